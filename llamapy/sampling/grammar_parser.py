"""GBNF text to grammar rules, with llama.cpp's semantics (src/llama-grammar.cpp's parser).

A grammar is a list of rules; a rule is a list of elements (type, value) whose alternatives
are separated by ALT and which ends with END, exactly as llama.cpp lays them out, so that
repetitions and groups become the same generated rules (`name_N`) and the same limits apply
(a repetition that would generate more than 2000 rules is refused, a `{m,n}` past 2000 is
unbounded). What differs is only what a user sees on bad input: one line naming the problem
with its line and column, instead of llama.cpp's dump of the rest of the text.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from ..errors import InputError

MAX_REPETITION_THRESHOLD = 2000
UNBOUNDED = -1


class GrammarError(InputError):
    """A grammar (or JSON schema) that cannot be used: one line saying why and where."""


class G(IntEnum):
    """llama_gretype: the element types, with llama.cpp's numbers."""
    END = 0             # end of a rule
    ALT = 1             # start of another alternative
    RULE_REF = 2        # value: a rule id
    CHAR = 3            # value: a code point (the first of a character class)
    CHAR_NOT = 4        # the first of a negated class ([^...])
    CHAR_RNG_UPPER = 5  # makes the previous char the lower end of a range
    CHAR_ALT = 6        # another char of the same class
    CHAR_ANY = 7        # any character (.)
    TOKEN = 8           # value: a token id (<[id]> or <token>)
    TOKEN_NOT = 9       # any token but this one (!<[id]>)


Element = tuple[int, int]  # (G, value)

