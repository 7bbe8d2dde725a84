"""Steps fused when a plan is prepared: a node and the next step that reads it, computed in
one call that still writes both results (another graph may read the first one: a training
step's backward pass, a recomputed segment).

Each fusion gives the bits the two kernels give one after the other (the same float32
operations in the same order), so it changes nothing but the number of calls: on a decode
step of a small model, a numba call costs more than the row it computes.

- RMS_NORM then MUL by the norm's weight (every llama-family layer, twice, and the output
  norm): x * scale, then times w, per element, as rms_norm_f32 and binary_rows_f32 compute them.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ...tensor import Op, Tensor
from ...types import GGMLType
from .compute import _rows_repeat
from .kernel_table import Prepared, read_only
from .kernels import sum_sq_f64
from .plan import Plan

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


def _rms_norm_mul(norm: Tensor, mul: Tensor, plan: Plan) -> Prepared | None:
    a, b = mul.src
    weight = b if a is norm else a
    x = norm.src[0]
    if weight is norm or any(t.type != GGMLType.F32 for t in (x, norm, weight, mul)):
        return None
    xv, nv, wv, dv = x.array(), norm.array(), weight.array(), mul.array()
    n0 = xv.shape[-1]
    if not all(v.flags.c_contiguous for v in (xv, nv, wv, dv)) or not xv.shape == nv.shape == dv.shape \
            or wv.shape[-1] != n0 or not _rows_repeat(dv.shape, wv.shape):
        return None
    x2, w2 = read_only(xv.reshape(-1, n0)), read_only(wv.reshape(-1, n0))
    n2, d2 = nv.reshape(-1, n0), dv.reshape(-1, n0)
    eps = np.float32(norm.op_params[0])
    return lambda: rms_norm_mul_rows(x2, w2, n2, d2, eps)


_FUSIONS = {(Op.RMS_NORM, Op.MUL): _rms_norm_mul}


def fuse(node: Tensor, following: Tensor, plan: Plan) -> Prepared | None:
    """One call computing `node` and then `following` (the step after it, which reads it), or
    None when they do not fuse (no fusion for these ops, or a layout the fused kernel does not
    take)."""
    make = _FUSIONS.get((node.op, following.op))
    if make is None or not any(s is node for s in following.src):
        return None
    return make(node, following, plan)
