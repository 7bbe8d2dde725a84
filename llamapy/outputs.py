"""What the last decode produced: its output tokens' logits, in batch order, what a graph
sampled for tokens whose sequence has a sampler chain in the graph, and, in a context that
computes embeddings, each output token's embedding (the normed last hidden state) and each
sequence's pooled one (llama.cpp's embd and embd_seq).

The logits are gathered into a buffer the context keeps, or, for a batch computed as one
ubatch in batch order, read in place from the compute buffer (valid until the next
decode, as llama.cpp's).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .errors import InputError


class Outputs:
    """Owned by a Context: decode fills it, the get_* methods and saved states read it."""

    def __init__(self, n_vocab: int) -> None:
        self.n_vocab = n_vocab
        self._buffer = np.empty((0, n_vocab), dtype=np.float32)  # grows to the largest batch's outputs
        self._row = np.empty(0, dtype=np.int64)  # batch index -> logits row, -1 if none
        self._n = 0
        self._in_place = False
        self._logits = self._buffer  # where the rows are: the buffer or the compute buffer
        self._sampled: dict[int, object] = {}  # batch index -> SampledRow
        self._embd = np.empty((0, 0), dtype=np.float32)  # output row -> embedding (embeddings on)
        self._embd_seq: dict[int, np.ndarray] = {}  # sequence -> pooled embedding (pooling on)
        self._has_embd = False

    # ---- filled by decode ----------------------------------------------------------------
    def start(self, output: np.ndarray, in_place: bool, n_embd: int = 0) -> None:
        """A new batch whose tokens with `output` set give a row; with `in_place`, its
        single ubatch's rows will be read where the graph left them; with `n_embd`, each
        row has an embedding of that size too."""
        self._row = np.empty(len(output), dtype=np.int64)
        self._n = output_rows(output, self._row)
        self._in_place = in_place
        if not in_place and self._buffer.shape[0] < self._n:
            self._buffer = np.empty((self._n, self.n_vocab), dtype=np.float32)
        self._logits = self._buffer
        self._sampled = {}
        self._has_embd = n_embd > 0
        self._embd_seq = {}
        if self._has_embd and (self._embd.shape[0] < self._n or self._embd.shape[1] != n_embd):
            self._embd = np.empty((max(self._n, self._embd.shape[0]), n_embd), dtype=np.float32)

    def place(self, batch_idx: np.ndarray, output: np.ndarray | None, logits: np.ndarray) -> None:
        """The logits of batch tokens batch_idx[output] (output None: all of batch_idx), one
        row each, from a ubatch's graph."""
        if self._in_place:
            self._logits = logits
        else:
            self._buffer[self._row[batch_idx if output is None else batch_idx[output]]] = logits

    def place_embeddings(self, batch_idx: np.ndarray, embd: np.ndarray) -> None:
        """The embeddings of batch tokens batch_idx (all outputs), one row each."""
        self._embd[self._row[batch_idx]] = embd

    def set_pooled(self, seq: int, vector: np.ndarray) -> None:
        """A sequence's pooled embedding (a later ubatch of the same sequence replaces it, as
        llama.cpp's embd_seq)."""
        self._embd_seq[seq] = vector

    def record_sampled(self, i: int, sampled) -> None:
        """What the graph sampled for batch token i (its logits never leave the graph)."""
        self._sampled[i] = sampled

    # ---- read ------------------------------------------------------------------------------
    def logits(self) -> np.ndarray:
        if self._sampled:
            raise InputError("get_logits: some outputs of the last batch were sampled in the graph and their "
                             "logits never left it (use get_logits_ith for the others)")
        return self._logits[: self._n]

    def logits_ith(self, i: int) -> np.ndarray:
        row = self._row[i]
        if self.sampled_ith(i) is not None:
            raise InputError(f"token {i} of the last batch was sampled in the graph (a sampler chain is set for its "
                             "sequence): its logits did not leave the graph; use the chain's sample() or "
                             "get_sampled_token_ith")
        if row < 0:
            raise InputError(f"token {i} of the last batch did not request logits")
        return self._logits[row]

    def sampled_ith(self, i: int):
        if not self._sampled:
            return None
        return self._sampled.get(i % len(self._row) if i < 0 else i)

    def embeddings(self) -> np.ndarray:
        """[n_outputs, n_embd]: every output token's embedding, in batch order."""
        self._need_embeddings()
        return self._embd[: self._n]

    def embeddings_ith(self, i: int) -> np.ndarray:
        self._need_embeddings()
        row = self._row[i]
        if row < 0:
            raise InputError(f"token {i} of the last batch has no output")
        return self._embd[row]

    def embeddings_seq(self, seq: int) -> np.ndarray | None:
        """The pooled embedding of sequence `seq` in the last batch (None: not in it)."""
        self._need_embeddings()
        return self._embd_seq.get(seq)

    def _need_embeddings(self) -> None:
        if not self._has_embd:
            raise InputError("no embeddings: the last decode ran without them (Context(..., embeddings=True) or "
                             "set_embeddings(True))")

    # ---- state ---------------------------------------------------------------------------------
    def to_state(self) -> tuple[np.ndarray, np.ndarray]:
        """(batch index -> row, -1 if none; the rows): what a saved context keeps. Refused when
        some rows were sampled in the graph, since their logits never left it."""
        return self._row.astype(np.int64), self.logits()

    def from_state(self, row: np.ndarray, logits: np.ndarray) -> None:
        """The outputs of a saved context (as to_state gave them); nothing sampled."""
        if logits.shape[1] != self.n_vocab:
            raise InputError(f"state has logits of {logits.shape[1]} tokens; this model has {self.n_vocab}")
        n = logits.shape[0]
        if self._buffer.shape[0] < n:
            self._buffer = np.empty((n, self.n_vocab), dtype=np.float32)
        self._buffer[:n] = logits
        self._row = row.copy()
        self._n = n
        self._in_place = False
        self._logits = self._buffer
        self._sampled = {}
        self._has_embd = False
        self._embd_seq = {}


@njit(cache=True)
def output_rows(output, row):
    """row[i] = the logits row of batch token i (outputs counted in batch order), -1 for a
    token without output; returns the number of outputs."""
    n = 0
    for i in range(output.shape[0]):
        if output[i]:
            row[i] = n
            n += 1
        else:
            row[i] = -1
    return n
