"""Ops for sampling inside a graph: top-k selection, cumulative sums, probability cuts
and a categorical draw, so that a model graph can end in a chosen token.

Rows are dimension 0 (one row of logits per output token). The cut ops keep the row's
length and write -inf over the tokens they remove, so shapes stay static and a graph can
be reused from step to step; removed tokens then have probability exactly 0.

Numerics (shared with llamapy's CPU samplers, see backend/cpu/sampling_kernels.py):
exp in float32, sums accumulated in double in row order. Tokens at -inf add exact zeros,
so a masked row and the compacted candidate list it stands for give identical results.
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
    """Logits rows sorted largest first: softmax, cumulative sum, and -inf after the first
    token where the cumulative probability reaches p (keeping at least min_keep)."""
    _check(a.type == GGMLType.F32, "TOP_P_CUT: F32 rows expected")
    return _node(ctx, Op.TOP_P_CUT, GGMLType.F32, a.ne, (a,), (float(p), int(min_keep)))


def min_p_cut(ctx: Context, a: Tensor, p: float) -> Tensor:
    """-inf over the tokens whose probability is below p times the row's largest."""
    _check(a.type == GGMLType.F32, "MIN_P_CUT: F32 rows expected")
    return _node(ctx, Op.MIN_P_CUT, GGMLType.F32, a.ne, (a,), (float(p),))


def penalties(ctx: Context, a: Tensor, counts: Tensor, repeat: float, freq: float, present: float) -> Tensor:
    """Repetition penalties from per-token counts (same shape as a): where count > 0, a logit
    is divided by `repeat` if positive (multiplied if not), then count * freq + present is
    subtracted (llama.cpp's penalties sampler)."""
    _check(a.type == counts.type == GGMLType.F32 and a.ne == counts.ne, f"PENALTIES: counts {counts.ne} vs {a.ne}")
    return _node(ctx, Op.PENALTIES, GGMLType.F32, a.ne, (a, counts), (float(repeat), float(freq), float(present)))


def sample_dist(ctx: Context, a: Tensor, u: Tensor, ids: Tensor | None = None) -> Tensor:
    """A categorical draw per row of logits: softmax, then the first token whose running
    probability reaches u * total, u being each row's uniform number in [0, 1) (F64 [1, rows],
    set by the host). With `ids` (I32, a's shape), the drawn position is mapped to ids[position].
    Result: I32 [1, ne1]."""
    _check(a.type == GGMLType.F32 and a.ne[2] == a.ne[3] == 1, f"SAMPLE_DIST: F32 matrix expected, got {a.ne}")
    _check(u.type == GGMLType.F64 and u.nelements() == a.ne[1], f"SAMPLE_DIST: need {a.ne[1]} F64 uniforms")
    if ids is not None:
        _check(ids.type == GGMLType.I32 and ids.ne == a.ne, f"SAMPLE_DIST: ids {ids.ne} vs {a.ne}")
    src = (a, u) if ids is None else (a, u, ids)
    return _node(ctx, Op.SAMPLE_DIST, GGMLType.I32, (1, a.ne[1], 1, 1), src)
