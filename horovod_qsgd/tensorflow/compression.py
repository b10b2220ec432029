"""Compressors for Horovod's TensorFlow ``compression=`` argument that really send fewer bytes.

Horovod calls ``compress(grad)``, allreduces what comes back, and calls
``decompress(result, ctx)`` (in ``hvd.DistributedGradientTape``,
``hvd.DistributedOptimizer``, Horovod's Keras ``DistributedOptimizer`` and
``hvd.allreduce``). :class:`QSGD` and :class:`TopK` work exactly like their
PyTorch twins in :mod:`horovod_qsgd.torch`:

1. ``compress`` encodes the gradient with the shared codec (one
   ``tf.numpy_function`` call into the numba kernels), starts an
   ``hvd.allgather`` of the uint8 payload under a name derived from the
   variable's name, and returns a one-element placeholder holding 1 for
   Horovod to allreduce with its own op, prescale and postscale.
2. ``decompress`` takes every rank's payload from the allgather, checks the
   headers against its own, decodes them in rank order into one fp32 sum and
   multiplies it by ``placeholder / num_ranks`` (sum or average, whatever the
   caller asked Horovod for).

From 3 ranks, large tensors take the two-stage exchange instead
(:mod:`horovod_qsgd.common.two_stage`): ``compress`` alltoalls the slices
each owner needs, ``decompress`` sums and re-encodes this rank's owned
chunk, allgathers it and decodes the owners' sums (TensorFlow's executor
starts the collectives as their inputs are ready, so no order of calls can
deadlock them).

``exchange="node_aware"`` sums inside each node first and compresses only
what crosses between nodes (:mod:`horovod_qsgd.tensorflow.node_aware`); a
grouped call's node-aware tensors share each step's collective.

:class:`RandomK` returns the k values every rank selects with a shared seed
and lets Horovod's allreduce sum them.

On a GPU the codecs still run on the host: ``tf.numpy_function`` hands them
host copies, and TensorFlow offers no zero-copy (DLPack) view of a tensor
inside a ``tf.function`` graph. Each compressed gradient costs 8 bytes of
PCIe per coordinate (its fp32 copy down, the decoded fp32 sum up; 16 with
Top-k's error feedback, whose residual variable crosses both ways too), and
the payloads start and end on the host wherever TensorFlow places Horovod's
allgather. Uncompressed tensors (below ``min_numel``) stay on the GPU.

Everything that changes from step to step lives in ``tf.Variable`` objects
(per gradient: an int64 step counter for the counter-based RNG and, with error
feedback, an fp32 residual), so a compressor works eagerly and inside
``tf.function`` (traced once) and is saved and restored by
``tf.train.Checkpoint(compressor=...)``. Tensors below ``min_numel`` elements
and non-float tensors go through Horovod's allreduce unchanged; Horovod
allgathers ``tf.IndexedSlices`` itself without calling the compressor.
"""
import functools
import itertools
import time
import warnings

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context
from tensorflow.python.framework import ops

import horovod.tensorflow as hvd
from horovod_qsgd.codecs import RandomKCodec
from horovod_qsgd.common import docs
from horovod_qsgd.common.chunks import chunk_unit
from horovod_qsgd.common.collectives import HostBuffers
from horovod_qsgd.common.engine import PayloadEngine
from horovod_qsgd.common.fusion import DEFAULT_FUSION_THRESHOLD, check_fusion_threshold
from horovod_qsgd.common.naming import HANDSHAKE_NAME, tensor_key
from horovod_qsgd.common.node_aware import NODE_AWARE, job_nodes
from horovod_qsgd.common.payload_compressors import QSGDArguments, TopKArguments
from horovod_qsgd.common.two_stage import moved_owner_chunk
from horovod_qsgd.kernels import CarriedResidual, finish_sum
from horovod_qsgd.tensorflow.compressor_base import (PASS_THROUGH, PLACEHOLDER_DTYPES, CompressorBase,
                                                     ExchangeContext, adapter_method, in_legacy_graph)
