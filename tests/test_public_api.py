"""What a user imports: the same names, and the same objects, from both adapters."""
import pytest

NAMES = {"QSGD", "TopK", "RandomK", "FP16", "NoCompression", "CompressionMismatchError",
         "UnsupportedCollectiveError", "PayloadError", "set_cpu_threads", "cpu_threads"}


@pytest.mark.parametrize("adapter_name", ["torch", "tensorflow"])
def test_errors_and_thread_setting_come_from_the_adapter(adapter_name):
    import importlib

    from horovod_qsgd import kernels
    from horovod_qsgd.codecs.header import PayloadError
    from horovod_qsgd.common.errors import CompressionMismatchError, UnsupportedCollectiveError
    adapter = importlib.import_module(f"horovod_qsgd.{adapter_name}")
    assert NAMES <= set(adapter.__all__)
    assert all(hasattr(adapter, name) for name in adapter.__all__)
    assert adapter.CompressionMismatchError is CompressionMismatchError
    assert adapter.UnsupportedCollectiveError is UnsupportedCollectiveError
    assert adapter.PayloadError is PayloadError
    assert adapter.set_cpu_threads is kernels.set_cpu_threads and adapter.cpu_threads is kernels.cpu_threads
