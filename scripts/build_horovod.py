#!/usr/bin/env python3
"""Build and install Horovod 0.28.1 for today's PyTorch and TensorFlow (CPU, Gloo).

Horovod 0.28.1 is the last release and does not build as released against
torch >= 2.1, TensorFlow 2.21 or CMake >= 4. This script downloads the sdist
from the package index, applies the three source edits listed below (failing
loudly if a line it edits is not there), builds a wheel and caches it, so the
second run on a machine installs in seconds.

It does nothing when an importable Horovod already has PyTorch, TensorFlow and
Gloo built in and was built against the framework versions installed now.

Usage: python scripts/build_horovod.py [--force] [--cache DIR]

A user with CUDA GPUs builds the NCCL variant with
    HOROVOD_GPU_OPERATIONS=NCCL python scripts/build_horovod.py --force
It needs nvcc (on PATH or in $CUDA_HOME/bin) and NCCL's header and library:
$HOROVOD_NCCL_HOME, /usr, $CUDA_HOME, or the nvidia-nccl-cu12/-cu13 wheel that
PyTorch's CUDA build installs (its unversioned libnccl.so is linked in the
cache). It builds for the visible GPUs' architectures unless
HOROVOD_BUILD_CUDA_CC_LIST is set, and checks nccl_built() afterwards.
"""
import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

HOROVOD_VERSION = "0.28.1"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAMP_NAME = "horovod_qsgd_build.json"

# (file, old text, new text, why). Each old text must occur exactly once.
SOURCE_EDITS = [
    ("horovod/torch/CMakeLists.txt",
     "    set(CMAKE_CXX_STANDARD 14)\n",
     "    set(CMAKE_CXX_STANDARD 17)\n",
     "torch >= 2.1 headers need C++17"),
    ("CMakeLists.txt",
     "set(CMAKE_CXX_STANDARD 14)\n",
     "set(CMAKE_CXX_STANDARD 17)\n",
     "the bundled Gloo must match the torch extension's C++17, or "
     "gloo::rendezvous::Store::kDefaultTimeout is defined twice at link time"),
    ("horovod/tensorflow/CMakeLists.txt",
     'list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")\n',
     "",
     "the TF 2.21 wheel lacks highwayhash headers; xla_mpi_ops only serves GPU XLA"),
]

BUILD_ENV = {
    "HOROVOD_WITH_PYTORCH": "1",
    "HOROVOD_WITH_TENSORFLOW": "1",
    "HOROVOD_WITHOUT_MXNET": "1",
    "HOROVOD_WITHOUT_MPI": "1",
    "HOROVOD_WITH_GLOO": "1",
    "HOROVOD_CPU_OPERATIONS": "gloo",
    # cmake >= 4 refuses the bundled Gloo's cmake_minimum_required otherwise.
    "CMAKE_POLICY_VERSION_MINIMUM": "3.5",
}


def log(msg):
    print(f"[build_horovod] {msg}", flush=True)


