"""Run the CUDA code paths and compare them with the CPU, byte for byte.

In CI, test_kernel_cudasim.py starts it in a subprocess with
NUMBA_ENABLE_CUDASIM=1 (set before numba is imported): numba's CUDA
simulator runs the kernels as Python, so only the small cases are run.  On a
machine with a CUDA GPU, run it directly (``python scripts/cuda_check.py``):
the real kernels then also take tensors of a million elements and more,
which cover multi-block launches, the sampled exact top-k path and the
refinements of the approximate selectors at scale.

Exits 0 when every CUDA payload, residual and decoded output is
bit-identical to the CPU path and to the checked-in test vectors; prints the
mismatches and exits 1 otherwise.
"""

import os
import sys
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
warnings.simplefilter("ignore", RuntimeWarning)  # uint64 wraparound in the simulated hash

from numba import cuda  # noqa: E402

from horovod_qsgd import kernels as K  # noqa: E402
from horovod_qsgd.kernels import CarriedResidual  # noqa: E402
from horovod_qsgd.codecs import QSGDCodec, RandomKCodec, TopKCodec  # noqa: E402
from horovod_qsgd.common.engine import PayloadEngine  # noqa: E402
from horovod_qsgd.common.exchange import decode_checked  # noqa: E402
from horovod_qsgd.common.fusion import FusedTwoStage  # noqa: E402
from horovod_qsgd.common.stats import CompressionStats  # noqa: E402
from horovod_qsgd.common.two_stage import TwoStage  # noqa: E402
from horovod_qsgd.testdata import load_vectors, make_codec  # noqa: E402

failures = []
nan_bits_only = []
NAN_BITS = "NaN bits"   # what same() returns where the only differences are the bits of NaNs


