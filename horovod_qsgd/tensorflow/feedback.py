"""The TensorFlow compressors' error-feedback store (:class:`~horovod_qsgd.common.feedback.FeedbackStore`), in
variables by gradient name.

Per gradient: an int64 step counter, with error feedback an fp32 residual, and where this rank owns a chunk
of the sum that chunk's owner residual with its int64 layout. All are ``tf.Variable`` objects created on first
use (outside any trace), so that a compressor works eagerly and in ``tf.function`` and ``tf.train.Checkpoint``
saves them; they stay attributes of the compressor itself (``_steps``, ``_residuals``, ``_owner_residuals``,
``_owner_layouts``): the names checkpoints hold them under. The rules that move them are the common store's;
what is TensorFlow's own: an elastic job's owner residuals change length with the world (its host op spills
them each step), and a ``tf.compat.v1`` graph's variables have no value before its Session runs.

A step's new values wait until the step is decided (:class:`~horovod_qsgd.common.feedback.StepVerdict`'s rule):
each variable that a step writes has a *spare* that takes the new value, stamped with the step's generation
and the tensor's own verdict. Every read takes the spare where its step counted, else the variable; the next
write first moves a counted spare into the variable. Each of these is the choice of a tensor and an assignment,
which aliases it: no pass over a residual. The verdicts themselves are the host's
(:class:`~horovod_qsgd.common.feedback.Generations`), reached from stateless host ops, so that no variable is
shared between tensors (TensorFlow orders the ops that share a variable).
"""
import re

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context
from tensorflow.python.framework import ops
from tensorflow.python.ops.resource_variable_ops import ResourceVariable

from horovod_qsgd.common.engine import NO_OWNER
from horovod_qsgd.common.feedback import FeedbackStore, Generations, settled


def op_name(name):
    """A TensorFlow op name made from a stable tensor name (graph mode scopes it further)."""
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", name)


def new_variable(initial_value, name, dtype):
    """A variable created outside any graph being traced.

    A compressor meets a new gradient when a function is (re)traced, possibly
    not on its first trace, where ``tf.Variable`` refuses to create
    variables; each state variable is created once per gradient name, so
    lifting it out with ``init_scope`` and constructing it directly is safe.
    """
    with tf.init_scope():
        return ResourceVariable(initial_value, name=op_name(name), dtype=dtype, trainable=False)


def is_eager(variable):
    """False for a variable of a ``tf.compat.v1`` graph, whose value only a Session reads."""
    return isinstance(variable.handle, ops.EagerTensor)


def eager_value(variable):
    """The variable's value (numpy), or None for a variable of a ``tf.compat.v1`` graph."""
    if not is_eager(variable):
        return None
    with context.eager_mode():
        return variable.numpy()


