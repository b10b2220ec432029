"""The lattice codec's CUDA path in numba's CUDA simulator gives the CPU's bytes.

Started by test_lattice_codec.py in a subprocess with NUMBA_ENABLE_CUDASIM=1
(set before numba is imported).  Prints OK and exits 0 when payloads,
decoded values and failure counts are identical; exits 1 otherwise.
"""

import os
import sys
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", "run with NUMBA_ENABLE_CUDASIM=1"
warnings.simplefilter("ignore", RuntimeWarning)  # uint64 wraparound in the simulated hash

from numba import cuda  # noqa: E402

from horovod_qsgd.codecs.lattice import ExactCodec, LatticeCodec  # noqa: E402

failures = []


def check(name, ok):
    if not ok:
        failures.append(name)
        print("MISMATCH", name, flush=True)


def same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def run_case(name, codec, x, y, eps, step, key):
    m = codec.max_payload_nbytes(x.size)
    cpu = np.full(m, 0xA5, np.uint8)
    n_cpu = codec.encode(x, cpu, eps=eps, step=step, key=key)
    d_buf = cuda.to_device(np.full(m, 0x5A, np.uint8))
    n_gpu = codec.encode(cuda.to_device(x), d_buf, eps=eps, step=step, key=key)
    gpu = d_buf.copy_to_host()
    check(f"{name}: payload CUDA == CPU", n_cpu == n_gpu and same(cpu[:n_cpu], gpu[:n_gpu]))
    nb = -(-x.size // codec.bucket_size)
    out_cpu, mask_cpu = np.zeros(x.size, np.float32), np.full(nb, 7, np.uint8)
    bad_cpu = codec.decode(cpu[:n_cpu], y, out_cpu, bad=mask_cpu)
    d_out, d_mask = cuda.to_device(np.zeros(x.size, np.float32)), cuda.to_device(np.full(nb, 9, np.uint8))
    bad_gpu = codec.decode(d_buf[:n_gpu], cuda.to_device(y), d_out, bad=d_mask)
    check(f"{name}: failed buckets CUDA == CPU ({bad_gpu} vs {bad_cpu})",
          bad_cpu == bad_gpu and same(mask_cpu, d_mask.copy_to_host()))
    # the same arithmetic on both: equal values even in failed buckets (NaN where y/eps is out of range)
    check(f"{name}: decoded CUDA == CPU", same(out_cpu, d_out.copy_to_host()))
    return bad_cpu


def main():
    rng = np.random.default_rng(7)
    n = 1000  # not a multiple of the bucket or of 8
    x = rng.standard_normal(n).astype(np.float32)
    y = (x + rng.uniform(-0.01, 0.01, n)).astype(np.float32)
    for bits in (8, 5, 3):
        codec = LatticeCodec(bits=bits, bucket_size=64, seed=3)
        eps = codec.eps_for_spread(0.01)
        check(f"bits={bits}: decodes", run_case(f"bits={bits}", codec, x, y, eps, 4, 11) == 0)
    # too far apart in two buckets: both paths flag exactly those
    codec = LatticeCodec(bits=8, bucket_size=64)
    y_far = y.copy()
    y_far[[3, 700]] += 5.0
    check("far: two failed buckets",
          run_case("far", codec, x, y_far, codec.eps_for_spread(0.01), 0, 1) == 2)
    # one coordinate per bucket of 8 swept across the decoding boundary (+-(q/2 + 3) eps)
    codec = LatticeCodec(bits=4, bucket_size=8)
    eps = 2.0 ** -8
    k = 200
    xs = rng.uniform(-1, 1, 8 * k).astype(np.float32)
    ys = xs.copy()
    ys[::8] = (xs[::8] + np.linspace(-11 * eps, 11 * eps, k)).astype(np.float32)
    ys[9] = np.nan
    failed = run_case("boundary sweep", codec, xs, ys, eps, 2, 5)
    check(f"boundary sweep: some but not all buckets fail ({failed} of {k})", 0 < failed < k)
    # negative lattice points with large magnitude (|x/eps| ~ 2**30)
    big = (rng.standard_normal(200) * 1000).astype(np.float32)
    run_case("large |x/eps|", codec, big, big, 1e-6, 9, 2)
    e = ExactCodec()
    buf = cuda.to_device(np.zeros(e.max_payload_nbytes(n), np.uint8))
    e.encode(cuda.to_device(x), buf)
    out = cuda.to_device(np.zeros(n, np.float32))
    e.decode(buf, None, out)
    check("exact codec CUDA round trip", same(out.copy_to_host(), x))
    if failures:
        print(f"{len(failures)} mismatches")
        return 1
    print("OK: lattice codec CUDA simulator == CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
