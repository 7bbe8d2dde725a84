"""llama-perplexity's log-softmax of a logit row, bit for bit: the float32 maximum, libm's expf
of each float32 difference summed in double in row order, libm's log. Perplexity, the base
log-probabilities of KL-divergence runs and their statistics all start from it."""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange


# libm's expf, fast: exp in double (x = k ln2 + r, |r| <= ln2 / 2, e^r by a degree-8
# polynomial fitted on Chebyshev nodes: relative error 2^-39.7), rounded to float32. Where that
# double lies within 2^-31 of a float32 rounding midpoint (relative; the test is on the 29
# bits the rounding drops), libm's result may round the other way (glibc's expf is exact to
# 1.69 * 2^-34 before its rounding), so those inputs (~0.8% of a logit row) and x < -87
# (subnormal results) go to libm itself. Over every float32 x in [-87, 0] the results equal
# glibc's expf (checked exhaustively through expf_or_nan_row, all 1.1e9 inputs;
# test_perplexity.py checks a sample).
_EXP_SHIFT = float.fromhex("0x1.8p52")
_LOG2E = 1.4426950408889634
_LN2_HI = float.fromhex("0x1.62e42fee00000p-1")  # k * _LN2_HI exact for |k| < 2^21
_LN2_LO = float.fromhex("0x1.a39ef35793c76p-33")
_P = tuple(float.fromhex(h) for h in (
    "0x1.000000000003bp+0", "0x1.ffffffffd38b9p-1", "0x1.ffffffffe76d1p-2", "0x1.555555a26e86dp-3",
    "0x1.5555558894baap-5", "0x1.111080ad5ff96p-7", "0x1.6c162bf3b803ap-10", "0x1.a1aa7fd72aef8p-13",
    "0x1.a17daf8b769b0p-16"))
_NEAR = 1 << 21  # 2^-31 of the value, in units of its double's last bit (2^-52 of its binade)


@njit(cache=True, inline="always")
def _expf_or_nan(x):
    xd = np.float64(x)
    k = (xd * _LOG2E + _EXP_SHIFT) - _EXP_SHIFT
    r = (xd - k * _LN2_HI) - k * _LN2_LO
    p = _P[8]
    for j in range(7, -1, -1):
        p = p * r + _P[j]
    y = p * np.int64((np.int64(k) + 1023) << 52).view(np.float64)
    dropped = (np.float64(y).view(np.int64) & 0x1FFFFFFF) - 0x10000000  # from the midpoint
    sure = abs(dropped) > _NEAR and x >= np.float32(-87.0)
    return np.float32(y) if sure else np.float32(np.nan)


@njit(cache=True, fastmath={"contract"})
def expf_or_nan_row(x: np.ndarray, shift: np.float32, out: np.ndarray) -> None:
    """out[i] = libm's expf(x[i] - shift) (float32, x[i] <= shift) where the fast path above is
    sure of it, else NaN (vectorised; fma where LLVM likes)."""
    for i in range(x.shape[0]):
        out[i] = _expf_or_nan(x[i] - shift)


@njit(cache=True)
def row_extreme(row: np.ndarray, largest: bool) -> np.float32:
    """The largest (or smallest) logit, as std::max (std::min) over the row gives it (a NaN
    is passed over unless it comes first), in 16 running extremes that LLVM vectorises."""
    n = row.shape[0]
    acc = np.empty(16, dtype=np.float32)
    acc[:] = row[0]
    n16 = n - n % 16
    for i in range(0, n16, 16):
        for j in range(16):
            v = row[i + j]
            acc[j] = v if (v > acc[j] if largest else v < acc[j]) else acc[j]
    m = acc[0]
    for j in range(1, 16):
        m = acc[j] if (acc[j] > m if largest else acc[j] < m) else m
    for i in range(n16, n):
        m = row[i] if (row[i] > m if largest else row[i] < m) else m
    return m


@njit(cache=True)
def log_sum_exp_row(row: np.ndarray, e: np.ndarray) -> tuple[np.float32, float]:
    """(max, log(sum(expf(row - max)))) as llama-perplexity's log_softmax: float32 max, libm's
    expf of each float32 difference (above; numba's math.exp of a float32 is libm's expf),
    summed in double in row order, libm's log. e: scratch of the row's length."""
    m = row_extreme(row, True)
    expf_or_nan_row(row, m, e)
    total = 0.0
    for i in range(row.shape[0]):
        v = e[i]
        if v != v:
            v = math.exp(row[i] - m)
        total += np.float64(v)
    return m, math.log(total)


@njit(parallel=True, cache=True)
def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[target] per row, bit for bit as llama-perplexity's log_softmax:
    (float32 logit - max) - log(sum exp) in double (log_sum_exp_row); logits [n_seq,
    rows, n_vocab], targets [n_seq, rows]; rows in parallel, no temporaries beyond one row."""
    n_seq, n_rows = targets.shape
    n = n_seq * n_rows
    out = np.empty((n_seq, n_rows), dtype=np.float64)
    n_tasks = min(n, 64)  # one scratch row per task, not per row (262,144 floats on Gemma 3)
    for task in prange(n_tasks):
        e = np.empty(logits.shape[2], dtype=np.float32)
        for r in range(task * n // n_tasks, (task + 1) * n // n_tasks):
            s, i = r // n_rows, r % n_rows
            row = logits[s, i]
            m, lse = log_sum_exp_row(row, e)
            out[s, i] = -(np.float64(row[targets[s, i]] - m) - lse)
    return out