class FeedbackVariables(FeedbackStore):
    """Step counters and error-feedback residuals by gradient name, in variables that are attributes of
    ``compressor`` (a ``tf.Module`` with ``codec`` and a reentrant ``_runtime.lock``)."""

    def __init__(self, compressor):
        # Tracked by tf.train.Checkpoint under these names: state name -> variable.
        compressor._steps, compressor._residuals = {}, {}
        compressor._owner_residuals = {}  # where this rank owns a chunk of the sum, with error feedback
        compressor._owner_layouts = {}    # int64 layout each owner residual belongs to
        # the step's new value of each variable above and the stamp of the step that wrote it, by "<kind>/<name>"
        compressor._spares, compressor._spare_generations = {}, {}
        # what tf.Module made of them: dictionaries it tracks, changed only through these
        self.steps, self.residuals = compressor._steps, compressor._residuals
        self.owner_residuals, self.owner_layouts = compressor._owner_residuals, compressor._owner_layouts
        self.spares, self.spare_generations = compressor._spares, compressor._spare_generations
        self._compressor = compressor
        self._spare_of_variable = {}  # variable ref -> (spare, its generation variable)

    # -- the step's verdict -------------------------------------------------------------------
    def start_step(self, name, numel):
        """At tensor ``name``'s compress (error feedback): the step's generation (an int64 scalar), a new one where
        this tensor took part in the current one."""
        _, written = self._spare(self.checked_residual(name, numel))
        generations = self._generations
        return tf.numpy_function(lambda stamp: np.int64(generations.start(int(stamp))), [written.read_value()],
                                 tf.int64, stateful=False, name="horovod_qsgd_generation")

    def read(self, variable):
        """What a step reads ``variable`` as: its spare where the step that wrote it counted, else itself (a
        choice of one tensor)."""
        spare, written = self._spare(variable)
        return tf.cond(self._counted(written.read_value()), spare.read_value, variable.read_value)

    def write_step(self, pending, finite, generation):
        """The ops of a step's writes ``pending`` ([(variable, new value)]) in ``generation``, whose result was
        ``finite`` or not: each variable first takes its spare where that counted, then the spare takes the new
        value, stamped with the generation and this tensor's own verdict."""
        generations = self._generations
        stamp = tf.numpy_function(lambda g, f: np.int64(generations.record(int(g), bool(f))), [generation, finite],
                                  tf.int64, stateful=False, name="horovod_qsgd_verdict")
        updates = []
        for variable, new_value in pending:
            spare, written = self._spare(variable)
            taken = variable.assign(self.read(variable))
            with tf.control_dependencies([taken]):
                updates += [spare.assign(new_value), written.assign(stamp)]
        return updates

    def _counted(self, stamp):
        generations = self._generations
        counted = tf.numpy_function(lambda s: np.bool_(generations.counted(int(s))), [stamp], tf.bool,
                                    stateful=False, name="horovod_qsgd_counted")
        counted.set_shape([])
        return counted

    @property
    def _generations(self):
        return self._compressor._runtime.generations

    def _spare(self, variable):
        """(``variable``'s spare, the generation that wrote it), created at its first use (outside any trace)."""
        with self._lock:
            found = self._spare_of_variable.get(variable.ref())
            if found is not None:
                return found
            key = self._key(variable)
            with tf.init_scope():
                shape = variable.shape if variable.shape.is_fully_defined() else tf.TensorShape([None])
                initial = np.zeros([d if d is not None else 0 for d in shape.as_list()],
                                   variable.dtype.as_numpy_dtype)
                spare = ResourceVariable(initial, name=op_name(f"{key}/spare"), dtype=variable.dtype,
                                         trainable=False, shape=shape)
                written = new_variable(np.int64(-1), f"{key}/spare_generation", tf.int64)
            self.spares[key], self.spare_generations[key] = spare, written
            found = self._spare_of_variable[variable.ref()] = (spare, written)
            return found

    def _key(self, variable):
        for kind, store in (("residual", self.residuals), ("owner_residual", self.owner_residuals),
                            ("owner_layout", self.owner_layouts)):
            for name, candidate in store.items():
                if candidate is variable:
                    return f"{kind}/{name}"
        raise KeyError(f"horovod_qsgd: {variable.name} is not a variable of this compressor's state")

    @property
    def _lock(self):
        return self._compressor._runtime.lock

    def step_variable(self, name):
        with self._lock:
            var = self.steps.get(name)
            if var is None:
                var = self.steps[name] = new_variable(np.int64(0), f"{name}/step", tf.int64)
        return var

    def residual_variable(self, name, numel, owner_layout=None):
        """Tensor ``name``'s residual variable (``numel`` elements). Given this rank's ``owner_layout``, an
        owner residual kept for another layout (a checkpoint from another job size or node layout) is first
        added into it at its old chunk: call it before reading it."""
        var = self.checked_residual(name, numel)
        if owner_layout is not None:
            self.spill_moved_owner_residual(name, owner_layout, self._compressor.codec)
        return var

    def spill_moved_owner_residual(self, name, layout, codec):
        """The common rule, done eagerly when the tensor is first compressed eagerly or traced; not for an
        elastic job's variable-length owner residuals (its host op spills them each step) or a tf.compat.v1
        graph's (whose process made them for its layout)."""
        with self._lock, tf.init_scope():
            var = self.owner_residuals.get(name)
            if var is not None and var.shape.is_fully_defined():
                super().spill_moved_owner_residual(name, layout, codec)

    def owner_residual_variable(self, plan):
        """The owner-side residual variable of a two-stage plan's tensor; recreated (with the plan's warning)
        where the one kept does not fit."""
        with self._lock, tf.init_scope():
            return self.owner_residual_for(plan.name, plan)

    def elastic_owner_variables(self, name):
        """(owner residual, its layout) of tensor ``name`` in an elastic job: a variable of any length, empty
        where this rank owns no chunk; the layout ``NO_OWNER`` until it does."""
        with self._lock, tf.init_scope():
            var = self.owner_residuals.get(name)
            if var is None or var.shape.is_fully_defined():
                initial = np.zeros(0, np.float32) if var is None else eager_value(var)
                layout = NO_OWNER if var is None else eager_value(self.owner_layouts[name])
                self.owner_residuals[name] = ResourceVariable(initial, name=op_name(f"{name}/owner_residual"),
                                                              dtype=tf.float32, trainable=False,
                                                              shape=tf.TensorShape([None]))
                self.owner_layouts[name] = new_variable(np.asarray(layout, np.int64), f"{name}/owner_layout",
                                                        tf.int64)
            return self.owner_residuals[name], self.owner_layouts[name]

    def in_graph(self):
        """Whether the variables live in a ``tf.compat.v1`` graph (only its Session reads them)."""
        return not all(is_eager(var) for var in self.steps.values())

    # -- the variables the common rules move ------------------------------------------------
    def _names(self):
        with self._lock:
            return list(dict.fromkeys([*self.steps, *self.residuals, *self.owner_residuals]))

    def _step(self, name):
        var = self.steps.get(name)
        return 0 if var is None else int(var.numpy())

    def _set_step(self, name, step):
        self.step_variable(name).assign(step)

    def _residual(self, name):
        return self.residuals.get(name)

    def _new_residual(self, name, numel, device):
        with self._lock:
            var = self.residuals.get(name)
            if var is None or var.shape.num_elements() != numel:
                var = self.residuals[name] = new_variable(np.zeros(numel, np.float32), f"{name}/residual",
                                                          tf.float32)
        return var

    def _load_residual(self, name, value):
        if value is not None:
            value = np.asarray(value, np.float32)
            self.checked_residual(name, value.size).assign(value)
        elif name in self.residuals:
            self.residuals[name].assign(tf.zeros_like(self.residuals[name]))

    def _owner_residual(self, name):
        return self.owner_residuals.get(name)

    def _owner_layout(self, name):
        value = eager_value(self.owner_layouts[name])
        return None if value is None else [int(v) for v in value]

    def _new_owner(self, name, numel, layout, device):
        with self._lock:
            var = self.owner_residuals[name] = new_variable(np.zeros(numel, np.float32), f"{name}/owner_residual",
                                                            tf.float32)
            self.owner_layouts[name] = new_variable(np.array(layout, np.int64), f"{name}/owner_layout", tf.int64)
        return var

    def _load_owner(self, name, value, layout):
        """Into the variables a traced function reads where they can hold it (always in an elastic job, whose
        owner residuals change size with the world), else into new ones (a function traced for another
        layout is traced again: its plan would not match). None: zeros where a variable exists (an elastic
        job's: empty, owning no chunk)."""
        with self._lock:
            var, layout_var = self.owner_residuals.get(name), self.owner_layouts.get(name)
            elastic = var is not None and not var.shape.is_fully_defined()
            if value is None:
                if elastic:
                    var.assign(np.zeros(0, np.float32))
                    layout_var.assign(np.array(NO_OWNER, np.int64))
                elif var is not None:
                    var.assign(tf.zeros_like(var))
                return
            value, layout = np.asarray(value, np.float32), np.asarray(layout, np.int64)
            if var is not None and (elastic or var.shape.num_elements() == value.size):
                var.assign(value)
                layout_var.assign(layout)
                return
            self.owner_residuals[name] = new_variable(value, f"{name}/owner_residual", tf.float32)
            self.owner_layouts[name] = new_variable(layout, f"{name}/owner_layout", tf.int64)

    def _drop_owner(self, name):
        with self._lock:
            for kind, store in (("owner_residual", self.owner_residuals), ("owner_layout", self.owner_layouts)):
                self._spare_of_variable.pop(store.pop(name).ref(), None)
                self.spares.pop(f"{kind}/{name}", None)
                self.spare_generations.pop(f"{kind}/{name}", None)

    def _reset(self, name):
        if name in self.steps:
            self.steps[name].assign(0)
        self._load_residual(name, None)
        self._load_owner(name, None, None)

    def _settle(self, name):
        """Eagerly: each of tensor ``name``'s variables takes its spare where that counted (no spare is then
        pending), before anything but a step reads or changes them."""
        for store in (self.residuals, self.owner_residuals, self.owner_layouts):
            variable = store.get(name)
            found = None if variable is None else self._spare_of_variable.get(variable.ref())
            if found is not None and is_eager(variable):  # a tf.compat.v1 graph's: its Session holds the values
                with context.eager_mode():
                    variable.assign(self.read(variable))
                    found[1].assign(settled(int(found[1].numpy())))

    def _numel(self, array):
        return array.shape.num_elements()

    def _saved(self, array):
        return array.numpy().copy()

    def _scale(self, array, factor):
        array.assign(array * factor)
        found = self._spare_of_variable.get(array.ref())
        if found is not None:  # it may hold the residual
            found[0].assign(found[0] * factor)

    def _add_chunk(self, residual, begin, end, owner_residual):
        value = eager_value(residual)
        value[begin:end] += eager_value(owner_residual)[:end - begin]
        residual.assign(value)
