"""Errors raised by the adapters. Each message names the tensor, the problem and the fix."""


class CompressionMismatchError(RuntimeError):
    """Ranks disagree about a compressor's settings, a tensor's shape or the library version."""


class UnsupportedCollectiveError(ValueError):
    """The compressor was asked to serve a collective it cannot serve (Adasum, reducescatter, ...)."""
