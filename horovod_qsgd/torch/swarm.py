"""SwarmSGD: decentralized SGD with local steps and quantized pairwise model averaging.

Nadiradze, Sabour, Davies, Li, Alistarh, "Decentralized SGD with Asynchronous,
Local and Quantized Updates" (arXiv 1910.12308)::

    import horovod.torch as hvd
    from horovod_qsgd.torch.swarm import SwarmOptimizer

    optimizer = SwarmOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               model, local_steps=4, quantization="lattice8")
    ...                                   # the training loop is unchanged
    optimizer.average_models()            # before evaluating or saving the model

See :func:`SwarmOptimizer` for the algorithm, the policies and the costs.
"""
import horovod.torch as hvd
import torch

from horovod_qsgd.common.matching import TOPOLOGIES, check_edges, random_matching
from horovod_qsgd.torch_shared.local_sgd import named_parameters_of
from horovod_qsgd.torch.swarm_engine import AVERAGING, Slot, SwarmEngine, SwarmStats, parse_quantization

__all__ = ["SwarmOptimizer", "SwarmMixin", "SwarmStats", "random_matching", "TOPOLOGIES"]


class SwarmMixin:
    """Methods SwarmSGD adds to a torch optimizer class; see :func:`SwarmOptimizer`.

    ``isinstance(optimizer, SwarmMixin)`` tells a swarm optimizer apart.
    """

    def step(self, closure=None):
        """One local step of the wrapped optimizer; every ``local_steps`` steps, a pairwise model average."""
        loss = super().step(closure)
        self._swarm.after_local_step()
        return loss

    def synchronize(self):
        """Applies a non-blocking exchange still in flight (a collective: call it on every rank)."""
        self._swarm.synchronize()

    def average_models(self):
        """Replaces every rank's model by the average over all ranks (one allreduce; call on every rank).

        Parameters and floating-point buffers are averaged; a non-blocking
        exchange in flight is applied first.  Use it before evaluating or
        saving the model: SwarmSGD's individual models differ slightly.
        """
        self._swarm.average_models()

    @property
    def swarm_round(self):
        """Number of exchange rounds started so far."""
        return self._swarm.round

    def partner(self, round_index=None):
        """This rank's partner in a round (default: the next one), -1 when it sits out."""
        return self._swarm.partner(self._swarm.round if round_index is None else round_index)

    def last_exchange(self):
        """Diagnostics of the last round: round, partner, eps sent/received per tensor, failed tensors, fallback."""
        return dict(self._swarm.last)

    def compression_stats(self, reset=False):
        """Counters since the last reset.

        ``rounds``, ``rounds_sat_out``; ``bytes_sent`` (payloads and fallbacks
        this rank sent) and ``bytes_uncompressed`` (the same exchanges at the
        tensors' own dtype); ``tensors_compressed`` / ``tensors_passed_through``
        (lattice-coded vs exact payloads); ``decode_failures`` (tensors
        whose payload did not decode here), ``fallback_rounds`` (rounds this
        rank re-sent in full precision); ``encode_seconds``,
        ``decode_seconds``, ``wait_seconds`` (blocked in the exchange).
        """
        return self._swarm.stats.snapshot(reset)

    def state_dict(self):
        """The wrapped optimizer's state plus ``"swarm"``: local step and round counters, seed and settings,
        spread estimates, and a non-blocking exchange in flight (snapshot and received bytes).

        Models and optimizer states differ between ranks: save each rank's.
        """
        state = super().state_dict()
        state["swarm"] = self._swarm.state()
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        swarm = state_dict.pop("swarm", None)
        if swarm is not None:
            self._swarm.check(swarm)  # before anything is loaded
        super().load_state_dict(state_dict)
        if swarm is not None:
            self._swarm.load(swarm)


def _named_tensors(optimizer, named_parameters, named_buffers):
    module = named_parameters if isinstance(named_parameters, torch.nn.Module) else None
    if module is not None:
        named_parameters = module.named_parameters()
        if named_buffers is None:
            named_buffers = module.named_buffers()
    named_parameters = named_parameters_of(optimizer, named_parameters, "SwarmOptimizer", keep_unstepped=True)
    return named_parameters, list(named_buffers or [])


