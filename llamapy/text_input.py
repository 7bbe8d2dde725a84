"""Text from users is text: what reaches a tokenizer is valid Unicode, and a file that is not
text (an executable, a run of NUL bytes, another encoding) is refused in one line instead of
being trained on or scored.

- `read_text_file`: a file's UTF-8 text. A few invalid bytes in a large text (a stray Latin-1
  character) are replaced, with a warning that counts them; a file with NUL bytes, many
  invalid bytes or mostly control characters is refused as not text.
- `check_text`: a string that came from JSON escapes or the command line may hold lone
  surrogates (`"\\ud800"`, or bytes that were not UTF-8 in `sys.argv`); refused, naming where.
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from .errors import InputError

MAX_INVALID_FRACTION = 1e-3  # above this share of invalid UTF-8 bytes a file is not text
MAX_CONTROL_FRACTION = 0.05  # nor above this share of control characters (tabs, newlines excepted)
_CONTROLS = [chr(i) for i in range(32) if chr(i) not in "\t\n\r\f\v"]
_SURROGATE = re.compile("[\ud800-\udfff]")  # what UTF-8 cannot encode
_REPLACEMENT = "\ufffd".encode()  # U+FFFD written in the file itself


def read_text_file(path: str | os.PathLike, what: str = "text file",
                   warn: Callable[[str], None] | None = None) -> str:
    """The UTF-8 text of `path` (module docstring): InputError if it is missing, unreadable
    or not text; `warn` hears about the bytes replaced."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{what} not found: {path}")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}") from None
    text, invalid = decode_text(data, str(path))
    if invalid and warn is not None:
        warn(f"{path}: {invalid} bytes are not UTF-8; each was replaced by U+FFFD")
    return text


def decode_text(data: bytes, where: str) -> tuple[str, int]:
    """The UTF-8 text of `data` and how many of its bytes were not UTF-8 (each replaced by
    U+FFFD); InputError naming `where` if it is not text (NUL bytes, more invalid bytes or
    control characters than a text has)."""
    if b"\x00" in data:
        raise InputError(f"{where}: not text ({data.count(0)} NUL bytes; a binary file?)")
    text = data.decode("utf-8", errors="replace")
    invalid = text.count("\ufffd") - data.count(_REPLACEMENT)  # no second decoded copy of a big file
    if invalid > max(8, MAX_INVALID_FRACTION * len(data)):
        raise InputError(f"{where}: not UTF-8 text ({invalid} invalid bytes in {len(data)}; convert it to UTF-8)")
    controls = sum(text.count(c) for c in _CONTROLS)
    if controls > MAX_CONTROL_FRACTION * max(1, len(text)):
        raise InputError(f"{where}: not text ({controls} control characters in {len(text)})")
    return text, invalid


def check_text(text: str, where: str) -> str:
    """`text` itself if it is valid Unicode (encodable as UTF-8), else InputError naming `where`
    and the first lone surrogate (a surrogate escape from a non-UTF-8 command line: that byte).
    Searched for, not encoded: a 100 MB text is not copied to be checked."""
    bad = _SURROGATE.search(text)
    if bad is not None:
        code = ord(bad.group())
        what = (f"the byte 0x{code - 0xDC00:02x}, which is not UTF-8" if 0xDC80 <= code <= 0xDCFF
                else f"a lone surrogate U+{code:04X}")
        raise InputError(f"{where}: not valid text: {what} at character {bad.start()}")
    return text
