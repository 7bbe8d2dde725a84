"""The products on the CPU, MUL_MAT and OUT_PROD, with ggml's broadcasting.

MUL_MAT of an F32 or F16 first operand sums in ggml-cpu's order (floatdot.py), so that
inference gives llama.cpp's numbers whatever BLAS and CPU run it; training graphs set
Prec.BLAS on their F32 products (opt.TrainGraph), which then go through BLAS (gemm.py),
several times faster, as OUT_PROD's float products always do.

ggml computes dst[i13, i12, i11, i01] = dot(a[i13 / r3, i12 / r2, i01, :], b[i13, i12, i11, :]),
r2 = b.ne2 / a.ne2, r3 = b.ne3 / a.ne3: a's matrices are shared by r2 (r3) consecutive
matrices of b, as grouped-query attention needs. Splitting b's dims 2 and 3 into
(a.ne, r) makes that plain numpy broadcasting, without copying anything.

When `a` is F16/BF16, ggml converts `b` to that type before the dot products; rounding
`b` the same way here keeps results identical to llama.cpp's (bit for bit for F16).

When `a` is block-quantized, ggml quantizes `b` to the type's dot-product partner
(vec_dot_type: Q8_0, Q8_1 or Q8_K) and uses integer dot products. Here `b`'s rows are
rounded to exactly those values (d * q); qmatmul.py multiplies them with `a`'s packed rows
in ggml's order for Q5_0, Q8_0, Q4_K and Q6_K (qexact.py) and otherwise with rows
dequantized a tile at a time, through BLAS (float32 summation order apart, llama.cpp's).
OUT_PROD (the products of the backward pass) reads a quantized `a` the same way, from its
packed rows, in float32 or (set_prec BF16) by bf16 dot products.
"""
from __future__ import annotations

import numpy as np

from .... import convert
from ....ops import Prec, prec_of
from ....tensor import Op, Tensor
from ....types import GGMLType, traits
from ..plan import Plan
from ..plan.kernel_table import KernelTable, Prepared, require_f32
from . import floatdot
from .gemm import GRAIN, Matmul, matmul
from .qmatmul import QuantMatrix, mul_mat_qt, plan_mul_mat_q, row_offsets
from .type_table import cpu_type

KERNELS = KernelTable()

# gemm.py cuts a product into slices of GRAIN multiply-adds: with fewer than two slices
# a second thread idles.
PARALLEL_MIN_MACS = 2 * GRAIN


def _mul_mat_parallel(node: Tensor) -> bool:
    return node.nelements() * node.src[0].ne[0] >= PARALLEL_MIN_MACS


def _out_prod_parallel(node: Tensor) -> bool:
    return node.nelements() * node.src[0].ne[1] >= PARALLEL_MIN_MACS


