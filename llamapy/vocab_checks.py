"""A GGUF vocabulary's tokenizer.ggml.* arrays, read and checked before a tokenizer is built.

A damaged vocabulary loads and then scores text badly without a word (a NaN score, a token
whose text is not UTF-8, an unknown token type each moved a model's perplexity from 56 to
hundreds or millions), so every array is checked at load and the first bad entry is named
in one line: its key and its index. The checks are vectorised (numpy, one regex over the
joined texts): a 262,144-token vocabulary costs milliseconds more to load.

What is refused, and why:
- token texts that are not UTF-8: every tokenizer llamapy builds (SPM, byte-level BPE,
  gemma4's BPE) merges UTF-8 text, and writes raw bytes as text of its own (SPM and gemma4's
  byte tokens as "<0x0A>", byte-level BPE as GPT-2's printable alphabet), so a raw byte in a
  token's text is damage: that token can never be produced, and its neighbours' merges go
  wrong. The same holds for merges.
- token types outside llama.cpp's LLAMA_TOKEN_TYPE values 0 (undefined) to 6 (byte);
- scores that are not finite (SPM merges by score: one NaN reorders every merge near it);
- arrays whose lengths differ from the token list's;
- special token ids outside the vocabulary, except -1 (as UINT32: 4294967295), which some
  converters write for "none" and is read as absent.
"""
from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from llamapy.errors import VocabError
from llamapy.gguf_file import MetaValue, ValueType, typed_scalar

TOKENS_KEY = "tokenizer.ggml.tokens"
TYPES_KEY = "tokenizer.ggml.token_type"
SCORES_KEY = "tokenizer.ggml.scores"
MERGES_KEY = "tokenizer.ggml.merges"

TOKEN_TYPE_RANGE = (0, 6)  # llama.cpp's LLAMA_TOKEN_TYPE_UNDEFINED .. LLAMA_TOKEN_TYPE_BYTE
_NO_TOKEN = frozenset({-1, 2**32 - 1, 2**64 - 1})  # "no such token", as int32, uint32 and uint64
_SURROGATE = re.compile("[\ud800-\udfff]")  # what a byte that is not UTF-8 decodes to (surrogateescape)


def array_value(meta: dict[str, MetaValue], key: str, allowed: tuple[ValueType, ...]) -> Sequence | None:
    """The stored value of array `key` (a numpy array, or a sequence of strings) when its
    items are of an `allowed` type; None when the key is absent."""
    v = meta.get(key)
    if v is None:
        return None
    if v.type != ValueType.ARRAY or v.sub_type not in allowed:
        got = [v.type.name] + ([v.sub_type.name] if v.sub_type is not None else [])
        raise VocabError(f"GGUF key {key} has type {got}, expected an array of {[t.name for t in allowed]}")
    return v.value


def token_texts(meta: dict[str, MetaValue]) -> list[str]:
    """Token texts: UTF-8, empty ones renamed like llama.cpp ("[EMPTY_i]"), no duplicates."""
    stored = array_value(meta, TOKENS_KEY, (ValueType.STRING,))
    if stored is None or len(stored) == 0:
        raise VocabError(f"GGUF file has no {TOKENS_KEY} list (no vocabulary)")
    texts = [text or f"[EMPTY_{i}]" for i, text in enumerate(stored)]
    check_utf8(texts, TOKENS_KEY)
    if len(set(texts)) != len(texts):
        seen: dict[str, int] = {}
        for i, text in enumerate(texts):
            if text in seen:
                raise VocabError(f"duplicate token in vocabulary: {text!r} has ids {seen[text]} and {i}")
            seen[text] = i
    return texts


def check_utf8(texts: Sequence[str], key: str) -> None:
    """Refuse the first text of `texts` holding bytes that are not UTF-8 (read as lone
    surrogates), naming `key`, its index and the byte; one regex over all of them joined."""
    joined = "".join(texts)
    bad = _SURROGATE.search(joined)
    if bad is None:
        return
    at, index = bad.start(), 0
    while at >= len(texts[index]):
        at -= len(texts[index])
        index += 1
    code = ord(joined[bad.start()])
    what = f"the byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"the surrogate U+{code:04X}"
    raise VocabError(f"GGUF key {key} entry {index} ({texts[index][:40]!r}) is not UTF-8 text: {what} at "
                     f"character {at}")


def _per_token(meta: dict[str, MetaValue], key: str, allowed: tuple[ValueType, ...], n_tokens: int
               ) -> np.ndarray | None:
    """Array `key` with one entry per token (refused when it has another length), or None."""
    stored = array_value(meta, key, allowed)
    if stored is None:
        return None
    values = np.asarray(stored)
    if len(values) != n_tokens:
        raise VocabError(f"GGUF key {key} has {len(values)} entries for {n_tokens} tokens")
    return values


def token_types(meta: dict[str, MetaValue], n_tokens: int, default: int) -> list[int]:
    """Each token's type (`default` when the file has none), all llama.cpp token types."""
    types = _per_token(meta, TYPES_KEY, (ValueType.INT32,), n_tokens)
    if types is None:
        return [default] * n_tokens
    types = types.astype(np.int64)
    low, high = TOKEN_TYPE_RANGE
    bad = np.flatnonzero((types < low) | (types > high))
    if bad.size:
        i = int(bad[0])
        raise VocabError(f"GGUF key {TYPES_KEY} entry {i} is {types[i]}, not a token type ({low} undefined, "
                         f"1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, {high} byte)")
    return types.tolist()


def token_scores(meta: dict[str, MetaValue], n_tokens: int) -> list[float] | None:
    """Each token's score, all finite; None when the file has none."""
    scores = _per_token(meta, SCORES_KEY, (ValueType.FLOAT32, ValueType.INT32), n_tokens)
    if scores is None:
        return None
    scores = scores.astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(scores))
    if bad.size:
        i = int(bad[0])
        raise VocabError(f"GGUF key {SCORES_KEY} entry {i} is {scores[i]}, not a finite score")
    return scores.tolist()


def merges(meta: dict[str, MetaValue]) -> list[str] | None:
    """The BPE merges ("left right" in rank order), all UTF-8; None when the file has none."""
    stored = array_value(meta, MERGES_KEY, (ValueType.STRING,))
    if stored is None:
        return None
    texts = stored if isinstance(stored, list) else stored.tolist()
    check_utf8(texts, MERGES_KEY)
    return texts


def special_id(meta: dict[str, MetaValue], key: str, n_tokens: int) -> int | None:
    """The token id of special-token key `key`: None when absent or -1 ("none"), refused
    outside the vocabulary (llama.cpp warns and ignores it; the file is damaged or of
    another vocabulary)."""
    value = typed_scalar(meta, key, int)
    if value is None or value in _NO_TOKEN:
        return None
    if not 0 <= value < n_tokens:
        raise VocabError(f"GGUF key {key} is {value}, outside the vocabulary of {n_tokens} tokens "
                         f"(0..{n_tokens - 1})")
    return value
