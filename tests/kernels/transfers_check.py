"""Counts the synchronous host<->device copies and device allocations of codec calls in numba's CUDA simulator.

Run with NUMBA_ENABLE_CUDASIM=1 (test_host_transfers.py does); prints one
JSON object: for each call, the copies host-to-device (``h2d``),
device-to-host (``d2h``), device-to-device (``d2d``) and the device arrays
allocated by numba (``alloc``) or taken from the caller's allocator
(``allocator``), the kernel launches, how many of all those went to
another stream than the caller's ``K.launch_stream`` (``off_stream``), and
whether its result equals the CPU path's. Every host copy waits for the
GPU's queue to drain on a real device.
"""

import json
import os
import sys
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
warnings.simplefilter("ignore", RuntimeWarning)  # uint64 wraparound in the simulated hash
# the simulator runs a block's threads as Python threads while its scheduler polls them: at the default 5 ms
# GIL switch interval each barrier waits on switches, and the grouped top-k's 52-tensor step took 175 s, 33 s
# at 0.2 ms
sys.setswitchinterval(0.0002)

from numba import cuda  # noqa: E402
from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray  # noqa: E402
from numba.cuda.simulator.kernel import FakeCUDAKernel  # noqa: E402

from horovod_qsgd import kernels as K  # noqa: E402
from horovod_qsgd.kernels import CarriedResidual  # noqa: E402
from horovod_qsgd.codecs import LatticeCodec, QSGDCodec, RandomKCodec, TopKCodec  # noqa: E402
from horovod_qsgd.common.exchange import decode_gathered  # noqa: E402
from horovod_qsgd.common.fusion import ALLGATHER_GROUP_NBYTES  # noqa: E402
from horovod_qsgd.common.two_stage import TwoStage  # noqa: E402
from tests.two_stage_reference import first_stage_inboxes  # noqa: E402

assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", "run under NUMBA_ENABLE_CUDASIM=1"

counts = {"h2d": 0, "d2h": 0, "d2d": 0, "alloc": 0, "allocator": 0, "launch": 0, "off_stream": 0}
scope_stream = [0]  # the stream the call under measurement runs in (K.launch_stream)
scope_allocator = [None]  # and the scratch allocator it names


def framework_allocator(nbytes):
    """Stands in for PyTorch's caching allocator: device bytes that are not numba's allocations."""
    counts["allocator"] += 1
    return FakeCUDAArray(np.empty(nbytes, np.uint8))


def _on_stream(stream):
    if stream is not scope_stream[0] and not (stream == 0 and scope_stream[0] == 0):
        counts["off_stream"] += 1


def _counting(kind, fn, source_arg=None, stream_arg=None):
    """``fn`` counting its calls as ``kind``; a device array as argument ``source_arg`` makes it a d2d copy."""
    def wrapped(*args, **kwargs):
        device_source = source_arg is not None and isinstance(args[source_arg], FakeCUDAArray)
        counts["d2d" if device_source else kind] += 1
        stream = kwargs.get("stream", args[stream_arg] if stream_arg is not None and len(args) > stream_arg else 0)
        _on_stream(stream)
        return fn(*args, **kwargs)
    return wrapped


def _counting_launch(getitem):
    def wrapped(self, configuration):
        counts["launch"] += 1
        _on_stream(configuration[2] if len(configuration) > 2 else 0)
        return getitem(self, configuration)
    return wrapped


# Device arrays made by the harness itself are created before a window opens; only the call inside counts.
FakeCUDAArray.copy_to_host = _counting("d2h", FakeCUDAArray.copy_to_host, stream_arg=2)
FakeCUDAArray.copy_to_device = _counting("h2d", FakeCUDAArray.copy_to_device, source_arg=1, stream_arg=2)
cuda.to_device = _counting("h2d", cuda.to_device, source_arg=0, stream_arg=1)
cuda.device_array = _counting("alloc", cuda.device_array)
FakeCUDAKernel.__getitem__ = _counting_launch(FakeCUDAKernel.__getitem__)

