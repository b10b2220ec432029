"""Why the DDP hooks keep parameters apart inside a bucket: QSGD's error per parameter, flat against apart.

    python benchmarks/bucket_boundaries.py [--out benchmarks/results/ddp-hooks/bucket-boundaries.md]

One gradient of the byte-level language model (``benchmarks/byte_lm.py``,
seed 0's initial weights, training batch of step 5, 16 sequences) is laid
out as DDP lays out its bucket (parameters in reverse order of
registration) and quantized by QSGD (``bucket_size`` 512, max norm) two
ways: the whole bucket as one flat tensor, whose 512-coordinate scales span
parameter boundaries, and each parameter on its own, as the hook stages it.
Printed per parameter: the relative error ``||Q(g) - g|| / ||g||``, root mean
square over 10 draws of the stochastic rounding. Parameters below the hooks'
default ``min_numel`` (10,000) are not quantized by the hook at all; the
column says what quantizing them apart would cost.
"""
import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DRAWS = 10


def gradient():
    """[(name, flat fp32 gradient)] in DDP's bucket order."""
    import torch
    from benchmarks import byte_lm
    from benchmarks.stdlib_text import Corpus
    params = {k: torch.nn.Parameter(torch.from_numpy(v)) for k, v in byte_lm.initial_weights(0, 128, 2, 64).items()}
    tokens = torch.from_numpy(Corpus().training_batch(0, 5, 16, 64).astype(np.int64))
    logits = byte_lm.forward(params, tokens[:, :-1], byte_lm.TorchOps(), 4)
    torch.nn.functional.cross_entropy(logits.reshape(-1, byte_lm.VOCABULARY), tokens[:, 1:].reshape(-1)).backward()
    return [(name, params[name].grad.numpy().ravel().astype(np.float32)) for name in reversed(list(params))]


def quantized(codec, x, key):
    out = np.zeros(codec.max_payload_nbytes(x.size), np.uint8)
    used = codec.encode(x, out, step=0, key=key)
    y = np.zeros_like(x)
    codec.decode_accumulate(out[:used], y)
    return y


def relative_errors(codec, grads):
    """{name: (flat, apart)} relative errors."""
    flat = np.concatenate([g for _, g in grads])
    squared = {name: [0.0, 0.0] for name, _ in grads}
    for draw in range(DRAWS):
        y, at = quantized(codec, flat, draw), 0
        for name, g in grads:
            squared[name][0] += float(np.sum((y[at:at + g.size] - g) ** 2))
            squared[name][1] += float(np.sum((quantized(codec, g, 1000 + draw) - g) ** 2))
            at += g.size
    return {name: tuple(np.sqrt(s / (DRAWS * float(np.sum(g ** 2)))) for s in squared[name]) for name, g in grads}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "ddp-hooks",
                                                      "bucket-boundaries.md"))
    args = parser.parse_args()
    from horovod_qsgd.codecs import QSGDCodec
    grads = gradient()
    errors = {bits: relative_errors(QSGDCodec(bits=bits), grads) for bits in (8, 4)}
    lines = ["# QSGD's error per parameter: a DDP bucket quantized flat, or its parameters apart", "",
             __doc__.split("\n\n", 2)[2].strip(), "", "```bash", "python benchmarks/bucket_boundaries.py", "```", "",
             "| parameter | elements | QSGD-8 flat | QSGD-8 apart | QSGD-4 flat | QSGD-4 apart |",
             "|---|---|---|---|---|---|"]
    for name, g in grads:
        cells = " | ".join(f"{errors[bits][name][i]:.3f}" for bits in (8, 4) for i in (0, 1))
        lines.append(f"| `{name}` | {g.size} | {cells} |")
    for bits in (8, 4):
        worst = max(errors[bits], key=lambda n: errors[bits][n][0])
        lines.append(f"\nQSGD-{bits}: worst flat `{worst}` {errors[bits][worst][0]:.2f} (apart "
                     f"{errors[bits][worst][1]:.3f}); worst apart {max(e[1] for e in errors[bits].values()):.3f}.")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
