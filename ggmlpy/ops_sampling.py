"""Ops for categorical sampling from rows of scores inside a graph: top-k selection,
running sums, probability cuts, penalties by count and a categorical draw, so that a
graph can end in the drawn index of each row.

Rows are dimension 0 (one row of scores, e.g. logits, per draw). The cut ops keep the
row's length and write -inf over the entries they remove, so shapes stay static and a
graph can be reused from step to step; removed entries then have probability exactly 0.

Numerics are those of ggmlpy.rowops, whose kernels compute these ops: exp in float32,
sums accumulated in double in row order. Entries at -inf add exact zeros, so a masked
row and the compacted list of the entries it keeps give identical results.
"""
from __future__ import annotations

from .context import Context
from .ops import _check, _node
from .tensor import Op, Tensor
from .types import GGMLType

__all__ = ["cumsum", "min_p_cut", "penalties", "sample_dist", "top_k", "top_p_cut"]


def top_k(ctx: Context, a: Tensor, k: int) -> Tensor:
    """Indices of each row's k largest values, largest first (ties: lower index first):
    I32 [k, ne1, ne2, ne3] (ggml_top_k)."""
    _check(a.type == GGMLType.F32, "TOP_K: F32 rows expected")
    _check(0 < k <= a.ne[0], f"TOP_K: k={k} out of range for rows of {a.ne[0]}")
    return _node(ctx, Op.TOP_K, GGMLType.I32, (k,) + a.ne[1:], (a,), (int(k),))


def cumsum(ctx: Context, a: Tensor) -> Tensor:
    """Running sum along each row (accumulated in double): F32, a's shape (ggml_cumsum)."""
    _check(a.type == GGMLType.F32, "CUMSUM: F32 rows expected")
    return _node(ctx, Op.CUMSUM, GGMLType.F32, a.ne, (a,))


def top_p_cut(ctx: Context, a: Tensor, p: float, min_keep: int = 1) -> Tensor:
    """Rows of scores sorted largest first: softmax, cumulative sum, and -inf after the first
    entry where the cumulative probability reaches p (keeping at least min_keep)."""
    _check(a.type == GGMLType.F32, "TOP_P_CUT: F32 rows expected")
    return _node(ctx, Op.TOP_P_CUT, GGMLType.F32, a.ne, (a,), (float(p), int(min_keep)))


def min_p_cut(ctx: Context, a: Tensor, p: float) -> Tensor:
    """-inf over the entries whose probability is below p times the row's largest."""
    _check(a.type == GGMLType.F32, "MIN_P_CUT: F32 rows expected")
    return _node(ctx, Op.MIN_P_CUT, GGMLType.F32, a.ne, (a,), (float(p),))


def penalties(ctx: Context, a: Tensor, counts: Tensor, repeat: float, freq: float, present: float) -> Tensor:
    """Penalties from per-entry counts (same shape as a): where count > 0, a score is
    divided by `repeat` if positive (multiplied if not), then count * freq + present is
    subtracted (the rule of llama.cpp's penalties sampler)."""
    _check(a.type == counts.type == GGMLType.F32 and a.ne == counts.ne, f"PENALTIES: counts {counts.ne} vs {a.ne}")
    return _node(ctx, Op.PENALTIES, GGMLType.F32, a.ne, (a, counts), (float(repeat), float(freq), float(present)))


def sample_dist(ctx: Context, a: Tensor, u: Tensor, ids: Tensor | None = None) -> Tensor:
    """A categorical draw per row of scores: softmax, then the first entry whose running
    probability reaches u * total, u being each row's uniform number in [0, 1) (F64 [1, rows],
    set by the host). With `ids` (I32, a's shape), the drawn position is mapped to ids[position].
    Result: I32 [1, ne1]."""
    _check(a.type == GGMLType.F32 and a.ne[2] == a.ne[3] == 1, f"SAMPLE_DIST: F32 matrix expected, got {a.ne}")
    _check(u.type == GGMLType.F64 and u.nelements() == a.ne[1], f"SAMPLE_DIST: need {a.ne[1]} F64 uniforms")
    if ids is not None:
        _check(ids.type == GGMLType.I32 and ids.ne == a.ne, f"SAMPLE_DIST: ids {ids.ne} vs {a.ne}")
    src = (a, u) if ids is None else (a, u, ids)
    return _node(ctx, Op.SAMPLE_DIST, GGMLType.I32, (1, a.ne[1], 1, 1), src)
