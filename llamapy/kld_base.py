"""The base model's log-probabilities that a KL-divergence run compares another model with:
llama-perplexity's `--kl-divergence-base` file, byte for byte.

Layout (little-endian):

    "_logits_"                     8 bytes
    n_ctx, n_vocab, n_chunk        int32 each
    tokens                         n_chunk * n_ctx int32: the chunks as tokenized (no BOS put in)
    then, chunk after chunk, one row per scored token (n_ctx - 1 - n_ctx / 2 rows a chunk):
        scale, min_log_prob        float32 each (the row's first 4 uint16)
        q[0 .. n_vocab)            uint16: log p(token i) = scale * q[i] + min_log_prob
        0                          one uint16 of padding when n_vocab is odd

A row keeps the 16 nats below its largest logit: q = 0 at and below max - 16 (or the row's
smallest logit, if higher), 65535 at the largest. The numbers are llama-perplexity's float32
arithmetic, so the same logits give the same bytes.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeVar

import numpy as np
from numba import njit, prange

from .atomic import replace_atomically
from .errors import InputError
from .log_softmax import log_sum_exp_row, row_extreme

MAGIC = b"_logits_"
HEADER_BYTES = len(MAGIC) + 3 * 4
ROWS_AT_ONCE = 32  # rows quantized and written together (16 MB at a time on Gemma 3's vocabulary)
T = TypeVar("T")


def row_width(n_vocab: int) -> int:
    """uint16 per row: the two float32 and the vocabulary, padded to an even count."""
    return 2 * ((n_vocab + 1) // 2) + 4


def file_size(n_ctx: int, n_vocab: int, n_chunk: int) -> int:
    """Bytes of a file of n_chunk chunks of n_ctx tokens over n_vocab tokens."""
    n_scored = n_ctx - 1 - n_ctx // 2
    return HEADER_BYTES + 4 * n_ctx * n_chunk + 2 * n_chunk * n_scored * row_width(n_vocab)


@njit(parallel=True, cache=True)
def quantize_log_probs(logits: np.ndarray, targets: np.ndarray, q: np.ndarray, params: np.ndarray) -> np.ndarray:
    """llama-perplexity's log_softmax of the base model, row by row in parallel: each row's
    log-probabilities as q[r, 4:4 + n_vocab] with params[r] = (scale, min_log_prob), and the
    NLL of its target as that mode rounds it, float32 (max + float32(log sum)) - logit."""
    n, n_vocab = logits.shape
    nll = np.empty(n, dtype=np.float64)
    for r in prange(n):
        row = logits[r]
        e = np.empty(n_vocab, dtype=np.float32)
        top, log_sum = log_sum_exp_row(row, e)
        low = top - np.float32(16.0)
        bottom = row_extreme(row, False)
        bottom = low if bottom < low else bottom
        log_sum32 = np.float32(log_sum)
        scale = (top - bottom) / np.float32(65535.0)
        params[r, 0] = scale
        params[r, 1] = (bottom - top) - log_sum32
        if scale != 0:
            inv_scale = np.float32(1.0) / scale
            for i in range(n_vocab):
                x = row[i]
                level = np.uint16(0)
                if x > bottom:  # nearest integer, ties to even, as the float32 sum with 1.5 * 2^23 rounds
                    level = np.uint16((np.int32(inv_scale * (x - bottom) + np.float32(12582912.0)) - 12582912)
                                      & 0xFFFF)
                q[r, 4 + i] = level
        else:
            q[r, 4:4 + n_vocab] = 0
        nll[r] = np.float64((top + log_sum32) - row[targets[r]])
    return nll


class BaseLogProbsWriter:
    """Writes the rows of a perplexity run as they are scored (they come in file order: chunk
    after chunk, each chunk's rows in order)."""

    def __init__(self, out: BinaryIO, n_vocab: int) -> None:
        self.out = out
        self.n_vocab = n_vocab

    def score(self, logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
        """Write the rows of logits [chunks, rows, n_vocab]; the NLLs of targets [chunks, rows]."""
        nll = np.empty(targets.shape)
        q = np.zeros((ROWS_AT_ONCE, row_width(self.n_vocab)), dtype="<u2")
        params = np.empty((ROWS_AT_ONCE, 2), dtype="<f4")
        for s in range(targets.shape[0]):
            for r0 in range(0, targets.shape[1], ROWS_AT_ONCE):
                n = min(ROWS_AT_ONCE, targets.shape[1] - r0)
                nll[s, r0:r0 + n] = quantize_log_probs(logits[s, r0:r0 + n], targets[s, r0:r0 + n], q[:n], params[:n])
                q[:n, :4] = params[:n].view("<u2")
                self.out.write(q[:n].tobytes())
        return nll


def write_base_log_probs(path: str | os.PathLike, tokens: np.ndarray, n_ctx: int, n_vocab: int,
                         run: Callable[[BaseLogProbsWriter], T]) -> T:
    """Write `path` atomically: the header and tokens (whole chunks of n_ctx), then the rows
    that `run` scores through the writer it is given; returns what `run` returns."""
    n_chunk = len(tokens) // n_ctx
    result = []

    def write(out: BinaryIO) -> None:
        out.write(MAGIC + np.array([n_ctx, n_vocab, n_chunk], dtype="<i4").tobytes())
        out.write(np.asarray(tokens[:n_chunk * n_ctx], dtype="<i4").tobytes())
        result.append(run(BaseLogProbsWriter(out, n_vocab)))

    replace_atomically(path, write, "the base log-probabilities", validate=BaseLogProbs.open)  # read back as read
    return result[0]


@dataclass(frozen=True)
class BaseLogProbs:
    """A --kl-divergence-base file, checked (`open`) and memory-mapped: its rows are read as
    the run reaches them."""
    path: Path
    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: np.ndarray  # [n_chunk * n_ctx] int32
    rows: np.ndarray    # [n_chunk, n_scored, row_width(n_vocab)] uint16, memory-mapped

    @classmethod
    def open(cls, path: str | os.PathLike) -> BaseLogProbs:
        """Check the file: InputError if it is missing, not such a file, truncated or longer,
        or its header or tokens are impossible."""
        path = Path(path)
        if not path.is_file():
            raise InputError(f"base log-probabilities file not found: {path}")
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(HEADER_BYTES)
        except OSError as e:
            raise InputError(f"cannot read {path}: {e.strerror}") from None
        if len(head) < len(MAGIC) or head[:len(MAGIC)] != MAGIC:
            raise InputError(f"{path} is not a file of base log-probabilities (it does not start with "
                             f"{MAGIC.decode()}, as llama-perplexity's --kl-divergence-base files do)")
        if len(head) < HEADER_BYTES:
            raise InputError(f"{path} is truncated: {size} bytes, not even its header")
        n_ctx, n_vocab, n_chunk = (int(v) for v in np.frombuffer(head, dtype="<i4", offset=len(MAGIC)))
        if n_ctx < 4 or n_vocab < 1 or n_chunk < 1:
            raise InputError(f"{path} is corrupt: its header says n_ctx {n_ctx}, n_vocab {n_vocab}, "
                             f"n_chunk {n_chunk}")
        expected = file_size(n_ctx, n_vocab, n_chunk)
        if size != expected:
            what = "is truncated" if size < expected else f"has {size - expected} bytes too many"
            raise InputError(f"{path} {what}: {n_chunk} chunks of {n_ctx} tokens over a vocabulary of {n_vocab} "
                             f"take {expected} bytes, the file has {size}")
        n_tokens = n_ctx * n_chunk
        tokens = np.array(np.memmap(path, dtype="<i4", mode="r", offset=HEADER_BYTES, shape=(n_tokens,)),
                          dtype=np.int32)
        bad = np.flatnonzero((tokens < 0) | (tokens >= n_vocab))
        if len(bad):
            raise InputError(f"{path} is corrupt: its token {bad[0]} is {tokens[bad[0]]}, outside the vocabulary of "
                             f"{n_vocab} tokens")
        rows = np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES + 4 * n_tokens,
                         shape=(n_chunk, n_ctx - 1 - n_ctx // 2, row_width(n_vocab)))
        return cls(path, n_ctx, n_vocab, n_chunk, tokens, rows)

    def require_vocabulary(self, n_vocab: int) -> None:
        """InputError unless the file's rows are over a vocabulary of n_vocab tokens."""
        if self.n_vocab != n_vocab:
            raise InputError(f"{self.path} holds log-probabilities over {self.n_vocab} tokens, but the model's "
                             f"vocabulary has {n_vocab}: it was made with another model family")

    def block(self, chunk: int, r0: int, r1: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows r0..r1 of a chunk: (their q rows [rows, width] uint16, with the vocabulary at
        4.., read in place; their (scale, min_log_prob) [rows, 2] float32). InputError if a
        row's numbers cannot be log-probabilities (a corrupt file)."""
        q = self.rows[chunk, r0:r1]
        params = np.ascontiguousarray(q[:, :4]).view("<f4")
        scale, low = params[:, 0], params[:, 1]
        bad = np.flatnonzero(~(np.isfinite(scale) & (scale >= 0) & np.isfinite(low) & (low <= 0)))
        if len(bad):
            raise InputError(f"{self.path} is corrupt: row {r0 + bad[0]} of chunk {chunk + 1} has scale "
                             f"{scale[bad[0]]} and minimum log-probability {low[bad[0]]}")
        return q, params