from horovod_qsgd.tensorflow.conduct import AnyWorldConduct, GraphConduct, zeroed
from horovod_qsgd.tensorflow.fusion import FusedRound, group_name
from horovod_qsgd.tensorflow.host_ops import values_gatherer
from horovod_qsgd.tensorflow.node_aware import NodeAwareOps

_payload_compressors_built = itertools.count()


def _distinct_names(members):
    """The names of a fused group's members; raises where a tensor is in it twice."""
    names = [m.name for m in members]
    if len(set(names)) < len(names):
        raise RuntimeError(f"horovod_qsgd: a grouped call compressed {sorted(names)}: a tensor twice; give "
                           "every tensor of the group its own name.")
    return names


class PayloadCompressor(CompressorBase):
    """Sends each gradient as compressed payloads; base of :class:`QSGD` and :class:`TopK`.

    ``second_codec`` (None: allgather only) encodes the owners' sums of the
    two-stage exchange (:mod:`horovod_qsgd.common.two_stage`).
    """

    def __init__(self, codec, min_numel, exchange="allgather", second_codec=None,
                 fusion_threshold=DEFAULT_FUSION_THRESHOLD):
        # set first: the base class records settings(), which include them
        self.exchange = exchange
        self.second_codec = second_codec
        self.fusion_threshold = check_fusion_threshold(fusion_threshold)
        super().__init__(codec, min_numel)
        # Two compressors in one process must not fuse under the same collective names; scripts build their
        # compressors in the same order on every rank.
        self._fusion_namespace = f"tf_compressor{next(_payload_compressors_built)}."
        self._engine = PayloadEngine(codec, second_codec, exchange, self._runtime.stats)
        if exchange == NODE_AWARE and self._in_elastic_job:
            warnings.warn("horovod_qsgd: exchange='node_aware' is node-blind (as 'auto') in a Horovod Elastic job: "
                          "its ranks, and so its nodes, change with the world.")

    def _handshake(self, process_set):
        """Also finds the nodes, once, where the exchange is node-aware (global process set, not elastic)."""
        first = process_set.included() and process_set.process_set_id not in self._runtime.verified_process_sets
        super()._handshake(process_set)
        if (first and self.exchange == NODE_AWARE and not self._in_elastic_job
                and process_set.process_set_id == hvd.global_process_set.process_set_id):
            with context.eager_mode():
                mine = tf.constant([[hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()]],
                                   tf.int64)
                records = hvd.allgather(mine, name=HANDSHAKE_NAME + ".nodes").numpy().tolist()
            self._runtime.nodes = job_nodes(records, hvd.rank(), asked=True)

    def settings(self):
        return dict(super().settings(), exchange=self.exchange, fusion_threshold=self.fusion_threshold)

    @adapter_method
    def compress(self, tensor):
        step, site, tensor = self._begin(tensor)
        if step is None:
            return self._pass_through(tensor, site)
        stats = self._runtime.stats
        process_set = step.site.process_set
        placeholder_dtype = tensor.dtype if tensor.dtype in PLACEHOLDER_DTYPES else tf.float32
        if self._in_elastic_job:
            return self._exchange_in_any_world(step, tensor, placeholder_dtype)
        placeholder = tf.ones([1], dtype=placeholder_dtype)
        if self._runtime.nodes is not None and process_set.process_set_id == hvd.global_process_set.process_set_id:
            return placeholder, self._node_aware_context(step, tensor)
        rank = process_set.rank() if process_set.included() else 0
        num_ranks = process_set.size()
        plan = self._engine.plan(step.name, step.numel, num_ranks, rank, step.numel * tensor.dtype.size,
                                 placeholder_dtype.size)
        residual_var = None
        if self.error_feedback:
            residual_var = self._feedback.residual_variable(step.name, step.numel, [num_ranks, rank])
        ctx = ExchangeContext(step.name, tensor.shape, tensor.dtype, num_ranks, step=step.value,
                              step_variable=step.variable, plan=plan, process_set=process_set,
                              generation=step.generation)
        ctx.conduct = GraphConduct(plan.collectives(), process_set, stats)
        # Horovod does not fuse alltoalls: a round's two-stage tensors wait for its end to be fused (see
        # tensorflow/fusion.py), each encoded now, its conduct waiting for its first collective
        deferred = plan.starts_with_alltoall and self.fusion_threshold != 0
        inputs = [step.flat, step.value] + ([] if residual_var is None else [self._feedback.read(residual_var)])
        extra = ctx.conduct.start(functools.partial(_begin_encoded if deferred else _begin, plan), inputs,
                                  [tf.float32] * (int(deferred) + int(residual_var is not None)))
        if residual_var is not None:
            new_residual = extra.pop()
            new_residual.set_shape(step.flat.shape)
            ctx.pending.append((residual_var, new_residual))
        if not deferred:
            self._run_collectives(ctx)
            return placeholder, ctx
        ctx.own = extra[0]
        ctx.own.set_shape([plan.own_numel()])
        self._wait_for_round(ctx, self._runtime.fusion_round)
        return placeholder, ctx

    def _wait_for_round(self, ctx, round_):
        """ctx's exchange starts at its round's first decompress, fused with the round's others (``round_``:
        the runtime's list it waits in)."""
        ctx.graph, ctx.waiting = ops.get_default_graph(), True
        with self._runtime.lock:
            round_.append(ctx)

    def _run_collectives(self, ctx):
        """The collectives of ctx's exchange alone, under its tensor's names; its owner residual's new value
        joins ``ctx.pending``."""
        owner_var = self._feedback.owner_residual_variable(ctx.plan) if self._keeps_owner_residual(ctx.plan) else None
        new_owner = ctx.conduct.run_collectives([] if owner_var is None else [self._feedback.read(owner_var)])
        if owner_var is not None:
            ctx.pending.append((owner_var, new_owner[0]))

    def _keeps_owner_residual(self, plan):
        return self.error_feedback and plan.owned is not None

    def _end_round(self, ctx):
        """At a round's first decompress: the tensors of ctx's graph that wait for it start, fused where there
        are several (a grouped call), else alone under their own names. Its two-stage tensors of ctx's process
        set (tensorflow/fusion.py) and its node-aware tensors that take the same exchange between nodes (the
        nodes' allgather, or from 3 nodes their two stages for shards large enough) are a group each."""
        with self._runtime.lock:
            runtime = self._runtime
            flat = [m for m in runtime.fusion_round if m.graph is ctx.graph
                    and m.process_set.process_set_id == ctx.process_set.process_set_id]
            node_aware = [m for m in runtime.node_round if m.graph is ctx.graph]
            runtime.fusion_round = [m for m in runtime.fusion_round if m not in flat]
            runtime.node_round = [m for m in runtime.node_round if m not in node_aware]
        for member in flat + node_aware:
            member.waiting = False
        if len(flat) == 1:
            self._run_collectives(flat[0])
        elif flat:
            names = _distinct_names(flat)
            owner_variables = [self._feedback.owner_residual_variable(m.plan) if self.error_feedback else None
                               for m in flat]
            fused = FusedRound(group_name(self._fusion_namespace, ctx.process_set.process_set_id, names), flat,
                               self._runtime, self._finite_flag, owner_variables, self._feedback.read)
            for index, member in enumerate(flat):
                member.fused, member.index, member.own = fused, index, None
        _distinct_names(node_aware)
        for scope in sorted({m.plan.fusion_scope for m in node_aware}):
            group = [m for m in node_aware if m.plan.fusion_scope == scope]
            name = None
            if len(group) > 1:
                name = group_name(self._fusion_namespace, ctx.process_set.process_set_id, [m.name for m in group])
            self._start_node_aware(group, name)

    def _node_aware_context(self, step, tensor):
        """A node-aware tensor's context (:mod:`horovod_qsgd.tensorflow.node_aware`): its exchange starts here
        with ``fusion_threshold=0``, else at the round's first decompress, fused with the round's other ones."""
        plan = self._engine.plan_node_aware(step.name, step.numel, self._runtime.nodes,
                                            step.numel * tensor.dtype.size)
        ctx = ExchangeContext(step.name, tensor.shape, tensor.dtype, plan.layout.num_ranks, step=step.value,
                              step_variable=step.variable, plan=plan, process_set=step.site.process_set,
                              generation=step.generation)
        ctx.node_input = [step.flat]
        if self.error_feedback:
            ctx.residual_variable = self._feedback.residual_variable(step.name, step.numel, plan.layout.as_list())
            ctx.node_input.append(self._feedback.read(ctx.residual_variable))
        if self.fusion_threshold == 0:
            self._start_node_aware([ctx], None)
        else:
            self._wait_for_round(ctx, self._runtime.node_round)
        return ctx

    def _start_node_aware(self, members, name):
        """The collectives of the members' exchange, alone (``name`` None: one tensor) or fused as ``name``."""
        node_ops = NodeAwareOps(members, name, self._runtime.stats, self._finite_flag,
                                self._feedback.owner_residual_variable, self._feedback.read)
        for index, member in enumerate(members):
            member.fused, member.index = node_ops, index

    # -- Horovod Elastic: one traced function, worlds of any size ------------------------------
    # Horovod Elastic resets the ranks under a tf.function traced once, so the graph cannot hold a plan: every
    # tensor's ops are an AnyWorldConduct's, whose host ops make the plan of the world they run in (hvd.size(),
    # hvd.rank()).
    def _live_plan(self, ctx):
        """The plan of ctx's tensor in the world the ops run in (made once per world)."""
        key = (ctx.name, hvd.size(), hvd.rank())
        plan = self._runtime.live_plans.get(key)
        if plan is None:
            plan = self._runtime.live_plans[key] = self._engine.plan(ctx.name, ctx.numel, key[1], key[2],
                                                                     ctx.uncompressed_nbytes, ctx.placeholder_nbytes)
        return plan

    def _exchange_in_any_world(self, step, tensor, placeholder_dtype):
        """(the placeholder for Horovod's allreduce, the context): the exchange's collectives, whichever the
        plan of the world the ops run in takes.

        The placeholder's 1 comes out of the host op: a constant would let
        grappler's constant folding run its allreduce once, when the graph is
        optimized, and a worker that joins later would wait there for ranks
        that optimized theirs long ago.
        """
        ctx = ExchangeContext(step.name, tensor.shape, tensor.dtype, None, step=step.value,
                              step_variable=step.variable, process_set=hvd.global_process_set,
                              generation=step.generation,
                              live_plan=self._live_plan)
        ctx.numel, ctx.uncompressed_nbytes, ctx.placeholder_nbytes = (step.numel, step.numel * tensor.dtype.size,
                                                                      placeholder_dtype.size)
        ctx.conduct = AnyWorldConduct(step.name, self._runtime.stats)
        residual_var = owner_var = layout_var = None
        inputs, extra_dtypes = [step.flat, step.value], [tf.float32]
        if self.error_feedback:
            residual_var = self._feedback.residual_variable(step.name, step.numel)
            owner_var, layout_var = self._feedback.elastic_owner_variables(step.name)
            inputs += [self._feedback.read(v) for v in (residual_var, owner_var, layout_var)]
            extra_dtypes += [tf.float32, tf.float32, tf.int64]
        unit = chunk_unit(self.codec)

        def begin(run, x, step_value, residual=None, owner_residual=None, owner_layout=None):
            plan, one = self._live_plan(ctx), np.ones(1, np.float32)
            if residual is None:
                return plan.conduct(HostBuffers, x, int(step_value)), [one]
            residual, owner_residual = _spill_moved_owner(ctx.name, plan, unit, residual, owner_residual,
                                                          owner_layout)
            new_residual = np.empty_like(residual)
            conduct = plan.conduct(HostBuffers, x, int(step_value), CarriedResidual(new_residual, residual),
                                   run.first_carried)
            return conduct, [one, new_residual, owner_residual, np.asarray(plan.owner_layout(), np.int64)]

        one, *extra = ctx.conduct.start(begin, inputs, extra_dtypes, name="horovod_qsgd_encode_any_world")
        one.set_shape([1])
        if residual_var is not None:
            new_residual, owner_residual, new_layout = extra
            new_residual.set_shape(step.flat.shape)
            owner_residual.set_shape([None])
            new_layout.set_shape([2])
            ctx.pending += [(residual_var, new_residual), (layout_var, new_layout)]
        for new_owner in ctx.conduct.run_collectives(extra[1:2]):
            ctx.pending.append((owner_var, new_owner))
        return tf.cast(one, placeholder_dtype), ctx

    @adapter_method
    def decompress(self, tensor, ctx):
        if ctx is PASS_THROUGH:
            return tensor
        if ctx.waiting:
            self._end_round(ctx)
        if ctx.fused is not None:  # one of a group's, or a node-aware tensor's alone
            result, ctx.fused = ctx.fused.result(ctx.index, tensor), None
        elif ctx.live_plan is None:
            [result] = ctx.conduct.finish(_decode_alone(ctx.plan), tensor, [ctx.plan.numel], ctx.plan.num_ranks,
                                          self._finite_flag)
        else:  # an elastic job's: the plan of the world the ops run in
            [result] = ctx.conduct.finish(lambda gathered: _decode_alone(ctx.live_plan(ctx))(gathered), tensor,
                                          [ctx.numel], hvd.size, self._finite_flag)
        result = tf.reshape(self._settle(ctx, result), ctx.shape)
        return result if ctx.dtype == tf.float32 else tf.cast(result, ctx.dtype)


