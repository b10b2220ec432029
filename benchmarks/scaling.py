r"""How step time scales with ranks, per exchange: a cost model fitted to measured runs, then projected.

    python benchmarks/scaling.py benchmarks/results/scaling

reads the ``compare.py --ranks ...`` runs in that directory (``results.json``),
times this machine's codecs with one thread (``codecs.json``, made on first
use; ``--remeasure`` redoes it), fits the model's three machine parameters
to the runs, prints predicted against measured step time for every run, and
projects step time and speedup for N = 2 ... 1024 ranks at 1, 10, 25 and
100 Gbit/s for a 25M- and a 100M-parameter model with a stated compute time
(``projection.csv``, ``crossover.csv``, ``projection_*.png``,
``validation.csv``).

The model of one step on one rank
---------------------------------
Per tensor of ``n`` fp32 elements (``k = ratio * n`` entries for Top-k,
payload ``b(n)`` bytes by the codecs' ``max_payload_nbytes``):

======================  ===========================  ===============================
exchange                 bytes a rank receives         codec work (one thread)
======================  ===========================  ===============================
ring allreduce (none)    ``2 (N-1)/N * 4 n``           none
QSGD allgather           ``(N-1) b(n)``                ``E n + N D n``
QSGD two stages          ``(N-1)/N (b1(n) + b2(n))``   ``E n + D n + E n / N + D n``
Top-k allgather          ``(N-1) b(n)``                ``S n + N A k``
Top-k two stages         ``(N-1)/N (b1(n) + b2(n))``   ``S n + A k + S n / N + A k``
======================  ===========================  ===============================

``E``/``D``: QSGD-4 encode and decode-and-accumulate per coordinate; ``S``:
Top-k 1% selection with error feedback per coordinate; ``A``: sparse
accumulate per sent entry (``codecs.json``). The allgather decodes N
payloads, so its codec work grows with N; the two stages' does not.
Horovod's one-element placeholder allreduce per compressed tensor is counted.

In a cluster (the projections), each rank has a full-duplex link of ``B``:

``T = t_compute + m * codec + received / B + latency * message_steps``

``message_steps``: ``2 (N-1)`` per fused allreduce (64 MiB fusion buffers),
``N-1`` per fused allgather and per alltoall. Horovod does not fuse
alltoalls: the PyTorch adapter fuses the two-stage tensors itself, one
alltoall per 64 MiB of first-stage payload (``fusion_threshold``; exchange
``"two_stage"``), where before it ran one per tensor (``"two_stage_unfused"``,
the measured runs before fusion, and TensorFlow's still). ``m``: the
adapter's cost over the bare codecs (copies, zero fills, residual updates),
fitted below, one per compressor.

On the measuring machine every rank shares ``cores`` cores and one loopback:

``T = t_compute(N) + m * s(N) * codec + N * received / min(B, rho N) + beta * rounds [N > cores]``

* ``t_compute(N)``: measured (``compare.py``: N ranks training without
  exchanging anything, one thread each; 1.3x / 1.6x / 5.8x of one rank alone
  at 2 / 4 / 8 ranks on 2 cores: ranks compete for caches as well as cores).
* ``s(N) = max(1, N / cores)``: the codec work time-shares the cores.
* ``N * received / min(B, rho N)``: every rank's bytes cross the one shaped
  device; ``rho``, the loopback throughput one sending rank reaches (TCP and
  copies on these cores), caps the rate where the shaping is faster.
* ``beta * rounds``, only with more ranks than cores: each separately
  negotiated collective (fused allreduces, fused allgathers, each alltoall)
  waits for every rank's Horovod thread to be scheduled.

``m_qsgd``, ``m_topk``, ``rho``, ``beta`` are fitted to all runs at once
(least squares on log step time).

Compute and communication are added, not overlapped: Horovod overlaps the
allreduce of late layers with the backward pass of early ones, which makes
uncompressed jobs faster than modelled and compression's gain smaller where
the link time is below the backward time. The benchmark's MLP has three
large layers and overlaps little. Codec costs in the projections are this
machine's CPU, one thread per rank, times the fitted ``m``: nothing here was
measured on a GPU; ``codec = 0`` (a free codec) bounds what a faster device
could reach.
"""
import argparse
import csv
import functools
import json
import math
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.compressors import SPECS  # noqa: E402

