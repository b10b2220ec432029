"""What a user imports: the same names, and the same objects, from both adapters."""
import pytest

NAMES = {"QSGD", "TopK", "RandomK", "FP16", "NoCompression", "CompressionMismatchError",
         "UnsupportedCollectiveError", "PayloadError", "set_cpu_threads", "cpu_threads", "Join",
         "JoinUnsupportedError"}


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


def test_ddp_states_take_the_horovod_compressors_arguments_and_need_no_horovod():
    import inspect

    import horovod_qsgd.ddp as ddp
    import horovod_qsgd.torch as hvd_adapter
    for state, compressor in [(ddp.QSGDState, hvd_adapter.QSGD), (ddp.TopKState, hvd_adapter.TopK)]:
        ours = dict(inspect.signature(state).parameters)
        assert ours.pop("process_group").default is None
        theirs = {k: p for k, p in inspect.signature(compressor).parameters.items() if k != "fusion_threshold"}
        assert [(k, p.default) for k, p in ours.items()] == [(k, p.default) for k, p in theirs.items()], state
    with pytest.raises(ValueError, match="encoding='elias' varies: use encoding='fixed'"):
        ddp.QSGDState(encoding="elias")
    proc = _without_horovod("import horovod_qsgd.ddp as d\nprint(type(d.TopKState()).__name__)\n")
    assert proc.returncode == 0 and proc.stdout.strip() == "TopKState", proc.stderr[-2000:]


def test_node_aware_exchange_is_offered_by_every_payload_compressor_and_documented_with_what_auto_does():
    """Both frameworks' compressors and the DDP states take exchange='node_aware'; their docstrings say whether
    'auto' takes it by itself (PyTorch and DDP: for GPU gradients; TensorFlow, whose codecs run on the host: no)."""
    import horovod_qsgd.tensorflow as tf_adapter
    import horovod_qsgd.torch as torch_adapter
    from horovod_qsgd.ddp import QSGDState, TopKState
    for make in (torch_adapter.QSGD, torch_adapter.TopK, QSGDState, TopKState, tf_adapter.QSGD, tf_adapter.TopK):
        assert make(exchange="node_aware").exchange == "node_aware"
        doc = " ".join(make.__doc__.split())
        auto = "takes it for GPU gradients" if make not in (tf_adapter.QSGD, tf_adapter.TopK) else "does not take it"
        assert '``"node_aware"``: on nodes of several ranks' in doc and f'``"auto"`` {auto}' in doc, make
    with pytest.raises(ValueError, match="allowed values: 'allgather', 'two_stage', 'auto', 'node_aware'"):
        torch_adapter.QSGD(exchange="nodes")


def test_fsdp_compressors_take_the_horovod_compressors_arguments_need_no_horovod_and_refuse_what_they_cannot():
    """horovod_qsgd.fsdp's QSGD and TopK take the Horovod compressors' arguments with their defaults, less the
    fusion and second-stage ones (a reduce-scatter has one stage) and QSGD's encoding (fixed sizes only), plus
    TopK's residual_dtype (float32 by default, or the lean bfloat16 form); their exchanges are the flat
    reduce-scatter and the node-aware one; it imports without Horovod; a compressor of another adapter, a bad
    residual_dtype or a model without fully_shard is refused."""
    import inspect

    import torch

    import horovod_qsgd.fsdp as fsdp
    import horovod_qsgd.torch as hvd_adapter
    for ours, compressor in [(fsdp.QSGD, hvd_adapter.QSGD), (fsdp.TopK, hvd_adapter.TopK)]:
        theirs = {k: p.default for k, p in inspect.signature(compressor).parameters.items()
                  if k not in ("second_stage_bits", "fusion_threshold", "encoding")}
        extra = {"residual_dtype": "float32"} if ours is fsdp.TopK else {}
        assert {k: p.default for k, p in inspect.signature(ours).parameters.items()} == dict(theirs, **extra), ours
    with pytest.raises(ValueError, match="residual_dtype='float16'; allowed values: 'float32', 'bfloat16'"):
        fsdp.TopK(residual_dtype="float16")
    with pytest.raises(ValueError, match="allowed values: 'auto', 'reduce_scatter', 'node_aware'"):
        fsdp.TopK(exchange="two_stage")
    with pytest.raises(TypeError, match="takes horovod_qsgd.fsdp.QSGD or TopK, got QSGD"):
        fsdp.compress_reduce_scatter(torch.nn.Linear(2, 2), hvd_adapter.QSGD())
    with pytest.raises(ValueError, match="found no fully_shard module"):
        fsdp.compress_reduce_scatter(torch.nn.Linear(2, 2), fsdp.QSGD())
    proc = _without_horovod("import horovod_qsgd.fsdp as f\nprint(f.TopK())\n")
    assert proc.returncode == 0 and proc.stdout.startswith("TopK(error_feedback=True"), proc.stderr[-2000:]


def _without_horovod(code):
    """``code`` run by a fresh interpreter in which importing Horovod fails: the finished process."""
    import subprocess
    import sys
    blocked = ("import sys\n"
               "class Block:\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] == 'horovod':\n"
               "            raise ImportError('no horovod here')\n"
               "sys.meta_path.insert(0, Block())\n")
    return subprocess.run([sys.executable, "-c", blocked + code], capture_output=True, text=True, timeout=120)


PUBLIC_MODULES = ["horovod_qsgd.torch", "horovod_qsgd.tensorflow", "horovod_qsgd.ddp", "horovod_qsgd.fsdp",
                  "horovod_qsgd.lightning"]


def _public_docs():
    """(module, name, object, its documentation: the class's or function's docstring plus its __init__'s)."""
    import importlib
    import inspect
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            doc = inspect.getdoc(obj) or ""
            if inspect.isclass(obj) and "__init__" in vars(obj) and obj.__init__.__doc__:
                doc += "\n" + inspect.getdoc(obj.__init__)
            yield module_name, name, obj, doc


def _parameters(obj):
    import inspect
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return []
    return [p for p in signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def test_every_public_class_and_function_documents_its_arguments_and_what_it_costs():
    """PyTorch's own standard (powerSGD_hook.py): an ``Args:`` list naming every argument (its default in the
    signature), and what it costs. Exceptions say when they are raised instead."""
    missing = []
    for module_name, name, obj, doc in _public_docs():
        if getattr(obj, "__module__", "").startswith("horovod."):
            continue  # Horovod's own (FP16, NoCompression), documented there
        if isinstance(obj, type) and issubclass(obj, Exception):
            if "raise" not in doc.lower():
                missing.append(f"{module_name}.{name}: when is it raised?")
            continue
        parameters = [p.name for p in _parameters(obj)]
        if parameters and "Args:" not in doc:
            missing.append(f"{module_name}.{name}: no Args:")
        args = doc.split("Args:", 1)[-1]
        missing += [f"{module_name}.{name}: Args: does not name {p!r}" for p in parameters if p not in args]
        if "cost" not in doc.lower():
            missing.append(f"{module_name}.{name}: no word of what it costs")
    assert not missing, "\n".join(missing)
