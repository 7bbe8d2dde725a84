"""Training datasets: windows of n_ctx tokens, each token with the label its prediction
is trained on (the next token) or IGNORE where that prediction does not count.

Two ways to fill windows:
- a token stream (plain text), cut as llama.cpp's finetune cuts it: window i covers
  tokens [i*stride, i*stride + n_ctx) and its labels are the next tokens [i*stride + 1,
  i*stride + n_ctx + 1) (stride n_ctx/2 by default). With `bos` set, every window starts
  with the BOS token followed by n_ctx-1 text tokens, and its labels are those text tokens
  and the next one: models such as Gemma score text badly without BOS in front.
- samples (instruction or chat examples) packed into windows as separate sequences: each
  sample's positions start at 0 and its tokens attend only to its own earlier tokens, so
  a sample trains as it would alone in a window, and the positions its train mask leaves
  out (a prompt) and the padding after the last sample carry IGNORE.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ggmlpy import GGMLType
from ggmlpy.opt import Dataset

from .errors import InputError
from .samples import Sample, is_jsonl, read_jsonl, split_text
from .text_input import read_text_file

IGNORE = -1  # the label of a position whose next-token prediction does not count


def window_count(n_tokens: int, n_ctx: int, stride: int) -> int:
    return 0 if n_tokens < n_ctx + 1 else (n_tokens - n_ctx - 1) // stride + 1


class TokenWindows(Dataset):
    """A text's windows: a ggmlpy Dataset of I32 windows (data) and next-token windows
    (labels), with where they came from: the token count, the window length and the stride."""

    def __init__(self, n_tokens: int, n_ctx: int, stride: int, ndata: int) -> None:
        super().__init__(n_ctx, n_ctx, ndata, 1, GGMLType.I32, GGMLType.I32)
        self.n_tokens, self.n_ctx, self.stride = n_tokens, n_ctx, stride


def token_windows(tokens, n_ctx: int, stride: int | None = None, bos: int | None = None) -> TokenWindows:
    """Windows of n_ctx tokens every `stride` tokens (default n_ctx / 2) and their labels."""
    tokens = np.asarray(tokens, dtype=np.int32)
    stride = stride or max(n_ctx // 2, 1)
    if n_ctx < 2 or stride < 1:
        raise InputError(f"training windows need n_ctx >= 2 and stride >= 1 (got {n_ctx}, {stride})")
    text_per_window = n_ctx - 1 if bos is not None else n_ctx
    n = window_count(len(tokens), text_per_window, stride)
    if n == 0:
        raise InputError(f"the text has {len(tokens)} tokens; one training window of n_ctx={n_ctx} "
                         f"needs at least {text_per_window + 1}")
    ds = TokenWindows(len(tokens), n_ctx, stride, n)
    chunk = sliding_window_view(tokens, text_per_window + 1)[::stride][:n]  # a view: no copy of the windows
    if bos is None:
        ds.data[:], ds.labels[:] = chunk[:, :-1], chunk[:, 1:]
    else:
        ds.data[:, 0] = bos
        ds.data[:, 1:] = chunk[:, :-1]
        ds.labels[:] = chunk
    return ds


def text_windows(vocab, text: str, n_ctx: int, window_bos: bool = False, stride: int | None = None) -> TokenWindows:
    """The training windows of a text: tokenized with BOS first, or, with `window_bos`,
    with BOS at the start of every window instead (TrainParams.window_bos)."""
    tokens = vocab.tokenize_array(text, add_special=not window_bos)
    return token_windows(tokens, n_ctx, stride, vocab.bos_id if window_bos else None)


# ---- packed samples ---------------------------------------------------------------------
class PackedWindows(Dataset):
    """Samples packed into windows: I32 tokens (data) and labels (the next token, or IGNORE),
    and per token its position in its sample (`pos`, from 0: RoPE) and the sample it belongs
    to (`seq`, its index in the window, -1 for padding: the attention mask). `n_samples`
    samples were packed, `n_truncated` of them cut to fit a window, `n_unlearned` of them
    cut before their first learned token (a front end warns)."""

    def __init__(self, n_ctx: int, ndata: int, n_samples: int, n_truncated: int, n_unlearned: int = 0) -> None:
        super().__init__(n_ctx, n_ctx, ndata, 1, GGMLType.I32, GGMLType.I32)
        self.n_ctx, self.n_samples, self.n_truncated, self.n_unlearned = n_ctx, n_samples, n_truncated, n_unlearned
        self.pos = np.zeros((ndata, n_ctx), dtype=np.int32)
        self.seq = np.full((ndata, n_ctx), -1, dtype=np.int32)


    def layout(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        """Positions and sequence ids of stored window j."""
        return self.pos[j], self.seq[j]


def window_layout(dataset: Dataset, i: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions and sequence ids of the i-th window in the current (shuffled) order: a
    packed window's (a dataset with a `layout`), else one sequence from position 0 (a
    text's windows)."""
    layout = getattr(dataset, "layout", None)
    if layout is not None:
        return layout(dataset.index(i))
    return one_sequence(dataset.ne_datapoint)


