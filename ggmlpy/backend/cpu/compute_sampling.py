"""Preparers for the sampling ops (TOP_K, CUMSUM, TOP_P_CUT, MIN_P_CUT, PENALTIES, SAMPLE_DIST).

Each works row by row with the kernels of ggmlpy.rowops: these graphs carry one row
per draw, so there are few.
"""
from __future__ import annotations

import numpy as np

from ... import rowops
from ...tensor import Op, Tensor
from .kernel_table import KernelTable, Prepared, require_f32
from .plan import Plan

KERNELS = KernelTable()


def _row_iter(*arrays: np.ndarray):
    n3, n2, n1 = arrays[0].shape[:3]
    for i3 in range(n3):
        for i2 in range(n2):
            for i1 in range(n1):
                yield tuple(a[i3, i2, i1] for a in arrays)


@KERNELS.register(Op.TOP_K)
def _top_k(node: Tensor, plan: Plan) -> Prepared:
    (a,) = node.src
    require_f32(node, a)
    av, dv = a.array(), node.array()
    k = node.op_params[0]

    def run() -> None:
        for src, dst in _row_iter(av, dv):
            dst[:] = rowops.top_k_desc(src, k)
    return run


@KERNELS.register(Op.CUMSUM)
def _cumsum(node: Tensor, plan: Plan) -> Prepared:
    (a,) = node.src
    require_f32(node, a)
    av, dv = a.array(), node.array()

    def run() -> None:
        for src, dst in _row_iter(av, dv):
            rowops.cumsum(src, dst)
    return run


@KERNELS.register(Op.TOP_P_CUT)
def _top_p_cut(node: Tensor, plan: Plan) -> Prepared:
    (a,) = node.src
    require_f32(node, a)
    av, dv = a.array(), node.array()
    p, min_keep = node.op_params

    def run() -> None:
        for src, dst in _row_iter(av, dv):
            keep = rowops.top_p_keep(src, p, min_keep)
            dst[:keep] = src[:keep]
            dst[keep:] = -np.inf
    return run


@KERNELS.register(Op.MIN_P_CUT)
def _min_p_cut(node: Tensor, plan: Plan) -> Prepared:
    (a,) = node.src
    require_f32(node, a)
    av, dv = a.array(), node.array()
    (p,) = node.op_params

    def run() -> None:
        for src, dst in _row_iter(av, dv):
            threshold = rowops.min_p_threshold(src, p)
            dst[:] = np.where(src >= threshold, src, np.float32(-np.inf))
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
