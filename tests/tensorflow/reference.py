"""What every rank should receive, computed without the adapter: the codec and plain Horovod collectives.

Each rank encodes its own local gradient with a fresh codec (its own step
counters and residuals), the raw payloads are exchanged with a plain
``hvd.allgather`` and decoded in rank order; RandomK's values are summed by a
plain ``hvd.allreduce`` and scattered. Import TensorFlow and Horovod lazily:
this module is imported by the collecting pytest process.
"""
import numpy as np

LEGACY_KERAS = {"TF_USE_LEGACY_KERAS": "1"}
KERAS3 = {"TF_USE_LEGACY_KERAS": "0"}

KINDS = {
    "qsgd4": ("QSGD", {"bits": 4}),
    "qsgd8": ("QSGD", {"bits": 8}),
    "qsgd2-l2": ("QSGD", {"bits": 2, "norm": "l2", "bucket_size": 1024}),
    "topk": ("TopK", {"ratio": 0.01}),
    "topk-gaussian": ("TopK", {"ratio": 0.01, "selector": "gaussian"}),
    "randomk-ef": ("RandomK", {"ratio": 0.05, "error_feedback": True}),
    "randomk-fp16": ("RandomK", {"ratio": 0.05, "error_feedback": True, "value_dtype": "float16"}),
}


def make(kind, **overrides):
    import horovod_qsgd.tensorflow as adapter
    class_name, kwargs = KINDS[kind]
    return getattr(adapter, class_name)(**dict(kwargs, **overrides))


class Reference:
    """Expected received gradients, step by step, for one compressor configuration.

    Payloads are decoded in rank order, so QSGD/TopK results are bitwise. What
    Horovod's ring allreduce sums (passed-through tensors, RandomK values) is
    bitwise on 2 ranks (a + b = b + a); on 3 and more the summation order
    depends on how Horovod fused the tensors in that cycle, so
    :meth:`check` allows a few ulp there.
    """

    def __init__(self, hvd, kind, op="average", prescale=1.0, postscale=1.0, process_set=None, **overrides):
        template = make(kind, **overrides)
        self.hvd = hvd
        self.codec = make(kind, **overrides).codec       # fresh codec, own state below
        self.min_numel = template.min_numel
        self.error_feedback = template.error_feedback
        self.randomk = type(template).__name__ == "RandomK"
        self.op = op
        self.prescale, self.postscale = prescale, postscale
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        self.steps, self.residuals = {}, {}
        self.calls = 0
        self.bound = None

    def compressed(self, local):
        local = np.asarray(local)
        return np.issubdtype(local.dtype, np.floating) and local.size >= self.min_numel

    def expected(self, name, local):
        """The gradient every rank should receive for ``name`` given this rank's ``local`` gradient."""
        import tensorflow as tf
        from horovod_qsgd.codecs import HEADER_NBYTES, parse_header
        from horovod_qsgd.common.naming import rank_key, tensor_key
        hvd = self.hvd
        local = np.asarray(local)
        self.calls += 1
        tag = f"reference.{self.calls}"
        op = hvd.Sum if self.op == "sum" else hvd.Average
        self.bound = None
        if not self.compressed(local):
            self.bound = self._reorder_bound(local, tag)
            return hvd.allreduce(tf.constant(local), op=op, name=tag, prescale_factor=self.prescale,
                                 postscale_factor=self.postscale, process_set=self.process_set).numpy()
        flat = local.reshape(-1).astype(np.float32)
        step = self.steps.get(name, 0)
        self.steps[name] = step + 1
        residual = (self.residuals.setdefault(name, np.zeros(flat.size, np.float32))
                    if self.error_feedback else None)
        total = np.zeros(flat.size, np.float32)
        if self.randomk:
            values = self.codec.gather(flat, step=step, key=tensor_key(name), residual=residual)
            if self.codec.value_dtype == "float16":  # sent and summed as fp16
                values = values.astype(np.float16)
            reduced = hvd.allreduce(tf.constant(values), op=op, name=tag, prescale_factor=self.prescale,
                                    postscale_factor=self.postscale, process_set=self.process_set).numpy()
            self.codec.scatter_accumulate(np.ascontiguousarray(reduced, np.float32), total, step=step,
                                          key=tensor_key(name))
            self.bound = np.zeros(flat.size, np.float32)
            self.codec.scatter_accumulate(self._reorder_bound(values, tag).astype(np.float32), self.bound,
                                          step=step, key=tensor_key(name))
            self.bound = self.bound.reshape(local.shape)
        else:
            out = np.empty(self.codec.max_payload_nbytes(flat.size), np.uint8)
            nbytes = self.codec.encode(flat, out, step=step, key=rank_key(name, self.process_set.rank()),
                                       residual=residual)
            gathered = hvd.allgather(tf.constant(out[:nbytes]), name=tag, process_set=self.process_set).numpy()
            offset = 0
            for _ in range(self.process_set.size()):
                header = parse_header(gathered[offset:offset + HEADER_NBYTES].tobytes())
                self.codec.decode_accumulate(gathered[offset:offset + header.nbytes], total)
                offset += header.nbytes
            assert offset == gathered.size
            if self.op == "average":
                total *= np.float32(1.0 / self.process_set.size())
        return total.reshape(local.shape).astype(local.dtype)


    def check(self, name, local, got, what):
        """Asserts that ``got`` is what this rank should receive for ``name``."""
        want = self.expected(name, local)
        if self.bound is not None and self.process_set.size() > 2:
            assert_close(got, want, self.bound, what)
        else:
            assert_bitwise(got, want, what)

    def _reorder_bound(self, contribution, tag):
        """Bound on the difference between two summation orders of every rank's ``contribution``.

        Summing n terms in any order is off from the exact sum by at most
        (n - 1) * eps * sum |x_r| (plus the scaling's rounding): two orders
        differ by at most twice that.
        """
        import tensorflow as tf
        contribution = np.asarray(contribution)
        magnitude = self.hvd.allreduce(tf.constant(np.abs(contribution).astype(np.float64)), op=self.hvd.Sum,
                                       name=tag + ".bound", process_set=self.process_set).numpy()
        scale = self.prescale * self.postscale / (self.process_set.size() if self.op == "average" else 1)
        eps = np.finfo(contribution.dtype).eps
        return 2 * (self.process_set.size() + 1) * eps * magnitude * scale


def assert_close(got, want, bound, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, got.dtype, want.shape, want.dtype)
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    if not np.all(diff <= bound):
        raise AssertionError(f"{what}: {int((diff > bound).sum())} of {got.size} elements differ by more than "
                             f"a reordered sum can, max diff {diff.max()}")


def assert_bitwise(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, got.dtype, want.shape, want.dtype)
    if not np.array_equal(got, want):
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
        raise AssertionError(f"{what}: {int((diff > 0).sum())} of {got.size} elements differ, max diff {diff.max()}")


def gathered_rows(hvd, array, name):
    """Every rank's copy of ``array`` (flattened), as rows in rank order."""
    import tensorflow as tf
    flat = np.asarray(array, np.float32).reshape(1, -1)
    return hvd.allgather(tf.constant(flat), name=name).numpy()