ESCAPES = {"t": "\t", "r": "\r", "n": "\n", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-"}
HEX_DIGITS = {"x": 2, "u": 4, "U": 8}


def is_word_char(c: str) -> bool:
    return c.isascii() and (c.isalnum() or c == "-")


@dataclass
class ParsedGrammar:
    """Rules by id, and the names of the rules (those written and those generated)."""
    rules: list[list[Element]]
    symbol_ids: dict[str, int]
    names: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.names = {i: name for name, i in self.symbol_ids.items()}


class _Parser:
    """llama_grammar_parser over a Python string (positions are characters)."""

    def __init__(self, src: str, vocab=None) -> None:
        self.src, self.vocab = src + "\0", vocab  # a sentinel as C's terminating NUL
        self.n = len(src)
        self.symbol_ids: dict[str, int] = {}
        self.rules: list[list[Element] | None] = []

    # ---- errors ----------------------------------------------------------------------------
    def fail(self, message: str, pos: int) -> GrammarError:
        line = self.src.count("\n", 0, pos) + 1
        column = pos - (self.src.rfind("\n", 0, pos) + 1) + 1
        near = self.src[pos:pos + 20].split("\n")[0].rstrip("\0")
        where = f"line {line}, column {column}" + (f" (at {near!r})" if near else " (at the end)")
        return GrammarError(f"grammar: {message} at {where}")

    # ---- lexical ---------------------------------------------------------------------------
    def at(self, pos: int) -> str:
        return self.src[pos] if pos < self.n else "\0"

    def space(self, pos: int, newline_ok: bool) -> int:
        while True:
            c = self.at(pos)
            if c == "#":
                while self.at(pos) not in "\r\n\0":
                    pos += 1
            elif c in " \t" or (newline_ok and c in "\r\n"):
                pos += 1
            else:
                return pos

    def name(self, pos: int) -> int:
        end = pos
        while is_word_char(self.at(end)):
            end += 1
        if end == pos:
            raise self.fail("expecting a name", pos)
        return end

    def integer(self, pos: int) -> int:
        end = pos
        while self.at(end).isascii() and self.at(end).isdigit():
            end += 1
        if end == pos:
            raise self.fail("expecting an integer", pos)
        return end

    def char(self, pos: int) -> tuple[int, int]:
        """One (possibly escaped) character: (code point, position after it)."""
        c = self.at(pos)
        if c == "\\":
            e = self.at(pos + 1)
            if e in HEX_DIGITS:
                size, start = HEX_DIGITS[e], pos + 2
                end = start
                while end < start + size and self.at(end) in "0123456789abcdefABCDEF":
                    end += 1
                if end != start + size:
                    raise self.fail(f"expecting {size} hex chars", start)
                return int(self.src[start:end], 16), end
            if e in ESCAPES:
                return ord(ESCAPES[e]), pos + 2
            raise self.fail("unknown escape", pos)
        if pos >= self.n:
            raise self.fail("unexpected end of input", pos)
        return ord(c), pos + 1

    def token(self, pos: int) -> tuple[int, int]:
        """<[id]> or <text> (the text must be one token of the vocabulary)."""
        start = pos
        if self.at(pos) != "<":
            raise self.fail("expecting '<'", pos)
        pos += 1
        if self.at(pos) == "[":
            pos += 1
            end = self.integer(pos)
            token = int(self.src[pos:end])
            if token > 0xFFFFFFFF:
                raise self.fail("token id too big", pos)
            if self.at(end) != "]":
                raise self.fail("expecting ']'", end)
            if self.at(end + 1) != ">":
                raise self.fail("expecting '>'", end + 1)
            if self.vocab is not None and token >= self.vocab.n_tokens:
                raise self.fail(f"token {token} is outside the vocabulary (0..{self.vocab.n_tokens - 1})", start)
            return token, end + 2
        if self.vocab is None:
            raise self.fail("a token by its text needs the model's vocabulary", start)
        while self.at(pos) not in ">\0":
            pos += 1
        if self.at(pos) != ">":
            raise self.fail("expecting '>'", pos)
        text = self.src[start:pos + 1]
        tokens = self.vocab.tokenize(text, add_special=False, parse_special=True)
        if len(tokens) != 1:
            raise self.fail(f"{text} is not one token of the vocabulary", start)
        return tokens[0], pos + 1

    # ---- symbols and rules -------------------------------------------------------------------
    def symbol_id(self, name: str) -> int:
        return self.symbol_ids.setdefault(name, len(self.symbol_ids))

    def generate_symbol_id(self, base: str) -> int:
        next_id = len(self.symbol_ids)
        self.symbol_ids[f"{base}_{next_id}"] = next_id
        return next_id

    def add_rule(self, rule_id: int, rule: list[Element]) -> None:
        if len(self.rules) <= rule_id:
            self.rules.extend([None] * (rule_id + 1 - len(self.rules)))
        self.rules[rule_id] = rule

    def alternates(self, pos: int, rule_name: str, rule_id: int, nested: bool) -> int:
        rule: list[Element] = []
        pos = self.sequence(pos, rule_name, rule, nested)
        while self.at(pos) == "|":
            rule.append((G.ALT, 0))
            pos = self.space(pos + 1, True)
            pos = self.sequence(pos, rule_name, rule, nested)
        rule.append((G.END, 0))
        self.add_rule(rule_id, rule)
        return pos

    def sequence(self, pos: int, rule_name: str, rule: list[Element], nested: bool) -> int:
        last_start = len(rule)
        n_prev_rules = 1

        def repeat(min_times: int, max_times: int, at: int) -> None:
            """S{m,n} -> S repeated m times, then n-m nested optional rules (llama.cpp's rewrite)."""
            nonlocal n_prev_rules
            no_max = max_times == UNBOUNDED
            if last_start == len(rule):
                raise self.fail("expecting an item before */+/?/{", at)
            if not no_max and max_times < min_times:
                raise self.fail(f"repetition {{{min_times},{max_times}}} has its maximum below its minimum", at)
            prev = rule[last_start:]
            total = max_times if not no_max and max_times > 0 else (min_times if min_times > 0 else 1)
            if n_prev_rules * total > MAX_REPETITION_THRESHOLD:
                raise self.fail("this repetition would generate more than 2000 rules (reduce the repetitions or the "
                                "rule's complexity)", at)
            if min_times == 0:
                del rule[last_start:]
            else:
                for _ in range(1, min_times):
                    rule.extend(prev)
            last_rec = 0
            n_opt = 1 if no_max else max_times - min_times
            for i in range(n_opt):
                rec_id = self.generate_symbol_id(rule_name)
                rec = list(prev)
                if i > 0 or no_max:
                    rec.append((G.RULE_REF, rec_id if no_max else last_rec))
                rec += [(G.ALT, 0), (G.END, 0)]
                self.add_rule(rec_id, rec)
                last_rec = rec_id
            if n_opt > 0:
                rule.append((G.RULE_REF, last_rec))
            n_prev_rules *= total

        while pos < self.n:
            c = self.at(pos)
            if c == '"':
                pos += 1
                last_start, n_prev_rules = len(rule), 1
                while self.at(pos) != '"':
                    if pos >= self.n:
                        raise self.fail("unexpected end of input in a string", pos)
                    cp, pos = self.char(pos)
                    rule.append((G.CHAR, cp))
                pos = self.space(pos + 1, nested)
            elif c == "[":
                pos += 1
                start_type = G.CHAR
                if self.at(pos) == "^":
                    pos += 1
                    start_type = G.CHAR_NOT
                last_start, n_prev_rules = len(rule), 1
                while self.at(pos) != "]":
                    if pos >= self.n:
                        raise self.fail("unexpected end of input in a character class", pos)
                    cp, pos = self.char(pos)
                    rule.append((G.CHAR_ALT if last_start < len(rule) else start_type, cp))
                    if self.at(pos) == "-" and self.at(pos + 1) != "]":
                        if pos + 1 >= self.n:
                            raise self.fail("unexpected end of input in a character class", pos + 1)
                        upper, pos = self.char(pos + 1)
                        rule.append((G.CHAR_RNG_UPPER, upper))
                pos = self.space(pos + 1, nested)
            elif c in "<!":
                kind = G.TOKEN
                if c == "!":
                    kind = G.TOKEN_NOT
                    pos += 1
                token, end = self.token(pos)
                last_start, n_prev_rules = len(rule), 1
                rule.append((kind, token))
                pos = self.space(end, nested)
            elif is_word_char(c):
                end = self.name(pos)
                ref = self.symbol_id(self.src[pos:end])
                pos = self.space(end, nested)
                last_start, n_prev_rules = len(rule), 1
                rule.append((G.RULE_REF, ref))
            elif c == "(":
                open_at = pos
                pos = self.space(pos + 1, True)
                n_before = len(self.symbol_ids)
                sub_id = self.generate_symbol_id(rule_name)
                pos = self.alternates(pos, rule_name, sub_id, True)
                n_prev_rules = max(1, len(self.symbol_ids) - n_before)
                last_start = len(rule)
                rule.append((G.RULE_REF, sub_id))
                if self.at(pos) != ")":
                    raise self.fail(f"expecting ')' to close the '(' of line {self.src.count(chr(10), 0, open_at) + 1}",
                                    pos)
                pos = self.space(pos + 1, nested)
            elif c == ".":
                last_start, n_prev_rules = len(rule), 1
                rule.append((G.CHAR_ANY, 0))
                pos = self.space(pos + 1, nested)
            elif c in "*+?":
                at = pos
                pos = self.space(pos + 1, nested)
                repeat(*{"*": (0, UNBOUNDED), "+": (1, UNBOUNDED), "?": (0, 1)}[c], at)
            elif c == "{":
                at = pos
                pos = self.space(pos + 1, nested)
                end = self.integer(pos)
                min_times = int(self.src[pos:end])
                pos = self.space(end, nested)
                max_times = UNBOUNDED
                if self.at(pos) == "}":
                    max_times = min_times
                    pos = self.space(pos + 1, nested)
                elif self.at(pos) == ",":
                    pos = self.space(pos + 1, nested)
                    if self.at(pos).isascii() and self.at(pos).isdigit():
                        end = self.integer(pos)
                        max_times = int(self.src[pos:end])
                        pos = self.space(end, nested)
                    if self.at(pos) != "}":
                        raise self.fail("expecting '}'", pos)
                    pos = self.space(pos + 1, nested)
                else:
                    raise self.fail("expecting ',' or '}'", pos)
                if min_times > MAX_REPETITION_THRESHOLD:
                    raise self.fail(f"{min_times} repetitions is more than {MAX_REPETITION_THRESHOLD}", at)
                if max_times > MAX_REPETITION_THRESHOLD:
                    max_times = UNBOUNDED
                repeat(min_times, max_times, at)
            else:
                break
        return pos

    def rule(self, pos: int) -> int:
        end = self.name(pos)
        name = self.src[pos:end]
        after = self.space(end, False)
        rule_id = self.symbol_id(name)
        if self.src[after:after + 3] != "::=":
            raise self.fail(f"expecting ::= after the rule name {name!r}", after)
        pos = self.alternates(self.space(after + 3, True), name, rule_id, False)
        c = self.at(pos)
        if c == "\r":
            pos += 2 if self.at(pos + 1) == "\n" else 1
        elif c == "\n":
            pos += 1
        elif pos < self.n:
            raise self.fail("expecting a newline or the end", pos)
        return self.space(pos, True)

    def parse(self) -> ParsedGrammar:
        pos = self.space(0, True)
        while pos < self.n:
            pos = self.rule(pos)
        names = {i: name for name, i in self.symbol_ids.items()}
        for i in range(len(self.symbol_ids)):
            rule = self.rules[i] if i < len(self.rules) else None
            if rule is None:
                raise GrammarError(f"grammar: rule {names[i]!r} is used but never defined")
        if not self.rules:
            raise GrammarError("grammar: the grammar is empty (no rule)")
        return ParsedGrammar([list(r) for r in self.rules if r is not None], dict(self.symbol_ids))


def parse_gbnf(text: str, vocab=None) -> ParsedGrammar:
    """The rules of a GBNF grammar. `vocab`: the vocabulary that `<token>` elements are looked
    up in (without it, only `<[id]>` tokens are allowed). Raises GrammarError."""
    if "\0" in text:
        raise GrammarError("grammar: the text holds a NUL character")
    return _Parser(text, vocab).parse()


def _is_end(rule: list[Element], i: int) -> bool:
    return rule[i][0] in (G.END, G.ALT)


def check_left_recursion(parsed: ParsedGrammar) -> None:
    """llama.cpp refuses left-recursive rules (a rule that can reach itself without consuming a
    character would make the pushdown matcher loop)."""
    rules = parsed.rules
    n = len(rules)
    visited, in_progress, may_be_empty = [False] * n, [False] * n, [False] * n

    def detect(index: int) -> bool:
        if in_progress[index]:
            return True
        in_progress[index] = True
        rule = rules[index]
        at_start = True
        for i in range(len(rule)):
            if _is_end(rule, i):
                if at_start:
                    may_be_empty[index] = True
                    break
                at_start = True
            else:
                at_start = False
        recurse = True
        for i, (kind, value) in enumerate(rule):
            if kind == G.RULE_REF and recurse:
                if detect(value):
                    return True
                if not may_be_empty[value]:
                    recurse = False
            elif _is_end(rule, i):
                recurse = True
            else:
                recurse = False
        in_progress[index] = False
        visited[index] = True
        return False

    for i in range(n):
        if not visited[i] and detect(i):
            raise GrammarError(f"grammar: left recursion in rule {parsed.names.get(i, str(i))!r} (unsupported, as in "
                               "llama.cpp: rewrite it to recurse on the right)")


def format_rules(parsed: ParsedGrammar) -> str:
    """The rules as llama.cpp's llama_grammar_parser::print writes them (for reading a grammar's
    generated rules)."""
    def char(c: int) -> str:
        return chr(c) if 0x20 <= c <= 0x7F else f"<U+{c:04X}>"

    lines = []
    for rule_id, rule in enumerate(parsed.rules):
        out = [f"{parsed.names[rule_id]} ::= "]
        for i, (kind, value) in enumerate(rule[:-1]):
            if kind == G.ALT:
                out.append("| ")
            elif kind == G.RULE_REF:
                out.append(f"{parsed.names[value]} ")
            elif kind == G.CHAR:
                out.append("[" + char(value))
            elif kind == G.CHAR_NOT:
                out.append("[^" + char(value))
            elif kind == G.CHAR_RNG_UPPER:
                out.append("-" + char(value))
            elif kind == G.CHAR_ALT:
                out.append(char(value))
            elif kind == G.CHAR_ANY:
                out.append(".")
            elif kind in (G.TOKEN, G.TOKEN_NOT):
                out.append(("!" if kind == G.TOKEN_NOT else "") + f"<[{value}]> ")
            if kind in (G.CHAR, G.CHAR_NOT, G.CHAR_ALT, G.CHAR_RNG_UPPER, G.CHAR_ANY) and \
                    rule[i + 1][0] not in (G.CHAR_ALT, G.CHAR_RNG_UPPER, G.CHAR_ANY):
                out.append("] ")
        lines.append("".join(out))
    return "\n".join(lines) + "\n"
