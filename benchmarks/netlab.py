"""A private network namespace with a shaped loopback: a real slow network on one machine.

Both ranks of a ``horovodrun -np 2`` job started inside the namespace talk over
its loopback, so ``tc`` shapes their traffic and the namespace's
``/proc/net/dev`` counts exactly their bytes. The loopback is one device: the
shaped rate is shared by both directions.
"""
import os
import shutil
import subprocess
import sys
import uuid

# horovodrun of this interpreter, whether or not its scripts directory is on PATH.
HOROVODRUN = [sys.executable, "-m", "horovod.runner.launch"]
# A token-bucket burst must exceed the MTU or every packet is dropped.
LOOPBACK_MTU = 9000
BURST = "256kb"


def unavailable_reason():
    """None when namespaces can be made here, else why not (for pytest.skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed (Debian package iproute2)"
    probe = f"hq-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"'ip netns add' failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


def bytes_sent(proc_net_dev):
    """{interface: bytes it sent} from the text of a ``/proc/net/dev``."""
    sent = {}
    for line in proc_net_dev.splitlines():
        name, _, counters = line.partition(":")
        if counters:
            sent[name.strip()] = int(counters.split()[8])  # transmit bytes
    return sent


def loopback_bytes():
    """Bytes sent on ``lo`` in the calling process's network namespace."""
    with open("/proc/net/dev") as f:
        sent = bytes_sent(f.read())
    if "lo" not in sent:
        raise RuntimeError("no 'lo' in /proc/net/dev")
    return sent["lo"]


class Namespace:
    """``with Namespace(rate="1gbit") as ns: ns.run([...])``; rate None leaves the loopback unshaped."""

    def __init__(self, rate=None, latency="20ms"):
        self.name = f"hq-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.rate, self.latency = rate, latency

    def _ip(self, *args):
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    def __enter__(self):
        self._ip("netns", "add", self.name)
        try:
            self._ip("-n", self.name, "link", "set", "lo", "up")
            if self.rate:
                self._ip("-n", self.name, "link", "set", "lo", "mtu", str(LOOPBACK_MTU))
                subprocess.run(["ip", "netns", "exec", self.name, "tc", "qdisc", "add", "dev", "lo", "root",
                                "tbf", "rate", self.rate, "burst", BURST, "latency", self.latency],
                               check=True, capture_output=True, text=True)
        except Exception:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        subprocess.run(["ip", "netns", "delete", self.name], capture_output=True)

    def command(self, argv):
        return ["ip", "netns", "exec", self.name, *argv]

    def run(self, argv, **kwargs):
        return subprocess.run(self.command(argv), **kwargs)


def run_horovod_job(job, rate, *, shaped, env, timeout, what):
    """Runs the ``horovodrun`` command line ``job`` and returns the finished process.

    ``shaped``: in a fresh namespace whose loopback is shaped to ``rate``
    ('none': unshaped); otherwise on the host loopback. Raises with the tail
    of the job's output, naming ``what``, if it fails.
    """
    if shaped:
        with Namespace(rate=None if rate == "none" else rate) as ns:
            proc = ns.run(job, capture_output=True, text=True, env=env, timeout=timeout)
    else:
        proc = subprocess.run(job, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def run_torchrun_benchmark(ranks, argv, json_out, what, rate="none", timeout=1800):
    """``torchrun --nproc_per_node ranks`` of the script command ``argv`` (its path and arguments) in a fresh
    namespace whose loopback is shaped to ``rate`` ('none': unshaped), one framework and kernel thread per
    rank, the repository on the path; returns the JSON its rank 0 wrote to ``json_out``, or raises with the
    tail of the job's output, naming ``what``."""
    import json
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    job = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr",
           "127.0.0.1", "--master_port", str(port)] + list(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", PYTHONPATH=root)
    run_horovod_job(job, rate, shaped=True, env=env, timeout=timeout, what=what)
    with open(json_out) as f:
        return json.load(f)


def control_bytes_per_second(barrier, seconds=1.0, counters=None):
    """Loopback bytes per second while the job is idle between two barriers.

    Horovod's background loop coordinates the ranks every cycle even when no
    tensor is pending (about 0.5 MB/s for two ranks with Gloo here). That
    traffic is Horovod's, not the compressors'; benchmarks measure it so the
    payload bytes can be told apart from it. ``counters``: a function giving
    other byte counters (a list) to take the idle rate of too; then the rates
    come back as (loopback, [others]).
    """
    import time
    barrier()
    start_bytes, start = loopback_bytes(), time.perf_counter()
    start_others = counters() if counters else None
    time.sleep(seconds)
    barrier()
    elapsed = time.perf_counter() - start
    rate = (loopback_bytes() - start_bytes) / elapsed
    if counters is None:
        return rate
    return rate, [(now - then) / elapsed for now, then in zip(counters(), start_others)]
