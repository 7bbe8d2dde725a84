"""Steps fused when a plan is prepared: a run of consecutive nodes, each reading the one
before, computed in one call that still writes every node's result (another node or graph
may read them: the residual stream, a training step's backward pass, a recomputed segment).

Each fusion gives the bits its kernels give one after the other (the same float32 operations
in the same order, every intermediate rounded to float32 as stored), so it changes nothing
but the number of calls: on a decode step of a small model, a numba call costs more than the
row it computes.

- RMS_NORM then MUL by the norm's weight (every llama-family norm): x * scale, then times w,
  per element, as rms_norm_f32 and binary_rows_f32 compute them.
- ADD (the residual) then that norm and MUL (every layer's second norm and the next layer's
  first): the sum as binary_rows_f32 stores it, then as above.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ....row_math import sum_sq_f64
from ....tensor import Op, Tensor
from ....types import GGMLType
from ..plan import Plan
from ..plan.kernel_table import Prepared, read_only
from .compute import _rows_repeat

F32 = np.float32


@njit(cache=True)
def rms_norm_mul_rows(x, w, nrm, dst, eps):
    """nrm[r] = rms_norm(x[r]), dst[r] = nrm[r] * w[r % rows(w)] for C-contiguous [rows, n0]
    arrays, rounded as rms_norm_f32 followed by binary_rows_f32 (OP_MUL); nrm and dst may be
    one array (a MUL in place)."""
    n1, n0 = x.shape
    b1 = w.shape[0]
    for r in range(n1):
        xr, wr, nr, dr = x[r], w[r % b1], nrm[r], dst[r]
        mean = F32(sum_sq_f64(xr) / n0)
        sc = F32(1.0) / np.sqrt(mean + F32(eps))
        for i0 in range(n0):
            v = xr[i0] * sc
            nr[i0] = v
            dr[i0] = v * wr[i0]


@njit(cache=True)
def add_rms_norm_mul_rows(a, b, x, w, nrm, dst, eps):
    """x[r] = a[r] + b[r % rows(b)], then rms_norm_mul_rows(x, w, nrm, dst, eps), row by row."""
    n1, n0 = a.shape
    b1 = b.shape[0]
    for r in range(n1):
        ar, br, xr = a[r], b[r % b1], x[r]
        for i0 in range(n0):
            xr[i0] = ar[i0] + br[i0]
    rms_norm_mul_rows(x, w, nrm, dst, eps)


def _rows(v: np.ndarray, n0: int) -> np.ndarray:
    return v.reshape(-1, n0)


def _weight_rows(node: Tensor, mul: Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(node's rows, weight rows, mul's rows) when `mul` multiplies F32 `node` by a weight
    whose rows repeat over it, all C-contiguous and of node's shape (binary_rows_f32's case)."""
    a, b = mul.src
    weight = b if a is node else a
    if weight is node or any(t.type != GGMLType.F32 for t in (node, weight, mul)):
        return None
    nv, wv, dv = node.array(), weight.array(), mul.array()
    n0 = nv.shape[-1]
    if not all(v.flags.c_contiguous for v in (nv, wv, dv)) or nv.shape != dv.shape or wv.shape[-1] != n0 \
            or not _rows_repeat(dv.shape, wv.shape):
        return None
    return _rows(nv, n0), read_only(_rows(wv, n0)), _rows(dv, n0)


def _rms_norm_mul(norm: Tensor, mul: Tensor, plan: Plan) -> Prepared | None:
    x = norm.src[0]
    rows = _weight_rows(norm, mul)
    if rows is None or x.type != GGMLType.F32 or not x.array().flags.c_contiguous or x.ne != norm.ne:
        return None
    n2, w2, d2 = rows
    x2 = read_only(_rows(x.array(), n2.shape[1]))
    eps = np.float32(norm.op_params[0])
    return lambda: rms_norm_mul_rows(x2, w2, n2, d2, eps)


def _add_rms_norm_mul(add: Tensor, norm: Tensor, mul: Tensor, plan: Plan) -> Prepared | None:
    rows = _weight_rows(norm, mul)
    a, b = add.src
    if norm.src[0] is not add or add.ne != norm.ne or rows is None \
            or any(t.type != GGMLType.F32 for t in (a, b, add)):
        return None
    av, bv, xv = a.array(), b.array(), add.array()
    n0 = xv.shape[-1]
    # the rows of b repeating over a, as compute.py's ADD takes them to binary_rows_f32
    if not all(v.flags.c_contiguous for v in (av, bv, xv)) or av.shape != xv.shape or bv.shape[-1] != n0 \
            or not _rows_repeat(av.shape, bv.shape):
        return None
    a2, b2, x2 = read_only(_rows(av, n0)), read_only(_rows(bv, n0)), _rows(xv, n0)
    n2, w2, d2 = rows
    eps = np.float32(norm.op_params[0])
    return lambda: add_rms_norm_mul_rows(a2, b2, x2, w2, n2, d2, eps)


# longest first: a run is fused as a whole when it can be
_FUSIONS = (((Op.ADD, Op.RMS_NORM, Op.MUL), _add_rms_norm_mul),
            ((Op.RMS_NORM, Op.MUL), _rms_norm_mul))


def fuse(nodes: list[Tensor], i: int, plan: Plan) -> tuple[Prepared, int] | None:
    """(one call computing nodes[i], nodes[i + 1], ..., how many) for the longest fusion whose
    ops they are, each reading the one before; None when none applies (no fusion for these
    ops, or a layout the fused kernel does not take)."""
    for ops, make in _FUSIONS:
        run = nodes[i:i + len(ops)]
        if tuple(n.op for n in run) != ops or not all(any(s is p for s in n.src) for p, n in zip(run, run[1:])):
            continue
        call = make(*run, plan)
        if call is not None:
            return call, len(ops)
    return None