def _spill_moved_owner(name, plan, unit, residual, owner_residual, owner_layout):
    """(residual, owner residual) that ``plan``'s step reads: an owner residual kept for another layout goes into
    a copy of the residual at its old chunk (the rule of :class:`~horovod_qsgd.common.feedback.FeedbackStore`),
    and one that is not the plan's own chunk becomes zeros of it."""
    if owner_residual.size and list(owner_layout) != plan.owner_layout():
        chunk = moved_owner_chunk(name, residual.size, unit, list(owner_layout), owner_residual.size,
                                  [plan.num_ranks, plan.rank])
        if chunk is not None:
            residual = residual.copy()
            residual[chunk[0]:chunk[1]] += owner_residual[:chunk[1] - chunk[0]]
        owner_residual = owner_residual[:0]
    if owner_residual.size != plan.own_numel():
        owner_residual = np.zeros(plan.own_numel(), np.float32)
    return residual, owner_residual


def _decode_alone(plan):
    """A tensor's decode of what its exchange gathered, alone (a :meth:`GraphConduct.finish` ``decode``)."""
    return zeroed(lambda gathered, totals: plan.decode(gathered, totals[0]), [plan.numel])


def _begin(plan, run, x, step_value, residual=None):
    """A tensor's conduct from its gradient (a :class:`~horovod_qsgd.tensorflow.conduct.GraphConduct` begin);
    the new residual comes out beside it."""
    new_residual = None if residual is None else np.empty_like(residual)
    conduct = plan.conduct(HostBuffers, x, int(step_value),
                           None if residual is None else CarriedResidual(new_residual, residual),
                           run.first_carried)
    return conduct, [] if residual is None else [new_residual]