def same(a, b):
    """True where the bytes are equal; NAN_BITS where they differ only inside words that are NaN on both sides.

    A NaN's bits are the hardware's: x86 keeps an operand NaN's bits through an add and makes inf - inf
    0xffc00000, an NVIDIA GPU gives 0x7fffffff for both (seen on an H200). Values are equal either way."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return False
    a8, b8 = a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)
    differ = np.flatnonzero(a8 != b8)
    if differ.size == 0:
        return True
    for width, ftype in ((4, np.float32), (2, np.float16)):
        whole = a8.size - a8.size % width
        if differ[-1] >= whole:
            continue
        words = np.unique(differ // width)
        if (np.isnan(a8[:whole].view(ftype)[words]).all() and np.isnan(b8[:whole].view(ftype)[words]).all()):
            return NAN_BITS
    return False


def check(name, ok):
    if ok is NAN_BITS:
        nan_bits_only.append(name)
        print("NaN bits differ (values equal)", name, flush=True)
    elif not ok:
        failures.append(name)
        print("MISMATCH", name, flush=True)


def run_case(name, codec, x, step, key, residual, want_payload=None, want_residual=None):
    m = codec.max_payload_nbytes(x.size)
    # CPU
    b_cpu = np.zeros(m, np.uint8)
    r_cpu = None if residual is None else residual.copy()
    n_cpu = codec.encode(x, b_cpu, step=step, key=key, residual=r_cpu)
    # CUDA (simulated)
    d_out = cuda.to_device(np.zeros(m, np.uint8))
    d_res = None if residual is None else cuda.to_device(residual.copy())
    n_gpu = codec.encode(cuda.to_device(x), d_out, step=step, key=key, residual=d_res)
    b_gpu = d_out.copy_to_host()
    check(f"{name}: payload CUDA == CPU", n_cpu == n_gpu and same(b_cpu[:n_cpu], b_gpu[:n_gpu]))
    if want_payload is not None:
        check(f"{name}: payload CUDA == test vector", same(b_gpu[:n_gpu], want_payload))
    if residual is not None:
        check(f"{name}: residual CUDA == CPU", same(r_cpu, d_res.copy_to_host()))
        if want_residual is not None:
            check(f"{name}: residual CUDA == test vector", same(d_res.copy_to_host(), want_residual))
    o_cpu = np.full(x.size, 0.25, np.float32)
    codec.decode_accumulate(b_cpu[:n_cpu], o_cpu)
    d_o = cuda.to_device(np.full(x.size, 0.25, np.float32))
    codec.decode_accumulate(d_out[:n_gpu], d_o)
    check(f"{name}: decode CUDA == CPU", same(o_cpu, d_o.copy_to_host()))


def main():
    if not SIMULATED and not cuda.is_available():
        print("no CUDA GPU here: run on a machine with one, or with NUMBA_ENABLE_CUDASIM=1 for the simulator")
        return 2
    cases = load_vectors()
    for c in cases:
        run_case(c["name"], make_codec(c["codec"], c["config"]), c["x"], c["step"], c["key"], c["residual"],
                 c["payload"], c["residual_out"])
    rng = np.random.default_rng(0)
    # exact top-k with ties and a NaN, on the CUDA selection path
    x = (rng.integers(0, 4, 700) * rng.choice([-1, 1], 700)).astype(np.float32)
    x[123] = np.nan
    run_case("topk_exact_ties", TopKCodec(ratio=0.05, error_feedback=False), x, 0, 0, None)
    run_case("topk_gaussian_ef_fp16", TopKCodec(ratio=0.05, selector="gaussian", value_dtype="float16"),
             rng.standard_normal(900).astype(np.float32), 3, 4, rng.standard_normal(900).astype(np.float32))
    # the approximate selectors' refinements: a heavy tail moves Gaussian-k's first threshold out of the
    # band; ties leave no threshold in it (the closest count is used)
    heavy = rng.standard_cauchy(900).astype(np.float32)
    run_case("topk_gaussian_refined", TopKCodec(ratio=0.05, selector="gaussian", error_feedback=False), heavy, 1, 2,
             None)
    ties = np.nan_to_num(x)
    run_case("topk_gaussian_ties_no_band", TopKCodec(ratio=0.05, selector="gaussian", error_feedback=False),
             ties, 1, 2, None)
    run_case("topk_sample_ef", TopKCodec(ratio=0.05, selector="sample"), heavy, 7, 8,
             rng.standard_normal(900).astype(np.float32))
    # not finite: Gaussian-k's moments and the sampled threshold fall back to the exact select
    run_case("topk_gaussian_nan_exact", TopKCodec(ratio=0.05, selector="gaussian"), x, 1, 2, np.zeros(700, np.float32))
    inf = heavy.copy()
    inf[::10] = np.inf
    run_case("topk_sample_inf_exact", TopKCodec(ratio=0.05, selector="sample", value_dtype="float16"), inf, 3, 4,
             np.zeros(900, np.float32))
    # exact top-k on the sampled-candidate path (n > 4 * sample size), and where the bound lets through
    # more than a quarter of the entries (all equal) and the select runs over all of them
    n = 20_000
    run_case("topk_exact_sampled_ef_fp16", TopKCodec(ratio=0.05, value_dtype="float16"),
             rng.standard_normal(n).astype(np.float32), 5, 6, rng.standard_normal(n).astype(np.float32))
    run_case("topk_exact_sampled_all_equal", TopKCodec(ratio=0.05), np.full(n, 0.5, np.float32), 5, 6,
             np.zeros(n, np.float32))
    # kernel-level: random-k indices, fp16 widening
    base = K.stream_base(1, 2, 3, K.PURPOSE_RANDOMK)
    check("randomk indices CUDA == CPU",
          same(K.randomk_indices(1000, 37, base), K.randomk_indices(1000, 37, base, gpu=True).copy_to_host()))
    h = rng.standard_normal(300).astype(np.float16).view(np.uint16)
    payload_bytes = rng.integers(0, 256, 20_000).astype(np.uint8)
    offsets = list(rng.integers(0, payload_bytes.size - 16, K.bytes.OFFSETS_PER_LAUNCH + 72))
    check("gather_bytes of more offsets than one launch's arguments CUDA == CPU",
          same(K.gather_bytes(payload_bytes, offsets, 16), K.gather_bytes(cuda.to_device(payload_bytes), offsets, 16)))
    check("widen_f16 CUDA == CPU", same(K.widen_f16(h), K.widen_f16(cuda.to_device(h)).copy_to_host()))
    total = len(cases) + 10 + run_elias_exchange_cases(rng) + run_exchange_decode_cases(rng)
    total += run_fused_decode_cases(rng) + run_engine_encode_cases(rng) + run_settled_step_cases(rng)
    total += run_encode_many_cases(rng) + run_topk_encode_many_cases(rng)
    if not SIMULATED:
        total += run_large_cases(rng)
    if failures:
        print(f"{len(failures)} mismatches")
        return 1
    where = "CUDA-simulator" if SIMULATED else f"CUDA ({cuda.get_current_device().name})"
    print(f"OK: {total} {where} checks bit-identical to the CPU path and the test vectors"
          + (f" ({len(nan_bits_only)} of them up to the bits of NaNs)" if nan_bits_only else ""))
    return 0


def _decode_all(codec, buf, numel, ranks, device):
    """(decoded rows' bytes or None, the error's type and message or None) of decode_checked."""
    outs = [np.full(numel, 0.25, np.float32) for _ in range(ranks)]
    if device:
        buf, outs = cuda.to_device(buf), [cuda.to_device(o) for o in outs]
    try:
        decode_checked(codec, buf, range(ranks), [numel] * ranks, outs, "w")
    except Exception as exc:  # compared between CPU and CUDA: the same type and message
        return None, f"{type(exc).__name__}: {exc}"
    return [(o.copy_to_host() if device else o).tobytes() for o in outs], None


def _rank_payloads(codec, rng, numel, ranks):
    """One payload per rank (step 5, key = the rank) of a standard normal gradient each."""
    parts = []
    for r in range(ranks):
        out = np.zeros(codec.max_payload_nbytes(numel), np.uint8)
        parts.append(out[:codec.encode(rng.standard_normal(numel).astype(np.float32), out, step=5, key=r)])
    return parts


def _check_exchange_decode(label, codec, buf, numel, ranks, intact):
    """The exchange's decode of ``buf`` on CUDA gives the CPU's sums or error; it raises unless ``intact``."""
    cpu, gpu = _decode_all(codec, buf, numel, ranks, False), _decode_all(codec, buf, numel, ranks, True)
    check(f"{label}: CUDA == CPU ({cpu[1]} / {gpu[1]})", cpu == gpu)
    check(f"{label}: raises", (cpu[1] is None) == intact)


def run_elias_exchange_cases(rng, numel=1000, ranks=3):
    """Elias payloads on a GPU decode where the device finds them (the header chain) and are checked
    after: sums and error messages equal the CPU's, which walks the headers first."""
    count = 0
    for codec in [QSGDCodec(bits=4, encoding="elias"),
                  QSGDCodec(bits=3, bucket_size=300, norm="l2", scale_dtype="float16", encoding="elias")]:
        parts = _rank_payloads(codec, rng, numel, ranks)
        whole = np.concatenate(parts)
        second = parts[0].size
        damaged = {"whole": whole, "cut": whole[:-8], "stream": whole.copy(),
                   # payload 1 cut to 24 bytes and saying so: the chain adds up, its stream is missing
                   "truncated": np.concatenate([parts[0], parts[1][:24], parts[2]])}
        damaged["stream"][-30:-4] ^= 0x5A
        for name, at, value in [("not advancing", 12, 4), ("wrong length", second + 12, 20),
                                ("numel", 4, numel - 1), ("truncated", second + 12, 24)]:
            damaged[name] = damaged.get(name, whole).copy()
            damaged[name][at:at + 4] = np.frombuffer(np.uint32(value).tobytes(), np.uint8)
        for name, buf in damaged.items():
            _check_exchange_decode(f"elias exchange {codec.scale_dtype} {name}", codec, buf, numel, ranks,
                                   intact=name == "whole")
            count += 1
    return count


