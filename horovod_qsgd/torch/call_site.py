"""Which collective is Horovod running when it calls ``compress``?

Horovod's ``Compression`` interface passes only the tensor. Our compressors
start their own named collective and need three more facts, all of which are
local variables of the Horovod function that called ``compress``:

* a name that is equal on every rank (collectives are matched by name; the
  optimizer submits unused parameters in set order, which differs by rank),
* the reduction op (Adasum cannot be served),
* the process set.

``find_call_site`` reads them from the calling frames of the stock
``hvd.DistributedOptimizer`` (named parameters, grouped or not) and of
``hvd.allreduce`` / ``hvd.grouped_allreduce`` called with ``name=``.
"""
import sys
from dataclasses import dataclass

import horovod.torch as hvd
import torch

from horovod_qsgd.common.call_site import check_compressible
from horovod_qsgd.common.errors import UnsupportedCollectiveError

_MPI_OPS = "horovod.torch.mpi_ops"


@dataclass(frozen=True)
class CallSite:
    name: object  # str, or None for hvd.allreduce called without name=
    op: object
    process_set: object
    # The optimizer replaces the gradient with the result (as Horovod's in-place allreduce of an
    # uncompressed gradient overwrites it): decoding into the gradient's own memory is safe there.
    # hvd.allreduce must leave its input alone.
    result_replaces_input: bool = False
    # Horovod's scaling around the sum, as the allreduce was asked for it (hvd.join()'s refusal repeats it).
    prescale_factor: float = 1.0
    postscale_factor: float = 1.0
    # The optimizer's parameter whose gradient this is (None for hvd.allreduce).
    parameter: object = None

    @property
    def frozen(self):
        """True for a parameter whose ``requires_grad`` was turned off after the optimizer was built: Horovod still
        submits a zero gradient for it, whose result the optimizer applies."""
        return self.parameter is not None and not self.parameter.requires_grad


def _from_optimizer(owner, param):
    name = owner._parameter_names.get(param)
    if name is None:
        return None
    # Horovod's Adasum optimizer (op=hvd.Adasum) is the one distributed optimizer without .op and
    # .process_set: it always reduces with Adasum, over all ranks.
    op = getattr(owner, "op", hvd.Adasum)
    predivide = getattr(owner, "gradient_predivide_factor", 1.0) if op == hvd.Average else 1.0
    return CallSite(name, op, getattr(owner, "process_set", hvd.global_process_set), result_replaces_input=True,
                    prescale_factor=1.0 / predivide, postscale_factor=predivide, parameter=param)


def _from_mpi_ops(code_name, local_vars, element):
    name = local_vars.get("name")
    op = local_vars.get("op")
    if op is None:
        op = hvd.Average if local_vars.get("average", True) in (True, None) else hvd.Sum
    if code_name == "grouped_allreduce" and name is not None:
        tensors = local_vars["tensors"]
        index = next(i for i, t in enumerate(tensors) if t is element)
        name = f"{name}.{index}"
    return CallSite(name, op, local_vars.get("process_set", hvd.global_process_set),
                    prescale_factor=local_vars.get("prescale_factor", 1.0),
                    postscale_factor=local_vars.get("postscale_factor", 1.0))


def find_call_site(tensor):
    """Returns the CallSite of the collective that is compressing ``tensor``; raises UnsupportedCollectiveError
    for an Adasum reduction, whatever the tensor: on every rank at its first tensor, before any collective, so
    that no rank waits for another."""
    frame = sys._getframe(2)
    element = None  # the parameter or list element a comprehension is compressing
    while frame is not None:
        local_vars = frame.f_locals
        code_name = frame.f_code.co_name
        owner = local_vars.get("self")
        candidate = local_vars.get("p", local_vars.get("t"))
        if element is None and isinstance(candidate, torch.Tensor):
            element = candidate
        if owner is not None and isinstance(getattr(owner, "_parameter_names", None), dict):
            site = _from_optimizer(owner, element)
            if site is not None:
                return _refuse_adasum(site)
        if frame.f_globals.get("__name__") == _MPI_OPS:
            if code_name in ("allreduce", "grouped_allreduce"):
                return _refuse_adasum(_from_mpi_ops(code_name, local_vars, element if element is not None else tensor))
            if code_name in ("reducescatter", "grouped_reducescatter"):
                raise UnsupportedCollectiveError(
                    f"horovod_qsgd: hvd.{code_name} cannot carry compressed payloads: a reduce-scatter "
                    "needs summable tensors. Use compression=hvd.Compression.none or fp16 there.")
        frame = frame.f_back
    raise RuntimeError(
        "horovod_qsgd: compress() was called outside hvd.DistributedOptimizer, hvd.allreduce and "
        "hvd.grouped_allreduce, so there is no name to exchange the payload under. Call it through "
        "one of those (with name= for hvd.allreduce).")


def check_site(site):
    """Raises unless a payload can be exchanged for this call: it needs a name and a summing op."""
    check_compressible(site.name, site.op == hvd.Adasum)


def _refuse_adasum(site):
    if site.op == hvd.Adasum:
        check_compressible(site.name or "(unnamed)", True)
    return site
