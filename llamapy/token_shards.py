"""Token shards: a corpus tokenized once, in parallel, into flat token files that training
reads a window at a time, so a corpus larger than memory can be trained on and a run's
memory does not grow with it (nanoGPT's train.bin, with an index).

A shard directory holds:
- `index.json`: the format and version, the tokenizer's fingerprint (a model with another
  vocabulary is refused), the token type (uint16 when the vocabulary fits, else uint32), the
  kind of data and the shards in order, each with its token count and its bytes' digest;
- `tokens-NNNNN.bin`: the token ids, little-endian, one document after another;
- for samples (JSONL) also `masks-NNNNN.bin` (uint8 per token: 1 where the token is learned,
  the answers of a conversation) and `lengths-NNNNN.bin` (uint32 tokens per sample; a sample
  never spans two shards).

Opening a directory checks it whole before any window is read: the index's entries (each
a distinct `tokens-NNNNN.bin` of the directory), the files' sizes, the token files' digests
and, in the same read, that every id is a token of the vocabulary (an id past it would index
past the embedding matrix), and for samples that the lengths cut the tokens into samples of
at least two tokens each.

A text ("text" kind) is one token stream: each document tokenized as `-f` tokenizes a file
(BOS first, as the vocabulary asks), the documents one after another. Training cuts it into
windows as it cuts one text, so `--data DIR` trains on the same windows as `-f FILE` for a
file tokenized alone. A file larger than a piece (256 KiB) is tokenized in pieces, in
parallel, cut at a line break where the tokenizer gives the same tokens for the text around
the cut whole and apart (`_cut`), the pieces after the first without SentencePiece's leading
space: the tokens are the whole text's (tested with four of llama.cpp's tokenizers, checked
with ten).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import InputError, SaveError
from .dataset import tokenize_sample
from .samples import FORMATS, Format, is_jsonl, parse_jsonl_line
from .text_input import decode_text

FORMAT = "llamapy-token-shards"
VERSION = 1
INDEX = "index.json"
PIECE_BYTES = 256 << 10          # a worker's unit of text: SentencePiece slows and swells on long inputs
SHARD_TOKENS = 256 << 20         # tokens per shard file (512 MiB of uint16)
VERIFY_PIECE = 4 << 20          # bytes read at a time to check a shard's digest
_CUT_SEARCH = 1 << 20            # how far back from a piece's end a cut is looked for
_CUT_TRIES = 256                 # line breaks tried there
_CUT_CONTEXT = 256               # bytes each side of a cut tokenized to check it
TOKENS_NAME = re.compile(r"tokens-[0-9]{5,}\.bin")  # the token files write_token_shards names
Kind = Literal["text", "samples"]


class ShardEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    tokens: str
    n_tokens: int = Field(ge=0)
    digest: str
    n_samples: int = Field(0, ge=0)  # samples (kind "samples"): masks-/lengths- files beside tokens-


class ShardIndex(BaseModel):
    """index.json (module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    format: Literal["llamapy-token-shards"] = FORMAT
    version: int = VERSION
    kind: Kind
    dtype: Literal["uint16", "uint32"]
    n_vocab: int = Field(ge=1)
    vocab: str                   # the tokenizer's Vocab.fingerprint()
    sources: list[str]
    shards: list[ShardEntry]
    chat_template: str | None = None   # samples: the template's name, and whether prompts were masked
    mask_prompt: bool = True
    formats: Annotated[list[Format], Field(min_length=1)] | None = None  # samples: their JSONL formats (None:
    #                                                                     written before formats were recorded)

    @property
    def n_tokens(self) -> int:
        return sum(s.n_tokens for s in self.shards)

    @property
    def n_samples(self) -> int:
        return sum(s.n_samples for s in self.shards)


def _verify_tokens(file: Path, expected: str, dtype: np.dtype, n_vocab: int) -> None:
    """The token file's bytes against the digest llamapy-tokenize wrote for it, and in the same
    read its ids against the vocabulary: a damaged or changed shard is refused before training,
    not trained on, and an id a model has no row for never reaches a kernel (read in pieces,
    through the page cache; about a second a GB)."""
    digest = hashlib.blake2b(digest_size=16)
    done = 0  # ids read
    with open(file, "rb") as f:
        while piece := f.read(VERIFY_PIECE):
            if len(piece) % dtype.itemsize:
                raise InputError(f"{file}: changed while it was read (its size is no longer whole tokens)")
            digest.update(piece)
            ids = np.frombuffer(piece, dtype)
            if int(ids.max()) >= n_vocab or (dtype.kind == "i" and int(ids.min()) < 0):
                at = int(np.argmax((ids >= n_vocab) | (ids < 0)))
                raise InputError(f"{file}: token {done + at} is id {int(ids[at])}, not one of the vocabulary's "
                                 f"{n_vocab} (0 to {n_vocab - 1}: a damaged or changed shard; tokenize the data "
                                 "again)")
            done += len(ids)
    if digest.hexdigest() != expected:
        raise InputError(f"{file}: its bytes are not the ones llamapy-tokenize wrote (the index's digest "
                         "differs: a damaged or changed shard; tokenize the data again)")


def is_shard_dir(path: Path) -> bool:
    return path.is_dir() and (path / INDEX).is_file()


# ---- reading ----------------------------------------------------------------------------------
class TokenShards:
    """An opened shard directory: its index, and its token files read a window at a time with
    positioned reads. The pages read stay in the system's page cache, shared and reclaimable,
    not in this process: its memory does not grow with the corpus as a memory map's resident
    pages would over an epoch."""

    def __init__(self, path: Path, index: ShardIndex) -> None:
        """Check the directory against `index` (the cheap checks first, then one read of the
        token files) and open it."""
        self.path, self.index = path, index
        self.dtype = np.dtype(index.dtype).newbyteorder("<")
        self._check_entries()
        self.tokens = [self._checked(s.tokens, s.n_tokens, self.dtype) for s in index.shards]
        self._open: dict[Path, object] = {}
        if index.kind == "samples":
            self.masks = [self._checked(_sibling(s.tokens, "masks"), s.n_tokens, np.uint8) for s in index.shards]
            self.lengths = np.concatenate([self._lengths(s) for s in index.shards])
            self.sample_starts = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        for s, file in zip(index.shards, self.tokens):
            _verify_tokens(file, s.digest, self.dtype, index.n_vocab)
        self.starts = np.concatenate([[0], np.cumsum([s.n_tokens for s in index.shards])]).astype(np.int64)

    @classmethod
    def open(cls, path: str | os.PathLike, vocab=None) -> TokenShards:
        """Open `path` (InputError for anything that is not an intact shard directory, or, when
        `vocab` is given, one tokenized with another tokenizer)."""
        path = Path(path)
        if not is_shard_dir(path):
            raise InputError(f"{path}: not a token shard directory (no {INDEX}; make one with llamapy-tokenize)")
        try:
            raw = json.loads((path / INDEX).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: also over-long ints
            raise InputError(f"{path / INDEX}: unreadable ({e})") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise InputError(f"{path / INDEX}: not a {FORMAT} index")
        if raw.get("version") != VERSION:
            raise InputError(f"{path / INDEX}: version {raw.get('version')} of the format; this llamapy reads "
                             f"version {VERSION} (tokenize the data again)")
        try:
            index = ShardIndex.model_validate(raw)
        except ValidationError as e:
            first = e.errors()[0]
            raise InputError(f"{path / INDEX}: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
        if not index.shards or index.n_tokens == 0:
            raise InputError(f"{path}: the shards hold no tokens")
        if vocab is not None and index.vocab != vocab.fingerprint():
            raise InputError(f"{path}: tokenized with another tokenizer than this model's (tokenize the data "
                             "again with this model)")
        if vocab is not None and index.n_vocab != vocab.n_tokens:
            raise InputError(f"{path / INDEX}: n_vocab {index.n_vocab}, but the model's vocabulary has "
                             f"{vocab.n_tokens} tokens (a changed index; tokenize the data again)")
        return cls(path, index)

    def _check_entries(self) -> None:
        """Each entry names a token file of this directory by its name, and no file twice: an
        index edited to point elsewhere, at another kind of file or at a shard twice (its
        tokens would silently train twice) is refused."""
        where, seen = self.path / INDEX, set()
        for k, s in enumerate(self.index.shards):
            if Path(s.tokens).name != s.tokens or s.tokens in ("", ".", ".."):
                raise InputError(f"{where}: shard {k} names {s.tokens!r}, not a file of the directory (an index "
                                 "names its shards by file name)")
            if not TOKENS_NAME.fullmatch(s.tokens):
                raise InputError(f"{where}: shard {k} names {s.tokens!r}, not a token file (tokens-NNNNN.bin)")
            if s.tokens in seen:
                raise InputError(f"{where}: shard {s.tokens!r} is listed twice (its tokens would train twice: a "
                                 "changed index; tokenize the data again)")
            if self.index.kind == "text" and s.n_samples:
                raise InputError(f"{where}: shard {s.tokens!r} of a text counts {s.n_samples} samples "
                                 "(a changed index; tokenize the data again)")
            seen.add(s.tokens)

    def _lengths(self, entry: ShardEntry) -> np.ndarray:
        """A samples shard's sample lengths, checked to cut its tokens into samples of at least
        two tokens (a sample learns its tokens after the first)."""
        file = self._checked(_sibling(entry.tokens, "lengths"), entry.n_samples, np.dtype("<u4"))
        n = np.fromfile(file, np.dtype("<u4")).astype(np.int64)
        if int(n.sum()) != entry.n_tokens:
            raise InputError(f"{file}: the sample lengths add up to {int(n.sum())} tokens, not the shard's "
                             f"{entry.n_tokens} (a damaged shard directory)")
        if len(n) and int(n.min()) < 2:
            k = int(np.argmin(n))
            raise InputError(f"{file}: sample {k} is {int(n[k])} token(s); a sample has at least 2 "
                             "(a damaged shard directory)")
        return n

    def _checked(self, name: str, count: int, dtype) -> Path:
        """The shard file `name`, checked to be in the directory and of the size the index says."""
        file = self.path / name
        if Path(name).name != name or not file.is_file():
            raise InputError(f"{self.path}: shard {name!r} is missing")
        size = file.stat().st_size
        if size != count * np.dtype(dtype).itemsize:
            raise InputError(f"{file}: {size} bytes, the index says {count * np.dtype(dtype).itemsize} "
                             "(a damaged or unfinished shard)")
        return file

    @property
    def n_tokens(self) -> int:
        return int(self.starts[-1])

    def read(self, start: int, length: int, masks: bool = False) -> np.ndarray:
        """Tokens (or, with `masks`, their learn flags) [start, start + length) of the stream,
        across shard boundaries, as int32."""
        if start < 0 or start + length > self.n_tokens:
            raise IndexError(f"tokens [{start}, {start + length}) of {self.n_tokens}")
        files, dtype = (self.masks, np.dtype(np.uint8)) if masks else (self.tokens, self.dtype)
        out = np.empty(length, np.int32)
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        done = 0
        while done < length:
            offset = start + done - int(self.starts[k])
            take = min(length - done, int(self.starts[k + 1]) - (start + done))
            out[done:done + take] = self._pread(files[k], offset * dtype.itemsize, take, dtype)
            done += take
            k += 1
        return out

    def _pread(self, file: Path, offset: int, count: int, dtype: np.dtype) -> np.ndarray:
        f = self._open.get(file)
        if f is None:
            f = self._open[file] = open(file, "rb")  # noqa: SIM115 -- kept open while the shards are read
        f.seek(offset)
        data = f.read(count * dtype.itemsize)
        if len(data) != count * dtype.itemsize:
            raise InputError(f"{file}: ends early (was it changed while training?)")
        return np.frombuffer(data, dtype)


def _sibling(tokens_name: str, what: str) -> str:
    return tokens_name.replace("tokens-", f"{what}-", 1)


# ---- pieces of the input: what a worker tokenizes -------------------------------------------------
@dataclass(frozen=True)
class Piece:
    """Bytes [start, end) of `path`; `first`/`last`: the file's first/last piece; `line`: the
    number of the piece's first line (JSONL, for error messages)."""

    path: str
    start: int
    end: int
    first: bool
    last: bool
    line: int = 1


def input_files(inputs: Sequence[Path]) -> list[Path]:
    """The files to tokenize: each file given, and the .txt/.text/.md/.jsonl files of each
    directory (recursively, in sorted order)."""
    files: list[Path] = []
    for item in inputs:
        if item.is_dir():
            found = sorted(p for p in item.rglob("*") if p.is_file() and p.suffix.lower() in
                           (".txt", ".text", ".md", ".jsonl", ".raw"))
            if not found:
                raise InputError(f"{item}: no .txt, .md, .raw or .jsonl files in the directory")
            files += found
        elif item.is_file():
            files.append(item)
        else:
            raise InputError(f"input not found: {item}")
    kinds = {is_jsonl(f) for f in files}
    if len(kinds) > 1:
        raise InputError("the inputs mix JSONL samples and plain text: tokenize each kind into its own directory")
    return files


def pieces(path: Path, piece_bytes: int, jsonl: bool,
           splits_alike: Callable[[bytes, bytes], bool] | None = None) -> Iterator[Piece]:
    """`path` cut into pieces of about `piece_bytes` (where: `_cut`)."""
    size = path.stat().st_size
    start, line = 0, 1
    with open(path, "rb") as f:
        while True:
            end = min(size, start + piece_bytes)
            if end < size:
                end = _cut(f, start, end, jsonl, splits_alike)
            if jsonl:
                f.seek(start)
                lines = _count_lines(f, end - start)
            yield Piece(str(path), start, end, start == 0, end == size, line)
            if end >= size:
                return
            start = end
            if jsonl:
                line += lines


def _cut(f, start: int, end: int, jsonl: bool, splits_alike: Callable[[bytes, bytes], bool] | None) -> int:
    """Where a piece that would end at `end` ends: JSONL after its last line break; a text at
    the last line break (before it or after it) where `splits_alike(before, after)` says the
    tokenizer gives the same tokens for the text around it cut there as whole, else at the
    last line break, else between two UTF-8 characters."""
    lo = max(start + 1, end - _CUT_SEARCH)
    f.seek(lo)
    window = f.read(end + 1 - lo)  # up to the byte at `end` (there is one: end < the file's size)
    if jsonl:
        at = window.rfind(b"\n", 0, end - lo)
        return lo + at + 1 if at >= 0 else end
    at, tries = end - lo, 0
    while tries < _CUT_TRIES and (at := window.rfind(b"\n", 0, at)) > 0:
        for cut in (at, at + 1):
            if splits_alike is None or splits_alike(window[max(0, cut - _CUT_CONTEXT):cut],
                                                    window[cut:cut + _CUT_CONTEXT]):
                return lo + cut
        tries += 1
    at = window.rfind(b"\n", 0, end - lo)
    if at > 0:
        return lo + at
    while end > lo and window[end - lo] & 0xC0 == 0x80:  # not inside a UTF-8 character
        end -= 1
    return end


def splits_alike(vocab) -> Callable[[bytes, bytes], bool]:
    """Whether `vocab` tokenizes the text `before + after` as `before` and `after` apart: a cut
    there changes no token (pre-tokenizers and merges act within a few characters)."""
    def alike(before: bytes, after: bytes) -> bool:
        while before and before[0] & 0xC0 == 0x80:
            before = before[1:]
        left, right = before.decode("utf-8", "replace"), after.decode("utf-8", "replace")
        apart = vocab.tokenize(left, add_special=False, space_prefix=False) + \
            vocab.tokenize(right, add_special=False, space_prefix=False)
        return apart == vocab.tokenize(left + right, add_special=False, space_prefix=False)
    return alike


def _count_lines(f, n: int) -> int:
    count = 0
    while n > 0:
        block = f.read(min(n, 1 << 24))
        if not block:
            break
        count += block.count(b"\n")
        n -= len(block)
    return count


# ---- the workers ----------------------------------------------------------------------------------
_WORKER: dict = {}


def _start_worker(vocab, template: tuple | None, mask_prompt: bool, fmt: str | None) -> None:
    chat = None
    if template is not None:
        from .chat import ChatTemplate
        chat = ChatTemplate(*template)
    _WORKER.update(vocab=vocab, chat=chat, mask_prompt=mask_prompt, fmt=fmt)


def _read_piece(piece: Piece) -> bytes:
    with open(piece.path, "rb") as f:
        f.seek(piece.start)
        return f.read(piece.end - piece.start)


def tokenize_text_piece(piece: Piece) -> tuple[np.ndarray, int]:
    """A text piece's tokens (BOS/EOS at the file's ends as the vocabulary asks), and the
    count of bytes that were not UTF-8 (each replaced by U+FFFD); a piece that is not text
    is refused as `-f` refuses a file (text_input.decode_text)."""
    vocab = _WORKER["vocab"]
    text, invalid = decode_text(_read_piece(piece), f"{piece.path} (bytes {piece.start}-{piece.end})")
    tokens = vocab.tokenize(text, add_special=False, space_prefix=piece.first)
    if piece.first and vocab.add_bos:
        tokens = [vocab.bos_id] + tokens
    if piece.last and vocab.add_eos:
        tokens = tokens + [vocab.eos_id]
    return np.asarray(tokens, np.uint32), invalid


def tokenize_sample_piece(piece: Piece) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A JSONL piece's samples: their tokens, learn flags and lengths (samples_to_windows'
    tokenization: conversations through the chat template, text samples whole)."""
    vocab, chat, fmt = _WORKER["vocab"], _WORKER["chat"], _WORKER["fmt"]
    data = _read_piece(piece)
    try:
        lines = data.decode("utf-8").split("\n")
    except UnicodeDecodeError as e:
        raise InputError(f"{piece.path}: not UTF-8 text ({e.reason} at byte {piece.start + e.start})") from None
    tokens, masks, lengths = [], [], []
    for number, line in enumerate(lines, start=piece.line):
        if not line.strip():
            continue
        sample, _ = parse_jsonl_line(line, f"{piece.path}:{number}", fmt)
        ids, mask = tokenize_sample(sample, vocab, chat, _WORKER["mask_prompt"])
        tokens.append(ids.astype(np.uint32))
        masks.append(mask.astype(np.uint8))
        lengths.append(len(ids))
    if not tokens:
        return np.zeros(0, np.uint32), np.zeros(0, np.uint8), np.zeros(0, np.uint32)
    return np.concatenate(tokens), np.concatenate(masks), np.asarray(lengths, np.uint32)


def first_format(path: Path, fmt: str | None) -> str:
    """The samples' format of a JSONL file: `fmt` if given, else its first sample's."""
    if fmt is not None:
        if fmt not in FORMATS:
            raise InputError(f"unknown data format {fmt!r} (known: {', '.join(FORMATS)})")
        return fmt
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if raw.strip():
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise InputError(f"{path}:{number}: not UTF-8 text ({e.reason})") from None
                return parse_jsonl_line(line, f"{path}:{number}", None)[1]
    raise InputError(f"{path}: no samples (the file is empty)")


# ---- writing --------------------------------------------------------------------------------------
class _ShardWriter:
    """Appends tokens (and for samples their masks and lengths) to numbered shard files of at
    most `shard_tokens` tokens, digesting each as it is written."""

    def __init__(self, directory: Path, dtype: np.dtype, shard_tokens: int, samples: bool) -> None:
        self.directory, self.dtype, self.shard_tokens, self.samples = directory, dtype, shard_tokens, samples
        self.entries: list[ShardEntry] = []
        self._files: list = []
        self._n = self._n_samples = 0
        self._digest = None

    def _open(self) -> None:
        name = f"tokens-{len(self.entries):05d}.bin"
        kinds = [name] + ([_sibling(name, "masks"), _sibling(name, "lengths")] if self.samples else [])
        self._files = [open(self.directory / k, "wb") for k in kinds]  # noqa: SIM115 -- closed by _close
        self._name, self._n, self._n_samples = name, 0, 0
        self._digest = hashlib.blake2b(digest_size=16)

    def _close(self) -> None:
        if not self._files:
            return
        for f in self._files:
            f.flush()
            os.fsync(f.fileno())
            f.close()
        self._files = []
        self.entries.append(ShardEntry(tokens=self._name, n_tokens=self._n, digest=self._digest.hexdigest(),
                                       n_samples=self._n_samples))

    def _write(self, index: int, array: np.ndarray) -> None:
        data = np.ascontiguousarray(array).tobytes()
        self._files[index].write(data)
        if index == 0:
            self._digest.update(data)

    def add_stream(self, tokens: np.ndarray) -> None:
        tokens = tokens.astype(self.dtype)
        while len(tokens):
            if not self._files or self._n >= self.shard_tokens:
                self._close()
                self._open()
            take = min(len(tokens), self.shard_tokens - self._n)
            self._write(0, tokens[:take])
            self._n += take
            tokens = tokens[take:]

    def add_samples(self, tokens: np.ndarray, masks: np.ndarray, lengths: np.ndarray) -> None:
        ends = np.cumsum(lengths, dtype=np.int64)
        done = 0  # samples written
        while done < len(lengths):
            if not self._files or (self._n and self._n + int(lengths[done]) > self.shard_tokens):
                self._close()
                self._open()
            base = int(ends[done - 1]) if done else 0
            fits = int(np.searchsorted(ends, base + self.shard_tokens - self._n, side="right"))
            upto = max(fits, done + 1)  # a sample longer than a shard still goes whole
            stop = int(ends[upto - 1])
            self._write(0, tokens[base:stop].astype(self.dtype))
            self._write(1, masks[base:stop])
            self._write(2, lengths[done:upto].astype("<u4"))
            self._n += stop - base
            self._n_samples += upto - done
            done = upto

    def finish(self) -> list[ShardEntry]:
        self._close()
        return self.entries


@dataclass
class TokenizeReport:
    index: ShardIndex
    invalid_bytes: int


def write_token_shards(inputs: Sequence[Path], out_dir: Path, vocab, *, workers: int = 1,
                       chat_template=None, mask_prompt: bool = True, data_format: str | None = None,
                       piece_bytes: int = PIECE_BYTES, shard_tokens: int = SHARD_TOKENS,
                       progress: Callable[[int, int], None] | None = None) -> TokenizeReport:
    """Tokenize `inputs` (texts, or JSONL samples) with `vocab` in `workers` processes into the
    shard directory `out_dir`, which must not exist yet: the shards are written into a
    temporary directory beside it, renamed into place when complete, so an interrupted run
    leaves no half directory. `progress(bytes_done, bytes_total)` hears of each piece."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise InputError(f"{out_dir} already exists (the shards go into a new directory; remove it or name another)")
    files = input_files(inputs)
    samples = is_jsonl(files[0])
    dtype = np.dtype("<u2") if vocab.n_tokens <= 1 << 16 else np.dtype("<u4")
    parent = out_dir.parent if str(out_dir.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"{parent}: no such directory for {out_dir}")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # a directory as mkdir makes it, not mkdtemp's private one
    try:
        writer = _ShardWriter(tmp, dtype, shard_tokens, samples)
        total = sum(f.stat().st_size for f in files)
        done, invalid, formats = 0, 0, set()
        for path in files:
            fmt = first_format(path, data_format) if samples else None
            formats.add(fmt)
            if samples and fmt != "text" and chat_template is None:
                raise InputError(f"{path}: conversations need a chat template (the model has none: give one by "
                                 "file or name)")
            template = None if chat_template is None else (chat_template.source, chat_template.name,
                                                           chat_template.bos_token, chat_template.eos_token)
            work = tokenize_sample_piece if samples else tokenize_text_piece
            for piece, result in _map_pieces(work, pieces(path, piece_bytes, samples, splits_alike(vocab)), workers,
                                             (vocab, template, mask_prompt, fmt)):
                if samples:
                    writer.add_samples(*result)
                else:
                    writer.add_stream(result[0])
                    invalid += result[1]
                done += piece.end - piece.start
                if progress is not None:
                    progress(done, total)
        entries = writer.finish()
        index = ShardIndex(kind="samples" if samples else "text", dtype=dtype.name, n_vocab=vocab.n_tokens,
                           vocab=vocab.fingerprint(), sources=[str(f.resolve()) for f in files], shards=entries,
                           chat_template=None if chat_template is None else chat_template.name,
                           mask_prompt=mask_prompt, formats=sorted(formats) if samples else None)
        if index.n_tokens == 0:
            raise InputError("the inputs give no tokens")
        with open(tmp / INDEX, "w", encoding="utf-8") as f:
            f.write(index.model_dump_json(indent=1))
            f.flush()
            os.fsync(f.fileno())
        TokenShards.open(tmp, vocab)  # read back as training will read it (digests, ids) before it is named
        os.replace(tmp, out_dir)
        tmp = None
    except OSError as e:
        raise SaveError(f"cannot write the shards to {out_dir}: {e.strerror or e}") from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return TokenizeReport(index, invalid)


def _map_pieces(work, items: Iterator[Piece], workers: int, init: tuple) -> Iterator[tuple[Piece, tuple]]:
    """(piece, work(piece)) in input order: in this process, or in `workers` processes with at
    most two pieces each in flight (memory stays a few pieces)."""
    if workers <= 1:
        _start_worker(*init)
        for piece in items:
            yield piece, work(piece)
        return
    import multiprocessing
    if "fork" not in multiprocessing.get_all_start_methods():  # the vocabulary is inherited, not pickled
        yield from _map_pieces(work, items, 1, init)
        return
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"), initializer=_start_worker,
                             initargs=init) as pool:
        pending: list = []
        for piece in items:
            pending.append((piece, pool.submit(work, piece)))
            if len(pending) >= 2 * workers:
                first, future = pending.pop(0)
                yield first, future.result()
        for piece, future in pending:
            yield piece, future.result()
