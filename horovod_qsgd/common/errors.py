"""Errors raised by the adapters. Each message names the tensor, the problem and the fix."""


class CompressionMismatchError(RuntimeError):
    """Ranks disagree about a compressor's settings, a tensor's shape or the library version.

    Raised on every rank, at the first exchange of the tensor (or the first bucket, step or outer step), before
    any payload is decoded; the message names the tensor, the setting and each rank's value. Make the ranks'
    settings equal (the same script and arguments on every rank) and restart."""

    # TensorFlow's autograph re-raises an exception as its own type only when the class keeps
    # BaseException's __init__ signature visible as Exception.__init__.
    __init__ = Exception.__init__


def residual_length_mismatch(tensor, numel, residual_numel, cause="or two tensors share a name"):
    """The error where ``tensor`` (its description: "tensor 'fc.weight'") of ``numel`` elements meets an
    error-feedback residual of ``residual_numel``: its state belongs to another tensor."""
    return CompressionMismatchError(
        f"horovod_qsgd: {tensor} has {numel} elements but its error-feedback residual has {residual_numel}; "
        f"a checkpoint from another model was loaded, {cause}.")


class UnsupportedCollectiveError(ValueError):
    """The compressor was asked to serve a collective it cannot serve (Adasum, reducescatter, ...).

    Raised before any collective starts (PyTorch: on every rank at the first gradient), with the op to use
    instead (``op=hvd.Average`` or ``hvd.Sum``, or ``hvd.Compression.none``)."""

    __init__ = Exception.__init__


def elastic_state_missing(kind, state="hvd.elastic.TorchState(model, optimizer, compression=compression)"):
    """The error when a compressor runs in a Horovod Elastic job (HOROVOD_ELASTIC=1) outside its elastic state."""
    return (f"horovod_qsgd: this is a Horovod Elastic job and the {kind} compressor is not part of its elastic "
            "state: after a worker is lost or added, its settings check, exchange plan and step counters would "
            "not follow the new ranks (the job would hang or sum mismatched payloads). Pass it to the state: "
            f"{state}.")


def elastic_process_set_unsupported(tensor_name):
    """The error when a TensorFlow compressor in a Horovod Elastic job meets a tensor of a process set."""
    return (f"horovod_qsgd: tensor {tensor_name!r} is reduced within a process set in a Horovod Elastic job; there "
            "the TensorFlow compressors follow the global set only (their plans follow hvd.size() and hvd.rank() "
            "as the world changes). Reduce it over all ranks, or send it uncompressed (min_numel above its size).")


class JoinUnsupportedError(UnsupportedCollectiveError):
    """``hvd.join()`` was called while our compressors exchange payloads (Horovod's join answers allreduces only).

    Raised on every rank (the exceptions: ``docs/join.md``) instead of a hang or a killed job; use
    ``horovod_qsgd.torch.Join`` / ``horovod_qsgd.tensorflow.Join`` for uneven inputs."""

    __init__ = Exception.__init__


class RankInJoinError(CompressionMismatchError):
    """A rank in ``hvd.join()`` sent its notice where a payload belonged (see :mod:`horovod_qsgd.tensorflow.hvd_join`).

    ``joined``: how many ranks sent it in this buffer.
    """

    __init__ = Exception.__init__

    @property
    def joined(self):
        return self.args[1]


# How long hvd.join() waits for the others to take part in its refusal before it raises alone.
HVD_JOIN_TIMEOUT_SECONDS = 300


def hvd_join_timed_out(join_class):
    """The error a rank in ``hvd.join()`` raises alone when the others neither step nor join in time."""
    return (f"horovod_qsgd: hvd.join() waited {HVD_JOIN_TIMEOUT_SECONDS} s for the other ranks, which are neither "
            "in a training step nor in hvd.join(). With compressed payloads every rank must call hvd.join() after "
            f"the same number of steps; for uneven inputs use {join_class}.")


def hvd_join_refused(join_class, joined_ranks, num_ranks):
    """The error every rank raises when ``hvd.join()`` meets compressed payloads: ``joined_ranks`` of
    ``num_ranks`` called it while the others were still in a step."""
    return (f"horovod_qsgd: hvd.join() was called on {joined_ranks} of {num_ranks} ranks while the others were "
            "still training: Horovod's join answers the others' allreduces with zeros but not the allgathers "
            "and alltoalls that carry QSGD's and TopK's payloads (its background loop would die and the job "
            f"with it). For uneven inputs use {join_class}; hvd.join() works where every rank calls it after "
            "the same number of steps.")


def tensor_name_shared(name, first, second):
    """The error when a second user (``second``: "parameter 'fc.weight' of another model", "hvd.allreduce") meets a
    tensor name that ``first`` already uses with the same compressor, whose error-feedback state is kept by name."""
    return ValueError(
        f"horovod_qsgd: tensor {name!r} is compressed for {second}, and this compressor already keeps its "
        f"error-feedback state (residual, step counter) for {first} under that name: the two would share one "
        "residual. Give each model (or each direct hvd.allreduce) its own compressor, or another name=.")
