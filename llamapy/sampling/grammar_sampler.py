"""Grammar-constrained sampling as llama.cpp's common_sampler does it.

`GrammarChain` wraps a sampler chain: the chain samples from the model's logits as usual,
and the grammar only checks the token it picked (one token: cheap). Only when the grammar
rejects it are the logits sampled again, from the start, with every token the grammar does
not allow masked to -inf first (the whole vocabulary is checked only then). The chain's
samplers and the grammar both hear the token chosen. A grammar has no form inside the model
graph, so a chain with one never samples there (llama.cpp turns backend sampling off too).

`GrammarConstraint` is the grammar's side (llama.cpp's grammar sampler): the position in the
grammar and, for a *lazy* grammar, the wait for a trigger: until a trigger token is sampled
or the text so far matches a trigger pattern, nothing is constrained; then the text from the
trigger on (the pattern's first group, or the whole match) is fed to the grammar and the
rest is constrained.
"""
from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Literal, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict

from ..errors import InputError
from .grammar import Grammar, GrammarError, compile_grammar
from .json_schema_grammar import json_schema_to_grammar
from .samplers import Candidates, SamplerChain


class GrammarTrigger(BaseModel):
    """What ends a lazy grammar's wait (llama.cpp's common_grammar_trigger): a `word` in the
    text, a `pattern` (a regular expression searched in the text), a `pattern_full` (one the
    whole text must match) or a `token` (by id)."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["word", "pattern", "pattern_full", "token"]
    value: str = ""
    token: Optional[int] = None


def trigger_patterns(triggers: list[GrammarTrigger]) -> tuple[list[str], list[int]]:
    """(regular expressions, token ids) of the triggers, as common_sampler_init makes them."""
    patterns, tokens = [], []
    for t in triggers:
        if t.type == "token":
            if t.token is None:
                raise InputError("a token trigger needs its token id")
            tokens.append(t.token)
        elif t.type == "word":
            patterns.append(re.escape(t.value))
        elif t.type == "pattern":
            patterns.append(t.value)
        else:  # pattern_full: anchored at both ends
            p = t.value
            patterns.append("^$" if not p else ("" if p.startswith("^") else "^") + p + ("" if p.endswith("$") else "$"))
    return patterns, tokens


class _Trigger:
    """A compiled trigger pattern over the bytes generated so far (std::regex reads bytes too)."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        try:
            self.regex = re.compile(pattern.encode("utf-8"))
        except re.error as e:
            raise GrammarError(f"grammar trigger pattern {pattern!r}: {e}") from None
        self.whole = pattern.startswith("^") and pattern.endswith("$")

    def find(self, text: bytes) -> int | None:
        """Where the constrained text starts (the first non-empty group, else the match), or None."""
        match = (self.whole and self.regex.fullmatch(text)) or self.regex.search(text)
        if match is None:
            return None
        for i in range(1, (match.lastindex or 0) + 1):
            if match.start(i) >= 0 and match.end(i) > match.start(i):
                return match.start(i)
        return match.start()


class GrammarConstraint:
    """A grammar's position in one generation, with the lazy wait for a trigger."""

    def __init__(self, grammar: Grammar, lazy: bool = False, triggers: list[GrammarTrigger] | None = None) -> None:
        patterns, tokens = trigger_patterns(list(triggers or []))
        if lazy and not patterns and not tokens:
            raise GrammarError("a lazy grammar needs at least one trigger")
        self.grammar, self.lazy = grammar, lazy
        self.patterns = [_Trigger(p) for p in patterns]
        self.trigger_tokens = set(tokens)
        self.matcher = grammar.matcher()
        self.reset()

    def reset(self) -> None:
        self.matcher.reset()
        self.awaiting = self.lazy
        self.buffer = b""
        self.buffered: list[tuple[int, int, int]] = []  # (token, start, end) in the buffer

    def allows(self, token: int) -> bool:
        return self.awaiting or self.matcher.allows(token)

    def mask(self, cur: Candidates) -> None:
        """Set the logits of the candidates the grammar does not allow to -inf."""
        if self.awaiting:
            return
        allowed = self.matcher.allowed()
        cur.logits = np.where(allowed[cur.ids], cur.logits, np.float32(-np.inf)).astype(np.float32)

    def accept(self, token: int) -> None:
        if not self.awaiting:
            self.matcher.accept(token)
            return
        piece = self.grammar.vocab.token_to_piece(token, True)
        if token in self.trigger_tokens:
            self.awaiting, self.buffer, self.buffered = False, b"", []
            self.matcher.accept(token)
            return
        start = len(self.buffer)
        self.buffered.append((token, start, start + len(piece)))
        self.buffer += piece
        for trigger in self.patterns:
            at = trigger.find(self.buffer)
            if at is None:
                continue
            self.awaiting = False
            for tok, tok_start, tok_end in self.buffered:  # replay what overlaps the trigger on
                if tok_end > at:
                    self.matcher.accept(tok, self.buffer[max(tok_start, at):tok_end])
            self.buffer, self.buffered = b"", []
            return


