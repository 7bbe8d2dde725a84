"""A JSON schema's `pattern` as GBNF (llama.cpp's _pattern_to_rule).

Only anchored patterns (`^...$`) built from literals, `.`, groups (plain or `(?:`),
alternatives, character classes with GBNF's escapes, `* + ?` and `{m,n}` translate; anything
else (look-arounds, `\\d`-style shorthands, inner anchors) raises UnsupportedPattern, which
the converter turns into "any string" with a warning. A pattern that is no regular expression
at all (unbalanced parentheses, nothing to repeat) raises InvalidPattern, an error.
"""
from __future__ import annotations

from collections.abc import Callable

INT_MAX = 2**31 - 1
MAX_PATTERN_DEPTH = 100
NON_LITERAL = set("|.()[]{}*+?^$")
ESCAPED_IN_REGEX_NOT_IN_LITERAL = set("^$.[](){}|*+?")
HEX_LENGTH = {"x": 2, "u": 4, "U": 8}
SIMPLE_ESCAPES = set('trn\\"[]-')  # keep in step with the GBNF parser's escapes


class UnsupportedPattern(Exception):
    """A valid regular expression with no GBNF equivalent here."""


class InvalidPattern(Exception):
    """Not a regular expression."""


def gbnf_escape_length(pattern: str, pos: int) -> int:
    """The length of the GBNF escape at `pos` (\\n, \\xHH, \\uHHHH, ...), 0 if there is none."""
    if pos + 1 >= len(pattern) or pattern[pos] != "\\":
        return 0
    e = pattern[pos + 1]
    if e in SIMPLE_ESCAPES:
        return 2
    n_hex = HEX_LENGTH.get(e, 0)
    if not n_hex or pos + 2 + n_hex > len(pattern):
        return 0
    if not all(h in "0123456789abcdefABCDEF" for h in pattern[pos + 2:pos + 2 + n_hex]):
        return 0
    return 2 + n_hex


def _stoi(text: str) -> int:
    """std::stoi: leading space, a sign, then digits (what follows them is ignored)."""
    s = text.lstrip(" \t\n\v\f\r")
    end = 1 if s[:1] in "+-" else 0
    while end < len(s) and s[end].isascii() and s[end].isdigit():
        end += 1
    digits = s[:end]
    if not digits.lstrip("+-"):
        raise UnsupportedPattern("invalid number in curly brackets")
    value = int(digits)
    if not -2**31 <= value <= INT_MAX:
        raise UnsupportedPattern("invalid number in curly brackets")
    return value