FUSION_BYTES = 64 * 1024 * 1024      # Horovod's default fusion buffer
CODEC_SIZE = 1 << 21                 # elements per tensor the codecs are timed at
RANKS = [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
RATES_GBIT = [1, 10, 25, 100]
# The projected models: parameters in tensors of 2^20 elements (a transformer's or ResNet's larger
# layers), and a stated compute time per step (forward + backward on one device).
MODELS = {"25M": (24, 0.100), "100M": (96, 0.400)}
PROJECTED = [("none", None), ("qsgd-4bit", "allgather"), ("qsgd-4bit", "two_stage"), ("qsgd-4bit", "two_stage_unfused"),
             ("topk-1%", "allgather"), ("topk-1%", "two_stage"), ("topk-1%", "two_stage_unfused")]


# ----------------------------------------------------------------------------- codec costs

def measure_codecs(size=CODEC_SIZE, reps=7):
    """Seconds per coordinate (per sent entry for "sparse_accumulate") of each codec step, one thread."""
    from benchmarks.kernel_benchmark import timeit
    from horovod_qsgd import kernels
    from horovod_qsgd.codecs import QSGDCodec, TopKCodec
    kernels.set_cpu_threads(1)
    x = np.random.default_rng(0).standard_normal(size).astype(np.float32)

    def median_seconds(fn):
        return timeit(fn, reps)[0]

    costs = {}
    qsgd = QSGDCodec(bits=4, bucket_size=512)
    payload = np.zeros(qsgd.max_payload_nbytes(size), np.uint8)
    used = qsgd.encode(x, payload, step=0, key=1)
    acc = np.zeros(size, np.float32)
    costs["qsgd_encode"] = median_seconds(lambda: qsgd.encode(x, payload, step=1, key=1)) / size
    costs["qsgd_decode_accumulate"] = median_seconds(lambda: qsgd.decode_accumulate(payload[:used], acc)) / size
    topk = TopKCodec(ratio=0.01)
    payload = np.zeros(topk.max_payload_nbytes(size), np.uint8)
    residual = np.zeros(size, np.float32)
    costs["topk_select"] = median_seconds(lambda: topk.encode(x, payload, step=1, key=1, residual=residual)) / size
    used = topk.encode(x, payload, step=1, key=1, residual=residual)
    k = max(1, int(0.01 * size))
    costs["sparse_accumulate"] = median_seconds(lambda: topk.decode_accumulate(payload[:used], acc)) / k
    return costs


def codec_seconds(costs, name, exchange, n, ranks):
    """One rank's codec time for one tensor of ``n`` elements (see the module docstring's table)."""
    kind = SPECS[name][0]
    encode = {"QSGD": costs["qsgd_encode"], "TopK": costs["topk_select"]}.get(kind)
    if encode is None:
        return 0.0
    e, d = encode * n, decode_seconds(costs, name, n)
    return e + ranks * d if exchange == "allgather" else e + d + e / ranks + d


def decode_seconds(costs, name, n):
    """One rank's time to decode one payload of ``n`` elements into a sum."""
    kind, kwargs = SPECS[name]
    if kind == "QSGD":
        return costs["qsgd_decode_accumulate"] * n
    if kind == "TopK":
        return costs["sparse_accumulate"] * kwargs["ratio"] * n
    return 0.0


# ----------------------------------------------------------------------------- bytes and messages

@functools.lru_cache(maxsize=None)
def _codecs(name):
    import horovod_qsgd.torch as adapter
    from benchmarks.compressors import build
    compressor = build(name, adapter)
    return compressor, compressor.codec, compressor.second_codec


def tensor_traffic(name, exchange, n, ranks, fused=True):
    """(bytes a rank receives, on average over ranks, [(collective, bytes)], exchange taken or None when the
    tensor goes through Horovod's allreduce) for one tensor of ``n`` elements.

    An alltoall's bytes are the first-stage payload's capacity over all chunks (what fusion packs by);
    unfused, it is an ``"alltoall_alone"``."""
    from horovod_qsgd.common.chunks import chunk_bounds, chunk_unit
    from horovod_qsgd.common.two_stage import TwoStage, choose_exchange, stage_nbytes
    ring = 2 * (ranks - 1) / ranks * 4 * n, [("allreduce", 4 * n)], None
    if name == "none":
        return ring
    compressor, first, second = _codecs(name)
    if n < compressor.min_numel:
        return ring
    alltoall = "alltoall" if fused else "alltoall_alone"
    chosen = choose_exchange(exchange, first, second, n, ranks)
    placeholder = 2 * (ranks - 1) / ranks * 4  # the one-element allreduce Horovod's protocol needs
    if chosen == "allgather":
        b = first.max_payload_nbytes(n)
        return placeholder + (ranks - 1) * b, [("allreduce", 4), ("allgather", b)], chosen
    first_stage, second_stage = stage_nbytes(first, second, n, ranks)  # the mean over ranks
    owned = chunk_bounds(n, ranks, chunk_unit(first))[0]
    capacity = TwoStage(first, second, "", n, ranks, 0).payload_capacity()
    return (placeholder + first_stage + second_stage,
            [("allreduce", 4), (alltoall, capacity), ("allgather", second.max_payload_nbytes(owned[1] - owned[0]))],
            chosen)


def collective_counts(collectives, ranks):
    """(sequential message steps, separately negotiated collectives) of one step's collectives.

    Horovod fuses allreduces and allgathers into 64 MiB buffers (an allgather's
    holds all N payloads); the adapter packs two-stage tensors into alltoalls of
    64 MiB of first-stage capacity ("alltoall"), or runs one per tensor
    ("alltoall_alone"). A fused allreduce is ``2 (N-1)`` message steps, a fused
    allgather and an alltoall ``N-1`` each.
    """
    def buffers(nbytes):
        return max(1, math.ceil(nbytes / FUSION_BYTES)) if nbytes else 0

    alltoalls = (sum(kind == "alltoall_alone" for kind, _ in collectives)
                 + buffers(sum(b for kind, b in collectives if kind == "alltoall")))
    allreduces = buffers(sum(b for kind, b in collectives if kind == "allreduce"))
    allgathers = buffers(ranks * sum(b for kind, b in collectives if kind == "allgather"))
    return 2 * (ranks - 1) * allreduces + (ranks - 1) * (allgathers + alltoalls), allreduces + allgathers + alltoalls


def step_terms(name, exchange, tensor_sizes, ranks, costs, fused=True):
    """(codec seconds, bytes received per rank, message steps, collective rounds) of one step.

    ``exchange``: as the compressors take it, or ``"two_stage_unfused"`` (one alltoall per tensor, as
    ``fused=False`` makes of any two-stage tensor)."""
    if exchange == "two_stage_unfused":
        exchange, fused = "two_stage", False
    codec, received, collectives = 0.0, 0.0, []
    for n in tensor_sizes:
        r, c, chosen = tensor_traffic(name, exchange, n, ranks, fused)
        received += r
        collectives += c
        if chosen is not None:
            codec += codec_seconds(costs, name, chosen, n, ranks)
    return (codec, received, *collective_counts(collectives, ranks))


# ----------------------------------------------------------------------------- the measured runs

def measured_runs(results_dir):
    with open(os.path.join(results_dir, "results.json")) as f:
        runs = json.load(f)
    from benchmarks.models_torch import build_model
    from benchmarks.report import rate_bits_per_second
    sizes = {}
    rows = []
    for r in runs:
        if r["model"] not in sizes:
            sizes[r["model"]] = [p.numel() for p in build_model(r["model"]).parameters()]
        rows.append(dict(r, tensor_sizes=sizes[r["model"]], rate_bps=rate_bits_per_second(r["rate"])))
    return rows


def fused_run(row):
    """Whether a measured run's compressor fused its two-stage tensors (runs from before fusion did not)."""
    compressor = row.get("compressor", "")
    return "fusion_threshold=" in compressor and "fusion_threshold=0," not in compressor + ","


PARAMETERS = ["m_qsgd", "m_topk", "rho", "beta"]
START, LOW, HIGH = [2.0, 2.0, 1.0, 0.05], [0.2, 0.2, 0.05, 1e-5], [20.0, 20.0, 100.0, 2.0]


def codec_multiplier(name, params):
    """The fitted factor from the bare codecs' cost to the adapter's (copies, zero fills, residual updates)."""
    kind = SPECS[name][0]
    return params[0] if kind == "QSGD" else params[1] if kind == "TopK" else 0.0


def predict_measured(row, costs, params):
    """Step time of a measured run: all ranks on ``cores`` cores and one shared loopback (PARAMETERS' order)."""
    m_qsgd, m_topk, rho, beta = params
    exchange = "auto" if row["exchange"] == "-" else row["exchange"]
    codec, received, steps, rounds = step_terms(row["configuration"], exchange, row["tensor_sizes"], row["ranks"],
                                                costs, fused_run(row))
    shared = max(1.0, row["ranks"] / row["cores"])
    link = row["ranks"] * received * 8 / min(row["rate_bps"], rho * 1e9 * row["ranks"])
    coordination = beta * rounds if row["ranks"] > row["cores"] else 0.0
    return (row["compute_shared_seconds"] + codec_multiplier(row["configuration"], params) * shared * codec
            + link + coordination)


def fit(rows, costs):
    """PARAMETERS minimising the squared log error of the predicted step times."""
    from scipy.optimize import least_squares
    measured = np.log([r["step_seconds"] for r in rows])

    def residuals(log_params):
        params = np.exp(log_params)
        return np.log([predict_measured(r, costs, params) for r in rows]) - measured

    solution = least_squares(residuals, np.log(START), bounds=(np.log(LOW), np.log(HIGH)))
    return tuple(float(v) for v in np.exp(solution.x))


def replicate_spread(rows):
    """Largest relative difference between two runs of the same exchange (auto and the one it chose)."""
    spread = 0.0
    for r in rows:
        if r["exchange"] != "auto":
            continue
        chosen = set(r.get("exchanges_used") or {})
        for other in rows:
            if (other["configuration"], other["ranks"], other["rate"]) == (r["configuration"], r["ranks"], r["rate"]) \
                    and other["exchange"] in chosen and len(chosen) == 1:
                spread = max(spread, abs(r["step_seconds"] / other["step_seconds"] - 1))
    return spread


# ----------------------------------------------------------------------------- projection

def projected_terms(costs, params, models=MODELS, ranks_list=RANKS):
    """{(model, ranks, configuration, exchange): (compute, codec, bytes received per rank, message steps, rounds)};
    codec seconds with the adapter's fitted multiplier."""
    terms = {}
    for model, (tensors, compute) in models.items():
        sizes = [1 << 20] * tensors
        for ranks in ranks_list:
            for name, exchange in PROJECTED:
                codec, received, steps, rounds = step_terms(name, exchange or "allgather", sizes, ranks, costs)
                terms[(model, ranks, name, exchange)] = (compute, codec_multiplier(name, params) * codec, received,
                                                         steps, rounds)
    return terms


def cluster_step_seconds(term, gbit, latency_seconds, codec_scale=1.0):
    """A rank's step with a full-duplex link of its own: compute + codec + bytes / rate + latency."""
    fixed, received = _fixed_and_bytes(term, latency_seconds, codec_scale)
    return fixed + received * 8 / (gbit * 1e9)


def project(terms, latency_seconds, rates=RATES_GBIT, codec_scale=1.0):
    """[{model, ranks, gbit, configuration, exchange, step_seconds, speedup}] for a cluster: a link per rank."""
    rows = []
    for (model, ranks, name, exchange), term in terms.items():
        for gbit in rates:
            t = cluster_step_seconds(term, gbit, latency_seconds, codec_scale)
            base = cluster_step_seconds(terms[(model, ranks, "none", None)], gbit, latency_seconds)
            rows.append(dict(model=model, ranks=ranks, gbit=gbit, configuration=name,
                             exchange=exchange or "ring allreduce", step_seconds=t, speedup=base / t))
    return rows


def crossover_gbit(terms, latency_seconds, model, ranks, name, exchange, codec_scale=1.0):
    """Link rate (Gbit/s) below which the compressor beats uncompressed: inf if always, 0 if never.

    Both steps are ``a + 8 r / B``, so they cross at ``B = 8 (r_none - r) / (a - a_none)``.
    """
    a_none, r_none = _fixed_and_bytes(terms[(model, ranks, "none", None)], latency_seconds, 1.0)
    a, r = _fixed_and_bytes(terms[(model, ranks, name, exchange)], latency_seconds, codec_scale)
    if r >= r_none:
        return 0.0 if a >= a_none else math.inf
    if a <= a_none:
        return math.inf
    return 8 * (r_none - r) / (a - a_none) / 1e9


def _fixed_and_bytes(term, latency_seconds, codec_scale):
    """(the step's seconds that do not depend on the link rate, bytes received) of a projected term."""
    compute, codec, received, steps, _ = term
    return compute + codec_scale * codec + latency_seconds * steps, received


def plot(rows, out_dir, suffix="", codecs_note="this CPU's codecs, one thread per rank"):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    for model in dict.fromkeys(r["model"] for r in rows):
        fig, axes = plt.subplots(1, len(RATES_GBIT), figsize=(4 * len(RATES_GBIT), 3.8), sharey=True)
        for ax, gbit in zip(axes, RATES_GBIT):
            for name, exchange in PROJECTED[1:]:
                mine = [r for r in rows if r["model"] == model and r["gbit"] == gbit and
                        r["configuration"] == name and r["exchange"] == exchange]
                ax.plot([r["ranks"] for r in mine], [r["speedup"] for r in mine], marker="o", markersize=3,
                        label=f"{name} {exchange}",
                        linestyle={"two_stage": "-", "two_stage_unfused": ":"}.get(exchange, "--"))
            ax.axhline(1.0, color="grey", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{gbit} Gbit/s per rank")
            ax.set_xlabel("ranks")
        axes[0].set_ylabel("speedup over uncompressed (model)")
        axes[0].legend(fontsize=7)
        tensors, compute = MODELS[model]
        fig.suptitle(f"{model} parameters, {compute * 1e3:.0f} ms compute per step, {codecs_note}")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, f"projection_{model}{suffix}.png"), dpi=100)
        plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="a directory with compare.py --ranks ... results.json")
    parser.add_argument("--remeasure", action="store_true", help="time the codecs again")
    parser.add_argument("--latency-us", type=float, default=25.0, help="per-message latency in the projection")
    args = parser.parse_args()

    codecs_path = os.path.join(args.results, "codecs.json")
    if args.remeasure or not os.path.exists(codecs_path):
        with open(codecs_path, "w") as f:
            json.dump(measure_codecs(), f, indent=1)
    with open(codecs_path) as f:
        costs = json.load(f)
    print("codec costs, one thread (ns per coordinate; sparse accumulate per sent entry): " +
          ", ".join(f"{k} {v * 1e9:.2f}" for k, v in costs.items()))

    rows = measured_runs(args.results)
    params = fit(rows, costs)
    m_qsgd, m_topk, rho, beta = params
    print(f"fitted: adapter codec cost / bare codec cost: QSGD {m_qsgd:.2f}, Top-k {m_topk:.2f}; loopback "
          f"throughput per sending rank rho = {rho:.2f} Gbit/s; per collective round with more ranks than cores "
          f"beta = {beta * 1e3:.0f} ms")
    print(f"\n{'ranks':>5} {'rate':>7} {'compressor':<24} {'measured s':>10} {'model s':>8} {'error':>7}")
    worst = 0.0
    with open(os.path.join(args.results, "validation.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["ranks", "rate", "compressor", "exchange", "measured_seconds", "model_seconds", "error"])
        for r in rows:
            predicted = predict_measured(r, costs, params)
            error = predicted / r["step_seconds"] - 1
            worst = max(worst, abs(error))
            print(f"{r['ranks']:>5} {r['rate']:>7} {r['name']:<24} {r['step_seconds']:>10.3f} {predicted:>8.3f} "
                  f"{error:>+7.1%}")
            writer.writerow([r["ranks"], r["rate"], r["configuration"], r["exchange"], r["step_seconds"],
                             predicted, error])
    errors = [predict_measured(r, costs, params) / r["step_seconds"] - 1 for r in rows]
    outside = sum(abs(x) > 0.25 for x in errors)
    print(f"largest error {worst:.1%}, root mean square {math.sqrt(np.mean(np.square(errors))):.1%}, "
          f"{outside} of {len(rows)} runs outside 25%; two runs of one exchange (auto and the exchange it "
          f"chose) differ by up to {replicate_spread(rows):.1%}")

    latency = args.latency_us * 1e-6
    terms = projected_terms(costs, params)
    projection = project(terms, latency)
    with open(os.path.join(args.results, "projection.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(projection[0]))
        writer.writeheader()
        writer.writerows(projection)
    for model, (tensors, compute) in MODELS.items():
        print(f"\nprojection, {model} parameters, {compute * 1e3:.0f} ms compute, a {args.latency_us:.0f} us link "
              "per rank, this CPU's codecs: speedup over uncompressed (step s of uncompressed)")
        for gbit in RATES_GBIT:
            print(f"  {gbit} Gbit/s")
            print(f"  {'ranks':>5} {'none s':>8} " + " ".join(f"{n + ' ' + (x or ''):>22}" for n, x in PROJECTED[1:]))
            for ranks in RANKS:
                mine = {(r["configuration"], r["exchange"]): r for r in projection
                        if r["model"] == model and r["gbit"] == gbit and r["ranks"] == ranks}
                base = mine[("none", "ring allreduce")]["step_seconds"]
                print(f"  {ranks:>5} {base:>8.3f} " + " ".join(f"{mine[(n, x)]['speedup']:>21.2f}x"
                                                             for n, x in PROJECTED[1:]))
    with open(os.path.join(args.results, "crossover.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["model", "ranks", "compressor", "exchange", "wins_below_gbit",
                         "wins_below_gbit_free_codec"])
        print("\nlink rate per rank below which a compressor beats uncompressed, Gbit/s: with this CPU's codecs "
              "(one thread) / with a codec that costs nothing (the bytes' bound)")
        print(f"{'model':>5} {'ranks':>5} " + " ".join(f"{n + ' ' + x:>24}" for n, x in PROJECTED[1:]))
        for model in MODELS:
            for ranks in RANKS:
                values = [(crossover_gbit(terms, latency, model, ranks, n, x),
                           crossover_gbit(terms, latency, model, ranks, n, x, codec_scale=0.0))
                          for n, x in PROJECTED[1:]]
                print(f"{model:>5} {ranks:>5} " + " ".join(f"{v:>11.1f} / {free:>10.1f}" for v, free in values))
                for (n, x), (v, free) in zip(PROJECTED[1:], values):
                    writer.writerow([model, ranks, n, x, v, free])
    plot(projection, args.results)
    plot(project(terms, latency, codec_scale=0.0), args.results, "_free_codec",
         "a codec that costs nothing (the bound for a faster device)")


if __name__ == "__main__":
    main()
