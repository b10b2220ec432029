"""The node-aware exchange in a TensorFlow graph: the group's conduct
(:meth:`~horovod_qsgd.common.node_aware.NodeAwareGroup.conduct`) run by
:class:`~horovod_qsgd.tensorflow.conduct.GraphConduct`.

Each step is a global ``hvd.alltoall`` whose splits are zero outside the step's peers (the ranks of this
node, or this local index's rank on every node), so no process set has to be declared in ``hvd.init()``.
TensorFlow's executor starts each collective as soon as its input is ready, whatever order the gradients
come in, as it does for the two stages.

One :class:`NodeAwareOps` is one tensor's exchange, or the fused exchange of a grouped call's tensors
(``hvd.grouped_allreduce``, ``groups=``: one collective per step for all of them, as
:mod:`horovod_qsgd.tensorflow.fusion` does for the flat two stages), every payload and result bit as alone.
What goes wrong (a mismatch in the node, another node's refusal notice) travels with the conduct to its
last step, which every rank of every node reaches: the last host op raises it, and none hangs.
"""
import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
from horovod_qsgd.common.collectives import HostBuffers
from horovod_qsgd.common.node_aware import NodeAwareGroup, collective_names
from horovod_qsgd.tensorflow.conduct import GraphConduct


class NodeAwareOps:
    """Builds one node-aware exchange: :meth:`start` (every collective), then :meth:`results`.

    ``plans``: its members' :class:`~horovod_qsgd.common.node_aware.NodeAwarePlan` s; ``group_name``: None for
    one tensor alone (its own collectives' names), else the fused group's name, the same on every rank;
    ``finite_flag(finite)``: the compressor's verdict on a result found finite or not; ``error_feedback``:
    whether residuals go in (top-k).
    """

    def __init__(self, plans, group_name, stats, finite_flag, error_feedback):
        self.plans, self.finite_flag, self.error_feedback = list(plans), finite_flag, error_feedback
        self.group = NodeAwareGroup(self.plans, fused=group_name is not None)
        self.names = collective_names(self.plans[0].name if group_name is None else group_name)
        self.conduct = GraphConduct(self.group.collectives(self.names), hvd.global_process_set, stats,
                                    answerable=False)  # hvd.join() cannot answer a node's alltoalls by name
        self.new_owner_residuals = None

    def start(self, flats, steps, residuals=None, owner_residuals=None):
        """Every step's collective for the members' flat gradients ``flats`` at their step counters ``steps``;
        ``residuals``: their tensor-long residuals with error feedback; ``owner_residuals``: their owner
        residuals going in (two stages between nodes, error feedback), whose new values are then
        :attr:`new_owner_residuals`."""
        count, group = len(self.plans), self.group
        owner_residuals = list(owner_residuals or ())

        def begin(run, *arrays):
            shard_residuals = [np.zeros(plan.shard, np.float32) for plan in self.plans] if residuals else None
            run.kept = shard_residuals
            conduct = group.conduct(HostBuffers, self.names, self._rows(arrays[:count], arrays[2 * count:]),
                                    [int(step) for step in arrays[count:2 * count]], shard_residuals or [None] * count,
                                    run.carried_residuals if owner_residuals else None)
            return conduct, []

        self.conduct.start(begin, list(flats) + list(steps) + list(residuals or ()), name="horovod_qsgd_node_rows")
        self.new_owner_residuals = self.conduct.run_collectives(owner_residuals, carried_at=2) or None

    def _rows(self, flats, residuals):
        """Step 1's send: to each rank of the node, the group's tag, then each member's shard for it,
        zero-padded; with error feedback all of a residual joins its gradient (see common.node_aware)."""
        group, local_size = self.group, self.group.layout.local_size
        out = np.empty((local_size, group.in_node_width()), np.float32)
        out[:, :group.tag_width] = group.tag
        for m, (plan, offset) in enumerate(zip(self.plans, group.offsets)):
            padded = np.zeros(plan.padded_numel(), np.float32)
            padded[:plan.numel] = flats[m]
            if residuals:
                padded[:plan.numel] += residuals[m]
            begin = group.tag_width + offset
            out[:, begin:begin + plan.shard] = padded.reshape(local_size, plan.shard)
        return out.reshape(-1)

    def results(self, placeholder):
        """Each member's (flat fp32 sum, scaled as ``placeholder`` says, finite flag, this step's tensor-long
        residual or None); the op that makes them raises what went wrong on this rank or on a rank of its
        node."""
        plans = self.plans

        def decode(sums, totals):
            for plan, total, padded in zip(plans, totals, sums):
                total[:] = padded[:plan.numel]

        def tensor_residuals(run):
            residuals = []
            for plan, shard_residual in zip(plans, run.kept or ()):
                residual = np.zeros(plan.numel, np.float32)
                begin, end = plan.own_span()
                residual[begin:end] = shard_residual[:end - begin]
                residuals.append(residual)
            return residuals

        kept_dtypes = [tf.float32] * len(plans) if self.error_feedback else []
        results, residuals = self.conduct.finish(decode, placeholder, [plan.numel for plan in plans],
                                                 plans[0].layout.num_ranks, self.finite_flag,
                                                 name="horovod_qsgd_node_finish", kept=(tensor_residuals, kept_dtypes))
        for plan, residual in zip(plans, residuals):
            residual.set_shape([plan.numel])
        return [(total, finite, residuals[m] if residuals else None) for m, (total, finite) in enumerate(results)]
