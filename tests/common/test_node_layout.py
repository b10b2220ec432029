"""The node-aware exchange's layout and residual placement, one process (its exchange: tests/test_node_aware.py)."""
import warnings

import numpy as np
import pytest

from horovod_qsgd.common.chunks import chunk_bounds, node_owner_chunk, saved_owner_chunk, shard_numel
from horovod_qsgd.common.node_aware import NodeLayout, job_nodes


def _records(nodes):
    """Horovod's (local rank, local size, cross rank, cross size) of ranks numbered node by node."""
    records = []
    for node, size in enumerate(nodes):
        for local in range(size):
            cross = [k for k, s in enumerate(nodes) if s > local]
            records.append((local, size, cross.index(node), len(cross)))
    return records


def test_layout_of_equal_nodes_names_every_rank_alike():
    records = _records([3, 3])
    for rank in range(6):
        layout, why_not = NodeLayout.from_records(records, rank)
        assert why_not is None
        assert (layout.num_nodes, layout.local_size, layout.node, layout.local_rank) == (2, 3, rank // 3, rank % 3)
        assert list(layout.local_ranks()) == [3 * (rank // 3) + j for j in range(3)]
        assert list(layout.cross_ranks()) == [rank % 3, 3 + rank % 3]
    layout = NodeLayout.from_records(records, 4)[0]
    assert layout.in_node_splits(7) == [0, 0, 0, 7, 7, 7]
    assert layout.cross_splits([5, 9]) == [0, 5, 0, 0, 9, 0]


def test_a_layout_of_nodes_grouped_in_any_order_names_its_peers_by_rank():
    # torch.distributed's adapters group ranks by host as they find them (DistributedNodes): here the
    # even ranks share one node, the odd ones the other
    members = [[0, 2, 4], [1, 3, 5]]
    layout = NodeLayout.of_members(members, 3)
    assert (layout.num_nodes, layout.local_size, layout.node, layout.local_rank) == (2, 3, 1, 1)
    assert list(layout.local_ranks()) == [1, 3, 5] and list(layout.cross_ranks()) == [2, 3]
    assert layout.in_node_splits(7) == [0, 7, 0, 7, 0, 7]
    assert layout.cross_splits([8, 9]) == [0, 0, 8, 9, 0, 0]
    assert layout.as_list() == [2, 3, 1, 1]
    numbered = NodeLayout(2, 3, 1, 1)  # Horovod's: node by node
    assert list(numbered.local_ranks()) == [3, 4, 5] and list(numbered.cross_ranks()) == [1, 4]


def test_layouts_without_a_node_aware_exchange_say_why():
    assert "differ in size ([1, 2] ranks)" in NodeLayout.from_records(_records([2, 1]), 0)[1]
    assert "1 node(s) of 4 rank(s)" in NodeLayout.from_records(_records([4]), 0)[1]
    assert "4 node(s) of 1 rank(s)" in NodeLayout.from_records(_records([1, 1, 1, 1]), 0)[1]
    shuffled = _records([2, 2])
    shuffled[1], shuffled[2] = shuffled[2], shuffled[1]  # ranks 1 and 2 on each other's nodes
    assert "not numbered node by node" in NodeLayout.from_records(shuffled, 0)[1]


def test_unequal_nodes_fall_back_node_blind_with_a_warning_only_where_node_aware_was_asked_for():
    with pytest.warns(UserWarning, match=r"needs several nodes of equal size.*differ in size \(\[1, 2\] ranks\)"
                      r".*node-blind \(as 'auto'\) instead"):
        assert job_nodes(_records([2, 1]), 0, asked=True) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert job_nodes(_records([2, 1]), 0, asked=False) is None  # "auto": silently node-blind
        assert job_nodes(_records([2, 2]), 3, asked=True).as_list() == [2, 2, 1, 1]


def test_an_owner_residual_of_a_node_layout_lands_at_its_chunk_of_its_shard():
    numel, unit = 10_000, 512
    shard = shard_numel(numel, 4, unit)
    assert shard == 5 * 512  # 4 shards of whole buckets, 240 elements of padding
    for node in range(3):
        begin, end = chunk_bounds(shard, 3, unit)[node]
        for local_rank in range(4):
            chunk = node_owner_chunk(numel, unit, [3, 4, node, local_rank], end - begin)
            assert chunk == (min(numel, local_rank * shard + begin), min(numel, local_rank * shard + end))
            assert saved_owner_chunk(numel, unit, [3, 4, node, local_rank], end - begin) == chunk
    assert node_owner_chunk(numel, unit, [3, 4, 0, 0], 7) is None  # not this tensor's chunk
    assert node_owner_chunk(numel, unit, [3, 4, 3, 0], 512) is None  # no such node
    assert node_owner_chunk(numel, unit, [3, 4, 2, 3], 1024) == (9216, 10_000)  # its tail is padding
    assert np.diff(node_owner_chunk(9000, unit, [3, 4, 2, 3], 1024)) == 0  # wholly in the padding: nothing lands


def test_a_fused_node_aware_group_lays_out_its_rows_and_refuses_other_groups():
    from horovod_qsgd.codecs import QSGDCodec
    from horovod_qsgd.common.engine import PayloadEngine
    from horovod_qsgd.common.node_aware import NodeAwareGroup
    from horovod_qsgd.common.stats import CompressionStats
    layout = NodeLayout(2, 2, 1, 0)  # rank 2 of 2 nodes x 2
    engine = PayloadEngine(QSGDCodec(bits=4), QSGDCodec(bits=4), "node_aware", CompressionStats())
    plans = [engine.plan_node_aware(name, numel, layout, 4 * numel) for name, numel in (("a", 5000), ("b", 700))]
    group = NodeAwareGroup(plans)
    assert group.shards == [2560, 512] and group.offsets == [0, 2560]
    assert group.in_node_width() == 2 + 3072
    assert group.in_node_splits() == [0, 0, 3074, 3074]
    assert engine.stats.snapshot()["bytes_sent_in_node"] == 4 * 3074
    assert group.check_in_node([0, 0, 3074, 3074]) is None
    assert "rank(s) [3] of this node sent [3073] elements where this rank's fused row has 3074" in str(
        group.check_in_node([0, 0, 3074, 3073]))
    assert group.check_tags([group.tag, group.tag]) is None
    other = NodeAwareGroup([engine.plan_node_aware(name, numel, layout, 4 * numel)  # same shards, other sizes
                            for name, numel in (("a", 5100), ("b", 600))])
    assert other.shards == group.shards and other.tag != group.tag
    assert "tensors a, b: rank(s) [3] of this node fused other tensors" in str(group.check_tags([group.tag,
                                                                                                other.tag]))
    alone = NodeAwareGroup(plans[:1], fused=False)  # one tensor's own collectives: tagged all the same
    assert alone.in_node_width() == 2 + 2560 and alone.check_tags([alone.tag, alone.tag]) is None
    assert "tensor 'a': rank(s) [3] of this node sent [2561] elements where this rank's row has 2562" in str(
        alone.check_in_node([0, 0, 2562, 2561]))
    shorter = NodeAwareGroup([engine.plan_node_aware("a", 4999, layout, 4 * 4999)], fused=False)  # same shard
    assert shorter.in_node_width() == alone.in_node_width()
    assert "tensor 'a': rank(s) [2] of this node compressed another tensor under this name" in str(
        alone.check_tags([shorter.tag, alone.tag]))


def test_every_rank_decodes_the_compressed_sums_its_node_forwards_bitwise_as_their_own_rank_would():
    """Steps 3-4 on rank 2 of 2 nodes x 2: the bytes local rank j received between nodes (both nodes' payloads
    of shard j), forwarded behind a flag, decode to what local rank j's own plan decodes; a flag set, a row
    too short for its flag, or a refusal notice forwarded make decode_node return the error to raise."""
    from horovod_qsgd.codecs import QSGDCodec
    from horovod_qsgd.common.engine import PayloadEngine
    from horovod_qsgd.common.exchange import refusal_notice
    from horovod_qsgd.common.node_aware import NodeAwareGroup, gather_flag
    from horovod_qsgd.common.stats import CompressionStats
    engine = PayloadEngine(QSGDCodec(bits=4), QSGDCodec(bits=4), "node_aware", CompressionStats())
    numel = 5000

    def plan(node, local_rank):
        return engine.plan_node_aware("a", numel, NodeLayout(2, 2, node, local_rank), 4 * numel)

    shard = plan(0, 0).shard
    rng = np.random.default_rng(0)
    node_sums = {(k, j): rng.standard_normal(shard).astype(np.float32) for k in range(2) for j in range(2)}

    def received(j):  # what local rank j of either node receives from the nodes' allgather of its shard
        parts = []
        for k in range(2):
            cross = plan(k, j).cross
            out = np.zeros(cross.capacity(), np.uint8)
            parts.append(out[:cross.encode(node_sums[k, j].copy(), out, 3)])
        return np.concatenate(parts)

    flag, failed_flag = (np.frombuffer(gather_flag(f), np.uint8) for f in (False, True))
    rows = [np.concatenate([flag, received(j)]) for j in range(2)]
    group = NodeAwareGroup([plan(1, 0)], fused=False)
    assert group.kind == "allgather" and len(rows[0]) == len(rows[1]) > 4
    before = engine.stats.snapshot()["bytes_sent_in_node"]
    assert group.gather_splits(len(rows[0]) - 4) == [0, 0, len(rows[0]), len(rows[0])]
    assert engine.stats.snapshot()["bytes_sent_in_node"] - before == len(rows[0])  # to the other rank of the node
    splits = [0, 0, len(rows[0]), len(rows[1])]
    out = np.zeros(2 * shard, np.float32)
    assert group.decode_node(np.concatenate(rows), splits, [out]) is None
    for j in range(2):
        want = np.zeros(shard, np.float32)
        plan(1, j).cross.decode(received(j), want)
        assert np.abs(want).sum() > 0 and np.array_equal(out[j * shard:(j + 1) * shard], want), j

    error = group.decode_node(np.concatenate([failed_flag, rows[1]]), [0, 0, 4, len(rows[1])], [out])
    assert "tensor 'a' failed between nodes on rank(s) [2] of this node" in str(error)
    error = group.decode_node(np.concatenate([rows[0], flag[:2]]), [0, 0, len(rows[0]), 2], [out])
    assert "rank 3 of this node sent 2 bytes of compressed sums, fewer than the 4-byte flag" in str(error)
    refused = np.concatenate([flag, np.frombuffer(refusal_notice(), np.uint8), received(1)[len(received(1)) // 2:]])
    error = group.decode_node(np.concatenate([rows[0], refused]), [0, 0, len(rows[0]), len(refused)], [out])
    assert "rank 0 found a mismatch" in str(error) and "local rank 1 of node k" in str(error), error


def _node_aware_results(codec, numels, grads, nodes, local_size, fused, spoil=None, first=0):
    """Every rank's results of the node-aware exchange of tensors of ``numels``: each rank's group conducts it
    (``NodeAwareGroup.conduct``), the global alltoalls run in one process (:mod:`tests.common.loopback`):
    {rank: [each tensor's sum]} or {rank: the error}. ``spoil``: a rank whose tensors are one element shorter
    (another model); ``first``: the first tensor's number in its name."""
    from horovod_qsgd.common.collectives import ALLTOALL
    from horovod_qsgd.common.engine import PayloadEngine
    from horovod_qsgd.common.node_aware import NodeAwareGroup
    from horovod_qsgd.common.stats import CompressionStats
    from horovod_qsgd.common.collectives import HostBuffers
    from tests.common.loopback import conduct_all
    groups, conducts = [], []
    for rank in range(nodes * local_size):
        engine = PayloadEngine(codec, codec, "node_aware", CompressionStats())
        layout = NodeLayout(nodes, local_size, rank // local_size, rank % local_size)
        sizes = [n - (rank == spoil) for n in numels]
        plans = [engine.plan_node_aware(f"t{m}", n, layout, 4 * n) for m, n in enumerate(sizes, first)]
        group = NodeAwareGroup(plans, fused=fused)
        rows = [np.array([group.tag[:group.tag_width]] * local_size, np.float32).reshape(local_size, -1)]
        for plan, grad in zip(plans, grads[rank]):  # shard j of every tensor to local rank j, behind the tag
            padded = np.zeros(plan.padded_numel(), np.float32)
            padded[:plan.numel] = grad[:plan.numel]
            rows.append(padded.reshape(local_size, plan.shard))
        none = [None] * len(plans)
        conducts.append(group.conduct(HostBuffers, plans[0].collective_names, np.concatenate(rows, axis=1).reshape(-1),
                                      [1] * len(plans), none, lambda none=none: none))
        groups.append(group)
    asked, returned = conduct_all(conducts, sized=False)
    assert [kind for kind, _, _ in asked] == [ALLTOALL] * (4 if groups[0].kind == "two_stage" else 3)
    # what an adapter that builds its collectives in advance (TensorFlow's graph) is told to expect
    assert [(kind, name) for kind, name, _ in asked] == groups[0].collectives(plans[0].collective_names)
    results = {}
    for rank, (group, (sums, error)) in enumerate(zip(groups, returned)):
        results[rank] = error if error is not None else [out[:plan.numel] for plan, out in zip(group.plans, sums)]
    return results, groups[0].kind


@pytest.mark.parametrize("nodes,local_size,kind", [(2, 2, "allgather"), (3, 2, "two_stage"), (2, 3, "allgather")])
def test_the_steps_of_a_node_aware_exchange_give_every_rank_the_same_sum_fused_or_not(nodes, local_size, kind):
    """The whole exchange through NodeAwareGroup's steps, the collectives simulated: every rank gets the same
    bits, fused the same as alone and as the reference, within QSGD-8's error of the true sum; a rank whose
    tensor is one element shorter (its shards as long) makes every rank of every node fail: none returns a
    result."""
    from horovod_qsgd.codecs import QSGDCodec
    from tests.two_stage_reference import node_aware_reference
    codec = QSGDCodec(bits=8)
    numels = [140_000, 133_001]  # from 3 nodes, shards of 65,536 or more take the two stages between nodes
    rng = np.random.default_rng(nodes * 10 + local_size)
    grads = [[rng.standard_normal(n).astype(np.float32) for n in numels] for _ in range(nodes * local_size)]
    fused, taken = _node_aware_results(codec, numels, grads, nodes, local_size, fused=True)
    assert taken == kind
    for m, numel in enumerate(numels):
        alone, _ = _node_aware_results(codec, [numel], [[g[m]] for g in grads], nodes, local_size, fused=False,
                                        first=m)
        for results, index in ((alone, 0), (fused, m)):
            for rank, result in results.items():
                assert np.array_equal(result[index], alone[0][0]), (rank, m)
        want = node_aware_reference(codec, codec, f"t{m}", [g[m] for g in grads], 1, 512, local_size)
        assert np.array_equal(alone[0][0], want), m  # the codecs alone on the node sums, in local-rank order
        truth = sum(g[m] for g in grads)
        error = np.linalg.norm(alone[0][0] - truth) / np.linalg.norm(truth)
        assert 0 < error < 0.05, (m, error)
    # rank 1's tensors one element shorter: its shards are as long, its digest is not (alone as fused)
    for fuse, what in ((False, "compressed another tensor under this name"), (True, "fused other tensors")):
        failed, _ = _node_aware_results(codec, numels[:2 if fuse else 1], grads, nodes, local_size, fused=fuse,
                                        spoil=1)
        assert all(isinstance(result, Exception) for result in failed.values()), failed
        for rank in range(local_size):  # rank 1 names every other rank of its node, they name rank 1
            named = [1] if rank != 1 else [r for r in range(local_size) if r != 1]
            assert f"rank(s) {named} of this node {what}" in str(failed[rank]), failed[rank]
        for rank in range(local_size, nodes * local_size):  # local rank 1 of node 0 refused; each told the others
            assert "local rank" in str(failed[rank]) and "of node k" in str(failed[rank]), failed[rank]


def test_auto_looks_for_nodes_for_gpu_gradients_of_the_global_group_only():
    """The rule every PyTorch adapter asks (Horovod's and DDP's): 'node_aware' always looks for the nodes in
    the global group; 'auto' only for GPU gradients; the flat exchanges never."""
    from horovod_qsgd.common.node_aware import looks_for_nodes
    table = {(exchange, on_gpu, global_group): looks_for_nodes(exchange, on_gpu, global_group)
             for exchange in ("allgather", "two_stage", "auto", "node_aware")
             for on_gpu in (False, True) for global_group in (False, True)}
    assert {key for key, looks in table.items() if looks} == {
        ("auto", True, True), ("node_aware", False, True), ("node_aware", True, True)}