def counted_labels(dataset: Dataset, i: int) -> int:
    """How many labels of the i-th window count (are not IGNORE): a dataset that reads its
    windows from files says so without reading them (`counted`)."""
    counted = getattr(dataset, "counted", None)
    if counted is not None:
        return counted(dataset.index(i))
    return int(np.count_nonzero(dataset.datapoint(i)[1] != IGNORE))


def one_sequence(n_ctx: int) -> tuple[np.ndarray, np.ndarray]:
    """The layout of a window that is one sequence from position 0."""
    return np.arange(n_ctx, dtype=np.int32), np.zeros(n_ctx, dtype=np.int32)


def as_packed(dataset: Dataset) -> PackedWindows:
    """`dataset`'s windows (in their stored order) with an explicit layout: a PackedWindows
    as it is, a text's windows as one sequence each."""
    if isinstance(dataset, PackedWindows):
        return dataset
    if dataset.data is None:
        raise InputError("windows read from token shards cannot be joined with other windows (validate with "
                         "-val-split)")
    n_ctx = dataset.ne_datapoint
    out = PackedWindows(n_ctx, dataset.ndata, dataset.ndata, 0)
    out.data[:], out.labels[:] = dataset.data, dataset.labels
    out.pos[:], out.seq[:] = one_sequence(n_ctx)
    return out


def join_windows(train: Dataset, val: Dataset) -> tuple[PackedWindows, int]:
    """`train`'s windows followed by `val`'s, and the index of the first validation window:
    a fit's data when the validation set is given apart (a file) rather than split off."""
    a, b = as_packed(train), as_packed(val)
    if a.n_ctx != b.n_ctx:
        raise InputError(f"training windows have {a.n_ctx} tokens, validation windows {b.n_ctx}")
    out = PackedWindows(a.n_ctx, a.ndata + b.ndata, a.n_samples + b.n_samples, a.n_truncated + b.n_truncated,
                        a.n_unlearned + b.n_unlearned)
    for name in ("data", "labels", "pos", "seq"):
        getattr(out, name)[:] = np.concatenate([getattr(a, name), getattr(b, name)])
    return out, a.ndata


def validation_windows(ndata: int, val_split: float) -> int:
    """Windows held out for validation, as llama-finetune splits: the training windows are
    the first int(ndata * (1 - val_split)), so at least one validates when asked for any
    (two of the 28 windows of the README's main job, for a spread) -- unless the data is too
    small for the split: when that one window would be more than twice the asked fraction
    (1 of 2 windows for a 5% split), every window trains and none validates
    (`split_too_small` says when)."""
    if val_split <= 0 or ndata < 2 or split_too_small(ndata, val_split):
        return 0
    return _llama_finetune_split(ndata, val_split)


def _llama_finetune_split(ndata: int, val_split: float) -> int:
    return max(1, ndata - int(np.float32(ndata) * (np.float32(1.0) - np.float32(val_split))))  # in float, as ggml


def split_too_small(ndata: int, val_split: float) -> bool:
    """True when `ndata` windows are too few for a `val_split` fraction: the held-out part
    would be more than twice the fraction asked for (validation_windows then holds none out)."""
    return 0 < val_split and ndata >= 1 and (ndata < 2 or _llama_finetune_split(ndata, val_split) > 2 * val_split * ndata)


