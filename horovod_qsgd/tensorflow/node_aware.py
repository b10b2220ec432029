"""The node-aware exchange as TensorFlow ops (the steps: :mod:`horovod_qsgd.common.node_aware`).

Each step is a host op (numpy, the shared codecs) followed by a global
``hvd.alltoall`` whose splits are zero outside the step's peers (the ranks of
this node, or this local index's rank on every node), so no process set has to
be declared in ``hvd.init()``. TensorFlow's executor starts each collective as
soon as its input is ready, whatever order the gradients come in, as it does
for the two stages.

One :class:`NodeAwareOps` is one tensor's exchange, or the fused exchange of a
grouped call's tensors (``hvd.grouped_allreduce``, ``groups=``: one collective
per step for all of them, as :mod:`horovod_qsgd.tensorflow.fusion` does for
the flat two stages): the wire of
:class:`~horovod_qsgd.common.node_aware.NodeAwareGroup`, every payload and
result bit as alone.

A host op never raises before this rank's last collective of the exchange has
started: a failed step would leave the peers waiting for it. What goes wrong
(a mismatch in the node, another node's refusal notice) is kept under the
exchange's name and raised by the last host op, after step 3 has told every
rank of the node, so every rank of every node raises and none hangs.
"""
import time

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
from horovod_qsgd.common.collectives import join_host_pieces
from horovod_qsgd.common.exchange import reduction_scale
from horovod_qsgd.common.naming import PAYLOAD_PREFIX
from horovod_qsgd.common.node_aware import NodeAwareGroup, collective_names
from horovod_qsgd.kernels import finish_sum
from horovod_qsgd.tensorflow.feedback import op_name


