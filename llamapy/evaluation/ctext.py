"""How llama-perplexity's C++ reads task files and prints numbers, where Python's own
ways differ: std::getline's lines, std::stoi's and operator>>'s integers, printf's NaN and
size_t's wrap-around."""
from __future__ import annotations

import math
import re

import numpy as np

from ..errors import InputError
from ..text_input import decode_text

_LEADING_INT = re.compile(r"[ \t\n\v\f\r]*([+-]?\d+)")
SIZE_T = 1 << 64


def file_text(data: bytes, where: str, warn=None) -> str:
    """A task file's UTF-8 text (InputError when it is not text)."""
    text, invalid = decode_text(data, where)
    if invalid and warn is not None:
        warn(f"{where}: {invalid} bytes are not UTF-8; each was replaced by U+FFFD")
    return text


def getline_lines(text: str) -> list[str]:
    """The lines std::getline reads from `text`: a last line without its newline counts, an
    empty remainder after the last newline does not."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return lines


def leading_int(text: str) -> int | None:
    """std::stoi / operator>>'s int: leading whitespace, a sign, digits (what follows is
    ignored); None when there is none or it overflows an int."""
    m = _LEADING_INT.match(text)
    if m is None:
        return None
    value = int(m.group(1))
    return value if -2**31 <= value < 2**31 else None


def size_t(value: int) -> int:
    """`value` as a size_t expression computes it (negative values wrap around)."""
    return value % SIZE_T


def c_float(spec: str, value: float) -> str:
    """printf's `%<spec>f` of a float or double: as Python's, but glibc writes a NaN with its
    sign bit set (0/0 on x86) as "-nan"."""
    if math.isnan(value):
        text = "-nan" if np.signbit(value) else "nan"
        width = re.match(r"\d*", spec).group()
        return text.rjust(int(width)) if width else text
    return f"%{spec}f" % value


def no_tasks(where: str, kind: str, why: str) -> InputError:
    return InputError(f"{where}: no {kind} tasks ({why})")
