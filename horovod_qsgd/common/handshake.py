"""One exchange of every rank's compressor settings before the first payload.

A rank that quantizes with other settings than its peers would decode their
payloads wrongly or wait for a collective they never start. Exchanging the
settings once per process set turns that into an error on every rank that
names what differs.
"""
import json

import numpy as np

from horovod_qsgd import __version__
from horovod_qsgd.common.errors import CompressionMismatchError


def settings_record(compressor, settings):
    """The bytes a rank contributes to the handshake."""
    record = {"horovod_qsgd": __version__, "compressor": compressor, "settings": settings}
    return json.dumps(record, sort_keys=True, default=str).encode("utf-8")


def _flatten(record, prefix=""):
    flat = {}
    for key, value in record.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, path + "."))
        else:
            flat[path] = value
    return flat


def check_settings(records):
    """Raises CompressionMismatchError unless all ranks' records (in rank order) are equal."""
    if all(r == records[0] for r in records):
        return
    flat = [_flatten(json.loads(r.decode("utf-8"))) for r in records]
    keys = sorted(set().union(*flat))
    lines = []
    for key in keys:
        values = [f.get(key, "<missing>") for f in flat]
        if any(v != values[0] for v in values):
            lines.append(f"  {key}: " + ", ".join(f"rank {r}={v!r}" for r, v in enumerate(values)))
    raise CompressionMismatchError(
        "horovod_qsgd: ranks use different compression settings:\n" + "\n".join(lines) +
        "\nEvery rank must build the compressor with the same arguments and run the same "
        "horovod_qsgd version.")


def verify_settings(compressor, settings, allgather, name):
    """Exchanges every rank's settings record and raises on all ranks if they differ.

    ``allgather(array, name)`` is the adapter's allgather of a 1-D numpy
    array over the process set, returning the ranks' arrays concatenated in
    rank order (numpy); it is called twice, for the record lengths (int64)
    and for the records (uint8).
    """
    record = np.frombuffer(settings_record(compressor, settings), dtype=np.uint8)
    lengths = allgather(np.array([record.size], dtype=np.int64), f"{name}.lengths")
    records = allgather(record, f"{name}.records")
    chunks, offset = [], 0
    for length in np.asarray(lengths).tolist():
        chunks.append(np.asarray(records[offset:offset + length]).tobytes())
        offset += length
    check_settings(chunks)
