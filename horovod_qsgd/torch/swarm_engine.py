"""SwarmSGD's exchange engine for PyTorch: the model as one flat vector, its payloads, the pairwise
alltoall, decode failures and their exact re-send, counters and checkpoint state.

:mod:`horovod_qsgd.torch.swarm` wraps an optimizer around it.
"""
import json
import logging
import time
import zlib

import horovod.torch as hvd
import torch

from horovod_qsgd.codecs.header import HEADER_NBYTES, PayloadError, parse_header
from horovod_qsgd.codecs.lattice import EXACT_CODEC_ID, LATTICE_CODEC_ID, ExactCodec, LatticeCodec
from horovod_qsgd.common.errors import CompressionMismatchError
from horovod_qsgd.common.matching import random_matching
from horovod_qsgd.common.naming import rank_key
from horovod_qsgd.common.stats import CompressionStats
from horovod_qsgd.torch_shared.arrays import as_array, kernel_stream
from horovod_qsgd.torch.handshake import check_settings_across_ranks

STATE_FORMAT = 1
NAME_PREFIX = "horovod_qsgd.swarm"
AVERAGING = ("blocking", "nonblocking")
_LOG = logging.getLogger("horovod_qsgd.torch.swarm")
#: The spread estimate of a tensor is max(spread measured now, SPREAD_MEMORY * previous estimate).
SPREAD_MEMORY = 0.5


class SwarmStats(CompressionStats):
    """Counters since the last reset (see :meth:`SwarmMixin.compression_stats`)."""

    FIELDS = CompressionStats.FIELDS + ("rounds", "rounds_sat_out", "decode_failures", "fallback_rounds",
                                        "fallback_tensors")


class Slot:
    __slots__ = ("name", "tensor", "kind", "offset", "numel", "quantize")

    def __init__(self, name, tensor, kind, offset, quantize):
        self.name, self.tensor, self.kind, self.offset = name, tensor, kind, offset
        self.numel, self.quantize = tensor.numel(), quantize


class _ExchangeInFlight:
    """A non-blocking exchange in flight: its round, partner, snapshot and handle (or received bytes)."""
    __slots__ = ("round", "partner", "snapshot", "send", "handle", "received", "eps_sent")

    def __init__(self, round_index, partner, snapshot, send, handle, received=None, eps_sent=None):
        self.round, self.partner, self.snapshot, self.send = round_index, partner, snapshot, send
        self.handle, self.received, self.eps_sent = handle, received, eps_sent or {}


def parse_quantization(quantization):
    if quantization is None or quantization == "none":
        return None
    if isinstance(quantization, LatticeCodec):
        return quantization
    if isinstance(quantization, dict):
        return LatticeCodec(**quantization)
    if isinstance(quantization, str) and quantization.startswith("lattice"):
        try:
            return LatticeCodec(bits=int(quantization[len("lattice"):] or 8))
        except ValueError:
            pass
    raise ValueError(f"quantization={quantization!r} is not supported; allowed: None, 'lattice8' "
                     "('lattice3'..'lattice8': bits per coordinate), a dict of LatticeCodec arguments "
                     "or a LatticeCodec")