report = {}


def measure(name, call, expected=None, warm=None):
    """Counts what ``call`` does; ``warm``: called first, uncounted (a step before, whose layouts are cached)."""
    if warm is not None:
        with K.launch_stream(scope_stream[0], scope_allocator[0]):
            warm()
    for kind in counts:
        counts[kind] = 0
    with K.launch_stream(scope_stream[0], scope_allocator[0]):
        result = call()
    entry = dict(counts)
    if expected is not None:
        got = result.copy_to_host() if isinstance(result, FakeCUDAArray) else result
        entry["matches_cpu"] = bool(np.array_equal(np.asarray(got).view(np.uint8), np.asarray(expected).view(np.uint8)))
    report[name] = entry
    return result


def device(a):
    return cuda.to_device(np.ascontiguousarray(a))


def encode_case(name, codec, x, residual=None, step=3, key=11):
    cap = codec.max_payload_nbytes(x.size)
    host_out = np.full(cap, 0xAB, np.uint8)  # stale bytes: padding must be written, not assumed zero
    used = codec.encode(x, host_out, step=step, key=key,
                        residual=None if residual is None else residual.copy())
    d_x, d_out, d_before = device(x), device(np.full(cap, 0xAB, np.uint8)), device(np.zeros(cap, np.uint8))
    d_res = None if residual is None else device(residual.copy())
    # QSGD's layout table goes to the device at its first step (encode_many_case counts that copy)
    warm = (lambda: codec.encode(d_x, d_before, step=step, key=key)) if isinstance(codec, QSGDCodec) else None
    measure(name, lambda: codec.encode(d_x, d_out, step=step, key=key, residual=d_res), warm=warm)
    report[name]["matches_cpu"] = bool(np.array_equal(d_out.copy_to_host()[:used], host_out[:used]))
    return host_out[:used]


def payloads(codec, rows, residual=False):
    parts = []
    for rank, row in enumerate(rows):
        out = np.zeros(codec.max_payload_nbytes(row.size), np.uint8)
        res = np.zeros(row.size, np.float32) if residual else None
        parts.append(out[:codec.encode(row, out, step=5, key=100 + rank, residual=res)])
    return parts


def decode_case(name, codec, rows, residual=False):
    """Every rank's payload decoded into one sum; QSGD's and top-k's in a step after one of the same layout
    (their tables cached)."""
    gathered = np.concatenate(payloads(codec, rows, residual))
    n = rows[0].size
    expected = np.zeros(n, np.float32)
    decode_gathered(codec, gathered, len(rows), n, "w", expected)
    d_gathered, d_total, d_before = device(gathered), device(np.zeros(n, np.float32)), device(np.zeros(n, np.float32))
    measure(name, lambda: (decode_gathered(codec, d_gathered, len(rows), n, "w", d_total), d_total)[1], expected,
            warm=(lambda: decode_gathered(codec, d_gathered, len(rows), n, "w", d_before))
            if isinstance(codec, (QSGDCodec, TopKCodec)) else None)


