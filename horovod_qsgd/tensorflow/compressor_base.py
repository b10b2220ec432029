"""What every TensorFlow compressor shares: settings handshake, state variables, checkpoints, statistics.

The per-gradient state (step counters, residuals: ``tf.Variable`` objects saved by ``tf.train.Checkpoint``)
is kept by the compressor's :class:`horovod_qsgd.tensorflow.feedback.FeedbackVariables` store.
:mod:`horovod_qsgd.tensorflow.compression` builds the public compressors on it.
"""
import json
import os
import threading

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context
from tensorflow.python.framework import ops
from tensorflow.python.ops import control_flow_util

import horovod.tensorflow as hvd
from horovod_qsgd.common.call_site import check_compressible, takes_op_uncompressed
from horovod_qsgd.common.errors import (RankInJoinError, elastic_process_set_unsupported, elastic_state_missing,
                                        tensor_name_shared)
from horovod_qsgd.common.exchange import reduction_scale
from horovod_qsgd.common.handshake import verify_settings
from horovod_qsgd.common.naming import HANDSHAKE_NAME
from horovod_qsgd.common.feedback import Generations, KeepsFeedback
from horovod_qsgd.common.settings import CodecSettings
from horovod_qsgd.common.state import PACKING_SETTINGS, STATE_FORMAT
from horovod_qsgd.common.stats import CompressionStats
from horovod_qsgd.common.threads import available_cores, share_cores, warn_if_oversubscribed
from horovod_qsgd.kernels import finish_sum
from horovod_qsgd.tensorflow import hvd_join
from horovod_qsgd.tensorflow.call_site import find_call_site
from horovod_qsgd.tensorflow.feedback import FeedbackVariables, eager_value, new_variable
from horovod_qsgd.tensorflow.host_ops import flat_fp32, host_op
from horovod_qsgd.tensorflow.keras_guard import refuse_keras3_horovod_optimizer

PASS_THROUGH = None  # Horovod's own compressors use None as "nothing to undo" too
ELASTIC_STATE_CALL = "horovod_qsgd.tensorflow.elastic.TensorFlowKerasState(model, optimizer, compression=compression)"
PLACEHOLDER_DTYPES = (tf.float16, tf.float32, tf.float64)



def _meaning(settings_json):
    """What a checkpoint's settings record says about its state: the settings that pack collectives (fusion)
    left out, so that a checkpoint written with other ones, or before they existed, restores."""
    record = json.loads(settings_json)
    record["settings"] = {k: v for k, v in record["settings"].items() if k not in PACKING_SETTINGS}
    return record


def decode_scaled(decode, numels, refusal, placeholder, num_ranks):
    """A decode host op's work: ``decode()`` returns the totals (float32 arrays of ``numels``), which are then
    scaled as the allreduced ``placeholder`` says (sum or average). Returns (the totals, whether each is
    finite, found by the pass that scales it).

    ``refusal``: the mismatch this rank found in the step's first stage, raised instead. hvd.join()'s
    notices make the totals NaN: the step finishes (see hvd_join) and is discarded as non-finite.
    """
    try:
        if refusal is not None:
            raise refusal
        totals = decode()
    except RankInJoinError as exc:
        hvd_join.note_refused(exc.joined)
        totals = [np.full(numel, np.nan, np.float32) for numel in numels]
    scale = reduction_scale(float(placeholder.reshape(-1)[0]), num_ranks)
    return totals, [finish_sum(total, scale) for total in totals]


def in_legacy_graph():
    """True while ops are built for a ``tf.compat.v1`` graph that a Session runs (also inside a
    ``tf.function`` called there, as Horovod's legacy optimizer does): its variables have no value outside
    the Session, and a plain v1 graph runs a state change only if what the Session fetches depends on it."""
    with tf.init_scope():
        return not tf.executing_eagerly()


