r"""Fusion: the two-stage exchanges of several tensors in one alltoall and one allgather.

Horovod fuses allreduces and allgathers, not alltoalls: unfused, every
two-stage tensor pays Horovod's negotiation and N-1 message latencies twice.
A group of tensors shares both collectives instead.

Groups. Collectives are matched across ranks by name, so every rank must form
the same groups whatever order its tensors arrive in. A *round* is what a rank
compresses before it first waits for a result (one optimizer step, one
``hvd.allreduce`` call). :class:`Fuser` learns a round's groups from the round
before: its two-stage tensors sorted by (process set, name) and packed greedily
up to ``threshold`` bytes of first-stage capacity (a function of the shape and
codec, equal on every rank). A tensor that completes its learned group starts
the group's alltoall at once, so the first stage still overlaps the backward
pass; what is left when the round's first result is waited for starts then
(learned groups with a member missing under their learned name, new tensors
packed anew).

Wire. One sender's part of a group's buffer is a *manifest* (a 16-byte
header: codec id 255, the number of tensors, the crc32 of their names, the
part's length) followed by the tensors' payloads in group order, each byte for
byte what it is alone. The manifest stops ranks that grouped other tensors
(another model) before anything is decoded, on every rank; the owner still adds
each tensor's slices in rank order, so no result bit depends on the packing.
A refusal notice (see :mod:`horovod_qsgd.common.exchange`) replaces a whole part.

Cost: 16 bytes per group and peer in each stage, and one copy of the encoded
slices into the group's buffer.
"""
import itertools
import zlib

from horovod_qsgd.codecs import HEADER_NBYTES, WIRE_VERSION, pack_header
from horovod_qsgd.common.collectives import ALLGATHER, ALLTOALL, Collective, RefusedEarlier
from horovod_qsgd.common.errors import CompressionMismatchError
from horovod_qsgd.common.exchange import (GROUP_CODEC_ID, check_payloads, decode_checked, decode_fixed_at,
                                         refusal_notice)
from horovod_qsgd.common.naming import PAYLOAD_PREFIX, SECOND_STAGE_PREFIX
from horovod_qsgd.common.two_stage import owner_key

DEFAULT_FUSION_THRESHOLD = 64 * 1024 * 1024  # Horovod's own HOROVOD_FUSION_THRESHOLD default
# A fused allgather group holds at most this many bytes of float32 gradient (or fusion_threshold, if smaller),
# by the device its tensors are on; a tensor above it is a group of its own. On a GPU every tensor alone pays
# its kernels' launches (30-150 us of host time each, issue #51): groups of DDP's bucket size, where ResNet-50's
# 52 compressed gradients make 5 groups and GPT-2 small's 50 make 17 (chosen from the launch counts, not yet
# timed on a GPU). On the host (0: each tensor alone, as Horovod's own allgather fusion packs them) fusing
# measured mixed on 2 ranks: a 17-layer MLP's steps 0.82x unshaped but 1.27x at 1 Gbit/s (one 17 MiB group
# waits for the backward pass's last layer, as groups are packed in name order), and a group of one cost about
# 0.35 ms more than the tensor alone (its manifest, built and checked).
ALLGATHER_GROUP_NBYTES = {"cpu": 0, "cuda": 25 * 1024 * 1024}


def check_fusion_threshold(threshold):
    """``threshold`` as an int, or ValueError naming what is allowed."""
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
        raise ValueError(f"horovod_qsgd: fusion_threshold={threshold!r} must be an int >= 0 (bytes of first-stage "
                         "payload per fused group; 0 gives every tensor its own collectives)")
    return threshold


def pack(entries, threshold):
    """Consecutive groups of ``entries`` ([(key, nbytes)], key = (scope, name)) of at most ``threshold`` bytes.

    A group never spans two scopes (process sets; a node-aware plan's
    ``fusion_scope``); an entry above the threshold is a group of its own.
    """
    groups, size = [], 0
    for key, nbytes in entries:
        if not groups or groups[-1][-1][0] != key[0] or size + nbytes > threshold:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes
    return groups


