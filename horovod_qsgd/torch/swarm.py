"""SwarmSGD: decentralized SGD with local steps and quantized pairwise model averaging.

Nadiradze, Sabour, Davies, Li, Alistarh, "Decentralized SGD with Asynchronous,
Local and Quantized Updates" (arXiv 1910.12308)::

    import horovod.torch as hvd
    from horovod_qsgd.torch.swarm import SwarmOptimizer

    optimizer = SwarmOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               model, local_steps=4, quantization="lattice8")
    ...                                   # the training loop is unchanged
    optimizer.average_models()            # before evaluating or saving the model

See :func:`SwarmOptimizer` for the algorithm, the policies and the costs.
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
from horovod_qsgd.torch.handshake import check_settings_across_ranks
from horovod_qsgd.common.naming import rank_key
from horovod_qsgd.common.stats import CompressionStats
from horovod_qsgd.kernels.rng import mix64_py, stream_base
from horovod_qsgd.torch.compression import as_array

__all__ = ["SwarmOptimizer", "SwarmMixin", "SwarmStats", "random_matching", "TOPOLOGIES"]

STATE_FORMAT = 1
NAME_PREFIX = "horovod_qsgd.swarm"
TOPOLOGIES = ("complete", "ring")
AVERAGING = ("blocking", "nonblocking")
_MATCHING_KEY = zlib.crc32(b"horovod_qsgd.swarm.matching")
_PURPOSE_MATCHING = 9
_GOLDEN = 0x9E3779B97F4A7C15
_LOG = logging.getLogger(__name__)
#: The spread estimate of a tensor is max(spread measured now, SPREAD_MEMORY * previous estimate).
SPREAD_MEMORY = 0.5


# ------------------------------------------------------------------ matching --

def _uniform_below(seed, round_index):
    """Draws of uniform integers in [0, m), from the counter-based stream (seed, round)."""
    base = int(stream_base(seed, round_index, _MATCHING_KEY, _PURPOSE_MATCHING))
    counter = [0]

    def below(m):
        counter[0] += 1
        return mix64_py(base + counter[0] * _GOLDEN) % m  # bias below m / 2**64
    return below


def _check_edges(topology, num_ranks):
    edges = []
    for edge in topology:
        try:
            a, b = (int(v) for v in edge)
        except (TypeError, ValueError):
            raise ValueError(f"topology: edge {edge!r} is not a pair of ranks") from None
        if a == b or not (0 <= a < num_ranks and 0 <= b < num_ranks):
            raise ValueError(f"topology: edge {edge!r} must join two different ranks in 0..{num_ranks - 1}")
        edges.append((min(a, b), max(a, b)))
    return sorted(set(edges))


def random_matching(num_ranks, round_index, seed=0, topology="complete"):
    """The pairing of ranks for one round: ``partner[r]`` is r's partner, or -1 if r sits out.

    Drawn from the counter-based generator keyed by ``(seed, round_index)``,
    so every rank computes the same matching without communicating.

    * ``"complete"``: a uniformly random perfect matching of all ranks (one
      uniformly chosen rank sits out when the count is odd).
    * ``"ring"``: ranks ``r`` and ``r+1 mod n`` are neighbours; for an even
      count one of the ring's two perfect matchings, chosen uniformly; for an
      odd count a uniformly chosen rank sits out and the path of the others
      is matched perfectly.
    * a sequence of ``(a, b)`` edges: a random maximal matching (edges in a
      random order, each taken if both ends are free); maximal, so perfect
      only where the graph allows it.
    """
    n = int(num_ranks)
    partner = [-1] * n
    below = _uniform_below(seed, round_index)
    if isinstance(topology, str):
        if topology not in TOPOLOGIES:
            raise ValueError(f"topology={topology!r} is not supported; allowed: 'complete', 'ring' "
                             "or a sequence of (rank, rank) edges")
        if n < 2:
            return partner
        if topology == "complete" or n == 3:  # a ring of 3 is the complete graph
            order = list(range(n))
            for i in range(n - 1, 0, -1):  # Fisher-Yates
                j = below(i + 1)
                order[i], order[j] = order[j], order[i]
            pairs = [(order[k], order[k + 1]) for k in range(0, n - 1, 2)]
        elif n % 2 == 0:
            offset = below(2)
            pairs = [((offset + k) % n, (offset + k + 1) % n) for k in range(0, n, 2)]
        else:
            out = below(n)
            pairs = [((out + 1 + k) % n, (out + 2 + k) % n) for k in range(0, n - 1, 2)]
    else:
        edges = _check_edges(topology, n)
        for i in range(len(edges) - 1, 0, -1):
            j = below(i + 1)
            edges[i], edges[j] = edges[j], edges[i]
        pairs, taken = [], set()
        for a, b in edges:
            if a not in taken and b not in taken:
                pairs.append((a, b))
                taken.update((a, b))
    for a, b in pairs:
        partner[a], partner[b] = b, a
    return partner


# --------------------------------------------------------------- statistics --

class SwarmStats(CompressionStats):
    """Counters since the last reset (see :meth:`SwarmMixin.compression_stats`)."""

    FIELDS = CompressionStats.FIELDS + ("rounds", "rounds_sat_out", "decode_failures", "fallback_rounds",
                                        "fallback_tensors", "wait_seconds")


# ---------------------------------------------------------------- the engine --

class _Slot:
    __slots__ = ("name", "tensor", "kind", "offset", "numel", "quantize")

    def __init__(self, name, tensor, kind, offset, quantize):
        self.name, self.tensor, self.kind, self.offset = name, tensor, kind, offset
        self.numel, self.quantize = tensor.numel(), quantize


class _Pending:
    """A non-blocking exchange in flight: its round, partner, snapshot and handle (or received bytes)."""
    __slots__ = ("round", "partner", "snapshot", "send", "handle", "received", "eps_sent")

    def __init__(self, round_index, partner, snapshot, send, handle, received=None, eps_sent=None):
        self.round, self.partner, self.snapshot, self.send = round_index, partner, snapshot, send
        self.handle, self.received, self.eps_sent = handle, received, eps_sent or {}


def _parse_quantization(quantization):
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


class _Engine:
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
        return _Pending(round_index, partner, snapshot, send, handle, eps_sent=eps_sent)

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
        self.pending = None if p is None else _Pending(p["round"], p["partner"], p["snapshot"].clone(), None, None,
                                                       p["received"].clone(), p["eps_sent"])
        self.verified = False  # compare round counters again before the next exchange


# ------------------------------------------------------------------ optimizer --

class SwarmMixin:
    """Methods SwarmSGD adds to a torch optimizer class; see :func:`SwarmOptimizer`.

    ``isinstance(optimizer, SwarmMixin)`` tells a swarm optimizer apart.
    """

    def step(self, closure=None):
        """One local step of the wrapped optimizer; every ``local_steps`` steps, a pairwise model average."""
        loss = super().step(closure)
        self._swarm.after_local_step()
        return loss

    def synchronize(self):
        """Applies a non-blocking exchange still in flight (a collective: call it on every rank)."""
        self._swarm.synchronize()

    def average_models(self):
        """Replaces every rank's model by the average over all ranks (one allreduce; call on every rank).

        Parameters and floating-point buffers are averaged; a non-blocking
        exchange in flight is applied first.  Use it before evaluating or
        saving the model: SwarmSGD's individual models differ slightly.
        """
        self._swarm.average_models()

    @property
    def swarm_round(self):
        """Number of exchange rounds started so far."""
        return self._swarm.round

    def partner(self, round_index=None):
        """This rank's partner in a round (default: the next one), -1 when it sits out."""
        return self._swarm.partner(self._swarm.round if round_index is None else round_index)

    def last_exchange(self):
        """Diagnostics of the last round: round, partner, eps sent/received per tensor, failed tensors, fallback."""
        return dict(self._swarm.last)

    def compression_stats(self, reset=False):
        """Counters since the last reset.

        ``rounds``, ``rounds_sat_out``; ``bytes_sent`` (payloads and fallbacks
        this rank sent) and ``bytes_uncompressed`` (the same exchanges at the
        tensors' own dtype); ``tensors_compressed`` / ``tensors_passed_through``
        (lattice-coded vs exact payloads); ``decode_failures`` (tensors
        whose payload did not decode here), ``fallback_rounds`` (rounds this
        rank re-sent in full precision); ``encode_seconds``,
        ``decode_seconds``, ``wait_seconds`` (blocked in the exchange).
        """
        return self._swarm.stats.snapshot(reset)

    def state_dict(self):
        """The wrapped optimizer's state plus ``"swarm"``: local step and round counters, seed and settings,
        spread estimates, and a non-blocking exchange in flight (snapshot and received bytes).

        Models and optimizer states differ between ranks: save each rank's.
        """
        state = super().state_dict()
        state["swarm"] = self._swarm.state()
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        swarm = state_dict.pop("swarm", None)
        if swarm is not None:
            self._swarm.check(swarm)  # before anything is loaded
        super().load_state_dict(state_dict)
        if swarm is not None:
            self._swarm.load(swarm)