def encode_many_case(name, codec, sizes, step=3, residuals=False, heavy_tails=False, not_finite=None):
    """A group's payloads by one encode_many, against the CPU's one-by-one encodes; the first step of a layout
    (its table copied to the device) and the next. ``residuals``: each input with an error-feedback residual,
    half of them carried (:class:`CarriedResidual`, its last step counted for every other one), compared too.
    ``heavy_tails``: every other input to the fifth power (a Gaussian threshold then needs its refinements);
    ``not_finite``: the input of that index gets an inf and a NaN."""
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    xs[0][:40] = 1.5  # ties broken by the lower index
    if heavy_tails:
        xs = [x ** 5 if i % 2 else x for i, x in enumerate(xs)]
    if not_finite is not None:
        xs[not_finite][[3, 5]] = [np.inf, np.nan]
    caps = [codec.max_payload_nbytes(n) for n in sizes]
    starts = np.cumsum([0] + caps)[:-1]
    keys = list(range(len(sizes)))
    if residuals:
        targets = [rng.standard_normal(n).astype(np.float32) for n in sizes]
        previous = [rng.standard_normal(n).astype(np.float32) for n in sizes]

    def residuals_of(convert, stamp=7):
        """The residuals; the carried ones' last step (stamped ``stamp``) counted for every other one."""
        if not residuals:
            return None, []
        t, p = [convert(a.copy()) for a in targets], [convert(a.copy()) for a in previous]
        held = [t[i] if i % 2 == 0 else
                CarriedResidual(t[i], p[i], convert(np.array([stamp - (i % 4 != 1), 0], np.int64)), stamp)
                for i in keys]
        return held, t + p

    expected = np.full(sum(caps), 0xAB, np.uint8)
    held, expected_state = residuals_of(np.asarray)
    for i, (x, start, cap) in enumerate(zip(xs, starts, caps)):
        codec.encode(x, expected[start:start + cap], step=step, key=i, residual=None if held is None else held[i])
    d_xs = [device(x) for x in xs]
    d_out = device(np.zeros(sum(caps), np.uint8))
    d_held, d_state = residuals_of(device)  # the arrays a training loop keeps; their content reset each step
    for stamp, which in ((7, "first step"), (8, "next step")):
        d_out.copy_to_device(np.full(sum(caps), 0xAB, np.uint8))  # stale bytes: every byte must be written
        outs = [d_out[start:start + cap] for start, cap in zip(starts, caps)]
        for d, h in zip(d_state, (targets + previous) if residuals else []):
            d.copy_to_device(h)
        if residuals:  # the next step's stamp, the same decisions (its commit stamps moved with it)
            for i in keys[1::2]:
                d_held[i].commit.copy_to_device(np.array([stamp - (i % 4 != 1), 0], np.int64))
                d_held[i].stamp = stamp
        measure(f"{name}, {which}", lambda: (codec.encode_many(d_xs, outs, step=step, keys=keys, residuals=d_held),
                                             d_out)[1], expected)
        report[f"{name}, {which}"]["matches_cpu"] &= all(
            np.array_equal(d.copy_to_host().view(np.uint32), h.view(np.uint32)) for d, h in zip(d_state, expected_state))


def two_stage_slices_case(name, codec, numel=5000, ranks=4):
    """One rank's first stage: its slices for the other owners, in a step after one of the same layout."""
    x = np.random.default_rng(3).standard_normal(numel).astype(np.float32)
    stage = TwoStage(codec, codec, "w", numel, ranks, 1)
    expected = np.zeros(stage.send_capacity(), np.uint8)
    stage.encode_for_owners(x, expected, step=2)
    d_x, d_out, d_before = device(x), device(np.zeros(expected.size, np.uint8)), device(np.zeros(expected.size,
                                                                                                  np.uint8))
    measure(name, lambda: (stage.encode_for_owners(d_x, d_out, step=2), d_out)[1], expected,
            warm=lambda: stage.encode_for_owners(d_x, d_before, step=2))


# The launch budget (issue #51): the codec's part of one step of a real model's compressed tensors (those of
# the compressors' min_numel, 10,000 elements, and more), fused as the adapters fuse them, on rank 0 of BUDGET_RANKS: each group's
# payloads encoded, then every rank's part of the group decoded (the allgather exchange, the same payloads
# standing in for every rank's). The groups come from the tensors' real sizes; the simulator runs them at
# 1/BUDGET_SCALE of their elements, which changes no launch or copy count (none depends on a size).
BUDGET_RANKS, BUDGET_SCALE = 4, 1 << 16


class _Member:
    def __init__(self, name, numel, codec, num_ranks):
        self.name, self.numel, self.codec, self.num_ranks = name, numel, codec, num_ranks


