"""The compressors' docstrings, written once for :mod:`horovod_qsgd.torch` and :mod:`horovod_qsgd.tensorflow`.

The math, the defaults and when to change them are the same in both
frameworks (the payloads are byte-identical); only what a gradient is called
and where the state lives differ, filled in by each adapter.
"""
from string import Template


def qsgd(name, state="", fusion=None, node_aware=None):
    """QSGD's docstring; ``name``: what names a gradient ("tensor", "variable"); ``state``: a closing paragraph;
    ``fusion``: which two-stage tensors the adapter fuses (takes ``fusion_threshold``): ``"step"``, a step's,
    ``"grouped"``, a grouped call's, None: none; ``node_aware``: where
    ``"auto"`` takes ``exchange="node_aware"`` (``"gpu"``: for GPU gradients, ``"asked"``: never by itself), None
    where the adapter does not have it."""
    return _QSGD.substitute(name=name, state=state, fusion=_FUSION_ARGS.get(fusion, ""),
                            exchange=_exchange_arg(node_aware))


def topk(state, fusion=None, node_aware=None):
    """Top-k's docstring; ``state``: how its per-rank state is checkpointed (ends a sentence); ``fusion`` and
    ``node_aware``: as :func:`qsgd`."""
    return _TOPK.substitute(state=state, fusion=_FUSION_ARGS.get(fusion, ""), exchange=_exchange_arg(node_aware))


def _exchange_arg(node_aware):
    if node_aware is None:
        return _FLAT_EXCHANGE
    return _NODE_AWARE_EXCHANGE.substitute(auto=_NODE_AWARE_AUTO[node_aware])


_FLAT_EXCHANGE = """exchange: ``"auto"`` (default), ``"allgather"`` or ``"two_stage"``."""
_NODE_AWARE_EXCHANGE = Template("""exchange: ``"auto"`` (default), ``"allgather"``, ``"two_stage"`` or
            ``"node_aware"``: on nodes of several ranks, the node's ranks
            first sum their gradients at full precision (each rank one
            1/L shard of them), only those sums are compressed and cross
            between nodes, and the node's ranks then share what crossed,
            still compressed: about 2 compressed gradients per node on the
            link between nodes instead of 2·L. ${auto}""")
_NODE_AWARE_AUTO = {
    "gpu": """``"auto"`` takes it for GPU
            gradients on several nodes; on CPU nodes its full-precision
            in-node sum cost about what it saved in our measurements
            (``benchmarks/results/node-step-time``, ``ddp-hooks/nodes*``).""",
    "asked": """``"auto"`` does not take it
            here: the codecs run on the host, where its full-precision
            in-node sum cost about what it saved in our measurements
            (``benchmarks/results/node-step-time``); ask for it where the link
            between nodes is much slower than the one inside them.""",
}


_FUSION_ARGS = {"step": """
        fusion_threshold: the two-stage tensors of a step share one alltoall
            and one allgather per group of at most this many bytes of
            first-stage payload (default 64 MiB, as Horovod's own fusion
            buffer: usually one group per step); on a GPU, allgather tensors
            share one allgather per group of at most this many bytes of
            float32 gradient and at most 25 MiB (DDP's bucket size; on the
            host each has its own), node-aware tensors each of their steps'
            collectives per group of at most this many bytes of float32
            gradient and at most 4 MiB (a larger tensor starts alone,
            overlapping the backward pass). A group is
            encoded and decoded together (on a GPU: launches per group, not
            per tensor). 0 gives every tensor its own collectives. A group's
            first collective waits for its last tensor, so smaller groups
            overlap more of the backward pass, and each costs a collective's
            latency (N-1 messages): measured on 2 cores, 8 ranks 7-14% faster
            fused, 4 ranks with three large tensors 13% slower with QSGD
            (``benchmarks/results/fusion``).""", "grouped": """
        fusion_threshold: the two-stage tensors of one grouped call share
            one alltoall and one allgather, its node-aware ones each step's
            collective (3 at 2 nodes, 4 from 3): ``hvd.grouped_allreduce``, and
            the ``groups=`` (``num_groups=``) of ``DistributedGradientTape``
            and both ``DistributedOptimizer``\ s, which compress a group's
            tensors before the first result. Without them Horovod builds
            every gradient's exchange alone, and so does this compressor.
            The groups are the caller's, alike on every rank: the threshold
            does not split them (default 64 MiB); 0 gives every tensor its
            own collectives. Each group costs a collective's latency (N-1
            messages) and its alltoall waits for its last tensor."""}


def randomk(name, state=""):
    """Random-k's docstring; as :func:`qsgd`."""
    return _RANDOMK.substitute(name=name, state=state)