def _sample_arrays(tokens, train_mask, where: str) -> tuple[np.ndarray, np.ndarray]:
    """A sample's inputs and labels: position i predicts token i + 1, and that prediction
    counts where train_mask[i + 1] is set: the mask marks the tokens to learn, as
    chat.ChatTemplate.tokenize marks the assistant turns (so its first entry is unused:
    nothing predicts the first token). The last token is only a label (nothing follows
    it), so a sample of L tokens takes L - 1 positions."""
    tokens = np.asarray(tokens)
    mask = np.asarray(train_mask)
    if tokens.ndim != 1 or mask.shape != tokens.shape:
        raise InputError(f"{where}: tokens and train mask must be 1-D and of one length "
                         f"(got shapes {tokens.shape} and {mask.shape})")
    if len(tokens) < 2:
        raise InputError(f"{where}: a sample needs at least 2 tokens (a token and the next), got {len(tokens)}")
    if not np.issubdtype(tokens.dtype, np.integer) or tokens.min() < 0 or tokens.max() > np.iinfo(np.int32).max:
        raise InputError(f"{where}: tokens must be non-negative int32 ids")
    tokens = tokens.astype(np.int32)
    labels = np.where(mask[1:].astype(bool), tokens[1:], IGNORE).astype(np.int32)
    return tokens[:-1], labels


def pack_samples(samples: Sequence[tuple[np.ndarray, np.ndarray]], n_ctx: int, pad_id: int,
                 truncate: bool = True) -> PackedWindows:
    """Pack samples (tokens int32, train_mask bool: the tokens to learn) into windows of n_ctx
    positions, greedily
    in order: a sample goes into the current window when it fits in what is left, else it
    starts the next; the positions left at the end of a window are padding (pad_id,
    IGNORE). Each sample is a sequence of its own (positions from 0, attention within it),
    so its loss and gradients are those of the sample alone in a window.

    A sample of L tokens takes L - 1 positions (see _sample_arrays); one that needs more
    than n_ctx is cut to its first n_ctx positions (counted in `n_truncated`), or refused
    with `truncate=False`."""
    if n_ctx < 1:
        raise InputError(f"pack_samples: n_ctx must be at least 1, got {n_ctx}")
    if not samples:
        raise InputError("pack_samples: no samples")
    if pad_id < 0:
        raise InputError(f"pack_samples: pad_id must be a token id, got {pad_id}")
    placed: list[tuple[int, int, np.ndarray, np.ndarray]] = []  # (window, offset, inputs, labels)
    window, fill, n_truncated, n_unlearned, first_learned = 0, 0, 0, 0, None
    for k, (tokens, train_mask) in enumerate(samples):
        inputs, labels = _sample_arrays(tokens, train_mask, f"sample {k}")
        learned = np.flatnonzero(labels != IGNORE)
        if len(learned):  # the positions a window needs to hold this sample's first learned token
            first_learned = min(first_learned or n_ctx + len(inputs), int(learned[0]) + 1)
        if len(inputs) > n_ctx:
            if not truncate:
                raise InputError(f"sample {k} has {len(inputs) + 1} tokens: it needs {len(inputs)} positions, "
                                 f"the window has {n_ctx} (truncate=True cuts it to fit)")
            inputs, labels = inputs[:n_ctx], labels[:n_ctx]
            n_truncated += 1
        n_unlearned += not np.any(labels != IGNORE)
        if fill + len(inputs) > n_ctx:
            window, fill = window + 1, 0
        placed.append((window, fill, inputs, labels))
        fill += len(inputs)
    if n_unlearned == len(samples):
        need = f"the earliest comes at position {first_learned}: a window of at least {first_learned} (-c) keeps it" \
            if first_learned else "no sample marks any token to learn"
        raise InputError(f"none of the {len(samples)} samples has a token to learn within a window of {n_ctx} "
                         f"positions ({need}); training would run on nothing")
    ds = PackedWindows(n_ctx, window + 1, len(samples), n_truncated, n_unlearned)
    ds.data[:], ds.labels[:] = pad_id, IGNORE
    ends = np.zeros(ds.ndata, dtype=np.int64)  # the first padding position of each window
    seq = np.zeros(ds.ndata, dtype=np.int32)   # samples placed in each window so far
    for w, offset, inputs, labels in placed:
        span = slice(offset, offset + len(inputs))
        ds.data[w, span], ds.labels[w, span] = inputs, labels
        ds.pos[w, span], ds.seq[w, span] = np.arange(len(inputs)), seq[w]
        seq[w] += 1
        ends[w] = offset + len(inputs)
    for w, end in enumerate(ends):  # padding: one more sequence, which nothing else sees
        ds.pos[w, end:] = np.arange(n_ctx - end)
    return ds