def _begin_encoded(plan, run, x, step_value, residual=None):
    """As :func:`_begin`, for a two-stage tensor that may yet be fused: encoded here, its own chunk out beside
    the conduct (a fused group's conduct takes it over), which waits for its first collective."""
    step_value = int(step_value)
    new_residual = None if residual is None else np.empty_like(residual)
    out = np.zeros(plan.capacity(), dtype=np.uint8)
    own = np.empty(plan.own_numel(), dtype=np.float32)
    splits = plan.encode(x, out, own, step_value, None if residual is None else CarriedResidual(new_residual, residual))
    conduct = plan.conduct_encoded(HostBuffers, out[:sum(splits)], splits, own, step_value,
                                   run.first_carried)
    return conduct, [own] + ([] if residual is None else [new_residual])


class QSGD(QSGDArguments, PayloadCompressor):
    __doc__ = docs.qsgd("variable", fusion="grouped", node_aware="asked", state="""

    State: one int64 step counter per compressed gradient (a ``tf.Variable``;
    checkpoint the compressor with ``tf.train.Checkpoint`` to resume
    bit-exactly). The payload bytes are those of ``horovod_qsgd.torch.QSGD``
    for the same input, step and name. Encoding and decoding run on the host
    (``tf.numpy_function``).""")


