"""Base revisions against the working tree, interleaved: step, encode and decode time ratios from one run.

    python benchmarks/paired.py --base main
    python benchmarks/paired.py --base df9f74d,main --compressors qsgd-4bit,topk-1% --model mlp10m --rate none \
        --rounds 5 --out benchmarks/results/paired/my-change

Run it before landing anything on a hot path (compress and decompress, an exchange, a codec, a kernel): the
VM's speed drifts by up to 30% between hours, so a revision is only ever compared with runs taken beside it.

Each base revision is exported from git (``git archive``) into a temporary directory; each side runs its own
copy of the synthetic benchmark under ``horovodrun``, which imports the ``horovod_qsgd`` of its own tree (the
benchmark puts its tree first on ``sys.path``; this script checks where the package came from before timing
anything). All sides share the installed Horovod and frameworks. Each round runs every compressor once on
each side, the order of the sides reversed every other round (ABBA), in a fresh network namespace shaped
to ``--rate`` as ``benchmarks/compare.py`` does.

Prints, per base and compressor, the ratio working tree / base of the median step, encode and decode seconds
(below 1: the working tree is faster) with every round's values, and writes them to ``--out/paired.json`` with
the revisions measured.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks import netlab  # noqa: E402
from benchmarks.compare import ONE_THREAD_ENV  # noqa: E402
from benchmarks.compressors import benchmark_flags, names_argument  # noqa: E402

SCRIPTS = {"pytorch": "pytorch_synthetic_benchmark.py", "tensorflow": "tensorflow_synthetic_benchmark.py"}
MEASURES = (("step", "step_seconds"), ("encode", "encode_seconds_per_step"), ("decode", "decode_seconds_per_step"))


def git(*args):
    return subprocess.run(["git", "-C", ROOT, *args], check=True, capture_output=True, text=True).stdout.strip()


def export(revision, into):
    """The tree of ``revision`` written under ``into``; returns (its directory, the full commit)."""
    try:
        commit = git("rev-parse", "--verify", f"{revision}^{{commit}}")
    except subprocess.CalledProcessError:
        raise SystemExit(f"paired: {revision!r} is not a commit of {ROOT}; give a commit, tag or branch of its "
                         "history (a shallow clone may need 'git fetch --unshallow')")
    tree = os.path.join(into, commit[:12])
    if os.path.isdir(tree):  # the same revision named twice
        return tree, commit
    os.makedirs(tree)
    archive = subprocess.run(["git", "-C", ROOT, "archive", commit], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
    return tree, commit


def working_tree_commit():
    """HEAD's commit, with '+changes' where the working tree differs from it."""
    commit = git("rev-parse", "HEAD")
    return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def check_imports_from(tree):
    """Fails unless a script of ``tree`` imports horovod_qsgd from ``tree`` (an install that shadows sys.path would
    time the same code twice)."""
    found = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import horovod_qsgd;"
                            " print(horovod_qsgd.__file__)", tree], check=True, capture_output=True,
                           text=True).stdout.strip()
    if not os.path.realpath(found).startswith(os.path.realpath(tree) + os.sep):
        raise SystemExit(f"paired: a script in {tree} imports horovod_qsgd from {found}; uninstall that copy or "
                         "install this one in editable mode (pip install -e .)")


def measure(tree, framework, name, args, shaped):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        job = [*netlab.HOROVODRUN, "-np", str(args.ranks), "-H", f"localhost:{args.ranks}", "--gloo", sys.executable,
               os.path.join(tree, "benchmarks", SCRIPTS[framework]), "--model", args.model,
               "--batch-size", str(args.batch_size), "--num-iters", str(args.num_iters),
               "--num-batches-per-iter", str(args.num_batches_per_iter), "--json-out", out, *benchmark_flags(name)]
        netlab.run_horovod_job(job, args.rate, shaped=shaped, env=ONE_THREAD_ENV, timeout=args.timeout,
                               what=f"{framework} {name} in {tree}")
        with open(out) as f:
            result = json.load(f)
    return {label: result[key] for label, key in MEASURES}


def ratio_rows(runs, bases, compressors, frameworks):
    """Per base, framework and compressor: each measure's median ratio (working tree / base) and every round's
    values."""
    rows = []
    for base_commit in bases:
        for framework in frameworks:
            for name in compressors:
                mine = [r for r in runs if r["framework"] == framework and r["compressor"] == name]
                row = {"base": base_commit, "framework": framework, "compressor": name}
                for label, _ in MEASURES:
                    base = [r[label] for r in mine if r["side"] == base_commit]
                    work = [r[label] for r in mine if r["side"] == "work"]
                    row[label] = {"base": base, "work": work,
                                  "ratio": statistics.median(work) / statistics.median(base)
                                  if statistics.median(base) > 0 else None}
                rows.append(row)
    return rows


def print_rows(rows, work_commit):
    for row in rows:
        work = work_commit[:12] + ("+changes" if work_commit.endswith("+changes") else "")
        print(f"\nworking tree {work} / base {row['base'][:12]}, {row['framework']} {row['compressor']}: "
              "ratio of medians (below 1: faster), then each round's seconds per step, base | working tree")
        for label, _ in MEASURES:
            values = row[label]
            ratio = "-" if values["ratio"] is None else f"{values['ratio']:.3f}"
            print(f"  {label:<7} {ratio:>6}   " + " ".join(f"{v:.4f}" for v in values["base"]) + " | "
                  + " ".join(f"{v:.4f}" for v in values["work"]))
    sys.stdout.flush()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True,
                        help="the revisions to compare against (commits, tags, branches), comma-separated")
    parser.add_argument("--compressors", type=names_argument, default=names_argument("none,qsgd-4bit,topk-1%"))
    parser.add_argument("--frameworks", default="pytorch", help="pytorch, tensorflow or both, comma-separated")
    parser.add_argument("--model", default="mlp25m")
    parser.add_argument("--rate", default="1gbit", help="the namespace loopback's tc rate; 'none' for unshaped")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--num-batches-per-iter", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--out", help="directory for paired.json (none: print only)")
    args = parser.parse_args()
    frameworks = args.frameworks.split(",")
    if set(frameworks) - set(SCRIPTS):
        parser.error(f"unknown framework(s) in {args.frameworks!r}; use pytorch and/or tensorflow")
    reason = netlab.unavailable_reason()
    if reason is not None:
        print(f"note: {reason}; running unshaped on the host loopback")
        args.rate = "none"
    with tempfile.TemporaryDirectory(prefix="paired-") as tmp:
        sides = {commit: tree for tree, commit in (export(base, tmp) for base in args.base.split(","))}
        bases = list(sides)
        sides["work"] = ROOT
        work_commit = working_tree_commit()
        for tree in sides.values():
            check_imports_from(tree)
        runs = []
        for round_index in range(args.rounds):
            order = list(sides) if round_index % 2 == 0 else list(sides)[::-1]
            for framework in frameworks:
                for name in args.compressors:
                    for side in order:
                        print(f"round {round_index + 1}/{args.rounds}: {framework} {name}, {side[:12]}", flush=True)
                        runs.append(dict(measure(sides[side], framework, name, args, reason is None),
                                         side=side, round=round_index, framework=framework, compressor=name))
    rows = ratio_rows(runs, bases, args.compressors, frameworks)
    print_rows(rows, work_commit)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        record = {"bases": bases, "work": work_commit, "command": " ".join(sys.argv), "model": args.model,
                  "rate": args.rate, "ranks": args.ranks, "rounds": args.rounds, "cores": os.cpu_count(),
                  "rows": rows, "runs": runs}
        with open(os.path.join(args.out, "paired.json"), "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
