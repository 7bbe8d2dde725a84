"""Damaged GGUF vocabularies are refused at load in one line naming the key and the first bad
entry, instead of loading and scoring text badly without a word (a NaN score, a token text that
is not UTF-8 or a token type 99 once moved stories260K's perplexity from 56 to 89.6, 629 million
and 390).

The files are stories260K (an SPM vocabulary) with one tokenizer.ggml.* array or id rewritten
(gguf_craft), and a small byte-level BPE vocabulary built from metadata alone."""
from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import llamapy
from llamapy.errors import LlamapyError, VocabError
from llamapy.gguf_file import GGUFFile, MetaValue, ValueType
from llamapy.vocab import Vocab

import gguf_craft as C
from test_hostile_cli import digest, one_error, run_tool

N_TOKENS = 512  # stories260K's vocabulary


def stored(path: Path, key: str):
    """stories260K's value of `key`, as a new list or array to change."""
    value = GGUFFile(path).metadata[key].value
    return value.tolist() if hasattr(value, "tolist") else list(value)


def rewritten(key: str, change: Callable[[object], object], sub_type: ValueType | None = None) -> Callable:
    """A maker of stories260K with metadata `key` replaced by change(its value), as an array of
    `sub_type` (a scalar when None)."""
    def make(source: Path, tmp: Path) -> Path:
        meta, tensors = C.parts(source)
        value = change(stored(source, key) if key in meta and sub_type is not None else meta.get(key))
        if sub_type is None:
            meta[key] = value
        elif sub_type == ValueType.STRING:
            meta[key] = MetaValue(ValueType.ARRAY, ValueType.STRING, list(value))
        else:
            dtype = np.float32 if sub_type == ValueType.FLOAT32 else np.int32
            meta[key] = MetaValue(ValueType.ARRAY, sub_type, np.asarray(value, dtype))
        return C.write(tmp / "vocab.gguf", meta, tensors)
    return make


def at(index: int, value):
    """A change setting entry `index` of a list to `value`."""
    def change(values):
        values = list(values)
        values[index] = value
        return values
    return change


SCORES, TYPES, TOKENS = "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.tokens"

# (case, file maker, what the one line says)
CASES = [
    ("a NaN score", rewritten(SCORES, at(17, float("nan")), ValueType.FLOAT32),
     "GGUF key tokenizer.ggml.scores entry 17 is nan, not a finite score"),
    ("an infinite score", rewritten(SCORES, at(300, float("-inf")), ValueType.FLOAT32),
     "tokenizer.ggml.scores entry 300 is -inf, not a finite score"),
    ("every score NaN", rewritten(SCORES, lambda v: [float("nan")] * len(v), ValueType.FLOAT32),
     "tokenizer.ggml.scores entry 0 is nan"),
    ("a score more than tokens", rewritten(SCORES, lambda v: v + [0.0], ValueType.FLOAT32),
     f"GGUF key tokenizer.ggml.scores has {N_TOKENS + 1} entries for {N_TOKENS} tokens"),
    ("a score fewer than tokens", rewritten(SCORES, lambda v: v[:-1], ValueType.FLOAT32),
     f"tokenizer.ggml.scores has {N_TOKENS - 1} entries for {N_TOKENS} tokens"),
    ("token type 99", rewritten(TYPES, at(5, 99), ValueType.INT32),
     "GGUF key tokenizer.ggml.token_type entry 5 is 99, not a token type"),
    ("token type 7", rewritten(TYPES, at(400, 7), ValueType.INT32), "token_type entry 400 is 7, not a token type"),
    ("token type -1", rewritten(TYPES, at(0, -1), ValueType.INT32), "token_type entry 0 is -1, not a token type"),
    ("every token type 99", rewritten(TYPES, lambda v: [99] * len(v), ValueType.INT32),
     "token_type entry 0 is 99"),
    ("a token type more than tokens", rewritten(TYPES, lambda v: v + [1], ValueType.INT32),
     f"tokenizer.ggml.token_type has {N_TOKENS + 1} entries for {N_TOKENS} tokens"),
    ("a token text with a byte that is not UTF-8", rewritten(TOKENS, at(300, "ab\udcffc"), ValueType.STRING),
     r"GGUF key tokenizer.ggml.tokens entry 300 \('ab\\udcffc'\) is not UTF-8 text: the byte 0xff at character 2"),
    ("a token text with an encoded surrogate", rewritten(TOKENS, at(401, "\udced\udca0\udc80x"), ValueType.STRING),
     "tokenizer.ggml.tokens entry 401 .* is not UTF-8 text: the byte 0xed at character 0"),
    ("a byte token's text not UTF-8", rewritten(TOKENS, at(13, "<0x\udcff>"), ValueType.STRING),
     "tokenizer.ggml.tokens entry 13 .* is not UTF-8 text"),
    ("every token text not UTF-8",
     rewritten(TOKENS, lambda v: [t + "\udcfe" for t in v], ValueType.STRING), "tokens entry 0 .* the byte 0xfe"),
    ("bos_token_id past the vocabulary", rewritten("tokenizer.ggml.bos_token_id", lambda v: C.u32(N_TOKENS)),
     f"GGUF key tokenizer.ggml.bos_token_id is {N_TOKENS}, outside the vocabulary of {N_TOKENS} tokens "
     rf"\(0..{N_TOKENS - 1}\)"),
    ("eos_token_id 10^6", rewritten("tokenizer.ggml.eos_token_id", lambda v: C.u32(10**6)),
     "tokenizer.ggml.eos_token_id is 1000000, outside the vocabulary"),
    ("unknown_token_id -2",
     rewritten("tokenizer.ggml.unknown_token_id", lambda v: MetaValue(ValueType.INT32, None, -2)),
     "tokenizer.ggml.unknown_token_id is -2, outside the vocabulary"),
    ("padding_token_id 2^32 - 2", rewritten("tokenizer.ggml.padding_token_id", lambda v: C.u32(2**32 - 2)),
     "tokenizer.ggml.padding_token_id is 4294967294, outside the vocabulary"),
]