def _named_tensors(optimizer, named_parameters, named_buffers):
    module = named_parameters if isinstance(named_parameters, torch.nn.Module) else None
    if module is not None:
        named_parameters = module.named_parameters()
        if named_buffers is None:
            named_buffers = module.named_buffers()
    in_optimizer = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        named_parameters = [(f"param.{i}", p) for i, p in enumerate(in_optimizer)]
    named_parameters = list(named_parameters)
    names = [n for n, _ in named_parameters]
    if len(set(names)) != len(names):
        raise ValueError("horovod_qsgd: SwarmOptimizer: named_parameters has duplicate names")
    named_ids = {id(p) for _, p in named_parameters}
    missing = [p for p in in_optimizer if id(p) not in named_ids]
    if missing:
        raise ValueError(f"horovod_qsgd: SwarmOptimizer: {len(missing)} of the optimizer's parameters are not in "
                         "named_parameters; pass model.named_parameters() or the model itself.")
    return named_parameters, list(named_buffers or [])


def SwarmOptimizer(optimizer, named_parameters=None, local_steps=4, quantization=None, topology="complete",
                   averaging="blocking", seed=0, process_set=hvd.global_process_set, named_buffers=None,
                   min_numel=1024):
    r"""SwarmSGD: local SGD steps and pairwise model averaging with random partners (arXiv 1910.12308).

    Use it *instead of* ``hvd.DistributedOptimizer``: it wraps the local
    optimizer, and ``step()`` does the local step and, every
    ``local_steps`` steps, one exchange round.

    Algorithm. Every rank keeps its own model :math:`X_i` and trains it on
    its own data with the wrapped optimizer. In round :math:`t` (after every
    ``H = local_steps`` local steps) the ranks are paired by a random
    matching of the ``topology`` graph, drawn from a counter-based generator
    keyed by ``(seed, t)``: every rank computes the same matching without
    communicating, and with an odd count one rank sits out the round. The
    partners exchange models through one ``hvd.alltoall`` whose splits send
    only to the partner (a rank sitting out sends nothing), and both set

    .. math:: X_i, X_j \leftarrow (X_i + X_j) / 2

    (``averaging="blocking"``). With ``averaging="nonblocking"`` (the
    paper's variant) the round snapshots :math:`S_i = X_i`, starts the
    exchange asynchronously and returns at once; training continues, and
    at the next round the rank applies :math:`X_i \leftarrow (S_i + S_j)/2 +
    (X_i - S_i)`: the average of the snapshots plus what it computed since.
    Communication then overlaps ``H`` steps of computation; the partner's
    model is ``H`` steps stale.

    Quantized exchange (``quantization="lattice8"``): models are large in
    norm but close to each other, so each tensor is sent with the
    cubic-lattice quantizer of Davies et al. (ICLR 2021,
    :class:`~horovod_qsgd.codecs.lattice.LatticeCodec`): ``round(x/eps) mod
    q`` with unbiased stochastic rounding, decoded against the receiver's
    own tensor. ``eps`` is chosen per tensor so that the decodable radius
    ``eps * (q/2 - 2)`` is ``headroom`` (default 2) times the estimated
    spread ``max|X_i - X_j|``: the larger of the spread this rank measured
    at its last exchange and half its previous estimate (``SPREAD_MEMORY``).
    A tensor is sent exactly while no estimate exists (a rank's first
    round), and parameters under ``min_numel`` elements always are. Each
    partner ends within ``eps/2`` per coordinate of the exact average.
    Models further apart than the radius do not decode; a 32-bit checksum
    per 4096 coordinates detects it. The ranks then allreduce one bit per
    lattice-coded tensor and rank, and both partners of an affected pair
    re-send those tensors in full precision, so the round still averages
    them exactly (reported by ``last_exchange()`` and counted by
    ``compression_stats()`` as ``decode_failures``, ``fallback_rounds``,
    ``fallback_tensors``, and logged at INFO level).

    Args:
        optimizer: the local torch optimizer (its hyperparameters and state
            stay in use; its state, e.g. momentum, stays local).
        named_parameters: ``model.named_parameters()`` for stable names, or
            the model itself (then its buffers are averaged too). Default:
            the optimizer's parameters as ``param.<i>``.
        local_steps (int): ``H``, local steps between exchanges (default 4).
            More: less communication, models drift further apart.
        quantization: ``None`` (default; exact float32), ``"lattice8"``
            (``"lattice3"``..``"lattice8"``: bits per coordinate), a dict of
            :class:`LatticeCodec` arguments or a ``LatticeCodec``.
        topology: ``"complete"`` (default), ``"ring"`` or a sequence of
            ``(rank, rank)`` edges (process-set ranks), see
            :func:`random_matching`.
        averaging: ``"blocking"`` (default) or ``"nonblocking"``.
        seed (int): seed of the matchings and of the rounding noise; the
            same on every rank (checked).
        process_set: the Horovod process set whose ranks swarm (default
            global); every rank in it must call ``step()`` equally often.
        named_buffers: ``model.named_buffers()`` when ``named_parameters``
            is not the model.
        min_numel (int): parameters with fewer elements are always sent
            exactly (default 1024; their bytes are negligible).

    Buffers: floating-point buffers (BatchNorm running mean and variance)
    are averaged with the partner in full precision at each exchange (they
    are small, and a quantization step chosen for the weights would not fit
    them), and by :meth:`average_models`. Integer buffers
    (``num_batches_tracked``) stay local. Buffers are exchanged only when
    the model or ``named_buffers`` is given.

    When to prefer it over gradient compression (``hvd.DistributedOptimizer``
    with ``compression=QSGD(...)``): when the network, not computation, is
    the bottleneck. Each rank sends its model to one partner every ``H``
    steps: per step ``4/H`` bytes per coordinate exact, about ``1/H`` with
    ``lattice8``, independent of the number of ranks; ring allreduce sends
    ``2(n-1)/n * 4`` bytes per coordinate every step (4 at 2 ranks, toward
    8), and compressed gradients, allgathered, grow with the rank count.
    The price: models differ between ranks (call :meth:`average_models`
    before evaluating), and pairwise averaging mixes more slowly than a
    global average, so progress per step can lag synchronous SGD at large
    rank counts or large ``H``; tune ``H`` and the learning rate. Horovod's
    ``alltoall`` is a collective of the whole process set, so a round waits
    for every rank to reach it (a straggler delays all ranks once per round,
    not once per step); ``"nonblocking"`` hides the transfer, not that wait.

    Costs: memory for one flat fp32 copy of the model per round (two with
    ``"nonblocking"``: the snapshot is kept until the next round), an
    encode and a decode pass over the model per round, and per round one
    ``alltoall`` plus, with quantization, an allreduce of
    ``size * ceil(T/31)`` int32 flags (T lattice-coded tensors) and, rarely,
    an exact re-send. Every rank of the process set must call ``step()``
    equally often (as with ``hvd.DistributedOptimizer``);
    ``hvd.broadcast_optimizer_state`` calls ``step()`` once on a fresh
    optimizer, which counts as a local step on every rank alike.

    Returns an instance of a subclass of the optimizer's class (like
    ``hvd.DistributedOptimizer``) that shares its parameter groups, state
    and hooks, with :meth:`SwarmMixin.average_models`, ``synchronize()``
    (apply a non-blocking exchange in flight), ``partner()``,
    ``last_exchange()``, ``compression_stats()`` and a ``state_dict()`` that
    adds the local-step and round counters, the settings (seed included),
    the spread estimates and an exchange in flight (models differ between
    ranks: save every rank's).
    """
    if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
        raise ValueError(f"local_steps={local_steps!r} must be an integer >= 1")
    if averaging not in AVERAGING:
        raise ValueError(f"averaging={averaging!r} is not supported; allowed: 'blocking', 'nonblocking'")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 64:
        raise ValueError(f"seed={seed!r} must be an integer in [0, 2**64)")
    if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
        raise ValueError(f"min_numel={min_numel!r} must be an integer >= 0")
    if not process_set.included():
        raise ValueError("horovod_qsgd: SwarmOptimizer: this rank is not in process_set")
    if isinstance(topology, str):
        random_matching(2, 0, 0, topology)  # validates the name
    else:
        topology = _check_edges(topology, process_set.size())
    codec = _parse_quantization(quantization)
    named_parameters, named_buffers = _named_tensors(optimizer, named_parameters, named_buffers)
    slots, offset = [], 0
    for kind, named in (("param", named_parameters), ("buffer", named_buffers)):
        for name, tensor in named:
            if not tensor.dtype.is_floating_point:
                continue  # integer buffers stay local
            quantize = codec is not None and kind == "param" and tensor.numel() >= min_numel
            slots.append(_Slot(f"{kind}:{name}", tensor, kind, offset, quantize))
            offset += tensor.numel()
    engine = _Engine(slots, local_steps, codec, topology, averaging, seed, process_set, min_numel)
    # A subclass of the optimizer's own class sharing its parameter groups, state and hooks (the
    # wrapped optimizer's __init__ is not called again, so any optimizer signature works).
    cls = type(optimizer.__class__.__name__, (SwarmMixin, optimizer.__class__), {})
    swarm = cls.__new__(cls)
    swarm.__dict__.update(optimizer.__dict__)
    swarm._swarm = engine
    return swarm
