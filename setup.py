from setuptools import find_packages, setup

# Horovod is not listed: pip cannot build 0.28.1 against today's frameworks.
# scripts/setup.sh installs the frameworks first, then builds Horovod with
# scripts/build_horovod.py, then installs this package.
setup(
    name="horovod_qsgd",
    version="0.1.0",
    description="Gradient compression (QSGD, top-k, random-k) for Horovod that really sends fewer bytes",
    packages=find_packages(include=["horovod_qsgd", "horovod_qsgd.*"]),
    package_data={"horovod_qsgd": ["testdata/*.npz"]},
    python_requires=">=3.9",
    install_requires=["numpy", "numba>=0.60"],
    extras_require={
        "torch": ["torch==2.13.0"],
        "tensorflow": ["tensorflow-cpu==2.21.0", "tf-keras==2.21.0"],
        # lightning and accelerate: tests/integrations runs the examples with them (pinned: what was tested)
        "test": ["pytest", "pytest-timeout", "scipy", "scikit-learn", "lightning==2.6.6", "accelerate==1.15.0"],
        "bench": ["matplotlib"],
        # numba's CUDA target with NVVM and libdevice from the package index (PyTorch's CUDA wheels lack
        # them); take the one of your CUDA major version (torch.version.cuda): the other would install
        # cuda-bindings and toolkit wheels of the wrong major version. numpy < 2.5: numba-cuda 0.30.4 (the
        # newest) fails to import under numpy 2.5, which removed np.row_stack (seen on a GPU machine)
        "cuda12": ["numba-cuda[cu12]", "numpy<2.5"],
        "cuda13": ["numba-cuda[cu13]", "numpy<2.5"],
        # tests only: compile every kernel for named GPUs without one (scripts/gpu_compile_check.py); pinned so
        # that the register table in benchmarks/results/gpu/ is reproducible
        "gpu-compile": ["numba-cuda[cu13]==0.30.4", "nvidia-cuda-nvcc==13.5.37"],
    },
)
