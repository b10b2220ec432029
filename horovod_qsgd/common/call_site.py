"""The checks every compressed collective passes before its payload is exchanged (both adapters)."""
from horovod_qsgd.common.errors import UnsupportedCollectiveError


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
