"""The tokenizer rebuilt from GGUF metadata, giving the same token ids as llama.cpp.

Two vocabulary kinds are supported, each delegated to a library that implements the
merge algorithm llama.cpp copies, so none is hand-written here:

* ``tokenizer.ggml.model = "llama"`` (SPM): a sentencepiece BPE model is serialised
  from the GGUF token list (a tiny protobuf encoder below) and loaded from bytes.
* ``tokenizer.ggml.model = "gpt2"`` (byte-level BPE) and ``"gemma4"`` (BPE over raw
  UTF-8 with "▁" for spaces and <0xXX> byte fallback): a Hugging Face ``tokenizers``
  BPE model from the token list and merges, pre-tokenized with llama.cpp's regexes
  for the ``tokenizer.ggml.pre`` value (gemma4 has its own).

What llama.cpp does around the merge step is rebuilt in Python: splitting out special
tokens first (``tokenizer_st_partition``), the SPM space prefix, BOS/EOS, the
end-of-generation set, ``token_to_piece`` and ``detokenize`` (with ``clean_spaces``).
"""
from __future__ import annotations

import hashlib
import json
import re
import struct
from array import array
from typing import Callable

import numpy as np

from llamapy import vocab_checks as checks
from llamapy.errors import InputError, LlamapyError, VocabError
from llamapy.gguf_file import GGUFMetadata, MetaValue, metadata_from_reader, typed_scalar
from llamapy.long_text import check_cuttable, encode_long
from llamapy.pretokenizers import PRE_TOKENIZERS, PreTokenizer
from llamapy.text_input import check_text

# GGUF token types (tokenizer.ggml.token_type values).
TYPE_NORMAL, TYPE_UNKNOWN, TYPE_CONTROL, TYPE_USER_DEFINED, TYPE_UNUSED, TYPE_BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp token attributes (bit flags). Auto-detection can add CONTROL to a token whose
# GGUF type says otherwise, and phi-3 adds RSTRIP, so attributes are kept apart from types.
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8

_TYPE_TO_ATTR = {
    TYPE_NORMAL: ATTR_NORMAL,
    TYPE_UNKNOWN: ATTR_UNKNOWN,
    TYPE_CONTROL: ATTR_CONTROL,
    TYPE_USER_DEFINED: ATTR_USER_DEFINED,
    TYPE_UNUSED: ATTR_UNUSED,
    TYPE_BYTE: ATTR_BYTE,
}
_ATTR_SPECIAL = ATTR_UNKNOWN | ATTR_CONTROL
_C_SPACES = " \t\n\v\f\r"  # C isspace(), used by llama.cpp for lstrip/rstrip
_SPM_SPACE = "\u2581"  # sentencepiece's escaped space "▁"

# BPE values of tokenizer.ggml.model: llama.cpp's default BOS/EOS id, and the pre-tokenizer it
# uses whatever tokenizer.ggml.pre says.
_BPE_MODELS: dict[str, tuple[int | None, str | None]] = {"gpt2": (11, None), "gemma4": (None, "gemma4")}


# ---------------------------------------------------------------------------------------
# Special tokens llama.cpp recognises by their text when the metadata does not name them.
# Where several candidates exist, the first in these lists wins (llama.cpp's choice then
# depends on hash-map order; this picks what it reports for Qwen2 and Phi-3).
# ---------------------------------------------------------------------------------------

_AUTODETECT_TEXTS: dict[str, tuple[str, ...]] = {
    "eot": (
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
        "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
    ),
    "eom": ("<|eom_id|>",),
    "fim_pre": (
        "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
        "<|code_prefix|>", "<|prefix|>",
    ),
    "fim_suf": (
        "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
        "<|code_suffix|>", "<|suffix|>",
    ),
    "fim_mid": (
        "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
        "<|code_middle|>", "<|middle|>",
    ),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
})
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss

