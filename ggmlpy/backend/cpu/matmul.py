"""MUL_MAT on the CPU: float products through BLAS (numpy.matmul), with ggml's broadcasting.

ggml computes dst[i13, i12, i11, i01] = dot(a[i13 / r3, i12 / r2, i01, :], b[i13, i12, i11, :]),
r2 = b.ne2 / a.ne2, r3 = b.ne3 / a.ne3: a's matrices are shared by r2 (r3) consecutive
matrices of b, as grouped-query attention needs. Splitting b's dims 2 and 3 into
(a.ne, r) makes that plain numpy broadcasting, without copying anything.

When `a` is F16/BF16, ggml converts `b` to that type before the dot products; rounding
`b` the same way here keeps results identical to llama.cpp's.
"""
from __future__ import annotations

import numpy as np

from ... import convert
from ...tensor import Op, Tensor
from ...types import GGMLType, traits
from .compute import Prepared, prepares


def _split_batch(b: np.ndarray, ne02: int, ne03: int) -> np.ndarray:
    n13, n12, n11, n10 = b.shape
    return b.reshape(ne03, n13 // ne03, ne02, n12 // ne02, n11, n10)


@prepares(Op.MUL_MAT)
def prepare_mul_mat(node: Tensor) -> Prepared:
    a, b = node.src
    if traits(a.type).is_quantized:
        raise NotImplementedError(f"MUL_MAT with {a.type.name} first operand")
    if b.type != GGMLType.F32:
        raise NotImplementedError(f"MUL_MAT with {b.type.name} second operand")
    av, bv, dv = a.array(), b.array(), node.array()
    ne03, ne02 = av.shape[0], av.shape[1]
    a_type = a.type

    b2, d2 = _fold_rows(bv), _fold_rows(dv)
    if ne02 == 1 and ne03 == 1 and b2 is not None and d2 is not None:
        # one matrix for all of b: a single GEMM over every row of b
        a2 = av[0, 0]
        if a_type == GGMLType.F32:
            a2t = a2.T
            return lambda: np.matmul(b2, a2t, out=d2)
        return lambda: np.matmul(convert.round_to(b2, a_type), convert.to_f32(a2, a_type).T, out=d2)

    a6 = av.reshape(ne03, 1, ne02, 1, av.shape[2], av.shape[3])
    b6 = _split_batch(bv, ne02, ne03)
    d6 = _split_batch(dv, ne02, ne03)
    if a_type == GGMLType.F32:
        a6t = a6.swapaxes(-1, -2)
        return lambda: np.matmul(b6, a6t, out=d6)
    return lambda: np.matmul(convert.round_to(b6, a_type), convert.to_f32(a6, a_type).swapaxes(-1, -2), out=d6)


def _fold_rows(x: np.ndarray) -> np.ndarray | None:
    """x as a 2-D (rows, ne0) view when its rows are evenly spaced, else None."""
    try:
        return np.reshape(x, (-1, x.shape[3]), copy=False)
    except ValueError:
        return None