def run_exchange_decode_cases(rng, numel=1000, ranks=3):
    """What the adapters decode on a GPU besides single payloads: fixed-size payloads of several ranks
    checked from their headers read in one copy (QSGD, Top-k), and random-k's allreduced values
    scattered into place. Sums and error messages equal the CPU's."""
    count = 0
    for codec in [QSGDCodec(bits=4), TopKCodec(ratio=0.05, error_feedback=False)]:
        parts = _rank_payloads(codec, rng, numel, ranks)
        whole = np.concatenate(parts)
        foreign = whole.copy()
        foreign[parts[0].size + 4:parts[0].size + 8] = np.frombuffer(np.uint32(numel + 1).tobytes(), np.uint8)
        for name, buf in [("whole", whole), ("numel", foreign)]:
            _check_exchange_decode(f"{type(codec).__name__} exchange {name}", codec, buf, numel, ranks,
                                   intact=name == "whole")
            count += 1
    codec = RandomKCodec(ratio=0.05)
    values = codec.gather(rng.standard_normal(numel).astype(np.float32), 3, 4)
    o_cpu = np.full(numel, 0.25, np.float32)
    codec.scatter_accumulate(values, o_cpu, 3, 4)
    d_o = cuda.to_device(np.full(numel, 0.25, np.float32))
    codec.scatter_accumulate(cuda.to_device(values), d_o, 3, 4)
    check("randomk scatter_accumulate CUDA == CPU", same(o_cpu, d_o.copy_to_host()))
    return count + 1


