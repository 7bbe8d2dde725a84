"""GBNF grammars over a vocabulary: which tokens may come next, and the state after one.

`Grammar(text, vocab)` parses a GBNF grammar (llama.cpp's format, grammars/*.gbnf) and
compiles it for the vocabulary; it is immutable apart from its caches (the states reached,
the tokens each allows), so generations share it (`compile_grammar` keeps the last ones).
`grammar.matcher()` is one generation's position in it: `allows(token)` checks one token,
`allowed()` gives the mask over the vocabulary, `accept(token)` moves on. The semantics are
llama.cpp's (llama_grammar_apply_impl / llama_grammar_accept_impl), token for token.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import numpy as np

from .grammar_machine import DEAD, GrammarMachine
from .grammar_parser import G, GrammarError, ParsedGrammar, format_rules, parse_gbnf
from .grammar_utf8 import NO_PARTIAL, Partial, decode
from .grammar_vocab import TokenTable, allowed_by_trie, token_table

__all__ = ["Grammar", "GrammarError", "GrammarMatcher", "compile_grammar"]


class Grammar:
    """A GBNF grammar compiled for one vocabulary, starting at rule `root`."""

    MAX_CACHED_MASKS = 256

    def __init__(self, text: str, vocab, root: str = "root") -> None:
        if not isinstance(text, str):
            raise GrammarError(f"grammar: expected GBNF text, not {type(text).__name__}")
        self.text, self.root, self.vocab = text, root, vocab
        self.parsed: ParsedGrammar = parse_gbnf(text, vocab)
        self.machine = GrammarMachine(self.parsed, root)
        self.table: TokenTable = token_table(vocab)
        self._masks: OrderedDict[tuple[int, Partial], np.ndarray] = OrderedDict()  # packed bits
        self._lock = threading.Lock()

    @classmethod
    def from_json_schema(cls, schema: dict | str, vocab) -> "Grammar":
        """The grammar llama.cpp makes of a JSON schema (a dict, or its JSON text)."""
        from .json_schema_grammar import json_schema_to_grammar
        return compile_grammar(json_schema_to_grammar(schema), vocab)

    def matcher(self) -> "GrammarMatcher":
        return GrammarMatcher(self)

    def describe(self) -> str:
        """The rules as llama.cpp prints them (generated ones included)."""
        return format_rules(self.parsed)

    # ---- what a state allows ------------------------------------------------------------------
    def allowed(self, sid: int, partial: Partial) -> np.ndarray:
        """Which tokens (a bool per token id) may come in state `sid` after `partial`."""
        key = (sid, partial if partial[1] > 0 else NO_PARTIAL)
        with self._lock:
            packed = self._masks.get(key)
            if packed is not None:
                self._masks.move_to_end(key)
        if packed is not None:
            return np.unpackbits(packed, count=self.table.n_tokens).view(bool)
        allowed = np.zeros(self.table.n_tokens, bool)
        allowed_by_trie(self.machine, sid, self.table.trie_for(partial), allowed)
        allowed[self.table.eog] = self.machine.state(sid).complete
        with self._lock:
            self._masks[key] = np.packbits(allowed)
            while len(self._masks) > self.MAX_CACHED_MASKS:
                self._masks.popitem(last=False)
        return allowed

    def allows(self, sid: int, partial: Partial, token: int) -> bool:
        """Whether `token` may come in state `sid` after `partial` (one token: no mask made)."""
        table, machine = self.table, self.machine
        if table.eog[token]:
            return machine.state(sid).complete
        piece = table.pieces[token]
        if not piece:
            return False
        points, end = decode(piece, partial)
        if end[1] < 0:
            return False
        s = sid
        for c in points:
            if any((value == token) == (kind == G.TOKEN) for kind, value, _ in machine.state(s).tokens):
                return True  # a token element on top takes the whole token
            s = machine.move_char(s, c)
            if s == DEAD:
                return False
        return end[1] == 0 or machine.match_partial(s, end)

    def after(self, sid: int, partial: Partial, token: int, piece: bytes | None = None) -> tuple[int, Partial]:
        """The (state, partial) after `token` (llama_grammar_accept_token; `piece`: the bytes
        read for it, when only a part of its piece is, as a lazy grammar's trigger replays)."""
        machine = self.machine
        if piece is None:
            if self.table.eog[token]:
                if machine.state(sid).complete:
                    return sid, partial
                raise GrammarError(f"grammar: the end of generation (token {token}) is not allowed before the "
                                   "grammar is complete")
            piece = self.table.pieces[token]
        s, end = self.after_text(sid, partial, piece)
        new = machine.union(s, machine.move_token(sid, token))
        if new == DEAD:
            raise GrammarError(f"grammar: token {token} ({piece.decode('utf-8', 'replace')!r}) is not allowed here")
        return new, end

    def after_text(self, sid: int, partial: Partial, data: bytes) -> tuple[int, Partial]:
        """The (state, partial) after the characters of `data` (DEAD: they do not match)."""
        points, end = decode(data, partial)
        s = self.machine.reading(sid)
        for c in points:
            if s == DEAD:
                break
            s = self.machine.move_char(s, c)
        return s, end


class GrammarMatcher:
    """One generation's position in a grammar: a state and the partial character last read."""

    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        self.reset()

    def reset(self) -> None:
        self.sid, self.partial = self.grammar.machine.initial, NO_PARTIAL

    @property
    def complete(self) -> bool:
        """The grammar may end here (an end-of-generation token is allowed)."""
        return self.grammar.machine.state(self.sid).complete

    def allows(self, token: int) -> bool:
        return self.grammar.allows(self.sid, self.partial, token)

    def allowed(self) -> np.ndarray:
        """A bool per token id: the tokens that may come next."""
        return self.grammar.allowed(self.sid, self.partial)

    def accept(self, token: int, piece: bytes | None = None) -> None:
        """Move past `token` (GrammarError if the grammar does not allow it)."""
        self.sid, self.partial = self.grammar.after(self.sid, self.partial, token, piece)

    def accepts_text(self, text: str | bytes) -> bool:
        """Whether the grammar, from here, accepts exactly `text` (read as one piece; the
        position does not change): a check of a whole output."""
        data = text.encode() if isinstance(text, str) else text
        if not data:
            return self.partial == NO_PARTIAL and self.complete
        sid, partial = self.grammar.after_text(self.sid, self.partial, data)
        return sid != DEAD and partial == NO_PARTIAL and self.grammar.machine.state(sid).complete


# ---- compiled grammars, kept --------------------------------------------------------------------
_compiled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_compiled_lock = threading.Lock()
MAX_COMPILED = 16


def compile_grammar(text: str, vocab, root: str = "root") -> Grammar:
    """`Grammar(text, vocab, root)`, reusing one of the last grammars compiled for the vocabulary
    (a server's requests with the same grammar or schema share its states and masks)."""
    with _compiled_lock:
        kept = _compiled.setdefault(vocab, OrderedDict())
        grammar = kept.get((text, root))
        if grammar is not None:
            kept.move_to_end((text, root))
            return grammar
    grammar = Grammar(text, vocab, root)
    with _compiled_lock:
        kept[(text, root)] = grammar
        while len(kept) > MAX_COMPILED:
            kept.popitem(last=False)
    return grammar
