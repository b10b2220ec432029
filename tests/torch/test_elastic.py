"""Horovod Elastic with our compressors (horovod_qsgd/torch/elastic.py): a worker lost, a worker added.

Each job runs ``tests/harness_samples/elastic_worker.py`` under ``horovodrun
--gloo --min-np 2 --max-np 3`` with a host-discovery script: two slots on
``localhost`` and one on this machine's other address (Horovod runs both
locally, without ssh). The worker there kills itself with SIGKILL at step 4;
Horovod blacklists its host, the two others restore the last commit and go
on, and after the blacklist's cooldown a new worker joins.
"""
import collections
import glob
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests.multirank import WORKER_THREAD_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT = 240


def _second_host():
    """This machine's address other than the loopback: a second "host" that Horovod runs without ssh."""
    from horovod.runner.util import network
    others = sorted(a for a in network.get_local_host_addresses() if not a.startswith("127."))
    if not others:
        pytest.skip("this machine has no address besides the loopback: no second host for the elastic job")
    return others[0]


def run_elastic_job(tmp_path, **settings):
    """Runs the elastic job; returns (exit code, output, records by pid, accounting by pid)."""
    (tmp_path / "hosts").write_text(f"localhost:2\n{_second_host()}:1\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {tmp_path / 'hosts'}\n")
    discover.chmod(0o755)
    env = dict(os.environ, **WORKER_THREAD_ENV, PYTHONPATH=ROOT, **settings)
    cmd = [sys.executable, "-m", "horovod.runner.launch", "--gloo", "-np", "3", "--min-np", "2", "--max-np", "3",
           "--host-discovery-script", str(discover), "--blacklist-cooldown-range", "3", "4",
           sys.executable, os.path.join(ROOT, "tests", "harness_samples", "elastic_worker.py"), str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # horovodrun and the launchers of its workers
        output, _ = proc.communicate()
        pytest.fail(f"the elastic job did not finish in {TIMEOUT} s (a hang after a reset?)\n{output[-3000:]}",
                    pytrace=False)
    records = collections.defaultdict(list)
    for path in glob.glob(str(tmp_path / "*.jsonl")):
        for line in open(path):
            record = json.loads(line)
            records[record["pid"]].append(record)
    accounting = {int(os.path.basename(p).split(".")[0]): dict(np.load(p))
                  for p in glob.glob(str(tmp_path / "*.npz"))}
    return proc.returncode, output, records, accounting


def test_training_goes_on_through_a_lost_and_an_added_worker(tmp_path):
    # QSGD and top-k, each with exchange="auto" and "two_stage", in one job (tests/harness_samples/elastic_worker.py)
    code, output, records, accounting = run_elastic_job(tmp_path)
    assert code == 0, output[-4000:]
    steps = [r for rs in records.values() for r in rs if "step" in r]
    by_step = collections.defaultdict(list)
    for r in steps:
        by_step[r["step"]].append(r)
    sizes = [by_step[s][0]["size"] for s in sorted(by_step)]
    # every step once, by the whole world of its time: 3 ranks, then 2, then 3 again
    assert sorted(by_step) == list(range(len(by_step)))
    assert [len(by_step[s]) for s in sorted(by_step)] == sizes
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3, sizes
    assert sizes.index(2) == 4  # the worker died at step 4, which the others took again
    for s, rs in sorted(by_step.items()):
        assert len({r["digest"] for r in rs}) == 1, f"step {s}: parameters differ between ranks"
        # the step counters (random streams) agree, also on the worker that joined late
        assert all(r["steps"] == rs[0]["steps"] for r in rs), rs
        assert {n for counters in rs[0]["steps"].values() for n in counters.values()} == {s + 1}
    done = [r for rs in records.values() for r in rs if r.get("event") == "done"]
    assert sorted(r["rank"] for r in done) == [0, 1, 2]

    # Top-k's mass: what every process ever contributed == what the steps delivered + every residual, the
    # lost worker's (as of its last commit) included. Its share is what a lost worker takes with it.
    killed = [pid for pid, rs in records.items() if not any(r.get("event") == "done" for r in rs)]
    assert len(killed) == 1 and killed[0] in accounting
    for vector in ("topk_auto", "topk_two_stage"):
        contributed = sum(a[f"{vector}.contributed"] for a in accounting.values())
        delivered = sum(a[f"{vector}.received"] for a in accounting.values())
        residuals = sum(a[f"{vector}.residual"] for a in accounting.values())
        np.testing.assert_allclose(delivered + residuals, contributed, rtol=0, atol=2e-3, err_msg=vector)
        lost = np.linalg.norm(accounting[killed[0]][f"{vector}.residual"])
        assert lost > 0  # (the test would not see a lost owner-side residual otherwise)
        print(f"{vector}: lost with the worker |residual| = {lost:.1f} (one step's gradient: {np.sqrt(70_000):.1f})")


def test_a_worker_that_joins_with_other_settings_is_refused_on_every_rank(tmp_path):
    code, output, records, _ = run_elastic_job(tmp_path, ELASTIC_REJOIN_RATIO="0.1")
    assert code != 0
    after_join = [r for rs in records.values() for r in rs if r.get("size") == 3 and r.get("step", 0) > 4]
    assert after_join == [], "a step ran with mismatched settings"
    # every rank of the new world raises (horovodrun's output prefixes are slots, not ranks: count the messages)
    assert output.count("CompressionMismatchError: horovod_qsgd: ranks use different compression settings") == 3
    assert output.count("settings.ratio: rank 0=0.05, rank 1=0.05, rank 2=0.1") == 3, output[-4000:]


@pytest.mark.parametrize("kind", ["QSGD", "TopK", "RandomK"])
def test_in_an_elastic_job_a_compressor_outside_the_elastic_state_refuses_with_the_fix(monkeypatch, kind):
    import horovod.torch as hvd
    import torch

    import horovod_qsgd.torch as hq
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")  # what horovodrun sets in an elastic job's workers
    compressor = getattr(hq, kind)()
    with pytest.raises(RuntimeError, match=rf"the {kind} compressor is not part of its elastic state.*"
                                           r"hvd\.elastic\.TorchState\(model, optimizer, compression=compression\)"):
        compressor.compress(torch.zeros(10))
    hvd.elastic.TorchState(compression=compressor)
    with pytest.raises(RuntimeError, match="outside hvd.DistributedOptimizer"):  # past the check
        compressor.compress(torch.zeros(10))
