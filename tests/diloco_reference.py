"""DiLoCo's outer steps from the codecs alone, for the tests of both its forms (Horovod and torch.distributed).

The inner optimizer is SGD with lr 1 and gradients set by the test, so every rank's local model after H steps
is known exactly (``x - g`` rounds once, in numpy as in torch). Each exchanged tensor (``groups``: its
collective's name and the parameters it holds, concatenated) is averaged as the exchange does it: the
allgather's payloads decoded in rank order, or the two stages of ``tests/two_stage_reference.py``; the outer
Nesterov step follows in numpy float32 operations.
"""

import numpy as np

from tests.two_stage_reference import allgather_reference, bounds, gradient, node_aware_reference
from tests.two_stage_reference import reference as two_stage_reference

# 70,001 elements in all: the torch.distributed form's one flat tensor takes the two stages from 3 ranks
# (65,536 and up); neither size is a multiple of QSGD's bucket.
SIZES = {"a": 40_000, "b": 30_001}
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.5
# outer_lr=None's value with momentum 0.8 at H = 4, 8, 16 by rank count: 0.7 * H / 16 * sqrt(ranks / 2), at
# least 1 - 0.8
DEFAULT_OUTER_LRS = {2: (0.2, 0.35, 0.7), 3: (0.21433, 0.428661, 0.7), 4: (0.247487, 0.494975, 0.7)}


def model(seed=0):
    import torch
    g = torch.Generator().manual_seed(seed)
    module = torch.nn.Module()
    for name, numel in SIZES.items():
        module.register_parameter(name, torch.nn.Parameter(torch.randn(numel, generator=g)))
    return module


def grads(rank, step):
    return {name: gradient(rank, numel, 1000 * step + i) * np.float32(0.01) for i, (name, numel) in
            enumerate(SIZES.items())}


def local_steps(opt, module, rank, steps):
    import torch
    for step in steps:
        for name, g in grads(rank, step).items():
            getattr(module, name).grad = torch.from_numpy(g.copy())
        opt.step()


def assert_every_rank_holds(everyone, want, kind, label):
    """Every row of ``everyone`` (the ranks' models, gathered) the same tensor, and ``want``: bitwise, or for
    float32 (``kind`` "none", whose average sums in the collective's own order) within its rounding."""
    import torch
    assert all(torch.equal(everyone[0], row) for row in everyone), label
    if kind == "none":
        np.testing.assert_allclose(everyone[0].numpy(), want, rtol=0, atol=1e-5)
    else:
        assert np.array_equal(everyone[0].numpy(), want), (label, np.abs(everyone[0].numpy() - want).max())


def node_average(rank, step, per_node):
    """Hierarchical DiLoCo's in-node average of the gradients of ``rank``'s node: summed in local-rank order,
    divided by the node's size (``horovod_qsgd.torch_shared.in_node``)."""
    first = rank - rank % per_node
    each = [grads(r, step) for r in range(first, first + per_node)]
    total = {n: each[0][n].copy() for n in SIZES}
    for g in each[1:]:
        for n in SIZES:
            total[n] += g[n]
    return {n: total[n] / np.float32(per_node) for n in SIZES}


