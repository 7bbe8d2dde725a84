"""Training windows read from token shards (llamapy.token_shards) as they are trained: the
same windows llamapy.dataset makes in memory (a text's overlapping windows, or samples
packed greedily), but a window's tokens are read from the shard files only when its batch
runs. What stays in memory is per window or per sample, never per token: a run on
a corpus larger than RAM holds the shuffled window order and, for samples, their lengths.
Over MPI each rank reads only the windows of its own batches."""
from __future__ import annotations

import hashlib

import numpy as np

from ggmlpy import GGMLType
from ggmlpy.opt import Dataset

from .dataset import IGNORE, pad_token, window_count
from .errors import InputError
from .samples import FORMATS
from .token_shards import TokenShards


class ShardTextWindows(Dataset):
    """A token stream's windows (llamapy.dataset.token_windows' cut: n_ctx tokens every
    `stride`, or BOS and n_ctx - 1 tokens with `bos`), read from the shards."""

    def __init__(self, shards: TokenShards, n_ctx: int, stride: int | None = None, bos: int | None = None) -> None:
        if shards.index.kind != "text":
            raise InputError(f"{shards.path}: holds samples, not a text")
        stride = stride or max(n_ctx // 2, 1)
        self.text_per_window = n_ctx - 1 if bos is not None else n_ctx
        n = window_count(shards.n_tokens, self.text_per_window, stride)
        if n == 0:
            raise InputError(f"{shards.path}: {shards.n_tokens} tokens; one training window of n_ctx={n_ctx} "
                             f"needs at least {self.text_per_window + 1}")
        super().__init__(n_ctx, n_ctx, n, 1, GGMLType.I32, GGMLType.I32, in_memory=False)
        self.shards, self.n_tokens, self.n_ctx, self.stride, self.bos = shards, shards.n_tokens, n_ctx, stride, bos

    def rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        data = np.empty((len(rows), self.n_ctx), np.int32)
        labels = np.empty((len(rows), self.n_ctx), np.int32)
        for r, j in enumerate(rows):
            chunk = self.shards.read(int(j) * self.stride, self.text_per_window + 1)
            if self.bos is None:
                data[r], labels[r] = chunk[:-1], chunk[1:]
            else:
                data[r, 0], data[r, 1:], labels[r] = self.bos, chunk[:-1], chunk
        return data, labels

    def counted(self, j: int) -> int:
        """Labels of window j that count: all of them (a text ignores none)."""
        return self.n_ctx

    def fingerprint(self) -> str:
        return _fingerprint(self.shards, f"text:{self.n_ctx}:{self.stride}:{self.bos}")

    def describe(self) -> str:
        return (f"{self.shards.path}: {self.n_tokens} tokens in {len(self.shards.index.shards)} shard(s), "
                f"{self.ndata} windows of {self.n_ctx} (stride {self.stride})")


class ShardSampleWindows(Dataset):
    """Samples packed into windows as llamapy.dataset.pack_samples packs them (in order,
    greedily; a sample of L tokens takes L - 1 positions, one longer than a window is cut to
    fit or, with `truncate=False`, refused), read from the shards."""

    def __init__(self, shards: TokenShards, n_ctx: int, pad_id: int, truncate: bool = True) -> None:
        if shards.index.kind != "samples":
            raise InputError(f"{shards.path}: holds a text, not samples")
        lengths = shards.lengths
        if len(lengths) == 0:
            raise InputError(f"{shards.path}: no samples")
        positions = lengths - 1
        too_long = np.nonzero(positions > n_ctx)[0]
        if len(too_long) and not truncate:
            k = int(too_long[0])
            raise InputError(f"{shards.path}: sample {k} is {int(lengths[k])} tokens, more than a window of {n_ctx} "
                             "takes (a longer -c, or let it be cut by dropping --no-truncate)")
        positions = np.minimum(positions, n_ctx)
        window, offset = _pack(positions, n_ctx)
        super().__init__(n_ctx, n_ctx, int(window[-1]) + 1, 1, GGMLType.I32, GGMLType.I32, in_memory=False)
        self.shards, self.n_ctx, self.pad_id = shards, n_ctx, pad_id
        self.n_samples, self.n_truncated = len(lengths), len(too_long)
        self.positions, self.offset = positions.astype(np.int32), offset
        self.first = np.searchsorted(window, np.arange(self.ndata + 1)).astype(np.int64)  # window -> its samples

    def _samples(self, j: int) -> range:
        return range(int(self.first[j]), int(self.first[j + 1]))

    def rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        data = np.full((len(rows), self.n_ctx), self.pad_id, np.int32)
        labels = np.full((len(rows), self.n_ctx), IGNORE, np.int32)
        starts = self.shards.sample_starts
        for r, j in enumerate(rows):
            for k in self._samples(int(j)):
                n, at = int(self.positions[k]), int(self.offset[k])
                tokens = self.shards.read(int(starts[k]), n + 1)
                learn = self.shards.read(int(starts[k]), n + 1, masks=True)
                data[r, at:at + n] = tokens[:-1]
                labels[r, at:at + n] = np.where(learn[1:] != 0, tokens[1:], IGNORE)
        return data, labels

    def layout(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        """Positions and sequence ids of stored window j (PackedWindows.layout)."""
        pos, seq = np.zeros(self.n_ctx, np.int32), np.full(self.n_ctx, -1, np.int32)
        end = 0
        for s, k in enumerate(self._samples(j)):
            n, at = int(self.positions[k]), int(self.offset[k])
            pos[at:at + n], seq[at:at + n] = np.arange(n), s
            end = at + n
        pos[end:] = np.arange(self.n_ctx - end)  # padding (sequence -1): positions as pack_samples gives them
        return pos, seq

    def counted(self, j: int) -> int:
        """Labels of stored window j that count (its learned tokens' predictions)."""
        starts = self.shards.sample_starts
        return sum(int(np.count_nonzero(self.shards.read(int(starts[k]) + 1, int(self.positions[k]), masks=True)))
                   for k in self._samples(j))

    def fingerprint(self) -> str:
        return _fingerprint(self.shards, f"samples:{self.n_ctx}:{self.pad_id}")

    def describe(self) -> str:
        return (f"{self.shards.path}: {self.n_samples} samples, {self.shards.n_tokens} tokens in "
                f"{len(self.shards.index.shards)} shard(s), packed into {self.ndata} windows of {self.n_ctx}")


def shard_windows(path, vocab, n_ctx: int, *, window_bos: bool = False, truncate: bool = True,
                  data_format: str | None = None) -> Dataset:
    """The training windows of a shard directory made by llamapy-tokenize (or
    write_token_shards) for `vocab`'s model: a text's windows (BOS at each window's start with
    `window_bos`) or its samples packed; the dataset Context.opt_fit takes. `data_format`,
    when given, must be what the shards hold (check_format)."""
    shards = TokenShards.open(path, vocab)
    check_format(shards, data_format)
    if shards.index.kind == "text":
        return ShardTextWindows(shards, n_ctx, bos=vocab.bos_id if window_bos else None)
    return ShardSampleWindows(shards, n_ctx, pad_token(vocab), truncate)


def check_format(shards: TokenShards, data_format: str | None) -> None:
    """Refuse a `data_format` the shards do not hold: the format was applied when they were
    tokenized, so a data format asked for now cannot be honoured by reading them otherwise.
    A text holds "text"; samples hold the formats their index records (an index written
    before formats were recorded cannot say, and is refused with any format named)."""
    if data_format is None:
        return
    if data_format not in FORMATS:
        raise InputError(f"unknown data format {data_format!r} (known: {', '.join(FORMATS)})")
    index = shards.index
    if index.kind == "text":
        if data_format != "text":
            raise InputError(f"{shards.path}: --data-format {data_format}, but the shards hold a plain text, not "
                             f"{data_format} samples (tokenize the {data_format} JSONL files into shards of their own)")
        return
    if index.formats is None:
        raise InputError(f"{shards.path}: --data-format {data_format}, but the shards' index does not record the "
                         "samples' format (tokenized by an older llamapy: drop --data-format, or tokenize again)")
    if index.formats != [data_format]:
        raise InputError(f"{shards.path}: --data-format {data_format}, but the shards hold "
                         f"{' and '.join(index.formats)} samples (the format is fixed when they are tokenized: drop "
                         f"--data-format, or tokenize again with --data-format {data_format})")


def _pack(positions: np.ndarray, n_ctx: int) -> tuple[np.ndarray, np.ndarray]:
    """pack_samples' greedy placement: each sample's window and offset in it."""
    window = np.empty(len(positions), np.int64)
    offset = np.empty(len(positions), np.int32)
    w, fill = 0, 0
    for k, n in enumerate(positions.tolist()):
        if fill + n > n_ctx:
            w, fill = w + 1, 0
        window[k], offset[k] = w, fill
        fill += n
    return window, offset


def _fingerprint(shards: TokenShards, cut: str) -> str:
    """The windows' identity for checkpoints: the shards' index (their digests) and the cut."""
    digest = hashlib.blake2b(digest_size=16)
    recorded = {"formats"} if shards.index.formats is None else set()  # as before formats were recorded
    digest.update(shards.index.model_dump_json(exclude=recorded).encode())
    digest.update(cut.encode())
    return digest.hexdigest()
