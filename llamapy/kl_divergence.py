"""KL divergence of a model's next-token distributions from a base model's, as
llama-perplexity's --kl-divergence computes it.

The base model's log-probabilities come from a file an earlier perplexity run wrote
(`llamapy.perplexity(..., kl_divergence_base=FILE)`, or llama-perplexity's
--kl-divergence-base; llamapy/kld_base.py), with the tokens of its chunks. The model is run
over the same chunks; for each scored token: its NLL and the base's, KL(base || model) over
the base's tokens within 16 nats of its top, whether both put the same token on top, and
Δp = p - p_base of the token that came. The statistics (means with their standard errors,
the correlation of the two log-perplexities, percentiles) are llama-perplexity's, in its
float32 and double roundings.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from numba import njit, prange

from .kld_base import ROWS_AT_ONCE, BaseLogProbs
from .log_softmax import expf_or_nan_row, log_sum_exp_row
from .model import Model
from .perplexity import decode_chunks, plan_chunks


@njit(parallel=True, cache=True)
def kld_rows(logits: np.ndarray, targets: np.ndarray, base_q: np.ndarray, base_params: np.ndarray,
             nll: np.ndarray, nll_base: np.ndarray, kld: np.ndarray, p_diff: np.ndarray,
             same_top: np.ndarray) -> None:
    """Per row (in parallel): the model's NLL of the target and the base's (float32), the KL
    divergence (double), Δp (float32) and whether the top tokens agree, in llama-perplexity's
    roundings. logits [n, n_vocab]; base_q [n, width] (the vocabulary from column 4),
    base_params [n, 2] (scale, min_log_prob)."""
    n, n_vocab = logits.shape
    for r in prange(n):
        row = logits[r]
        e = np.empty(n_vocab, dtype=np.float32)
        log_p_base = np.empty(n_vocab, dtype=np.float32)
        top, log_sum = log_sum_exp_row(row, e)
        top_token = 0
        while row[top_token] != top:  # the first largest, as a scan keeping strictly larger ones finds it
            top_token += 1
        log_norm = top + np.float32(log_sum)
        tok = targets[r]
        nll[r] = log_norm - row[tok]
        scale, low = base_params[r, 0], base_params[r, 1]
        nll_base[r] = -(scale * np.float32(base_q[r, 4 + tok]) + low)
        for i in range(n_vocab):
            log_p_base[i] = scale * np.float32(base_q[r, 4 + i]) + low
        base_top = 0
        for i in range(1, n_vocab):
            if log_p_base[i] > log_p_base[base_top]:
                base_top = i
        expf_or_nan_row(log_p_base, np.float32(0.0), e)
        total = 0.0
        for i in range(n_vocab):
            lp = log_p_base[i]
            if lp > np.float32(-16.0):
                p = e[i]
                if p != p:
                    p = math.exp(lp)
                total += np.float64(p * ((lp - row[i]) + log_norm))
        kld[r] = total
        same_top[r] = top_token == base_top
        p_diff[r] = np.float32(math.exp(-nll[r])) - np.float32(math.exp(-nll_base[r]))


def _ordered_sum(start: float, values: np.ndarray) -> float:
    """start + values[0] + values[1] + ..., added in that order as a loop adds them (np.sum
    would pair them)."""
    return float(np.add.accumulate(np.concatenate(([start], np.asarray(values, dtype=np.float64))))[-1])


def mean_and_error(total: float, total2: float, count: int) -> tuple[float, float]:
    """Mean and its standard error from the sums of values and squares (0 below 11 values)."""
    if count < 1:
        return 0.0, 0.0
    mean = total / count
    var = total2 / count - mean * mean
    return mean, math.sqrt(var / (count - 1)) if var > 0 and count > 10 else 0.0


def _divide(a: float, b: float) -> float:
    """a / b as C's doubles divide (inf or NaN by zero), for statistics of degenerate runs."""
    if b != 0:
        return a / b
    return math.nan if a == 0 or math.isnan(a) else math.copysign(math.inf, a) * math.copysign(1.0, b)


