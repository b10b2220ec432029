"""The exchanges under Horovod across network-namespace "nodes" (``benchmarks/nodelab.py``), as on a cluster.

Horovod sees M hosts of L ranks. The node-aware exchange: every result
compared bitwise with the codecs-alone reference (``node_aware_reference``),
PyTorch's and TensorFlow's adapters side by side. The flat two stages, whose
collectives now cross a NIC, give every rank the reference's bits as on one
host. Tests of one layout share a launch.
"""
import io

import numpy as np
import pytest

from tests.two_stage_reference import bounds, gradient, node_aware_reference, reference

SHARED_LAUNCHES = True  # tests with the same layout run in one launch (tests/multirank.py)


@pytest.mark.parametrize("nodes, per_node", [
    pytest.param(2, 2, marks=pytest.mark.ranks(4, timeout=300, launcher="nodes:2x2")),
    pytest.param(3, 2, marks=pytest.mark.ranks(6, timeout=400, launcher="nodes:3x2"))])
def test_node_aware_is_the_node_sums_exchanged_between_nodes_in_both_frameworks(nodes, per_node, hvd_tf, hvd_torch):
    """exchange='node_aware': QSGD (three tensors in flight) and top-k over 4 steps with its residuals through a
    checkpoint, bitwise the reference on every rank in both adapters (2 nodes: the nodes' allgather; 3 nodes:
    their two stages); the same bytes in both, unfused and fused (TensorFlow: a grouped call's tensors, top-k's
    residuals included); the bytes kept in the node and the collectives as the formula
    says; 'auto' node-blind on CPU; a tensor whose length differs on one rank, by a shard or by one element,
    refused on every rank."""
    import tensorflow as tf
    import torch
    from horovod_qsgd.codecs import QSGDCodec, TopKCodec
    import horovod_qsgd.tensorflow as tf_adapter
    import horovod_qsgd.torch as torch_adapter
    hvd, ranks = hvd_tf, nodes * per_node
    rank = hvd.rank()
    assert (hvd.size(), hvd.local_size(), hvd.cross_size()) == (ranks, per_node, nodes)
    assert (hvd.local_rank(), hvd.cross_rank()) == (rank % per_node, rank // per_node)
    numel = 200_003  # shards above the two stages' threshold: 3 nodes take them
    grads = [gradient(r, numel) for r in range(ranks)]

    # unfused (fusion_threshold=0), the two adapters' wires are the same
    qsgd = tf_adapter.QSGD(bits=4, exchange="node_aware", min_numel=0, fusion_threshold=0)
    twin = torch_adapter.QSGD(bits=4, exchange="node_aware", min_numel=0, fusion_threshold=0)

    def grouped(compressor):
        @tf.function
        def call(x):  # three in one graph: unfused, their steps interleave as the executor finds them ready
            # (inside tf.function the tensors are named by their ops: autograph hides grouped_allreduce's list)
            return hvd.grouped_allreduce([tf.identity(x * (i + 1), name=f"w.{i}") for i in range(3)], name="w",
                                         op=hvd.Sum, compression=compressor)
        return call

    got = grouped(qsgd)(tf.constant(grads[rank]))
    # PyTorch: one grouped call compresses all three before it waits, so their steps interleave too
    from_torch = hvd_torch.grouped_allreduce([torch.from_numpy(grads[rank] * (i + 1)) for i in range(3)], name="w",
                                             op=hvd_torch.Sum, compression=twin)
    # TensorFlow's default fuses a grouped call: one collective per step for the three
    tf_fused = tf_adapter.QSGD(bits=4, exchange="node_aware", min_numel=0)
    fused_got = grouped(tf_fused)(tf.constant(grads[rank]))
    for i in range(3):
        want = node_aware_reference(QSGDCodec(bits=4), QSGDCodec(bits=4), f"w.{i}", [g * (i + 1) for g in grads], 0,
                                    512, per_node)
        assert np.array_equal(got[i].numpy(), want), i
        assert np.array_equal(from_torch[i].numpy(), want), i
        assert np.array_equal(fused_got[i].numpy(), want), i
    shard = -(-numel // (per_node * 512)) * 512
    # in the node: the shards at full precision, then a flag and the compressed sums between nodes (QSGD's
    # payload sizes are fixed): the nodes' payloads of the shard (2 nodes), the owners' sums of its chunks (3)
    between = QSGDCodec(bits=4).max_payload_nbytes
    received = 2 * between(shard) if nodes == 2 else sum(between(e - b) for b, e in bounds(shard, nodes, 512))
    flag, tag = 4, 2  # step 1's rows start with a digest of the tensors' names and sizes (2 floats)
    for stats in (qsgd.compression_stats(), twin.compression_stats()):
        assert stats["exchanges"] == {f"w.{i}": "node_aware" for i in range(3)}
        assert stats["bytes_sent_in_node"] == 3 * (4 * (shard + tag) + flag + received) * (per_node - 1)
        assert stats["collectives_started"] == 3 * (3 if nodes == 2 else 4)  # in the node, between (1 or 2), back
    assert qsgd.compression_stats()["bytes_sent"] == twin.compression_stats()["bytes_sent"]

    # fused (PyTorch's default): one collective per step for the three, the same bits, over three rounds (the
    # later ones start the group the first learned as soon as its last member is compressed)
    fused = torch_adapter.QSGD(bits=4, exchange="node_aware", min_numel=0)
    for step in range(3):
        grads = [gradient(r, numel, step) for r in range(ranks)]
        from_torch = hvd_torch.grouped_allreduce([torch.from_numpy(grads[rank] * (i + 1)) for i in range(3)],
                                                 name="w", op=hvd_torch.Sum, compression=fused)
        for i in range(3):
            want = node_aware_reference(QSGDCodec(bits=4), QSGDCodec(bits=4), f"w.{i}", [g * (i + 1) for g in grads],
                                        step, 512, per_node)
            assert np.array_equal(from_torch[i].numpy(), want), (step, i)
    stats, alone = fused.compression_stats(), twin.compression_stats()
    assert stats["collectives_started"] == 3 * (3 if nodes == 2 else 4)
    # TensorFlow's fused group is PyTorch's, byte for byte (one round against three)
    tf_stats = tf_fused.compression_stats()
    for key in ("collectives_started", "bytes_sent", "bytes_sent_in_node"):
        assert 3 * tf_stats[key] == stats[key], key
    # step 1: one digest for the group; step 3 forwards a manifest per part received between nodes
    assert stats["bytes_sent_in_node"] == 3 * (4 * (3 * shard + tag) + flag + 3 * received + 16 * nodes) * (
        per_node - 1)
    manifests = 16 * nodes if nodes > 2 else 16  # one per owner and stage between 3 nodes; one part between 2
    assert stats["bytes_sent"] == 3 * (alone["bytes_sent"] + manifests)  # QSGD's payload sizes are fixed

    # a tensor of more than NODE_AWARE_GROUP_NBYTES of fp32 is a group of its own (it starts as soon as it is
    # compressed); the small ones still share one: two groups' collectives per round, the same bits
    from horovod_qsgd.common.node_aware import NODE_AWARE_GROUP_NBYTES
    sizes = (NODE_AWARE_GROUP_NBYTES // 4 + 1, 20_000, 30_000)
    split = torch_adapter.QSGD(bits=4, exchange="node_aware", min_numel=0)
    for step in range(2):
        xs = [[gradient(r, n, step) for r in range(ranks)] for n in sizes]
        from_torch = hvd_torch.grouped_allreduce([torch.from_numpy(x[rank]) for x in xs], name="s",
                                                 op=hvd_torch.Sum, compression=split)
        want = node_aware_reference(QSGDCodec(bits=4), QSGDCodec(bits=4), "s.0", xs[0], step, 512, per_node)
        assert np.array_equal(from_torch[0].numpy(), want), step
    # the big one's shards take the nodes' two stages between 3 nodes, the small ones' their allgather
    assert split.compression_stats()["collectives_started"] == 2 * ((3 if nodes == 2 else 4) + 3)
    # two small tensors whose shards take another exchange between 3 nodes each are two groups, not one
    # (a NodeAwareGroup takes one kind: fused, they had raised on every rank)
    sizes, mixed = (20_000, 200_003), torch_adapter.QSGD(bits=4, exchange="node_aware", min_numel=0)
    tf_mixed = tf_adapter.QSGD(bits=4, exchange="node_aware", min_numel=0)
    xs = [[gradient(r, n) for r in range(ranks)] for n in sizes]
    from_torch = hvd_torch.grouped_allreduce([torch.from_numpy(x[rank]) for x in xs], name="m", op=hvd_torch.Sum,
                                             compression=mixed)
    from_tf = tf.function(lambda a, b: hvd.grouped_allreduce(
        [tf.identity(a, name="m.0"), tf.identity(b, name="m.1")], name="m", op=hvd.Sum, compression=tf_mixed))(
        *(tf.constant(x[rank]) for x in xs))
    for i, x in enumerate(xs):
        want = node_aware_reference(QSGDCodec(bits=4), QSGDCodec(bits=4), f"m.{i}", x, 0, 512, per_node)
        assert np.array_equal(from_torch[i].numpy(), want), i
        assert np.array_equal(from_tf[i].numpy(), want), i
    for compressor in (mixed, tf_mixed):
        assert compressor.compression_stats()["collectives_started"] == (3 if nodes == 2 else 4 + 3)

    codec = TopKCodec(ratio=0.01)
    residuals = [np.zeros(numel, np.float32) for _ in range(ranks)]
    owners = [np.zeros(np.subtract(*bounds(-(-numel // per_node), nodes, 1)[r // per_node][::-1]), np.float32)
              for r in range(ranks)]

    def traced(compressor):
        return tf.function(lambda x: hvd.allreduce(x, name="t", op=hvd.Sum, compression=compressor))

    tf_topk = tf_adapter.TopK(ratio=0.01, exchange="node_aware")
    torch_topk = torch_adapter.TopK(ratio=0.01, exchange="node_aware")  # fused: a group of one
    tf_step = traced(tf_topk)
    for step in range(4):
        if step == 2:  # resumed from a checkpoint: the same bits go on
            saved = tf_topk.state_dict()
            tf_topk = tf_adapter.TopK(ratio=0.01, exchange="node_aware")
            tf_topk.load_state_dict(saved)
            tf_step = traced(tf_topk)
            buffer = io.BytesIO()
            torch.save(torch_topk.state_dict(), buffer)
            buffer.seek(0)
            torch_topk = torch_adapter.TopK(ratio=0.01, exchange="node_aware")
            torch_topk.load_state_dict(torch.load(buffer, weights_only=False))
        grads = [gradient(r, numel, step) for r in range(ranks)]
        from_tf = tf_step(tf.constant(grads[rank])).numpy()
        from_torch = hvd_torch.allreduce(torch.from_numpy(grads[rank]), name="t", op=hvd_torch.Sum,
                                         compression=torch_topk).numpy()
        want = node_aware_reference(codec, codec, "t", grads, step, 1, per_node, residuals,
                                    owners if nodes > 2 else None)
        assert np.array_equal(from_tf, want), step
        assert np.array_equal(from_torch, want), step
    assert np.abs(residuals[rank]).sum() > 0
    for kept in (tf_topk.state_dict()["tensors"]["t"], torch_topk.state_dict()["tensors"]["t"]):
        assert np.array_equal(np.asarray(kept["residual"]), residuals[rank])
        if nodes > 2:
            assert kept["owner_layout"] == [nodes, per_node, rank // per_node, rank % per_node]
            assert np.array_equal(np.asarray(kept["owner_residual"]), owners[rank])
    gathered = hvd.allgather(tf.constant(from_tf.reshape(1, -1)), name="check").numpy()
    assert all(np.array_equal(gathered[0], gathered[r]) for r in range(ranks))

    # TensorFlow, a grouped call of two top-k tensors fused, three steps: their residuals (and from 3 nodes the
    # owners') go on as the reference's
    sizes = (numel, 70_001)
    kept = [[np.zeros(n, np.float32) for _ in range(ranks)] for n in sizes]
    kept_owners = [[np.zeros(np.subtract(*bounds(-(-n // per_node), nodes, 1)[r // per_node][::-1]), np.float32)
                    for r in range(ranks)] for n in sizes]
    tf_grouped_topk = tf_adapter.TopK(ratio=0.01, exchange="node_aware")

    @tf.function
    def grouped_topk(x, y):
        return hvd.grouped_allreduce([tf.identity(x, name="g.0"), tf.identity(y, name="g.1")], name="g",
                                     op=hvd.Sum, compression=tf_grouped_topk)

    for step in range(3):
        xs = [[gradient(r, n, step + 10 * i) for r in range(ranks)] for i, n in enumerate(sizes)]
        got = grouped_topk(tf.constant(xs[0][rank]), tf.constant(xs[1][rank]))
        for i in range(2):
            want = node_aware_reference(codec, codec, f"g.{i}", xs[i], step, 1, per_node, kept[i],
                                        kept_owners[i] if nodes > 2 else None)
            assert np.array_equal(got[i].numpy(), want), (step, i)
    # between 3 nodes the larger one's shards take the nodes' two stages, the other's their allgather: two groups
    assert tf_grouped_topk.compression_stats()["collectives_started"] == 3 * (3 if nodes == 2 else 4 + 3)
    for i in range(2):
        state = tf_grouped_topk.state_dict()["tensors"][f"g.{i}"]
        assert np.array_equal(np.asarray(state["residual"]), kept[i][rank]), i
        if nodes > 2 and i == 0:  # the one whose shards took the nodes' two stages
            assert np.array_equal(np.asarray(state["owner_residual"]), kept_owners[i][rank]), i

    # PyTorch's optimizer (hooks in any order on each rank), three steps: fused and unfused train bitwise alike
    def train(compressor):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256, bias=False), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 128, bias=False))
        opt = hvd_torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             named_parameters=model.named_parameters(), compression=compressor)
        for step in range(3):
            data = torch.randn(8, 64, generator=torch.Generator().manual_seed(10 * rank + step))
            opt.zero_grad()
            model(data).square().mean().backward()
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), compressor.compression_stats()

    fused_params, fused_stats = train(torch_adapter.TopK(ratio=0.01, exchange="node_aware"))
    params, unfused_stats = train(torch_adapter.TopK(ratio=0.01, exchange="node_aware", fusion_threshold=0))
    assert torch.equal(fused_params, params)
    # both weights in one group a step; shards this small take the nodes' allgather also between 3 nodes
    assert fused_stats["collectives_started"] == 3 * 3
    assert unfused_stats["collectives_started"] == 2 * fused_stats["collectives_started"]

    # "auto" keeps CPU tensors node-blind (measured slower node-aware here), in both frameworks
    auto, torch_auto = tf_adapter.QSGD(bits=4, min_numel=0), torch_adapter.QSGD(bits=4, min_numel=0)
    hvd.allreduce(tf.constant(grads[rank]), name="a", op=hvd.Sum, compression=auto)
    hvd_torch.allreduce(torch.from_numpy(grads[rank]), name="a", op=hvd_torch.Sum, compression=torch_auto)
    assert auto.compression_stats()["exchanges"] == torch_auto.compression_stats()["exchanges"] == {"a": "two_stage"}

    length = numel + (4096 if rank == ranks - 1 else 0)  # the last rank's tensor is longer
    with pytest.raises(Exception, match="horovod_qsgd: tensor 'odd"):
        hvd.allreduce(tf.ones(length), name="odd", op=hvd.Sum, compression=tf_adapter.QSGD(exchange="node_aware"))
    with pytest.raises(Exception, match="horovod_qsgd: tensor 'odd"):
        hvd_torch.allreduce(torch.ones(length), name="odd", op=hvd_torch.Sum,
                            compression=torch_adapter.QSGD(exchange="node_aware"))
    # one element more on the last rank: its shards are as long (200,003 and 200,004 elements pad alike), the
    # digest at the head of its row in step 1 is not; alone too (TensorFlow, fusion_threshold=0), on every rank
    assert -(-(numel + 1) // (per_node * 512)) == -(-numel // (per_node * 512))
    near = numel + (1 if rank == ranks - 1 else 0)
    expected = "compressed another tensor under this name" if rank // per_node == nodes - 1 else \
        "horovod_qsgd: tensor 'near"
    with pytest.raises(Exception, match=expected):
        hvd.allreduce(tf.ones(near), name="near", op=hvd.Sum, compression=tf_adapter.QSGD(exchange="node_aware"))
    with pytest.raises(Exception, match=expected):
        hvd_torch.allreduce(torch.ones(near), name="near", op=hvd_torch.Sum,
                            compression=torch_adapter.QSGD(exchange="node_aware", fusion_threshold=0))
    # fused: sizes that differ on the last rank while its row's length does not, refused by the group's
    # digest in its node and by the refusal notices between nodes, on every rank
    delta = 4096 if rank == ranks - 1 else 0
    expected = "fused other tensors with them" if rank // per_node == nodes - 1 else "horovod_qsgd: tensor"
    with pytest.raises(Exception, match=expected):
        hvd_torch.grouped_allreduce([torch.ones(n) for n in (numel, numel + delta, numel - delta)], name="v",
                                    op=hvd_torch.Sum, compression=torch_adapter.QSGD(exchange="node_aware"))
    with pytest.raises(Exception, match=expected):
        hvd.grouped_allreduce([tf.ones(n) for n in (numel, numel + delta, numel - delta)], name="v", op=hvd.Sum,
                              compression=tf_adapter.QSGD(exchange="node_aware"))


@pytest.mark.ranks(4, timeout=240, launcher="nodes:2x2")
def test_two_stages_across_two_nodes_are_the_reference_on_every_rank(hvd_torch):
    import torch
    from horovod_qsgd.codecs import QSGDCodec, TopKCodec
    from horovod_qsgd.torch import QSGD, TopK
    hvd = hvd_torch
    rank = hvd.rank()
    assert (hvd.size(), hvd.local_size(), hvd.cross_size()) == (4, 2, 2)
    assert (hvd.local_rank(), hvd.cross_rank()) == (rank % 2, rank // 2)
    numel = 100_003
    grads = [gradient(r, numel) for r in range(4)]
    qsgd = QSGD(bits=4, exchange="two_stage", min_numel=0)
    result = hvd.allreduce(torch.from_numpy(grads[rank]), name="flat.w", op=hvd.Sum, compression=qsgd)
    want = reference(QSGDCodec(bits=4), QSGDCodec(bits=4), "flat.w", grads, 0, 512)
    assert np.array_equal(result.numpy(), want)

    topk, codec = TopK(ratio=0.01, exchange="two_stage"), TopKCodec(ratio=0.01)
    residuals = [np.zeros(numel, np.float32) for _ in range(4)]
    owners = [np.zeros(e - b, np.float32) for b, e in bounds(numel, 4, 1)]
    for step in range(3):
        grads = [gradient(r, numel, step) for r in range(4)]
        result = hvd.allreduce(torch.from_numpy(grads[rank]), name="flat.t", op=hvd.Sum, compression=topk)
        want = reference(codec, codec, "flat.t", grads, step, 1, residuals, owners)
        assert np.array_equal(result.numpy(), want), step
    gathered = hvd.allgather(result.reshape(1, -1), name="flat.check")
    assert all(torch.equal(gathered[0], gathered[r]) for r in range(4))
