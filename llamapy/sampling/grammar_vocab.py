"""A vocabulary's token pieces as the grammar reads them, and which tokens a grammar state allows.

llama.cpp checks every token of the vocabulary against every stack, one character at a time
(llama_grammar_reject_candidates). Here the pieces are decoded once per vocabulary and laid
out as a trie, level by level (level d: the distinct first-d-character prefixes); a state's
allowed tokens come from walking the levels with numpy: the nodes of a level take the state
their parent's character leads to, computed once per (state, classes matched). The rules
are llama.cpp's, token by token:

- an end-of-generation token is allowed when the grammar may end (a stack is empty);
- a token whose piece is empty, starts with a NUL or is invalid UTF-8 is never allowed;
- a piece must be matched character by character; one that ends inside a character is
  allowed if some class on top could match the character it starts;
- a token element on top of a stack allows the token with that id (any other, for `!<[id]>`)
  wherever the piece has characters left.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from itertools import chain

import numpy as np

from .grammar_machine import DEAD, GrammarMachine
from .grammar_parser import G
from .grammar_utf8 import NO_PARTIAL, Partial, decode, piece_bytes


class TokenTrie:
    """Tokens' code points, level by level: `parent[d]` and `chars[d]` for the nodes of level d
    (the root is the one node of level 0); the tokens ending at each level (their node and the
    partial character they end in); the tokens passing through each level (for token elements)."""

    def __init__(self, ids: list[int], points: list[list[int]] | tuple[np.ndarray, np.ndarray],
                 partials: list[Partial]) -> None:
        """`points`: each token's code points, as lists or as (all of them in a row, counts)."""
        n = len(ids)
        if isinstance(points, tuple):
            flat, lens = points
            lens = np.asarray(lens, np.int64)
        else:
            lens = np.fromiter((len(p) for p in points), np.int64, count=n)
            flat = np.fromiter(chain.from_iterable(points), np.int64, count=int(lens.sum()))
        depth = int(lens.max()) if n else 0
        self.depth = depth
        matrix = np.full((n, depth), -1, np.int32)  # -1 pads: a prefix sorts before its extensions
        if n and depth:
            offsets = np.cumsum(lens) - lens
            total = int(lens.sum())
            rows = np.repeat(np.arange(n), lens)
            matrix[rows, np.arange(total) - np.repeat(offsets, lens)] = flat
        order = np.lexsort(matrix.T[::-1]) if depth else np.arange(n)
        matrix, lens = matrix[order], lens[order]
        ids_sorted = np.asarray(ids, np.int64)[order]
        value = np.fromiter((p[0] for p in partials), np.int64, count=n)[order]
        remaining = np.fromiter((p[1] for p in partials), np.int64, count=n)[order]
        lcp = np.zeros(n, np.int64)  # common prefix with the token before (sorted)
        if n > 1 and depth:
            same = (matrix[1:] == matrix[:-1]) & (matrix[1:] >= 0)
            lcp[1:] = np.where(same.all(axis=1), depth, same.argmin(axis=1))
        self.parent: list[np.ndarray] = [np.zeros(0, np.int64)]
        self.chars: list[np.ndarray] = [np.zeros(0, np.int64)]
        self.ends: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self.passing: list[tuple[np.ndarray, np.ndarray]] = []  # (token ids, their node at the level)
        node = np.zeros(n, np.int64)  # each token's node at the current level
        for d in range(depth + 1):
            if d > 0:
                active = lens >= d
                starts = active & (lcp < d)
                first = np.flatnonzero(starts)
                new_node = np.cumsum(starts) - 1
                self.parent.append(node[first])
                self.chars.append(matrix[first, d - 1].astype(np.int64))
                node = np.where(active, new_node, -1)
            ending = np.flatnonzero(lens == d)
            self.ends.append((ids_sorted[ending], node[ending], value[ending], remaining[ending]))
            through = np.flatnonzero(lens > d)
            self.passing.append((ids_sorted[through], node[through]))

    def n_nodes(self, level: int) -> int:
        return 1 if level == 0 else len(self.parent[level])


