"""A Horovod PyTorch compressor's payload exchanges in flight on this rank, between compress and decompress.

``compress`` hands each tensor to :meth:`PayloadExchanges.start`, which asks the engine for its plan and
returns the tensor's part in flight; ``decompress`` asks :meth:`PayloadExchanges.receive` and
:meth:`PayloadExchanges.result`. The part knows its exchange, so the compressor never branches on it:

* **alone** (:class:`_Alone`): the allgather, started at compress (Horovod fuses allgathers itself);
* **fused two stages** (:class:`_Fused`, :class:`_Group`): Horovod does not fuse alltoalls, so tensors wait for
  their group (:class:`~horovod_qsgd.common.fusion.Fuser`, learned from the step before), whose alltoall
  starts when its last member is compressed; every group's second stage starts at the round's first
  decompress, before anything is waited for;
* **node-aware** (:class:`_NodeAware`): a member of a flight of :mod:`horovod_qsgd.torch.node_aware`, alone
  or in a fused group, advanced at every compress and decompress.

The engine (:mod:`horovod_qsgd.common.engine`) conducts every exchange; this module only starts its
collectives, groups tensors and decides when to wait.
"""
import threading

import torch

from horovod_qsgd.common.collectives import RefusedEarlier, conclude
from horovod_qsgd.common.engine import TwoStagePlan
from horovod_qsgd.common.fusion import FusedTwoStage, Fuser
from horovod_qsgd.common.node_aware import NODE_AWARE_GROUP_NBYTES
from horovod_qsgd.kernels import move_into_own_chunk
from horovod_qsgd.torch.node_aware import NodeAwareExchanges, NodeAwareMember
from horovod_qsgd.torch.transport import HorovodTransport
from horovod_qsgd.torch_arrays import as_array, kernel_stream