def _fused_decode(fused, buf, device):
    """(decoded members' bytes or None, the error's type and message or None) of a group's decode_gathered."""
    outs = [np.full(stage.numel, 0.25, np.float32) for stage in fused.stages]
    if device:
        buf, outs = cuda.to_device(buf), [cuda.to_device(o) for o in outs]
    try:
        fused.decode_gathered(buf, outs)
    except Exception as exc:  # compared between CPU and CUDA: the same type and message
        return None, f"{type(exc).__name__}: {exc}"
    return [(o.copy_to_host() if device else o).tobytes() for o in outs], None


def run_fused_decode_cases(rng, ranks=3, sizes=(3000, 1000)):
    """A fused group's second stage (per owner a manifest, then each member's sum) decodes on a GPU as on
    the CPU, for fixed-size and Elias payloads, and a foreign manifest gives the same error."""
    count = 0
    for codec in [QSGDCodec(bits=4, bucket_size=128), TopKCodec(ratio=0.05, error_feedback=False),
                  QSGDCodec(bits=4, encoding="elias")]:
        groups = [FusedTwoStage([TwoStage(codec, codec, f"t{i}", n, ranks, r) for i, n in enumerate(sizes)])
                  for r in range(ranks)]
        parts = []
        for fused in groups:
            sums, used = [], []
            for stage in fused.stages:
                begin, end = stage.owned
                sums.append(np.zeros(stage.owned_capacity(), np.uint8))
                used.append(stage.encode_owned(rng.standard_normal(end - begin).astype(np.float32), sums[-1], 5))
            parts += [np.frombuffer(p, np.uint8) if isinstance(p, bytes) else sums[p[0]][p[1]:p[2]]
                      for p in fused.second_stage_pieces(used)]
        whole = np.concatenate(parts)
        foreign = whole.copy()
        foreign[8:12] ^= 0xFF  # the first owner's manifest: another group's names digest
        for name, buf in [("whole", whole), ("foreign manifest", foreign)]:
            cpu, gpu = _fused_decode(groups[1], buf, False), _fused_decode(groups[1], buf, True)
            label = f"fused {type(codec).__name__} {codec.config().get('encoding', '')} {name}"
            check(f"{label}: CUDA == CPU ({cpu[1]} / {gpu[1]})", cpu == gpu)
            check(f"{label}: raises", (cpu[1] is None) == (name == "whole"))
            count += 1
    return count


def run_encode_many_cases(rng, sizes=(3000, 517, 8, 1, 20_000)):
    """A group of tensors encoded by one encode_many on CUDA arrays (QSGD's grouped kernels) gives the CPU's
    one-by-one payloads, into stale bytes (every header and padding byte written)."""
    count = 0
    for codec in [QSGDCodec(bits=4), QSGDCodec(bits=3, bucket_size=7, scale_dtype="float16"),
                  QSGDCodec(bits=8, bucket_size=100, norm="l2", rounding="deterministic")]:
        xs = [rng.standard_normal(n).astype(np.float32) for n in sizes]
        xs[1][5] = np.inf
        caps = [codec.max_payload_nbytes(n) for n in sizes]
        starts = np.cumsum([0] + caps)[:-1]
        cpu = np.full(sum(caps), 0xAB, np.uint8)
        for x, start, cap, key in zip(xs, starts, caps, range(len(sizes))):
            codec.encode(x, cpu[start:start + cap], step=9, key=key)
        gpu = cuda.to_device(np.full(sum(caps), 0xAB, np.uint8))
        used = codec.encode_many([cuda.to_device(x) for x in xs], [gpu[s:s + c] for s, c in zip(starts, caps)],
                                 step=9, keys=list(range(len(sizes))))
        check(f"encode_many of {len(sizes)} tensors {codec!r}: CUDA == CPU",
              used == caps and same(cpu, gpu.copy_to_host()))
        # a payload 1 byte off a 4-byte boundary cannot be viewed as float32 scales: the per-payload kernels
        odd = cuda.to_device(np.full(caps[0] + 1, 0xAB, np.uint8))
        codec.encode(cuda.to_device(xs[0]), odd[1:], step=9, key=0)
        check(f"encode into an unaligned slot {codec!r}: CUDA == CPU", same(cpu[:caps[0]], odd.copy_to_host()[1:]))
        _check_unaligned_decode(codec, cpu[:caps[0]], odd[1:], sizes[0])
        count += 3
    return count


