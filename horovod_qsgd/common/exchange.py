"""Reading the concatenation of all ranks' payloads that an allgather returns."""
from horovod_qsgd.codecs import HEADER_NBYTES, PayloadError, parse_header
from horovod_qsgd.common.errors import CompressionMismatchError


def payload_spans(read_bytes, total_nbytes, num_ranks, codec, numel, tensor_name):
    """Returns [(start, end)] of each rank's payload, in rank order.

    ``read_bytes(start, length)`` returns host bytes of the gathered buffer (a
    device buffer is read header by header). Every header is checked against
    what this rank sent, so a rank with another codec, setting or tensor shape
    raises here on every rank instead of decoding garbage.
    """
    spans, offset = [], 0
    for rank in range(num_ranks):
        if offset + HEADER_NBYTES > total_nbytes:
            raise CompressionMismatchError(
                f"horovod_qsgd: tensor {tensor_name!r}: the gathered payloads end after {offset} bytes, "
                f"before rank {rank}'s payload; a rank sent a truncated or foreign payload.")
        try:
            header = parse_header(read_bytes(offset, HEADER_NBYTES))
        except PayloadError as exc:
            raise CompressionMismatchError(
                f"horovod_qsgd: tensor {tensor_name!r}: rank {rank} sent no horovod_qsgd payload ({exc}). "
                "Every rank must use the same compression for this tensor.") from exc
        problems = []
        if header.codec_id != codec.codec_id:
            problems.append(f"codec id {header.codec_id} (here {codec.codec_id})")
        if header.digest != codec.digest:
            problems.append(f"settings digest {header.digest:#010x} (here {codec.digest:#010x})")
        if header.numel != numel:
            problems.append(f"{header.numel} elements (here {numel}): the tensor's shape differs")
        if problems:
            raise CompressionMismatchError(
                f"horovod_qsgd: tensor {tensor_name!r}: rank {rank}'s payload does not match this rank's: "
                + "; ".join(problems) + ". Every rank must use the same model and compressor settings.")
        spans.append((offset, offset + header.nbytes))
        offset += header.nbytes
    if offset != total_nbytes:
        raise CompressionMismatchError(
            f"horovod_qsgd: tensor {tensor_name!r}: {total_nbytes - offset} unexpected bytes after "
            f"{num_ranks} payloads; the process set's size differs from what this rank expects.")
    return spans


def reduction_scale(placeholder_value, num_ranks):
    """The factor to apply to the sum of decoded payloads.

    Each rank allreduces a placeholder of 1 with the optimizer's own op, pre-
    and postscale. It comes back as ``num_ranks`` for a sum and 1 for an
    average (with or without gradient_predivide_factor); the decoded sum is
    multiplied by ``placeholder / num_ranks``. Low-precision placeholders are
    snapped to those two exact values so the sum stays a bitwise sum.
    """
    value = float(placeholder_value)
    for exact in (float(num_ranks), 1.0):
        if abs(value - exact) <= 1e-2 * exact:
            value = exact
            break
    return value / num_ranks