def framework_versions():
    code = ("import json, torch, tensorflow as tf;"
            "print(json.dumps({'torch': torch.__version__, 'tensorflow': tf.__version__}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    if out.returncode != 0:
        sys.exit("build_horovod: PyTorch and TensorFlow must be installed before Horovod is "
                 "built (its build imports them).\n" + out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def build_key(versions):
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    gpu = os.environ.get("HOROVOD_GPU_OPERATIONS", "cpu").lower()
    return f"horovod-{HOROVOD_VERSION}-{py}-torch{versions['torch']}-tf{versions['tensorflow']}-{gpu}"


def nccl_wanted():
    return os.environ.get("HOROVOD_GPU_OPERATIONS", "").upper() == "NCCL"


def installed_build(versions):
    """Returns why the installed Horovod is unusable, or None when it is fine."""
    code = r"""
import json, os, horovod, horovod.torch as ht, horovod.tensorflow as htf
stamp = os.path.join(os.path.dirname(horovod.__file__), %r)
print(json.dumps({
    "version": horovod.__version__,
    "torch": ht.gloo_built(), "tensorflow_ops": htf.gloo_built(), "nccl": ht.nccl_built(),
    "stamp": json.load(open(stamp)) if os.path.exists(stamp) else None}))
""" % STAMP_NAME
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    if out.returncode != 0:
        return "no importable Horovod with torch and tensorflow support"
    info = json.loads(out.stdout.strip().splitlines()[-1])
    if info["version"] != HOROVOD_VERSION:
        return f"Horovod {info['version']} is installed, {HOROVOD_VERSION} is wanted"
    if not (info["torch"] and info["tensorflow_ops"]):
        return "the installed Horovod lacks Gloo for torch or tensorflow"
    if nccl_wanted() and not info["nccl"]:
        return "HOROVOD_GPU_OPERATIONS=NCCL asks for NCCL, the installed Horovod has none (nccl_built() is false)"
    stamp = info["stamp"]
    if stamp and (stamp.get("torch"), stamp.get("tensorflow")) != (versions["torch"], versions["tensorflow"]):
        return (f"Horovod was built against torch {stamp.get('torch')} / TF {stamp.get('tensorflow')}, "
                f"installed are {versions['torch']} / {versions['tensorflow']}")
    return None


def _nccl_home(cache_dir):
    """(include dir, lib dir) of NCCL, with an unversioned libnccl.so; exits naming what is missing."""
    candidates = [os.environ.get("HOROVOD_NCCL_HOME"), "/usr", os.environ.get("CUDA_HOME")]
    try:
        import nvidia.nccl  # the wheel PyTorch's CUDA build depends on
        candidates.append(list(nvidia.nccl.__path__)[0])
    except ImportError:
        pass
    for home in filter(None, candidates):
        include = os.path.join(home, "include")
        libs = [d for d in (os.path.join(home, "lib"), os.path.join(home, "lib64"),
                            os.path.join(home, "lib", "x86_64-linux-gnu"))
                if glob.glob(os.path.join(d, "libnccl.so*"))]
        if not (os.path.exists(os.path.join(include, "nccl.h")) and libs):
            continue
        if os.path.exists(os.path.join(libs[0], "libnccl.so")):
            return include, libs[0]
        # only libnccl.so.2 (the wheel): the linker needs the unversioned name
        link_dir = os.path.join(cache_dir, "nccl-lib")
        os.makedirs(link_dir, exist_ok=True)
        target = sorted(glob.glob(os.path.join(libs[0], "libnccl.so.*")))[0]
        link = os.path.join(link_dir, "libnccl.so")
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(target, link)
        return include, link_dir
    sys.exit("build_horovod: HOROVOD_GPU_OPERATIONS=NCCL needs NCCL's nccl.h and libnccl.so; none found in "
             + ", ".join(filter(None, candidates)) + ". Set HOROVOD_NCCL_HOME, or install PyTorch's CUDA build "
             "(it brings the nvidia-nccl-cu12 or -cu13 wheel).")


def gpu_build_env(cache_dir):
    """The extra environment of an NCCL build; exits with the fix when nvcc or NCCL is missing."""
    cuda_home = os.environ.get("CUDA_HOME")
    nvcc = shutil.which("nvcc") or (cuda_home and shutil.which(os.path.join(cuda_home, "bin", "nvcc")))
    if not nvcc:
        sys.exit("build_horovod: HOROVOD_GPU_OPERATIONS=NCCL needs nvcc, found neither on PATH nor in "
                 "$CUDA_HOME/bin. Install the CUDA toolkit (or `pip install nvidia-cuda-nvcc-cu12` and set "
                 "CUDA_HOME to its nvidia/cuda_nvcc directory).")
    include, lib = _nccl_home(cache_dir)
    env = {"HOROVOD_GPU_OPERATIONS": "NCCL", "HOROVOD_NCCL_LINK": "SHARED", "HOROVOD_NCCL_INCLUDE": include,
           "HOROVOD_NCCL_LIB": lib, "CUDA_HOME": cuda_home or os.path.dirname(os.path.dirname(nvcc))}
    if "HOROVOD_BUILD_CUDA_CC_LIST" not in os.environ:
        # every architecture nvcc knows takes far longer; build for the GPUs this machine has
        code = ("import torch; print(','.join(sorted({'%d%d' % torch.cuda.get_device_capability(i) "
                "for i in range(torch.cuda.device_count())})))")
        arch = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip()
        if arch:
            env["HOROVOD_BUILD_CUDA_CC_LIST"] = arch
    log("NCCL build: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    return env


def patch_sources(src_dir):
    for rel, old, new, why in SOURCE_EDITS:
        path = os.path.join(src_dir, rel)
        with open(path) as f:
            text = f.read()
        count = text.count(old)
        if count != 1:
            sys.exit(f"build_horovod: expected exactly one {old.strip()!r} in {rel}, found {count}. "
                     f"The Horovod sources differ from {HOROVOD_VERSION}; the edit ({why}) "
                     "must be revisited.")
        with open(path, "w") as f:
            f.write(text.replace(old, new))
        log(f"patched {rel}: {why}")


def build_wheel(cache_dir):
    gpu_env = gpu_build_env(cache_dir) if nccl_wanted() else {}
    work = tempfile.mkdtemp(prefix="horovod-build-")
    log(f"downloading the horovod=={HOROVOD_VERSION} sdist from the package index")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    f"horovod=={HOROVOD_VERSION}", "-d", work],
                   check=True, stdout=subprocess.DEVNULL)
    sdist, = glob.glob(os.path.join(work, "horovod-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        tar.extractall(work, filter="data")
    src_dir = os.path.join(work, f"horovod-{HOROVOD_VERSION}")
    patch_sources(src_dir)

    env = dict(os.environ, **BUILD_ENV, **gpu_env)
    env.setdefault("MAKEFLAGS", f"-j{(os.cpu_count() or 1) + 1}")
    log_path = os.path.join(cache_dir, "last-build.log")
    log(f"compiling Horovod (C++, about 12 minutes on 2 cores); log: {log_path}")
    start = time.time()
    with open(log_path, "w") as build_log:
        proc = subprocess.Popen([sys.executable, "-m", "pip", "wheel", "--no-deps",
                                 "--no-build-isolation", "-v", src_dir, "-w", work],
                                env=env, stdout=build_log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            time.sleep(60)
            log(f"  still compiling ({time.time() - start:.0f} s)")
    if proc.returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-4000:]
        sys.exit(f"build_horovod: the Horovod build failed; last lines of {log_path}:\n{tail}")
    wheel, = glob.glob(os.path.join(work, "horovod-*.whl"))
    log(f"built in {time.time() - start:.0f} s")
    return wheel


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--force", action="store_true", help="rebuild even if Horovod looks fine")
    parser.add_argument("--cache", default=os.environ.get(
        "HOROVOD_QSGD_CACHE", os.path.join(REPO_ROOT, ".cache", "horovod")),
        help="where built wheels are kept (default: .cache/horovod in the repository)")
    args = parser.parse_args()

    versions = framework_versions()
    problem = installed_build(versions)
    if problem is None and not args.force:
        log(f"Horovod {HOROVOD_VERSION} with torch {versions['torch']} and TF {versions['tensorflow']} "
            "is already installed; nothing to do")
        return
    log(problem or "rebuild forced")

    os.makedirs(args.cache, exist_ok=True)
    key = build_key(versions)
    cached = os.path.join(args.cache, key)
    wheels = glob.glob(os.path.join(cached, "*.whl"))
    if wheels and not args.force:
        log(f"installing the cached wheel {wheels[0]}")
        wheel = wheels[0]
    else:
        built = build_wheel(args.cache)
        os.makedirs(cached, exist_ok=True)
        wheel = os.path.join(cached, os.path.basename(built))
        shutil.move(built, wheel)
        shutil.rmtree(os.path.dirname(built), ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--force-reinstall", "--no-deps", wheel],
                   check=True, stdout=subprocess.DEVNULL)
    # Horovod's own runtime dependencies, without letting pip touch the frameworks.
    subprocess.run([sys.executable, "-m", "pip", "install", "cloudpickle", "psutil", "pyyaml", "packaging"],
                   check=True, stdout=subprocess.DEVNULL)

    code = "import horovod, os; print(os.path.dirname(horovod.__file__))"
    pkg_dir = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                             text=True).stdout.strip()
    with open(os.path.join(pkg_dir, STAMP_NAME), "w") as f:
        json.dump(dict(versions, key=key), f)
    problem = installed_build(versions)
    if problem:
        sys.exit(f"build_horovod: installed Horovod but it does not work: {problem}")
    log(f"Horovod {HOROVOD_VERSION} installed ({key})")


if __name__ == "__main__":
    main()