class SwarmEngine:
    """Everything SwarmSGD adds to an optimizer; the optimizer mixin delegates here."""

    def __init__(self, slots, local_steps, codec, topology, averaging, seed, process_set, min_numel):
        self.slots = slots
        self.numel = sum(s.numel for s in slots)
        self.local_steps = local_steps
        self.codec = codec
        self.exact = ExactCodec()
        self.topology = topology
        self.averaging = averaging
        self.seed = seed
        self.ps = process_set
        self.min_numel = min_numel
        manifest = [(s.name, s.kind, s.numel, str(s.tensor.dtype)) for s in slots]
        self.manifest_digest = zlib.crc32(json.dumps(manifest).encode("utf-8"))
        self.prefix = f"{NAME_PREFIX}.{process_set.process_set_id}.{self.manifest_digest:08x}."
        self.steps = 0          # local steps taken
        self.round = 0          # exchanges started
        self.spread = {}        # slot name -> spread estimate, see SPREAD_MEMORY (quantized slots)
        self.pending = None
        self.verified = False
        self.stats = SwarmStats()
        self.last = {}

    # -- settings -------------------------------------------------------------------------
    def settings(self):
        return {"local_steps": self.local_steps, "averaging": self.averaging, "seed": self.seed,
                "topology": self.topology if isinstance(self.topology, str) else [list(e) for e in self.topology],
                "quantization": None if self.codec is None else self.codec.config(),
                "min_numel": self.min_numel, "process_set_size": self.ps.size(),
                "model": f"{len(self.slots)} tensors, {self.numel} elements, digest {self.manifest_digest:08x}"}

    def handshake(self):
        """Once per process: every rank compares every rank's settings and round counter."""
        if self.verified:
            return
        check_settings_across_ranks("SwarmOptimizer", dict(self.settings(), round=self.round),
                                    self.prefix + "handshake", self.ps)
        self.verified = True

    # -- model as one flat fp32 vector --------------------------------------------------------
    def flat(self):
        if not self.slots:
            return torch.zeros(0)
        return torch.cat([s.tensor.detach().reshape(-1).float() for s in self.slots])

    def write_back(self, flat):
        with torch.no_grad():
            for s in self.slots:
                s.tensor.copy_(flat[s.offset:s.offset + s.numel].view_as(s.tensor))

    def partner(self, round_index):
        return random_matching(self.ps.size(), round_index, self.seed, self.topology)[self.ps.rank()]

    # -- payloads -------------------------------------------------------------------------
    def encode(self, flat, round_index):
        """One uint8 buffer: a payload (header + body) per slot, in slot order; returns (buffer, eps)."""
        start = time.perf_counter()
        rank = self.ps.rank()
        codecs = [self.codec if s.quantize and s.name in self.spread else self.exact for s in self.slots]
        sizes = [c.max_payload_nbytes(s.numel) for c, s in zip(codecs, self.slots)]  # fixed-size payloads
        buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=flat.device)
        eps_sent, offset = {}, 0
        with kernel_stream(flat.device):
            for s, codec, size in zip(self.slots, codecs, sizes):
                x, out = as_array(flat[s.offset:s.offset + s.numel]), as_array(buffer[offset:offset + size])
                if codec is self.exact:
                    codec.encode(x, out)
                else:
                    lo, hi = torch.aminmax(flat[s.offset:s.offset + s.numel]) if s.numel else (0.0, 0.0)
                    magnitude = max(-float(lo), float(hi))
                    eps = eps_sent[s.name] = codec.eps_for_spread(self.spread[s.name], magnitude)
                    codec.encode(x, out, eps=eps, step=round_index, key=rank_key(s.name, rank))
                offset += size
        self.stats.add(encode_seconds=time.perf_counter() - start)
        return buffer, eps_sent

    def decode(self, received, reference, partner):
        """The partner's model (flat fp32) decoded against ``reference``; returns (decoded, failed names, eps)."""
        start = time.perf_counter()
        decoded = torch.empty_like(reference)
        failed, eps_received, offset = [], {}, 0
        total = received.numel()
        with kernel_stream(reference.device):
            for s in self.slots:
                where = f"horovod_qsgd: SwarmOptimizer: tensor {s.name!r} from rank {partner}"
                try:
                    if offset + HEADER_NBYTES > total:
                        raise PayloadError(f"the received {total} bytes end before this tensor's payload")
                    header = parse_header(bytes(received[offset:offset + HEADER_NBYTES].cpu().numpy()))
                    if header.codec_id == LATTICE_CODEC_ID and self.codec is not None:
                        codec = self.codec
                    elif header.codec_id == EXACT_CODEC_ID:
                        codec = self.exact
                    else:
                        raise PayloadError(f"unexpected codec id {header.codec_id}")
                    if offset + header.nbytes > total:
                        raise PayloadError(f"truncated payload: header says {header.nbytes} bytes, "
                                           f"{total - offset} left")
                    payload = received[offset:offset + header.nbytes]
                    out = decoded[s.offset:s.offset + s.numel]
                    bad = codec.decode(as_array(payload), as_array(reference[s.offset:s.offset + s.numel]),
                                       as_array(out))
                except PayloadError as exc:
                    raise CompressionMismatchError(f"{where}: {exc}. Every rank must use the same model and "
                                                   "SwarmOptimizer settings.") from exc
                if codec is self.codec:
                    eps_received[s.name] = codec.payload_eps(as_array(payload))
                if bad:
                    failed.append(s.name)
                offset += header.nbytes
        if offset != total:
            raise CompressionMismatchError(
                f"horovod_qsgd: SwarmOptimizer: rank {partner} sent {total} bytes, {total - offset} more than "
                f"the payloads of this model's {len(self.slots)} tensors; the ranks' models differ.")
        self.stats.add(decode_seconds=time.perf_counter() - start)
        return decoded, failed, eps_received

    # -- collectives ----------------------------------------------------------------------
    def alltoall_async(self, send, partner, what):
        splits = torch.zeros(self.ps.size(), dtype=torch.int32)
        if partner >= 0:
            splits[partner] = send.numel()
        else:
            send = send[:0]
        return hvd.alltoall_async(send, splits=splits, name=self.prefix + what, process_set=self.ps)

    def wait(self, handle, partner, round_index):
        """Completes an alltoall; checks that only the partner sent anything."""
        start = time.perf_counter()
        received, splits = hvd.synchronize(handle)
        self.stats.add(wait_seconds=time.perf_counter() - start)
        splits = splits.tolist()
        for rank, count in enumerate(splits):
            if count and rank != partner:
                raise CompressionMismatchError(
                    f"horovod_qsgd: SwarmOptimizer: round {round_index}: rank {rank} sent {count} elements to "
                    f"this rank (rank {self.ps.rank()}), whose partner is "
                    f"{'nobody' if partner < 0 else f'rank {partner}'}: the ranks disagree on the matching "
                    "(different seeds, topologies or round counters; load every rank's checkpoint).")
        if partner >= 0 and not splits[partner]:
            raise CompressionMismatchError(
                f"horovod_qsgd: SwarmOptimizer: round {round_index}: partner rank {partner} sent nothing to rank "
                f"{self.ps.rank()}: the ranks disagree on the matching.")
        return received

    def exchange(self, reference, partner, round_index, received):
        """Decodes the partner's model, repairs decode failures; returns (model or None, diagnostics).

        Every rank calls this in every round (with quantization the failure
        flags and the repair are collectives). A rank flags the lattice-coded
        tensors it could not decode, one bit per tensor; the ranks allreduce
        the flags, and for every pair with a flag both partners re-send the
        tensors flagged by either of them in full precision (``reference``,
        the values the lattice payloads encoded), so both average them exactly.
        """
        decoded, failed, eps_received = None, [], {}
        if partner >= 0:
            decoded, failed, eps_received = self.decode(received, reference, partner)
        repaired = []
        if self.codec is not None:
            repaired = self.repair(reference, partner, round_index, failed, decoded)
        if decoded is not None:
            for s in self.slots:
                if s.quantize:
                    diff = decoded[s.offset:s.offset + s.numel] - reference[s.offset:s.offset + s.numel]
                    observed = diff.abs_().max().item() if s.numel else 0.0
                    # a larger spread seen recently (with another partner) fades by half a round
                    self.spread[s.name] = max(observed, SPREAD_MEMORY * self.spread.get(s.name, 0.0))
        self.stats.add(decode_failures=len(failed))
        return decoded, {"failed": failed, "fallback": repaired, "eps_received": eps_received}

    def repair(self, reference, partner, round_index, failed, decoded):
        """The failure flags' allreduce and, if any rank flagged, the exact re-send; returns the re-sent names."""
        quantized = [s for s in self.slots if s.quantize]
        words = max(1, (len(quantized) + 30) // 31)
        flags = torch.zeros(self.ps.size(), words, dtype=torch.int32)
        me = self.ps.rank()
        for k, s in enumerate(quantized):
            if s.name in failed:
                flags[me, k // 31] |= 1 << (k % 31)
        flags = hvd.synchronize(hvd.allreduce_async(flags, op=hvd.Sum, name=self.prefix + "flags",
                                                    process_set=self.ps))
        if not flags.any():
            return []
        resend = []
        if partner >= 0:
            pair = flags[me] | flags[partner]
            resend = [s for k, s in enumerate(quantized) if int(pair[k // 31]) >> (k % 31) & 1]
        send = torch.cat([reference[s.offset:s.offset + s.numel] for s in resend]) if resend else reference[:0]
        exact = self.wait(self.alltoall_async(send, partner if resend else -1, "fallback"),
                          partner if resend else -1, round_index)
        if resend:
            if exact.numel() != send.numel():
                raise CompressionMismatchError(
                    f"horovod_qsgd: SwarmOptimizer: round {round_index}: rank {partner} re-sent {exact.numel()} "
                    f"values, this rank expected {send.numel()}; the ranks' models differ.")
            offset = 0
            for s in resend:
                decoded[s.offset:s.offset + s.numel] = exact[offset:offset + s.numel]
                offset += s.numel
            self.stats.add(bytes_sent=send.numel() * 4, fallback_rounds=1, fallback_tensors=len(resend))
            _LOG.info("horovod_qsgd: SwarmOptimizer: round %d: %d tensor(s) did not decode between ranks %d and %d "
                      "(models further apart than the lattice radius); re-sent in full precision: %s",
                      round_index, len(resend), me, partner, ", ".join(s.name for s in resend))
        return [s.name for s in resend]

    def start(self):
        """Snapshot, encode and start the alltoall of a round; returns the pending exchange."""
        self.handshake()
        round_index = self.round
        partner = self.partner(round_index)
        snapshot = self.flat()
        send, eps_sent = self.encode(snapshot, round_index) if partner >= 0 else (torch.zeros(0, dtype=torch.uint8), {})
        handle = self.alltoall_async(send, partner, "exchange")
        self.round += 1
        model_bytes = sum(s.numel * s.tensor.element_size() for s in self.slots)
        self.stats.add(rounds=1, rounds_sat_out=int(partner < 0), bytes_sent=send.numel(),
                       bytes_uncompressed=model_bytes if partner >= 0 else 0,
                       tensors_compressed=sum(1 for s in self.slots if s.name in eps_sent) if partner >= 0 else 0,
                       tensors_passed_through=len(self.slots) - len(eps_sent) if partner >= 0 else 0)
        return _ExchangeInFlight(round_index, partner, snapshot, send, handle, eps_sent=eps_sent)

    def finish(self, pending, blocking):
        """Applies a started exchange to the model (every rank calls it, in the same round)."""
        received = pending.received
        if received is None:
            received = self.wait(pending.handle, pending.partner, pending.round)
        decoded, info = self.exchange(pending.snapshot, pending.partner, pending.round, received)
        self.last = dict(info, round=pending.round, partner=pending.partner, eps_sent=pending.eps_sent)
        if decoded is None:
            return
        average = decoded.add_(pending.snapshot).mul_(0.5)  # (snapshot + partner) / 2, in place
        if not blocking:  # what this rank computed since the snapshot goes on top
            average += self.flat().sub_(pending.snapshot)
        self.write_back(average)

    # -- the optimizer hooks ----------------------------------------------------------------
    def after_local_step(self):
        self.steps += 1
        if self.steps % self.local_steps:
            return
        if self.averaging == "blocking":
            self.finish(self.start(), blocking=True)
            return
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.finish(pending, blocking=False)
        self.pending = self.start()

    def synchronize(self):
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.finish(pending, blocking=False)

    def average_models(self):
        self.synchronize()
        self.handshake()
        flat = self.flat()
        if flat.numel():
            total = hvd.synchronize(hvd.allreduce_async(flat, op=hvd.Average, name=self.prefix + "average",
                                                        process_set=self.ps))
            self.write_back(total)

    # -- checkpoints ----------------------------------------------------------------------
    def state(self):
        pending = None
        if self.pending is not None:
            p = self.pending
            if p.received is None:  # every rank has started it: waiting is local and cannot hang
                p.received, p.handle = self.wait(p.handle, p.partner, p.round), None
            pending = {"round": p.round, "partner": p.partner, "snapshot": p.snapshot.clone(),
                       "received": p.received.clone(), "eps_sent": dict(p.eps_sent)}
        return {"format": STATE_FORMAT, "settings": self.settings(), "steps": self.steps, "round": self.round,
                "spread": dict(self.spread), "pending": pending}

    def check(self, state):
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"horovod_qsgd: SwarmOptimizer cannot load a state of format {state.get('format')!r} "
                             f"(this version writes {STATE_FORMAT}).")
        if state["settings"] != self.settings():
            raise ValueError(f"horovod_qsgd: SwarmOptimizer: the checkpoint was written with settings "
                             f"{state['settings']}, this optimizer has {self.settings()}; build it with the same "
                             "arguments and model.")

    def load(self, state):
        """Replaces the counters, estimates and exchange in flight (every rank loads its own state)."""
        self.check(state)
        if self.pending is not None and self.pending.handle is not None:
            # started by every rank: waiting is local; the loaded state replaces it on every rank
            self.wait(self.pending.handle, self.pending.partner, self.pending.round)
        self.steps, self.round, self.spread = int(state["steps"]), int(state["round"]), dict(state["spread"])
        p = state["pending"]
        self.pending = None if p is None else _ExchangeInFlight(
            p["round"], p["partner"], p["snapshot"].clone(), None, None, p["received"].clone(), p["eps_sent"])
        self.verified = False  # compare round counters again before the next exchange