_QSGD = Template(r"""QSGD: stochastic, unbiased quantization to a few bits per coordinate (Alistarh et al., arXiv 1610.02132).

    The flattened gradient is cut into buckets of ``bucket_size`` values. A
    bucket :math:`v` with scale :math:`\|v\|` (``norm="max"``: the largest
    magnitude, as in the paper's experiments; ``"l2"``: the paper's theory)
    sends, for each coordinate, its sign and a level
    :math:`\ell_i \in \{0..s\}` with :math:`s = 2^{bits-1}-1`, where
    :math:`|v_i|/\|v\| \cdot s` is rounded up with probability equal to its
    fractional part, so :math:`E[Q(v)] = v`.

    Exchange. ``"allgather"``: every rank receives every rank's payload and
    decodes all N of them; it receives :math:`(N-1)P` bytes for a payload of
    :math:`P`, so it pays off only for a few ranks. ``"two_stage"``: each rank
    owns 1/N of the buckets; the slices go to their owners (one alltoall),
    each owner adds its own unquantized slice and the N-1 decoded ones,
    quantizes the sum again with ``second_stage_bits`` and the re-quantized
    sums are allgathered: about :math:`(N-1)/N \cdot (P + P_2)` bytes per
    rank, flat in N like a ring allreduce. ``"auto"`` (default) takes the
    allgather at 2 ranks and for tensors under 65536 elements (one collective
    instead of two) and the two stages otherwise. ``compression_stats()``
    says which exchange each tensor used and the bytes of each stage.

    The second quantization adds the variance of quantizing a sum of N
    gradients, which does not shrink with N: with 4+4 bits the relative
    error of the averaged gradient is 0.21 at 8 ranks against the
    allgather's 0.09 (``benchmarks/two_stage_error.py``).
    ``second_stage_bits=8`` brings it to 0.085, below the allgather's, for
    :math:`(N-1)/N \cdot 0.5P` more bytes. On digits neither showed in
    accuracy at 4 or 8 ranks (``benchmarks/results/convergence-two-stage``).

    When to change the defaults. ``bits=4`` matched uncompressed within the
    spread over seeds in both convergence studies (digits with momentum SGD;
    a byte-level language model with Adam, where it ended 0.04 nats per byte
    lower): start there. ``bits=8`` (3.9x fewer bytes) when the link is only
    a little slower than the compute step; ``bits=2`` (15x) when the link
    dominates the step, for more variance (it ended between 4 and 8 bits on
    the language model). From about 8 ranks with the two-stage exchange set
    ``second_stage_bits=8`` (the owners' re-quantization otherwise doubles
    the error of the averaged gradient). Raise ``min_numel`` when many small
    tensors make per-tensor overheads dominate ``compression_stats()``;
    ``bucket_size``, ``norm`` and ``encoding`` rarely need changing.

    Args:
        bits: wire bits per coordinate, 2..8 (2: ternary, 4: s=7, 8: s=127).
            Fewer bits, fewer bytes and more variance.
        bucket_size: coordinates per scale (default 512, the paper's). Larger
            buckets cost fewer scale bytes but add variance.
        norm: ``"max"`` (default; lower variance in practice) or ``"l2"``.
        encoding: ``"fixed"`` (bit-packed, default) or ``"elias"`` (the paper's
            Elias-coded sparse form; pays off with few levels, ``norm="l2"``
            and large buckets).
        scale_dtype: ``"float32"`` (default) or ``"float16"`` per-bucket scales.
        rounding: ``"stochastic"`` (unbiased, default) or ``"deterministic"``
            (round to the nearest level: no randomness, but biased).
        min_numel: tensors with fewer elements go through the ordinary
            allreduce unquantized (default 10000, as in the paper).
        seed: seed of the counter-based RNG (rounding depends on seed, step,
            ${name} name, rank and element index).
        ${exchange}
        second_stage_bits: bits of the owners' re-quantized sums (default:
            ``bits``).${fusion}

    Cost on the wire per rank and step: ``bits + 32/bucket_size`` bits per
    coordinate plus a 16-byte header per payload; 4 bits with bucket 512 is
    4.0625 bits, 7.88x fewer than fp32. Allgather at N ranks: N-1 payloads
    received; two stages: 7.8x fewer bytes than a ring allreduce at any N
    (4+4 bits).${state}
    """)

