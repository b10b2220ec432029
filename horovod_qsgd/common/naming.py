"""Stable per-tensor keys: collectives are matched across ranks by name, never by call order."""
import zlib

PAYLOAD_PREFIX = "horovod_qsgd.payload."
SECOND_STAGE_PREFIX = "horovod_qsgd.sum."
HANDSHAKE_NAME = "horovod_qsgd.handshake"
JOIN_FLAG_NAME = "horovod_qsgd.join.active_ranks"  # the Join classes' count of ranks still training
JOIN_CHECK_NAME = "horovod_qsgd.join.ranks_in_hvd_join"  # hvd.join()'s refusal: the ranks that called it


def tensor_key(name):
    """32-bit key of a tensor name for the counter-based RNG; equal on every rank and run."""
    return zlib.crc32(name.encode("utf-8"))


def rank_key(name, rank):
    """Key whose rounding noise is independent across ranks (so averaging reduces it)."""
    return zlib.crc32(f"{name}@rank{rank}".encode("utf-8"))