def pattern_rule(pattern: str, name: str, add_rule: Callable[[str, str], str], dotall: bool = False) -> str:
    """The body of the rule for a JSON string matching `pattern` (its sub-rules added with
    `add_rule(name, body) -> name`)."""
    from .json_schema_grammar import build_repetition

    if len(pattern) < 2 or pattern[0] != "^" or pattern[-1] != "$":
        raise UnsupportedPattern("not anchored with '^' and '$'")
    sub = pattern[1:-1]
    length = len(sub)
    sub_rule_ids: dict[str, str] = {}
    i = 0
    depth = 0

    def to_rule(item: tuple[str, bool]) -> str:
        text, literal = item
        return f'"{text}"' if literal else text

    def transform() -> tuple[str, bool]:
        nonlocal i, depth
        seq: list[tuple[str, bool]] = []

        def join_seq() -> tuple[str, bool]:
            out: list[tuple[str, bool]] = []
            literal = ""
            for text, is_literal in seq:
                if is_literal:
                    literal += text
                else:
                    if literal:
                        out.append((literal, True))
                        literal = ""
                    out.append((text, False))
            if literal:
                out.append((literal, True))
            return " ".join(to_rule(item) for item in out), False

        while i < length:
            c = sub[i]
            if c == ".":
                seq.append((add_rule("dot", "[\\U00000000-\\U0010FFFF]" if dotall else "[^\\x0A\\x0D]"), False))
                i += 1
            elif c == "(":
                i += 1
                if i < length and sub[i] == "?":
                    if i + 1 < length and sub[i + 1] == ":":
                        i += 2
                    else:
                        raise UnsupportedPattern("unsupported group syntax")
                depth += 1
                if depth > MAX_PATTERN_DEPTH:
                    raise UnsupportedPattern("pattern nesting too deep")
                seq.append(("(" + to_rule(transform()) + ")", False))
            elif c == ")":
                i += 1
                if depth == 0:
                    raise InvalidPattern("unbalanced parentheses")
                depth -= 1
                return join_seq()
            elif c in "^$":
                raise UnsupportedPattern("anchor inside the pattern")
            elif c == "[":
                brackets = "["
                i += 1
                while i < length and sub[i] != "]":
                    if sub[i] == "\\":
                        n = gbnf_escape_length(sub, i)
                        if n == 0:
                            raise UnsupportedPattern(f"unsupported escape in character class: {sub[i:i + 2]}")
                        brackets += sub[i:i + n]
                        i += n
                    else:
                        brackets += sub[i]
                        i += 1
                if i >= length:
                    raise InvalidPattern("unterminated character class")
                seq.append((brackets + "]", False))
                i += 1
            elif c == "|":
                seq.append(("|", False))
                i += 1
            elif c in "*+?":
                if not seq:
                    raise InvalidPattern("nothing to repeat")
                seq[-1] = (to_rule(seq[-1]) + c, False)
                i += 1
            elif c == "{":
                start = i
                i += 1
                while i < length and sub[i] != "}":
                    i += 1
                if i >= length:
                    raise UnsupportedPattern("unterminated curly brackets")
                nums = sub[start + 1:i].split(",")
                i += 1
                if len(nums) not in (1, 2):
                    raise UnsupportedPattern("wrong number of values in curly brackets")
                if len(nums) == 1:
                    min_times = max_times = _stoi(nums[0])
                else:
                    min_times = _stoi(nums[0]) if nums[0] else 0
                    max_times = _stoi(nums[1]) if nums[1] else INT_MAX
                if not seq:
                    raise InvalidPattern("nothing to repeat")
                text, is_literal = seq[-1]
                if not is_literal:
                    if text not in sub_rule_ids:
                        sub_rule_ids[text] = ""  # counted before it is named, as llama.cpp's map insertion
                        sub_rule_ids[text] = add_rule(f"{name}-{len(sub_rule_ids)}", text)
                    text = sub_rule_ids[text]
                seq[-1] = (build_repetition(f'"{text}"' if is_literal else text, min_times, max_times), False)
            else:
                literal = ""
                while i < length:
                    ch = sub[i]
                    if ch == "\\":
                        if i == length - 1:
                            raise InvalidPattern("trailing backslash")
                        nxt = sub[i + 1]
                        if nxt in ESCAPED_IN_REGEX_NOT_IN_LITERAL:
                            literal += nxt
                            i += 2
                        else:
                            n = gbnf_escape_length(sub, i)
                            if n == 0:
                                raise UnsupportedPattern(f"unsupported escape: {sub[i:i + 2]}")
                            literal += sub[i:i + n]
                            i += n
                    elif ch == '"':
                        literal += '\\"'
                        i += 1
                    elif ch not in NON_LITERAL and (i == length - 1 or not literal or sub[i + 1] == "."
                                                    or sub[i + 1] not in NON_LITERAL):
                        literal += ch
                        i += 1
                    else:
                        break
                if not literal:  # nothing was taken: a stray ] or }
                    raise UnsupportedPattern(f"unsupported character: {c}")
                seq.append((literal, True))
        return join_seq()

    rule = to_rule(transform())
    if depth != 0:
        raise InvalidPattern("unbalanced parentheses")
    return f'"\\"" ({rule}) "\\""'
