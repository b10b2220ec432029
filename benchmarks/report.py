"""Plots and crossover bandwidths from the results of benchmarks/compare.py.

    python benchmarks/report.py benchmarks/results/latest/results.json

Writes, next to the results file, per framework: ``throughput_<framework>.png``
(total img/s against link rate, one line per compressor),
``bytes_<framework>.png`` (wire bytes per step), and ``crossover_<framework>.csv``.

Crossover: the link rate below which a compressor beats uncompressed. A
step is modelled as ``T(B) = a + w / B``: ``w`` is the measured wire bytes
per step, ``a`` the step time on the unshaped loopback (compute, encoding,
Horovod's own latency). Equal times give ``B* = (w_none - w) / (a - a_none)``;
a compressor whose unshaped step is not slower than uncompressed wins at
every rate (``inf``). The measured speedups at the shaped rates are printed
beside it, so the model can be checked against the runs.
"""
import csv
import json
import math
import os
import sys

_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def rate_bits_per_second(rate):
    """'100mbit' -> 1e8; 'none' (unshaped) -> inf."""
    if rate == "none":
        return math.inf
    for unit, factor in _UNITS.items():
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * factor
    raise ValueError(f"unknown rate {rate!r}; use e.g. 100mbit, 1gbit or none")


def format_rate(bits_per_second):
    if math.isinf(bits_per_second):
        return "any rate"
    if bits_per_second > 1e11:  # step-time differences within noise: the model only says "very fast links"
        return "> 100 Gbit/s"
    if bits_per_second >= 1e9:
        return f"{bits_per_second / 1e9:.1f} Gbit/s"
    return f"{bits_per_second / 1e6:.0f} Mbit/s"


def crossovers(results):
    """[(compressor, crossover bits/s or None, {rate: measured speedup})] for one framework's results."""
    by_name = {}
    for r in results:
        by_name.setdefault(r["name"], {})[r["rate"]] = r
    none = by_name.get("none", {})
    if "none" not in none:
        return []
    a_none, w_none = none["none"]["step_seconds"], none["none"]["wire_bytes_per_step"]
    rows = []
    for name, runs in by_name.items():
        if name == "none" or "none" not in runs:
            continue
        a, w = runs["none"]["step_seconds"], runs["none"]["wire_bytes_per_step"]
        if w >= w_none:
            crossover = None  # sends no fewer bytes: never wins on a slow link
        elif a <= a_none:
            crossover = math.inf
        else:
            crossover = 8 * (w_none - w) / (a - a_none)
        speedups = {rate: run["img_sec_total"] / none[rate]["img_sec_total"]
                    for rate, run in runs.items() if rate in none}
        rows.append((name, crossover, speedups))
    return rows


def _plot_throughput(results, framework, path, plt):
    shaped = sorted({r["rate"] for r in results if r["rate"] != "none"}, key=rate_bits_per_second)
    rates = shaped + (["none"] if any(r["rate"] == "none" for r in results) else [])
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name in dict.fromkeys(r["name"] for r in results):
        points = {r["rate"]: r["img_sec_total"] for r in results if r["name"] == name}
        xs = [i for i, rate in enumerate(rates) if rate in points]
        ax.plot(xs, [points[rates[i]] for i in xs], marker="o", label=name,
                linestyle="--" if name == "none" else "-")
    ax.set_xticks(range(len(rates)), [("unshaped" if r == "none" else r) for r in rates])
    ax.set_yscale("log")
    ax.set_xlabel("loopback rate (shared by both directions)")
    ax.set_ylabel("total img/s, 2 ranks")
    ax.set_title(f"{framework}: throughput vs link rate")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_bytes(results, framework, path, plt):
    per_name = {}
    for r in results:
        per_name.setdefault(r["name"], []).append(r["wire_bytes_per_step"] / 1e6)
    names = list(per_name)
    medians = [sorted(v)[len(v) // 2] for v in per_name.values()]
    fig, ax = plt.subplots(figsize=(7.5, 4.0))
    ax.bar(range(len(names)), medians)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("MB on the wire per step (both ranks)")
    ax.set_title(f"{framework}: bytes per step, measured in the namespace")
    for i, m in enumerate(medians):
        ax.text(i, m, f"{m:.2f}", ha="center", va="bottom", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(results, out_dir):
    """Plots and crossover CSVs for each framework in ``results``; prints the crossover table."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    for framework in dict.fromkeys(r["framework"] for r in results):
        mine = [r for r in results if r["framework"] == framework]
        _plot_throughput(mine, framework, os.path.join(out_dir, f"throughput_{framework}.png"), plt)
        _plot_bytes(mine, framework, os.path.join(out_dir, f"bytes_{framework}.png"), plt)
        rows = crossovers(mine)
        if not rows:
            print(f"{framework}: no unshaped 'none' run, so no crossover estimate")
            continue
        rates = sorted({rate for _, _, s in rows for rate in s}, key=rate_bits_per_second)
        print(f"\n{framework}: crossover (model T = a + w/B) and measured speedup vs none")
        print(f"{'compressor':<15} {'wins below':>14} " + " ".join(f"{r:>8}" for r in rates))
        with open(os.path.join(out_dir, f"crossover_{framework}.csv"), "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["compressor", "crossover_bits_per_second"] + [f"speedup_{r}" for r in rates])
            for name, crossover, speedups in rows:
                shown = "never" if crossover is None else format_rate(crossover)
                print(f"{name:<15} {shown:>14} " +
                      " ".join(f"{speedups[r]:>7.2f}x" if r in speedups else f"{'-':>8}" for r in rates))
                writer.writerow([name, "" if crossover is None else crossover] +
                                [speedups.get(r, "") for r in rates])


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        results = json.load(f)
    write(results, os.path.dirname(os.path.abspath(sys.argv[1])))


if __name__ == "__main__":
    main()
