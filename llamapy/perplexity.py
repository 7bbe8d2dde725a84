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

One loop decodes the chunks (`decode_chunks`) and hands each decode's scored rows to a
consumer: the NLLs of `perplexity`, the base file writer of a KL-divergence run
(kld_base.py), the comparison with such a file (kl_divergence.py).
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from .batch import Batch
from .context import Context
from .errors import InputError
from .kld_base import write_base_log_probs
from .log_softmax import token_nll
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


@dataclass(frozen=True)
class ChunkPlan:
    """How the tokens are cut and decoded (module docstring): n_chunk chunks of n_ctx tokens,
    n_seq of them per decode, n_batch tokens of each per decode."""
    n_ctx: int
    n_chunk: int
    n_seq: int
    n_batch: int
    n_ubatch: int

    @property
    def first(self) -> int:
        """The first position whose logits are scored (it predicts the token after it)."""
        return self.n_ctx // 2

    @property
    def n_scored(self) -> int:
        """Scored tokens per chunk."""
        return self.n_ctx - self.first - 1


def plan_chunks(n_tokens: int, n_ctx: int, n_batch: int = 2048, n_ubatch: int = 512, n_chunks: int = -1) -> ChunkPlan:
    """llama-perplexity's chunks of `n_tokens` tokens, all of them or the first `n_chunks`
    (InputError when they cannot be made)."""
    if n_ctx < 4:
        raise InputError(f"context size {n_ctx} is too small for perplexity")
    if n_tokens < n_ctx:
        raise InputError(f"{n_tokens} tokens do not make a chunk of {n_ctx}")
    if not (n_batch < n_ctx or n_batch % n_ctx == 0):
        raise InputError(f"n_batch ({n_batch}) must be smaller than n_ctx ({n_ctx}) or a multiple of it")
    n_chunk_max = n_tokens // n_ctx
    n_chunk = n_chunk_max if n_chunks < 0 else min(n_chunks, n_chunk_max)
    # chunks per decode: as many as one ubatch holds (see the module docstring)
    n_seq = min(max(1, min(n_batch, n_ubatch) // n_ctx), n_chunk)
    n_batch = min(n_batch, n_ctx * n_seq)
    return ChunkPlan(n_ctx, n_chunk, n_seq, n_batch, min(n_ubatch, n_batch))


# score(chunk0, row0, logits, targets): the scored rows row0.. of chunks chunk0.. that one decode
# produced, logits [chunks, rows, n_vocab] (read in place: valid until the next decode) and the
# tokens they predict [chunks, rows]
ScoreRows = Callable[[int, int, np.ndarray, np.ndarray], None]


def decode_chunks(model: Model, tokens: np.ndarray, plan: ChunkPlan, score: ScoreRows, n_threads: int | None = None,
                  adapters=(), **context_args) -> Iterator[range]:
    """Decode the planned chunks of `tokens` as llama-perplexity does (each from an empty KV
    cache, its first token replaced by BOS), handing each decode's scored rows to `score`;
    yields the chunks of each pass once they are scored. `adapters`: (LoraAdapter, scale)
    pairs applied to the model."""
    n_ctx, n_seq, n_batch = plan.n_ctx, plan.n_seq, plan.n_batch
    ctx = Context(model, n_ctx=n_ctx * n_seq, n_batch=n_batch, n_ubatch=plan.n_ubatch, n_seq_max=n_seq,
                  n_threads=n_threads, kv_unified=False, **context_args)
    for adapter, scale in adapters:
        ctx.attach_lora(adapter, scale)
    bos = model.vocab.bos_id if model.vocab.add_bos else None
    first = plan.first
    for i in range(0, plan.n_chunk, n_seq):
        n_seq_batch = min(n_seq, plan.n_chunk - i)
        chunk = tokens[i * n_ctx:(i + n_seq_batch) * n_ctx].reshape(n_seq_batch, n_ctx)
        ctx.memory_clear()
        for lo in range(0, n_ctx, n_batch):
            hi = min(n_ctx, lo + n_batch)
            part = chunk[:, lo:hi].copy()
            if lo == 0 and bos is not None:
                part[:, 0] = bos
            ctx.decode(Batch(part.reshape(-1), *_batch_layout(n_seq_batch, lo, hi, first)))
            s0, s1 = max(lo, first), min(hi, n_ctx - 1)  # positions predicting a next token
            if s1 > s0:
                # scored rows straight from the context's logits (no copy of [tokens, n_vocab])
                logits = ctx.get_logits().reshape(n_seq_batch, -1, model.hparams.n_vocab)
                score(i, s0 - first, logits[:, :s1 - s0], chunk[:, s0 + 1:s1 + 1])
        yield range(i, i + n_seq_batch)


def perplexity(model: Model, tokens: Sequence[int], n_ctx: int, n_batch: int = 2048, n_ubatch: int = 512,
               n_chunks: int = -1, n_threads: int | None = None,
               on_chunk: Callable[[int, int, float], None] | None = None, adapters=(),
               on_pass: Callable[[int, int], None] | None = None, kl_divergence_base: str | os.PathLike | None = None,
               **context_args) -> PerplexityResult:
    """Score `tokens` (already tokenized with BOS); `on_chunk(i, n_chunk, running_ppl)` reports
    each chunk, `on_pass(n_done, n_chunk)` each pass (the chunks one decode scores together:
    the time between passes is what an ETA can use). `adapters`: (LoraAdapter, scale) pairs
    applied to the model. `kl_divergence_base`: also write the log-probabilities of every
    scored token there, llama-perplexity's --kl-divergence-base file that
    `llamapy.kl_divergence.kl_divergence` compares another model with (its NLLs are then
    rounded to float32 as llama-perplexity rounds them in that mode)."""
    tokens = np.asarray(tokens, dtype=np.int32)
    if len(tokens) < 2 * n_ctx:
        raise InputError(f"you need at least {2 * n_ctx} tokens to evaluate perplexity with a context of {n_ctx}; "
                         f"the text tokenizes to only {len(tokens)} tokens")
    plan = plan_chunks(len(tokens), n_ctx, n_batch, n_ubatch, n_chunks)

    def run(nll_rows: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> PerplexityResult:
        nll = np.empty((plan.n_seq, plan.n_scored))

        def score(chunk0: int, row0: int, logits: np.ndarray, targets: np.ndarray) -> None:
            nll[:len(targets), row0:row0 + targets.shape[1]] = nll_rows(logits, targets)

        result = PerplexityResult()
        for chunks in decode_chunks(model, tokens, plan, score, n_threads, adapters, **context_args):
            for s in range(len(chunks)):
                total, total2 = _sums(nll[s])
                result.nll += total
                result.nll2 += total2
                result.count += plan.n_scored
                result.n_chunks += 1
                result.running.append(result.ppl)
                if on_chunk:
                    on_chunk(result.n_chunks, plan.n_chunk, result.ppl)
            if on_pass:
                on_pass(result.n_chunks, plan.n_chunk)
        return result

    if kl_divergence_base is None:
        return run(token_nll)
    return write_base_log_probs(kl_divergence_base, tokens[:plan.n_chunk * n_ctx], n_ctx, model.hparams.n_vocab,
                                lambda writer: run(writer.score))
