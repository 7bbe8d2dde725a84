"""The log-probabilities llama-perplexity's task scores add up, bit for bit.

Two computations, as tools/perplexity/perplexity.cpp has them:
- `compute_logprobs` (every token after the first of an ending): float32 throughout — the
  row's maximum, libm's expf of each float32 difference summed in a float32 in row order,
  libm's logf of that sum, `logit - max - logf(sum)`.
- `softmax` (the first token of each ending, from the last shared token's logits): the
  float32 maximum, expf summed in a double, each probability rounded to float32, then
  libm's logf of the chosen one.
numba's math.exp / math.log of a float32 are libm's expf / logf; the fast expf of
llamapy.log_softmax (libm's to the bit) does most of each row.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ..log_softmax import expf_or_nan_row, row_extreme


@njit(cache=True)
def _float_sum_exp(row: np.ndarray, m: np.float32, e: np.ndarray) -> np.float32:
    """sum of expf(row - m) accumulated in a float32, in row order."""
    expf_or_nan_row(row, m, e)
    total = np.float32(0.0)
    for i in range(row.shape[0]):
        v = e[i]
        if v != v:
            v = np.float32(math.exp(row[i] - m))
        total += v
    return total


@njit(cache=True)
def _double_sum_exp(row: np.ndarray, m: np.float32, e: np.ndarray) -> float:
    """sum of expf(row - m) accumulated in a double, in row order."""
    expf_or_nan_row(row, m, e)
    total = 0.0
    for i in range(row.shape[0]):
        v = e[i]
        if v != v:
            v = np.float32(math.exp(row[i] - m))
        total += np.float64(v)
    return total


@njit(parallel=True, cache=True)
def token_logprobs(logits: np.ndarray, rows: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """llama-perplexity's compute_logprobs: log p(tokens[k]) under logits[rows[k]], float32."""
    n = rows.shape[0]
    out = np.empty(n, dtype=np.float32)
    n_tasks = min(n, 64)  # one scratch row per task
    for task in prange(n_tasks):
        e = np.empty(logits.shape[1], dtype=np.float32)
        for k in range(task * n // n_tasks, (task + 1) * n // n_tasks):
            row = logits[rows[k]]
            m = row_extreme(row, True)
            total = _float_sum_exp(row, m, e)
            out[k] = (row[tokens[k]] - m) - np.float32(math.log(total))
    return out


@njit(cache=True)
def softmax_logprobs(row: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """logf of llama-perplexity's softmax(row)[t] for each t of tokens, float32."""
    e = np.empty(row.shape[0], dtype=np.float32)
    m = row_extreme(row, True)
    total = _double_sum_exp(row, m, e)
    out = np.empty(tokens.shape[0], dtype=np.float32)
    for k in range(tokens.shape[0]):
        prob = np.float32(np.float64(np.float32(math.exp(row[tokens[k]] - m))) / total)
        out[k] = np.float32(math.log(prob))
    return out
