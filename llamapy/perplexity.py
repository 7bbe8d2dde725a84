"""Perplexity the way llama.cpp's llama-perplexity computes it.

The text is tokenized once (BOS first), cut into non-overlapping chunks of n_ctx
tokens; each chunk starts from an empty KV cache with its first token replaced by BOS,
and only its second half is scored (positions n_ctx/2 .. n_ctx-2 predicting the next
token). When a ubatch holds several chunks (n_batch and n_ubatch both >= 2 n_ctx) they
are decoded together, one KV stream each. Otherwise each decode takes one chunk: the
ubatches computed are the same as with llama.cpp's n_batch / n_ctx chunks per decode
(a ubatch never mixes sequences then), but only one chunk's logits exist at a time
(n_ctx / 2 rows of n_vocab floats, read in place from the compute buffer). The ± is
the standard error of the mean NLL propagated to PPL.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from numba import njit, prange

from .batch import Batch
from .context import Context
from .errors import InputError
from .model import Model


@dataclass
class PerplexityResult:
    n_chunks: int = 0
    count: int = 0          # scored tokens
    nll: float = 0.0        # sums over scored tokens
    nll2: float = 0.0
    running: list[float] = field(default_factory=list)  # PPL after each chunk

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count)

    @property
    def ppl_error(self) -> float:
        """Standard error of the mean NLL, times PPL (NaN when undefined)."""
        mean = self.nll / self.count
        var = self.nll2 / self.count - mean * mean
        if var <= 0 or self.count < 2:
            return float("nan")
        return math.sqrt(var / (self.count - 1)) * self.ppl


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
def _row_max(row: np.ndarray) -> np.float32:
    """The largest logit, as std::max over the row gives it (a NaN is passed over unless it
    comes first), in 16 running maxima that LLVM vectorises."""
    n = row.shape[0]
    acc = np.empty(16, dtype=np.float32)
    acc[:] = row[0]
    n16 = n - n % 16
    for i in range(0, n16, 16):
        for j in range(16):
            v = row[i + j]
            acc[j] = v if v > acc[j] else acc[j]
    m = acc[0]
    for j in range(1, 16):
        m = acc[j] if acc[j] > m else m
    for i in range(n16, n):
        m = row[i] if row[i] > m else m
    return m


@njit(cache=True)
def _log_sum_exp_row(row: np.ndarray, e: np.ndarray) -> tuple[np.float32, float]:
    """(max, log(sum(expf(row - max)))) as llama-perplexity's log_softmax: float32 max, libm's
    expf of each float32 difference (above; numba's math.exp of a float32 is libm's expf),
    summed in double in row order, libm's log. e: scratch of the row's length."""
    m = _row_max(row)
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
    (float32 logit - max) - log(sum exp) in double (_log_sum_exp_row); logits [n_seq,
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
            m, lse = _log_sum_exp_row(row, e)
            out[s, i] = -(np.float64(row[targets[s, i]] - m) - lse)
    return out


def _sums(nll: np.ndarray) -> tuple[float, float]:
    """A chunk's sum of NLLs and of their squares, added in token order from 0.0 as
    llama-perplexity adds them (one thread's order: with more its sums differ by rounding
    from run to run)."""
    total = total2 = 0.0
    for v in nll.tolist():
        total += v
        total2 += v * v
    return total, total2


def _batch_layout(n_seq: int, lo: int, hi: int, first: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions, sequence ids and output flags of a decode of positions [lo, hi) of n_seq chunks."""
    pos = np.tile(np.arange(lo, hi, dtype=np.int32), n_seq)
    seq = np.repeat(np.arange(n_seq, dtype=np.int32), hi - lo)
    return pos, seq, pos >= first


def perplexity(model: Model, tokens: Sequence[int], n_ctx: int, n_batch: int = 2048, n_ubatch: int = 512,
               n_chunks: int = -1, n_threads: int | None = None,
               on_chunk: Callable[[int, int, float], None] | None = None, adapters=(),
               on_pass: Callable[[int, int], None] | None = None, **context_args) -> PerplexityResult:
    """Score `tokens` (already tokenized with BOS); `on_chunk(i, n_chunk, running_ppl)` reports
    each chunk, `on_pass(n_done, n_chunk)` each pass (the chunks one decode scores together:
    the time between passes is what an ETA can use). `adapters`: (LoraAdapter, scale) pairs
    applied to the model."""
    tokens = np.asarray(tokens, dtype=np.int32)
    if n_ctx < 4:
        raise InputError(f"context size {n_ctx} is too small for perplexity")
    if len(tokens) < 2 * n_ctx:
        raise InputError(f"you need at least {2 * n_ctx} tokens to evaluate perplexity with a context of {n_ctx}; "
                         f"the text tokenizes to only {len(tokens)} tokens")
    if not (n_batch < n_ctx or n_batch % n_ctx == 0):
        raise InputError(f"n_batch ({n_batch}) must be smaller than n_ctx ({n_ctx}) or a multiple of it")
    n_chunk_max = len(tokens) // n_ctx
    n_chunk = n_chunk_max if n_chunks < 0 else min(n_chunks, n_chunk_max)
    # chunks per decode: as many as one ubatch holds (see the module docstring)
    n_seq = max(1, min(n_batch, n_ubatch) // n_ctx)
    n_seq = min(n_seq, n_chunk)
    n_batch = min(n_batch, n_ctx * n_seq)
    ctx = Context(model, n_ctx=n_ctx * n_seq, n_batch=n_batch, n_ubatch=min(n_ubatch, n_batch), n_seq_max=n_seq,
                  n_threads=n_threads, kv_unified=False, **context_args)
    for adapter, scale in adapters:
        ctx.attach_lora(adapter, scale)
    bos = model.vocab.bos_id if model.vocab.add_bos else None
    first = n_ctx // 2
    n_scored = n_ctx - first - 1
    num_batches = -(-n_ctx // n_batch)
    result = PerplexityResult()

    for i in range(0, n_chunk, n_seq):
        n_seq_batch = min(n_seq, n_chunk - i)
        chunk = tokens[i * n_ctx:(i + n_seq_batch) * n_ctx].reshape(n_seq_batch, n_ctx)
        ctx.memory_clear()
        nll = np.empty((n_seq_batch, n_scored))
        for j in range(num_batches):
            lo, hi = j * n_batch, min(n_ctx, (j + 1) * n_batch)
            part = chunk[:, lo:hi].copy()
            if j == 0 and bos is not None:
                part[:, 0] = bos
            ctx.decode(Batch(part.reshape(-1), *_batch_layout(n_seq_batch, lo, hi, first)))
            s0, s1 = max(lo, first), min(hi, n_ctx - 1)  # positions predicting a next token
            if s1 > s0:
                # scored rows straight from the context's logits (no copy of [tokens, n_vocab])
                logits = ctx.get_logits().reshape(n_seq_batch, -1, model.hparams.n_vocab)
                nll[:, s0 - first:s1 - first] = token_nll(logits[:, :s1 - s0], chunk[:, s0 + 1:s1 + 1])
        for s in range(n_seq_batch):
            total, total2 = _sums(nll[s])
            result.nll += total
            result.nll2 += total2
            result.count += n_scored
            result.n_chunks += 1
            result.running.append(result.ppl)
            if on_chunk:
                on_chunk(result.n_chunks, n_chunk, result.ppl)
        if on_pass:
            on_pass(result.n_chunks, n_chunk)
    return result
