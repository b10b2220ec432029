"""Benchmark models that need no download: a communication-heavy MLP and a compute-heavy small CNN."""
import torch

# Layer widths of the MLPs: mlp25m has 25.2M parameters, mlp10m 9.9M, deep5m 5.0M in 17 layers (many tensors
# of 0.26-0.52M elements each, as the blocks of a transformer: what a collective per tensor costs shows).
MLP_WIDTHS = {"mlp25m": (1024, 4096, 4096, 1000), "mlp10m": (1024, 2048, 2560, 1000),
              "deep5m": (1024,) + (512,) * 16 + (1000,)}


def build_model(name):
    if name in MLP_WIDTHS:
        widths = MLP_WIDTHS[name]
        layers = []
        for fan_in, fan_out in zip(widths[:-1], widths[1:]):
            layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers[:-1])
    if name == "cnn":
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(64, 128, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(128, 128, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(), torch.nn.Linear(128 * 8 * 8, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    raise ValueError(f"unknown model {name!r}; choose one of {sorted(MLP_WIDTHS) + ['cnn']}")


def input_shape(name):
    return (MLP_WIDTHS[name][0],) if name in MLP_WIDTHS else (3, 32, 32)
