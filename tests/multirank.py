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

A launch costs seconds (horovodrun, one interpreter per rank, the imports):
in a module that sets ``SHARED_LAUNCHES = True`` the tests with the same
rank count, ``env`` and launcher run one after another in one launch and
are judged one by one from their own reports (``alone=True`` in a marker
keeps a test to itself: its own ``hvd.init`` arguments, a job it breaks).
"""
import hashlib
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
# HOROVOD_CYCLE_TIME: Horovod's coordination round every 1 ms (its default) costs each idle rank about a
# quarter of a core in system calls (3 ranks sleeping: 1.5-2.0 s of CPU each per 8 s), taken from the ranks
# that compute on the 2-core machine; at 5 ms, 0.4-0.6 s. TensorFlow's two-stage module: 232 s -> 187 s. A
# test that needs another cycle sets it in its marker's env.
WORKER_THREAD_ENV = {"OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1",
                     "TF_NUM_INTEROP_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
                     "NUMBA_NUM_THREADS": "1", "HOROVOD_CYCLE_TIME": "5"}
POLL_INTERVAL_S = 1e-4
# A test in a worker fails as hung after its marker's timeout, at least this long (pytest.ini's 1200 s is the
# parent's): in a launch shared by 50 tests a hang must not cost 1200 s per test that follows it.
WORKER_TEST_TIMEOUT_MIN_S = 300
HUNG_FILE = "hung.rank{rank}.txt"  # a worker's note of the test after whose hang it stopped


def wait_politely():
    """Makes this process's ``horovod.torch`` wait for a collective by polling it every 0.1 ms, not spinning.

    Horovod 0.28.1's PyTorch ``synchronize`` spins on ``std::this_thread::yield()`` until the handle is done: a
    waiting rank takes a whole core (5.0 s waited: 6.0 s of CPU), and with 3-4 ranks on the 2-core machine it
    takes it from the ranks still computing. What the collective computes does not change; only how the rank
    waits (about 0.1 ms later at most, against Horovod's 5 ms cycle). SwarmSGD's multi-rank module: 147 s -> 124 s.
    Does nothing where horovod.torch is not imported; the workers call it after every test's fixtures."""
    mpi_ops = sys.modules.get("horovod.torch.mpi_ops")
    lib = getattr(mpi_ops, "mpi_lib", None)
    if lib is None or getattr(lib, "horovod_qsgd_waits_politely", False):
        return
    wait_and_clear, poll = lib.horovod_torch_wait_and_clear, lib.horovod_torch_poll

    def polling_wait_and_clear(handle):
        while not poll(handle):
            time.sleep(POLL_INTERVAL_S)
        return wait_and_clear(handle)  # done: returns at once, and raises the collective's error if any
    lib.horovod_torch_wait_and_clear = polling_wait_and_clear
    lib.horovod_qsgd_waits_politely = True


def in_worker():
    return os.environ.get(WORKER_ENV) == "1"


def _worker_rank():
    return os.environ.get("HOROVOD_RANK", os.environ.get("RANK", "unknown"))  # horovodrun, torchrun


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


def _report_name(nodeid, rank):
    return f"{hashlib.sha1(nodeid.encode()).hexdigest()[:16]}.rank{rank}.json"


def _rank_reports(report_dir, num_ranks, nodeid):
    reports = {}
    for rank in range(num_ranks):
        path = os.path.join(report_dir, _report_name(nodeid, rank))
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
    from tests import horovodrun
    return horovodrun.command() + ["-np", str(num_ranks), "-H", f"localhost:{num_ranks}", "--gloo"]


class _Launch:
    """What one launch of some test nodes on ``num_ranks`` ranks left: every rank's report per node, the output."""

    def __init__(self, nodeids, rootdir, num_ranks, timeout, extra_env=None, launcher="horovodrun"):
        self.num_ranks, self.timeout, self.nodeids = num_ranks, timeout, nodeids
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
            "-m", "pytest", "-q", "-p", "no:cacheprovider", "--no-header", "-rN"] + list(nodeids)
        log_path = os.path.join(report_dir, "horovodrun.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=rootdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                proc.wait(timeout=timeout)
                self.hung = False
            except subprocess.TimeoutExpired:
                self.hung = True
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        with open(log_path) as f:
            self.output = f.read()
        self.returncode = proc.returncode
        self.reports = {nodeid: _rank_reports(report_dir, num_ranks, nodeid) for nodeid in nodeids}
        self.stopped_after = {}  # rank -> the test after whose hang that rank's worker stopped
        for rank in range(num_ranks):
            path = os.path.join(report_dir, HUNG_FILE.format(rank=rank))
            if os.path.exists(path):
                with open(path) as f:
                    self.stopped_after[rank] = f.read()

    def _stopped_after_text(self):
        return "; ".join(f"rank {rank}: {nodeid}" for rank, nodeid in sorted(self.stopped_after.items()))

    def judge(self, nodeid):
        """Calls pytest.fail (or skip) for ``nodeid`` as its ranks reported; returns if every rank passed."""
        num_ranks, reports = self.num_ranks, self.reports[nodeid]
        shared = "" if len(self.nodeids) == 1 else f" (a launch shared by {len(self.nodeids)} tests)"
        failures = [f"--- rank {rank} failed ---\n{rep['longrepr']}"
                    for rank, rep in sorted(reports.items()) if rep["outcome"] == "failed"]
        missing = [r for r in range(num_ranks) if r not in reports]
        if self.hung and missing:
            pytest.fail(f"timed out after {self.timeout} s on {num_ranks} ranks{shared} (a hung collective?); "
                        f"ranks that finished: {sorted(reports) or 'none'}\n" + "\n".join(failures)
                        + f"\n--- horovodrun output (tail) ---\n{self.output[-3000:]}", pytrace=False)
        if failures:
            pytest.fail("\n".join(failures), pytrace=False)
        skipped = [rep for rep in reports.values() if rep["outcome"] == "skipped"]
        if len(skipped) == num_ranks:
            pytest.skip(skipped[0]["longrepr"])
        if missing and self.stopped_after and nodeid not in self.stopped_after.values():
            pytest.fail(f"not run on ranks {missing}: the launch{shared} stopped after a test hung there "
                        f"({self._stopped_after_text()}), which leaves the ranks' collectives out of step",
                        pytrace=False)
        if missing or (self.returncode != 0 and len(self.nodeids) == 1):
            pytest.fail(f"horovodrun exited with {self.returncode}{shared}; ranks without a report: {missing}\n"
                        f"--- horovodrun output (tail) ---\n{self.output[-3000:]}", pytrace=False)


# ---- pytest hooks, registered from tests/conftest.py ----

def pytest_configure(config):
    config.addinivalue_line(
        "markers", "ranks(n, timeout=180, env=None, launcher='horovodrun', alone=False): run the test on n ranks "
        "under horovodrun --gloo, or torchrun with launcher='torchrun', or on M network-namespace nodes of L "
        "ranks with launcher='nodes:MxL' (Horovod) or 'torchrun-nodes:MxL' (env: extra variables; a None value "
        "removes one). In a module with SHARED_LAUNCHES = True (or a group name, shared with the group's "
        "modules), tests with the same n, env and launcher share one launch unless alone=True")


def _shared_launch_key(item, marker):
    """Tests of a module that sets ``SHARED_LAUNCHES = True`` share one launch per (ranks, timeout-free marker
    arguments): the workers run them one after another, saving a launch (horovodrun, interpreters, imports)
    each. ``SHARED_LAUNCHES = "<group>"`` shares them with every module of that group (modules whose tests
    leave nothing behind that another module's could trip on). ``ranks(..., alone=True)`` keeps a test to
    itself (its own hvd.init arguments, a job it breaks)."""
    shared = getattr(item.module, "SHARED_LAUNCHES", False)
    if not shared or marker.kwargs.get("alone"):
        return None
    env = marker.kwargs.get("env") or {}
    return (shared if isinstance(shared, str) else item.module.__name__, _ranks_of(marker),
            tuple(sorted(env.items())), marker.kwargs.get("launcher", "horovodrun"))


def _ranks_of(marker):
    return marker.args[0] if marker.args else marker.kwargs["n"]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    if in_worker():
        for item in items:
            marker = item.get_closest_marker("ranks")
            if marker is not None and item.get_closest_marker("timeout") is None:
                limit = max(marker.kwargs.get("timeout", DEFAULT_TIMEOUT), WORKER_TEST_TIMEOUT_MIN_S)
                item.add_marker(pytest.mark.timeout(limit))
        return
    groups = {}
    for item in items:  # what is left to run, after -k and deselection
        marker = item.get_closest_marker("ranks")
        key = None if marker is None else _shared_launch_key(item, marker)
        if key is not None:
            groups.setdefault(key, []).append(item)
    for members in groups.values():
        for item in members:
            item.shared_launch = members


_launches = {}  # id of a shared group's first item -> its _Launch


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    marker = pyfuncitem.get_closest_marker("ranks")
    if marker is None or in_worker():
        return None
    num_ranks, rootdir = _ranks_of(marker), str(pyfuncitem.config.rootpath)
    env, launcher = marker.kwargs.get("env"), marker.kwargs.get("launcher", "horovodrun")
    members = getattr(pyfuncitem, "shared_launch", [pyfuncitem])
    launch = _launches.get(id(members[0]))
    if launch is None:
        timeout = sum(m.get_closest_marker("ranks").kwargs.get("timeout", DEFAULT_TIMEOUT) for m in members)
        launch = _Launch([m.nodeid for m in members], rootdir, num_ranks, timeout, env, launcher)
        if len(members) > 1:
            _launches[id(members[0])] = launch
    launch.judge(pyfuncitem.nodeid)
    return True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield
    if in_worker():
        wait_politely()  # after the fixtures: horovod.torch imported by hvd_torch or by an earlier test's body


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In a worker, a test that hung (pytest-timeout) ends the worker's session: its peers may still wait in
    that test's collectives, and every later test of the launch would start out of step with them and hang
    too. The parent fails the tests not run, naming the test that hung."""
    outcome = yield
    report = outcome.get_result()
    if in_worker() and report.when == "call" and report.failed and "from pytest-timeout" in str(report.longrepr):
        with open(os.path.join(os.environ[REPORT_DIR_ENV], HUNG_FILE.format(rank=_worker_rank())), "w") as f:
            f.write(item.nodeid)
        item.session.shouldstop = f"{item.nodeid} hung"


def pytest_runtest_logreport(report):
    if not in_worker() or (report.when != "call" and report.outcome == "passed"):
        return
    rank = _worker_rank()
    if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
        longrepr = report.longrepr[2]
    else:
        longrepr = str(report.longrepr) if report.longrepr else ""
    path = os.path.join(os.environ[REPORT_DIR_ENV], _report_name(report.nodeid, rank))
    # A failing teardown must not hide a failing call: keep the first failure.
    if os.path.exists(path):
        with open(path) as f:
            if json.load(f)["outcome"] == "failed":
                return
    with open(path, "w") as f:
        json.dump({"outcome": report.outcome, "when": report.when, "longrepr": longrepr}, f)
