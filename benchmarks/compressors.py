"""The compressor configurations the benchmarks compare, by name, for either framework."""
import argparse

# name -> (class name in horovod_qsgd.torch / horovod_qsgd.tensorflow, constructor arguments)
SPECS = {
    "none": ("NoCompression", None),
    "fp16": ("FP16", None),
    "qsgd-8bit": ("QSGD", {"bits": 8}),
    "qsgd-4bit": ("QSGD", {"bits": 4}),
    "qsgd-2bit": ("QSGD", {"bits": 2}),
    "topk-1%": ("TopK", {"ratio": 0.01}),
    "topk-0.1%": ("TopK", {"ratio": 0.001}),
    "gaussiank-1%": ("TopK", {"ratio": 0.01, "selector": "gaussian"}),
    "gaussiank-0.1%": ("TopK", {"ratio": 0.001, "selector": "gaussian"}),
    "randomk-1%": ("RandomK", {"ratio": 0.01, "error_feedback": True}),
    # variants the studies ask for by name: the exchanges forced (the default "auto" takes two stages from 3
    # ranks), the owners' sums at 8 bits, a larger Top-k ratio
    "qsgd-4bit-allgather": ("QSGD", {"bits": 4, "exchange": "allgather"}),
    "topk-1%-allgather": ("TopK", {"ratio": 0.01, "exchange": "allgather"}),
    "qsgd-4bit-second8": ("QSGD", {"bits": 4, "second_stage_bits": 8}),
    "topk-10%": ("TopK", {"ratio": 0.1}),
    # the same levels as qsgd-2bit (bit for bit), Elias-coded: fewer bytes where most levels are 0
    "qsgd-2bit-elias": ("QSGD", {"bits": 2, "encoding": "elias"}),
    "qsgd-4bit-two-stage": ("QSGD", {"bits": 4, "exchange": "two_stage"}),
    "topk-1%-two-stage": ("TopK", {"ratio": 0.01, "exchange": "two_stage"}),
    # every two-stage tensor its own alltoall and allgather, as before fusion
    "qsgd-4bit-unfused": ("QSGD", {"bits": 4, "fusion_threshold": 0}),
    "topk-1%-unfused": ("TopK", {"ratio": 0.01, "fusion_threshold": 0}),
    # only the nodes' sums cross between nodes (on one node: node-blind, with a warning)
    "qsgd-8bit-node-aware": ("QSGD", {"bits": 8, "exchange": "node_aware"}),
    "qsgd-4bit-node-aware": ("QSGD", {"bits": 4, "exchange": "node_aware"}),
    "topk-1%-node-aware": ("TopK", {"ratio": 0.01, "exchange": "node_aware"}),
    # every node-aware tensor its own collectives, as before fusion
    "qsgd-4bit-node-aware-unfused": ("QSGD", {"bits": 4, "exchange": "node_aware", "fusion_threshold": 0}),
    "topk-1%-node-aware-unfused": ("TopK", {"ratio": 0.01, "exchange": "node_aware", "fusion_threshold": 0}),
}
# What the studies compare unless told otherwise: one row per compressor, default exchange.
STANDARD = list(SPECS)[:list(SPECS).index("qsgd-4bit-allgather")]


def names_argument(text):
    """argparse ``type=`` for a comma-separated list of configuration names: the list, or an error naming the
    unknown ones (before any job starts)."""
    names = text.split(",")
    unknown = [name for name in names if name not in SPECS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown compressor(s) {unknown}; choose from {', '.join(SPECS)}")
    return names


_FLAG_NAMES = {"bits": "--bits", "ratio": "--ratio", "selector": "--selector", "exchange": "--exchange",
               "fusion_threshold": "--fusion-threshold"}
_KINDS = {"NoCompression": "none", "FP16": "fp16", "QSGD": "qsgd", "TopK": "topk", "RandomK": "randomk"}


def build(name, module, **overrides):
    """An instance (or Horovod's compressor class) of configuration ``name`` from an adapter module."""
    class_name, kwargs = SPECS[name]
    cls = getattr(module, class_name)
    return cls if kwargs is None else cls(**dict(kwargs, **overrides))


def benchmark_flags(name):
    """The synthetic benchmarks' command-line flags for configuration ``name``."""
    class_name, kwargs = SPECS[name]
    flags = ["--compression", _KINDS[class_name]]
    for key, value in (kwargs or {}).items():
        if key in _FLAG_NAMES:
            flags += [_FLAG_NAMES[key], str(value)]
    return flags
