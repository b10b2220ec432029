"""A small byte-level transformer language model, written once for PyTorch and TensorFlow.

Architecture (GPT-2's, small): a byte embedding (256 x width) plus a learned
position embedding (context x width); ``layers`` pre-norm blocks of causal
multi-head self-attention and a 4x-wide tanh-GELU MLP, each added to the
residual stream; a final layer norm and an untied output layer (width x 256).
Initial weights are drawn with numpy from the seed as GPT-2 draws them: normal
with std 0.02, the two projections that write into the residual stream scaled
by 1/sqrt(2 layers), biases zero, norm gains one.

``forward`` is written once against a few array operations that both
frameworks provide (``TorchOps``, ``TensorFlowOps``), so the two models are the
same function of the same weights by construction.
"""
import math

import numpy as np

VOCABULARY = 256


def parameter_shapes(width, layers, context):
    """Name -> shape of every parameter, in a fixed order."""
    shapes = {"embedding": (VOCABULARY, width), "position": (context, width)}
    for i in range(layers):
        shapes.update({f"block{i}/norm1/gain": (width,), f"block{i}/norm1/bias": (width,),
                       f"block{i}/attention/qkv": (width, 3 * width), f"block{i}/attention/qkv_bias": (3 * width,),
                       f"block{i}/attention/out": (width, width), f"block{i}/attention/out_bias": (width,),
                       f"block{i}/norm2/gain": (width,), f"block{i}/norm2/bias": (width,),
                       f"block{i}/mlp/in": (width, 4 * width), f"block{i}/mlp/in_bias": (4 * width,),
                       f"block{i}/mlp/out": (4 * width, width), f"block{i}/mlp/out_bias": (width,)})
    shapes.update({"final_norm/gain": (width,), "final_norm/bias": (width,),
                   "head": (width, VOCABULARY), "head_bias": (VOCABULARY,)})
    return shapes


def initial_weights(seed, width, layers, context):
    """Name -> float32 array, drawn from ``seed`` alone."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in parameter_shapes(width, layers, context).items():
        if name.endswith("gain"):
            weights[name] = np.ones(shape, np.float32)
        elif name.endswith("bias"):
            weights[name] = np.zeros(shape, np.float32)
        else:
            std = 0.02 / math.sqrt(2 * layers) if name.endswith(("attention/out", "mlp/out")) else 0.02
            weights[name] = (rng.standard_normal(shape) * std).astype(np.float32)
    return weights


def forward(p, tokens, ops, heads):
    """Logits (batch, length, 256) of the next byte after each position of ``tokens`` (batch, length)."""
    batch, length = ops.shape(tokens)
    width = ops.shape(p["embedding"])[1]
    head_width = width // heads
    layers = sum(1 for name in p if name.endswith("norm1/gain"))
    x = ops.take(p["embedding"], tokens) + p["position"][:length]
    mask = ops.causal_mask(length)
    for i in range(layers):
        h = _layer_norm(x, p[f"block{i}/norm1/gain"], p[f"block{i}/norm1/bias"], ops)
        qkv = h @ p[f"block{i}/attention/qkv"] + p[f"block{i}/attention/qkv_bias"]
        qkv = ops.transpose(ops.reshape(qkv, (batch, length, 3, heads, head_width)), (2, 0, 3, 1, 4))
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = (q @ ops.transpose(k, (0, 1, 3, 2))) * (1.0 / math.sqrt(head_width)) + mask
        attended = ops.transpose(ops.softmax(scores) @ v, (0, 2, 1, 3))
        x = x + ops.reshape(attended, (batch, length, width)) @ p[f"block{i}/attention/out"] \
            + p[f"block{i}/attention/out_bias"]
        h = _layer_norm(x, p[f"block{i}/norm2/gain"], p[f"block{i}/norm2/bias"], ops)
        h = _gelu(h @ p[f"block{i}/mlp/in"] + p[f"block{i}/mlp/in_bias"], ops)
        x = x + h @ p[f"block{i}/mlp/out"] + p[f"block{i}/mlp/out_bias"]
    x = _layer_norm(x, p["final_norm/gain"], p["final_norm/bias"], ops)
    return x @ p["head"] + p["head_bias"]


def _layer_norm(x, gain, bias, ops, eps=1e-5):
    centred = x - ops.mean_last(x)
    return centred * ops.rsqrt(ops.mean_last(centred * centred) + eps) * gain + bias


def _gelu(x, ops):
    return 0.5 * x * (1.0 + ops.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


class TorchOps:
    def __init__(self):
        import torch
        self.torch = torch

    def shape(self, x):
        return tuple(x.shape)

    def take(self, table, indices):
        return table[indices]

    def causal_mask(self, length):
        return self.torch.triu(self.torch.full((length, length), -1e9), diagonal=1)

    def transpose(self, x, perm):
        return x.permute(*perm)

    def reshape(self, x, shape):
        return x.reshape(shape)

    def softmax(self, x):
        return self.torch.softmax(x, dim=-1)

    def mean_last(self, x):
        return x.mean(dim=-1, keepdim=True)

    def rsqrt(self, x):
        return self.torch.rsqrt(x)

    def tanh(self, x):
        return self.torch.tanh(x)


class TensorFlowOps:
    def __init__(self):
        import tensorflow as tf
        self.tf = tf

    def shape(self, x):
        return tuple(int(d) for d in x.shape)

    def take(self, table, indices):
        return self.tf.gather(table, indices)

    def causal_mask(self, length):
        upper = 1.0 - self.tf.linalg.band_part(self.tf.ones((length, length)), -1, 0)
        return upper * -1e9

    def transpose(self, x, perm):
        return self.tf.transpose(x, perm)

    def reshape(self, x, shape):
        return self.tf.reshape(x, shape)

    def softmax(self, x):
        return self.tf.nn.softmax(x, axis=-1)

    def mean_last(self, x):
        return self.tf.reduce_mean(x, axis=-1, keepdims=True)

    def rsqrt(self, x):
        return self.tf.math.rsqrt(x)

    def tanh(self, x):
        return self.tf.tanh(x)