class TopK(TopKArguments, PayloadCompressor):
    __doc__ = docs.topk(fusion="grouped", node_aware="asked", state=r"""per compressed
    gradient an int64 step counter and the fp32 residuals are ``tf.Variable``\ s,
    saved by ``tf.train.Checkpoint``; every rank saves its own.""")


class RandomK(CompressorBase):
    __doc__ = docs.randomk("variable", r"""

    State: per compressed gradient an int64 step counter (and a residual with
    error feedback), in ``tf.Variable``\ s.""")

    def __init__(self, ratio=0.01, error_feedback=False, rescale=False, value_dtype="float32",
                 min_numel=10000, seed=0):
        super().__init__(RandomKCodec(ratio=ratio, seed=seed, value_dtype=value_dtype,
                                      error_feedback=error_feedback, rescale=rescale), min_numel)

    def _handshake(self, process_set):
        """Also sets the step counters to rank 0's at the first step (eagerly): they pick the coordinates, which
        must be the same on every rank, and a checkpoint loaded on rank 0 alone, or a resume at another number of
        ranks, leaves them different. A ``tf.compat.v1`` graph's counters are the Session's to restore alike."""
        first = process_set.process_set_id not in self._runtime.verified_process_sets
        super()._handshake(process_set)
        if (first and process_set.process_set_id == hvd.global_process_set.process_set_id
                and not in_legacy_graph()):
            with context.eager_mode():
                self._feedback.set_step_counters(hvd.broadcast_object(
                    self._feedback.step_counters(), root_rank=0, name=HANDSHAKE_NAME + ".steps"))

    @adapter_method
    def compress(self, tensor):
        step, site, tensor = self._begin(tensor)
        if step is None:
            return self._pass_through(tensor, site)
        stats = self._runtime.stats
        uncompressed = step.numel * tensor.dtype.size

        half = self.codec.value_dtype == "float16"

        def on_gathered(nbytes, seconds):
            stats.add(tensors_compressed=1, encode_seconds=seconds, bytes_uncompressed=uncompressed,
                      bytes_sent=nbytes // 2 if half else nbytes)

        # The codec returns fp32 values, fp16-rounded with value_dtype="float16"; those are sent as fp16
        # (an exact cast), as horovod_qsgd.torch.RandomK sends them: the same bytes in both frameworks.
        gather = values_gatherer(self.codec, tensor_key(step.name), on_gathered)
        values, pending = self._on_host(step, gather, tf.float32, "horovod_qsgd_gather")
        if half:
            values = tf.cast(values, tf.float16)
        return values, ExchangeContext(step.name, tensor.shape, tensor.dtype, step.site.process_set.size(),
                                       step=step.value, step_variable=step.variable, pending=pending,
                                       generation=step.generation)

    @adapter_method
    def decompress(self, tensor, ctx):
        if ctx is PASS_THROUGH:
            return tensor
        codec, stats = self.codec, self._runtime.stats
        numel, key = ctx.shape.num_elements(), tensor_key(ctx.name)

        def scatter(values, step_value):
            start = time.perf_counter()
            total = np.zeros(numel, dtype=np.float32)
            values = np.ascontiguousarray(values, dtype=np.float32)
            codec.scatter_accumulate(values, total, step=int(step_value), key=key)
            stats.add(decode_seconds=time.perf_counter() - start)
            # the total is finite where the k values are: the rest is zeros
            return total, self._finite_flag(finish_sum(values, 1.0))

        total = self._settle(ctx, tf.numpy_function(scatter, [tensor, ctx.step], [tf.float32, tf.bool],
                                                   stateful=False, name="horovod_qsgd_scatter"))
        result = tf.reshape(total, ctx.shape)
        return result if ctx.dtype == tf.float32 else tf.cast(result, ctx.dtype)