_TOPK = Template(r"""Top-k sparsification with error feedback (Shi et al., arXiv 1911.08772; Lin et al., DGC).

    Each step the residual :math:`r` (what earlier steps did not send) is
    added to the gradient, the ``k = max(1, floor(ratio * n))`` largest
    magnitudes of the sum are sent as (int32 index, value) pairs and the rest
    stays in the residual: ``sent + r_new == grad + r_old`` exactly.

    Exchange. ``"allgather"``: every rank receives every rank's k pairs,
    :math:`(N-1) \cdot 8k` bytes, and the result has up to :math:`Nk`
    nonzeros. ``"two_stage"``: each rank owns 1/N of the coordinates; a rank
    selects, in every other owner's chunk, the top ``ratio`` of its
    ``grad + r`` there (with error feedback: what it does not send stays in
    ``r``, so no chunk can receive more than its share, whatever the
    gradient), and one alltoall delivers them. The owner adds its own chunk
    of ``grad + r`` (uncompressed) and the received pairs, adds its
    *owner-side residual*, selects the top ``ratio`` of that sum and keeps
    the rest in the owner-side residual; the owners' selections are
    allgathered. Nothing is lost: ``sent + sum of all residuals`` equals the
    sum of all gradients. About :math:`2 (N-1)/N \cdot 8k` bytes per rank,
    flat in N, and about k nonzeros in the result. ``"auto"`` (default):
    the allgather at 2 ranks and for tensors under 65536 elements, the two
    stages otherwise. The owner-side residual is per-rank state of the
    owned chunk; it is in ``state_dict()`` and is reset (with a warning)
    when the job resumes with another number of ranks.

    When to use it. Top-k sends a weight's gradient only when its
    accumulated value is among the largest, so each weight gets few turns:
    on digits (an MLP, 30 epochs) it matched uncompressed, but on a small
    byte-level transformer language model it trained several times more
    slowly than uncompressed with Adam and with momentum SGD, at 1% and
    0.1%, exact or Gaussian (0.8 nats per byte behind after 400 steps, 0.9
    after 1200; 10% still 0.46 behind), where QSGD at 2-8 bits matched it
    (``benchmarks/results/lm-convergence``). Prefer QSGD unless the link is
    so slow that only Top-k's bytes fit, and check convergence on your model
    first. If you use it: keep ``error_feedback=True`` and the residuals in
    checkpoints; ``selector="gaussian"`` when selection time shows in
    ``compression_stats()``.

    Args:
        ratio: fraction of coordinates sent (default 0.01).
        selector: ``"exact"`` (exactly the k largest, default), ``"gaussian"``
            (Gaussian-k: a threshold from mean and standard deviation, at most
            3 refinements; much faster, k is approximate) or ``"sample"``
            (DGC: a threshold from a random sample).
        error_feedback: keep what was not sent (default True). Without it
            top-k is biased and usually converges worse.
        value_dtype: ``"float32"`` (default) or ``"float16"`` values.
        sample_ratio: fraction of coordinates the ``"sample"`` selector reads.
        min_numel: smaller tensors are allreduced unchanged (default 10000).
        seed: seed for the ``"sample"`` selector.
        ${exchange}${fusion}

    Cost on the wire per rank and step: a fixed capacity of entries (k for
    exact, somewhat more for the approximate selectors) times 8 bytes (6 with
    fp16 values) plus a 16-byte header: at ratio 0.01, 0.08 bytes per
    coordinate instead of 4. The residual costs one fp32 copy of every
    compressed gradient in memory, and it is per-rank state: ${state}
    """)

_RANDOMK = Template(r"""Random-k sparsification with a shared seed.

    Every rank draws the same ``k = max(1, floor(ratio * n))`` coordinates
    from (seed, step, ${name} name), one uniformly inside each of k equal
    strata, so Horovod's own allreduce sums the selected values directly:
    the wire carries k values instead of n, and no indices. The step
    counters must therefore be equal on every rank: at its first step (and
    after an elastic reset) every rank takes rank 0's, so a state loaded on
    rank 0 alone, or a resume at another number of ranks, draws alike. A
    state loaded later in a running job must be loaded on every rank.

    When to use it. Mostly as a baseline: it needs no index on the wire and
    no selection, but it sends random coordinates, so it converges more
    slowly than Top-k or QSGD at the same bytes (on digits 0.5-0.9 points
    behind at 1%; on the language model with Adam the furthest behind of all).
    Prefer QSGD.

    Costs: 4 bytes per sent value (2 with float16), through Horovod's own
    allreduce (a ring: bytes per rank flat in the ranks); drawing the
    coordinates and gathering them is one pass over the tensor on each rank;
    ``error_feedback=True`` keeps a float32 residual the size of the tensor.

    Args:
        ratio: fraction of coordinates sent (default 0.01); the bytes scale
            with it.
        error_feedback: keep unsent coordinates in a residual (default False;
            True sends them later, for the residual's memory).
        rescale: multiply sent values by n/k so the estimate is unbiased
            (default False; increases variance by n/k).
        value_dtype: ``"float32"`` (default) or ``"float16"``: values are sent
            and summed as fp16 (half the bytes; the sum is rounded to fp16,
            as with Horovod's ``Compression.fp16``).
        min_numel: smaller tensors are allreduced unchanged (default 10000).
        seed: the shared seed; must be equal on all ranks (checked).${state}
    """)
