"""Gradient compression for Horovod that puts fewer bytes on the wire.

Framework adapters live in :mod:`horovod_qsgd.torch` and
:mod:`horovod_qsgd.tensorflow`; both call the same kernels in
:mod:`horovod_qsgd.kernels` through the codecs in :mod:`horovod_qsgd.codecs`.
"""

__version__ = "0.1.0"
