"""Which collective is Horovod running when it calls ``compress``? (TensorFlow)

Horovod's ``Compressor`` interface passes only the tensor. Our compressors
start their own named collective and keep per-gradient state, so they need
more, all of which are local variables of the Horovod functions on the stack:

* the variable the gradient belongs to, when Horovod's gradient path called
  us (``hvd.DistributedGradientTape``, ``hvd.DistributedOptimizer`` and the
  Keras ``DistributedOptimizer`` all go through ``allreduce_grads(grads,
  vars)``): state follows the variable, whatever graph the gradient is in;
* otherwise the ``name=`` given to ``hvd.allreduce`` / ``hvd.grouped_allreduce``,
  or, in graph mode, the gradient's graph name (what Horovod itself derives
  its collective names from);
* the reduction op (Adasum cannot be served) and the process set.

Horovod traces its TF functions with ``tf.function``, so under autograph the
frames are converted copies (``tf__allreduce``, ``else_body_13``, list
comprehensions) whose locals keep the original names; both forms are read.
"""
import re
import sys
from dataclasses import dataclass

from horovod_qsgd.common.errors import UnsupportedCollectiveError

_HVD_TF = "horovod.tensorflow"
# Functions whose locals pair gradients with their variables: Horovod's gradient path, and our Keras 3
# optimizer's grouped calls (horovod_qsgd.tensorflow.keras3), by module: (function, gradients, variables).
_GRADIENT_FRAMES = {_HVD_TF: ("allreduce_grads", "grads", "vars"),
                    "horovod_qsgd.tensorflow.keras3": ("_allreduce_group", "grads", "variables")}
_REFUSED = ("reducescatter", "grouped_reducescatter")


@dataclass(frozen=True)
class CallSite:
    name: object         # stable name (str) or None when none could be found
    op: object
    process_set: object
    variable: object     # the variable whose gradient this is, or None
    source: str          # where the name came from: "variable", "name", "graph" or "none"


def _base_name(code_name):
    return code_name[4:] if code_name.startswith("tf__") else code_name


def _index_of(items, element):
    # Only lists and tuples: in a frame autograph converted, a name not yet assigned holds its Undefined
    # object, whose indexing returns itself, so iterating it never ends.
    if not isinstance(items, (list, tuple)):
        return None
    for i, item in enumerate(items):
        if item is element:
            return i
    return None


def variable_name(var):
    """A variable's stable name: Keras 3's ``path``, else ``name`` without the ``:0`` output suffix."""
    path = getattr(var, "path", None)
    name = path if isinstance(path, str) and path else var.name
    return re.sub(r":\d+$", "", name)


def graph_name(tensor):
    """The tensor's graph name (``None`` for eager tensors)."""
    try:
        name = tensor.name
    except (AttributeError, ValueError):
        return None
    return re.sub(r":0$", "", name) if isinstance(name, str) else None


def find_call_site(tensor, default_op, default_process_set):
    """Returns the CallSite of the Horovod collective that is compressing ``tensor``."""
    frame = sys._getframe(2)
    op = process_set = name = None
    found_collective = False
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module == _HVD_TF:
            base = _base_name(frame.f_code.co_name)
            local_vars = frame.f_locals
            if base in _REFUSED:
                raise UnsupportedCollectiveError(
                    f"horovod_qsgd: hvd.{base} cannot carry compressed payloads: a reduce-scatter needs "
                    "summable tensors. Use compression=hvd.Compression.none or fp16 there.")
            if not found_collective and base in ("allreduce", "grouped_allreduce"):
                found_collective = True
                op = local_vars.get("op")
                process_set = local_vars.get("process_set")
                name = local_vars.get("name")
                if base == "grouped_allreduce" and name is not None:
                    index = _index_of(local_vars.get("tensor_list") or local_vars.get("tensors"), tensor)
                    name = None if index is None else f"{name}.{index}"
        function, grads_name, vars_name = _GRADIENT_FRAMES.get(module, (None, None, None))
        if function is not None and _base_name(frame.f_code.co_name) == function:
            local_vars = frame.f_locals
            index = _index_of(local_vars.get(grads_name), tensor)
            variables = local_vars.get(vars_name)
            if index is not None and variables is not None and index < len(variables):
                return CallSite(variable_name(variables[index]), op if found_collective else default_op,
                                process_set or default_process_set, variables[index], "variable")
        frame = frame.f_back
    if op is None:
        op = default_op
    if process_set is None:
        process_set = default_process_set
    if isinstance(name, str) and name:
        return CallSite(name, op, process_set, None, "name")
    name = graph_name(tensor)
    if name is not None:
        return CallSite(name, op, process_set, None, "graph")
    return CallSite(None, op, process_set, None, "none")