def budget_case(model, shapes, codec, thresholds, label=None, by_gradient=False):
    """``by_gradient``: groups packed as the PyTorch adapter packs its allgather tensors (in name order, by
    their float32 gradient's bytes); else by payload bytes, as its two-stage tensors."""
    from horovod_qsgd.common.collectives import join_host_pieces
    from horovod_qsgd.common.fusion import FusedAllgather, pack
    from horovod_qsgd.testdata.model_shapes import compressed
    real = compressed(shapes)
    rng = np.random.default_rng(5)
    xs = {name: rng.standard_normal(max(8, numel // BUDGET_SCALE)).astype(np.float32) for name, numel in real}
    d_xs = {name: device(x) for name, x in xs.items()}
    ef = getattr(codec, "error_feedback", False)
    d_residuals = {name: device(np.zeros(x.size, np.float32)) for name, x in xs.items()} if ef else {}
    for threshold in thresholds:
        if by_gradient:
            groups = pack([((0, name), 4 * numel) for name, numel in sorted(real)], threshold)
        else:
            groups = pack([((0, name), codec.max_payload_nbytes(numel)) for name, numel in real], threshold)
        members = [[_Member(name, xs[name].size, codec, BUDGET_RANKS) for _, name in group] for group in groups]
        host, device_parts = [], []
        for group in members:
            fused = FusedAllgather(group)
            caps = [codec.max_payload_nbytes(m.numel) for m in group]
            outs = [np.zeros(cap, np.uint8) for cap in caps]
            used = codec.encode_many([xs[m.name] for m in group], outs, step=1, keys=list(range(len(group))),
                                     residuals=[np.zeros(m.numel, np.float32) for m in group] if ef else None)
            part = join_host_pieces(fused.part_pieces(used), outs)
            gathered = np.concatenate([part] * BUDGET_RANKS)
            sums = [np.zeros(m.numel, np.float32) for m in group]
            fused.decode(gathered, sums)
            host.append(sums)
            device_parts.append((fused, caps, device(gathered)))

        def buffers():  # what the adapter's framework allocates and zeroes: payload buffers, sums
            return [([device(np.zeros(cap, np.uint8)) for cap in caps], [device(np.zeros(m.numel, np.float32))
                                                                         for m in group])
                    for group, (_, caps, _) in zip(members, device_parts)]

        def step(arrays):
            for group, (fused, _, d_gathered), (outs, sums) in zip(members, device_parts, arrays):
                codec.encode_many([d_xs[m.name] for m in group], outs, step=1, keys=list(range(len(group))),
                                  residuals=[d_residuals[m.name] for m in group] if ef else None)
                fused.decode(d_gathered, sums)
            return [sums for _, sums in arrays]

        def first_step():  # the same arrays, as a training loop's allocator hands back; the sums zeroed after
            step(arrays)
            for total in [total for _, sums in arrays for total in sums] + list(d_residuals.values()):
                total.copy_to_device(np.zeros(total.size, np.float32))

        name = f"budget {model}, {label + ', ' if label else ''}threshold {threshold >> 20} MiB"
        arrays = buffers()
        got = measure(name, lambda: step(arrays), warm=first_step)
        report[name].update(
            tensors=len(real), groups=len(groups),
            matches_cpu=all(np.array_equal(d.copy_to_host().view(np.uint32), h.view(np.uint32))
                            for d_sums, h_sums in zip(got, host) for d, h in zip(d_sums, h_sums)))



def two_stage_case(name, codec, numel=5000, ranks=3):
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal(numel).astype(np.float32) for _ in range(ranks)]
    stages = [TwoStage(codec, codec, "w", numel, ranks, r) for r in range(ranks)]
    sums = []
    for r, (stage, received) in enumerate(zip(stages, first_stage_inboxes(stages, grads))):
        begin, end = stage.owned
        total = grads[r][begin:end].copy()
        d_received, d_total = device(received), device(total)
        stage.accumulate_received(received, total)
        if r == 0:
            d_before = device(grads[r][begin:end].copy())
            measure(f"{name}: sum of the first stage's slices",
                    lambda: (stage.accumulate_received(d_received, d_total), d_total)[1], total,
                    warm=lambda: stage.accumulate_received(d_received, d_before))
        out = np.zeros(stage.owned_capacity(), np.uint8)
        sums.append(out[:stage.encode_owned(total, out, step=0)])
    gathered = np.concatenate(sums)
    expected = np.zeros(numel, np.float32)
    stages[0].decode_gathered(gathered, expected)
    d_gathered, d_result, d_before = device(gathered), device(np.zeros(numel, np.float32)), device(np.zeros(numel,
                                                                                                           np.float32))
    measure(f"{name}: decode of the second stage's sums",
            lambda: (stages[0].decode_gathered(d_gathered, d_result), d_result)[1], expected,
            warm=lambda: stages[0].decode_gathered(d_gathered, d_before))


def settled_steps_case(name, codec, x, nonfinite_steps=(1,), steps=4):
    """Error feedback across steps as the PyTorch adapter runs it on a device: each encode reads the residual
    through a CarriedResidual with the tensor's commit stamps, each result is scaled by finish_sum, which stamps
    its verdict; nothing is read back. Against the CPU, which copies the residual and decides on the host:
    every payload, the residual left and the count of non-finite steps, bitwise. Entries: the carried encode
    and the in-place encode of the same step (launches must agree: no extra pass), and the finish."""
    rng = np.random.default_rng(7)
    grads = [(x * (1 + s) + rng.standard_normal(x.size).astype(np.float32)).astype(np.float32) for s in range(steps)]
    for s in nonfinite_steps:
        grads[s][123] = np.inf
    cap = codec.max_payload_nbytes(x.size)
    host_residual, host_nonfinite, payloads_match = np.zeros(x.size, np.float32), 0, True
    kept, spare = device(np.zeros(x.size, np.float32)), device(np.zeros(x.size, np.float32))
    stamps, counter = device(np.zeros(2, np.int64)), device(np.zeros(1, np.int64))
    scale = device(np.full(1, 0.5, np.float32))
    for step, grad in enumerate(grads):
        before, host_out = host_residual.copy(), np.zeros(cap, np.uint8)
        new_residual = before.copy()
        used = codec.encode(grad, host_out, step=step, key=11, residual=new_residual)
        total = np.zeros(x.size, np.float32)
        codec.decode_accumulate(host_out[:used], total)
        if K.finish_sum(total, 0.5):
            host_residual = new_residual
        else:
            host_nonfinite += 1
        d_grad, d_out = device(grad), device(np.zeros(cap, np.uint8))
        carried = K.CarriedResidual(spare, kept, stamps, step)
        entry = f"{name} step {step}: carried encode"
        measure(entry, lambda: codec.encode(d_grad, d_out, step=step, key=11, residual=carried))
        report[entry]["matches_cpu"] = bool(np.array_equal(d_out.copy_to_host()[:used], host_out[:used]))
        payloads_match &= report[entry]["matches_cpu"]
        d_total = device(np.zeros(x.size, np.float32))
        codec.decode_accumulate(d_out[:used], d_total)
        measure(f"{name} step {step}: finish", lambda: (K.finish_sum(d_total, scale, stamps=stamps, stamp=step + 1,
                                                                      counter=counter), d_total)[1], total)
        # the same step with the residual updated in place (its value before the step): the launches to match
        in_place, d_out = device(before), device(np.zeros(cap, np.uint8))
        entry = f"{name} step {step}: in-place encode"
        measure(entry, lambda: codec.encode(d_grad, d_out, step=step, key=11, residual=in_place))
        report[entry]["matches_cpu"] = bool(np.array_equal(d_out.copy_to_host()[:used], host_out[:used]))
    written, not_finite = stamps.copy_to_host()
    residual = (spare if written == steps and not_finite != steps else kept).copy_to_host()
    same_residual = bool(np.array_equal(residual.view(np.uint32), host_residual.view(np.uint32)))
    same_count = int(counter.copy_to_host()[0]) == host_nonfinite
    report[f"{name}: after {steps} steps"] = dict({kind: 0 for kind in counts}, nonfinite=host_nonfinite,
                                                  matches_cpu=payloads_match and same_residual and same_count)


def main():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(20_000).astype(np.float32)
    rows = [rng.standard_normal(3000).astype(np.float32) for _ in range(3)]
    qsgd = QSGDCodec(bits=4)
    encode_case("qsgd-4 encode", qsgd, x)
    # 3 fp16 scales leave two alignment bytes after them, zeroed by the encoder
    encode_case("qsgd-4 fp16 scales encode", QSGDCodec(bits=4, bucket_size=7000, scale_dtype="float16"), x)
    decode_case("qsgd-4 decode of 3 ranks", qsgd, rows)
    decode_case("qsgd-8 decode of 3 ranks", QSGDCodec(bits=8, bucket_size=128), rows)
    two_stage_case("qsgd-4 two stages", QSGDCodec(bits=4, bucket_size=256))
    two_stage_slices_case("qsgd-4 two stages: slices for 3 owners", qsgd)
    encode_many_case("qsgd-4 encode_many of 5 tensors", qsgd, [3000, 517, 8, 20_000, 1])
    encode_many_case("qsgd-3 fp16 scales encode_many of 3 tensors",
                     QSGDCodec(bits=3, bucket_size=7, scale_dtype="float16"), [1001, 30, 7])
    from horovod_qsgd.testdata.model_shapes import gpt2_small, resnet50
    for model, shapes in [("resnet50", resnet50()), ("gpt2-small", gpt2_small())]:
        budget_case(model, shapes, qsgd, thresholds=[64 << 20, 4 << 20, 1 << 20])
        budget_case(model, shapes, qsgd, thresholds=[ALLGATHER_GROUP_NBYTES["cuda"]], label="allgather groups",
                    by_gradient=True)
    topk = TopKCodec(ratio=0.01)
    encode_many_case("topk-5% encode_many of 5 tensors", TopKCodec(ratio=0.05), [3000, 517, 8, 20_000, 1],
                     residuals=True)
    encode_many_case("topk-5% fp16 encode_many of 3 tensors", TopKCodec(ratio=0.05, value_dtype="float16"),
                     [1001, 30, 7], residuals=True)
    encode_many_case("topk-5% without error feedback, encode_many of 2 tensors",
                     TopKCodec(ratio=0.05, error_feedback=False), [1001, 300])
    gaussian = TopKCodec(ratio=0.05, selector="gaussian")
    encode_many_case("gaussiank-5% encode_many of 5 tensors", gaussian, [3000, 517, 8, 20_000, 1], residuals=True,
                     heavy_tails=True)
    encode_many_case("gaussiank-5% fp16 encode_many of 3 tensors, one not finite",
                     TopKCodec(ratio=0.05, selector="gaussian", value_dtype="float16"), [1001, 30, 7],
                     residuals=True, not_finite=0)
    encode_many_case("gaussiank-5% without error feedback, encode_many of 2 tensors",
                     TopKCodec(ratio=0.05, selector="gaussian", error_feedback=False), [1001, 300], heavy_tails=True)
    encode_many_case("sample-k 5% encode_many of 5 tensors", TopKCodec(ratio=0.05, selector="sample"),
                     [3000, 517, 8, 20_000, 1], residuals=True, heavy_tails=True)
    # the 7-element tensor's 7 samples: its rank-1 sample is the NaN, so it falls back to the exact select
    encode_many_case("sample-k 5% fp16 encode_many of 3 tensors, one not finite",
                     TopKCodec(ratio=0.05, selector="sample", value_dtype="float16"), [1001, 30, 7], residuals=True,
                     not_finite=2)
    encode_many_case("sample-k 5% without error feedback, encode_many of 2 tensors",
                     TopKCodec(ratio=0.05, selector="sample", error_feedback=False), [1001, 300], heavy_tails=True)
    # one group (~30 s a step here); GPT-2 small's 50 tensors cost the same 19 launches (run once, 2026-11-28)
    budget_case("resnet50", resnet50(), topk, thresholds=[64 << 20], label="top-k 1%")
    zeros = np.zeros(x.size, np.float32)
    encode_case("topk-1% encode", topk, x, residual=zeros)  # k = 200: the radix select over all of acc
    # k = 1000 of 20,000: over the candidates above a sampled bound
    encode_case("topk-5% encode (sampled candidates)", TopKCodec(ratio=0.05), x, residual=x[::-1].copy())
    encode_case("gaussiank-1% encode", TopKCodec(ratio=0.01, selector="gaussian", value_dtype="float16"), x,
                residual=zeros)
    encode_case("sample-k 1% encode", TopKCodec(ratio=0.01, selector="sample"), x, residual=zeros)
    decode_case("topk-1% decode of 3 ranks", topk, rows, residual=True)
    # a quarter of x where the path does not depend on the size (the simulator's time does): the radix select
    # over all of acc, one moments chunk, random-k; the sampled candidates need more than 4 x 4096 elements
    settled_steps_case("topk-1% settled", topk, x[:5000])
    settled_steps_case("topk-5% settled (sampled candidates)", TopKCodec(ratio=0.05), x, nonfinite_steps=(1, 2))
    settled_steps_case("gaussiank-1% settled", TopKCodec(ratio=0.01, selector="gaussian"), x[:5000])
    settled_steps_case("randomk-1% settled", RandomKCodec(ratio=0.01, error_feedback=True), x[:5000])
    randomk = RandomKCodec(ratio=0.01)
    encode_case("randomk-1% encode", randomk, x)
    decode_case("randomk-1% decode of 3 ranks", randomk, rows)
    # The header chain of variable-size payloads, followed on the device: whole, cut inside the last
    # payload (the walk stops there), and with a header claiming 4 bytes (the chain cannot advance).
    chain = np.concatenate(payloads(QSGDCodec(bits=4, encoding="elias"), rows))
    broken = chain.copy()
    broken[12:16] = np.frombuffer(np.uint32(4).tobytes(), np.uint8)
    for name, buf in [("whole", chain), ("cut", chain[:-8]), ("not advancing", broken)]:
        d_buf = device(buf)
        measure(f"header chain of 3 elias payloads, {name}", lambda: K.gather_chain(d_buf, 4, 16, 12),
                K.gather_chain(buf, 4, 16, 12))
    # Every launch, allocation and copy of every codec goes to the stream of K.launch_stream, and
    # scratch memory comes from its allocator.
    scope_stream[0], scope_allocator[0] = cuda.stream(), framework_allocator
    for name, codec, residual in [("qsgd-4", qsgd, None), ("qsgd-4 elias", QSGDCodec(bits=4, encoding="elias"), None),
                                  ("topk-1%", topk, np.zeros(x.size, np.float32)),
                                  ("gaussiank-1%", TopKCodec(ratio=0.01, selector="gaussian"),
                                   np.zeros(x.size, np.float32)),
                                  ("randomk-1% fp16", RandomKCodec(ratio=0.01, value_dtype="float16"), None)]:
        encode_case(f"on a stream: {name} encode", codec, x, residual=residual)
        decode_case(f"on a stream: {name} decode of 3 ranks", codec, rows, residual=residual is not None)
    encode_many_case("on a stream: topk-5% encode_many of 3 tensors", TopKCodec(ratio=0.05), [1001, 30, 7],
                     residuals=True)
    lattice = LatticeCodec(bits=8)
    cap = lattice.max_payload_nbytes(x.size)
    d_x, d_ref, d_out, d_payload = device(x), device(x + 0.01), device(np.zeros(x.size, np.float32)), \
        device(np.zeros(cap, np.uint8))
    host_payload, expected = np.zeros(cap, np.uint8), np.zeros(x.size, np.float32)
    lattice.encode(x, host_payload, eps=1e-3, step=1, key=2)
    lattice.decode(host_payload, x + 0.01, expected)
    measure("on a stream: lattice encode and decode",
            lambda: (lattice.encode(d_x, d_payload, eps=1e-3, step=1, key=2), lattice.decode(d_payload, d_ref, d_out),
                     d_out)[2], expected)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