def read_samples(path, data_format: str | None = None, sample_start: str | None = None,
                 include_sample_start: bool = False, warn=None) -> list[Sample]:
    """The samples of a file: a `.jsonl` file's lines (text, prompt/completion or chat; see
    llamapy.samples), or plain text as one sample, or one per `sample_start` as llama.cpp's
    old finetune cut it. `warn` hears about bytes of a text that were not UTF-8."""
    path = Path(path)
    if is_jsonl(path):
        return read_jsonl(path, data_format)[0]
    return split_text(read_text_file(path, warn=warn), sample_start, str(path), include_sample_start)


def samples_to_windows(samples: Sequence[Sample], vocab, n_ctx: int, *, chat_template=None, mask_prompt: bool = True,
                       truncate: bool = True) -> PackedWindows:
    """Samples tokenized and packed into windows of n_ctx. Conversations (and prompt/completion
    pairs) are rendered with `chat_template` (a llamapy.chat.ChatTemplate, required for them)
    and, with `mask_prompt`, only their assistant turns are learned; text samples are learned
    whole (BOS as the vocabulary adds it). A sample longer than a window is cut to fit
    (`n_truncated` counts them), or refused with `truncate=False`. Errors name the sample's
    file and line."""
    tokenized = []
    for sample in samples:
        tokens, mask = tokenize_sample(sample, vocab, chat_template, mask_prompt)
        if not truncate and len(tokens) - 1 > n_ctx:
            raise InputError(f"{sample.where}: the sample is {len(tokens)} tokens, more than a window of {n_ctx} "
                             "takes (a longer -c, or let it be cut by dropping --no-truncate)")
        tokenized.append((tokens, mask))
    if not tokenized:
        raise InputError("no samples to train on")
    return pack_samples(tokenized, n_ctx, pad_token(vocab), truncate)


def tokenize_sample(sample: Sample, vocab, chat_template=None, mask_prompt: bool = True
                    ) -> tuple[np.ndarray, np.ndarray]:
    """A sample's tokens (int32) and which of them are learned (bool): a conversation rendered
    with `chat_template`, its assistant turns learned (all of it without `mask_prompt`); a
    text whole, BOS as the vocabulary adds it. Errors name the sample's file and line."""
    if sample.is_chat:
        if chat_template is None:
            raise InputError(f"{sample.where}: a conversation needs a chat template (the model has none: "
                             "give one by file or name)")
        try:
            tokens, mask = chat_template.tokenize(vocab, sample.messages)
        except InputError as e:
            raise InputError(f"{sample.where}: {e}") from None
        tokens, mask = np.asarray(tokens, np.int32), np.asarray(mask, bool)
        if not mask_prompt:
            mask = np.ones_like(mask)
    else:
        tokens = np.asarray(vocab.tokenize(sample.text, add_special=True), np.int32)
        mask = np.ones(len(tokens), bool)
    if len(tokens) < 2:
        raise InputError(f"{sample.where}: the sample gives {len(tokens)} token(s); at least 2 are needed")
    return tokens, mask


def pad_token(vocab) -> int:
    """What fills a window's positions after its last sample: PAD, else EOS, else token 0."""
    return vocab.pad_id if vocab.pad_id is not None else (vocab.eos_id if vocab.eos_id is not None else 0)


def load_samples(path, vocab, n_ctx: int, *, data_format: str | None = None, chat_template=None,
                 mask_prompt: bool = True, sample_start: str | None = None, include_sample_start: bool = False,
                 truncate: bool = True) -> PackedWindows:
    """Training examples from a file (read_samples), tokenized and packed into windows of
    n_ctx (samples_to_windows): the dataset Context.opt_fit takes."""
    samples = read_samples(path, data_format, sample_start, include_sample_start)
    return samples_to_windows(samples, vocab, n_ctx, chat_template=chat_template, mask_prompt=mask_prompt,
                              truncate=truncate)
