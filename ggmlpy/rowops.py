"""Kernels over one row of scores (1-D float32): softmax, running sums, sorting, the cuts
that keep a row's likeliest entries, penalties by count, a categorical draw, and the
max and exp-sum of a log-softmax.

The CPU backend's ops (ops_sampling, cross entropy) run these same kernels on a graph's
rows, so code that calls them directly on host arrays gets bit-identical results. Every
sum runs in double in row order, so an entry at -inf (probability 0) changes no sum.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from .row_math import exp_f32, max_f32, sum_f64

F32 = np.float32


def sort_desc(row: np.ndarray) -> np.ndarray:
    """Positions of a row's values, largest first; ties keep the lower position first."""
    return np.argsort(-row, kind="stable")


def top_k_desc(row: np.ndarray, k: int) -> np.ndarray:
    """sort_desc(row)[:k] without sorting the row: the k largest (ties: the lower position
    first; NaN after every number, as the stable sort puts them), largest first."""
    k = max(0, min(int(k), row.shape[0]))
    out = np.empty(k, dtype=np.int64)
    _top_k_into(row, out)
    return out


@njit(cache=True)
def _top_k_into(row, out):
    """One pass keeping the k best so far in order in `out` (values in `best`): a value
    enters only when it beats the k-th strictly, so an equal later one stays behind."""
    k = out.shape[0]
    if k == 0:
        return
    best = np.empty(k, dtype=np.float32)
    count = 0
    for i in range(row.shape[0]):
        v = row[i]
        if v != v:  # NaN: only to fill up, below
            continue
        if count == k:
            if not v > best[k - 1]:
                continue
            j = k - 1
        else:
            j = count
            count += 1
        while j > 0 and best[j - 1] < v:
            best[j] = best[j - 1]
            out[j] = out[j - 1]
            j -= 1
        best[j] = v
        out[j] = i
    for i in range(row.shape[0]):  # fewer than k numbers: the NaNs follow, in order
        if count == k:
            break
        if row[i] != row[i]:
            out[count] = i
            count += 1


@njit(cache=True)
def softmax(x, out):
    """out = softmax(x): float32 exp of x - max, normalized by their double sum."""
    m = max_f32(x)
    s = 0.0
    for i in range(x.shape[0]):
        e = np.exp(x[i] - m)
        out[i] = e
        s += np.float64(e)
    for i in range(x.shape[0]):
        out[i] = F32(out[i] / s)


@njit(cache=True)
def cumsum(x, out):
    s = 0.0
    for i in range(x.shape[0]):
        s += np.float64(x[i])
        out[i] = F32(s)


@njit(cache=True)
def top_p_keep(x_sorted, p, min_keep):
    """How many leading entries of a row sorted largest first top-p keeps: up to and
    including the first where the running probability reaches p, at least min_keep."""
    n = x_sorted.shape[0]
    probs = np.empty(n, dtype=np.float32)
    softmax(x_sorted, probs)
    cum = 0.0
    for i in range(n):
        cum += np.float64(probs[i])
        if F32(cum) >= F32(p) and i + 1 >= min_keep:
            return i + 1
    return n


@njit(cache=True)
def min_p_threshold(x, p):
    """Scores below this have probability below p times the largest."""
    return max_f32(x) + F32(math.log(F32(p)))


@njit(cache=True)
def dist_select(x, rnd):
    """A categorical draw with uniform rnd in [0, 1): probabilities exp(x - max) summed in
    double; the first position where the running sum reaches rnd * total (never a
    zero-probability one)."""
    n = x.shape[0]
    m = max_f32(x)
    total = 0.0
    for i in range(n):
        total += np.float64(np.exp(x[i] - m))
    target = total * rnd
    run = 0.0
    last = -1
    for i in range(n):
        e = np.float64(np.exp(x[i] - m))
        if e == 0.0:
            continue
        last = i
        run += e
        if run >= target:
            return i
    return last


@njit(cache=True)
def exp_sum(row, scratch):
    """(max, sum(exp(row - max))) with scratch = exp(row - max), as ggml's log-softmax:
    float exp, double sum."""
    m = max_f32(row)
    for i in range(row.shape[0]):  # a loop, not scratch[:] = row: numba's slice assignment costs a second to compile
        scratch[i] = exp_f32(row[i] - m)
    return m, sum_f64(scratch)


def apply_penalties(x: np.ndarray, counts: np.ndarray, repeat: float, freq: float, present: float) -> np.ndarray:
    """Penalized copy of scores x given each entry's count: where count > 0, divided by
    repeat if positive (multiplied if not), minus count * freq + present."""
    out = np.array(x, dtype=np.float32)
    counts = np.asarray(counts, dtype=np.float32)
    seen = counts > 0  # a few dozen of the vocabulary: only they change
    r = F32(repeat)
    v, c = out[seen], counts[seen]
    v = np.where(v <= 0, v * r, v / r).astype(np.float32)
    out[seen] = v - (c * F32(freq) + F32(present)).astype(np.float32)
    return out
