"""Reading what the collectives return: payloads walked and checked, decoded, scaled."""
import itertools

import numpy as np

from horovod_qsgd.codecs import (HEADER_NBYTES, WIRE_VERSION, Header, PayloadError, follow_header_chain, pack_header,
                                 parse_header, read_header_bytes, read_header_chain)
from horovod_qsgd.common.errors import CompressionMismatchError, RankInJoinError

# Codec id 0 marks a refusal: a rank that found a mismatch in what it received sends this header in
# place of its payload, so that every rank waiting for it raises too instead of hanging.
REFUSAL_CODEC_ID = 0
# Codec id 255 marks a fused group's manifest: a header in front of one sender's payloads of several tensors
# (see :mod:`horovod_qsgd.common.fusion`), its numel the number of tensors, its digest their names' crc32.
GROUP_CODEC_ID = 255
# Codec id 254 marks a rank in hvd.join() (TensorFlow: :mod:`horovod_qsgd.tensorflow.hvd_join`). With two
# stages every owner receives one in the first, so what an owner sends on in the second is never read.
JOINED_CODEC_ID = 254


def refusal_notice():
    """The 16 bytes a rank sends instead of a payload it cannot produce (see ``check_payloads``)."""
    return pack_header(REFUSAL_CODEC_ID, 0, 0, HEADER_NBYTES)


def join_notice():
    """The 16 bytes a rank in hvd.join() sends instead of a payload."""
    return pack_header(JOINED_CODEC_ID, 0, 0, HEADER_NBYTES)


def _rank_in_join(tensor_name, joined):
    return RankInJoinError(f"horovod_qsgd: tensor {tensor_name!r}: {joined} rank(s) sent hvd.join()'s notice "
                           "instead of a payload", joined)


def _checked_header(head, sender, numel, codec, tensor_name, what):
    """The parsed header ``head`` (16 host bytes) that ``sender`` sent, or CompressionMismatchError naming the fault.

    ``codec``: anything with ``header_differences(header, numel)`` (a codec, a fused group's manifest).
    """
    try:
        header = parse_header(head)
    except PayloadError as exc:
        raise CompressionMismatchError(
            f"horovod_qsgd: tensor {tensor_name!r}: rank {sender} sent no horovod_qsgd {what} ({exc}). "
            "Every rank must use the same compression for this tensor.") from exc
    if header.codec_id == JOINED_CODEC_ID:
        raise _rank_in_join(tensor_name, 1)
    if header.codec_id == REFUSAL_CODEC_ID:
        raise CompressionMismatchError(
            f"horovod_qsgd: tensor {tensor_name!r}: rank {sender} found a mismatch in what it received "
            "and sent no result; its error names the rank and the difference. Every rank must use the "
            "same model and compressor settings.")
    differences = codec.header_differences(header, numel)
    if differences:
        raise CompressionMismatchError(
            f"horovod_qsgd: tensor {tensor_name!r}: rank {sender}'s {what} does not match this rank's: "
            + "; ".join(differences) + ". Every rank must use the same model and compressor settings.")
    return header


def _per_payload(tensor_name, count):
    """One tensor name per payload: ``tensor_name`` is one name for all, or a list (a fused group's)."""
    return [tensor_name] * count if isinstance(tensor_name, str) else list(tensor_name)


def check_payloads(buffer, senders, numels, codec, tensor_name, what="payload"):
    """[(start, end, header)] of the payloads concatenated in a received buffer, one per sender, in order.

    Every header is checked against this rank's codec and the element count
    ``numels[i]`` expected from ``senders[i]``, so a rank with another codec,
    setting or tensor shape raises here, on every rank, instead of decoding
    garbage. The headers are found by following their lengths on the
    buffer's device and read in one copy. ``tensor_name``: the tensor's
    name, or a list of one per payload.
    """
    heads = read_header_chain(buffer, len(senders))  # row i is the header at the offset the walk reaches
    return _checked_spans(heads, buffer.size, senders, numels, codec, tensor_name, what)