class PayloadExchanges:
    """Every payload exchange of one compressor in flight on this rank: the tensors' parts, the groups waiting
    for members or for their second stage, the node-aware flights.

    ``feedback``: the compressor's :class:`~horovod_qsgd.torch.feedback.TensorFeedback` (owner residuals are
    taken when a group starts); ``namespace``: the prefix of this compressor's group names.
    """

    def __init__(self, engine, feedback, stats, fusion_threshold, namespace, error_feedback):
        self.engine, self.feedback, self.stats = engine, feedback, stats
        self.fusion_threshold, self.namespace, self.error_feedback = fusion_threshold, namespace, error_feedback
        self.node_exchanges = NodeAwareExchanges(stats)
        self._lock = threading.Lock()
        self.forget()

    def forget(self):
        """Drops what a failed step left in flight; fusion groups are learned anew."""
        self.fuser = Fuser(self.fusion_threshold, self.namespace)
        self.node_fuser = Fuser(min(self.fusion_threshold, NODE_AWARE_GROUP_NBYTES), self.namespace + "node_aware.")
        self._first_stages = []  # groups whose alltoall started and whose second stage did not
        self.node_exchanges.forget()

    # -- the compressor's calls ----------------------------------------------------------------
    def start(self, tensor, flat, site, step, residual, placeholder_nbytes, nodes):
        """Tensor ``tensor``'s part in flight (its exchange started, or waiting for its group). ``flat``: its
        flat fp32 gradient; ``residual``: the CarriedResidual this step reads and writes (None without error
        feedback); ``nodes``: the NodeLayout where the tensor goes node-aware, else None."""
        if nodes is not None:
            return self._start_node_aware(tensor, flat, site, step, residual, nodes)
        plan = self.engine.plan(site.name, flat.numel(), site.process_set.size(), site.process_set.rank(),
                                tensor.numel() * tensor.element_size(), placeholder_nbytes)
        residual = None if residual is None else as_array(residual)
        if plan.starts_with_alltoall:  # Horovod does not fuse alltoalls: the Fuser groups them
            return _Fused(plan, flat, residual, site.process_set)
        transport = HorovodTransport(site.process_set, flat.device)
        conduct = plan.conduct(transport, flat, step, residual)
        handle = transport.start(next(conduct))
        self.stats.add(collectives_started=1)
        return _Alone(plan, conduct, handle)

    def join(self, ctx, site):
        """Once ``ctx`` (the compress's :class:`~horovod_qsgd.torch.compression._InFlight`) exists: its part
        joins its group, and whatever is ready starts."""
        ctx.handle.join(self, ctx, site)

    def receive(self, ctx):
        """Waits for ctx's exchange (starting whatever the round still holds back first)."""
        return ctx.handle.receive(self, ctx)

    def result(self, ctx, received):
        """The flat fp32 sum of ctx's tensor over every rank, from what :meth:`receive` returned."""
        return ctx.handle.result(self, ctx, received)

    # -- the parts' calls ----------------------------------------------------------------------
    def _start_node_aware(self, tensor, flat, site, step, residual, nodes):
        """Step 1 of the node-aware exchange (horovod_qsgd.torch.node_aware), started.

        With error feedback, the whole residual joins the gradient here
        (``residual`` is zeroed): this rank's own shard of it is what the
        node's sum did not send last step, anything elsewhere was left by
        another layout. The node's sum of the shard is then compressed with a
        zero shard residual, which the result puts back at the shard.
        """
        plan = self.engine.plan_node_aware(site.name, flat.numel(), nodes, tensor.numel() * tensor.element_size())
        padded = torch.zeros(plan.padded_numel(), dtype=torch.float32, device=flat.device)
        shard_residual = owner_residual = None
        if residual is not None:  # padded = flat + the residual, and the step's new residual zero
            move_into_own_chunk(as_array(flat), as_array(residual), as_array(padded[:flat.numel()]))
            shard_residual = torch.zeros(plan.shard, dtype=torch.float32, device=flat.device)
            if plan.cross.owned is not None:  # this rank owns a chunk of its shard between nodes
                state = self.feedback[site.name]  # one of another layout was spilled by TensorFeedback.state()
                owner_residual = state.owner_residual_for_step(plan, plan.own_numel(), flat.device, step)
        else:
            padded[:flat.numel()] = flat
        return _NodeAware(NodeAwareMember(plan, step, padded, shard_residual, owner_residual))

    def _start_group(self, name, members):
        """Starts a fused group's exchange, which the engine conducts: first the alltoall of its slices."""
        parts = [member.handle for member in members]
        plans = [part.plan for part in parts]
        fused = FusedTwoStage(plans)
        device = parts[0].flat.device
        transport = HorovodTransport(parts[0].process_set, device)
        outs = [torch.zeros(plan.capacity(), dtype=torch.uint8, device=device) for plan in plans]
        owns = [torch.empty(plan.own_numel(), dtype=torch.float32, device=device) for plan in plans]
        with kernel_stream(device):
            member_splits = TwoStagePlan.encode_together(
                plans, [as_array(part.flat) for part in parts], [as_array(out) for out in outs],
                [as_array(own) for own in owns], [member.step for member in members],
                [part.residual for part in parts])
        numels = [part.plan.own_numel() for part in parts]

        def owner_residuals():
            return [as_array(self._owner_residual(member, numel, transport.device))
                    for member, numel in zip(members, numels)]
        conduct = fused.conduct(transport, name, [out[:sum(splits)] for out, splits in zip(outs, member_splits)],
                                member_splits, owns, [member.step for member in members], owner_residuals)
        del outs, owns  # the conduct holds what it still needs
        collective = next(conduct)
        manifests = collective.send.numel() - sum(sum(splits) for splits in member_splits)
        group = _Group(name, fused, members, transport, conduct, transport.start(collective))
        for index, part in enumerate(parts):
            part.flat = part.residual = None
            part.group, part.index = group, index
        self.stats.add(collectives_started=1, bytes_sent_first_stage=manifests, bytes_sent=manifests)
        with self._lock:
            self._first_stages.append(group)

    def _owner_residual(self, ctx, numel, device):
        """What this step reads and writes the owner-side residual of ctx's tensor (``numel`` elements on this
        rank) through (error feedback only), reset if the ranks changed."""
        if not self.error_feedback:
            return None
        ctx.owner_residual = ctx.state.owner_residual_for_step(ctx.handle.plan, numel, device, ctx.step)
        return ctx.owner_residual

    def _end_round(self):
        """At a round's first decompress, whatever its exchange: starts every group still waiting, node-aware
        and two-stage, before waiting for anything."""
        self._start_node_aware_groups()
        self._start_second_stages()

    def _start_node_aware_groups(self):
        """Ends the round of node-aware tensors: starts the groups still waiting for a member (or never
        learned), at the round's first decompress, as :meth:`_start_second_stages` does for the two stages,
        before waiting for anything. Every node-aware decompress calls it: once a round's groups all started
        as their last members were compressed, nothing else would end it."""
        with self._lock:
            remaining = self.node_fuser.end_round()
        for name, members in remaining:
            self.node_exchanges.start(members, name)

    def _start_second_stages(self):
        """Starts the second stage of every group whose first stage is under way.

        Called at the round's first ``decompress``: the groups still waiting
        for a member start their alltoalls first (:meth:`Fuser.end_round`).
        Horovod's optimizer decompresses in hook order, which differs between
        ranks, and collectives are matched by name: a rank that waited for
        one group's allgather before starting the others' could wait for a
        peer that waits for it. Starting all of them here, before waiting on
        any, cannot deadlock in any order of calls. After a refusal, this
        group's and every later group's second stage carry a refusal notice,
        sent without waiting for their first stage (ranks that grouped
        otherwise may never start it): every peer raises instead of waiting.
        """
        with self._lock:
            remaining = self.fuser.end_round()
        for name, members in remaining:
            self._start_group(name, members)
        with self._lock:
            groups = sorted(self._first_stages, key=lambda g: g.name)
            self._first_stages = []
        refused = None
        for group in groups:
            if refused is None:
                received, received_splits = self.node_exchanges.synchronize(group.handle)
                collective = group.conduct.send((received, received_splits.tolist()))
                refused = collective.refusal
            else:
                collective = group.conduct.throw(RefusedEarlier(refused))
            group.handle, group.second_handle = None, group.transport.start(collective)
            sent = collective.send.numel()
            self.stats.add(bytes_sent_second_stage=sent, bytes_sent=sent, collectives_started=1)
        if refused is not None:
            raise refused