class NodeAwareOps:
    """Builds one node-aware exchange: :meth:`start` (steps 1 and 2), then :meth:`results` (step 2's second
    stage from 3 nodes, steps 3 and 4).

    ``plans``: its members' :class:`~horovod_qsgd.common.node_aware.NodeAwarePlan` s; ``group_name``: None for
    one tensor alone (its own collectives' names), else the fused group's name, the same on every rank;
    ``errors``: exchange name -> what this rank raises for it once its collectives are sent (shared by the
    compressor's exchanges); ``finite_flag(finite)``: the compressor's verdict on a result found finite or not;
    ``error_feedback``: whether residuals go in (top-k).
    """

    def __init__(self, plans, group_name, stats, errors, finite_flag, error_feedback):
        self.plans, self.stats, self.errors, self.finite_flag = list(plans), stats, errors, finite_flag
        self.group = NodeAwareGroup(self.plans, fused=group_name is not None)
        self.error_feedback = error_feedback
        self.key = self.plans[0].name if group_name is None else group_name
        self.names = [op_name(PAYLOAD_PREFIX + name) for name in collective_names(self.key)]
        # built by start(): step 2's received bytes, each member's own chunk and shard residual
        self.cross_received = self.shard_residuals = self.owns = self.new_owner_residuals = None

    def _alltoall(self, sent, splits, stage):
        """(received, received splits) of the exchange's collective number ``stage`` (global, zero splits off its
        peers)."""
        return hvd.alltoall(sent, splits=splits, name=self.names[stage], ignore_name_scope=True)

    def _fail(self, error):
        """Keeps this rank's first error for the exchange (raised by step 4)."""
        self.errors.setdefault(self.key, error)

    # -- steps 1 and 2 --------------------------------------------------------------------------
    def start(self, flats, steps, residuals=None):
        """Steps 1 and 2 started for the members' flat gradients ``flats`` at their step counters ``steps``
        (``residuals``: their tensor-long residuals with error feedback)."""
        plans, stats, group, count = self.plans, self.stats, self.group, len(self.plans)
        local_size, width = plans[0].layout.local_size, self.group.in_node_width()

        def rows(*arrays):  # to each rank of the node: the digest, then each member's shard of it, zero-padded
            self.errors.pop(self.key, None)  # a new step of this exchange
            out = np.empty((local_size, width), np.float32)
            out[:, :group.tag_width] = group.tag
            for m, (plan, offset) in enumerate(zip(plans, group.offsets)):
                padded = np.zeros(plan.padded_numel(), np.float32)
                padded[:plan.numel] = arrays[m]
                if residuals is not None:  # all of it joins the gradient: see common.node_aware
                    padded[:plan.numel] += arrays[count + m]
                begin = group.tag_width + offset
                out[:, begin:begin + plan.shard] = padded.reshape(local_size, plan.shard)
            stats.add(collectives_started=1)
            return out.reshape(-1), np.asarray(group.in_node_splits(), np.int32)

        sent, splits = tf.numpy_function(rows, list(flats) + list(residuals or ()), [tf.float32, tf.int32],
                                         stateful=False, name="horovod_qsgd_node_rows")
        sent.set_shape([local_size * width])
        splits.set_shape([plans[0].layout.num_ranks])
        received, received_splits = self._alltoall(sent, splits, 0)
        out_dtypes = [tf.uint8, tf.int32] + [tf.float32] * count * (2 if self.error_feedback else 1)
        outputs = tf.numpy_function(self._encode_node_sums, [received, received_splits] + list(steps), out_dtypes,
                                    stateful=False, name="horovod_qsgd_node_encode")
        sent, cross_splits = outputs[:2]
        self.owns, self.shard_residuals = outputs[2:2 + count], outputs[2 + count:]
        sent.set_shape([None])
        cross_splits.set_shape([plans[0].layout.num_ranks])
        for own in self.owns:
            own.set_shape([None])
        for plan, residual in zip(plans, self.shard_residuals):
            residual.set_shape([plan.shard])
        self.cross_received = self._alltoall(sent, cross_splits, 1)[0]

    def _encode_node_sums(self, received, received_splits, *steps):
        """Step 2: the node's sum of this rank's shard of each member, encoded for this local index's rank on
        every node; and each member's own chunk (two stages between nodes) and shard residual (error feedback)."""
        group, plans = self.group, self.plans
        start = time.perf_counter()
        shard_residuals = [np.zeros(plan.shard, np.float32) for plan in plans] if self.error_feedback else []
        sums, error = group.sum_in_node(received, received_splits.tolist())
        two_stage = error is None and group.owns_chunks
        owns = [np.empty(plan.cross.own_numel() if two_stage else 0, np.float32) for plan in plans]
        outs = [np.zeros(0, np.uint8)]
        if error is not None:  # every peer gets a refusal notice, forwards it in step 3: its node raises
            self._fail(error)
            pieces, counts = group.refuse_between_nodes()
        else:
            outs = [np.zeros(plan.cross.capacity(), np.uint8) for plan in plans]
            pieces, counts = group.encode_between_nodes(
                sums, outs, owns if two_stage else [None] * len(plans), [int(step) for step in steps],
                shard_residuals or [None] * len(plans))
        self.stats.add(collectives_started=1, encode_seconds=time.perf_counter() - start)
        return [join_host_pieces(pieces, outs), np.asarray(group.cross_splits(counts), np.int32)] + owns + \
            shard_residuals

    # -- steps 3 and 4 --------------------------------------------------------------------------
    def results(self, placeholder, steps, owner_residuals=None):
        """Each member's (flat fp32 sum, scaled as ``placeholder`` says, finite flag, this step's tensor-long
        residual or None); the op that makes them raises what went wrong on this rank or on a rank of its node.
        ``owner_residuals``: the members' owner residuals going in (two stages between nodes, error feedback);
        their new values are then :attr:`new_owner_residuals`."""
        plans, count, cross_received = self.plans, len(self.plans), self.cross_received
        if self.group.owns_chunks:
            cross_received = self._cross_sums(cross_received, steps, owner_residuals)
        sent, splits = tf.numpy_function(self._forward, [cross_received], [tf.uint8, tf.int32],
                                         stateful=False, name="horovod_qsgd_node_forward")
        sent.set_shape([None])
        splits.set_shape([plans[0].layout.num_ranks])
        gathered, gathered_splits = self._alltoall(sent, splits, 3)
        out_dtypes = [tf.float32] * count + [tf.bool] * count + ([tf.float32] * count if self.error_feedback else [])
        outputs = tf.numpy_function(self._finish, [gathered, gathered_splits, placeholder] + self.shard_residuals,
                                    out_dtypes, stateful=False, name="horovod_qsgd_node_finish")
        totals, finites, residuals = outputs[:count], outputs[count:2 * count], outputs[2 * count:]
        for plan, total, finite in zip(plans, totals, finites):
            total.set_shape([plan.numel])
            finite.set_shape([])
        for plan, residual in zip(plans, residuals):
            residual.set_shape([plan.numel])
        return list(zip(totals, finites, residuals or [None] * count))

    def _cross_sums(self, received, steps, owner_residuals):
        """Step 2's second stage: the owner's sum of the slices it received of each member, re-encoded, to every
        node."""
        plans, group, count = self.plans, self.group, len(self.plans)

        def sum_and_encode(received, *arrays):
            start = time.perf_counter()
            owns, steps = arrays[:count], arrays[count:2 * count]
            kept = [np.array(residual, np.float32) for residual in arrays[2 * count:]] or [None] * count
            outs = [np.zeros(0, np.uint8)]
            if self.key in self.errors:  # its peers raise on the notice, as on the first stage's
                pieces, counts = group.refuse_between_nodes(second_stage=True)
            else:
                outs = [np.zeros(plan.cross.owned_capacity(), np.uint8) for plan in plans]
                pieces, counts, error = group.sum_between_nodes(received, [np.array(own, np.float32) for own in owns],
                                                                outs, [int(step) for step in steps], kept)
                if error is not None:  # its refusal notice goes to every peer all the same: they raise on it
                    self._fail(error)
            self.stats.add(collectives_started=1, encode_seconds=time.perf_counter() - start)
            new_owners = [] if owner_residuals is None else kept
            return [join_host_pieces(pieces, outs), np.asarray(group.cross_splits(counts), np.int32)] + new_owners

        inputs = [received] + list(self.owns) + list(steps) + list(owner_residuals or ())
        out_dtypes = [tf.uint8, tf.int32] + ([] if owner_residuals is None else [tf.float32] * count)
        outputs = tf.numpy_function(sum_and_encode, inputs, out_dtypes, stateful=False,
                                    name="horovod_qsgd_node_encode_sums")
        outputs[0].set_shape([None])
        outputs[1].set_shape([plans[0].layout.num_ranks])
        if owner_residuals is not None:
            for new_owner, residual in zip(outputs[2:], owner_residuals):
                new_owner.set_shape(residual.shape)
            self.new_owner_residuals = outputs[2:]
        return self._alltoall(outputs[0], outputs[1], 2)[0]

    def _forward(self, received):
        """Step 3's input: the failure flag and the bytes step 2 received (not where it failed), for every rank of
        the node."""
        pieces, splits = self.group.forward_in_node(self.key in self.errors, received.size)
        self.stats.add(collectives_started=1)
        return join_host_pieces(pieces, [received]), np.asarray(splits, np.int32)

    def _finish(self, gathered, gathered_splits, placeholder, *shard_residuals):
        """Step 4: every shard of every member decoded from what the node's ranks forwarded, scaled; raises what
        went wrong."""
        plans = self.plans
        padded = [np.zeros(plan.padded_numel(), np.float32) for plan in plans]
        if self.key not in self.errors:  # this rank's own error goes first: its node-mates raise on its flag
            start = time.perf_counter()
            error = self.group.decode_node(gathered, gathered_splits.tolist(), padded)
            self.stats.add(decode_seconds=time.perf_counter() - start)
            if error is not None:
                self._fail(error)
        error = self.errors.pop(self.key, None)
        if error is not None:
            raise error
        scale = reduction_scale(float(placeholder.reshape(-1)[0]), plans[0].layout.num_ranks)
        totals = [values[:plan.numel] for plan, values in zip(plans, padded)]
        finite = [finish_sum(total, scale) for total in totals]
        residuals = []
        for plan, shard_residual in zip(plans, shard_residuals):
            residual = np.zeros(plan.numel, np.float32)
            begin, end = plan.own_span()
            residual[begin:end] = shard_residual[:end - begin]
            residuals.append(residual)
        return totals + [self.finite_flag(flag) for flag in finite] + residuals
