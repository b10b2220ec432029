"""The parameter shapes of two real models, for the launch budget (no model is downloaded).

``resnet50()`` follows torchvision's ``resnet50()`` (bottleneck blocks [3, 4, 6, 3], widths 64..512,
expansion 4, a downsample convolution and batch norm in each layer's first block, 1000 classes): 161
tensors, 25,557,032 parameters. ``gpt2_small()`` follows Hugging Face's ``GPT2Model`` for ``gpt2``
(12 layers, width 768, vocabulary 50,257, 1,024 positions; Conv1D weights stored [in, out]): 148 tensors,
124,439,808 parameters. tests/kernels/test_model_shapes.py checks both totals; the launch budget
(tests/kernels/test_host_transfers.py) and benchmarks/gpu_step_cost.py use them.
"""


MIN_NUMEL = 10_000  # the compressors' default: smaller gradients are not compressed


def compressed(shapes, min_numel=MIN_NUMEL):
    """[(name, numel)] of the shapes the compressors compress, sorted by name (as fusion groups them)."""
    return sorted((name, _numel(shape)) for name, shape in shapes if _numel(shape) >= min_numel)


def _numel(shape):
    total = 1
    for dim in shape:
        total *= dim
    return total


def resnet50():
    shapes = [("conv1.weight", (64, 3, 7, 7)), ("bn1.weight", (64,)), ("bn1.bias", (64,))]
    inplanes = 64
    for layer, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3)), start=1):
        for block in range(blocks):
            prefix = f"layer{layer}.{block}"
            shapes += [(f"{prefix}.conv1.weight", (width, inplanes, 1, 1)),
                       (f"{prefix}.bn1.weight", (width,)), (f"{prefix}.bn1.bias", (width,)),
                       (f"{prefix}.conv2.weight", (width, width, 3, 3)),
                       (f"{prefix}.bn2.weight", (width,)), (f"{prefix}.bn2.bias", (width,)),
                       (f"{prefix}.conv3.weight", (4 * width, width, 1, 1)),
                       (f"{prefix}.bn3.weight", (4 * width,)), (f"{prefix}.bn3.bias", (4 * width,))]
            if block == 0:
                shapes += [(f"{prefix}.downsample.0.weight", (4 * width, inplanes, 1, 1)),
                           (f"{prefix}.downsample.1.weight", (4 * width,)),
                           (f"{prefix}.downsample.1.bias", (4 * width,))]
            inplanes = 4 * width
    return shapes + [("fc.weight", (1000, 2048)), ("fc.bias", (1000,))]


def gpt2_small(layers=12, width=768, vocabulary=50257, positions=1024):
    shapes = [("wte.weight", (vocabulary, width)), ("wpe.weight", (positions, width))]
    for layer in range(layers):
        prefix = f"h.{layer}"
        shapes += [(f"{prefix}.ln_1.weight", (width,)), (f"{prefix}.ln_1.bias", (width,)),
                   (f"{prefix}.attn.c_attn.weight", (width, 3 * width)), (f"{prefix}.attn.c_attn.bias", (3 * width,)),
                   (f"{prefix}.attn.c_proj.weight", (width, width)), (f"{prefix}.attn.c_proj.bias", (width,)),
                   (f"{prefix}.ln_2.weight", (width,)), (f"{prefix}.ln_2.bias", (width,)),
                   (f"{prefix}.mlp.c_fc.weight", (width, 4 * width)), (f"{prefix}.mlp.c_fc.bias", (4 * width,)),
                   (f"{prefix}.mlp.c_proj.weight", (4 * width, width)), (f"{prefix}.mlp.c_proj.bias", (width,))]
    return shapes + [("ln_f.weight", (width,)), ("ln_f.bias", (width,))]
