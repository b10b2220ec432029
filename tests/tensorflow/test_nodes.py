"""TensorFlow's node-aware exchange across "nodes" (network namespaces, ``benchmarks/nodelab.py``).

The same bits as the codecs-alone reference and as ``horovod_qsgd.torch`` on
the same ranks; top-k's residuals through a checkpoint; a mismatch refused on
every rank of every node.
"""
import numpy as np
import pytest

from tests.two_stage_reference import bounds, gradient, node_aware_reference


@pytest.mark.parametrize("nodes, per_node", [
    pytest.param(2, 2, marks=pytest.mark.ranks(4, timeout=300, launcher="nodes:2x2")),
    pytest.param(3, 2, marks=pytest.mark.ranks(6, timeout=400, launcher="nodes:3x2"))])
def test_node_aware_in_tensorflow_is_the_reference_and_the_torch_adapters_result(nodes, per_node, hvd_tf):
    import tensorflow as tf
    import torch
    import horovod.torch as hvd_torch
    from horovod_qsgd.codecs import QSGDCodec, TopKCodec
    import horovod_qsgd.tensorflow as tf_adapter
    import horovod_qsgd.torch as torch_adapter
    hvd, ranks = hvd_tf, nodes * per_node
    hvd_torch.init()
    rank = hvd.rank()
    assert (hvd.local_size(), hvd.cross_size()) == (per_node, nodes)
    numel = 200_003  # shards above the two stages' threshold: 3 nodes take them
    grads = [gradient(r, numel) for r in range(ranks)]
    qsgd = tf_adapter.QSGD(bits=4, exchange="node_aware", min_numel=0)

    @tf.function
    def grouped(x):  # three in one graph: their steps interleave as the executor finds them ready
        # (inside tf.function the tensors are named by their ops: autograph hides grouped_allreduce's list)
        return hvd.grouped_allreduce([tf.identity(x * (i + 1), name=f"w.{i}") for i in range(3)], name="w",
                                     op=hvd.Sum, compression=qsgd)

    got = grouped(tf.constant(grads[rank]))
    twin = torch_adapter.QSGD(bits=4, exchange="node_aware", min_numel=0)
    from_torch = hvd_torch.grouped_allreduce([torch.from_numpy(grads[rank] * (i + 1)) for i in range(3)], name="w",
                                             op=hvd_torch.Sum, compression=twin)
    for i in range(3):
        want = node_aware_reference(QSGDCodec(bits=4), QSGDCodec(bits=4), f"w.{i}", [g * (i + 1) for g in grads], 0,
                                    512, per_node)
        assert np.array_equal(got[i].numpy(), want), i
        assert np.array_equal(from_torch[i].numpy(), want), i
    stats = qsgd.compression_stats()
    shard = -(-numel // (per_node * 512)) * 512
    assert stats["exchanges"] == {f"w.{i}": "node_aware" for i in range(3)}
    assert stats["bytes_sent_in_node"] == twin.compression_stats()["bytes_sent_in_node"]
    assert stats["bytes_sent_in_node"] == 3 * 4 * (2 * shard + 1) * (per_node - 1)
    assert stats["collectives_started"] == 3 * (3 if nodes == 2 else 4)

    codec = TopKCodec(ratio=0.01)
    residuals = [np.zeros(numel, np.float32) for _ in range(ranks)]
    owners = [np.zeros(np.subtract(*bounds(-(-numel // per_node), nodes, 1)[r // per_node][::-1]), np.float32)
              for r in range(ranks)]

    def traced_top_k(compressor):
        return tf.function(lambda x: hvd.allreduce(x, name="t", op=hvd.Sum, compression=compressor))

    topk = tf_adapter.TopK(ratio=0.01, exchange="node_aware")
    step_fn = traced_top_k(topk)
    for step in range(4):
        if step == 2:  # resumed from a checkpoint: the same bits go on
            saved = topk.state_dict()
            topk = tf_adapter.TopK(ratio=0.01, exchange="node_aware")
            topk.load_state_dict(saved)
            step_fn = traced_top_k(topk)
        grads = [gradient(r, numel, step) for r in range(ranks)]
        result = step_fn(tf.constant(grads[rank])).numpy()
        want = node_aware_reference(codec, codec, "t", grads, step, 1, per_node, residuals,
                                    owners if nodes > 2 else None)
        assert np.array_equal(result, want), step
    kept = topk.state_dict()["tensors"]["t"]
    assert np.array_equal(kept["residual"], residuals[rank])
    assert np.abs(residuals[rank]).sum() > 0
    if nodes > 2:
        assert kept["owner_layout"] == [nodes, per_node, rank // per_node, rank % per_node]
        assert np.array_equal(kept["owner_residual"], owners[rank])

    length = numel + (4096 if rank == ranks - 1 else 0)  # the last rank's tensor is longer
    with pytest.raises(Exception, match="horovod_qsgd: tensor 'odd"):
        hvd.allreduce(tf.ones(length), name="odd", op=hvd.Sum,
                      compression=tf_adapter.QSGD(exchange="node_aware"))