def adapter_method(method):
    """compress/decompress, never converted by autograph.

    Our errors keep their type when raised while Horovod's functions are
    traced because their classes use ``Exception.__init__`` (see
    :mod:`horovod_qsgd.common.errors`); autograph turns others into StagingError.
    """
    return tf.autograph.experimental.do_not_convert(method)


class _Step:
    """One compress call: where it came from, the state name, the counter, the fp32 input and, with error
    feedback, the step's generation (:meth:`FeedbackVariables.start_step`)."""
    __slots__ = ("site", "name", "numel", "variable", "value", "flat", "generation")

    def __init__(self, site, name, numel, variable, value, flat, generation=None):
        self.site, self.name, self.numel = site, name, numel
        self.variable, self.value, self.flat, self.generation = variable, value, flat, generation


class ExchangeContext:
    """What ``decompress`` needs; one per traced (or eager) ``compress`` call."""
    __slots__ = ("name", "shape", "dtype", "num_ranks", "step", "step_variable", "plan", "own",
                 "process_set", "pending", "live_plan", "numel", "uncompressed_nbytes", "placeholder_nbytes",
                 "residual_variable", "conduct", "graph", "waiting", "fused", "index", "node_input", "generation")

    def __init__(self, name, shape, dtype, num_ranks, step=None, step_variable=None, plan=None,
                 own=None, process_set=None, pending=(), live_plan=None, generation=None):
        self.name, self.shape, self.dtype, self.num_ranks = name, shape, dtype, num_ranks
        self.step, self.step_variable, self.generation = step, step_variable, generation
        # [(state variable, its value after this step)], written by _settle() where they wait for the step's verdict
        self.pending = list(pending)
        # the engine's plan (horovod_qsgd.common.engine); own: a two-stage tensor's own chunk until its fused
        # group takes it
        self.plan, self.own, self.process_set = plan, own, process_set
        # in an elastic job: plan is None and live_plan(ctx) makes the plan of the world the ops run in, for
        # numel elements
        self.live_plan, self.numel = live_plan, None
        self.uncompressed_nbytes = self.placeholder_nbytes = None
        # the exchange's graph ops alone (horovod_qsgd.tensorflow.conduct); the residual variable a node-aware
        # exchange updates, and its input until it starts (the flat gradient and, with error feedback, the
        # residual read)
        self.conduct = self.residual_variable = self.node_input = None
        # waiting: a two-stage or node-aware tensor of graph ``graph`` waits for its round's first decompress to
        # be fused; then fused: its group's ops (tensorflow/fusion.py FusedRound, tensorflow/node_aware.py
        # NodeAwareOps, also a node-aware tensor's alone), its place there ``index``
        self.graph, self.waiting = None, False
        self.fused = self.index = None