class Fuser:
    """Which tensors share collectives (two-stage, node-aware): the same groups on every rank (see the module
    docstring).

    Keys are (scope, tensor name), the scope a process set id (or a node-aware
    plan's ``fusion_scope``); items are what the caller starts
    a group with. A group is named by a number drawn from a counter that
    every rank advances alike, not by its members: ranks that grouped other
    tensors (another model) then meet in the same collective, and the
    manifests report the difference on every rank instead of leaving each
    rank waiting for a name the others never use.
    """

    def __init__(self, threshold, namespace=""):
        self.threshold = check_fusion_threshold(threshold)
        self.namespace = namespace  # equal on every rank, different for each compressor of a process
        self._learned = {}  # key -> (its group's name, the group's keys)
        self._round = {}  # key -> first-stage capacity, of this round's tensors
        self._waiting = {}  # key -> item, of this round's tensors whose group has not started
        self._groups_named = 0

    def add(self, key, capacity, item):
        """Notes a compressed tensor; returns [(name, items)] with the learned group it completes, or []."""
        if key in self._round:
            raise RuntimeError(f"horovod_qsgd: tensor {key[1]!r} was compressed twice before its result was "
                               "waited for; give every tensor in flight its own name.")
        self._round[key] = capacity
        self._waiting[key] = item
        name, group = self._learned.get(key, (None, ()))
        if not group or any(k not in self._waiting for k in group):
            return []
        return [(name, [self._waiting.pop(k) for k in group])]

    def end_round(self):
        """[(name, items)] of the round's groups not started yet; the round's groups are learned for the next."""
        partial, new = {}, []
        for key in sorted(self._waiting):
            if key in self._learned:
                partial.setdefault(self._learned[key][0], []).append(key)
            else:
                new.append(key)
        groups = sorted(partial.items()) + [(self._name(keys), keys) for keys in
                                            pack([(k, self._round[k]) for k in new], self.threshold)]
        started = [(name, [self._waiting[k] for k in keys]) for name, keys in groups]
        # A group learned again keeps its name: Horovod caches what it negotiated for a name.
        names = {group: name for name, group in (self._learned[key] for key in self._round if key in self._learned)}
        for key in self._round:
            for stale in self._learned.pop(key, (None, ()))[1]:
                self._learned.pop(stale, None)
        for keys in pack(sorted(self._round.items()), self.threshold):
            group = tuple(keys)
            learned = (names.get(group) or self._name(keys), group)
            for key in keys:
                self._learned[key] = learned
        self._round, self._waiting = {}, {}
        return started

    def _name(self, keys):
        self._groups_named += 1
        return f"{self.namespace}{keys[0][0]}.group{self._groups_named}"


class _Manifest:
    """The header in front of one rank's part of a fused buffer, checked like a codec's."""

    def __init__(self, names):
        self.names = names
        self.digest = zlib.crc32("\0".join(names).encode("utf-8"))

    def pack(self, nbytes):
        return pack_header(GROUP_CODEC_ID, len(self.names), self.digest, nbytes)

    def header_differences(self, header, count):
        if header.version != WIRE_VERSION:
            return [f"wire format version {header.version} (here {WIRE_VERSION})"]
        if header.codec_id != GROUP_CODEC_ID:
            return [f"codec id {header.codec_id} where a fused group's manifest (codec id {GROUP_CODEC_ID}) "
                    "belongs: that rank did not fuse these tensors"]
        if header.numel != count or header.digest != self.digest:
            return [f"a group of {header.numel} tensors, names digest {header.digest:#010x} (here {count}, "
                    f"{self.digest:#010x}): the ranks grouped other tensors"]
        return []


def fused_exchange(plans):
    """The fused exchange of several plans of one kind and process set: :class:`FusedTwoStage` for two-stage
    plans, :class:`FusedAllgather` for allgather plans."""
    return (FusedTwoStage if plans[0].starts_with_alltoall else FusedAllgather)(plans)


def group_label(names):
    """How errors name a fused group's tensors: all of them, or the first three and a count."""
    return ", ".join(names) if len(names) <= 3 else f"{', '.join(names[:3])} and {len(names) - 3} more fused with them"