def SwarmOptimizer(optimizer, named_parameters=None, local_steps=4, quantization=None, topology="complete",
                   averaging="blocking", seed=0, process_set=hvd.global_process_set, named_buffers=None,
                   min_numel=1024):
    r"""SwarmSGD: local SGD steps and pairwise model averaging with random partners (arXiv 1910.12308).

    Use it *instead of* ``hvd.DistributedOptimizer``: it wraps the local
    optimizer, and ``step()`` does the local step and, every
    ``local_steps`` steps, one exchange round.

    Algorithm. Every rank keeps its own model :math:`X_i` and trains it on
    its own data with the wrapped optimizer. In round :math:`t` (after every
    ``H = local_steps`` local steps) the ranks are paired by a random
    matching of the ``topology`` graph, drawn from a counter-based generator
    keyed by ``(seed, t)``: every rank computes the same matching without
    communicating, and with an odd count one rank sits out the round. The
    partners exchange models through one ``hvd.alltoall`` whose splits send
    only to the partner (a rank sitting out sends nothing), and both set

    .. math:: X_i, X_j \leftarrow (X_i + X_j) / 2

    (``averaging="blocking"``). With ``averaging="nonblocking"`` (the
    paper's variant) the round snapshots :math:`S_i = X_i`, starts the
    exchange asynchronously and returns at once; training continues, and
    at the next round the rank applies :math:`X_i \leftarrow (S_i + S_j)/2 +
    (X_i - S_i)`: the average of the snapshots plus what it computed since.
    Communication then overlaps ``H`` steps of computation; the partner's
    model is ``H`` steps stale.

    Quantized exchange (``quantization="lattice8"``): models are large in
    norm but close to each other, so each tensor is sent with the
    cubic-lattice quantizer of Davies et al. (ICLR 2021,
    :class:`~horovod_qsgd.codecs.lattice.LatticeCodec`): ``round(x/eps) mod
    q`` with unbiased stochastic rounding, decoded against the receiver's
    own tensor. ``eps`` is chosen per tensor so that the decodable radius
    ``eps * (q/2 - 2)`` is ``headroom`` (default 2) times the estimated
    spread ``max|X_i - X_j|``: the larger of the spread this rank measured
    at its last exchange and half its previous estimate (``SPREAD_MEMORY``).
    A tensor is sent exactly while no estimate exists (a rank's first
    round), and parameters under ``min_numel`` elements always are. Each
    partner ends within ``eps/2`` per coordinate of the exact average.
    Models further apart than the radius do not decode; a 32-bit checksum
    per 4096 coordinates detects it. The ranks then allreduce one bit per
    lattice-coded tensor and rank, and both partners of an affected pair
    re-send those tensors in full precision, so the round still averages
    them exactly (reported by ``last_exchange()`` and counted by
    ``compression_stats()`` as ``decode_failures``, ``fallback_rounds``,
    ``fallback_tensors``, and logged at INFO level).

    Args:
        optimizer: the local torch optimizer (its hyperparameters and state
            stay in use; its state, e.g. momentum, stays local).
        named_parameters: ``model.named_parameters()`` for stable names, or
            the model itself (then its buffers are averaged too). Default:
            the optimizer's parameters as ``param.<i>``.
        local_steps (int): ``H``, local steps between exchanges (default 4).
            More: less communication, models drift further apart.
        quantization: ``None`` (default; exact float32), ``"lattice8"``
            (``"lattice3"``..``"lattice8"``: bits per coordinate), a dict of
            :class:`LatticeCodec` arguments or a ``LatticeCodec``.
        topology: ``"complete"`` (default), ``"ring"`` or a sequence of
            ``(rank, rank)`` edges (process-set ranks), see
            :func:`random_matching`.
        averaging: ``"blocking"`` (default) or ``"nonblocking"``.
        seed (int): seed of the matchings and of the rounding noise; the
            same on every rank (checked).
        process_set: the Horovod process set whose ranks swarm (default
            global); every rank in it must call ``step()`` equally often.
        named_buffers: ``model.named_buffers()`` when ``named_parameters``
            is not the model.
        min_numel (int): parameters with fewer elements are always sent
            exactly (default 1024; their bytes are negligible).

    Buffers: floating-point buffers (BatchNorm running mean and variance)
    are averaged with the partner in full precision at each exchange (they
    are small, and a quantization step chosen for the weights would not fit
    them), and by :meth:`average_models`. Integer buffers
    (``num_batches_tracked``) stay local. Buffers are exchanged only when
    the model or ``named_buffers`` is given.

    When to prefer it over gradient compression (``hvd.DistributedOptimizer``
    with ``compression=QSGD(...)``): when the network, not computation, is
    the bottleneck. Each rank sends its model to one partner every ``H``
    steps: per step ``4/H`` bytes per coordinate exact, about ``1/H`` with
    ``lattice8``, independent of the number of ranks; ring allreduce sends
    ``2(n-1)/n * 4`` bytes per coordinate every step (4 at 2 ranks, toward
    8), and compressed gradients, allgathered, grow with the rank count.
    The price: models differ between ranks (call :meth:`average_models`
    before evaluating), and pairwise averaging mixes more slowly than a
    global average, so progress per step can lag synchronous SGD at large
    rank counts or large ``H``; tune ``H`` and the learning rate. Horovod's
    ``alltoall`` is a collective of the whole process set, so a round waits
    for every rank to reach it (a straggler delays all ranks once per round,
    not once per step); ``"nonblocking"`` hides the transfer, not that wait.

    Costs: memory for one flat fp32 copy of the model per round (two with
    ``"nonblocking"``: the snapshot is kept until the next round), an
    encode and a decode pass over the model per round, and per round one
    ``alltoall`` plus, with quantization, an allreduce of
    ``size * ceil(T/31)`` int32 flags (T lattice-coded tensors) and, rarely,
    an exact re-send. Every rank of the process set must call ``step()``
    equally often (as with ``hvd.DistributedOptimizer``);
    ``hvd.broadcast_optimizer_state`` calls ``step()`` once on a fresh
    optimizer, which counts as a local step on every rank alike.

    Returns an instance of a subclass of the optimizer's class (like
    ``hvd.DistributedOptimizer``) that shares its parameter groups, state
    and hooks, with :meth:`SwarmMixin.average_models`, ``synchronize()``
    (apply a non-blocking exchange in flight), ``partner()``,
    ``last_exchange()``, ``compression_stats()`` and a ``state_dict()`` that
    adds the local-step and round counters, the settings (seed included),
    the spread estimates and an exchange in flight (models differ between
    ranks: save every rank's).
    """
    if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
        raise ValueError(f"local_steps={local_steps!r} must be an integer >= 1")
    if averaging not in AVERAGING:
        raise ValueError(f"averaging={averaging!r} is not supported; allowed: 'blocking', 'nonblocking'")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 64:
        raise ValueError(f"seed={seed!r} must be an integer in [0, 2**64)")
    if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
        raise ValueError(f"min_numel={min_numel!r} must be an integer >= 0")
    if not process_set.included():
        raise ValueError("horovod_qsgd: SwarmOptimizer: this rank is not in process_set")
    if isinstance(topology, str):
        random_matching(2, 0, 0, topology)  # validates the name
    else:
        topology = check_edges(topology, process_set.size())
    codec = parse_quantization(quantization)
    named_parameters, named_buffers = _named_tensors(optimizer, named_parameters, named_buffers)
    slots, offset = [], 0
    for kind, named in (("param", named_parameters), ("buffer", named_buffers)):
        for name, tensor in named:
            if not tensor.dtype.is_floating_point:
                continue  # integer buffers stay local
            quantize = codec is not None and kind == "param" and tensor.numel() >= min_numel
            slots.append(Slot(f"{kind}:{name}", tensor, kind, offset, quantize))
            offset += tensor.numel()
    engine = SwarmEngine(slots, local_steps, codec, topology, averaging, seed, process_set, min_numel)
    # A subclass of the optimizer's own class sharing its parameter groups, state and hooks (the
    # wrapped optimizer's __init__ is not called again, so any optimizer signature works).
    cls = type(optimizer.__class__.__name__, (SwarmMixin, optimizer.__class__), {})
    swarm = cls.__new__(cls)
    swarm.__dict__.update(optimizer.__dict__)
    swarm._swarm = engine
    return swarm
