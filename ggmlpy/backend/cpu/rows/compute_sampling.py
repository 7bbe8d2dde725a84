"""Preparers for the sampling ops (TOP_K, CUMSUM, TOP_P_CUT, MIN_P_CUT, PENALTIES, SAMPLE_DIST).

Each works row by row with the kernels of ggmlpy.rowops: these graphs carry one row
per draw, so there are few.
"""
from __future__ import annotations

import numpy as np

from .... import rowops
from ....tensor import Op, Tensor
from ..plan import Plan
from ..plan.kernel_table import KernelTable, Prepared, require_f32

KERNELS = KernelTable()


def _row_iter(*arrays: np.ndarray):
    n3, n2, n1 = arrays[0].shape[:3]
    for i3 in range(n3):
        for i2 in range(n2):
            for i1 in range(n1):
                yield tuple(a[i3, i2, i1] for a in arrays)


def _top_k(src: np.ndarray, dst: np.ndarray, k: int) -> None:
    dst[:] = rowops.top_k_desc(src, k)


def _top_p_cut(src: np.ndarray, dst: np.ndarray, p: float, min_keep: int) -> None:
    keep = rowops.top_p_keep(src, p, min_keep)
    dst[:keep] = src[:keep]
    dst[keep:] = -np.inf


def _min_p_cut(src: np.ndarray, dst: np.ndarray, p: float) -> None:
    threshold = rowops.min_p_threshold(src, p)
    dst[:] = np.where(src >= threshold, src, np.float32(-np.inf))


# the ops that map each F32 row to a row: row(src, dst, *op params)
_ROWS = {Op.TOP_K: _top_k, Op.CUMSUM: rowops.cumsum, Op.TOP_P_CUT: _top_p_cut, Op.MIN_P_CUT: _min_p_cut}


@KERNELS.register(*_ROWS)
def _row_by_row(node: Tensor, plan: Plan) -> Prepared:
    (a,) = node.src
    require_f32(node, a)
    av, dv, row, params = a.array(), node.array(), _ROWS[node.op], tuple(node.op_params)

    def run() -> None:
        for src, dst in _row_iter(av, dv):
            row(src, dst, *params)
    return run


@KERNELS.register(Op.PENALTIES)
def _penalties(node: Tensor, plan: Plan) -> Prepared:
    a, counts = node.src
    require_f32(node, a, counts)
    av, cv, dv = a.array(), counts.array(), node.array()
    repeat, freq, present = node.op_params
    return lambda: np.copyto(dv, rowops.apply_penalties(av, cv, repeat, freq, present))


@KERNELS.register(Op.SAMPLE_DIST)
def _sample_dist(node: Tensor, plan: Plan) -> Prepared:
    a, u = node.src[:2]
    require_f32(node, a)
    av, uv, dv = a.array()[0, 0], u.array().reshape(-1), node.array().reshape(-1)
    idv = node.src[2].array()[0, 0] if len(node.src) > 2 else None

    def run() -> None:
        for r in range(av.shape[0]):
            i = rowops.dist_select(av[r], uv[r])
            dv[r] = i if idv is None else idv[r, i]
    return run