class CompressorBase(CodecSettings, KeepsFeedback, tf.Module):
    """Settings handshake, per-gradient state variables (:class:`FeedbackVariables`), checkpoints and statistics."""

    def __init__(self, codec, min_numel):
        super().__init__(name=type(self).__name__)
        if min_numel < 0:
            raise ValueError(f"horovod_qsgd: min_numel must be >= 0, got {min_numel}")
        self.codec = codec
        self.min_numel = int(min_numel)
        self._feedback = FeedbackVariables(self)
        self._settings = new_variable(self._settings_json(), "horovod_qsgd_settings", tf.string)
        self._runtime = _Runtime()
        # In a Horovod Elastic job (horovodrun sets HOROVOD_ELASTIC=1 in its workers) a function is traced once
        # and runs on worlds of other sizes: plans are made when the ops run (compression.py).
        self._in_elastic_job = os.environ.get("HOROVOD_ELASTIC") == "1"
        self.elastic_state_attached = False  # set by horovod_qsgd.tensorflow.elastic's states

    # -- identity ---------------------------------------------------------------------------
    # Horovod caches its allreduce function keyed by the compressor: identity is the right key
    # (two compressors have separate state). Hashing is also the one moment our code runs while
    # Horovod's Keras DistributedOptimizer wraps an optimizer, so a Keras 3 optimizer, which that
    # wrapper would silently leave un-allreduced, is refused here.
    def __hash__(self):
        refuse_keras3_horovod_optimizer()
        return id(self) >> 4

    def __eq__(self, other):
        return self is other

    # -- settings ---------------------------------------------------------------------------
    def settings(self):
        return dict(self.codec.config(), min_numel=self.min_numel)

    def _settings_json(self):
        return json.dumps({"compressor": type(self).__name__, "format": STATE_FORMAT,
                           "settings": self.settings()}, sort_keys=True, default=str)

    def _passes_through(self, tensor):
        return (not tensor.dtype.is_floating or tensor.shape.num_elements() is None
                or tensor.shape.num_elements() < self.min_numel)

    def _check_site(self, site):
        check_compressible(site.name, site.op is not None and site.op == hvd.Adasum, unnamed_hint=(
            " (Called eagerly; inside tf.function, DistributedGradientTape and DistributedOptimizer the name "
            "comes from the variable or the graph.)"))

    def _handshake(self, process_set):
        """Once per process set, eagerly (also while a function is traced): all ranks compare settings."""
        key = process_set.process_set_id
        if key in self._runtime.verified_process_sets or not process_set.included():
            return
        share_cores(hvd.local_size())
        # TensorFlow's order: the config, else TF_NUM_INTRAOP_THREADS, else (0) a thread per core
        intra_op = (tf.config.threading.get_intra_op_parallelism_threads()
                    or int(os.environ.get("TF_NUM_INTRAOP_THREADS") or 0) or available_cores())
        warn_if_oversubscribed("TensorFlow", intra_op, hvd.local_size(),
                               "TF_NUM_INTRAOP_THREADS={share} and TF_NUM_INTEROP_THREADS=1 in the environment "
                               "(or tf.config.threading.set_intra_op_parallelism_threads({share}))")
        with context.eager_mode():  # also while a tf.compat.v1 graph is built, where init_scope stays in it
            self._check_restored_settings()

            def allgather(array, name):
                return hvd.allgather(tf.constant(array), name=name, process_set=process_set).numpy()

            verify_settings(type(self).__name__, self.settings(), allgather, HANDSHAKE_NAME)
        self._runtime.verified_process_sets.add(key)

    def _check_restored_settings(self):
        restored = eager_value(self._settings)
        if restored is None:  # a tf.compat.v1 graph's variable: a Session restores it after this check
            return
        restored = restored.decode("utf-8")
        if _meaning(restored) != _meaning(self._settings_json()):
            raise ValueError(f"horovod_qsgd: the checkpoint was written by {restored}, this compressor is "
                             f"{self._settings_json()}; build it with the same arguments.")

    # -- per-gradient state -------------------------------------------------------------------
    def _state_name(self, site):
        """The name state and collectives are keyed by: the variable's name, made unique per variable (and apart
        from the names hvd.allreduce used); hvd.allreduce's ``name=``, refused where a variable's state has it
        (the two would share one residual)."""
        runtime = self._runtime
        if site.variable is None:
            with runtime.lock:
                if site.name in runtime.variable_of_name:
                    raise tensor_name_shared(site.name, "a variable's gradient", "hvd.allreduce")
                runtime.direct_names.add(site.name)
            return site.name
        with runtime.lock:
            ref = site.variable.ref() if hasattr(site.variable, "ref") else id(site.variable)
            name = runtime.name_of_variable.get(ref)
            if name is None:
                name, count = site.name, 1
                while name in runtime.variable_of_name or name in runtime.direct_names:
                    count += 1
                    name = f"{site.name}#{count}"
                runtime.name_of_variable[ref] = name
                runtime.variable_of_name[name] = ref
                runtime.keep_alive.append(site.variable)
            return name

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self):
        """Step counters and residuals by tensor name (numpy), plus the settings they belong to.

        ``tf.train.Checkpoint(compressor=c)`` saves and restores the same
        variables; this is for code that checkpoints with numpy/pickle.
        Residuals differ between ranks: save each rank's state. In a
        ``tf.compat.v1`` graph the state lives in graph variables: save it
        with ``tf.compat.v1.train.Saver`` there.
        """
        if self._feedback.in_graph():
            raise RuntimeError("horovod_qsgd: this compressor's state lives in a tf.compat.v1 graph; save and "
                               "restore it with tf.compat.v1.train.Saver (its variables are global variables).")
        return self._feedback.checkpoint(type(self).__name__, self.settings())

    def rescale_residuals(self, factor):
        """Multiplies every error-feedback residual by ``factor`` (a float or a scalar tensor; works in
        ``tf.function``): call it with new / old loss scale when a loss scaler changes its scale (see
        ``horovod_qsgd.torch``'s twin), so that residual and gradient stay in the same units."""
        self._feedback.rescale_feedback(tf.cast(factor, tf.float32))

    # -- Horovod Elastic (horovod_qsgd.tensorflow.elastic) -------------------------------------
    def start_new_world(self, steps):
        """After an elastic reset, on every rank: the settings are checked again and the step counters become
        ``steps`` (rank 0's, by tensor name), so that a rank that joined draws the same random streams."""
        self._runtime.verified_process_sets = set()
        self._feedback.set_step_counters(steps)

    def verify_settings(self):
        """Checks the settings among the ranks of the global process set now (eagerly, on every rank)."""
        self._handshake(hvd.global_process_set)

    def shadowing_flag(self):
        """The variable :class:`horovod_qsgd.tensorflow.Join` sets while this rank shadows the others' steps.

        Made on the first call, which must come before the compressor's first
        tensor: a function traced earlier would not read it.
        """
        if self._runtime.shadowing is None:
            if self._runtime.used:
                raise RuntimeError(
                    "horovod_qsgd: make the Join before the compressor's first step: the functions traced "
                    "so far cannot zero this rank's gradients once it runs out of data. Create "
                    "Join(train_step, compression) right after the compressor.")
            self._runtime.shadowing = new_variable(False, "horovod_qsgd_join_shadowing", tf.bool)
        return self._runtime.shadowing

    # -- statistics -------------------------------------------------------------------------
    def compression_stats(self, reset=False):
        """Counters since the last reset: tensors, bytes before and after, encode/decode seconds.

        Counted when the ops run (not when they are traced). Log it once per
        step with ``reset=True`` to get per-step numbers.
        """
        stats = self._runtime.stats.snapshot(reset)
        for counter in self._runtime.pass_through_counters:
            stats = counter.add_to(stats, reset)
        sent = stats["bytes_sent"]
        stats["compression_ratio"] = stats["bytes_uncompressed"] / sent if sent else float("nan")
        return stats

    def _pass_through(self, tensor, site):
        nbytes = tensor.shape.num_elements() * tensor.dtype.size if tensor.shape.is_fully_defined() else None
        if tf.executing_eagerly():
            self._runtime.stats.add(tensors_passed_through=1, bytes_uncompressed=nbytes, bytes_sent=nbytes)
        elif in_legacy_graph():
            # No variable to read without a Session: counted by a host op the result depends on.
            stats, itemsize = self._runtime.stats, tensor.dtype.size

            def count(numel):
                stats.add(tensors_passed_through=1, bytes_uncompressed=int(numel) * itemsize,
                          bytes_sent=int(numel) * itemsize)
                return np.int64(numel)

            counted = tf.numpy_function(count, [tf.size(tensor, out_type=tf.int64)], tf.int64, stateful=True,
                                        name="horovod_qsgd_count")
            with tf.control_dependencies([counted]):
                tensor = tf.identity(tensor)
        else:
            # One counter per call site: a variable of its own keeps the gradient's cond branch free of
            # ordering constraints against other gradients (a shared counter would serialize Horovod's
            # allreduces and defeat its tensor fusion). A named site keeps its counter when it is traced again.
            key = None if site.name is None else (site.name, nbytes)
            counter = self._runtime.pass_through_by_site.get(key)
            if counter is None:
                counter = _PassThroughCounter(nbytes)
                self._runtime.pass_through_counters.append(counter)
                if key is not None:
                    self._runtime.pass_through_by_site[key] = counter
            counter.variable.assign_add(1)
            if nbytes is None:  # no static shape: counted at its run-time size
                counter.bytes_variable.assign_add(tf.cast(tf.size(tensor), tf.int64) * tensor.dtype.size)
        return tensor, PASS_THROUGH

    def _begin(self, tensor):
        """(the step being compressed, or None to pass the tensor through; its call site; the tensor, shaped like
        its variable).

        A gradient without a static shape (``sparse_as_dense=True`` turns an
        embedding's IndexedSlices into one) takes its variable's shape, checked at run time.
        """
        site, name, tensor = self._prepare(tensor)
        if name is None:
            return None, site, tensor
        if not tf.executing_eagerly() and control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph()):
            raise ValueError(
                f"horovod_qsgd: tensor {name!r} is compressed inside an XLA-compiled function "
                "(jit_compile=True), which cannot run the codecs' host ops. Compile without XLA: "
                "tf.function(jit_compile=False), or model.compile(..., jit_compile=False) in Keras.")
        step_var = self._feedback.step_variable(name)
        numel = tensor.shape.num_elements()
        generation = self._feedback.start_step(name, numel) if self.error_feedback else None
        return _Step(site, name, numel, step_var, step_var.read_value(), flat_fp32(tensor), generation), site, tensor

    def _on_host(self, step, fn, out_dtype, op_name):
        """Runs ``fn`` through :func:`host_op` (:meth:`_settle` advances the step counter).

        Returns (out, pending): the residual variable and its updated value,
        for :meth:`_settle` to assign once the result is known.
        """
        residual_var = self._feedback.residual_variable(step.name, step.numel) if self.error_feedback else None
        out, new_residual = host_op(fn, step.flat, step.value,
                                    None if residual_var is None else self._feedback.read(residual_var),
                                    out_dtype, op_name)
        return out, [] if residual_var is None else [(residual_var, new_residual)]

    def _settle(self, ctx, total):
        """The decoded fp32 ``total`` of ctx's tensor, after its host fn (``total``, a finite flag) ran.

        Advances the step counter and writes the step's error-feedback state
        where it waits for the step's verdict (:mod:`horovod_qsgd.tensorflow.feedback`):
        a gradient with inf or NaN on any rank makes its result non-finite on
        every rank alike (see the PyTorch twin, ``_CompressorBase._settle``),
        a loss scaler then skips the whole step, and no tensor keeps anything
        of it, the finite ones included.
        """
        total, finite = total
        updates = self._feedback.write_step(ctx.pending, finite, ctx.generation) if ctx.pending else []
        with tf.control_dependencies([ctx.step]):  # after this step's read: a v1 graph orders nothing by itself
            updates.append(ctx.step_variable.assign_add(1))
        with tf.control_dependencies(updates):  # run by a tf.compat.v1 Session too, which fetches only the result
            return tf.identity(total)

    def _finite_flag(self, finite):
        """A host fn's verdict on its decoded result, ``finite`` as :func:`decode_scaled` or
        :func:`~horovod_qsgd.kernels.finish_sum` found it (counted in the statistics when it is not finite)."""
        if not finite:
            self._runtime.stats.add(tensors_nonfinite=1)
        return np.bool_(finite)

    def _prepare(self, tensor):
        if tf.distribute.has_strategy():
            strategy = type(tf.distribute.get_strategy()).__name__
            raise ValueError(
                f"horovod_qsgd: a compressor was called under tf.distribute's {strategy}. Horovod and a "
                "tf.distribute strategy each distribute the step: together they run the compressor once per "
                "replica, which desynchronises its state and collectives. Train with Horovod alone (one process "
                "per device, no strategy scope), or with the strategy alone and without this compressor.")
        if self._in_elastic_job and not self.elastic_state_attached:
            raise RuntimeError(elastic_state_missing(type(self).__name__, ELASTIC_STATE_CALL))
        site = find_call_site(tensor, None, hvd.global_process_set)
        if (self._in_elastic_job and site.process_set.process_set_id != hvd.global_process_set.process_set_id
                and not self._passes_through(tensor)):
            raise ValueError(elastic_process_set_unsupported(site.name))
        self._handshake(site.process_set)
        variable_shape = None if site.variable is None else site.variable.shape
        if (not tensor.shape.is_fully_defined() and variable_shape is not None and variable_shape.is_fully_defined()
                and tensor.shape.is_compatible_with(variable_shape)):
            tensor = tf.ensure_shape(tensor, variable_shape)
        self._runtime.used = True
        if self._runtime.shadowing is not None:
            # A rank out of data contributes zeros (tf.where: a multiplication by 0 would keep NaN).
            tensor = tf.where(self._runtime.shadowing, tf.zeros_like(tensor), tensor)
        if self._passes_through(tensor) or takes_op_uncompressed(site.name, hvd, site.op, self._runtime.warned_ops):
            return site, None, tensor
        self._check_site(site)
        return site, self._state_name(site), tensor