def _check_unaligned_decode(codec, payload, unaligned, numel):
    """``unaligned`` (a device copy of ``payload`` off a 4-byte boundary) decodes by the per-payload kernels as
    the CPU decodes ``payload``."""
    host_total, device_total = np.zeros(numel, np.float32), cuda.to_device(np.zeros(numel, np.float32))
    codec.decode_accumulate(payload, host_total)
    codec.decode_accumulate(unaligned, device_total)
    check(f"decode of an unaligned payload {codec!r}: CUDA == CPU", same(host_total, device_total.copy_to_host()))


def run_topk_encode_many_cases(rng, sizes=(3000, 517, 8, 1, 20_000)):
    """Exact, Gaussian and sample top-k's group of tensors by one encode_many
    (:mod:`horovod_qsgd.kernels.select_grouped`): the CPU's one-by-one payloads and residuals, residuals updated
    in place and carried (last step counted or not), ties, heavy tails (the thresholds' refinements), an inf and a
    NaN (the exact fallback); and a payload off a 4-byte boundary decoded by the per-payload scatter."""
    count = 0
    for codec in [TopKCodec(ratio=0.05), TopKCodec(ratio=0.01, value_dtype="float16"),
                  TopKCodec(ratio=0.05, error_feedback=False), TopKCodec(ratio=0.05, selector="gaussian"),
                  TopKCodec(ratio=0.01, selector="gaussian", value_dtype="float16", error_feedback=False),
                  TopKCodec(ratio=0.05, selector="sample"), TopKCodec(ratio=0.02, selector="sample",
                                                                      error_feedback=False)]:
        xs = [rng.standard_normal(n).astype(np.float32) for n in sizes]
        xs[0][:30] = 2.0
        xs[1] = xs[1] ** 5
        xs[2][3] = np.inf  # the thresholds of the 8-element tensor not finite: the exact fallback
        xs[4][7] = np.nan
        caps = [codec.max_payload_nbytes(n) for n in sizes]
        starts = np.cumsum([0] + caps)[:-1]
        targets = [rng.standard_normal(n).astype(np.float32) for n in sizes]
        previous = [rng.standard_normal(n).astype(np.float32) for n in sizes]

        def residuals(convert):
            t, p = [convert(a.copy()) for a in targets], [convert(a.copy()) for a in previous]
            held = [t[i] if i % 2 == 0 else
                    CarriedResidual(t[i], p[i], convert(np.array([4 - (i % 4 != 1), 0], np.int64)), 4)
                    for i in range(len(sizes))]
            return (held, t + p) if codec.error_feedback else (None, [])
        cpu = np.full(sum(caps), 0xAB, np.uint8)
        held, cpu_state = residuals(np.asarray)
        for i, (x, start, cap) in enumerate(zip(xs, starts, caps)):
            codec.encode(x, cpu[start:start + cap], step=9, key=i, residual=None if held is None else held[i])
        gpu = cuda.to_device(np.full(sum(caps), 0xAB, np.uint8))
        held, gpu_state = residuals(cuda.to_device)
        used = codec.encode_many([cuda.to_device(x) for x in xs], [gpu[s:s + c] for s, c in zip(starts, caps)],
                                 step=9, keys=list(range(len(sizes))), residuals=held)
        check(f"encode_many of {len(sizes)} tensors {codec!r}: CUDA == CPU",
              used == caps and same(cpu, gpu.copy_to_host())
              and all(same(c, g.copy_to_host()) for c, g in zip(cpu_state, gpu_state)))
        odd = cuda.to_device(np.concatenate([np.zeros(1, np.uint8), cpu[:caps[0]]]))
        _check_unaligned_decode(codec, cpu[:caps[0]], odd[1:], sizes[0])
        count += 2
    # three senders' payloads with one index in common, added in payload order: 1 + 3e7 - 3e7 is 0 in float32,
    # the reverse order 1
    codec = TopKCodec(ratio=0.05, error_feedback=False)
    parts = []
    for value in (1.0, 3e7, -3e7):
        x = np.full(100, 1e-3, np.float32)
        x[5] = value
        parts.append(np.zeros(codec.max_payload_nbytes(100), np.uint8))
        codec.encode(x, parts[-1], step=1, key=1)
    whole = np.concatenate(parts)
    spans = [(i * parts[0].size, (i + 1) * parts[0].size, None) for i in range(3)]
    host_total, device_total = np.zeros(100, np.float32), cuda.to_device(np.zeros(100, np.float32))
    codec.decode_sum(whole, spans, [host_total] * 3)
    codec.decode_sum(cuda.to_device(whole), spans, [device_total] * 3)
    check("top-k decode of 3 payloads sharing an index, in payload order: CUDA == CPU",
          host_total[5] == 0 and same(host_total, device_total.copy_to_host()))
    return count + 1


