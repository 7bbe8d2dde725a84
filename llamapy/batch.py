"""Batches of tokens for `Context.decode`, and their split into micro-batches (ubatches).

A `Batch` is what the user submits (llama_batch): tokens with positions, a sequence id
each, and which tokens' logits to output. The context computes it as ubatches of at
most n_ubatch tokens; that split never changes results beyond float rounding.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
from numba import njit

from .errors import InputError


@dataclass
class Batch:
    tokens: np.ndarray            # int32 [n]
    pos: np.ndarray | None = None     # int32 [n]; None: continue each sequence where it ended
    seq_id: np.ndarray | None = None  # int32 [n]; None: all sequence 0
    output: np.ndarray | None = None  # bool [n]; None: only the last token
    # uint64 [n]: bit s set when sequence s shares the token's cell too (llama_batch's further
    # seq ids: a prompt several sequences continue, decoded once); None: seq_id's alone
    seq_shared: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.tokens = np.ascontiguousarray(self.tokens, dtype=np.int32).reshape(-1)
        n = len(self.tokens)
        if self.pos is not None:
            self.pos = np.ascontiguousarray(self.pos, dtype=np.int32).reshape(-1)
        if self.seq_id is None:
            self.seq_id = np.zeros(n, dtype=np.int32)
        else:
            self.seq_id = np.ascontiguousarray(self.seq_id, dtype=np.int32).reshape(-1)
        if self.output is None:
            self.output = np.zeros(n, dtype=bool)
            if n:
                self.output[-1] = True
        else:
            self.output = np.ascontiguousarray(self.output, dtype=bool).reshape(-1)
        if self.seq_shared is not None:
            self.seq_shared = np.ascontiguousarray(self.seq_shared, dtype=np.uint64).reshape(-1)
        for name in ("pos", "seq_id", "output", "seq_shared"):
            arr = getattr(self, name)
            if arr is not None and len(arr) != n:
                raise InputError(f"batch has {n} tokens but {len(arr)} {name} entries")

    @classmethod
    def from_tokens(cls, tokens, pos0: int = 0, seq_id: int = 0, all_outputs: bool = False) -> "Batch":
        """One sequence's tokens at positions pos0, pos0+1, ..."""
        tokens = np.array(tokens, dtype=np.int32).reshape(-1)
        n = len(tokens)
        # every array made here already has its type and length: skip __post_init__'s checks
        # (a generation step makes one of these per token)
        batch = cls.__new__(cls)
        batch.tokens = tokens
        batch.pos = np.arange(pos0, pos0 + n, dtype=np.int32)
        batch.seq_id = np.empty(n, dtype=np.int32)
        batch.seq_id.fill(seq_id)
        if all_outputs:
            batch.output = np.ones(n, dtype=bool)
        else:
            batch.output = np.zeros(n, dtype=bool)
            if n:
                batch.output[-1] = True
        return batch

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class UBatch:
    """A micro-batch laid out stream-major: n_seqs streams (stream0, stream0+1, ...) of
    n_seq_tokens tokens each. `idx` maps each token back to its index in the batch."""

    tokens: np.ndarray
    pos: np.ndarray
    seq_id: np.ndarray
    output: np.ndarray
    idx: np.ndarray
    n_seq_tokens: int
    n_seqs: int
    stream0: int
    seq_shared: np.ndarray | None = None  # Batch.seq_shared's bits of these tokens

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @cached_property
    def n_outputs(self) -> int:
        return int(self.output.sum())


def _take(batch: Batch, idx: np.ndarray, n_seq_tokens: int, n_seqs: int, stream0: int) -> UBatch:
    shared = None if batch.seq_shared is None else batch.seq_shared[idx]
    return UBatch(batch.tokens[idx], batch.pos[idx], batch.seq_id[idx], batch.output[idx], idx,
                  n_seq_tokens, n_seqs, stream0, shared)


def split_simple(batch: Batch, n_ubatch: int) -> list[UBatch]:
    """Consecutive runs of at most n_ubatch tokens (one stream: the unified KV cache)."""
    out = []
    for start in range(0, len(batch), n_ubatch):
        stop = min(start + n_ubatch, len(batch))
        run = slice(start, stop)  # views, not copies: a run is contiguous
        shared = None if batch.seq_shared is None else batch.seq_shared[run]
        out.append(UBatch(batch.tokens[run], batch.pos[run], batch.seq_id[run], batch.output[run],
                          np.arange(start, stop), stop - start, 1, 0, shared))
    return out


def split_equal(batch: Batch, n_ubatch: int) -> list[UBatch]:
    """Equal-length runs from a contiguous range of sequences (one KV stream per sequence).

    Each ubatch takes the same number of tokens from every sequence in the range, so
    attention runs as one batched product over streams.
    """
    order = np.argsort(batch.seq_id, kind="stable")  # each sequence's tokens, in batch order
    seqs, starts, counts = np.unique(batch.seq_id[order], return_index=True, return_counts=True)
    pending = {int(s): order[a:a + n] for s, a, n in zip(seqs, starts, counts)}
    cursor = {s: 0 for s in pending}
    out = []
    while True:
        live = [s for s in sorted(pending) if cursor[s] < len(pending[s])]
        if not live:
            return out
        run = [live[0]]
        for s in live[1:]:
            if s != run[-1] + 1 or len(run) >= n_ubatch:
                break
            run.append(s)
        n_seq_tokens = min(min(len(pending[s]) - cursor[s] for s in run), max(1, n_ubatch // len(run)))
        idx = np.concatenate([pending[s][cursor[s]:cursor[s] + n_seq_tokens] for s in run])
        for s in run:
            cursor[s] += n_seq_tokens
        out.append(_take(batch, idx, n_seq_tokens, len(run), run[0]))


@njit(cache=True)
def all_within(values, n):
    """Whether every value is in [0, n) (a decode's check of its token and sequence ids)."""
    for v in values:
        if v < 0 or v >= n:
            return False
    return True
