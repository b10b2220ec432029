"""Real bytes, TensorFlow: a ~10M-parameter model trained under horovodrun in a private network namespace.

benchmarks/tensorflow_synthetic_benchmark.py runs hvd.DistributedGradientTape
in tf.function; the namespace's /proc/net/dev counts every byte the two ranks
exchange. The counts must match the payload formula (the compressors' own
byte statistics) within 10%, and be at least 6x (QSGD 4-bit) and 20x (top-k
1%) below the uncompressed run's, which must be a ring allreduce's worth.
"""
import json
import os
import subprocess
import sys

import pytest

from benchmarks import netlab

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PARAMS = 9905640  # benchmarks.models_tf mlp10m, equal to models_torch's


def run_benchmark(tmp_path, *args):
    out = tmp_path / f"result-{len(list(tmp_path.iterdir()))}.json"
    with netlab.Namespace() as ns:
        proc = ns.run([*netlab.HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
                       "benchmarks/tensorflow_synthetic_benchmark.py", "--model", "mlp10m", "--batch-size", "8",
                       "--num-warmup-batches", "2", "--num-iters", "2", "--num-batches-per-iter", "2",
                       "--json-out", str(out), *args],
                      cwd=ROOT, capture_output=True, text=True, timeout=400,
                      env=dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def uncompressed(tmp_path_factory):
    reason = netlab.unavailable_reason()
    if reason:
        pytest.skip(reason)
    return run_benchmark(tmp_path_factory.mktemp("tf-wire"), "--compression", "none")


def test_uncompressed_tensorflow_run_sends_a_ring_allreduce_worth(uncompressed):
    assert uncompressed["framework"] == "tensorflow" and uncompressed["parameters"] == PARAMS
    expected = 2 * 4 * PARAMS  # two ranks, ring allreduce: each sends its whole fp32 gradient once
    assert abs(uncompressed["wire_bytes_per_step"] - expected) <= 0.10 * expected, uncompressed


@pytest.mark.parametrize("args,min_reduction", [
    (("--compression", "qsgd", "--bits", "4"), 6.0),
    (("--compression", "topk", "--ratio", "0.01"), 20.0),
])
def test_tensorflow_compressed_bytes_match_formula_and_reduction(uncompressed, tmp_path, args, min_reduction):
    result = run_benchmark(tmp_path, *args)
    measured, formula = result["wire_bytes_per_step"], result["payload_bytes_per_step"]
    assert formula > 0, result
    assert abs(measured - formula) <= 0.10 * formula, (measured, formula)
    reduction = uncompressed["wire_bytes_per_step"] / measured
    print(f"{args}: {measured / 1e6:.3f} MB per step on the wire, formula {formula / 1e6:.3f} MB, "
          f"{reduction:.1f}x fewer than uncompressed")
    assert reduction >= min_reduction, reduction