def _split_batch(b: np.ndarray, ne02: int, ne03: int) -> np.ndarray:
    n13, n12, n11, n10 = b.shape
    return b.reshape(ne03, n13 // ne03, ne02, n12 // ne02, n11, n10)


@KERNELS.register(Op.MUL_MAT, parallel=_mul_mat_parallel)
def prepare_mul_mat(node: Tensor, plan: Plan) -> Prepared:
    a, b = node.src
    if b.type != GGMLType.F32:
        raise NotImplementedError(f"MUL_MAT with {b.type.name} second operand")
    if traits(a.type).is_quantized:
        return _prepare_quantized(node, a, b, plan)
    av, bv, dv = a.array(), b.array(), node.array()
    ne03, ne02 = av.shape[0], av.shape[1]
    a_type, floats = a.type, cpu_type(a.type).floats
    if prec_of(node) not in floats.blas_precs:  # ggml's order (floatdot.py)
        tinyblas = floatdot.uses_tinyblas(a.ne[1], b.ne[1], a.ne[0])
        if not dv.flags.c_contiguous:
            raise NotImplementedError(f"MUL_MAT of {a_type.name} into a non-contiguous result")
        return lambda: floatdot.mul_mat(np.ascontiguousarray(convert.to_f32(av, a_type)),
                                        np.ascontiguousarray(convert.round_to(bv, a_type)), dv, tinyblas,
                                        floats.halves)

    in_place = av.dtype == np.float32  # BLAS reads the matrix as it is; other types convert per call
    b2, d2 = _fold_rows(bv), _fold_rows(dv)
    if ne02 == 1 and ne03 == 1 and b2 is not None and d2 is not None:
        # one matrix for all of b: a single GEMM over every row of b
        a2 = av[0, 0]
        if in_place:
            return Matmul(b2, a2.T, d2, parallel=_mul_mat_parallel(node)).run
        return lambda: matmul(convert.round_to(b2, a_type), convert.to_f32(a2, a_type).T, d2)

    a6 = av.reshape(ne03, 1, ne02, 1, av.shape[2], av.shape[3])
    b6 = _split_batch(bv, ne02, ne03)
    d6 = _split_batch(dv, ne02, ne03)
    if in_place:
        return Matmul(b6, a6.swapaxes(-1, -2), d6, parallel=_mul_mat_parallel(node)).run
    return lambda: matmul(convert.round_to(b6, a_type), convert.to_f32(a6, a_type).swapaxes(-1, -2), d6)


def _prepare_quantized(node: Tensor, a: Tensor, b: Tensor, plan: Plan) -> Prepared:
    """One (W, x rows, out rows) product per matrix of `a`; b's matrices that share it
    (broadcasting over dims 2 and 3) are folded into one batch of rows when their layout
    allows, so each tile of W is dequantized once per graph evaluation."""
    k, m, ne02, ne03 = a.ne
    offs = row_offsets(a)
    b6 = _split_batch(b.array(), ne02, ne03)
    d6 = _split_batch(node.array(), ne02, ne03)
    work = []
    for i3 in range(ne03):
        for i2 in range(ne02):
            w = QuantMatrix(a.type, a.buffer, offs[i3, i2], k)
            bs, ds = b6[i3, :, i2], d6[i3, :, i2]  # (r3, r2, N, K), (r3, r2, N, M)
            b2, d2 = _fold_rows(bs), _fold_rows(ds)
            if b2 is not None and d2 is not None:
                work.append((w, b2, d2))
            else:
                work += [(w, bs[j3, j2], ds[j3, j2]) for j3 in range(bs.shape[0]) for j2 in range(bs.shape[1])]
    scratch = plan.scratch  # tiles and rounded activations, shared by every product
    products = [(plan_mul_mat_q(w, x.shape[0]), x, out) for w, x, out in work]  # kernels chosen here, once

    def run() -> None:
        for product, x, out in products:
            product(x, out, scratch)
    return run


@KERNELS.register(Op.OUT_PROD, parallel=_out_prod_parallel)
def _out_prod(node: Tensor, plan: Plan) -> Prepared:
    a, b = node.src
    if traits(a.type).is_quantized:
        return _out_prod_quantized(node, a, b, plan)
    require_f32(node, a, b)
    av, bv, dv = a.array(), b.array(), node.array()
    ne03, ne02 = av.shape[0], av.shape[1]
    a6 = av.reshape(ne03, 1, ne02, 1, av.shape[2], av.shape[3])
    b6t = _split_batch(bv, ne02, ne03).swapaxes(-1, -2)
    d6 = _split_batch(dv, ne02, ne03)
    return Matmul(b6t, a6, d6)


def _out_prod_quantized(node: Tensor, a: Tensor, b: Tensor, plan: Plan) -> Prepared:
    """result[n, k] = sum_m W[m, k] * b[m, n] with W the quantized a: the gradient of a
    product with a frozen quantized weight, from W's packed rows a tile at a time."""
    require_f32(node, b)
    if a.ne[2] != 1 or a.ne[3] != 1:
        raise NotImplementedError("OUT_PROD with a batched quantized first operand")
    k = a.ne[0]
    w = QuantMatrix(a.type, a.buffer, row_offsets(a)[0, 0], k)
    bv, dv = b.array(), node.array()
    scratch = plan.scratch
    pairs = [(bv[i3, i2].T, dv[i3, i2]) for i3 in range(bv.shape[0]) for i2 in range(bv.shape[1])]
    bf16 = prec_of(node) == Prec.BF16

    def run() -> None:
        for g, out in pairs:
            mul_mat_qt(w, g, out, scratch, bf16)
    return run


def _fold_rows(x: np.ndarray) -> np.ndarray | None:
    """x as a 2-D (rows, ne0) view when its rows are evenly spaced, else None."""
    try:
        return np.reshape(x, (-1, x.shape[-1]), copy=False)
    except ValueError:
        return None
