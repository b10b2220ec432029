"""The checks every compressed collective passes before its payload is exchanged (both adapters)."""
import warnings

from horovod_qsgd.common.errors import UnsupportedCollectiveError

# Reductions a payload cannot serve but Horovod's own allreduce can: the tensor goes there uncompressed.
UNCOMPRESSED_OPS = ("Min", "Max", "Product")


def takes_op_uncompressed(name, hvd, op, warned):
    """True where ``op`` is one of :data:`UNCOMPRESSED_OPS` of the Horovod module ``hvd``, which a payload cannot
    serve: decoded payloads add up, so such a tensor goes through Horovod's own allreduce, uncompressed, with a
    warning the first time an op does (``warned``: the op names already warned of). The op is an argument of
    the call, equal on every rank, so every rank takes the same collective."""
    op_name = next((n for n in UNCOMPRESSED_OPS if op is not None and op == getattr(hvd, n)), None)
    if op_name is None:
        return False
    if op_name not in warned:
        warned.add(op_name)
        warnings.warn(f"horovod_qsgd: tensor {name!r} is reduced with op={op_name}, which compressed payloads "
                      f"cannot serve (they are summed); it and every later op={op_name} tensor go through "
                      "Horovod's allreduce uncompressed. Pass compression=hvd.Compression.none there to "
                      "silence this.", stacklevel=4)
    return True


def check_compressible(name, is_adasum, unnamed_hint=""):
    """Raises unless a payload can be exchanged: it needs a name equal on every rank and a summing op."""
    if name is None:
        raise ValueError(
            "horovod_qsgd: hvd.allreduce(..., compression=...) needs name= for tensors that are "
            "compressed: the payload is exchanged under a name derived from it, and names must be "
            "equal on every rank." + unnamed_hint)
    if is_adasum:
        raise UnsupportedCollectiveError(
            f"horovod_qsgd: tensor {name!r}: op=hvd.Adasum cannot be combined with payload "
            "compression (Adasum needs the full gradients). Use op=hvd.Average or hvd.Sum, or "
            "compression=hvd.Compression.none with Adasum.")