# Metadata keys of the special ids; the deprecated prefix/suffix/middle keys come last.
_SPECIAL_ID_KEYS: tuple[tuple[str, str], ...] = (
    ("bos", "tokenizer.ggml.bos_token_id"),
    ("eos", "tokenizer.ggml.eos_token_id"),
    ("eot", "tokenizer.ggml.eot_token_id"),
    ("eom", "tokenizer.ggml.eom_token_id"),
    ("unk", "tokenizer.ggml.unknown_token_id"),
    ("sep", "tokenizer.ggml.seperator_token_id"),
    ("pad", "tokenizer.ggml.padding_token_id"),
    ("mask", "tokenizer.ggml.mask_token_id"),
    ("fim_pre", "tokenizer.ggml.fim_pre_token_id"),
    ("fim_suf", "tokenizer.ggml.fim_suf_token_id"),
    ("fim_mid", "tokenizer.ggml.fim_mid_token_id"),
    ("fim_pad", "tokenizer.ggml.fim_pad_token_id"),
    ("fim_rep", "tokenizer.ggml.fim_rep_token_id"),
    ("fim_sep", "tokenizer.ggml.fim_sep_token_id"),
    ("fim_pre", "tokenizer.ggml.prefix_token_id"),
    ("fim_suf", "tokenizer.ggml.suffix_token_id"),
    ("fim_mid", "tokenizer.ggml.middle_token_id"),
)

# ---------------------------------------------------------------------------------------
# Reading GGUF metadata
# ---------------------------------------------------------------------------------------


def _metadata(source) -> dict[str, MetaValue]:
    """Metadata from a GGUFFile (or in-memory model description), a metadata dict, or a `gguf.GGUFReader`."""
    if isinstance(source, GGUFMetadata):
        return source.metadata
    if isinstance(source, dict):
        return source
    return metadata_from_reader(source)


def _scalar(meta: dict[str, MetaValue], key: str, kind: type, default=None):
    """A scalar of `kind` (int, bool or str), or `default` when the key is absent; one line
    when the file stores another type."""
    value = typed_scalar(meta, key, kind)
    return default if value is None else value


