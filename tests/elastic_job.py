"""A Horovod Elastic job on one machine, for tests/torch/test_elastic.py and tests/tensorflow/test_elastic.py.

The job runs a worker of ``tests/harness_samples/`` under ``horovodrun --gloo
--min-np 2 --max-np 3`` with a host-discovery script: two slots on
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

from tests import horovodrun
from tests.multirank import WORKER_THREAD_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 240


def _second_host():
    """This machine's address other than the loopback: a second "host" that Horovod runs without ssh."""
    from horovod.runner.util import network
    others = sorted(a for a in network.get_local_host_addresses() if not a.startswith("127."))
    if not others:
        pytest.skip("this machine has no address besides the loopback: no second host for the elastic job")
    return others[0]


def run_elastic_job(tmp_path, worker, timeout=TIMEOUT, **settings):
    """Runs ``tests/harness_samples/<worker>`` elastically; returns (exit code, output, records by pid,
    accounting by pid)."""
    (tmp_path / "hosts").write_text(f"localhost:2\n{_second_host()}:1\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {tmp_path / 'hosts'}\n")
    discover.chmod(0o755)
    env = dict(os.environ, **WORKER_THREAD_ENV, PYTHONPATH=ROOT, **settings)
    cmd = horovodrun.command() + ["--gloo", "-np", "3", "--min-np", "2", "--max-np", "3",
                                  "--host-discovery-script", str(discover), "--blacklist-cooldown-range", "3", "4",
                                  sys.executable, os.path.join(ROOT, "tests", "harness_samples", worker),
                                  str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # horovodrun and the launchers of its workers
        output, _ = proc.communicate()
        pytest.fail(f"the elastic job did not finish in {timeout} s (a hang after a reset?)\n{output[-3000:]}",
                    pytrace=False)
    records = collections.defaultdict(list)
    for path in glob.glob(str(tmp_path / "*.jsonl")):
        for line in open(path):
            record = json.loads(line)
            records[record["pid"]].append(record)
    accounting = {int(os.path.basename(p).split(".")[0]): dict(np.load(p))
                  for p in glob.glob(str(tmp_path / "*.npz"))}
    return proc.returncode, output, records, accounting


def check_lost_and_added_worker(code, output, records, accounting, vectors):
    """What both frameworks' job must show: every step once by the world of its time (3, then 2 from the
    step the worker died at, then 3), parameters and step counters equal on every rank, and for each top-k
    vector: contributed == delivered + every residual, the lost worker's as of its last commit included."""
    assert code == 0, output[-4000:]
    steps = [r for rs in records.values() for r in rs if "step" in r]
    by_step = collections.defaultdict(list)
    for r in steps:
        by_step[r["step"]].append(r)
    sizes = [by_step[s][0]["size"] for s in sorted(by_step)]
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

    killed = [pid for pid, rs in records.items() if not any(r.get("event") == "done" for r in rs)]
    assert len(killed) == 1 and killed[0] in accounting
    for vector in vectors:
        contributed = sum(a[f"{vector}.contributed"] for a in accounting.values())
        delivered = sum(a[f"{vector}.received"] for a in accounting.values())
        residuals = sum(a[f"{vector}.residual"] for a in accounting.values())
        np.testing.assert_allclose(delivered + residuals, contributed, rtol=0, atol=2e-3, err_msg=vector)
        lost = np.linalg.norm(accounting[killed[0]][f"{vector}.residual"])
        assert lost > 0  # (the test would not see a lost owner-side residual otherwise)
        print(f"{vector}: lost with the worker |residual| = {lost:.1f} (one step's gradient: {np.sqrt(70_000):.1f})")
    return by_step


def check_refused_on_every_rank(code, output, records):
    """A worker that joins with top-k ratio 0.1 against 0.05: no step runs, every rank of the new world raises."""
    assert code != 0
    after_join = [r for rs in records.values() for r in rs if r.get("size") == 3 and r.get("step", 0) > 4]
    assert after_join == [], "a step ran with mismatched settings"
    # horovodrun's output prefixes are slots, not ranks: count the messages
    assert output.count("CompressionMismatchError: horovod_qsgd: ranks use different compression settings") == 3
    assert output.count("settings.ratio: rank 0=0.05, rank 1=0.05, rank 2=0.1") == 3, output[-4000:]
