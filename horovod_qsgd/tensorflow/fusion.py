"""A grouped call's two-stage tensors in one alltoall and one allgather (:mod:`horovod_qsgd.common.fusion`).

Horovod's TensorFlow paths call ``compress`` and ``decompress`` of one
gradient before the next gradient's ``compress`` (``_allreduce_cond``, one
``tf.cond`` per gradient), except in a grouped call: ``hvd.grouped_allreduce``
and the ``groups=`` / ``num_groups=`` of ``DistributedGradientTape`` and both
optimizers compress every tensor of the group before the first
``decompress``. Those tensors are a *round*; at the round's first
``decompress`` its two-stage tensors (one graph, one process set) become one
fused group, built here as graph ops:

1. ``assemble``: the members' encoded slices (each encoded alone, as in the
   unfused exchange) laid out per owner behind a manifest
   (:class:`~horovod_qsgd.common.fusion.FusedTwoStage`); one alltoall.
2. ``sum_and_encode``: the owner adds each member's received slices to its
   own chunk and re-encodes the sums (or writes a refusal notice); one allgather.
3. ``decode``: every owner's sums into every member's total, scaled as the
   first member's placeholder says (a grouped call has one op for all).

The group is the caller's: every rank builds it from the same call, so the
collectives' name comes from the members' names (a function traced again,
for a last short batch on one rank only, builds the same names) and a rank
whose tensors differ in shape meets the others in the same collectives, where
the manifests report it on every rank. ``fusion_threshold`` does not split a
grouped call: groups split by size could differ in number between such ranks,
and a TensorFlow step waits for every collective it started.
"""
import time
import zlib

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
from horovod_qsgd.common.exchange import refusal_notice
from horovod_qsgd.common.fusion import FusedTwoStage, join_host_pieces
from horovod_qsgd.common.naming import PAYLOAD_PREFIX, SECOND_STAGE_PREFIX
from horovod_qsgd.tensorflow import hvd_join
from horovod_qsgd.tensorflow.compressor_base import decode_scaled, op_name


def group_name(namespace, process_set_id, names):
    """The collectives' name of a group of tensors ``names``: the same on every rank, in every trace."""
    digest = zlib.crc32("\0".join(sorted(names)).encode("utf-8"))
    return f"{namespace}{process_set_id}.group{len(names)}.{digest:08x}"