class Reference:
    """Every rank's model through DiLoCo, in numpy. ``kind``: "none", "qsgd", "topk" (allgather; Top-k 5% with
    error feedback), "qsgd-two-stage", "topk-two-stage"; with ``per_node`` (nodes of that many ranks) the
    hierarchical form: each local step with the node's average gradient, the outer exchange node-aware (Horovod)
    or, with ``node_shards``, shard j of the node's pseudo-gradient exchanged among the nodes by their local
    ranks j (torch.distributed)."""

    def __init__(self, kind, num_ranks, groups, per_node=None, node_shards=False, outer_lr=OUTER_LR,
                 outer_momentum=OUTER_MOMENTUM):
        from horovod_qsgd.codecs import QSGDCodec, TopKCodec
        self.kind, self.num_ranks, self.groups, self.per_node = kind, num_ranks, groups, per_node
        self.outer_lr, self.outer_momentum = np.float32(outer_lr), np.float32(outer_momentum)
        self.node_shards = node_shards
        self.codec = {"qsgd": QSGDCodec(bits=4), "topk": TopKCodec(ratio=0.05)}.get(kind.split("-")[0])
        self.unit = 512 if kind.startswith("qsgd") else 1
        self.anchor = {n: p.detach().numpy().copy() for n, p in model().named_parameters()}
        self.momentum = {n: np.zeros_like(a) for n, a in self.anchor.items()}
        self.residuals, self.owner_residuals = {}, {}
        self.outer = {}  # key name -> outer steps it took (its codec's step)

    def _average(self, key_name, deltas):
        step = self.outer[key_name] = self.outer.get(key_name, -1) + 1
        numel = deltas[0].size
        feedback = self.kind.startswith("topk")
        if self.node_shards:
            return self._average_node_shards(key_name, deltas[::self.per_node], feedback, step)
        residuals = self.residuals.setdefault(key_name, [np.zeros(numel, np.float32)
                                                         for _ in range(self.num_ranks)]) if feedback else None
        if self.per_node is not None:
            total = node_aware_reference(self.codec, self.codec, key_name, deltas, step, self.unit,
                                         self.per_node, residuals)
        elif self.kind.endswith("two-stage"):
            owner = self.owner_residuals.setdefault(key_name, [np.zeros(e - b, np.float32) for b, e in
                                                               bounds(numel, self.num_ranks, self.unit)])
            total = two_stage_reference(self.codec, self.codec, key_name, deltas, step, self.unit, residuals,
                                        owner if feedback else None)
        else:
            total = allgather_reference(self.codec, key_name, deltas, step, residuals)
        return total * np.float32(1.0 / self.num_ranks)

    def _average_node_shards(self, key_name, node_deltas, feedback, step):
        numel, nodes, local_size = node_deltas[0].size, len(node_deltas), self.per_node
        shard = -(-numel // (local_size * self.unit)) * self.unit
        padded = [np.concatenate([d, np.zeros(local_size * shard - numel, np.float32)]) for d in node_deltas]
        total = np.zeros(local_size * shard, np.float32)
        for j in range(local_size):
            name = f"{key_name}.shard{j}"
            residuals = self.residuals.setdefault(name, [np.zeros(shard, np.float32) for _ in range(nodes)]) \
                if feedback else None
            parts = [p[j * shard:(j + 1) * shard] for p in padded]
            total[j * shard:(j + 1) * shard] = allgather_reference(self.codec, name, parts, step, residuals) \
                * np.float32(1.0 / nodes)
        return total[:numel]

    def outer_step(self, steps, groups=None):
        """The models (concatenated in SIZES' order) after the local steps ``steps`` on every rank and one outer
        step of ``groups`` (default: every group; streaming DiLoCo: a fragment's). With ``kind="none"`` the
        average is the exact mean (the exchange's float32 sum has its own order: compare with a tolerance)."""
        for key_name, names in self.groups if groups is None else groups:
            anchor = np.concatenate([self.anchor[n] for n in names])
            deltas = []
            for rank in range(self.num_ranks):
                local = [self.anchor[n].copy() for n in names]
                for step in steps:
                    g = grads(rank, step) if self.per_node is None else node_average(rank, step, self.per_node)
                    local = [x - g[n] for x, n in zip(local, names)]
                deltas.append(anchor - np.concatenate(local))
            if self.codec is None:
                averaged = np.mean(np.stack(deltas).astype(np.float64), 0).astype(np.float32)
            else:
                averaged = self._average(key_name, deltas)
            mu, lr = self.outer_momentum, self.outer_lr
            offset = 0
            for n in names:
                part = averaged[offset:offset + SIZES[n]]
                offset += SIZES[n]
                self.momentum[n] = self.momentum[n] * mu + part
                self.anchor[n] = self.anchor[n] - (self.momentum[n] * mu + part) * lr
        return np.concatenate([self.anchor[n] for n in SIZES])


def check_streaming(opt, module, rank, reference, fragment_groups, gathered, kind):
    """Streaming DiLoCo with ``sync_every=4, fragments=2`` over 12 steps: fragment 0 (SIZES' "a") takes its outer
    step after steps 2, 6 and 10, fragment 1 ("b") after 4, 8 and 12, each on the local steps since its own last
    one; after each, that fragment bitwise the reference on every rank and the other still each rank's own.
    ``gathered(label)``: every rank's model (SIZES' order), one row per rank. Returns the optimizer's stats."""
    spans = {0: (0, SIZES["a"]), 1: (SIZES["a"], SIZES["a"] + SIZES["b"])}
    due, last = {2: 0, 0: 1}, {0: 0, 1: 0}
    for count in range(1, 13):
        local_steps(opt, module, rank, [count - 1])
        fragment = due.get(count % 4)
        if fragment is None:
            continue
        want = reference.outer_step(range(last[fragment], count), [fragment_groups[fragment]])
        last[fragment] = count
        everyone = gathered(f"{kind}.{count}")
        (begin, end), (other_begin, other_end) = spans[fragment], spans[1 - fragment]
        assert_every_rank_holds(everyone[:, begin:end], want[begin:end], kind, (kind, count, fragment))
        others = everyone[:, other_begin:other_end]
        assert not all(bool((others[0] == row).all()) for row in others[1:]), (kind, count, "the other fragment")
    assert opt.outer_steps == 6
    return opt.compression_stats()
