"""What every compressor shares about its codec and settings, whichever adapter carries it."""


class CodecSettings:
    """Part of every object with a ``codec`` and ``settings()``: Horovod's PyTorch and TensorFlow compressors,
    the DDP hooks' states, FSDP2's reduce-scatter compressors."""

    @property
    def error_feedback(self):
        """True when what a step does not send is kept in a residual and added to the next step's gradient."""
        return bool(getattr(self.codec, "error_feedback", False))

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in sorted(self.settings().items()))
        return f"{type(self).__name__}({args})"
