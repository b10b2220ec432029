"""Compile every CUDA kernel for real GPUs, without a GPU: the compile gate CI runs.

numba's CUDA simulator (``scripts/cuda_check.py`` in CI) runs the kernels as
Python and never compiles them, so a kernel that NVVM rejects would first
fail on a user's GPU. This script:

1. runs ``scripts/cuda_check.py`` and the lattice codec's simulator check in
   the simulator (a subprocess with ``NUMBA_ENABLE_CUDASIM=1``), recording
   the argument types of every kernel launch;
2. fails if a kernel of :mod:`horovod_qsgd.kernels` was never launched there
   (its argument types would be unknown);
3. compiles every (kernel, argument types) with numba-cuda to PTX for each
   compute capability (``--cc``, default 8.0 and 9.0: A100 and H100), with
   no device: numba's current-device query is answered with that capability;
4. assembles the PTX with ``ptxas -v`` (from the ``nvidia-cuda-nvcc`` wheel)
   and reads registers, spill stores and loads, stack frame and shared
   memory per thread block;
5. exits 1 on any compile or assembly error or any spilled byte, 0
   otherwise, and writes the table (``--table``).

Needs the ``gpu-compile`` extra: numba-cuda with NVVM and the CUDA compiler
wheels, no driver. ``scripts/test.sh`` installs it in a venv of its own,
``.venv-gpu-compile`` (numba-cuda replaces ``numba.cuda`` where it is
installed, and its simulator is several times slower than numba's own).
Takes about 1.5 minutes, mostly the simulator.

    .venv-gpu-compile/bin/python scripts/gpu_compile_check.py [--cc 8.0 9.0] [--table FILE]

The tests split it: step 1 with the test environment's numba
(``NUMBA_ENABLE_CUDASIM=1 python scripts/gpu_compile_check.py --record FILE``),
steps 2-5 in the venv (``--launches FILE``).
"""
import argparse
import importlib
import os
import pickle
import pkgutil
import platform
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MISSING = ("the GPU compile check needs numba-cuda with NVVM and ptxas from the CUDA compiler wheels: run it "
           "with .venv-gpu-compile/bin/python (scripts/test.sh creates it), or `pip install -e '.[gpu-compile]'` "
           "(no GPU or driver needed)")
# Registers per SM on sm_80 and sm_90, and the most warps an SM holds: what register use costs in occupancy.
SM_REGISTERS, SM_MAX_WARPS = 65536, 64
SIMULATED_CHECKS = [os.path.join(ROOT, "scripts", "cuda_check.py"),
                    os.path.join(ROOT, "tests", "swarm", "cudasim_lattice.py")]


# -------------------------------------------------------- 1. record launches (in the simulator) --

def record(path):
    """Runs the simulator checks with every kernel launch's argument types recorded; pickles them to ``path``."""
    import runpy

    import numba
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    from horovod_qsgd.kernels import _dual

    launched = {}
    configure = _dual.cuda_kernel.blocks

    def argument_type(value):
        return numba.typeof(value._ary if isinstance(value, FakeCUDAArray) else value)

    def recording_blocks(kernel, grid, block):
        launch = configure(kernel, grid, block)

        def run(*args):
            signature = tuple(argument_type(a) for a in args)
            launched.setdefault((kernel.fn.__module__, kernel.fn.__qualname__), set()).add(signature)
            return launch(*args)
        return run

    _dual.cuda_kernel.blocks = recording_blocks
    sys.setswitchinterval(0.0002)  # the simulator's threads wait on GIL switches at every barrier (transfers_check)
    for script in SIMULATED_CHECKS:
        sys.argv = [script]
        status = runpy.run_path(script)["main"]()
        if status:
            raise SystemExit(f"{script} failed in the simulator (exit {status}); fix that first")
    with open(path, "wb") as f:
        pickle.dump({key: sorted(sigs, key=str) for key, sigs in launched.items()}, f)


