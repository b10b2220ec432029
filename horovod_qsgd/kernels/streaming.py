"""Stores that bypass the cache, for CPU passes that write a large array they do not read (CPU only).

A plain store to memory the pass has not read first reads each line in (read-for-ownership): writing the
error-feedback accumulator ``acc = x + previous residual`` into a second buffer, as the non-finite safety
needs, then moved 4 bytes per element more than adding into the residual in place (a 25M-element pass: 11
against 7.5 ms on one core, 17.5 against 12 ms with two ranks side by side). Non-temporal stores write whole
lines without reading them: 9 and 13 ms. They also leave the written lines out of the cache, so a pass uses
them only where nothing reads the array back soon after (the top-k count pass recomputes ``x + c`` from the
cached inputs instead) and only on arrays larger than the cache (:data:`STREAM_MIN`).

No CUDA twin: the GPU has no read-for-ownership, and no core compiled for CUDA calls these.
"""
import numba
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

__all__ = ["STREAM_MIN", "stream_sum"]

STREAM_MIN = 1 << 22  # elements (16 MB of float32, half this VM's L3): smaller arrays stay in the cache
_LANES = 8  # one 32-byte vector of float32
_ALIGN = 4 * _LANES


@intrinsic
def _stream_sum_vector(typingctx, dst, xs, cs, j):
    """dst[j:j + 8] = xs[j:j + 8] + cs[j:j + 8], one non-temporal 32-byte store (``dst + j`` 32-byte aligned)."""
    def codegen(context, builder, signature, args):
        vector = ir.VectorType(ir.FloatType(), _LANES)

        def at(k):
            data = context.make_array(signature.args[k])(context, builder, args[k]).data
            return builder.bitcast(builder.gep(data, [args[3]]), vector.as_pointer())

        total = builder.fadd(builder.load(at(1), align=4), builder.load(at(2), align=4))
        store = builder.store(total, at(0), align=_ALIGN)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()
    return types.void(dst, xs, cs, j), codegen


@intrinsic
def _store_fence(typingctx):
    """Orders the non-temporal stores before any later store (they are weakly ordered): the thread that joins
    a parallel pass then reads what it wrote."""
    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()
    return types.void(), codegen


@numba.njit(inline="always")
def stream_sum(dst, xs, cs):
    """dst[j] = xs[j] + cs[j] (float32, contiguous, equal sizes), stored past the cache."""
    n = dst.size
    head = min(n, ((_ALIGN - dst.ctypes.data % _ALIGN) % _ALIGN) // 4)
    for j in range(head):
        dst[j] = xs[j] + cs[j]
    j = head
    while j + _LANES <= n:
        _stream_sum_vector(dst, xs, cs, j)
        j += _LANES
    for i in range(j, n):
        dst[i] = xs[i] + cs[i]
    _store_fence()
