"""The node-aware exchange as TensorFlow ops (the steps: :mod:`horovod_qsgd.common.node_aware`).

Each step is a host op (numpy, the shared codecs) followed by a global
``hvd.alltoall`` whose splits are zero outside the step's peers (the ranks of
this node, or this local index's rank on every node), so no process set has to
be declared in ``hvd.init()``. TensorFlow's executor starts each collective as
soon as its input is ready, whatever order the gradients come in, as it does
for the two stages.

A host op never raises before this rank's last collective of the tensor has
started: a failed step would leave the peers waiting for it. What goes wrong
(a mismatch in the node, another node's refusal notice) is kept by tensor name
and raised by :meth:`NodeAwareOps.result`, after step 3 has told every rank of
the node, so every rank of every node raises and none hangs.
"""
import time

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
from horovod_qsgd.common.exchange import reduction_scale
from horovod_qsgd.common.fusion import join_host_pieces
from horovod_qsgd.common.naming import PAYLOAD_PREFIX
from horovod_qsgd.common.node_aware import NodeAwareGroup
from horovod_qsgd.tensorflow.compressor_base import op_name


class NodeAwareOps:
    """Builds one tensor's node-aware exchange: :meth:`start` in ``compress`` (steps 1 and 2), :meth:`result` in
    ``decompress`` (step 2's second stage from 3 nodes, steps 3 and 4; unfused: the wire of
    :class:`~horovod_qsgd.common.node_aware.NodeAwareGroup` of one tensor).

    ``errors``: tensor name -> what this rank raises for it once its collectives are sent (shared by the
    compressor's tensors); ``finite_flag(total)``: the compressor's verdict on a result; ``error_feedback``:
    whether a residual goes in (top-k).
    """

    def __init__(self, plan, stats, errors, finite_flag, error_feedback):
        self.plan, self.stats, self.errors, self.finite_flag = plan, stats, errors, finite_flag
        self.group = NodeAwareGroup([plan], fused=False)
        self.error_feedback = error_feedback
        self.names = [op_name(PAYLOAD_PREFIX + name) for name in plan.collective_names]
        self.shard_residual = self.own = self.new_owner_residual = None

    def _alltoall(self, sent, splits, stage):
        """(received, received splits) of the tensor's collective number ``stage`` (global, zero splits off its
        peers)."""
        return hvd.alltoall(sent, splits=splits, name=self.names[stage], ignore_name_scope=True)

    def _fail(self, error):
        """Keeps this rank's first error for the tensor (raised by :meth:`result`)."""
        self.errors.setdefault(self.plan.name, error)

    # -- compress -----------------------------------------------------------------------------
    def start(self, flat, step, residual=None):
        """Steps 1 and 2 started (``residual``: the tensor-long residual with error feedback); returns step 2's
        received bytes."""
        plan, stats, group = self.plan, self.stats, self.group
        numel, shard, local_size = plan.numel, plan.shard, plan.layout.local_size
        row_width = group.in_node_width()

        def pad(x, residual=None):  # each rank's row: the tag, then its shard of the tensor, zero-padded
            self.errors.pop(plan.name, None)  # a new step of this tensor
            padded = np.zeros(local_size * shard, np.float32)
            padded[:numel] = x
            if residual is not None:  # all of it joins the gradient: see common.node_aware
                padded[:numel] += residual
            rows = np.empty((local_size, row_width), np.float32)
            rows[:, :group.tag_width] = group.tag
            rows[:, group.tag_width:] = padded.reshape(local_size, shard)
            stats.add(collectives_started=1)
            return rows.reshape(-1), np.asarray(group.in_node_splits(), np.int32)

        inputs = [flat] if residual is None else [flat, residual]
        padded, splits = tf.numpy_function(pad, inputs, [tf.float32, tf.int32], stateful=False,
                                           name="horovod_qsgd_node_pad")
        padded.set_shape([local_size * row_width])
        splits.set_shape([plan.layout.num_ranks])
        received, received_splits = self._alltoall(padded, splits, 0)
        outputs = tf.numpy_function(self._encode_node_sum, [received, received_splits, step],
                                    [tf.uint8, tf.int32, tf.float32, tf.float32], stateful=False,
                                    name="horovod_qsgd_node_encode")
        sent, cross_splits, self.own, self.shard_residual = outputs
        sent.set_shape([None])
        cross_splits.set_shape([plan.layout.num_ranks])
        self.own.set_shape([None])
        self.shard_residual.set_shape([shard if self.error_feedback else 0])
        return self._alltoall(sent, cross_splits, 1)[0]

    def _encode_node_sum(self, received, received_splits, step):
        """Step 2: the node's sum of this rank's shard, encoded for this local index's rank on every node."""
        group, cross = self.group, self.plan.cross
        start = time.perf_counter()
        shard_residual = np.zeros(self.plan.shard if self.error_feedback else 0, np.float32)
        sums, error = group.sum_in_node(received, received_splits.tolist())
        two_stage = error is None and cross.kind == "two_stage"
        own = np.empty(cross.own_numel() if two_stage else 0, np.float32)
        outs = [np.zeros(0 if error is not None else cross.capacity(), np.uint8)]
        if error is not None:  # every peer gets a refusal notice, forwards it in step 3: its node raises
            self._fail(error)
            pieces, counts = group.refuse_between_nodes()
        else:
            pieces, counts = group.encode_between_nodes(sums, outs, [own if two_stage else None], [int(step)],
                                                        [shard_residual if self.error_feedback else None])
        self.stats.add(collectives_started=1, encode_seconds=time.perf_counter() - start)
        return join_host_pieces(pieces, outs), np.asarray(group.cross_splits(counts), np.int32), own, shard_residual

    # -- decompress ---------------------------------------------------------------------------
    def result(self, cross_received, placeholder, step, owner_residual=None):
        """(the tensor's flat fp32 sum, scaled as the placeholder says, a finite flag, this step's residual or
        None); raises what went wrong on this rank or on a rank of its node."""
        plan = self.plan
        if plan.cross.kind == "two_stage":
            cross_received = self._cross_sums(cross_received, step, owner_residual)
        sent, splits = tf.numpy_function(self._forward, [cross_received], [tf.uint8, tf.int32],
                                         stateful=False, name="horovod_qsgd_node_forward")
        sent.set_shape([None])
        splits.set_shape([plan.layout.num_ranks])
        gathered, gathered_splits = self._alltoall(sent, splits, 3)
        inputs = [gathered, gathered_splits, placeholder] + ([self.shard_residual] if self.error_feedback else [])
        out_dtypes = [tf.float32, tf.bool] + ([tf.float32] if self.error_feedback else [])
        outputs = tf.numpy_function(self._finish, inputs, out_dtypes, stateful=False, name="horovod_qsgd_node_finish")
        outputs[0].set_shape([plan.numel])
        if not self.error_feedback:
            return outputs[0], outputs[1], None
        outputs[2].set_shape([plan.numel])
        return outputs

    def _cross_sums(self, received, step, owner_residual):
        """Step 2's second stage: the owner's sum of the slices it received, re-encoded, to every node."""
        plan = self.plan

        def sum_and_encode(received, own, step, owner_residual=None):
            start = time.perf_counter()
            owner_residual = None if owner_residual is None else owner_residual.copy()
            out = np.zeros(0, np.uint8)
            if plan.name in self.errors:  # its peers raise on the notice, as on the first stage's
                pieces, counts = self.group.refuse_between_nodes(second_stage=True)
            else:
                out = np.zeros(plan.cross.owned_capacity(), np.uint8)
                pieces, counts, error = self.group.sum_between_nodes(received, [np.array(own, np.float32)], [out],
                                                                     [int(step)], [owner_residual])
                if error is not None:  # its refusal notice goes to every peer all the same: they raise on it
                    self._fail(error)
            self.stats.add(collectives_started=1, encode_seconds=time.perf_counter() - start)
            outputs = (join_host_pieces(pieces, [out]), np.asarray(self.group.cross_splits(counts), np.int32))
            return outputs if owner_residual is None else outputs + (owner_residual,)

        inputs = [received, self.own, step] + ([] if owner_residual is None else [owner_residual])
        out_dtypes = [tf.uint8, tf.int32] + ([] if owner_residual is None else [tf.float32])
        outputs = tf.numpy_function(sum_and_encode, inputs, out_dtypes, stateful=False,
                                    name="horovod_qsgd_node_encode_sum")
        outputs[0].set_shape([None])
        outputs[1].set_shape([plan.layout.num_ranks])
        if owner_residual is not None:
            outputs[2].set_shape(owner_residual.shape)
            self.new_owner_residual = outputs[2]
        return self._alltoall(outputs[0], outputs[1], 2)[0]

    def _forward(self, received):
        """Step 3's input: the failure flag and the bytes step 2 received (not where it failed), for every rank of
        the node."""
        pieces, splits = self.group.forward_in_node(self.plan.name in self.errors, received.size)
        self.stats.add(collectives_started=1)
        return join_host_pieces(pieces, [received]), np.asarray(splits, np.int32)

    def _finish(self, gathered, gathered_splits, placeholder, shard_residual=None):
        """Step 4: every shard decoded from what the node's ranks forwarded, scaled; raises what went wrong."""
        plan = self.plan
        padded = np.zeros(plan.layout.local_size * plan.shard, np.float32)
        if plan.name not in self.errors:  # this rank's own error goes first: its node-mates raise on its flag
            start = time.perf_counter()
            error = self.group.decode_node(gathered, gathered_splits.tolist(), [padded])
            self.stats.add(decode_seconds=time.perf_counter() - start)
            if error is not None:
                self._fail(error)
        error = self.errors.pop(plan.name, None)
        if error is not None:
            raise error
        total = padded[:plan.numel]
        scale = reduction_scale(float(placeholder.reshape(-1)[0]), plan.layout.num_ranks)
        if scale != 1.0:
            total *= np.float32(scale)
        finite = self.finite_flag(total)
        if shard_residual is None:
            return total, finite
        residual = np.zeros(plan.numel, np.float32)
        begin, end = plan.own_span()
        residual[begin:end] = shard_residual[:end - begin]
        return total, finite, residual
