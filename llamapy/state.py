"""Saving and restoring a context's state (llama_state_* and llama_state_seq_*).

A sequence's state is its KV cells (positions, in cell order) and the K and V rows of
those cells in every layer; restoring it into another context (same model and cache types)
places the rows in free cells of that sequence's stream, after forgetting what the
sequence held there. The whole-context state is every cell, the whole cache and the
last decode's logits.

Layout (little-endian): a 4-byte magic, a version, then a JSON header with the shapes,
then raw arrays in the order the header lists them.
"""
from __future__ import annotations

import json
import os
import struct

import numpy as np

from .errors import InputError

SEQ_MAGIC = b"LPSQ"
CTX_MAGIC = b"LPCX"
FILE_MAGIC = b"LPST"
VERSION = 1


def _cache_desc(kv) -> dict:
    return {"n_layer": len(kv.k), "type_k": kv.k[0].type.name, "type_v": kv.v[0].type.name,
            "row_k": int(kv.k[0].array().shape[-1]), "row_v": int(kv.v[0].array().shape[-1])}


def _pack(magic: bytes, header: dict, arrays: list[np.ndarray]) -> bytes:
    h = json.dumps(header).encode()
    parts = [magic, struct.pack("<II", VERSION, len(h)), h]
    parts += [np.ascontiguousarray(a).tobytes() for a in arrays]
    return b"".join(parts)


def _unpack(magic: bytes, data: bytes) -> tuple[dict, memoryview]:
    if len(data) < 12 or data[:4] != magic:
        raise InputError(f"state data does not start with {magic!r}: not a state of this kind")
    version, n = struct.unpack_from("<II", data, 4)
    if version != VERSION:
        raise InputError(f"state version {version} is not supported (expected {VERSION})")
    return json.loads(bytes(data[12:12 + n])), memoryview(data)[12 + n:]


class _Reader:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.at = buf, 0

    def take(self, dtype, shape) -> np.ndarray:
        dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * dtype.itemsize
        if self.at + n > len(self.buf):
            raise InputError("state data is truncated")
        a = np.frombuffer(self.buf[self.at:self.at + n], dtype=dtype).reshape(shape)
        self.at += n
        return a


def _check_cache(ctx, header: dict) -> None:
    mine = _cache_desc(ctx.kv)
    theirs = {k: header[k] for k in mine}
    if mine != theirs:
        raise InputError(f"state was saved from a different model or cache layout: {theirs} vs {mine}")


def _layers(kv):
    """Per layer, K then V as arrays (n_stream, kv_size, row) of their storage dtype."""
    for k, v in zip(kv.k, kv.v):
        yield k.array()[0]
        yield v.array()[0]


# ---- one sequence --------------------------------------------------------------------------
def seq_get_data(ctx, seq: int) -> bytes:
    kv = ctx.kv
    stream = kv.stream_of(seq)
    cells = np.flatnonzero((kv.seqs[stream] & np.uint64(1 << seq)) != 0)
    cells = cells[np.argsort(kv.pos[stream, cells], kind="stable")]
    header = {"seq": seq, "n_cells": int(len(cells)), **_cache_desc(kv)}
    arrays = [kv.pos[stream, cells].astype(np.int32), kv.shift[stream, cells].astype(np.int32)]
    arrays += [a[stream, cells] for a in _layers(kv)]
    return _pack(SEQ_MAGIC, header, arrays)


def seq_set_data(ctx, seq: int, data: bytes) -> int:
    """Restore a sequence saved by seq_get_data into sequence `seq`; returns the bytes read."""
    header, body = _unpack(SEQ_MAGIC, data)
    _check_cache(ctx, header)
    kv = ctx.kv
    n = header["n_cells"]
    r = _Reader(body)
    pos, shift = r.take(np.int32, (n,)), r.take(np.int32, (n,))
    kv.seq_rm(seq)
    stream = kv.stream_of(seq)
    free = np.flatnonzero(kv.pos[stream] < 0)
    if len(free) < n:
        raise InputError(f"state of {n} cells does not fit: {len(free)} free cells (increase n_ctx)")
    cells = free[:n]
    for a in _layers(kv):
        a[stream, cells] = r.take(a.dtype, (n,) + a.shape[2:])
    kv.pos[stream, cells] = pos
    kv.shift[stream, cells] = shift
    kv.seqs[stream, cells] = np.uint64(1 << seq)
    kv.has_shift = kv.has_shift or bool(shift.any())
    return len(data) - len(body) + r.at


# ---- the whole context -------------------------------------------------------------------------
def get_data(ctx) -> bytes:
    kv = ctx.kv
    n_out = ctx._n_outputs
    header = {"n_stream": kv.n_stream, "kv_size": kv.kv_size, "n_outputs": n_out,
              "n_batch_last": len(ctx._output_row), "n_vocab": ctx.n_vocab, **_cache_desc(kv)}
    arrays = [kv.pos, kv.seqs, kv.shift, *_layers(kv), ctx._output_row.astype(np.int64), ctx._logits[:n_out]]
    return _pack(CTX_MAGIC, header, arrays)


def set_data(ctx, data: bytes) -> None:
    header, body = _unpack(CTX_MAGIC, data)
    _check_cache(ctx, header)
    kv = ctx.kv
    if (header["n_stream"], header["kv_size"]) != (kv.n_stream, kv.kv_size):
        raise InputError(f"state has {header['n_stream']} streams of {header['kv_size']} cells; this context "
                         f"{kv.n_stream} of {kv.kv_size}")
    r = _Reader(body)
    shape = (kv.n_stream, kv.kv_size)
    kv.pos[...] = r.take(np.int32, shape)
    kv.seqs[...] = r.take(np.uint64, shape)
    kv.shift[...] = r.take(np.int32, shape)
    kv.has_shift = bool(kv.shift.any())
    for a in _layers(kv):
        a[...] = r.take(a.dtype, a.shape)
    ctx._output_row = r.take(np.int64, (header["n_batch_last"],)).copy()
    n_out = header["n_outputs"]
    if ctx._logits.shape[0] < n_out:
        ctx._logits = np.empty((n_out, ctx.n_vocab), dtype=np.float32)
    ctx._logits[:n_out] = r.take(np.float32, (n_out, header["n_vocab"]))
    ctx._n_outputs = n_out
    ctx._sampled = {}
    ctx._n_batch_last = header["n_batch_last"]


# ---- files (the state plus the tokens it holds) ----------------------------------------------------
def save_file(path: str | os.PathLike, state: bytes, tokens) -> int:
    tokens = np.asarray(list(tokens), dtype=np.int32)
    with open(path, "wb") as f:
        f.write(FILE_MAGIC + struct.pack("<II", VERSION, len(tokens)) + tokens.tobytes() + state)
    return 12 + tokens.nbytes + len(state)


def load_file(path: str | os.PathLike) -> tuple[bytes, list[int]]:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise InputError(f"cannot read state file {path}: {e.strerror}") from None
    if data[:4] != FILE_MAGIC:
        raise InputError(f"{path}: not a llamapy state file")
    version, n = struct.unpack_from("<II", data, 4)
    if version != VERSION:
        raise InputError(f"{path}: state file version {version} is not supported")
    tokens = np.frombuffer(data, dtype=np.int32, count=n, offset=12).tolist()
    return data[12 + 4 * n:], tokens
