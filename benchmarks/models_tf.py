"""TensorFlow twins of benchmarks/models_torch.py: the same layers and parameter counts, no Keras needed.

Plain ``tf.Module``\\ s with ``tf.Variable``\\ s (named like the layers, e.g.
``"fc1/kernel"``), so the benchmark runs the same with tf-keras or Keras 3
installed. Images are NHWC (TensorFlow's CPU layout); parameter counts equal
the PyTorch models' (mlp25m 25.2M, mlp10m 9.9M, deep5m 5.0M, cnn 2.4M).
"""
import numpy as np
import tensorflow as tf

# Layer widths, equal to benchmarks.models_torch.MLP_WIDTHS (not imported: that module imports torch).
MLP_WIDTHS = {"mlp25m": (1024, 4096, 4096, 1000), "mlp10m": (1024, 2048, 2560, 1000),
              "deep5m": (1024,) + (512,) * 16 + (1000,)}
CNN_CHANNELS = (3, 64, 128, 128)
CNN_HIDDEN = 256
CNN_CLASSES = 10


def _uniform(rng, shape, fan_in):
    bound = 1.0 / np.sqrt(fan_in)  # torch.nn.Linear / Conv2d's default range
    return rng.uniform(-bound, bound, shape).astype(np.float32)


class _Dense(tf.Module):
    def __init__(self, rng, fan_in, fan_out, name):
        super().__init__(name=name)
        self.kernel = tf.Variable(_uniform(rng, (fan_in, fan_out), fan_in), name=f"{name}/kernel")
        self.bias = tf.Variable(_uniform(rng, (fan_out,), fan_in), name=f"{name}/bias")

    def __call__(self, x):
        return x @ self.kernel + self.bias


class _Conv(tf.Module):
    def __init__(self, rng, c_in, c_out, name):
        super().__init__(name=name)
        self.kernel = tf.Variable(_uniform(rng, (3, 3, c_in, c_out), 9 * c_in), name=f"{name}/kernel")
        self.bias = tf.Variable(_uniform(rng, (c_out,), 9 * c_in), name=f"{name}/bias")

    def __call__(self, x):
        return tf.nn.conv2d(x, self.kernel, strides=1, padding="SAME") + self.bias


class MLP(tf.Module):
    def __init__(self, widths, seed=0):
        super().__init__(name="mlp")
        rng = np.random.default_rng(seed)
        self.layers = [_Dense(rng, a, b, f"fc{i}") for i, (a, b) in enumerate(zip(widths[:-1], widths[1:]))]

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = tf.nn.relu(layer(x))
        return self.layers[-1](x)


class CNN(tf.Module):
    def __init__(self, seed=0):
        super().__init__(name="cnn")
        rng = np.random.default_rng(seed)
        c = CNN_CHANNELS
        self.convs = [_Conv(rng, c[i], c[i + 1], f"conv{i}") for i in range(3)]
        self.fc = [_Dense(rng, c[-1] * 8 * 8, CNN_HIDDEN, "fc0"), _Dense(rng, CNN_HIDDEN, CNN_CLASSES, "fc1")]

    def __call__(self, x):
        x = tf.nn.relu(self.convs[0](x))
        x = tf.nn.max_pool2d(tf.nn.relu(self.convs[1](x)), 2, 2, "VALID")
        x = tf.nn.max_pool2d(tf.nn.relu(self.convs[2](x)), 2, 2, "VALID")
        x = tf.reshape(x, [tf.shape(x)[0], -1])
        return self.fc[1](tf.nn.relu(self.fc[0](x)))


def build_model(name, seed=0):
    if name in MLP_WIDTHS:
        return MLP(MLP_WIDTHS[name], seed)
    if name == "cnn":
        return CNN(seed)
    raise ValueError(f"unknown model {name!r}; choose one of {sorted(MLP_WIDTHS) + ['cnn']}")


def input_shape(name):
    return (MLP_WIDTHS[name][0],) if name in MLP_WIDTHS else (32, 32, 3)


def num_classes(name):
    return MLP_WIDTHS[name][-1] if name in MLP_WIDTHS else CNN_CLASSES