class _FusedPayloads:
    """What every fused group's wire shares: a manifest in front of each sender's part, each member's payload
    after it, checked and decoded per sender."""

    def __init__(self, plans):
        self.names = [plan.name for plan in plans]
        self._manifest = _Manifest(self.names)
        self.label = group_label(self.names)

    def part_pieces(self, used):
        """The pieces of one sender's part from each member's bytes used (member m's buffer, bytes 0 to used[m])."""
        return [self._manifest.pack(HEADER_NBYTES + sum(used))] + [(m, 0, n) for m, n in enumerate(used)]

    def _decode_parts(self, codec, buffer, senders, numels_from, outs_from, what):
        """Decodes each sender's part of ``buffer`` (manifest, then a payload per member) into ``outs_from(sender)``.

        The manifests are walked and checked like payload headers (:func:`check_payloads`), then each part's
        payloads are decoded.
        """
        parts = check_payloads(buffer, senders, [len(self.names)] * len(senders), self._manifest, self.label,
                               f"group of {what}s")
        if codec.payload_nbytes_is_fixed:  # every payload's place known: one decode of all senders' parts
            starts, all_senders, numels, outs = [], [], [], []
            for sender, (start, end, _) in zip(senders, parts):
                sizes = [codec.max_payload_nbytes(numel) for numel in numels_from(sender)]
                if end - start != HEADER_NBYTES + sum(sizes):
                    break  # a part of another length: decoded part by part below, which names the fault
                starts += [start + HEADER_NBYTES + offset for offset in itertools.accumulate(sizes[:-1], initial=0)]
                all_senders += [sender] * len(sizes)
                numels += numels_from(sender)
                outs += outs_from(sender)
            else:
                decode_fixed_at(codec, buffer, starts, all_senders, numels, outs, self.names * len(parts), what)
                return
        for sender, (start, end, _) in zip(senders, parts):
            decode_checked(codec, buffer[start + HEADER_NBYTES:end], [sender] * len(self.names),
                           numels_from(sender), outs_from(sender), self.names, what)


class FusedAllgather(_FusedPayloads):
    """The allgather exchange of several tensors (their :class:`~horovod_qsgd.common.engine.AllgatherPlan`
    plans) in one collective: each rank's part is a manifest and its members' payloads (:meth:`part_pieces`)."""

    def __init__(self, plans):
        super().__init__(plans)
        self.plans = list(plans)
        self.codec, self.num_ranks = self.plans[0].codec, self.plans[0].num_ranks

    def conduct_members(self, transport, name, xs, steps, residuals, owner_residuals=None):
        """:meth:`conduct` from the members' flat float32 gradients ``xs`` (the adapter's tensors), encoded
        first, together (one launch sequence on a GPU where they share a step); ``residuals``: each member's
        error-feedback residual as the codec takes it, or None each; ``owner_residuals``: unused (see
        :meth:`FusedTwoStage.conduct_members`). Counts this rank's manifest as sent.

        Fixed-size payloads are encoded in place, behind the manifest, in the buffer sent: no copy."""
        capacities = [plan.capacity() for plan in self.plans]
        if self.codec.payload_nbytes_is_fixed:
            part = transport.zeros(HEADER_NBYTES + sum(capacities), "uint8")
            starts = itertools.accumulate(capacities, initial=HEADER_NBYTES)
            outs = [part[start:start + capacity] for start, capacity in zip(starts, capacities)]
        else:
            part, outs = None, [transport.zeros(capacity, "uint8") for capacity in capacities]
        used = type(self.plans[0]).encode_together(self.plans, [transport.array(x) for x in xs],
                                                   [transport.array(out) for out in outs], steps, residuals)
        self.plans[0].stats.add(bytes_sent=HEADER_NBYTES)
        del xs  # not held while the payloads travel
        if part is not None and list(used) == capacities:
            part[:HEADER_NBYTES] = transport.concatenate([self._manifest.pack(len(part))], [])
            return (yield from self._gather(name, part))
        return (yield from self.conduct(transport, name, outs, used))

    def capacity(self):
        """Bytes of one rank's part: what the group's members' payloads can take, and the manifest."""
        return HEADER_NBYTES + sum(plan.capacity() for plan in self.plans)

    def conduct(self, transport, name, payloads, used):
        """The group's allgather, named ``name``, conducted as
        :meth:`~horovod_qsgd.common.engine.AllgatherPlan.conduct` does one tensor's: ``payloads[m]`` is member
        m's buffer (the adapter's uint8 tensor) as its plan's ``encode`` (or ``encode_together``) wrote
        ``used[m]`` bytes of it. Returns (every rank's part, for :meth:`decode`; None: an allgather refuses
        nothing, every rank checks every part as it decodes)."""
        return (yield from self._gather(name, transport.concatenate(self.part_pieces(used), payloads)))

    def _gather(self, name, send):
        arriving = [self.capacity()] * self.num_ranks if self.codec.payload_nbytes_is_fixed else None
        gathered = yield Collective(ALLGATHER, PAYLOAD_PREFIX + name, send, arriving=arriving, equal_parts=True,
                                    final=True)
        return gathered, None

    @staticmethod
    def collectives(name):
        """[(kind, name)] of the collective :meth:`conduct` yields for a group named ``name``."""
        return [(ALLGATHER, PAYLOAD_PREFIX + name)]

    def decode(self, gathered, outs):
        """Adds every rank's payloads, in rank order, to ``outs[m]`` (float32, zeros on entry), checked."""
        self._decode_parts(self.codec, gathered, range(self.num_ranks), lambda sender: [p.numel for p in self.plans],
                           lambda sender: outs, "payload")


