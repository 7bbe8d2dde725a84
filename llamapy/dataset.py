"""Token streams as training datasets: windows of n_ctx tokens, labels shifted by one.

Window i covers tokens [i*stride, i*stride + n_ctx) and its labels are the next tokens
[i*stride + 1, i*stride + n_ctx + 1), as llama.cpp's finetune cuts them (stride n_ctx/2
by default). With `bos` set, every window starts with the BOS token followed by n_ctx-1
text tokens, and its labels are those text tokens and the next one: models such as Gemma
score text badly without BOS in front.
"""
from __future__ import annotations

import numpy as np

from ggmlpy import GGMLType
from ggmlpy.opt import Dataset

from .errors import InputError


def window_count(n_tokens: int, n_ctx: int, stride: int) -> int:
    return 0 if n_tokens < n_ctx + 1 else (n_tokens - n_ctx - 1) // stride + 1


class TokenWindows(Dataset):
    """A ggmlpy Dataset of I32 windows (data) and next-token windows (labels), with where
    they came from: the token count, the window length and the stride."""

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
    starts = np.arange(n) * stride
    idx = starts[:, None] + np.arange(text_per_window + 1)[None, :]
    chunk = tokens[idx]
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
    tokens = vocab.tokenize(text, add_special=not window_bos)
    return token_windows(tokens, n_ctx, stride, vocab.bos_id if window_bos else None)
