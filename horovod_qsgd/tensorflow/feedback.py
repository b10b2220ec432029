"""The TensorFlow compressors' error-feedback state: each gradient's step counter and residuals, as variables.

Per gradient the state is an int64 step counter (the counter-based RNG's step) and, with error feedback, an
fp32 residual; where this rank owns a chunk of the sum (two stages, or between 3 or more nodes) also that
chunk's owner residual and the int64 layout it belongs to. All are ``tf.Variable`` objects created on first
use (outside any trace), so that a compressor works eagerly and in ``tf.function`` and ``tf.train.Checkpoint``
saves them. :class:`FeedbackVariables` is the part of every compressor that keeps them, with the rules that
move them: a residual that does not match its gradient is an error, an owner residual kept for another
layout is added into the residual at its old chunk (as the PyTorch adapter's store does), an elastic job's
owner residuals change length with the world, the checkpoint format, a loss scaler's rescale. The variables
stay attributes of the compressor itself (``_steps``, ``_residuals``, ``_owner_residuals``,
``_owner_layouts``): the names checkpoints hold them under.
"""
import re

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context
from tensorflow.python.framework import ops
from tensorflow.python.ops.resource_variable_ops import ResourceVariable

from horovod_qsgd.common.chunks import chunk_unit
from horovod_qsgd.common.engine import NO_OWNER
from horovod_qsgd.common.errors import residual_length_mismatch
from horovod_qsgd.common.state import check_loadable, state_header
from horovod_qsgd.common.two_stage import moved_owner_chunk


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