def recorded_launches(path):
    """{(module, kernel name): [argument types]} from a simulator run in a subprocess, pickled to ``path``."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    subprocess.run([sys.executable, os.path.abspath(__file__), "--record", path], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return load_launches(path)


def load_launches(path):
    with open(path, "rb") as f:
        return pickle.load(f)


# ------------------------------------------------------------------ 2. every kernel, launched --

def all_kernels():
    """{(module, name): cuda_kernel} of every CUDA kernel in horovod_qsgd.kernels."""
    from horovod_qsgd import kernels
    from horovod_qsgd.kernels._dual import cuda_kernel

    found = {}
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{info.name}")
        for value in vars(module).values():
            if isinstance(value, cuda_kernel) and value.fn.__module__ == module.__name__:
                found[(module.__name__, value.fn.__qualname__)] = value
    return found


# ------------------------------------------------------------------- 3-4. compile and assemble --

def find_ptxas():
    try:
        from cuda.pathfinder import find_nvidia_binary_utility
    except ImportError:
        return None
    return find_nvidia_binary_utility("ptxas")


def answer_device_query(cc):
    """numba-cuda compiles a kernel's device functions for the current device: here there is none."""
    from numba.cuda import compiler, dispatcher

    class NamedGPU:
        compute_capability = cc

    for module in (compiler, dispatcher):
        module.get_current_device = NamedGPU


def fresh_device_functions():
    """Forgets the compiled CUDA twins of the cores: a device function keeps the capability it was built for."""
    from horovod_qsgd.kernels import _dual
    for entry in _dual._REGISTRY.values():
        entry[3] = None


PTXAS_RESOURCES = {
    "registers": r"Used (\d+) registers",
    "spill_stores": r"(\d+) bytes spill stores",
    "spill_loads": r"(\d+) bytes spill loads",
    "stack_frame": r"(\d+) bytes stack frame",
    "smem": r"(\d+) bytes smem",
}


