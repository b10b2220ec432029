"""The node-aware exchange in a TensorFlow graph (the steps: :mod:`horovod_qsgd.common.node_aware`).

The group's conduct (:meth:`~horovod_qsgd.common.node_aware.NodeAwareGroup.conduct`, the one the PyTorch
adapter polls) runs in the host ops of a :class:`~horovod_qsgd.tensorflow.conduct.GraphConduct`. Each step's
collective is a global ``hvd.alltoall`` whose splits are zero outside the step's peers (the ranks of this
node, or this local index's rank on every node), so no process set has to be declared in ``hvd.init()``.
TensorFlow's executor starts each collective as soon as its input is ready, whatever order the gradients
come in, as it does for the two stages.

One :class:`NodeAwareOps` is one tensor's exchange, or the fused exchange of a grouped call's tensors
(``hvd.grouped_allreduce``, ``groups=``: one collective per step for all of them, as
:mod:`horovod_qsgd.tensorflow.fusion`'s ``FusedRound`` does for the flat two stages), every payload and
result bit as alone.

The conduct never raises mid-step: a failed step would leave the peers waiting for it. What goes wrong (a
mismatch in the node, another node's refusal notice) comes out at its end and is raised by the decode op,
after step 3 has told every rank of the node, so every rank of every node raises and none hangs.
"""
import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
from horovod_qsgd.common.collectives import HostBuffers
from horovod_qsgd.common.node_aware import NodeAwareGroup, collective_names
from horovod_qsgd.tensorflow.conduct import GraphConduct

_OWNERS_SUM = 2  # the collective before which two stages between nodes read the owner residuals: the owners' sums


class NodeAwareOps:
    """The graph ops of one node-aware exchange: every collective at once, then, at the first member's
    :meth:`result`, the decode.

    ``members``: the exchange's contexts (their ``plan``, a
    :class:`~horovod_qsgd.common.node_aware.NodeAwarePlan`; ``node_input``, the flat gradient and, with error
    feedback, the residual read; ``step``; ``residual_variable``, with error feedback; ``pending``, which the
    residuals' and owner residuals' new values join); ``group_name``: None for one tensor alone (its own
    collectives' names), else the fused group's name, the same on every rank; ``finite_flag(finite)``: the
    compressor's verdict on a result found finite or not; ``owner_variable(plan)``: a member's owner-residual
    variable, asked for where it keeps one (error feedback, two stages between nodes); ``read(variable)``: its
    value as the step sees it (:meth:`horovod_qsgd.tensorflow.feedback.FeedbackVariables.read`).
    """

    def __init__(self, members, group_name, stats, finite_flag, owner_variable, read):
        self.members, self.finite_flag = list(members), finite_flag
        self.plans = [m.plan for m in self.members]
        self.error_feedback = self.members[0].residual_variable is not None
        self.group = NodeAwareGroup(self.plans, fused=group_name is not None)
        self.names = collective_names(self.plans[0].name if group_name is None else group_name)
        self.conduct = GraphConduct(self.group.collectives(self.names), hvd.global_process_set, stats,
                                    answerable=False, first_dtype=tf.float32)
        self._results = None
        owner_variables = []
        if self.error_feedback and self.group.owns_chunks:
            owner_variables = [owner_variable(plan) for plan in self.plans]
        new_owners = self._start([m.node_input[0] for m in self.members], [m.step for m in self.members],
                                 [m.node_input[1] for m in self.members] if self.error_feedback else [],
                                 [read(variable) for variable in owner_variables])
        for member, variable, new_owner in zip(self.members, owner_variables, new_owners):
            member.pending.append((variable, new_owner))
        for member in self.members:
            member.node_input = None

    def _start(self, flats, steps, residuals, owner_residuals):
        """Every collective of the exchange of the members' flat gradients ``flats`` at their step counters
        ``steps``; with error feedback, ``residuals`` (tensor-long) join them in step 1, and ``owner_residuals``
        (two stages between nodes) are read where the owners' sums are encoded. Returns the owner residuals'
        new values."""
        group, plans, count = self.group, self.plans, len(self.plans)

        def begin(run, *arrays):
            flats, steps = arrays[:count], [int(step) for step in arrays[-count:]]
            rows = self._rows(flats, arrays[count:count + len(residuals)])
            run.kept = [np.zeros(plan.shard, np.float32) for plan in plans] if self.error_feedback else [None] * count
            return group.conduct(HostBuffers, self.names, rows, steps, run.kept,
                                 lambda: run.carried_residuals() or [None] * count), []

        self.conduct.start(begin, list(flats) + list(residuals) + list(steps), name="horovod_qsgd_node_rows")
        return self.conduct.run_collectives(owner_residuals, carried_at=_OWNERS_SUM)

    def _rows(self, flats, residuals):
        """Step 1's send: to each rank of the node, the group's tag, then each member's shard of it (plus its
        residual: all of it joins the gradient, see common.node_aware), zero-padded."""
        group = self.group
        out = np.empty((self.plans[0].layout.local_size, group.in_node_width()), np.float32)
        out[:, :group.tag_width] = group.tag
        for m, (plan, offset) in enumerate(zip(self.plans, group.offsets)):
            padded = np.zeros(plan.padded_numel(), np.float32)
            padded[:plan.numel] = flats[m]
            if residuals:
                padded[:plan.numel] += residuals[m]
            begin = group.tag_width + offset
            out[:, begin:begin + plan.shard] = padded.reshape(-1, plan.shard)
        return out.reshape(-1)

    def result(self, index, placeholder):
        """(flat fp32 sum, scaled as ``placeholder`` says, finite flag) of member ``index``. The first call builds
        every member's, and their residuals' new values join their ``pending``; the op that makes them raises
        what went wrong on this rank or on a rank of its node."""
        if self._results is None:
            self._results = self._finish(placeholder)
        return self._results[index]

    def _finish(self, placeholder):
        plans = self.plans

        def decode(sums):
            return [total[:plan.numel] for plan, total in zip(plans, sums)]

        def tensor_long(shard_residuals):  # this rank's shard of each member's residual, zeros elsewhere
            residuals = []
            for plan, shard_residual in zip(plans, shard_residuals):
                residual = np.zeros(plan.numel, np.float32)
                begin, end = plan.own_span()
                residual[begin:end] = shard_residual[:end - begin]
                residuals.append(residual)
            return residuals

        finished = self.conduct.finish(decode, placeholder, [plan.numel for plan in plans],
                                       plans[0].layout.num_ranks, self.finite_flag, name="horovod_qsgd_node_finish",
                                       kept=tensor_long if self.error_feedback else None)
        if not self.error_feedback:
            return finished
        results, residuals = finished
        for member, residual in zip(self.members, residuals):
            member.pending.append((member.residual_variable, residual))
        return results
