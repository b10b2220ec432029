"""Real bytes: a ~10M-parameter model trained under horovodrun in a private network namespace.

The synthetic benchmark of each framework (PyTorch's DistributedOptimizer,
TensorFlow's DistributedGradientTape in tf.function) runs two ranks in a
namespace whose /proc/net/dev counts every byte they exchange. Less Horovod's
own coordination traffic (measured by the benchmark while the job is idle,
about 0.5 MB/s), the counts must match the payload formula (the compressors'
own byte statistics) within 10%; the totals must be at least 6x (QSGD 4-bit)
and 20x (top-k 1%) below the uncompressed run's, which must be a ring
allreduce's worth.
"""
import json
import os
import sys

import pytest

from benchmarks import netlab
from tests import horovodrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARAMS = 9905640  # mlp10m in benchmarks/models_torch.py and benchmarks/models_tf.py
FRAMEWORKS = ["pytorch", "tensorflow"]


def run_benchmark(tmp_path, framework, *args):
    out = tmp_path / f"result-{len(list(tmp_path.iterdir()))}.json"
    with netlab.Namespace() as ns:
        proc = ns.run([*horovodrun.command(), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
                       f"benchmarks/{framework}_synthetic_benchmark.py", "--model", "mlp10m", "--batch-size", "8",
                       "--num-warmup-batches", "2", "--num-iters", "2", "--num-batches-per-iter", "2",
                       "--json-out", str(out), *args],
                      cwd=ROOT, capture_output=True, text=True, timeout=400,
                      env=dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["framework"] == framework and result["parameters"] == PARAMS, result
    return result


@pytest.fixture(scope="module", params=FRAMEWORKS)
def uncompressed(request, tmp_path_factory):
    reason = netlab.unavailable_reason()
    if reason:
        pytest.skip(reason)
    return run_benchmark(tmp_path_factory.mktemp("wire"), request.param, "--compression", "none")


def test_uncompressed_run_sends_a_ring_allreduce_worth(uncompressed):
    expected = 2 * 4 * PARAMS  # two ranks, ring allreduce: each sends its whole fp32 gradient once
    assert abs(uncompressed["wire_bytes_per_step"] - expected) <= 0.10 * expected, uncompressed


@pytest.mark.parametrize("args,min_reduction", [
    (("--compression", "qsgd", "--bits", "4"), 6.0),
    (("--compression", "topk", "--ratio", "0.01"), 20.0),
])
def test_compressed_bytes_match_formula_and_reduction(uncompressed, tmp_path, args, min_reduction):
    result = run_benchmark(tmp_path, uncompressed["framework"], *args)
    measured, formula = result["wire_bytes_per_step"], result["payload_bytes_per_step"]
    control = result["control_bytes_per_step"]
    assert formula > 0, result
    assert abs(measured - control - formula) <= 0.10 * formula, (measured, control, formula)
    reduction = uncompressed["wire_bytes_per_step"] / measured
    print(f"{result['framework']} {args}: {measured / 1e6:.3f} MB per step on the wire "
          f"({control / 1e6:.3f} MB of it Horovod's idle coordination), payload formula "
          f"{formula / 1e6:.3f} MB, {reduction:.1f}x fewer than uncompressed")
    assert reduction >= min_reduction, reduction
