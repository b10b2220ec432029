"""An exchange's conduct (:mod:`horovod_qsgd.common.collectives`) run by a TensorFlow graph.

A TensorFlow step is a graph built before it runs: each collective is a Horovod op placed when the
function is traced, and the steps between the collectives run in host ops (``tf.numpy_function``) when
the graph runs. An exchange states its collectives in advance (its ``collectives()``: kind and name, in
order), and :class:`GraphConduct` builds:

1. ``start``: a host op that starts the conduct and runs it to its first collective;
2. ``run_collectives``: each collective's Horovod op, and after each but the last a host op that sends
   the conduct what arrived and runs it to the next one;
3. ``finish``: a host op that sends the conduct what the last one received and decodes the result.

Between its host ops a conduct waits in a table, under a token that each op hands to the next: two
runs of one graph never meet, and a step abandoned halfway (an error in another op) leaves one conduct
behind, dropped when the table grows past a few. Which exchange it is never enters here: the adapter
says how to start it, which resumed step reads and writes what besides what arrived (owner-side
residuals), and how its result is decoded. The flat exchanges, a fused group's and the node-aware
exchange (:mod:`horovod_qsgd.tensorflow.node_aware`) all run here.
"""
import itertools
import threading
import time

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
from horovod_qsgd.common.collectives import ALLGATHER, ALLTOALL, conclude
from horovod_qsgd.common.naming import PAYLOAD_PREFIX, SECOND_STAGE_PREFIX
from horovod_qsgd.kernels import CarriedResidual
from horovod_qsgd.tensorflow import hvd_join
from horovod_qsgd.tensorflow.compressor_base import decode_scaled
from horovod_qsgd.tensorflow.feedback import op_name

_LIVE_LIMIT = 8  # conducts kept waiting per site: more means steps were abandoned halfway


class ConductRun:
    """One run of a site's exchange, between its host ops: the conduct, the residuals its resumed step
    carries (what a ``begin`` hands the conduct as its owner-side residuals), what the ``begin`` kept for
    the finish, and a collective held for a later one of the graph's (:class:`AnyWorldConduct`)."""
    __slots__ = ("conduct", "carried", "kept", "held")

    def __init__(self):
        self.conduct, self.carried = None, None
        self.kept = self.held = None

    def carried_residuals(self):
        """[CarriedResidual]: the carried values of the step running now, each read as it is and written anew."""
        return list(self.carried or [])

    def first_carried(self):
        """The first of :meth:`carried_residuals`, or None (a plan's ``owner_residual`` function)."""
        return self.carried[0] if self.carried else None


