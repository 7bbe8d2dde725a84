"""UTF-8 as llama.cpp's grammar reads token pieces (decode_utf8 in src/llama-grammar.cpp).

A token's piece may end inside a character (byte-fallback tokens, pieces cut mid-character):
the decoder returns the complete code points and the partial one (its bits so far and the
bytes it still needs), which the next piece continues. Its leniency is llama.cpp's, kept on
purpose so the same tokens are allowed: a lead byte's continuation bytes are not checked
once the sequence has started, overlong forms and surrogates pass, and a piece ends at a
NUL byte. An invalid start (a stray continuation byte) makes the whole piece invalid.
"""
from __future__ import annotations

Partial = tuple[int, int]  # (value so far, bytes remaining); remaining -1: invalid sequence
NO_PARTIAL: Partial = (0, 0)
INVALID: Partial = (0, -1)

_LEAD_LENGTH = (1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 2, 2, 3, 4)  # by the high 4 bits


def piece_bytes(piece: bytes) -> bytes:
    """The bytes the grammar reads of a piece: up to its first NUL (a C string)."""
    nul = piece.find(b"\0")
    return piece if nul < 0 else piece[:nul]


def decode(piece: bytes, partial: Partial = NO_PARTIAL) -> tuple[list[int], Partial]:
    """(complete code points, the partial one at the end) of `piece` continuing `partial`.
    An invalid piece gives no code points and INVALID."""
    value, remaining = partial
    pos, n = 0, len(piece)
    while pos < n and remaining > 0:
        byte = piece[pos]
        if byte >> 6 != 2:
            return [], INVALID
        value = (value << 6) + (byte & 0x3F)
        pos += 1
        remaining -= 1
    points: list[int] = []
    if partial[1] > 0 and remaining == 0:
        points.append(value)
    while pos < n:
        byte = piece[pos]
        remaining = _LEAD_LENGTH[byte >> 4] - 1
        if remaining < 0:
            return [], INVALID
        value = byte & ((1 << (7 - remaining)) - 1)
        pos += 1
        while pos < n and remaining > 0:
            value = (value << 6) + (piece[pos] & 0x3F)
            pos += 1
            remaining -= 1
        if remaining == 0:
            points.append(value)
    return points, (value, remaining) if remaining else NO_PARTIAL