def run_engine_encode_cases(rng, numel=3000, ranks=3):
    """The engine's two-stage step 1 (slices for the owners, this rank's own chunk with its residual's mass)
    on CUDA arrays gives the CPU's slices, splits, own chunk and residual."""
    count = 0
    for codec, residual in [(QSGDCodec(bits=4, bucket_size=128), None),
                            (TopKCodec(ratio=0.05), rng.standard_normal(numel).astype(np.float32))]:
        x = rng.standard_normal(numel).astype(np.float32)
        results = []
        for device in (False, True):
            plan = PayloadEngine(codec, codec, "two_stage", CompressionStats()).plan("t", numel, ranks, 1, 4 * numel, 4)
            out, own = np.zeros(plan.capacity(), np.uint8), np.zeros(plan.own_numel(), np.float32)
            r = None if residual is None else residual.copy()
            args = [x, out, own, r]
            if device:
                args = [None if a is None else cuda.to_device(a) for a in args]
            splits = plan.encode(args[0], args[1], args[2], 7, args[3])
            results.append([splits] + [None if a is None else (a.copy_to_host() if device else a).tobytes()
                                       for a in args[1:]])
        check(f"engine two-stage encode {type(codec).__name__}: CUDA == CPU", results[0] == results[1])
        count += 1
    return count