def percentile(values: np.ndarray, fraction: float) -> float:
    """llama-perplexity's percentile of sorted float32 values: linear between neighbours, in
    float32."""
    if fraction <= 0:
        return float(values[0])
    if fraction >= 1:
        return float(values[-1])
    p = np.float32(fraction) * np.float32(len(values) - 1)
    ip = int(p)
    p = np.float32(p - np.float32(ip))
    return float((np.float32(1) - p) * values[ip] + p * values[min(ip + 1, len(values) - 1)])


def median(values: np.ndarray) -> float:
    """The middle of sorted float32 values (the float32 mean of the two middle ones)."""
    n = len(values)
    return float(values[n // 2] if n % 2 else np.float32(0.5) * (values[n // 2] + values[n // 2 - 1]))


@dataclass
class KLDivergenceResult:
    """The sums over scored tokens (in token order) and each token's KLD and Δp; the
    statistics llama-perplexity prints are properties."""
    n_chunks: int = 0
    count: int = 0
    same_top: int = 0
    nll: float = 0.0
    nll2: float = 0.0
    nll_base: float = 0.0
    nll_base2: float = 0.0
    nll_nll_base: float = 0.0
    kld: float = 0.0
    kld2: float = 0.0
    p_diff: float = 0.0
    p_diff2: float = 0.0
    p_diff4: float = 0.0
    kld_values: list[np.ndarray] = field(default_factory=list)     # float32, one array per chunk
    p_diff_values: list[np.ndarray] = field(default_factory=list)

    def add(self, nll: np.ndarray, nll_base: np.ndarray, kld: np.ndarray, p_diff: np.ndarray,
            same_top: np.ndarray) -> None:
        """One chunk's tokens, in order (products of float32 values rounded to float32 first, as
        llama-perplexity's)."""
        self.nll = _ordered_sum(self.nll, nll)
        self.nll2 = _ordered_sum(self.nll2, nll * nll)
        self.nll_base = _ordered_sum(self.nll_base, nll_base)
        self.nll_base2 = _ordered_sum(self.nll_base2, nll_base * nll_base)
        self.nll_nll_base = _ordered_sum(self.nll_nll_base, nll * nll_base)
        self.kld = _ordered_sum(self.kld, kld)
        self.kld2 = _ordered_sum(self.kld2, kld * kld)
        p_diff2 = (p_diff * p_diff).astype(np.float64)
        self.p_diff = _ordered_sum(self.p_diff, p_diff)
        self.p_diff2 = _ordered_sum(self.p_diff2, p_diff2)
        self.p_diff4 = _ordered_sum(self.p_diff4, p_diff2 * p_diff2)
        self.same_top += int(same_top.sum())
        self.count += len(nll)
        self.n_chunks += 1
        self.kld_values.append(kld.astype(np.float32))
        self.p_diff_values.append(p_diff.copy())

    # ---- PPL of the model (Q) and of the base, and how they relate
    def log_ppl(self) -> tuple[float, float]:
        return mean_and_error(self.nll, self.nll2, self.count)

    def log_ppl_base(self) -> tuple[float, float]:
        return mean_and_error(self.nll_base, self.nll_base2, self.count)

    def ppl(self) -> tuple[float, float]:
        mean, err = self.log_ppl()
        return math.exp(mean), math.exp(mean) * err

    def ppl_base(self) -> tuple[float, float]:
        mean, err = self.log_ppl_base()
        return math.exp(mean), math.exp(mean) * err

    def log_ppl_covariance(self) -> float:
        if self.count < 10:
            return 0.0
        n = self.count
        return (self.nll_nll_base / n - (self.nll / n) * (self.nll_base / n)) / (n - 1)

    def log_ppl_correlation(self) -> float:
        return _divide(self.log_ppl_covariance(), self.log_ppl()[1] * self.log_ppl_base()[1])

    def log_ppl_ratio(self) -> tuple[float, float]:
        """ln(PPL(Q) / PPL(base)) and its error (the two log-PPLs are correlated)."""
        (a, da), (b, db) = self.log_ppl(), self.log_ppl_base()
        var = da * da + db * db - 2.0 * self.log_ppl_covariance()
        return a - b, math.sqrt(var) if var >= 0 else math.nan

    def ppl_ratio(self) -> tuple[float, float]:
        value, err = self.log_ppl_ratio()
        return math.exp(value), math.exp(value) * err

    def ppl_difference(self) -> tuple[float, float]:
        (q, dq), (b, db) = self.ppl(), self.ppl_base()
        var = dq * dq + db * db - 2.0 * q * b * self.log_ppl_covariance()
        return q - b, math.sqrt(var) if var >= 0 else math.nan

    # ---- KL divergence, probabilities of the tokens that came, top tokens
    def kl_divergence(self) -> tuple[float, float]:
        return mean_and_error(self.kld, self.kld2, self.count)

    def mean_p_diff(self) -> tuple[float, float]:
        return mean_and_error(self.p_diff, self.p_diff2, self.count)

    def rms_p_diff(self) -> tuple[float, float]:
        mse, err = mean_and_error(self.p_diff2, self.p_diff4, self.count)
        rms = math.sqrt(mse)
        return rms, _divide(0.5, rms) * err

    def same_top_fraction(self) -> tuple[float, float]:
        p = self.same_top / self.count
        return p, math.sqrt(_divide(p * (1 - p), self.count - 1))

    def sorted_kld(self) -> np.ndarray:
        return np.sort(np.concatenate(self.kld_values))

    def sorted_p_diff(self) -> np.ndarray:
        return np.sort(np.concatenate(self.p_diff_values))


def kl_divergence(model: Model, base: str | os.PathLike | BaseLogProbs, n_batch: int = 2048, n_ubatch: int = 512,
                  n_chunks: int = -1, n_threads: int | None = None,
                  on_chunk: Callable[[int, int, KLDivergenceResult], None] | None = None, adapters=(),
                  on_pass: Callable[[int, int], None] | None = None, **context_args) -> KLDivergenceResult:
    """Run `model` over the chunks of a base log-probabilities file (its tokens, its n_ctx) and
    compare it with them; `n_chunks` >= 0 stops after that many. `on_chunk(i, n_chunk,
    result)` reports each chunk, `on_pass` and `adapters` as in `llamapy.perplexity.perplexity`."""
    if not isinstance(base, BaseLogProbs):
        base = BaseLogProbs.open(base)
    base.require_vocabulary(model.hparams.n_vocab)
    # as llama-perplexity: a batch of n_batch tokens takes as many whole chunks as fit in it
    n_batch = n_batch if n_batch < base.n_ctx else n_batch // base.n_ctx * base.n_ctx
    plan = plan_chunks(len(base.tokens), base.n_ctx, n_batch, n_ubatch, n_chunks)
    shape = (plan.n_seq, plan.n_scored)
    nll, nll_base, p_diff = np.empty(shape, np.float32), np.empty(shape, np.float32), np.empty(shape, np.float32)
    kld, same_top = np.empty(shape), np.empty(shape, np.bool_)

    def score(chunk0: int, row0: int, logits: np.ndarray, targets: np.ndarray) -> None:
        for s in range(targets.shape[0]):
            for r0 in range(0, targets.shape[1], ROWS_AT_ONCE):
                r1 = min(r0 + ROWS_AT_ONCE, targets.shape[1])
                q, params = base.block(chunk0 + s, row0 + r0, row0 + r1)
                rows = slice(row0 + r0, row0 + r1)
                kld_rows(logits[s, r0:r1], targets[s, r0:r1], q, params, nll[s, rows], nll_base[s, rows],
                         kld[s, rows], p_diff[s, rows], same_top[s, rows])

    result = KLDivergenceResult()
    for chunks in decode_chunks(model, base.tokens, plan, score, n_threads, adapters, **context_args):
        for s in range(len(chunks)):
            result.add(nll[s], nll_base[s], kld[s], p_diff[s], same_top[s])
            if on_chunk:
                on_chunk(result.n_chunks, plan.n_chunk, result)
        if on_pass:
            on_pass(result.n_chunks, plan.n_chunk)
    return result