class GrammarChain(SamplerChain):
    """A sampler chain whose tokens a grammar constrains (common_sampler_sample's rejection
    sampling: check the chain's token, re-sample with the grammar's mask only if it fails)."""

    name = "grammar-chain"

    def __init__(self, chain: SamplerChain, constraint: GrammarConstraint) -> None:
        super().__init__(samplers=chain.samplers)
        self.constraint = constraint
        self.n_resampled = 0  # tokens the grammar rejected: sampled again with its mask

    def sample(self, ctx, idx: int = -1) -> int:
        t0 = time.perf_counter()
        token = self._constrained(ctx.get_logits_ith(idx))
        self.accept(token)
        self.t_sample += time.perf_counter() - t0
        return token

    def sample_logits(self, logits: np.ndarray) -> int:
        token = self._constrained(logits)
        self.accept(token)
        return token

    def _constrained(self, logits: np.ndarray) -> int:
        cur = Candidates.from_logits(logits)
        self.apply(cur)
        token = self._selected(cur)
        if self.constraint.allows(token):
            return token
        self.n_resampled += 1
        cur = Candidates.from_logits(logits)
        self.constraint.mask(cur)
        if not np.isfinite(cur.logits).any():
            raise GrammarError("the grammar allows no token of the vocabulary here")
        self.apply(cur)
        token = self._selected(cur)
        if not self.constraint.allows(token):
            raise GrammarError("no token the grammar allows is left after the other samplers (a logit bias or "
                               "--ignore-eos may ban the only ones it allows, such as the end of generation)")
        return token

    def accept(self, token: int) -> None:
        self.constraint.accept(token)
        super().accept(token)

    def reset(self) -> None:
        self.constraint.reset()
        super().reset()

    def backend_prefix(self) -> int:
        return 0  # a grammar needs the logits on the CPU

    def __repr__(self) -> str:
        lazy = ", lazy" if self.constraint.lazy else ""
        return f"{super().__repr__()} (constrained by a grammar{lazy})"


def constrain(chain: SamplerChain, vocab, grammar: str | Grammar | None = None, json_schema: dict | str | None = None,
              grammar_lazy: bool = False, grammar_triggers: list | None = None,
              warn: Callable[[str], None] | None = None) -> SamplerChain:
    """`chain` constrained by a GBNF grammar (text or compiled) or a JSON schema (a dict or its
    JSON text; llama.cpp's conversion, `warn` hearing of what it loosens). An empty grammar is
    none, as in llama.cpp. Raises GrammarError (an InputError) for a bad grammar or schema."""
    if grammar is not None and json_schema is not None:
        raise InputError("give a grammar or a JSON schema, not both")
    if json_schema is not None:
        compiled = compile_grammar(json_schema_to_grammar(json_schema, warn), vocab)
    elif isinstance(grammar, Grammar):
        if grammar.vocab is not vocab:
            raise InputError("the grammar was compiled for another vocabulary: compile it with this model's")
        compiled = grammar
    elif isinstance(grammar, str) and grammar:
        compiled = compile_grammar(grammar, vocab)
    elif grammar is None or grammar == "":
        if grammar_lazy or grammar_triggers:
            raise InputError("grammar_lazy and grammar_triggers need a grammar")
        return chain
    else:
        raise InputError(f"grammar: expected GBNF text or a Grammar, not {type(grammar).__name__}")
    triggers = [t if isinstance(t, GrammarTrigger) else
                GrammarTrigger(type="word", value=t) if isinstance(t, str) else GrammarTrigger(**t)
                for t in grammar_triggers or []]
    return GrammarChain(chain, GrammarConstraint(compiled, grammar_lazy, triggers))
