"""The pushdown matcher of a grammar (llama.cpp's stacks), as a machine over sets of stacks.

llama.cpp keeps a list of stacks (positions in the rules, innermost last), each ending at a
terminal: a character class, a token, or nothing (the grammar is complete). A character
moves every stack whose class matches it past that class, and the rules are expanded until
each new stack ends at a terminal again (llama_grammar_advance_stack).

Here a set of stacks is a *state* with a number, and the move of a state on a character
depends only on which of its distinct classes the character matches. So a move is computed
once per (state, classes matched) and remembered; a vocabulary's tokens are checked by
walking a trie of their pieces level by level with numpy (grammar_vocab.py), where each
level costs one vectorized class test per state instead of a Python step per token.
"""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

import numpy as np

from .grammar_parser import G, GrammarError, ParsedGrammar, check_left_recursion
from .grammar_utf8 import Partial

Stack = tuple[int, ...]  # positions in the flat element list, innermost (the terminal) last
DEAD = -1                # the empty set of stacks: nothing can follow


class CharClass:
    """A character element and its alternatives ([a-z0-9_], [^"\\\\], ".", "x"), matched as
    llama_grammar_match_char and llama_grammar_match_partial_char do."""

    def __init__(self, kinds: list[int], values: list[int], start: int) -> None:
        self.positive = kinds[start] in (G.CHAR, G.CHAR_ANY)
        self.ranges: list[tuple[int, int]] = []
        self.any = False
        pos = start
        while True:
            if kinds[pos + 1] == G.CHAR_RNG_UPPER:
                self.ranges.append((values[pos], values[pos + 1]))
                pos += 2
            elif kinds[pos] == G.CHAR_ANY:
                self.any = True
                pos += 1
            else:
                self.ranges.append((values[pos], values[pos]))
                pos += 1
            if kinds[pos] != G.CHAR_ALT:
                break
        self.end = pos  # the element after the class
        merged: list[list[int]] = []
        for lo, hi in sorted(r for r in self.ranges if r[0] <= r[1]):
            if merged and lo <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self._lo = [lo for lo, _ in merged]
        self._hi = [hi for _, hi in merged]
        self._lo_np = np.array(self._lo, np.int64)
        self._hi_np = np.array(self._hi, np.int64)

    def _found(self, c: int) -> bool:
        i = bisect.bisect_right(self._lo, c) - 1
        return i >= 0 and c <= self._hi[i]

    def match(self, c: int) -> bool:
        return (self.any or self._found(c)) == self.positive

    def match_array(self, chars: np.ndarray) -> np.ndarray:
        if self.any:
            return np.full(len(chars), self.positive)
        i = np.searchsorted(self._lo_np, chars, side="right") - 1
        found = (i >= 0) & (chars <= self._hi_np[np.maximum(i, 0)]) if len(self._lo) else np.zeros(len(chars), bool)
        return found if self.positive else ~found

    def match_partial(self, partial: Partial) -> bool:
        """Whether some completion of a partial UTF-8 sequence could match the class."""
        value, remaining = partial
        if remaining < 0 or (remaining == 1 and value < 2):  # invalid, or an overlong 7-bit character
            return False
        low = value << (remaining * 6)
        high = low | ((1 << (remaining * 6)) - 1)
        if low == 0:
            low = {2: 1 << 11, 3: 1 << 16}.get(remaining, low)
        if self.any:
            return True
        for lo, hi in self.ranges:
            if lo <= high and low <= hi:
                return self.positive
        return not self.positive


@dataclass
class State:
    """A set of stacks, grouped by what the top of each is."""
    stacks: frozenset[Stack]
    classes: tuple[int, ...]             # the distinct character classes on top (their positions)
    by_class: tuple[tuple[Stack, ...], ...]  # the stacks with each class on top
    tokens: tuple[tuple[int, int, Stack], ...]  # (G.TOKEN or G.TOKEN_NOT, token id, stack) for token tops
    complete: bool                       # holds the empty stack: the grammar may end here