class GraphConduct:
    """The graph ops of one site's exchange: a tensor's, or a fused group's.

    ``collectives``: [(kind, name)] in order, as the exchange states them; ``first_payload``: the first
    collective carries the tensor's first payload of the step (hvd.join() refuses there, see
    :mod:`horovod_qsgd.tensorflow.hvd_join`); ``on_collective(index, collective)``: counts what the
    statistics need besides what the exchange's own steps count; ``answerable``: hvd.join() can answer the
    collectives by name (not the node-aware exchange's, whose splits are zero outside a step's peers);
    ``first_dtype``: what the first collective sends (float32: the node-aware exchange's in-node step).
    """

    def __init__(self, collectives, process_set, stats, first_payload=True, on_collective=None, answerable=True,
                 first_dtype=tf.uint8):
        self.collectives = [(kind, op_name(name)) for kind, name in collectives]
        self.process_set, self.stats = process_set, stats
        self.first_payload, self.on_collective = first_payload, on_collective
        self.answerable, self.first_dtype = answerable, first_dtype
        self._lock = threading.Lock()
        self._waiting = {}
        self._tokens = itertools.count(1)
        # the graph tensors of the step built so far: the token and what the next collective sends
        self.token = self.send = self.splits = self.received = None
        self._received_splits = None

    # -- the runs between host ops --------------------------------------------------------------
    def _park(self, run):
        with self._lock:
            token = next(self._tokens)
            self._waiting[token] = run
            while len(self._waiting) > _LIVE_LIMIT:
                del self._waiting[next(iter(self._waiting))]
        return np.int64(token)

    def _take(self, token):
        with self._lock:
            return self._waiting.pop(int(token))

    def discard(self, token):
        """Drops the run of ``token`` (a tensor that joined a fused group, whose conduct takes over)."""
        with self._lock:
            self._waiting.pop(int(token), None)

    def _advance(self, run, index, received, seconds_from):
        """Runs ``run``'s conduct from collective ``index - 1``'s arrival to collective ``index``; parks it.
        Returns (the collective, or None where the graph's collective ``index`` is skipped, [the token, what
        it sends, its splits])."""
        if index > 0:
            hvd_join.sending(self.collectives[index][1], first=False)  # never raises mid-step: see hvd_join
        collective = self._next_collective(run, index, received)
        if collective is None:
            self.stats.add(encode_seconds=time.perf_counter() - seconds_from)
            return None, [self._park(run), np.zeros(0, np.uint8), np.zeros(0, np.int32)]
        if self.on_collective is not None:
            self.on_collective(index, collective)
        self.stats.add(collectives_started=1, encode_seconds=time.perf_counter() - seconds_from)
        splits = collective.splits if collective.kind == ALLTOALL else []
        return collective, [self._park(run), np.asarray(collective.send), np.asarray(splits, np.int32)]

    def _next_collective(self, run, index, received):
        """The conduct's collective ``index``, sent what collective ``index - 1`` received; it must be the one
        the graph holds."""
        collective = next(run.conduct) if index == 0 else run.conduct.send(received)
        if (collective.kind, op_name(collective.name)) != self.collectives[index]:
            raise RuntimeError(f"horovod_qsgd: an exchange asked for {collective.kind} {collective.name!r} where it "
                               f"stated {self.collectives[index]}")
        return collective

    # -- the graph ------------------------------------------------------------------------------
    def start(self, begin, inputs, extra_dtypes=(), name="horovod_qsgd_encode"):
        """Step 1: one host op that calls ``begin(run, *arrays)`` on ``inputs``' values, which returns (the
        conduct, [arrays of ``extra_dtypes``]), and runs the conduct to its first collective. Returns the
        extra outputs (e.g. the new residual)."""
        def start_host(*arrays):
            hvd_join.sending(self.collectives[0][1], first=self.first_payload)
            started = time.perf_counter()
            run = ConductRun()
            run.conduct, extra = begin(run, *arrays)
            _, outputs = self._advance(run, 0, None, started)
            return outputs + list(extra)

        outputs = tf.numpy_function(start_host, list(inputs),
                                    [tf.int64, self.first_dtype, tf.int32] + list(extra_dtypes), stateful=False,
                                    name=name)
        self._note_outputs(outputs[:3])
        return list(outputs[3:])

    def _note_outputs(self, outputs):
        self.token, self.send, self.splits = outputs
        self.token.set_shape([])
        self.send.set_shape([None])
        self.splits.set_shape([None])

    def _collective(self, index):
        kind, name = self.collectives[index]
        if kind == ALLTOALL:
            self.received, self._received_splits = hvd.alltoall(self.send, splits=self.splits, name=name,
                                                                ignore_name_scope=True,
                                                                process_set=self.process_set)
        else:
            self.received = hvd.allgather(self.send, name=name, ignore_name_scope=True, process_set=self.process_set)
            self._received_splits = None
        if self.answerable:
            hvd_join.note_payload_collective(kind, name, self.process_set)
        else:
            hvd_join.note_unanswerable_collective()

    def _arrival(self):
        """The inputs that carry what the last collective built received, and how to hand it to a conduct."""
        if self._received_splits is None:
            return [self.received], lambda received: received
        return [self.received, self._received_splits], lambda received, splits: (received, splits.tolist())

    def run_collectives(self, carried=(), carried_at=1):
        """Step 2: every collective, and between them the host ops that resume the conduct. ``carried``:
        tensors (owner-side residuals) that the resumed step before collective ``carried_at`` reads, handed to
        the conduct as :class:`CarriedResidual`\\ s through its run (``run.carried_residuals()``); returns their
        values after the step: written anew, or as they were where nothing was encoded into them (a refusal).
        An exchange that fails before it writes them raises in its finish, and nothing is assigned."""
        carried = list(carried)
        new_values = []
        self._collective(0)
        for index in range(1, len(self.collectives)):
            arrival_inputs, arrival = self._arrival()
            count = len(arrival_inputs)
            with_carried = carried if index == carried_at else []

            def resume_host(token, *arrays, index=index, with_carried=with_carried):
                started = time.perf_counter()
                run = self._take(token)
                olds = arrays[count:]
                news = [np.empty_like(old) for old in olds]
                run.carried = [CarriedResidual(new, old) for new, old in zip(news, olds)]
                collective, outputs = self._advance(run, index, arrival(*arrays[:count]), started)
                run.carried = None
                if collective is not None and collective.refusal is not None:
                    news = list(olds)  # nothing was encoded
                return outputs + news

            outputs = tf.numpy_function(resume_host, [self.token] + arrival_inputs + with_carried,
                                        [tf.int64, tf.uint8, tf.int32] + [tf.float32] * len(with_carried),
                                        stateful=False, name="horovod_qsgd_encode_sum")
            self._note_outputs(outputs[:3])
            for value, new in zip(with_carried, outputs[3:]):
                new.set_shape(value.shape)
                new_values.append(new)
            self._collective(index)
        return new_values

    def finish(self, decode, placeholder, numels, num_ranks, finite_flag, name="horovod_qsgd_decode", kept=None):
        """Step 3: one host op that takes the conduct's result and, unless it refused, ``decode(gathered)``,
        which returns the float32 totals of ``numels``; they are scaled as the allreduced ``placeholder``
        says (over ``num_ranks``: an int, or a function that gives it as the op runs). Returns [(total, finite
        flag)] per total and, with ``kept(run.kept)`` (float32 arrays of ``numels``, e.g. the step's
        residuals), those as tensors."""
        arrival_inputs, arrival = self._arrival()
        count, stats = len(arrival_inputs), self.stats
        more = [] if kept is None else [tf.float32] * len(numels)

        def finish_host(token, *arrays):
            run = self._take(token)
            gathered, refusal = conclude(run.conduct, arrival(*arrays[:count]))
            started = time.perf_counter()
            totals, finite = decode_scaled(lambda: decode(gathered), numels, refusal, arrays[count],
                                           num_ranks() if callable(num_ranks) else num_ranks)
            stats.add(decode_seconds=time.perf_counter() - started)
            return totals + [finite_flag(flag) for flag in finite] + ([] if kept is None else kept(run.kept))

        outputs = tf.numpy_function(finish_host, [self.token] + arrival_inputs + [placeholder],
                                    [tf.float32] * len(numels) + [tf.bool] * len(numels) + more, stateful=False,
                                    name=name)
        if not isinstance(outputs, (list, tuple)):
            outputs = [outputs]
        totals, flags, more = outputs[:len(numels)], outputs[len(numels):2 * len(numels)], outputs[2 * len(numels):]
        for total, numel in zip(totals, numels):
            total.set_shape([numel])
        for finite in flags:
            finite.set_shape([])
        for array, numel in zip(more, numels):
            array.set_shape([numel])
        results = list(zip(totals, flags))
        return results if kept is None else (results, list(more))


