"""A grouped call's two-stage tensors in one alltoall and one allgather (:mod:`horovod_qsgd.common.fusion`).

Horovod's TensorFlow paths call ``compress`` and ``decompress`` of one
gradient before the next gradient's ``compress`` (``_allreduce_cond``, one
``tf.cond`` per gradient), except in a grouped call: ``hvd.grouped_allreduce``
and the ``groups=`` / ``num_groups=`` of ``DistributedGradientTape`` and both
optimizers compress every tensor of the group before the first
``decompress``. Those tensors are a *round*; at the round's first
``decompress`` its two-stage tensors (one graph, one process set) become one
fused group: :meth:`~horovod_qsgd.common.fusion.FusedTwoStage.conduct`,
run by the graph ops of :class:`~horovod_qsgd.tensorflow.conduct.GraphConduct`
from the members' slices (each encoded alone by its compress, as in the
unfused exchange), with one alltoall and one allgather; every member's total
is scaled as the first member's placeholder says (a grouped call has one op
for all).

The group is the caller's: every rank builds it from the same call, so the
collectives' name comes from the members' names (a function traced again,
for a last short batch on one rank only, builds the same names) and a rank
whose tensors differ in shape meets the others in the same collectives, where
the manifests report it on every rank. ``fusion_threshold`` does not split a
grouped call: groups split by size could differ in number between such ranks,
and a TensorFlow step waits for every collective it started.
"""
import zlib

import numpy as np

from horovod_qsgd.common.collectives import HostBuffers
from horovod_qsgd.common.fusion import FusedTwoStage
from horovod_qsgd.tensorflow.conduct import GraphConduct, zeroed


def group_name(namespace, process_set_id, names):
    """The collectives' name of a group of tensors ``names``: the same on every rank, in every trace."""
    digest = zlib.crc32("\0".join(sorted(names)).encode("utf-8"))
    return f"{namespace}{process_set_id}.group{len(names)}.{digest:08x}"


class FusedRound:
    """The graph ops of one fused group (one conduct for all its members, built by
    :class:`~horovod_qsgd.tensorflow.conduct.GraphConduct`): every collective at once, then, at the first
    member's :meth:`result`, the decode."""

    def __init__(self, name, members, runtime, finite_flag, owner_variables, read):
        """``members``: the round's contexts (their ``plan``, ``conduct`` waiting at its first collective,
        ``own``, ``step``); ``owner_variables``: each member's owner-residual variable (None each without
        error feedback), which ``read`` reads as the step sees it."""
        plans = [ctx.plan for ctx in members]
        fused, stats, count = FusedTwoStage(plans), runtime.stats, len(members)
        with_owner = [i for i, var in enumerate(owner_variables) if var is not None]

        slices_nbytes = [0]  # of the members' slices, in the run now building the first collective

        def count_bytes(index, collective):
            sent = int(np.asarray(collective.send).size)
            if index == 0:  # the manifests; each member counted an alltoall of its own, which this one replaces
                manifests = sent - slices_nbytes[0]
                stats.add(collectives_started=-count, bytes_sent_first_stage=manifests, bytes_sent=manifests)
            else:
                stats.add(bytes_sent=sent, bytes_sent_second_stage=sent)

        def begin(run, *arrays):
            tokens, slices, splits = arrays[:count], arrays[count:2 * count], arrays[2 * count:3 * count]
            owns, steps = arrays[3 * count:4 * count], arrays[4 * count:]
            for member, token in zip(members, tokens):
                member.conduct.discard(token)  # this conduct takes each member's over
            slices_nbytes[0] = sum(int(s.size) for s in slices)

            def owner_residuals():
                carried = [None] * count
                for i, residual in zip(with_owner, run.carried_residuals()):
                    carried[i] = residual
                return carried
            return fused.conduct(HostBuffers, name, list(slices), [[int(n) for n in s] for s in splits], list(owns),
                                 [int(step) for step in steps], owner_residuals), []

        conduct = GraphConduct(FusedTwoStage.collectives(name), members[0].process_set, stats, first_payload=False,
                               on_collective=count_bytes)
        conduct.start(begin, [m.conduct.token for m in members] + [m.conduct.send for m in members]
                      + [m.conduct.splits for m in members]
                      + [m.own for m in members] + [m.step for m in members], name="horovod_qsgd_fuse_slices")
        new_owners = conduct.run_collectives([read(owner_variables[i]) for i in with_owner])
        for i, new_owner in zip(with_owner, new_owners):
            members[i].pending.append((owner_variables[i], new_owner))
        self._conduct, self._fused, self._finite_flag = conduct, fused, finite_flag
        self._numels = [plan.numel for plan in plans]
        self._results = None

    def result(self, index, placeholder):
        """(total, scaled as ``placeholder`` says, finite flag) of member ``index``; the first call builds
        every member's."""
        if self._results is None:
            numels = self._numels
            self._results = self._conduct.finish(zeroed(self._fused.decode, numels), placeholder, numels,
                                                 self._fused.num_ranks, self._finite_flag,
                                                 name="horovod_qsgd_fused_decode")
        return self._results[index]