class _Alone:
    """A tensor whose exchange the engine conducts alone: the allgather, started at compress (Horovod fuses
    allgathers itself)."""
    __slots__ = ("plan", "conduct", "handle")

    def __init__(self, plan, conduct, handle):
        self.plan, self.conduct, self.handle = plan, conduct, handle

    def join(self, exchanges, ctx, site):
        """Nothing to group with."""

    def receive(self, exchanges, ctx):
        return exchanges.node_exchanges.synchronize(self.handle)

    def result(self, exchanges, ctx, received):
        gathered, _ = conclude(self.conduct, received)  # one collective: nothing to refuse
        self.conduct = None
        total = ctx.zeroed_output(gathered.device)
        self.plan.decode(as_array(gathered), as_array(total))
        return total


class _Fused:
    """A two-stage tensor waiting for the rest of its group (:class:`_Group`), whose exchange the engine
    conducts: its flat gradient and residual, encoded with the whole group's when the group starts (one launch
    sequence for all members on a GPU); ``group``, ``index``: its group once started, and its place there."""
    __slots__ = ("plan", "flat", "residual", "process_set", "group", "index")

    def __init__(self, plan, flat, residual, process_set):
        self.plan, self.flat, self.residual, self.process_set = plan, flat, residual, process_set
        self.group = self.index = None

    def join(self, exchanges, ctx, site):
        with exchanges._lock:
            ready = exchanges.fuser.add((site.process_set.process_set_id, site.name), self.plan.payload_capacity(),
                                        ctx)
        for name, members in ready:
            exchanges._start_group(name, members)

    def receive(self, exchanges, ctx):
        if self.group is None or self.group.second_handle is None:
            exchanges._end_round()
        if self.group.results is None:
            return exchanges.node_exchanges.synchronize(self.group.second_handle)
        return None  # decoded with an earlier member of its group

    def result(self, exchanges, ctx, received):
        """The first member of a group to be decompressed decodes them all, in one pass.

        The group lets go of its members once decoded, and each member of the group: a reference cycle
        would keep every step's residual copies and buffers alive until Python's cycle collector ran
        (measured: Top-k's step 2.5x slower, every large allocation page-faulting afresh).
        """
        group = self.group
        if group.results is None:
            # a refusal of this rank was raised as its second stage started; the notices in what arrived make
            # the decode raise for every member decompressed after that
            gathered, _ = conclude(group.conduct, received)
            group.conduct = group.transport = None
            outs = [member.zeroed_output(gathered.device) for member in group.members]
            group.fused.decode(as_array(gathered), [as_array(out) for out in outs])
            group.results, group.members = outs, None
        result, group.results[self.index] = group.results[self.index], None
        self.group = None
        return result


class _Group:
    """Two-stage tensors that share one alltoall and one allgather (:mod:`horovod_qsgd.common.fusion`): the
    engine's conduct of their exchange, the handle of the collective in flight."""
    __slots__ = ("name", "fused", "members", "transport", "conduct", "handle", "second_handle", "results")

    def __init__(self, name, fused, members, transport, conduct, handle):
        self.name, self.fused, self.members, self.transport, self.conduct = name, fused, members, transport, conduct
        self.handle, self.second_handle, self.results = handle, None, None


class _NodeAware:
    """A tensor in the node-aware exchange (:mod:`horovod_qsgd.torch.node_aware`), alone or fused."""
    __slots__ = ("member",)

    def __init__(self, member):
        self.member = member

    def join(self, exchanges, ctx, site):
        ctx.owner_residual = self.member.owner_residual
        if exchanges.fusion_threshold == 0:  # alone, under its own collectives' names (TensorFlow's wire)
            exchanges.node_exchanges.start([self.member])
        else:
            with exchanges._lock:
                ready = exchanges.node_fuser.add((0, site.name), 4 * self.member.plan.padded_numel(), self.member)
            for name, members in ready:
                exchanges.node_exchanges.start(members, name)
        exchanges.node_exchanges.progress()

    def receive(self, exchanges, ctx):
        exchanges._end_round()  # at the round's first decompress; later ones find it ended
        return exchanges.node_exchanges.wait(self.member)

    def result(self, exchanges, ctx, result):
        """``result`` in the gradient's memory where it may be, and the shard residual back in this step's
        residual."""
        member = self.member
        if member.shard_residual is not None:
            begin, end = member.plan.own_span()
            ctx.residual.target[begin:end] = member.shard_residual[:end - begin]
        ctx.handle = None
        return result if ctx.out is None else ctx.out.copy_(result)
