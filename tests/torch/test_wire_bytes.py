"""Real bytes: a ~10M-parameter model trained under horovodrun in a private network namespace.

The namespace's /proc/net/dev counts every byte the two ranks exchange. Less
Horovod's own coordination traffic (measured by the benchmark while the job
is idle, about 0.5 MB/s), those counts must match the payload formula (the
compressors' own byte statistics) within 10%; the total must be at least 6x
(QSGD 4-bit) and 20x (top-k 1%) below the uncompressed run's.
"""
import json
import os
import subprocess
import sys

import pytest

from benchmarks import netlab

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PARAMS = 9905640  # benchmarks.models_torch mlp10m


def _run(tmp_path, *args):
    out = tmp_path / f"result-{len(list(tmp_path.iterdir()))}.json"
    with netlab.Namespace() as ns:
        proc = ns.run([*netlab.HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
                       "benchmarks/pytorch_synthetic_benchmark.py", "--model", "mlp10m", "--batch-size", "8",
                       "--num-warmup-batches", "2", "--num-iters", "2", "--num-batches-per-iter", "2",
                       "--json-out", str(out), *args],
                      cwd=ROOT, capture_output=True, text=True, timeout=400,
                      env=dict(os.environ, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def uncompressed(tmp_path_factory):
    reason = netlab.unavailable_reason()
    if reason:
        pytest.skip(reason)
    return _run(tmp_path_factory.mktemp("wire"), "--compression", "none")


def test_uncompressed_run_sends_a_ring_allreduce_worth(uncompressed):
    # Two ranks, ring allreduce: each rank sends its whole fp32 gradient once.
    expected = 2 * 4 * PARAMS
    assert abs(uncompressed["wire_bytes_per_step"] - expected) <= 0.10 * expected, uncompressed


@pytest.mark.parametrize("args,min_reduction", [
    (("--compression", "qsgd", "--bits", "4"), 6.0),
    (("--compression", "topk", "--ratio", "0.01"), 20.0),
])
def test_compressed_bytes_match_formula_and_reduction(uncompressed, tmp_path, args, min_reduction):
    result = _run(tmp_path, *args)
    measured, formula = result["wire_bytes_per_step"], result["payload_bytes_per_step"]
    control = result["control_bytes_per_step"]  # Horovod's own coordination, measured while idle
    assert formula > 0, result
    assert abs(measured - control - formula) <= 0.10 * formula, (measured, control, formula)
    reduction = uncompressed["wire_bytes_per_step"] / measured
    print(f"{args}: {measured / 1e6:.3f} MB per step on the wire ({control / 1e6:.3f} MB of it Horovod's "
          f"idle coordination), payload formula {formula / 1e6:.3f} MB, "
          f"{reduction:.1f}x fewer than uncompressed")
    assert reduction >= min_reduction, reduction
