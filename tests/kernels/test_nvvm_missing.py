"""A GPU machine without numba-cuda or NVVM gets an error that names the fix, not numba's advice to use conda."""
import numba
import pytest
from numba.cuda.cudadrv import nvvm
from numba.cuda.cudadrv.error import NvvmSupportError

from horovod_qsgd.kernels import _dual


class FakeNVVM:
    """Stands in for numba's NVVM loader; ``found`` says whether the library loads."""

    def __init__(self, found):
        self.found, self.calls = found, 0

    def __call__(self):
        self.calls += 1
        if not self.found:
            raise NvvmSupportError("libNVVM cannot be found. Do `conda install cudatoolkit`")


@pytest.fixture
def real_gpu_target(monkeypatch):
    monkeypatch.setattr(numba.config, "ENABLE_CUDASIM", 0)
    monkeypatch.setattr(numba.cuda, "implementation", "NVIDIA")  # numba-cuda's target, as on a GPU machine
    _dual.require_gpu_compiler.cache_clear()
    yield
    _dual.require_gpu_compiler.cache_clear()


def test_first_kernel_without_nvvm_names_the_extras(monkeypatch, real_gpu_target):
    monkeypatch.setattr(nvvm, "NVVM", FakeNVVM(found=False))

    def kernel(a):
        pass

    with pytest.raises(RuntimeError, match=r"\.\[cuda12\]'` or `'\.\[cuda13\]'.*NvvmSupportError") as error:
        _dual.cuda_kernel(kernel).blocks(1, 32)
    assert isinstance(error.value.__cause__, NvvmSupportError)


def test_nvvm_is_loaded_once(monkeypatch, real_gpu_target):
    loader = FakeNVVM(found=True)
    monkeypatch.setattr(nvvm, "NVVM", loader)
    _dual.require_gpu_compiler()
    _dual.require_gpu_compiler()
    assert loader.calls == 1


def test_first_kernel_on_numbas_builtin_target_names_numba_cuda(monkeypatch, real_gpu_target):
    # numba 0.68's built-in target fails on 14 of our kernels (min/max of two ints); it says "Built-in" here
    monkeypatch.setattr(numba.cuda, "implementation", "Built-in")
    loader = FakeNVVM(found=True)
    monkeypatch.setattr(nvvm, "NVVM", loader)

    def kernel(a):
        pass

    with pytest.raises(RuntimeError, match=r"numba-cuda.*built-in target \(Built-in\).*'\.\[cuda12\]'"):
        _dual.cuda_kernel(kernel).blocks(1, 32)
    assert loader.calls == 0