class FeedbackVariables:
    """Step counters and error-feedback residuals by gradient name, for a ``tf.Module`` compressor that has
    ``_runtime.lock`` and ``settings()``."""

    def _init_feedback(self):
        # Tracked by tf.train.Checkpoint: state name -> variable.
        self._steps = {}
        self._residuals = {}
        self._owner_residuals = {}  # two-stage exchange with error feedback: this rank's owned chunk
        self._owner_layouts = {}    # int64 [ranks, rank] each owner residual belongs to

    def _step_variable(self, name):
        with self._runtime.lock:
            var = self._steps.get(name)
            if var is None:
                var = self._steps[name] = new_variable(np.int64(0), f"{name}/step", tf.int64)
        return var

    def _residual_variable(self, name, numel, owner_layout=None):
        """Tensor ``name``'s residual variable (``numel`` elements). Given this rank's ``owner_layout``, an
        owner residual kept for another layout (a checkpoint from another job size or node layout) is first
        added into it at its old chunk (:meth:`_spill_moved_owner_residual`): call it before reading it."""
        with self._runtime.lock:
            var = self._residuals.get(name)
            if var is None:
                var = self._residuals[name] = new_variable(np.zeros(numel, np.float32),
                                                           f"{name}/residual", tf.float32)
        if var.shape.num_elements() != numel:
            raise residual_length_mismatch(f"tensor {name!r}", numel, var.shape.num_elements())
        if owner_layout is not None and name in self._owner_residuals:
            self._spill_moved_owner_residual(name, var, owner_layout)
        return var

    def _spill_moved_owner_residual(self, name, residual_var, layout):
        """Where tensor ``name``'s owner residual was kept for a layout other than ``layout``, adds it into the
        residual at its old chunk (aligned as the codec's chunks are; :func:`moved_owner_chunk` warns where it
        fits none) and drops it: this rank sends that mass in its next steps, as the PyTorch adapter's store
        does. Done eagerly, when the tensor is first compressed eagerly or traced; not for an elastic job's
        variable-length owner residuals (its host op spills them each step) or a tf.compat.v1 graph's (whose
        process made them for its layout)."""
        with self._runtime.lock, tf.init_scope():
            var = self._owner_residuals.get(name)
            if var is None or not var.shape.is_fully_defined():
                return
            value = eager_value(self._owner_layouts[name])
            saved = None if value is None else [int(v) for v in value]
            if saved is None or saved == list(layout):
                return
            owner_residual = eager_value(var)
            chunk = moved_owner_chunk(name, residual_var.shape.num_elements(), chunk_unit(self.codec), saved,
                                      owner_residual.size, list(layout))
            if chunk is not None:
                begin, end = chunk
                residual = eager_value(residual_var)
                residual[begin:end] += owner_residual[:end - begin]
                residual_var.assign(residual)
            del self._owner_residuals[name], self._owner_layouts[name]

    def _owner_residual_variable(self, plan):
        """The owner-side residual variable of a two-stage plan's tensor; recreated (with the plan's warning)
        where the one kept does not fit (one of another layout was spilled as the tensor's residual was read)."""
        name, layout = plan.name, plan.owner_layout()
        with self._runtime.lock, tf.init_scope():
            var, layout_var = self._owner_residuals.get(name), self._owner_layouts.get(name)
            saved = None
            if layout_var is not None:
                value = eager_value(layout_var)
                # a tf.compat.v1 graph's variable has no value before its Session runs; this process made it
                # for this rank count, which a process cannot change
                saved = layout if value is None else [int(v) for v in value]
            if var is not None and not plan.keeps_owner_residual(saved, var.shape.num_elements()):
                var = None
            if var is None:
                var = self._owner_residuals[name] = new_variable(np.zeros(plan.own_numel(), np.float32),
                                                                 f"{name}/owner_residual", tf.float32)
                layout_var = self._owner_layouts[name] = new_variable(np.array(layout, np.int64),
                                                                      f"{name}/owner_layout", tf.int64)
        return var

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self):
        """Step counters and residuals by tensor name (numpy), plus the settings they belong to.

        ``tf.train.Checkpoint(compressor=c)`` saves and restores the same
        variables; this is for code that checkpoints with numpy/pickle.
        Residuals differ between ranks: save each rank's state. In a
        ``tf.compat.v1`` graph the state lives in graph variables: save it
        with ``tf.compat.v1.train.Saver`` there.
        """
        if not all(is_eager(var) for var in self._steps.values()):
            raise RuntimeError("horovod_qsgd: this compressor's state lives in a tf.compat.v1 graph; save and "
                               "restore it with tf.compat.v1.train.Saver (its variables are global variables).")
        tensors = {name: {"step": int(var.numpy()), "residual": None} for name, var in self._steps.items()}
        for name, var in self._residuals.items():
            tensors.setdefault(name, {"step": 0})["residual"] = var.numpy().copy()
        for name, var in self._owner_residuals.items():
            value = var.numpy().copy()
            if value.size == 0:
                continue  # an elastic job's owner residual where this rank owns no chunk
            entry = tensors.setdefault(name, {"step": 0, "residual": None})
            entry["owner_residual"] = value
            entry["owner_layout"] = [int(v) for v in self._owner_layouts[name].numpy()]
        return dict(state_header(type(self).__name__, self.settings()), tensors=tensors)

    def load_state_dict(self, state):
        check_loadable(state, type(self).__name__, self.settings())
        for name, entry in state["tensors"].items():
            self._step_variable(name).assign(entry["step"])
            if entry.get("owner_residual") is not None:
                self._load_owner_residual(name, np.asarray(entry["owner_residual"], np.float32),
                                          np.asarray(entry["owner_layout"], np.int64))
            elif name in self._owner_residuals and not self._owner_residuals[name].shape.is_fully_defined():
                self._load_owner_residual(name, np.zeros(0, np.float32), np.array(NO_OWNER, np.int64))
            if entry.get("residual") is not None:
                residual = np.asarray(entry["residual"], dtype=np.float32)
                self._residual_variable(name, residual.size).assign(residual)

    def _load_owner_residual(self, name, value, layout):
        """Into the variables a traced function reads where they can hold it (always in an elastic job, whose
        owner residuals change size with the world), else into new ones (a function traced for another
        layout is traced again: its plan would not match)."""
        with self._runtime.lock:
            var, layout_var = self._owner_residuals.get(name), self._owner_layouts.get(name)
            if var is not None and (not var.shape.is_fully_defined() or var.shape.num_elements() == value.size):
                var.assign(value)
                layout_var.assign(layout)
                return
            self._owner_residuals[name] = new_variable(value, f"{name}/owner_residual", tf.float32)
            self._owner_layouts[name] = new_variable(layout, f"{name}/owner_layout", tf.int64)

    def _elastic_owner_variables(self, name):
        """(owner residual, its layout) of tensor ``name`` in an elastic job: a variable of any length, empty
        where this rank owns no chunk; the layout ``NO_OWNER`` until it does."""
        with self._runtime.lock, tf.init_scope():
            var = self._owner_residuals.get(name)
            if var is None or var.shape.is_fully_defined():
                initial = np.zeros(0, np.float32) if var is None else eager_value(var)
                layout = NO_OWNER if var is None else eager_value(self._owner_layouts[name])
                self._owner_residuals[name] = ResourceVariable(initial, name=op_name(f"{name}/owner_residual"),
                                                               dtype=tf.float32, trainable=False,
                                                               shape=tf.TensorShape([None]))
                self._owner_layouts[name] = new_variable(np.asarray(layout, np.int64), f"{name}/owner_layout",
                                                         tf.int64)
            return self._owner_residuals[name], self._owner_layouts[name]

    def _set_step_counters(self, steps):
        for name, step in steps.items():
            self._step_variable(name).assign(int(step))

    def step_counters(self):
        """{tensor name: steps taken}: what :meth:`start_new_world` gets from rank 0."""
        with self._runtime.lock:
            return {name: int(var.numpy()) for name, var in self._steps.items()}

    def rescale_residuals(self, factor):
        """Multiplies every error-feedback residual by ``factor`` (a float or a scalar tensor; works in
        ``tf.function``): call it with new / old loss scale when a loss scaler changes its scale (see
        ``horovod_qsgd.torch``'s twin), so that residual and gradient stay in the same units."""
        factor = tf.cast(factor, tf.float32)
        for variable in list(self._residuals.values()) + list(self._owner_residuals.values()):
            variable.assign(variable * factor)
