"""A checkpoint's vocabulary as GGUF metadata, read without transformers: SentencePiece models
(tokenizer.model) through `sentencepiece`, byte-level BPE (tokenizer.json) through `tokenizers`.

What llama.cpp's convert_hf_to_gguf.py writes for each:
- SentencePiece: tokenizer.ggml.model "llama", pre "default", every piece with its score and
  type (added_tokens.json and tokenizer_config.json's added tokens overriding pieces), ids up
  to config.json's vocab_size, the ones the model has no piece for as [PADi] (unused);
- BPE: model "gpt2", the pre-tokenizer identified by the sha256 of the token ids of a fixed
  text (bpe_pre_hashes.json: llama.cpp's table of known tokenizers), tokens by id (added
  tokens as control or user-defined, holes as [PADi]), the merges.
Then the special tokens (special_tokens.py).
"""
from __future__ import annotations

import hashlib
import json
from functools import cache
from importlib import resources
from pathlib import Path

from llamapy.errors import CheckpointError
from llamapy.gguf_file import ValueType
from llamapy.pretokenizers import PRE_TOKENIZERS

from . import special_tokens
from .json_file import optional_json, read_json
from .metadata import Meta

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


@cache
def bpe_pre_table() -> dict:
    return json.loads(resources.files(__package__).joinpath("bpe_pre_hashes.json").read_text(encoding="utf-8"))


def looks_special(text: str) -> bool:
    """Added tokens llama.cpp's converter marks as control even when not flagged special."""
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<｜") and text.endswith("｜>")) or (text.startswith("<unused") and text.endswith(">")))


def spm_tokens(folder: Path, vocab_size: int | None) -> tuple[list[bytes], list[float], list[int]]:
    """tokenizer.model's pieces, scores and types, ids up to `vocab_size` (default: the model's)."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.LoadFromFile(str(folder / "tokenizer.model"))
    except (OSError, RuntimeError) as e:
        raise CheckpointError(f"{folder / 'tokenizer.model'} is not a SentencePiece model: {e}") from None
    n = vocab_size or sp.vocab_size()
    if sp.vocab_size() > n:  # ids the model has no embedding row for
        raise CheckpointError(f"{folder / 'tokenizer.model'} has {sp.vocab_size()} pieces, but config.json's "
                              f"vocab_size is {n}")
    tokens = [f"[PAD{i}]".encode() for i in range(n)]
    scores, types = [-10000.0] * n, [UNUSED] * n
    for i in range(min(n, sp.vocab_size())):
        tokens[i], scores[i] = sp.IdToPiece(i).encode("utf-8"), sp.GetScore(i)
        types[i] = (UNKNOWN if sp.IsUnknown(i) else CONTROL if sp.IsControl(i) else UNUSED if sp.IsUnused(i)
                    else BYTE if sp.IsByte(i) else NORMAL)
    for content, i in (optional_json(folder / "added_tokens.json") or {}).items():
        if i < n:
            tokens[i], scores[i], types[i] = content.encode("utf-8"), -1000.0, USER_DEFINED
    decoder = (optional_json(folder / "tokenizer_config.json") or {}).get("added_tokens_decoder", {})
    for key, entry in decoder.items():
        i, content = int(key), entry["content"]
        if i >= n:
            continue
        if entry.get("special") or looks_special(content):
            types[i] = CONTROL
        else:
            content, types[i] = content.replace("\u2581", " "), USER_DEFINED
        tokens[i], scores[i] = content.encode("utf-8"), -1000.0
    return tokens, scores, types


def add_spm_vocab(meta: Meta, folder: Path, config: dict, vocab_size: int | None) -> int:
    """The SentencePiece vocabulary's keys; returns the number of tokens."""
    tokens, scores, types = spm_tokens(folder, vocab_size)
    meta.string("tokenizer.ggml.model", "llama")
    meta.string("tokenizer.ggml.pre", "default")
    meta.array("tokenizer.ggml.tokens", ValueType.STRING, tokens)
    meta.array("tokenizer.ggml.scores", ValueType.FLOAT32, scores)
    meta.array("tokenizer.ggml.token_type", ValueType.INT32, types)
    special_tokens.gather(folder, config, n_vocab=len(tokens)).write(meta)
    return len(tokens)


def identify_pre(tokenizer) -> str:
    """The pre-tokenizer name llama.cpp gives a BPE tokenizer (its ids for a fixed text, hashed)."""
    table = bpe_pre_table()
    digest = hashlib.sha256(str(tokenizer.encode(table["chktxt"]).ids).encode()).hexdigest()
    name = table["hashes"].get(digest)
    if name is None:
        raise CheckpointError(f"the BPE tokenizer is not one llama.cpp knows (its pre-tokenizer hash {digest[:16]}... "
                              "is not in convert_hf_to_gguf.py's table), so its pre-tokenizer cannot be named")
    if name not in PRE_TOKENIZERS:
        raise CheckpointError(f"the tokenizer's pre-tokenizer is {name!r}, which llamapy does not support")
    return name


def add_bpe_vocab(meta: Meta, folder: Path, config: dict, vocab_size: int | None) -> int:
    """The byte-level BPE vocabulary's keys; returns the number of tokens."""
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception for a file it cannot read
        raise CheckpointError(f"{path} is not a tokenizer the `tokenizers` library reads: {e}") from None
    if type(tokenizer.model).__name__ != "BPE":
        raise CheckpointError(f"{path}: a {type(tokenizer.model).__name__} tokenizer; only BPE ones are converted")
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    n = vocab_size or len(vocab)
    if vocab and max(vocab.values()) >= n:
        raise CheckpointError(f"{path} has token ids up to {max(vocab.values())}, but config.json's vocab_size is {n}")
    pre = identify_pre(tokenizer)
    added = {a["content"]: a for a in read_json(path).get("added_tokens", [])}
    clean_up = (optional_json(folder / "tokenizer_config.json") or {}).get(
        "clean_up_tokenization_spaces") is True
    by_id = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(n):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
            continue
        if token in added:
            entry = added[token]
            if not entry.get("normalized", True):  # as transformers would give it back
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False).ids,
                                         skip_special_tokens=False)
                if clean_up:
                    token = _clean_up_spaces(token)
            if entry.get("special") or looks_special(token):
                types.append(CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(USER_DEFINED)
        else:
            types.append(NORMAL)
        tokens.append(token)
    meta.string("tokenizer.ggml.model", "gpt2")
    meta.string("tokenizer.ggml.pre", pre)
    meta.array("tokenizer.ggml.tokens", ValueType.STRING, tokens)
    meta.array("tokenizer.ggml.token_type", ValueType.INT32, types)
    special_tokens.gather(folder, config, load_merges=True, n_vocab=n).write(meta)
    return len(tokens)


def _clean_up_spaces(text: str) -> str:
    """transformers' clean_up_tokenization: no space before punctuation and some contractions."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
                 (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


def bpe_token_count(folder: Path) -> int:
    """Tokens of tokenizer.json (its model's vocabulary and its added tokens)."""
    tok = read_json(folder / "tokenizer.json")
    return len(tok["model"]["vocab"]) + len(tok.get("added_tokens", []))