class _Runtime:
    """Per-process bookkeeping that is not checkpointed (hidden from tf.Module's tracking)."""

    def __init__(self):
        self.lock = threading.RLock()
        self.stats = CompressionStats()
        self.verified_process_sets = set()
        self.warned_ops = set()  # Min, Max, Product: taken uncompressed, warned of once
        self.name_of_variable = {}
        self.variable_of_name = {}
        self.direct_names = set()  # names hvd.allreduce compressed under (no variable)
        self.keep_alive = []
        self.pass_through_counters = []
        self.pass_through_by_site = {}  # (name, nbytes) -> its counter, kept across traces
        self.generations = Generations()  # the steps' verdicts (tensorflow/feedback.py)
        self.live_plans = {}  # (tensor name, ranks, rank) -> its plan, in an elastic job
        self.fusion_round = []  # two-stage contexts compressed since the last decompress, alltoall not built
        self.node_round = []  # likewise, node-aware contexts whose exchange has not started
        self.nodes = None  # the job's NodeLayout where the exchange is node-aware (global process set)
        self.shadowing = None  # horovod_qsgd.tensorflow.Join's flag: True while this rank has no data
        self.used = False  # compress has run (or been traced)


class _PassThroughCounter:
    """Calls of one traced pass-through, and their bytes: ``nbytes`` each, or (None) counted at run time."""

    def __init__(self, nbytes):
        self.nbytes = nbytes
        self.variable = new_variable(np.int64(0), "horovod_qsgd_pass_through", tf.int64)
        self.bytes_variable = None if nbytes is not None else new_variable(
            np.int64(0), "horovod_qsgd_pass_through_bytes", tf.int64)
        self.baseline = self.bytes_baseline = 0

    def add_to(self, stats, reset):
        count = int(self.variable.numpy())
        total_bytes = count * self.nbytes if self.bytes_variable is None else int(self.bytes_variable.numpy())
        calls, nbytes = count - self.baseline, total_bytes - self.bytes_baseline
        if reset:
            self.baseline, self.bytes_baseline = count, total_bytes
        stats = dict(stats)
        stats["tensors_passed_through"] += calls
        stats["bytes_uncompressed"] += nbytes
        stats["bytes_sent"] += nbytes
        return stats
