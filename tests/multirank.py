"""Run ordinary pytest tests on several Horovod ranks under ``horovodrun --gloo`` (or under ``torchrun``).

A test marked ``@pytest.mark.ranks(2)`` is not called in the pytest process.
Instead ``horovodrun -np 2 -H localhost:2 --gloo`` starts two workers, each
running ``pytest <that test's node id>`` with ``HOROVOD_QSGD_RANK_WORKER=1``,
where the marker is ignored and the test body runs as usual on every rank.
Each worker writes its outcome to a report file; the parent test fails with
the traceback of every rank that failed. A job that does not finish within the
marker's ``timeout`` (seconds) is killed and fails as a hang, so a stuck
collective never hangs CI. ``launcher="torchrun"`` starts the workers with
``torchrun --nproc_per_node n`` instead (the DDP hooks' tests; fixture
``dist_gloo``); ``launcher="nodes:2x2"`` starts them on two network-namespace
"nodes" of two ranks each (``benchmarks/nodelab.py``; needs root, else the
test is skipped), ``"torchrun-nodes:2x2"`` likewise under torchrun.
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

WORKER_ENV = "HOROVOD_QSGD_RANK_WORKER"
REPORT_DIR_ENV = "HOROVOD_QSGD_RANK_REPORTS"
DEFAULT_TIMEOUT = 180
# Ports are picked by horovodrun; these keep oversubscribed CPU runs polite.
WORKER_THREAD_ENV = {"OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1",
                     "TF_NUM_INTEROP_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
                     "NUMBA_NUM_THREADS": "1"}


def in_worker():
    return os.environ.get(WORKER_ENV) == "1"


def init_with_process_sets(hvd, *process_sets, timeout=60.0):
    """``hvd.init(process_sets=...)``, then waits until every set is registered on this rank.

    Even static sets can be registered after ``init()`` returns: under heavy load (CI beside a 4-rank job
    on 2 cores) Horovod's own ``size()`` query inside the TF tape raised "Process set does not exist".
    """
    hvd.init(process_sets=list(process_sets))
    deadline = time.monotonic() + timeout
    for process_set in process_sets:
        while True:
            try:
                process_set.included()
                break
            except ValueError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def _rank_reports(report_dir, num_ranks):
    reports = {}
    for rank in range(num_ranks):
        path = os.path.join(report_dir, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                reports[rank] = json.load(f)
    return reports


def _free_port():
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch_command(launcher, num_ranks, timeout):
    """The command that starts ``num_ranks`` workers: Horovod's ``horovodrun --gloo``, ``torchrun``, or
    ``benchmarks/nodelab.py`` with either across network namespaces ("nodes:MxL", "torchrun-nodes:MxL")."""
    if ":" in launcher:
        kind, layout = launcher.split(":")
        nodes, per_node = (int(x) for x in layout.split("x"))
        if kind not in ("nodes", "torchrun-nodes") or nodes * per_node != num_ranks:
            raise ValueError(f"launcher={launcher!r} for {num_ranks} ranks: use 'nodes:MxL' or "
                             "'torchrun-nodes:MxL' with M x L == the ranks")
        from benchmarks import netlab
        reason = netlab.unavailable_reason()
        if reason:
            pytest.skip(reason)
        # nodelab's own deadline comes first: it removes its namespaces before the job is killed
        return [sys.executable, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                             "benchmarks", "nodelab.py"),
                "--nodes", str(nodes), "--per-node", str(per_node), "--timeout", str(max(10, timeout - 15)),
                "--launcher", "torchrun" if kind == "torchrun-nodes" else "horovodrun", "--"]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(num_ranks),
                "--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    if launcher != "horovodrun":
        raise ValueError(f"launcher={launcher!r}: use 'horovodrun', 'torchrun' or 'nodes:MxL'")
    return [sys.executable, "-m", "horovod.runner.launch", "-np", str(num_ranks), "-H", f"localhost:{num_ranks}",
            "--gloo"]


def run_on_ranks(nodeid, rootdir, num_ranks, timeout, extra_env=None, launcher="horovodrun"):
    """Runs one test node on ``num_ranks`` ranks; calls pytest.fail on any rank failure or a hang."""
    report_dir = tempfile.mkdtemp(prefix="hq-ranks-")
    env = dict(os.environ, **WORKER_THREAD_ENV)
    for key, value in (extra_env or {}).items():  # None removes a variable
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    env[WORKER_ENV] = "1"
    env[REPORT_DIR_ENV] = report_dir
    env["PYTHONPATH"] = os.pathsep.join(p for p in [rootdir, env.get("PYTHONPATH")] if p)
    cmd = _launch_command(launcher, num_ranks, timeout) + (
        [] if launcher == "torchrun" else [sys.executable]) + [
        "-m", "pytest", "-q", "-p", "no:cacheprovider", "--no-header", "-rN", nodeid]
    log_path = os.path.join(report_dir, "horovodrun.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=rootdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
            hung = False
        except subprocess.TimeoutExpired:
            hung = True
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with open(log_path) as f:
        output = f.read()
    reports = _rank_reports(report_dir, num_ranks)

    failures = [f"--- rank {rank} failed ---\n{rep['longrepr']}"
                for rank, rep in sorted(reports.items()) if rep["outcome"] == "failed"]
    if hung:
        finished = sorted(reports)
        pytest.fail(f"timed out after {timeout} s on {num_ranks} ranks (a hung collective?); "
                    f"ranks that finished: {finished or 'none'}\n" + "\n".join(failures)
                    + f"\n--- horovodrun output (tail) ---\n{output[-3000:]}", pytrace=False)
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)
    skipped = [rep for rep in reports.values() if rep["outcome"] == "skipped"]
    if len(skipped) == num_ranks:
        pytest.skip(skipped[0]["longrepr"])
    missing = [r for r in range(num_ranks) if r not in reports]
    if proc.returncode != 0 or missing:
        pytest.fail(f"horovodrun exited with {proc.returncode}; ranks without a report: {missing}\n"
                    f"--- horovodrun output (tail) ---\n{output[-3000:]}", pytrace=False)


# ---- pytest hooks, registered from tests/conftest.py ----

def pytest_configure(config):
    config.addinivalue_line(
        "markers", "ranks(n, timeout=180, env=None, launcher='horovodrun'): run the test on n ranks under "
        "horovodrun --gloo, or torchrun with launcher='torchrun', or on M network-namespace nodes of L ranks "
        "with launcher='nodes:MxL' (Horovod) or 'torchrun-nodes:MxL' (env: extra variables; a None value "
        "removes one)")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    marker = pyfuncitem.get_closest_marker("ranks")
    if marker is None or in_worker():
        return None
    num_ranks = marker.args[0] if marker.args else marker.kwargs["n"]
    run_on_ranks(pyfuncitem.nodeid, str(pyfuncitem.config.rootpath), num_ranks,
                 marker.kwargs.get("timeout", DEFAULT_TIMEOUT), marker.kwargs.get("env"),
                 marker.kwargs.get("launcher", "horovodrun"))
    return True


def pytest_runtest_logreport(report):
    if not in_worker() or (report.when != "call" and report.outcome == "passed"):
        return
    rank = os.environ.get("HOROVOD_RANK", os.environ.get("RANK", "unknown"))  # horovodrun, torchrun
    if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
        longrepr = report.longrepr[2]
    else:
        longrepr = str(report.longrepr) if report.longrepr else ""
    path = os.path.join(os.environ[REPORT_DIR_ENV], f"rank{rank}.json")
    # A failing teardown must not hide a failing call: keep the first failure.
    if os.path.exists(path):
        with open(path) as f:
            if json.load(f)["outcome"] == "failed":
                return
    with open(path, "w") as f:
        json.dump({"outcome": report.outcome, "when": report.when, "longrepr": longrepr}, f)
