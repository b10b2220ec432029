"""The TensorFlow compressors' error-feedback store (:class:`~horovod_qsgd.common.feedback.FeedbackStore`), in
variables by gradient name.

Per gradient: an int64 step counter, with error feedback an fp32 residual, and where this rank owns a chunk
of the sum that chunk's owner residual with its int64 layout. All are ``tf.Variable`` objects created on first
use (outside any trace), so that a compressor works eagerly and in ``tf.function`` and ``tf.train.Checkpoint``
saves them; they stay attributes of the compressor itself (``_steps``, ``_residuals``, ``_owner_residuals``,
``_owner_layouts``): the names checkpoints hold them under. The rules that move them are the common store's;
what is TensorFlow's own: an elastic job's owner residuals change length with the world (its host op spills
them each step), and a ``tf.compat.v1`` graph's variables have no value before its Session runs.
"""
import re

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context
from tensorflow.python.framework import ops
from tensorflow.python.ops.resource_variable_ops import ResourceVariable

from horovod_qsgd.common.engine import NO_OWNER
from horovod_qsgd.common.feedback import FeedbackStore


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
        # what tf.Module made of them: dictionaries it tracks, changed only through these
        self.steps, self.residuals = compressor._steps, compressor._residuals
        self.owner_residuals, self.owner_layouts = compressor._owner_residuals, compressor._owner_layouts
        self._compressor = compressor

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
            del self.owner_residuals[name], self.owner_layouts[name]

    def _reset(self, name):
        if name in self.steps:
            self.steps[name].assign(0)
        self._load_residual(name, None)
        self._load_owner(name, None, None)

    def _numel(self, array):
        return array.shape.num_elements()

    def _saved(self, array):
        return array.numpy().copy()

    def _scale(self, array, factor):
        array.assign(array * factor)

    def _add_chunk(self, residual, begin, end, owner_residual):
        value = eager_value(residual)
        value[begin:end] += eager_value(owner_residual)[:end - begin]
        residual.assign(value)