@pytest.mark.parametrize("make, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_damaged_vocabulary_is_refused_in_one_line(stories_path, tmp_path, make, expected: str) -> None:
    path = make(stories_path, tmp_path)
    with pytest.raises(LlamapyError) as error:
        llamapy.load_model(path)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{path}: ") and re.search(expected, message), message


@pytest.mark.parametrize("token_id", [C.u32(2**32 - 1), MetaValue(ValueType.INT32, None, -1)],
                         ids=["uint32", "int32"])
def test_minus_one_means_no_such_token(stories_path, tmp_path, token_id: MetaValue) -> None:
    """-1 (as stories260K's own separator and padding ids store it) is "none", not damage: the
    id is absent and the vocabulary tokenizes as the original."""
    path = rewritten("tokenizer.ggml.eot_token_id", lambda v: token_id)(stories_path, tmp_path)
    vocab, original = llamapy.load_model(path).vocab, llamapy.load_model(stories_path).vocab
    assert vocab.eot_id is None and original.pad_id is None and original.sep_id is None
    text = "Once upon a time, there was a little girl named Lily."
    assert vocab.tokenize(text) == original.tokenize(text)


def test_token_type_0_loads(stories_path, tmp_path) -> None:
    """0 (undefined) is a llama.cpp token type, the lower end of the range: not refused."""
    path = rewritten(TYPES, at(400, 0), ValueType.INT32)(stories_path, tmp_path)
    assert llamapy.load_model(path).vocab.token_type(400) == 0


# ---- a byte-level BPE vocabulary --------------------------------------------------------------
BPE_TOKENS = ["a", "b", "Ġ", "ab", "Ġa", "<|endoftext|>"]


def bpe_metadata(**changes) -> dict[str, MetaValue]:
    meta = {
        "tokenizer.ggml.model": C.string("gpt2"),
        "tokenizer.ggml.pre": C.string("gpt-2"),
        TOKENS: MetaValue(ValueType.ARRAY, ValueType.STRING, BPE_TOKENS),
        TYPES: MetaValue(ValueType.ARRAY, ValueType.INT32, np.array([1, 1, 1, 1, 1, 3], np.int32)),
        "tokenizer.ggml.merges": MetaValue(ValueType.ARRAY, ValueType.STRING, ["a b", "Ġ a"]),
        "tokenizer.ggml.bos_token_id": C.u32(5),
        "tokenizer.ggml.eos_token_id": C.u32(5),
    }
    meta.update(changes)
    return meta


def test_the_bpe_vocabulary_loads() -> None:
    assert Vocab.from_gguf(bpe_metadata()).tokenize("ab a", add_special=False) == [3, 4]


@pytest.mark.parametrize("changes, expected", [
    ({TOKENS: MetaValue(ValueType.ARRAY, ValueType.STRING, ["a", "b", "Ġ", "a\udc80", "Ġa", "<|endoftext|>"])},
     r"tokenizer.ggml.tokens entry 3 \('a\\udc80'\) is not UTF-8 text: the byte 0x80 at character 1"),
    ({"tokenizer.ggml.merges": MetaValue(ValueType.ARRAY, ValueType.STRING, ["a b", "Ġ \udcc3"])},
     r"tokenizer.ggml.merges entry 1 .* is not UTF-8 text: the byte 0xc3"),
    ({SCORES: MetaValue(ValueType.ARRAY, ValueType.FLOAT32, np.array([0, 0, 0, np.nan, 0, 0], np.float32))},
     "tokenizer.ggml.scores entry 3 is nan, not a finite score"),
    ({TYPES: MetaValue(ValueType.ARRAY, ValueType.INT32, np.array([1, 1, 1, 1, 1, 3, 3], np.int32))},
     "tokenizer.ggml.token_type has 7 entries for 6 tokens"),
    ({"tokenizer.ggml.eos_token_id": C.u32(6)}, "tokenizer.ggml.eos_token_id is 6, outside the vocabulary of 6"),
], ids=["token text", "merge", "score", "types", "eos id"])
def test_a_damaged_bpe_vocabulary_is_refused(changes: dict, expected: str) -> None:
    with pytest.raises(VocabError) as error:
        Vocab.from_gguf(bpe_metadata(**changes))
    assert "\n" not in str(error.value) and re.search(expected, str(error.value)), error.value


# ---- through a tool ---------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["a NaN score", "token type 99", "a token text with a byte that is not UTF-8"])
def test_a_tool_refuses_a_damaged_vocabulary_in_one_line(stories_path, tmp_path, capsys, case: str) -> None:
    make, expected = next(c[1:] for c in CASES if c[0] == case)
    model = make(stories_path, tmp_path)
    text = tmp_path / "text.txt"
    text.write_text("Once upon a time, there was a little girl named Lily. " * 20, encoding="utf-8")
    before = {p: digest(p) for p in (model, text)}
    code, err = run_tool("perplexity", "-m", model, "-f", text, "-c", "16", capsys=capsys)
    assert code != 0 and re.search(expected, one_error(err)), err
    assert {p: digest(p) for p in before} == before