def _groups(states: np.ndarray):
    """(state, indices) for each live state in `states`."""
    alive = np.flatnonzero(states >= 0)
    if not alive.size:
        return
    live = states[alive]
    first = live[0]
    if (live == first).all():
        yield int(first), alive
        return
    uniq, inverse = np.unique(live, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    bounds = np.cumsum(np.bincount(inverse))
    start = 0
    for s, end in zip(uniq, bounds):
        yield int(s), alive[order[start:end]]
        start = end


def _next_states(machine: GrammarMachine, parents: np.ndarray, chars: np.ndarray) -> np.ndarray:
    out = np.full(len(parents), DEAD, np.int64)
    for sid, idx in _groups(parents):
        state = machine.state(sid)
        if not state.classes:
            continue
        c = chars[idx]
        k_classes = len(state.classes)
        if k_classes <= 62:
            bits = np.zeros(len(idx), np.int64)
            for k, top in enumerate(state.classes):
                bits |= machine.classes[top].match_array(c).astype(np.int64) << k
            uniq, inverse = np.unique(bits, return_inverse=True)
            targets = np.array([machine.move(sid, int(b)) if b else DEAD for b in uniq], np.int64)
        else:  # many distinct classes on top: rows of matches instead of a bitmask
            rows = np.stack([machine.classes[top].match_array(c) for top in state.classes], axis=1)
            uniq, inverse = np.unique(rows, axis=0, return_inverse=True)
            targets = np.array([machine.move(sid, sum(1 << k for k in np.flatnonzero(r))) if r.any() else DEAD
                                for r in uniq], np.int64)
        out[idx] = targets[inverse.reshape(-1)]
    return out


def allowed_by_trie(machine: GrammarMachine, sid: int, trie: TokenTrie, allowed: np.ndarray) -> None:
    """Set `allowed[token]` for the tokens of `trie` that state `sid` allows."""
    states = np.array([sid], np.int64)
    for d in range(trie.depth + 1):
        if d > 0:
            states = _next_states(machine, states[trie.parent[d]], trie.chars[d])
        ids, node, value, remaining = trie.ends[d]
        if ids.size:
            st = states[node]
            ok = (st >= 0) & (remaining == 0)
            partial = np.flatnonzero((st >= 0) & (remaining > 0))
            if partial.size:
                keys = np.stack([st[partial], value[partial], remaining[partial]], axis=1)
                uniq, inverse = np.unique(keys, axis=0, return_inverse=True)
                good = np.array([machine.match_partial(int(s), (int(v), int(r))) for s, v, r in uniq], bool)
                ok[partial] = good[inverse.reshape(-1)]
            allowed[ids[ok]] = True
        if machine.has_tokens:
            through_ids, through_node = trie.passing[d]
            for s, idx in _groups(states[through_node]):
                for kind, value_id, _ in machine.state(s).tokens:
                    hit = through_ids[idx]
                    allowed[hit[(hit == value_id) == (kind == G.TOKEN)]] = True
        if not (states >= 0).any():
            return


class TokenTable:
    """A vocabulary's pieces as the grammar reads them (special tokens rendered, cut at a NUL),
    the trie of those that decode on their own, and tries of the pieces that may continue a
    character split across tokens (made when a grammar first needs one)."""

    MAX_PARTIAL_TRIES = 64

    def __init__(self, vocab) -> None:
        n = vocab.n_tokens
        self.n_tokens = n
        self.eog = np.zeros(n, bool)
        self.eog[list(vocab.eog_ids)] = True
        self.pieces: list[bytes] = [piece_bytes(vocab.token_to_piece(t, True)) for t in range(n)]
        self.continuing: list[int] = [t for t, piece in enumerate(self.pieces)  # starting with a continuation byte
                                      if piece and 0x80 <= piece[0] < 0xC0 and not self.eog[t]]
        self.trie = self._whole_piece_trie()
        self._partial_tries: OrderedDict[Partial, TokenTrie] = OrderedDict()
        self._lock = threading.Lock()

    def _whole_piece_trie(self) -> TokenTrie:
        """The trie of the pieces read from their start: valid UTF-8 (nearly all) decoded in one
        go by Python's codec (the same code points as llama.cpp's decoder), the rest one by one."""
        texts: list[str] = []
        valid_ids: list[int] = []
        odd_ids, odd_points, odd_partials = [], [], []
        for t, piece in enumerate(self.pieces):
            if self.eog[t] or not piece:
                continue
            try:
                texts.append(piece.decode("utf-8"))
                valid_ids.append(t)
            except UnicodeDecodeError:
                cps, partial = decode(piece)
                if partial[1] >= 0:
                    odd_ids.append(t)
                    odd_points.append(cps)
                    odd_partials.append(partial)
        lens = np.fromiter(map(len, texts), np.int64, count=len(texts))
        flat = np.frombuffer("".join(texts).encode("utf-32-le", "surrogatepass"), np.uint32).astype(np.int64)
        odd_lens = np.fromiter(map(len, odd_points), np.int64, count=len(odd_points))
        odd_flat = np.fromiter(chain.from_iterable(odd_points), np.int64, count=int(odd_lens.sum()))
        return TokenTrie(valid_ids + odd_ids, (np.concatenate([flat, odd_flat]), np.concatenate([lens, odd_lens])),
                         [NO_PARTIAL] * len(valid_ids) + odd_partials)

    def trie_for(self, partial: Partial) -> TokenTrie:
        """The trie of the tokens as read after a piece that ended in `partial` (after none, or
        after an invalid piece, a piece is read from its start)."""
        if partial[1] <= 0:
            return self.trie
        with self._lock:
            trie = self._partial_tries.get(partial)
            if trie is not None:
                self._partial_tries.move_to_end(partial)
                return trie
        ids, points, partials = [], [], []
        for t in self.continuing:  # a piece that does not start with continuation bytes is invalid here
            cps, end = decode(self.pieces[t], partial)
            if end[1] >= 0:
                ids.append(t)
                points.append(cps)
                partials.append(end)
        trie = TokenTrie(ids, points, partials)
        with self._lock:
            self._partial_tries[partial] = trie
            while len(self._partial_tries) > self.MAX_PARTIAL_TRIES:
                self._partial_tries.popitem(last=False)
        return trie


_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_tables_lock = threading.Lock()


def token_table(vocab) -> TokenTable:
    """The vocabulary's TokenTable, made once (about a second for 262k tokens)."""
    with _tables_lock:
        table = _tables.get(vocab)
        if table is None:
            table = _tables[vocab] = TokenTable(vocab)
    return table
