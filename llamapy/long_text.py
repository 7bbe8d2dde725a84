"""A long text tokenized in bounded pieces, with the ids of the text tokenized whole.

The tokenizer libraries hold tens of bytes per character while they encode (sentencepiece's
symbols and merge queue, `tokenizers`' encodings): one 100 MB line handed over at once grew
a process to 3.5 GB. So a fragment longer than PIECE_CHARS is cut into pieces of about that
size and each is encoded alone; the memory of a text is then its own size times a small
factor, whatever its line lengths.

A cut must change no token, so it is made only where the text splits alike: at the start of
a run of whitespace (where pre-tokenizers and SPM's "▁" start a token), and only where the
tokenizer gives the same ids for the text around it (CONTEXT_CHARS a side) cut there as
whole (as token_shards cuts a corpus into shards). A text holding more than MAX_RUN_CHARS
characters without whitespace (megabytes of one character, a base64 blob) is refused in one
line before any of it is encoded (`check_cuttable`), rather than encoded at any cost: nothing
local then tells a safe cut from an unsafe one.
"""
from __future__ import annotations

import re
from array import array
from collections.abc import Callable, Iterator
from itertools import chain, islice

from .errors import InputError

PIECE_CHARS = 1 << 16      # characters a piece aims at
MAX_RUN_CHARS = 1 << 22    # the most characters without whitespace (a piece is at most this and PIECE_CHARS)
CONTEXT_CHARS = 256        # characters a side that show whether a cut changes a token
_TRIES = 16                # candidate cuts checked before looking further
_BLOCK = 1 << 12           # characters searched for candidates at a time, backwards
_RUN_START = re.compile(r"(?<=\S)\s")  # whitespace after a non-whitespace character
_SPACE = re.compile(r"\s")

Encode = Callable[[str], list[int]]


def check_cuttable(text: str) -> None:
    """Refuse, before any of it is encoded, a text holding more than MAX_RUN_CHARS characters
    in a row without whitespace (nowhere to cut it). Probes every MAX_RUN_CHARS / 2
    characters look for whitespace near them: a normal text costs a few steps per probe."""
    if len(text) <= MAX_RUN_CHARS:
        return
    half = MAX_RUN_CHARS // 2
    for probe in range(0, len(text) - half + 1, half):
        if _SPACE.search(text, probe, probe + half) is not None:
            continue  # a run this long contains a whole probe window [probe, probe + half)
        start = _last_space_before(text, probe)
        after = _SPACE.search(text, probe + half)
        end = after.start() if after is not None else len(text)
        if end - start > MAX_RUN_CHARS:
            raise InputError(f"the text to tokenize has {end - start} characters without whitespace (from character "
                             f"{start}): llamapy tokenizes a long text in pieces cut at whitespace, at most "
                             f"{MAX_RUN_CHARS} characters at a time; add line breaks or spaces to it")


def _last_space_before(text: str, pos: int) -> int:
    """Where the whitespace-free run holding `pos` starts (0: at the text's start)."""
    end = pos
    while end > 0:
        begin = max(0, end - _BLOCK)
        last = None
        for last in _SPACE.finditer(text, begin, end):
            pass
        if last is not None:
            return last.end()
        end = begin
    return 0


def encode_long(text: str, encode: Encode, out: array, prefix: str = "") -> None:
    """Append to `out` the ids of `prefix + text` as `encode` gives them for it whole,
    encoding pieces of about PIECE_CHARS characters at a time (InputError for a stretch
    longer than MAX_RUN_CHARS without a place to cut it)."""
    start = 0
    while len(text) - start > PIECE_CHARS:
        cut = safe_cut(text, start, encode)
        out.extend(encode(prefix + text[start:cut]))
        prefix, start = "", cut
    if start < len(text) or prefix:
        out.extend(encode(prefix + text[start:]))


def safe_cut(text: str, start: int, encode: Encode) -> int:
    """Where the piece of `text` from `start` ends: the verified cut nearest to PIECE_CHARS on,
    looked for backwards to a quarter of that, then forwards past a run of up to MAX_RUN_CHARS
    (check_cuttable refused longer ones); the end of the text when no cut is found in the
    rest."""
    aim, low = start + PIECE_CHARS, start + PIECE_CHARS // 4
    high = min(len(text), aim + MAX_RUN_CHARS + 1)
    forwards = (m.start() for m in _RUN_START.finditer(text, aim + 1, high))
    for cut in chain(islice(_backwards(text, low, aim), _TRIES), islice(forwards, _TRIES)):
        if splits_alike(text, cut, encode):
            return cut
    if high == len(text):
        return high
    raise InputError(f"the text to tokenize has no place to cut it in pieces between characters {start} and {high} "
                     f"(whitespace where its tokens split alike): llamapy takes at most {MAX_RUN_CHARS} characters "
                     "at once; add line breaks or spaces to it")


def _backwards(text: str, low: int, aim: int) -> Iterator[int]:
    """Starts of whitespace runs in (low, aim], nearest to `aim` first."""
    end = aim + 1
    while end > low:
        begin = max(low, end - _BLOCK)
        yield from reversed([m.start() for m in _RUN_START.finditer(text, begin, end)])
        end = begin


def splits_alike(text: str, cut: int, encode: Encode) -> bool:
    """Whether the text around `cut` gives the same ids cut there as whole."""
    left, right = text[max(0, cut - CONTEXT_CHARS):cut], text[cut:cut + CONTEXT_CHARS]
    return encode(left) + encode(right) == encode(left + right)
