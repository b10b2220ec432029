"""Synthetic TensorFlow benchmark in the style of Horovod's tensorflow2_synthetic_benchmark.py.

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/tensorflow_synthetic_benchmark.py \\
        --model mlp25m --compression qsgd --bits 4

The flags and the ``--json-out`` record are those of
benchmarks/pytorch_synthetic_benchmark.py (``framework: "tensorflow"``), so
benchmarks/compare.py runs either with ``--frameworks``. A step is
``hvd.DistributedGradientTape`` with ``compression=`` inside ``tf.function``
plus an SGD update (``--groups``: its ``groups=``, under which a grouped
call's two-stage tensors share their collectives); the models (benchmarks/models_tf.py) have the PyTorch
models' layers and parameter counts.
"""
import os
import sys

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import horovod_qsgd.tensorflow as adapter  # noqa: E402
from benchmarks import synthetic  # noqa: E402
from benchmarks.models_tf import build_model, input_shape, num_classes  # noqa: E402


def main(argv=None):
    args = synthetic.parse_args(__doc__.split("\n\n")[0], argv)
    hvd.init()
    model = build_model(args.model)
    variables = list(model.trainable_variables)
    compression = synthetic.make_compression(args, adapter)
    hvd.broadcast_variables(variables, root_rank=0)
    rng = np.random.default_rng(hvd.rank())
    data = tf.constant(rng.standard_normal((args.batch_size, *input_shape(args.model))).astype(np.float32))
    target = tf.constant(rng.integers(0, num_classes(args.model), args.batch_size).astype(np.int32))

    @tf.function
    def train_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(target, model(data)))
        if not args.local_only:
            tape = hvd.DistributedGradientTape(tape, compression=compression, groups=args.groups)
        for v, g in zip(variables, tape.gradient(loss, variables)):
            v.assign_sub(0.01 * g)

    synthetic.run(args, synthetic.Job(
        framework="tensorflow", rank=hvd.rank(), size=hvd.size(),
        num_params=sum(int(np.prod(v.shape)) for v in variables), compression=compression,
        step=train_step, barrier=lambda: hvd.allreduce(tf.zeros([1]), name="benchmark.barrier"),
        sum_over_ranks=lambda name, value: float(hvd.allreduce(tf.constant(value, dtype=tf.float64),
                                                               op=hvd.Sum, name=name).numpy())))


if __name__ == "__main__":
    main()