def assemble(ptx, cc, ptxas, extra_args=()):
    """ptxas's resource use of ``ptx`` for sm_XY: a dict of PTXAS_RESOURCES, or raises RuntimeError."""
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "kernel.ptx")
        with open(source, "w") as f:
            f.write(ptx)
        done = subprocess.run([ptxas, f"-arch=sm_{cc[0]}{cc[1]}", "-v", *extra_args, source,
                               "-o", os.path.join(tmp, "kernel.cubin")], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ptxas failed: {done.stderr.strip()}")
    resources = {}
    for name, pattern in PTXAS_RESOURCES.items():
        found = re.findall(pattern, done.stderr)
        resources[name] = max(int(n) for n in found) if found else 0
    return resources


def compile_kernel(kernel, signature, cc, ptxas, extra_ptxas_args=()):
    """A table row for one kernel, signature and capability: its resources, or its error in ``"error"``."""
    from numba import cuda

    from horovod_qsgd.kernels import _dual

    row = {"kernel": f"{kernel.fn.__module__.rsplit('.', 1)[-1]}.{kernel.fn.__qualname__}",
           "cc": f"{cc[0]}.{cc[1]}", "signature": ", ".join(str(t) for t in signature)}
    try:
        ptx, _ = cuda.compile_ptx(_dual._retarget(kernel.fn), signature, cc=cc)
        row.update(assemble(ptx, cc, ptxas, extra_ptxas_args))
    except Exception as error:  # any compile failure is the finding: report it, go on with the others
        message = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", str(error)).split())  # numba colours its errors
        row["error"] = f"{type(error).__name__}: {message[:400]}"
    return row


def problems(row):
    """What fails the gate in a row: a compile error or a spilled byte."""
    if "error" in row:
        return [row["error"]]
    spilled = row["spill_stores"] + row["spill_loads"]
    return [f"{spilled} bytes spilled to local memory"] if spilled else []


def register_limited_warps(registers):
    """Warps per SM that registers allow (allocated per thread in units of 8), capped at the SM's maximum."""
    per_thread = max(8, -(-registers // 8) * 8)
    return min(SM_MAX_WARPS, SM_REGISTERS // (per_thread * 32))


# ------------------------------------------------------------------------------- 5. the table --

def write_table(path, rows, ccs, elapsed, ptxas):
    import numba
    from numba import cuda

    version = [line for line in subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout.splitlines()
               if "release" in line][-1].split("release", 1)[1].strip()
    lines = [
        "# Every CUDA kernel compiled and assembled for real GPUs, without a GPU",
        "",
        f"Made by `.venv-gpu-compile/bin/python scripts/gpu_compile_check.py --cc {' '.join(ccs)}` (also run by "
        "`tests/kernels/test_gpu_compile.py` in CI)",
        f"on {platform.machine()} {platform.system()}, no GPU: numba {numba.__version__}, numba-cuda "
        f"({cuda.implementation}) {importlib.import_module('numba_cuda').__version__}, ptxas {version}; "
        f"{elapsed:.0f} s.",
        "",
        "Argument types are those of every launch `scripts/cuda_check.py` and the lattice check make in the "
        "simulator; a kernel with two launch signatures has two rows. Registers per thread; spills, stack "
        "frame (local memory) and shared memory in bytes (smem per block, static). *Warps/SM*: how many "
        f"warps the SM can hold at that register use ({SM_MAX_WARPS} is full occupancy; whole blocks may "
        "hold a few less); below 32 the kernel needs its own latency hiding.",
        "",
        "| kernel | cc | registers | warps/SM | spill st/ld | stack | smem | signature |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['kernel']} | {row['cc']} | ERROR | | | | | {row['error']} |")
            continue
        lines.append(f"| {row['kernel']} | {row['cc']} | {row['registers']} | "
                     f"{register_limited_warps(row['registers'])} | {row['spill_stores']}/{row['spill_loads']} | "
                     f"{row['stack_frame']} | {row['smem']} | `{row['signature']}` |")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def check(ccs, table, launches=None, save_launches=None, ptxas_args=()):
    """The gate: 0 when every kernel compiles and assembles for every capability without spilling.

    ``launches``: a recording saved by an earlier run (``save_launches``) instead of a simulator run.
    """
    from numba import cuda
    ptxas = find_ptxas()
    if getattr(cuda, "implementation", None) != "NVIDIA" or ptxas is None:
        print(f"horovod_qsgd: {MISSING}")
        return 2
    start = time.perf_counter()
    if launches:
        launched = load_launches(launches)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            launched = recorded_launches(save_launches or os.path.join(tmp, "launches.pkl"))
    kernels = all_kernels()
    failures = [f"{module}.{name}: never launched by the simulator checks, its argument types are unknown; "
                "add a case that launches it to scripts/cuda_check.py"
                for module, name in sorted(set(kernels) - set(launched))]
    rows = []
    for text in ccs:
        cc = tuple(int(part) for part in text.split("."))
        answer_device_query(cc)
        fresh_device_functions()
        for key in sorted(launched):
            for signature in launched[key]:
                row = compile_kernel(kernels[key], signature, cc, ptxas, ptxas_args)
                rows.append(row)
                failures += [f"{row['kernel']} for cc {row['cc']} ({row['signature']}): {p}" for p in problems(row)]
    if table:
        write_table(table, rows, ccs, time.perf_counter() - start, ptxas)
    compiled = [row for row in rows if "error" not in row]
    print(f"{len(compiled)} of {len(rows)} compiles of {len(kernels)} kernels assembled for cc {', '.join(ccs)}; "
          f"most registers {max((r['registers'] for r in compiled), default=0)}, "
          f"spilled bytes {sum(r['spill_stores'] + r['spill_loads'] for r in compiled)}")
    for failure in failures:
        print("FAIL", failure)
    return 1 if failures else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--cc", nargs="+", default=["8.0", "9.0"], help="compute capabilities (default 8.0 9.0)")
    parser.add_argument("--table", default=os.path.join(ROOT, "benchmarks", "results", "gpu", "kernel_compile.md"),
                        help="where to write the table ('' for nowhere)")
    parser.add_argument("--save-launches", help="keep the recorded launches in this file")
    parser.add_argument("--launches", help="compile the launches a --save-launches run kept (no simulator run)")
    parser.add_argument("--maxrregcount", type=int,
                        help="cap ptxas's registers per thread (to see which kernels would spill)")
    parser.add_argument("--record", metavar="FILE",
                        help="only step 1: run the simulator checks here, recording launches to FILE for --launches "
                             "(needs NUMBA_ENABLE_CUDASIM=1, not the gpu-compile extra; the tests run it with "
                             "numba's own simulator, several times faster than numba-cuda's)")
    args = parser.parse_args()
    if args.record:
        record(args.record)
        return 0
    ptxas_args = () if args.maxrregcount is None else (f"-maxrregcount={args.maxrregcount}",)
    return check(args.cc, args.table, args.launches, args.save_launches, ptxas_args)


if __name__ == "__main__":
    sys.exit(main())
