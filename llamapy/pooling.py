"""Embeddings from a generative model: which hidden states, pooled how, normalized how.

An embedding is the model's last hidden state after the output norm (llama.cpp's `t_embd`,
what the output layer reads). With pooling NONE every token has its own; otherwise a
sequence's tokens are pooled into one vector, as llama.cpp pools a ubatch's rows of a
sequence: MEAN averages them, CLS takes the first position's, LAST the last position's.
llama-server then normalizes a pooled vector (`embd_normalize`, default 2: Euclidean).
"""
from __future__ import annotations

from enum import Enum

import numpy as np

from .errors import InputError


class Pooling(str, Enum):
    """llama.cpp's llama_pooling_type, by its --pooling names (RANK needs a classifier head:
    no architecture here has one)."""
    NONE = "none"
    MEAN = "mean"
    CLS = "cls"
    LAST = "last"


# llama.cpp's enum values (the GGUF key {arch}.pooling_type and llama-cpp-python's pooling_type)
POOLING_IDS = {0: Pooling.NONE, 1: Pooling.MEAN, 2: Pooling.CLS, 3: Pooling.LAST}
UNSPECIFIED = -1
RANK = 4

DEFAULT_NORMALIZE = 2  # llama-server's --embd-normalize: Euclidean


def pooling_of(value: Pooling | str | int | None, model=None) -> Pooling:
    """A pooling type from a name, llama.cpp's number or None (unspecified: the model's own,
    from its GGUF `{arch}.pooling_type`, else NONE, as llama_init_from_model decides)."""
    if isinstance(value, Pooling):
        return value
    if value is None or (isinstance(value, int) and value == UNSPECIFIED):
        return model_pooling(model) if model is not None else Pooling.NONE
    if isinstance(value, bool):
        raise InputError(f"pooling: expected none, mean, cls or last, not {value!r}")
    if isinstance(value, int):
        if value == RANK:
            raise InputError("pooling rank needs a reranker's classifier head, which this model does not have")
        if value not in POOLING_IDS:
            raise InputError(f"pooling type {value}: expected -1 (the model's), 0 (none), 1 (mean), 2 (cls) or 3 (last)")
        return POOLING_IDS[value]
    try:
        return Pooling(str(value).lower())
    except ValueError:
        if str(value).lower() == "rank":
            raise InputError("pooling rank needs a reranker's classifier head, which this model does not have") from None
        raise InputError(f"pooling {value!r}: expected none, mean, cls or last") from None


def model_pooling(model) -> Pooling:
    """The pooling the model file asks for (generative models name none: NONE)."""
    value = model.file.get(f"{model.hparams.arch}.pooling_type")
    if value is None or value == UNSPECIFIED:
        return Pooling.NONE
    if not isinstance(value, int) or value not in POOLING_IDS:
        raise InputError(f"{model.hparams.arch}.pooling_type = {value!r}: llamapy pools with none (0), mean (1), "
                         "cls (2) or last (3)")
    return POOLING_IDS[value]


def pool(rows: np.ndarray, pos: np.ndarray, pooling: Pooling) -> np.ndarray:
    """One sequence's rows (in ubatch order, at positions `pos`) pooled into one vector, as
    llama.cpp's build_pooling: the mean (inp_mean's 1/n weights), or the row at the smallest
    (CLS: the first one found) or largest (LAST: the last one found) position."""
    if pooling is Pooling.MEAN:
        weight = np.float32(1.0) / np.float32(len(rows))
        return (rows * weight).sum(axis=0, dtype=np.float32)
    if pooling is Pooling.CLS:
        return rows[int(np.argmin(pos))].copy()
    if pooling is Pooling.LAST:
        return rows[len(pos) - 1 - int(np.argmax(pos[::-1]))].copy()
    raise InputError("pooling none keeps one embedding per token: nothing to pool")


def normalize(vector: np.ndarray, embd_normalize: int = DEFAULT_NORMALIZE) -> np.ndarray:
    """common_embd_normalize: -1 none, 0 max absolute scaled to int16's range, 1 taxicab,
    2 Euclidean, p > 2 the p-norm (sums in double, the scale applied in float)."""
    x = np.asarray(vector, dtype=np.float32)
    if embd_normalize == -1:
        total = 1.0
    elif embd_normalize == 0:
        total = float(np.abs(x).max(initial=0.0)) / 32760.0
    elif embd_normalize == 2:
        total = float(np.sqrt(np.sum((x * x).astype(np.float64))))
    else:
        p = float(embd_normalize)
        total = float(np.sum(np.abs(x).astype(np.float64) ** p) ** (1.0 / p))
    scale = np.float32(1.0 / total) if total > 0.0 else np.float32(0.0)
    return x * scale
