"""Errors raised by the adapters. Each message names the tensor, the problem and the fix."""


class CompressionMismatchError(RuntimeError):
    """Ranks disagree about a compressor's settings, a tensor's shape or the library version."""

    # TensorFlow's autograph re-raises an exception as its own type only when the class keeps
    # BaseException's __init__ signature visible as Exception.__init__.
    __init__ = Exception.__init__


class UnsupportedCollectiveError(ValueError):
    """The compressor was asked to serve a collective it cannot serve (Adasum, reducescatter, ...)."""

    __init__ = Exception.__init__
