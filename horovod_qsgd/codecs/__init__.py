"""Framework-neutral codecs: the algorithms and the wire format.

::

    from horovod_qsgd.codecs import (QSGDCodec, TopKCodec, RandomKCodec,
                                     LatticeCodec, ExactCodec,   # SwarmSGD's model exchange
                                     parse_header, HEADER_NBYTES, PayloadError)

Every payload is a 16-byte header (:mod:`.header`) followed by the codec's
body; ``encode`` writes it into a caller-provided uint8 buffer of at least
``max_payload_nbytes(numel)`` bytes and ``decode_accumulate`` adds the decoded
tensor to a float32 output.  Inputs may be numpy arrays (CPU kernels) or
CUDA arrays (``__cuda_array_interface__``: CUDA kernels); float16 and
(numpy) bfloat16 inputs are converted to float32 first, anything else is
refused with TypeError.
"""

from .base import Codec, to_float32
from .header import (HEADER_NBYTES, WIRE_VERSION, Header, PayloadError, follow_header_chain, pack_header,
                     parse_header, read_header_bytes, read_header_chain, split_payloads)
from .lattice import ExactCodec, LatticeCodec
from .qsgd import QSGDCodec
from .sparse import RandomKCodec, TopKCodec

__all__ = ["QSGDCodec", "TopKCodec", "RandomKCodec", "LatticeCodec", "ExactCodec", "parse_header", "HEADER_NBYTES", "PayloadError",
           "Header", "WIRE_VERSION", "Codec", "to_float32", "split_payloads", "pack_header",
           "read_header_bytes", "read_header_chain", "follow_header_chain"]