class GrammarMachine:
    """The rules of one parsed grammar, flattened, and the states reached so far (shared by every
    generation that uses the grammar; guarded by a lock, since a server prepares requests in
    worker threads while its decode loop samples)."""

    def __init__(self, parsed: ParsedGrammar, root: str = "root") -> None:
        if root not in parsed.symbol_ids:
            raise GrammarError(f"grammar: there is no rule named {root!r} to start from")
        check_left_recursion(parsed)
        self.parsed = parsed
        self.kinds: list[int] = []
        self.values: list[int] = []
        self.rule_start: list[int] = []
        for rule in parsed.rules:
            self.rule_start.append(len(self.kinds))
            for kind, value in rule:
                self.kinds.append(int(kind))
                self.values.append(int(value))
        self.kinds.append(G.END)  # a guard after the last rule
        self.values.append(0)
        # every CHAR, CHAR_NOT or CHAR_ANY starts a class (the chars after it in one are CHAR_ALTs)
        self.classes: dict[int, CharClass] = {i: CharClass(self.kinds, self.values, i) for i, k in enumerate(self.kinds)
                                              if k in (G.CHAR, G.CHAR_NOT, G.CHAR_ANY)}
        self.has_tokens = any(k in (G.TOKEN, G.TOKEN_NOT) for k in self.kinds)
        self._lock = threading.RLock()
        self._states: list[State] = []
        self._ids: dict[frozenset[Stack], int] = {}
        self._advanced: dict[Stack, frozenset[Stack]] = {}
        self._moves: dict[tuple[int, int], int] = {}      # (state, classes matched as bits) -> state
        self._char_moves: dict[tuple[int, int], int] = {}  # (state, code point) -> state
        self.initial = self._initial_state(parsed.symbol_ids[root])

    # ---- stacks -----------------------------------------------------------------------------
    def _end_of_alternative(self, pos: int) -> bool:
        return self.kinds[pos] in (G.END, G.ALT)

    def _alternatives(self, rule_id: int):
        pos = self.rule_start[rule_id]
        while True:
            yield pos
            while not self._end_of_alternative(pos):
                pos += 1
            if self.kinds[pos] != G.ALT:
                return
            pos += 1

    def advance(self, stack: Stack) -> frozenset[Stack]:
        """llama_grammar_advance_stack: the stacks `stack` expands to, each at a terminal (or empty)."""
        done = self._advanced.get(stack)
        if done is not None:
            return done
        out: dict[Stack, None] = {}
        todo, seen = [stack], set()
        while todo:
            cur = todo.pop()
            if cur in seen:
                continue
            seen.add(cur)
            if not cur:
                out[cur] = None
                continue
            pos = cur[-1]
            kind = self.kinds[pos]
            if kind == G.RULE_REF:
                base = cur[:-1] if self._end_of_alternative(pos + 1) else cur[:-1] + (pos + 1,)
                for sub in self._alternatives(self.values[pos]):
                    todo.append(base if self._end_of_alternative(sub) else base + (sub,))
            elif kind in (G.CHAR, G.CHAR_NOT, G.CHAR_ANY, G.TOKEN, G.TOKEN_NOT):
                out[cur] = None
            else:  # pragma: no cover -- the parser never leaves a stack in the middle of a class
                raise GrammarError(f"grammar: malformed stack at element {pos}")
        result = frozenset(out)
        self._advanced[stack] = result
        return result

    def _initial_state(self, root_id: int) -> int:
        stacks: set[Stack] = set()
        for pos in self._alternatives(root_id):
            stacks |= self.advance(() if self._end_of_alternative(pos) else (pos,))
        return self.intern(frozenset(stacks))

    # ---- states -----------------------------------------------------------------------------
    def intern(self, stacks: frozenset[Stack]) -> int:
        if not stacks:
            return DEAD
        sid = self._ids.get(stacks)
        if sid is not None:
            return sid
        with self._lock:
            sid = self._ids.get(stacks)
            if sid is None:
                by_class: dict[int, list[Stack]] = {}
                tokens = []
                for stack in sorted(stacks):
                    if not stack:
                        continue
                    top = stack[-1]
                    if self.kinds[top] in (G.TOKEN, G.TOKEN_NOT):
                        tokens.append((self.kinds[top], self.values[top], stack))
                    else:
                        by_class.setdefault(top, []).append(stack)
                sid = len(self._states)
                self._states.append(State(stacks, tuple(by_class), tuple(tuple(v) for v in by_class.values()),
                                          tuple(tokens), () in stacks))
                self._ids[stacks] = sid
        return sid

    def state(self, sid: int) -> State:
        return self._states[sid]

    @property
    def n_states(self) -> int:
        return len(self._states)

    def move(self, sid: int, matched: int) -> int:
        """The state after a character that matches the classes in bitmask `matched` of state `sid`."""
        key = (sid, matched)
        nxt = self._moves.get(key)
        if nxt is None:
            state = self._states[sid]
            stacks: set[Stack] = set()
            for k, top in enumerate(state.classes):
                if matched >> k & 1:
                    end = self.classes[top].end
                    for stack in state.by_class[k]:
                        stacks |= self.advance(stack[:-1] if self._end_of_alternative(end) else stack[:-1] + (end,))
            nxt = self.intern(frozenset(stacks))
            self._moves[key] = nxt
        return nxt

    def move_char(self, sid: int, c: int) -> int:
        """The state after character `c` (DEAD: no stack matches it)."""
        key = (sid, c)
        nxt = self._char_moves.get(key)
        if nxt is None:
            state = self._states[sid]
            matched = 0
            for k, top in enumerate(state.classes):
                if self.classes[top].match(c):
                    matched |= 1 << k
            nxt = self.move(sid, matched) if matched else DEAD
            if len(self._char_moves) < 1 << 20:
                self._char_moves[key] = nxt
        return nxt

    def move_token(self, sid: int, token: int) -> frozenset[Stack]:
        """The stacks of `sid` whose top is a token element matching `token`, moved past it."""
        out: set[Stack] = set()
        for kind, value, stack in self._states[sid].tokens:
            if (value == token) == (kind == G.TOKEN):
                end = stack[-1] + 1
                out |= self.advance(stack[:-1] if self._end_of_alternative(end) else stack[:-1] + (end,))
        return frozenset(out)

    def reading(self, sid: int) -> int:
        """The state of the stacks of `sid` that read characters (a class on top): a piece's
        characters move only those (a done stack and a token element take none)."""
        state = self._states[sid]
        if not state.complete and not state.tokens:
            return sid
        return self.intern(frozenset(stack for group in state.by_class for stack in group))

    def union(self, a: int, b: frozenset[Stack]) -> int:
        stacks = (self._states[a].stacks if a != DEAD else frozenset()) | b
        return self.intern(stacks)

    def match_partial(self, sid: int, partial: Partial) -> bool:
        """Whether a piece ending in `partial` may continue in state `sid` (some class on top
        could match the character it completes)."""
        return any(self.classes[top].match_partial(partial) for top in self._states[sid].classes)