def run_settled_step_cases(rng):
    """Error feedback through a finite, a non-finite and two finite steps as the PyTorch adapter runs it on a
    GPU: each encode reads the residual through a CarriedResidual with the tensor's commit stamps, and
    finish_sum scales the decoded sum and stamps its verdict, nothing read back. Against the CPU, which copies
    the residual and decides on the host: every payload, the residual kept at the end and the non-finite
    count, bit for bit; the two-stage step 1 (own chunk) too. Returns the number of cases."""
    cases = [("topk exact", TopKCodec(ratio=0.05), 3000), ("topk exact sampled", TopKCodec(ratio=0.05), 20_000),
             ("topk gaussian fp16", TopKCodec(ratio=0.05, selector="gaussian", value_dtype="float16"), 3000),
             ("topk sample", TopKCodec(ratio=0.05, selector="sample"), 3000),
             ("randomk", RandomKCodec(ratio=0.05, error_feedback=True), 3000)]
    for label, codec, numel in cases:
        grads = [rng.standard_normal(numel).astype(np.float32) for _ in range(4)]
        grads[1][numel // 3] = np.inf
        host, host_nonfinite, payloads_match = np.zeros(numel, np.float32), 0, True
        kept, spare = cuda.to_device(np.zeros(numel, np.float32)), cuda.to_device(np.zeros(numel, np.float32))
        stamps, counter = cuda.to_device(np.zeros(2, np.int64)), cuda.to_device(np.zeros(1, np.int64))
        scale = cuda.to_device(np.full(1, 0.5, np.float32))
        cap = codec.max_payload_nbytes(numel)
        for step, grad in enumerate(grads):
            new, out = host.copy(), np.zeros(cap, np.uint8)
            used = codec.encode(grad, out, step=step, key=9, residual=new)
            total = np.zeros(numel, np.float32)
            codec.decode_accumulate(out[:used], total)
            if K.finish_sum(total, 0.5):
                host = new
            else:
                host_nonfinite += 1
            d_out = cuda.to_device(np.zeros(cap, np.uint8))
            codec.encode(cuda.to_device(grad), d_out, step=step, key=9,
                         residual=K.CarriedResidual(spare, kept, stamps, step))
            payloads_match &= same(out[:used], d_out.copy_to_host()[:used])
            d_total = cuda.to_device(np.zeros(numel, np.float32))
            codec.decode_accumulate(d_out[:used], d_total)
            K.finish_sum(d_total, scale, stamps=stamps, stamp=step + 1, counter=counter)
            payloads_match &= same(total, d_total.copy_to_host())
        written, not_finite = stamps.copy_to_host()
        kept_now = spare if written == len(grads) and not_finite != len(grads) else kept
        check(f"settled steps {label}: CUDA == CPU", payloads_match and same(host, kept_now.copy_to_host())
              and int(counter.copy_to_host()[0]) == host_nonfinite == 1)
    # the two-stage step 1 moves the residual's own chunk into the owner's sum through the same stamps
    numel, codec = 3000, TopKCodec(ratio=0.05)
    x, r = rng.standard_normal(numel).astype(np.float32), rng.standard_normal(numel).astype(np.float32)
    plan = PayloadEngine(codec, codec, "two_stage", CompressionStats()).plan("t", numel, 3, 1, 4 * numel, 4)
    out, own, new = np.zeros(plan.capacity(), np.uint8), np.zeros(plan.own_numel(), np.float32), r.copy()
    splits = plan.encode(x, out, own, 7, new)
    # the stamps say that the last step (stamp 7) counted: its residual, r, is in the target buffer
    d_target, d_previous = cuda.to_device(r), cuda.to_device(np.full(numel, np.nan, np.float32))
    d_out, d_own = cuda.to_device(np.zeros(plan.capacity(), np.uint8)), cuda.to_device(own * 0)
    d_splits = plan.encode(cuda.to_device(x), d_out, d_own, 7,
                           K.CarriedResidual(d_target, d_previous, cuda.to_device(np.array([7, 0], np.int64)), 7))
    check("settled two-stage step 1: CUDA == CPU", splits == d_splits and same(out, d_out.copy_to_host())
          and same(own, d_own.copy_to_host()) and same(new, d_target.copy_to_host())
          and same(r, d_previous.copy_to_host()))
    return len(cases) + 1


def run_large_cases(rng, n=1_000_003):
    """Sizes the simulator cannot afford (real GPU only); returns the number of cases."""
    # n: not a multiple of a bucket, of 8 or of a CUDA block
    x = rng.standard_normal(n).astype(np.float32)
    r = rng.standard_normal(n).astype(np.float32) * np.float32(0.1)
    codecs = [
        ("qsgd4_max_1M", QSGDCodec(bits=4), None),
        ("qsgd2_l2_1M", QSGDCodec(bits=2, norm="l2", bucket_size=4096), None),
        ("qsgd8_fp16_scale_1M", QSGDCodec(bits=8, scale_dtype="float16"), None),
        ("qsgd3_deterministic_1M", QSGDCodec(bits=3, rounding="deterministic"), None),
        ("qsgd2_elias_l2_1M", QSGDCodec(bits=2, norm="l2", bucket_size=8192, encoding="elias"), None),
        ("topk_exact_ef_1M", TopKCodec(ratio=0.001), r),
        ("topk_gaussian_ef_1M", TopKCodec(ratio=0.001, selector="gaussian"), r),
        ("topk_sample_fp16_1M", TopKCodec(ratio=0.01, selector="sample", value_dtype="float16"), r),
        ("randomk_ef_1M", RandomKCodec(ratio=0.01, error_feedback=True), r),
    ]
    for name, codec, residual in codecs:
        run_case(name, codec, x, 11, 12, residual)
    return len(codecs)


if __name__ == "__main__":
    sys.exit(main())