def _checked_spans(heads, total_nbytes, senders, numels, codec, tensor_name, what):
    """:func:`check_payloads` for the host bytes of the header chain, ``heads``."""
    spans, offset, joined = [], 0, 0
    names = _per_payload(tensor_name, len(senders))
    whats = what if what.endswith("s") else f"{what}s"  # "payloads"; a fused group's "group of ... slices"
    for sender, numel, head, name in zip(senders, numels, heads, names):
        if offset + HEADER_NBYTES > total_nbytes:
            raise CompressionMismatchError(
                f"horovod_qsgd: tensor {name!r}: the received {whats} end after {offset} bytes, "
                f"before rank {sender}'s; a rank sent a truncated or foreign payload.")
        try:
            header = _checked_header(head, sender, numel, codec, name, what)
        except RankInJoinError:  # counted over the whole buffer, then raised
            joined += 1
            offset += HEADER_NBYTES
            continue
        if offset + header.nbytes > total_nbytes:
            raise CompressionMismatchError(
                f"horovod_qsgd: tensor {name!r}: rank {sender}'s {what} says {header.nbytes} bytes, "
                f"only {total_nbytes - offset} arrived.")
        spans.append((offset, offset + header.nbytes, header))
        offset += header.nbytes
    if offset != total_nbytes:
        raise CompressionMismatchError(
            f"horovod_qsgd: tensor {names[-1]!r}: {total_nbytes - offset} unexpected bytes after "
            f"{len(senders)} {whats}; the process set's size differs from what this rank expects.")
    if joined:
        raise _rank_in_join(names[0], joined)
    return spans


def decode_checked(codec, buffer, senders, numels, outs, tensor_name, what="payload"):
    """Adds the payload of ``senders[i]`` (``numels[i]`` elements) in ``buffer`` to ``outs[i]``, checked.

    Where the codec's payload sizes are fixed and fill the buffer exactly, the
    payloads are decoded where they must start and checked afterwards: every
    header and the codec's own checks come back in one device read. A mismatch
    then raises as :func:`check_payloads` does, after garbage went into
    ``outs`` (callers discard them on error; no decode writes outside its
    output). ``tensor_name``: the name errors give, or a list of one per
    payload. Other buffers (variable sizes, a refusal, a short or long buffer)
    are walked and checked first, except variable-size payloads on a device
    (Elias): those are decoded where the device finds them by following the
    header chain, and the chain's headers come back with the codec's checks in
    one read.
    """
    names = _per_payload(tensor_name, len(senders))
    if codec.payload_nbytes_is_fixed:
        sizes = [codec.max_payload_nbytes(numel) for numel in numels]
        if sum(sizes) == buffer.size:
            decode_fixed_at(codec, buffer, list(itertools.accumulate(sizes, initial=0))[:-1], senders, numels, outs,
                            names, what)
            return
    elif codec.decodes_chained and not isinstance(buffer, np.ndarray):
        chain = follow_header_chain(buffer, len(senders), 8 * codec.fault_width * len(senders))
        codec.decode_sum(buffer, chain.records, outs, chain.tail.view(np.int64))
        heads, fault_bytes = chain.read()
        spans = _checked_spans([row.tobytes() for row in heads], buffer.size, senders, numels, codec,
                               tensor_name, what)
        codec.raise_for_faults(fault_bytes, [header for _, _, header in spans])
        return
    codec.decode_sum(buffer, check_payloads(buffer, senders, numels, codec, tensor_name, what), outs)


def decode_fixed_at(codec, buffer, starts, senders, numels, outs, names, what):
    """Adds the fixed-size payload that ``senders[i]`` sent at byte ``starts[i]`` of ``buffer`` to ``outs[i]``
    in one decode, then checks every header and the codec's own checks from one device read (see
    :func:`decode_checked`; ``names``: one per payload)."""
    headers = [Header(WIRE_VERSION, codec.codec_id, numel, codec.digest, codec.max_payload_nbytes(numel))
               for numel in numels]
    faults = codec.fault_counters(len(outs), not isinstance(buffer, np.ndarray))
    codec.decode_sum(buffer, [(start, start + h.nbytes, h) for start, h in zip(starts, headers)], outs, faults)
    if faults is None:
        heads, fault_bytes = read_header_bytes(buffer, starts), None
    else:
        heads, fault_bytes = read_header_bytes(buffer, starts, tail=faults.view(np.uint8))
    for head, sender, numel, name in zip(heads, senders, numels, names):
        _checked_header(head, sender, numel, codec, name, what)
    if faults is not None:
        codec.raise_for_faults(fault_bytes, headers)


def decode_gathered(codec, gathered, num_ranks, numel, tensor_name, total):
    """Adds every rank's payload in an allgather's result, checked and decoded in rank order, to ``total``."""
    decode_checked(codec, gathered, range(num_ranks), [numel] * num_ranks, [total] * num_ranks, tensor_name)


SNAP_TOLERANCE = 1e-2  # relative distance at which a placeholder is snapped to num_ranks or 1


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
        if abs(value - exact) <= SNAP_TOLERANCE * exact:
            value = exact
            break
    return value / num_ranks