class FusedRound:
    """The graph ops of one fused group; :meth:`result` gives each member's (total, finite flag)."""

    def __init__(self, name, members, placeholder, runtime, finite_flag, owner_variables):
        """``members``: the round's contexts (their ``plan``, ``slices``, ``splits``, ``own``, ``step``);
        ``placeholder``: a member's allreduced placeholder; ``owner_variables``: each member's owner-residual
        variable (None each without error feedback)."""
        self.name = name
        self._plans = [ctx.plan for ctx in members]
        self._fused = FusedTwoStage(self._plans)
        self._stats, self._refusals, self._finite_flag = runtime.stats, runtime.refusals, finite_flag
        process_set = members[0].process_set
        received = self._first_stage(members, process_set)
        gathered = self._second_stage(members, received, process_set, owner_variables)
        self._results = self._decode(gathered, placeholder)

    def _first_stage(self, members, process_set):
        """Step 1: the members' slices in one buffer, alltoalled."""
        fused, stats, count = self._fused, self._stats, len(members)
        name = op_name(PAYLOAD_PREFIX + self.name)

        def assemble(*arrays):
            hvd_join.sending(name, first=False)  # each member's encode raised already if a join refused it
            pieces, splits = fused.first_stage_pieces([[int(s) for s in splits] for splits in arrays[count:]])
            sent = join_host_pieces(pieces, arrays[:count])
            manifests = sent.size - sum(int(a.size) for a in arrays[:count])
            # Each member's encode counted an alltoall of its own: this one replaces them.
            stats.add(collectives_started=1 - count, bytes_sent_first_stage=manifests, bytes_sent=manifests)
            return sent, np.asarray(splits, np.int32)

        sent, splits = tf.numpy_function(assemble, [m.slices for m in members] + [m.splits for m in members],
                                         [tf.uint8, tf.int32], stateful=False, name="horovod_qsgd_fuse_slices")
        sent.set_shape([None])
        splits.set_shape([process_set.size()])
        received, _ = hvd.alltoall(sent, splits=splits, name=name, ignore_name_scope=True, process_set=process_set)
        hvd_join.note_payload_collective("alltoall", name, process_set)
        return received

    def _second_stage(self, members, received, process_set, owner_variables):
        """Step 2: the owner's sums of every member, re-encoded in one buffer, allgathered."""
        fused, stats, refusals, plans, count = self._fused, self._stats, self._refusals, self._plans, len(members)
        name, group = op_name(SECOND_STAGE_PREFIX + self.name), self.name
        with_owner = [i for i, var in enumerate(owner_variables) if var is not None]

        def sum_and_encode(received, *arrays):
            hvd_join.sending(name, first=False)
            start = time.perf_counter()
            owns, steps = arrays[:count], arrays[count:2 * count]
            owner_residuals = [None] * count
            for i, value in zip(with_owner, arrays[2 * count:]):
                owner_residuals[i] = value.copy()
            totals = [np.array(own, dtype=np.float32) for own in owns]
            outs = [np.zeros(plan.owned_capacity(), np.uint8) for plan in plans]
            used, refusal = fused.sum_and_encode(received, totals, outs, [int(s) for s in steps], owner_residuals)
            if refusal is not None:
                refusals[group] = refusal  # raised by the group's decode, after the allgather
                part = np.frombuffer(refusal_notice(), np.uint8)
            else:
                part = join_host_pieces(fused.second_stage_pieces(used), outs)
            stats.add(collectives_started=1, bytes_sent=part.size, bytes_sent_second_stage=part.size,
                      encode_seconds=time.perf_counter() - start)
            return [part] + [owner_residuals[i] for i in with_owner]  # unchanged where refused

        inputs = ([received] + [m.own for m in members] + [m.step for m in members]
                  + [owner_variables[i].read_value() for i in with_owner])
        outputs = tf.numpy_function(sum_and_encode, inputs, [tf.uint8] + [tf.float32] * len(with_owner),
                                    stateful=False, name="horovod_qsgd_fused_encode_sum")
        if not isinstance(outputs, (list, tuple)):  # one output: eagerly, a tensor rather than a list of one
            outputs = [outputs]
        part = outputs[0]
        part.set_shape([None])
        for i, new_owner in zip(with_owner, outputs[1:]):
            new_owner.set_shape(owner_variables[i].shape)
            members[i].pending.append((owner_variables[i], new_owner))
        gathered = hvd.allgather(part, name=name, ignore_name_scope=True, process_set=process_set)
        hvd_join.note_payload_collective("allgather", name, process_set)
        return gathered

    def _decode(self, gathered, placeholder):
        """Step 3: every member's total, checked, decoded and scaled; and its finite flag."""
        fused, stats, refusals, group, finite_flag = (self._fused, self._stats, self._refusals, self.name,
                                                      self._finite_flag)
        num_ranks, numels = fused.num_ranks, [plan.numel for plan in self._plans]

        def decode(gathered, placeholder):
            start = time.perf_counter()
            totals = [np.zeros(numel, np.float32) for numel in numels]
            finite = decode_scaled(lambda: fused.decode_gathered(gathered, totals), totals, refusals.pop(group, None),
                                   placeholder, num_ranks)
            stats.add(decode_seconds=time.perf_counter() - start)
            return totals + [finite_flag(flag) for flag in finite]

        outputs = tf.numpy_function(decode, [gathered, placeholder],
                                    [tf.float32] * len(numels) + [tf.bool] * len(numels),
                                    stateful=False, name="horovod_qsgd_fused_decode")
        for total, numel in zip(outputs, numels):
            total.set_shape([numel])
        for finite in outputs[len(numels):]:
            finite.set_shape([])
        return list(zip(outputs[:len(numels)], outputs[len(numels):]))

    def result(self, index):
        """(total, finite flag) of member ``index``."""
        return self._results[index]