def zeroed(decode, numels):
    """A :meth:`GraphConduct.finish` ``decode`` from one that adds the gathered payloads into zeroed totals:
    ``decode(gathered, totals)``."""
    def decoded(gathered):
        totals = [np.zeros(numel, np.float32) for numel in numels]
        decode(gathered, totals)
        return totals
    return decoded


class AnyWorldConduct(GraphConduct):
    """The graph ops of one tensor's exchange in a Horovod Elastic job, where one traced function runs on worlds
    of any size: the graph cannot hold a plan, and the ``begin`` makes the plan of the world the ops run in.

    The graph holds an alltoall under the tensor's payload name, which runs only where the plan's conduct asks
    for one (every rank takes the same branch: the plan follows the world), then an allgather under its
    second stage's name, which carries the conduct's last collective: the owners' sums of the two stages, or
    the payloads of a plan of one allgather. hvd.join() cannot answer them by name.
    """

    def __init__(self, name, stats):
        super().__init__([(ALLTOALL, PAYLOAD_PREFIX + name), (ALLGATHER, SECOND_STAGE_PREFIX + name)],
                         hvd.global_process_set, stats, answerable=False)

    def _next_collective(self, run, index, received):
        if index == 0:
            collective = next(run.conduct)
            if collective.kind == ALLGATHER:  # the plan's one collective: the graph's allgather carries it
                run.held = collective
                return None
            return collective
        if run.held is not None:
            collective, run.held = run.held, None
        else:
            collective = run.conduct.send(received)
        if collective.kind != self.collectives[index][0]:  # the names were fixed when the graph was traced
            raise RuntimeError(f"horovod_qsgd: an exchange asked for {collective.kind} {collective.name!r} where "
                               f"the graph holds {self.collectives[index]}")
        return collective

    def _collective(self, index):
        if index > 0:
            super()._collective(index)
            return
        name, send, splits = self.collectives[0][1], self.send, self.splits
        self.received, self._received_splits = tf.cond(
            tf.size(splits) > 0,
            lambda: hvd.alltoall(send, splits=splits, name=name, ignore_name_scope=True),
            lambda: (send, splits))
        hvd_join.note_unanswerable_collective()