class FusedTwoStage(_FusedPayloads):
    """The two-stage exchange of several tensors (their :class:`~horovod_qsgd.common.two_stage.TwoStage`
    plans, one process set) in one alltoall and one allgather, on one rank.

    Each member is encoded by its own plan into its own buffer; this class
    says how the group's buffers are laid out (*pieces*: manifest bytes, or
    (member, start, end) ranges of a member's buffer, for the caller to
    concatenate), sums and re-encodes the owner's chunks, and decodes.
    """

    def __init__(self, stages):
        super().__init__(stages)
        self.stages = list(stages)
        self.first, self.second = self.stages[0].first, self.stages[0].second
        self.num_ranks, self.rank = self.stages[0].num_ranks, self.stages[0].rank

    def first_stage_pieces(self, member_splits):
        """(pieces, splits) of the alltoall from each member's ``encode_for_owners`` splits."""
        starts = [list(itertools.accumulate(splits, initial=0)) for splits in member_splits]
        pieces, splits = [], []
        for owner in range(self.num_ranks):
            if owner == self.rank:
                splits.append(0)
                continue
            nbytes = HEADER_NBYTES + sum(member[owner] for member in member_splits)
            pieces.append(self._manifest.pack(nbytes))
            pieces.extend((m, start[owner], start[owner + 1]) for m, start in enumerate(starts))
            splits.append(nbytes)
        return pieces, splits

    def sum_and_encode(self, received, totals, outs, steps, owner_residuals):
        """The owner's step for every member (see ``TwoStage.sum_and_encode``).

        ``totals[m]``: member m's own chunk on entry; ``outs[m]``: zeroed
        buffers of its ``owned_capacity()``. Returns (bytes used per member,
        None), or (None, CompressionMismatchError) when a received part does
        not match: send a refusal notice in place of the group's part, then
        raise it.
        """
        senders = [r for r in range(self.num_ranks) if r != self.rank]
        numels = [stage.owned[1] - stage.owned[0] for stage in self.stages]
        try:
            self._decode_parts(self.first, received, senders, lambda sender: numels, lambda sender: totals,
                               "first-stage slice")
        except CompressionMismatchError as exc:
            return None, exc
        if len(set(steps)) == 1:  # the members' sums in one encode_many (one launch sequence on a GPU)
            residuals = None if all(r is None for r in owner_residuals) else list(owner_residuals)
            return self.second.encode_many(totals, outs, step=steps[0], keys=[owner_key(stage.name, self.rank)
                                                                              for stage in self.stages],
                                           residuals=residuals), None
        return [stage.encode_owned(total, out, step, residual) for stage, total, out, step, residual
                in zip(self.stages, totals, outs, steps, owner_residuals)], None

    def conduct_members(self, transport, name, xs, steps, residuals, owner_residuals):
        """:meth:`conduct` from the members' flat float32 gradients ``xs`` (the adapter's tensors), encoded
        first, together (see ``TwoStagePlan.encode_together``); ``residuals``: each member's error-feedback
        residual as the codec takes it, or None each; ``owner_residuals``: as :meth:`conduct` takes it.
        Counts this rank's manifests as sent in the first stage."""
        outs = [transport.zeros(stage.capacity(), "uint8") for stage in self.stages]
        owns = [transport.empty(stage.own_numel(), "float32") for stage in self.stages]
        member_splits = type(self.stages[0]).encode_together(
            self.stages, [transport.array(x) for x in xs], [transport.array(out) for out in outs],
            [transport.array(own) for own in owns], steps, residuals)
        manifests = HEADER_NBYTES * (self.num_ranks - 1)
        self.stages[0].stats.add(bytes_sent_first_stage=manifests, bytes_sent=manifests)
        conduct = self.conduct(transport, name, [out[:sum(splits)] for out, splits in zip(outs, member_splits)],
                               member_splits, owns, steps, owner_residuals)
        del xs, outs, owns  # the conduct holds what it still needs, no longer than it needs it
        return (yield from conduct)

    def conduct(self, transport, name, slices, member_splits, owns, steps, owner_residuals):
        """The group's exchange, named ``name``, from its members' encoded slices to what the owners' sums
        arrive as, conducted as :meth:`~horovod_qsgd.common.engine.AllgatherPlan.conduct` does one tensor's.

        ``slices[m]``, ``member_splits[m]``: member m's slices as its plan's ``encode`` wrote them (the
        adapter's uint8 tensor) and their splits; ``owns[m]``: its own chunk (float32); ``owner_residuals``:
        a function called once the slices arrived that returns each member's owner-side residual as the codec
        takes it (or None each). Returns (what the owners' sums arrived as, for :meth:`decode`; None, or the
        error this rank refused with). Thrown :class:`~horovod_qsgd.common.collectives.RefusedEarlier` at its
        first collective, it sends a refusal notice in place of its sums without waiting for that collective.
        """
        pieces, splits = self.first_stage_pieces(member_splits)
        try:
            received, _ = yield Collective(ALLTOALL, PAYLOAD_PREFIX + name, transport.concatenate(pieces, slices),
                                           splits=splits)
        except RefusedEarlier as earlier:
            used, refusal = None, earlier.error
        else:
            outs = [transport.zeros(stage.owned_capacity(), "uint8") for stage in self.stages]
            used, refusal = self.sum_and_encode(transport.array(received), [transport.array(own) for own in owns],
                                                [transport.array(out) for out in outs], steps, owner_residuals())
        del owns  # this rank's own chunks are in its sums now: not kept while the sums travel
        if refusal is not None:
            sent = transport.concatenate([refusal_notice()], [])
        else:
            sent = transport.concatenate(self.second_stage_pieces(used), outs)
        gathered = yield Collective(ALLGATHER, SECOND_STAGE_PREFIX + name, sent, final=True, refusal=refusal)
        return gathered, refusal

    @staticmethod
    def collectives(name):
        """[(kind, name)] of the collectives :meth:`conduct` yields for a group named ``name``, in order."""
        return [(ALLTOALL, PAYLOAD_PREFIX + name), (ALLGATHER, SECOND_STAGE_PREFIX + name)]

    def second_stage_pieces(self, used):
        """The pieces of this owner's part of the allgather, from ``sum_and_encode``'s bytes used."""
        return self.part_pieces(used)

    def decode(self, gathered, outs):
        """The exchange's last step, as :meth:`FusedAllgather.decode`: :meth:`decode_gathered`."""
        self.decode_gathered(gathered, outs)

    def decode_gathered(self, gathered, outs):
        """Adds every owner's decoded sums into their chunks of ``outs[m]`` (float32, zeros on entry)."""
        self._decode_parts(self.second, gathered, range(self.num_ranks),
                           lambda owner: [s.bounds[owner][1] - s.bounds[owner][0] for s in self.stages],
                           lambda owner: [out[s.bounds[owner][0]:s.bounds[owner][1]] for s, out in
                                          zip(self.stages, outs)],
                           "second-stage sum")