# ---------------------------------------------------------------------------------------
# A minimal protobuf encoder for sentencepiece's ModelProto (sentencepiece_model.proto)
# ---------------------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int32 values are sign-extended to 64 bits
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _pb_int(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(int(value))


def _pb_bytes(field: int, value: bytes) -> bytes:
    return _varint((field << 3) | 2) + _varint(len(value)) + value


def _pb_float(field: int, value: float) -> bytes:
    return _varint((field << 3) | 5) + struct.pack("<f", value)


_SP_NORMAL, _SP_UNKNOWN, _SP_BYTE = 1, 2, 6
_SP_MODEL_BPE = 2


def _is_byte_piece(text: str) -> bool:
    return len(text) == 6 and text.startswith("<0x") and text.endswith(">") and all(
        c in "0123456789ABCDEF" for c in text[3:5])


def _spm_model_proto(texts: list[str], scores: list[float], attrs: list[int], unk_id: int) -> bytes:
    """Serialise a sentencepiece BPE model whose ids are the GGUF token ids.

    llama.cpp's SPM merge considers every token of the vocab, whatever its type, and never
    resegments UNUSED or freezes USER_DEFINED pieces as sentencepiece would; so all
    pieces are NORMAL except byte pieces (for byte fallback) and the one UNKNOWN piece.
    A piece is written from constant tags (field 1 bytes, field 2 float, field 3 varint) in
    one pass: a 262,144-piece vocabulary takes a fraction of a second, not seconds.
    """
    pack_float = struct.Struct("<f").pack
    tag_bytes, tag_score, tag_kind = b"\x0a", b"\x15", b"\x18"
    kinds = {k: tag_kind + _varint(k) for k in (_SP_NORMAL, _SP_UNKNOWN, _SP_BYTE)}
    normal, short = kinds[_SP_NORMAL], [bytes((n,)) for n in range(0x80)]
    parts: list[bytes] = []
    append = parts.append
    has_bytes = False
    for i, (text, score, attr) in enumerate(zip(texts, scores, attrs)):
        kind = normal
        if i == unk_id:
            kind = kinds[_SP_UNKNOWN]
        elif attr & ATTR_BYTE and _is_byte_piece(text):
            kind, has_bytes = kinds[_SP_BYTE], True
        raw = text.encode("utf-8", "surrogateescape")
        n = len(raw)
        piece = (tag_bytes + (short[n] if n < 0x80 else _varint(n)) + raw + tag_score + pack_float(score) + kind)
        m = len(piece)
        append(tag_bytes + (short[m] if m < 0x80 else _varint(m)) + piece)
    trainer = (_pb_int(3, _SP_MODEL_BPE) + _pb_int(4, len(texts)) + _pb_int(35, has_bytes)
               + _pb_int(40, unk_id) + _pb_int(41, -1) + _pb_int(42, -1) + _pb_int(43, -1))
    # The space prefix is added by Vocab.tokenize (llama.cpp adds it after special tokens too).
    normalizer = (_pb_bytes(1, b"identity") + _pb_int(3, False) + _pb_int(4, False) + _pb_int(5, True))
    return b"".join(parts) + _pb_bytes(2, trainer) + _pb_bytes(3, normalizer)


def _spm_encoder(texts: list[str], scores: list[float], attrs: list[int], unk_id: int
                 ) -> Callable[[str], list[int]]:
    """A function encoding one raw-text fragment (spaces not yet escaped) to ids."""
    import sentencepiece  # here: a process whose model has a BPE vocabulary never loads it
    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(_spm_model_proto(texts, scores, attrs, unk_id))
    except (RuntimeError, OSError) as exc:
        raise VocabError(f"cannot build the SPM tokenizer from the GGUF vocabulary: {exc}") from exc

    return processor.EncodeAsIds


# ---------------------------------------------------------------------------------------
# Byte-level BPE (tokenizers)
# ---------------------------------------------------------------------------------------


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {c: b for b, c in _byte_to_unicode().items()}
_NEWLINES = re.compile("\n+")


def _bpe_merges(merges: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Merge pairs in rank order, split like llama.cpp (at the first space after index 0).

    `tokenizers` refuses merges whose parts or result are not tokens; llama.cpp keeps the
    first of duplicate pairs. Such merges are dropped; ranks only matter relatively.
    """
    if any(m.startswith(" ") for m in merges):
        split = [(m[:pos], m[pos + 1:]) for m in merges if (pos := m.find(" ", 1)) > 0]
    else:  # the usual case, in C: at the first space
        split = [tuple(parts) for m in merges if len(parts := m.split(" ", 1)) == 2]
    unique = dict.fromkeys(split)  # the first of duplicate pairs, in rank order
    return [p for p in unique if p[0] in vocab and p[1] in vocab and p[0] + p[1] in vocab]


def _bpe_encoder(texts: list[str], merges: list[str], pre: PreTokenizer) -> Callable[[str], list[int]]:
    """A function encoding one raw-text fragment to ids with a BPE tokenizer.

    Byte-level vocabs (GPT-2's alphabet) get `tokenizers`' ByteLevel step after the splits;
    SPM-style ones (gemma4) merge raw characters and fall back to <0xXX> byte tokens, as
    llama.cpp does when `byte_encode` is off. A character that is no token (and has no byte
    tokens) stops merges across it in llama.cpp and is then dropped; `tokenizers` would drop
    it before merging, so it is encoded as an extra "unknown" id, removed afterwards.
    """
    from tokenizers import (  # here: only BPE vocabularies need it (3 MB)
        Regex,
        Tokenizer,
        models,
        pre_tokenizers,
    )
    vocab = {text: i for i, text in enumerate(texts)}
    unknown = len(texts)  # "" is never a token text: vocab_checks.token_texts renames empty ones
    try:
        model = models.BPE(vocab={**vocab, "": unknown}, merges=_bpe_merges(merges, vocab), unk_token="",
                           ignore_merges=pre.ignore_merges, byte_fallback=not pre.byte_encode)
        tokenizer = Tokenizer(model)
        steps = [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in pre.regexes]
        if pre.byte_encode:
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    except Exception as exc:  # tokenizers raises plain Exception subclasses
        raise VocabError(f"cannot build the BPE tokenizer from the GGUF vocabulary: {exc}") from exc

    def merge(text: str) -> list[int]:
        return [i for i in tokenizer.encode(text, add_special_tokens=False).ids if i != unknown]

    def encode(text: str) -> list[int]:
        if pre.escape_whitespaces:
            text = text.replace(" ", _SPM_SPACE)
        if not pre.whole_newline_runs:
            return merge(text)
        ids: list[int] = []
        done = 0
        for run in _NEWLINES.finditer(text):
            token = vocab.get(run.group())
            if token is not None:  # the run is one token: llama.cpp skips its merges
                ids += merge(text[done:run.start()])
                ids.append(token)
                done = run.end()
        return ids + merge(text[done:])

    return encode


def _decode_byte_level(text: str) -> bytes:
    """A byte-level BPE token's bytes (llama.cpp's llama_decode_text, quirks included)."""
    out = bytearray()
    for ch in text:
        byte = _UNICODE_TO_BYTE.get(ch)
        if byte is not None:
            out.append(byte)
        else:
            raw = ch.encode("utf-8", "surrogateescape")
            out += b"[UNK_BYTE_0x" + raw.hex().encode() + text.encode("utf-8", "surrogateescape") + b"]"
    return bytes(out)


# ---------------------------------------------------------------------------------------
# detokenize's clean_spaces passes (llama.cpp, for most BPE vocabs)
# ---------------------------------------------------------------------------------------


_SPACE_BEFORE_PUNCTUATION = re.compile(rb" ([?!.,])")  # " ?", " !", " .", " ,"
_LONE_QUOTE = re.compile(rb" ' ")  # " ' " loses both spaces
_SPACE_BEFORE_CONTRACTION = re.compile(rb" '(?=s|m|re|ve)")  # " 't", " 'd", " 'll" keep theirs


def _clean_spaces(text: bytes) -> bytes:
    """Undo the spaces a word-level tokenizer put before punctuation and contractions.

    llama.cpp's three in-place passes; each is a non-overlapping left-to-right rewrite,
    which is what these substitutions do.
    """
    text = _SPACE_BEFORE_PUNCTUATION.sub(rb"\1", text)
    text = _LONE_QUOTE.sub(b"'", text)
    return _SPACE_BEFORE_CONTRACTION.sub(b"'", text)


# ---------------------------------------------------------------------------------------
# Special-token partition (llama.cpp tokenizer_st_partition)
# ---------------------------------------------------------------------------------------

Fragment = str | int  # raw text still to tokenize, or a token id already decided


def _split_on_token(text: str, needle: str, token: int, lstrip: bool, rstrip: bool) -> list[Fragment]:
    """Split one raw fragment around every occurrence of a special token's text."""
    out: list[Fragment] = []
    pos = 0
    while True:
        match = text.find(needle, pos)
        if match < 0:
            if pos < len(text):
                out.append(text[pos:])
            return out
        left = text[pos:match]
        if lstrip:
            left = left.rstrip(_C_SPACES)
        if left:
            out.append(left)
        out.append(token)
        pos = match + len(needle)
        if rstrip:
            while pos < len(text) and text[pos] in _C_SPACES:
                pos += 1


# ---------------------------------------------------------------------------------------
# The vocabulary
# ---------------------------------------------------------------------------------------


class Vocab:
    """A GGUF vocabulary: tokenize and detokenize exactly as llama.cpp does."""

    def __init__(self) -> None:  # use Vocab.from_gguf
        self.kind = "spm"  # "spm" (tokenizer.ggml.model = llama) or "bpe" (gpt2, gemma4)
        self._texts: list[str] = []
        self._types: list[int] = []
        self._attrs: list[int] = []
        self._pieces: dict[int, bytes] = {}  # token_to_piece(special=True), filled on demand
        self._special_ids: list[int] = []  # tokens the partition looks for, longest first
        self._eog_ids: set[int] = set()
        self._encode: Callable[[str], list[int]] = lambda text: []
        self.bos_id: int | None = None
        self.eos_id: int | None = None
        self.eot_id: int | None = None
        self.eom_id: int | None = None
        self.unk_id: int | None = None
        self.sep_id: int | None = None
        self.pad_id: int | None = None
        self.mask_id: int | None = None
        self.fim_ids: dict[str, int | None] = {}  # fim_pre, fim_suf, fim_mid, fim_pad, fim_rep, fim_sep (None: none)
        self.add_bos = False
        self.add_eos = False
        self.add_sep = False
        self.add_space_prefix = False
        self.clean_spaces = False
        self.escape_whitespaces = False  # SPM-style BPE (gemma4): "▁" in tokens stands for a space

    # -- loading ---------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, source) -> "Vocab":
        """Rebuild the tokenizer from a GGUF file's tokenizer.ggml.* metadata (a refusal names
        the file when the source has a path)."""
        try:
            return cls._from_metadata(_metadata(source))
        except LlamapyError as e:
            where = getattr(source, "path", None)
            if where is None:
                raise
            raise type(e)(f"{where}: {e}") from None

    @classmethod
    def _from_metadata(cls, reader: dict[str, MetaValue]) -> "Vocab":
        """The steps follow llama.cpp's llama_vocab::load, in its order: defaults for the
        vocab kind, special ids, metadata flags, text-based detection of special tokens,
        the end-of-generation set, then the special-token cache used by tokenize.
        """
        vocab = cls()
        model = _scalar(reader, "tokenizer.ggml.model", str)
        if model is None:
            raise VocabError("GGUF file has no tokenizer.ggml.model (no vocabulary)")
        pre_name = _scalar(reader, "tokenizer.ggml.pre", str, "")
        vocab._texts = checks.token_texts(reader)
        vocab._types = checks.token_types(reader, vocab.n_tokens, TYPE_NORMAL)
        scores = checks.token_scores(reader, vocab.n_tokens)
        vocab._check_byte_tokens()
        vocab._attrs = [_TYPE_TO_ATTR.get(t, 0) for t in vocab._types]
        defaults, pre = vocab._configure(model, pre_name)
        ids = vocab._special_ids_from(reader, defaults)
        vocab._apply_flags(reader, pre)
        vocab._autodetect(ids)
        vocab._eog_ids = vocab._end_of_generation_ids(ids)
        vocab.bos_id, vocab.eos_id, vocab.eot_id, vocab.eom_id = ids["bos"], ids["eos"], ids["eot"], ids["eom"]
        vocab.unk_id, vocab.sep_id, vocab.pad_id, vocab.mask_id = ids["unk"], ids["sep"], ids["pad"], ids["mask"]
        vocab.fim_ids = {name: ids[name] for name in ("fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep")}
        vocab._check_add_special()
        vocab._special_ids = vocab._special_token_cache()
        vocab._set_strip_attrs(_scalar(reader, "general.name", str, ""), pre_name)
        vocab._encode = vocab._build_encoder(reader, pre, scores)
        return vocab

    def _build_encoder(self, reader: dict[str, MetaValue], pre: PreTokenizer | None, scores: list[float] | None
                       ) -> Callable[[str], list[int]]:
        """The library tokenizer for raw-text fragments: sentencepiece (SPM) or tokenizers (BPE)."""
        if self.kind == "spm":
            unk_id = 0 if self.unk_id is None else self.unk_id  # SPM's default unk (0) is always valid
            return _spm_encoder(self._texts, scores or [0.0] * self.n_tokens, self._attrs, unk_id)
        assert pre is not None  # set by _configure for every BPE vocab
        merges = checks.merges(reader)
        if merges is None and not pre.merges_optional:
            raise VocabError("GGUF file has no tokenizer.ggml.merges, needed by a BPE vocabulary")
        return _bpe_encoder(self._texts, merges or [], pre)

    def _special_token_cache(self) -> list[int]:
        """Control, user-defined and unknown tokens, longest text (in bytes) first."""
        special = [i for i, a in enumerate(self._attrs) if a & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)]
        return sorted(special, key=lambda i: -len(self._texts[i].encode("utf-8", "surrogateescape")))

    def _configure(self, model: str, pre_name: str) -> tuple[dict[str, int | None], PreTokenizer | None]:
        """Vocab kind and llama.cpp's defaults for it; returns default special ids."""
        if model == "llama":
            self.kind = "spm"
            self.add_space_prefix, self.add_bos, self.add_eos, self.clean_spaces = True, True, False, False
            return {"bos": 1, "eos": 2, "unk": 0}, None
        if model not in _BPE_MODELS:
            raise VocabError(f"unsupported tokenizer type tokenizer.ggml.model = {model!r}; llamapy supports "
                             f"{', '.join(map(repr, ('llama', *_BPE_MODELS)))}")
        default_id, forced_pre = _BPE_MODELS[model]
        pre_name = forced_pre or pre_name or "default"
        pre = PRE_TOKENIZERS.get(pre_name)
        if pre is None:
            raise VocabError(f"unsupported pre-tokenizer type tokenizer.ggml.pre = {pre_name!r}; llamapy supports "
                             f"{', '.join(sorted(PRE_TOKENIZERS))}")
        self.kind = "bpe"
        self.add_space_prefix, self.add_bos, self.clean_spaces = False, pre.add_bos, pre.clean_spaces
        self.add_sep, self.escape_whitespaces = pre.add_sep, pre.escape_whitespaces
        return {"bos": None if pre.no_bos else default_id, "eos": default_id}, pre

    def _special_ids_from(self, reader: dict[str, MetaValue], defaults: dict[str, int | None]
                          ) -> dict[str, int | None]:
        """Special ids: defaults dropped when out of range, then the metadata's (checked by
        vocab_checks.special_id: in range, or -1 for none)."""
        n = len(self._texts)
        ids: dict[str, int | None] = {name: None for name, _ in _SPECIAL_ID_KEYS}
        for name, value in defaults.items():
            ids[name] = value if value is not None and 0 <= value < n else None
        for name, key in _SPECIAL_ID_KEYS:
            value = checks.special_id(reader, key, n)
            if value is not None:
                ids[name] = value
        return ids

    def _apply_flags(self, reader: dict[str, MetaValue], pre: PreTokenizer | None) -> None:
        """Metadata overrides of the space-prefix and BOS/EOS/SEP defaults."""
        self.add_space_prefix = _scalar(reader, "tokenizer.ggml.add_space_prefix", bool, self.add_space_prefix)
        self.add_bos = _scalar(reader, "tokenizer.ggml.add_bos_token", bool, self.add_bos)
        self.add_eos = _scalar(reader, "tokenizer.ggml.add_eos_token", bool, self.add_eos)
        self.add_sep = _scalar(reader, "tokenizer.ggml.add_sep_token", bool, self.add_sep)
        if pre is not None and pre.force_bos:
            self.add_bos = True

    def _check_byte_tokens(self) -> None:
        """A BYTE token stands for the byte its text <0xXX> names: any other text is refused
        (llama.cpp reads past such a text, or a byte from its 4th and 5th characters)."""
        for i, (text, kind) in enumerate(zip(self._texts, self._types)):
            if kind == TYPE_BYTE and not _is_byte_piece(text):
                raise VocabError(f"token {i} ({text!r}) is typed BYTE in tokenizer.ggml.token_type, but its text is "
                                 "not a byte <0xXX>")

    def _check_add_special(self) -> None:
        if self.add_bos and self.bos_id is None:
            raise VocabError("tokenizer.ggml.add_bos_token is true, but tokenizer.ggml.bos_token_id is not set")
        if self.add_eos and self.eos_id is None:
            raise VocabError("tokenizer.ggml.add_eos_token is true, but tokenizer.ggml.eos_token_id is not set")

    def _autodetect(self, ids: dict[str, int | None]) -> None:
        """Find EOT/EOM/FIM tokens by text when the metadata does not name them."""
        index = {text: i for i, text in enumerate(self._texts)}
        for name, candidates in _AUTODETECT_TEXTS.items():
            if ids[name] is not None:
                continue
            for text in candidates:
                if text in index:
                    ids[name] = index[text]
                    self._attrs[ids[name]] |= ATTR_CONTROL
                    break

    def _end_of_generation_ids(self, ids: dict[str, int | None]) -> set[int]:
        """Tokens that end generation, with llama.cpp's per-model workarounds."""
        eog = {ids[name] for name in ("fim_pad", "fim_rep", "fim_sep") if ids[name] is not None}
        for i, text in enumerate(self._texts):
            if text in _EOG_TEXTS:
                eog.add(i)
                self._attrs[i] |= ATTR_CONTROL
            elif text in _ALWAYS_RENDERED:
                self._attrs[i] = ATTR_USER_DEFINED
        eog |= {ids[name] for name in ("eos", "eot", "eom") if ids[name] is not None}
        by_text = {self._texts[i]: i for i in eog}
        # o200k_harmony / solar-open: "<|end|>" is not an end of generation there.
        has_call = "<|call|>" in by_text or "<|calls|>" in by_text
        if "<|end|>" in by_text and has_call and ("<|return|>" in by_text or "<|flush|>" in by_text):
            eog.discard(by_text["<|end|>"])
            self._attrs[by_text["<|end|>"]] = ATTR_USER_DEFINED
        # gemma4 and plamo have a normal "</s>" (paddleocr's ends generation).
        if ("<|tool_response>" in by_text or "<|plamo:eos|>" in by_text) and "</s>" in by_text:
            eog.discard(by_text["</s>"])
            self._attrs[by_text["</s>"]] = ATTR_NORMAL
        return eog

    def _set_strip_attrs(self, model_name: str, pre_name: str) -> None:
        """Per-model LSTRIP/RSTRIP attributes llama.cpp hard-codes (they affect partition)."""
        index = {text: i for i, text in enumerate(self._texts)}
        name = model_name.lower()
        if any(p in pre_name for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) and "<mask>" in index:
            self._attrs[index["<mask>"]] |= ATTR_LSTRIP
        elif "phi-3" in name or "phi3" in name:
            for i in self._special_ids:
                self._attrs[i] |= ATTR_RSTRIP
            for text, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
                if text in index:
                    i = index[text]
                    self._attrs[i] = (self._attrs[i] | ATTR_RSTRIP) if on else (self._attrs[i] & ~ATTR_RSTRIP)
        elif "modern-bert" in name and "[MASK]" in index:
            self._attrs[index["[MASK]"]] |= ATTR_LSTRIP

    def _piece(self, token: int) -> bytes:
        """A token's bytes when special tokens are rendered (llama.cpp's piece cache)."""
        text, attr = self._texts[token], self._attrs[token]
        if attr & (_ATTR_SPECIAL | ATTR_USER_DEFINED):
            return text.encode("utf-8", "surrogateescape")
        if attr & ATTR_NORMAL:
            if self.kind == "spm" or self.escape_whitespaces:
                return text.replace(_SPM_SPACE, " ").encode("utf-8", "surrogateescape")
            return _decode_byte_level(text)
        if attr & ATTR_BYTE:
            return bytes([int(text[3:5], 16)])
        return b""

    # -- public API ------------------------------------------------------------------

    @property
    def n_tokens(self) -> int:
        return len(self._texts)

    def token_text(self, token: int) -> str:
        """The raw vocabulary string of a token."""
        return self._texts[self._check(token)]

    def token_type(self, token: int) -> int:
        """The GGUF token type (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte)."""
        return self._types[self._check(token)]

    def fingerprint(self) -> str:
        """What tells two tokenizers apart (token shards record it): the kind, flags, special
        tokens, token texts and types, as 32 hex digits."""
        digest = hashlib.blake2b(digest_size=16)
        parts = [self.kind, self.n_tokens, self.bos_id, self.eos_id, self.add_bos, self.add_eos, self.add_sep,
                 self.add_space_prefix, self.escape_whitespaces, self.clean_spaces]
        digest.update(json.dumps([str(p) for p in parts]).encode())
        for values in (self._texts, self._types):
            digest.update("\x00".join(map(str, values)).encode("utf-8", "surrogatepass"))
        return digest.hexdigest()

    @property
    def eog_ids(self) -> frozenset[int]:
        """The end-of-generation tokens (EOS, EOT, EOM and the like, as llama.cpp finds them)."""
        return frozenset(self._eog_ids)

    def is_eog(self, token: int) -> bool:
        """True for tokens that end generation (EOS, EOT, <|im_end|>, ...)."""
        return token in self._eog_ids

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False,
                 space_prefix: bool = True) -> list[int]:
        """Token ids of `text`, as llama.cpp's llama_tokenize.

        add_special adds BOS/EOS when the vocab asks for them; parse_special lets control
        tokens written literally in the text become single tokens (user-defined tokens
        always do). `space_prefix=False` leaves out SentencePiece's space before the text
        (a piece that continues a text cut in pieces). A long text: `tokenize_array`.
        """
        return self.tokenize_array(text, add_special, parse_special, space_prefix).tolist()

    def tokenize_array(self, text: str, add_special: bool = True, parse_special: bool = False,
                       space_prefix: bool = True) -> np.ndarray:
        """`tokenize`'s ids as an int32 array: 4 bytes a token where a list takes up to 36, and
        a long text encoded in bounded pieces (llamapy.long_text) with the same ids."""
        check_text(text, "the text to tokenize")
        out = array("i")
        if add_special and self.add_bos:
            out.append(self.bos_id)
        prev_special = space_prefix  # SPM: a space prefix goes at the start and after special tokens
        fragments = self._partition(text, parse_special)
        for fragment in fragments:
            if isinstance(fragment, str):
                check_cuttable(fragment)  # before any is encoded
        for fragment in fragments:
            if isinstance(fragment, int):
                out.append(fragment)
                prev_special = True
                continue
            prefix = " " if self.kind == "spm" and self.add_space_prefix and prev_special else ""
            encode_long(fragment, self._encode, out, prefix)
            prev_special = False
        if add_special and self.add_eos:
            out.append(self.eos_id)
        return np.frombuffer(out, dtype=np.intc).astype(np.int32, copy=False)

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """A token's bytes (possibly part of a UTF-8 character); control and unknown tokens
        are empty unless `special`."""
        if not special and self._attrs[self._check(token)] & _ATTR_SPECIAL:
            return b""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self._piece(token)
        return piece

    def detokenize(self, tokens: list[int], remove_special: bool = False, unparse_special: bool = False) -> str:
        """Text of a token list, as llama.cpp's llama_detokenize.

        remove_special drops a leading BOS / trailing EOS the vocab adds; unparse_special
        renders control tokens. Invalid UTF-8 becomes U+FFFD.
        """
        tokens = list(tokens)
        remove_space = self.add_space_prefix
        if remove_special and self.add_bos and tokens and tokens[0] == self.bos_id:
            remove_space = False
            tokens = tokens[1:]
        if remove_special and self.add_eos and tokens and tokens[-1] == self.eos_id:
            tokens = tokens[:-1]
        pieces = [self.token_to_piece(t, unparse_special) for t in tokens]
        if remove_space and pieces and pieces[0].startswith(b" "):
            pieces[0] = pieces[0][1:]
        text = b"".join(pieces)
        if self.clean_spaces:
            text = _clean_spaces(text)
        return text.decode("utf-8", "replace")

    # -- helpers ---------------------------------------------------------------------

    def _check(self, token: int) -> int:
        if not 0 <= token < len(self._texts):
            raise InputError(f"token id {token} is outside the vocabulary (0..{len(self._texts) - 1})")
        return token

    def _partition(self, text: str, parse_special: bool) -> list[Fragment]:
        """Split special tokens out of the text, longest first (llama.cpp's order)."""
        fragments: list[Fragment] = [text] if text else []
        for token in self._special_ids:
            attr = self._attrs[token]
            if not parse_special and attr & _ATTR_SPECIAL:
                continue
            needle = self._texts[token]
            if not any(isinstance(f, str) and needle in f for f in fragments):
                continue
            split: list[Fragment] = []
            for fragment in fragments:
                if isinstance(fragment, str) and needle in fragment:
                    split += _split_on_token(fragment, needle, token,
                                             bool(attr & ATTR_LSTRIP), bool(attr & ATTR_RSTRIP))
                else:
                    split.append(fragment)
            fragments = split
        return fragments
