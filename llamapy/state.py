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
    """What must agree between the saving and the restoring context, for every KV cache."""
    out = []
    for cache in kv.caches:
        k0, v0 = next(iter(cache.k.values())), next(iter(cache.v.values()))
        out.append({"layers": sorted(int(il) for il in cache.k), "type_k": k0.type.name, "type_v": v0.type.name,
                    "row_k": int(k0.array().shape[-1]), "row_v": int(v0.array().shape[-1])})
    return {"caches": out}


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
    if mine["caches"] != header["caches"]:
        raise InputError(f"state was saved from a different model or cache layout: {header['caches']} vs {mine['caches']}")


def _layers(cache):
    """Per layer of one cache, K then V as arrays (n_stream, kv_size, row) of their storage dtype."""
    for il in sorted(cache.k):
        yield cache.k[il].array()[0]
        yield cache.v[il].array()[0]


# ---- one sequence --------------------------------------------------------------------------
def seq_get_data(ctx, seq: int) -> bytes:
    header = {"seq": seq, "n_cells": [], **_cache_desc(ctx.kv)}
    arrays = []
    for cache in ctx.kv.caches:
        stream = cache.stream_of(seq)
        cells = np.flatnonzero((cache.seqs[stream] & np.uint64(1 << seq)) != 0)
        cells = cells[np.argsort(cache.pos[stream, cells], kind="stable")]
        header["n_cells"].append(int(len(cells)))
        arrays += [cache.pos[stream, cells].astype(np.int32), cache.shift[stream, cells].astype(np.int32)]
        arrays += [a[stream, cells] for a in _layers(cache)]
    return _pack(SEQ_MAGIC, header, arrays)


def seq_set_data(ctx, seq: int, data: bytes) -> int:
    """Restore a sequence saved by seq_get_data into sequence `seq`; returns the bytes read."""
    header, body = _unpack(SEQ_MAGIC, data)
    _check_cache(ctx, header)
    ctx.kv.seq_rm(seq)
    r = _Reader(body)
    for cache, n in zip(ctx.kv.caches, header["n_cells"]):
        pos, shift = r.take(np.int32, (n,)), r.take(np.int32, (n,))
        stream = cache.stream_of(seq)
        free = np.flatnonzero(cache.pos[stream] < 0)
        if len(free) < n:
            raise InputError(f"state of {n} cells does not fit: {len(free)} free cells (increase n_ctx)")
        cells = free[:n]
        for a in _layers(cache):
            a[stream, cells] = r.take(a.dtype, (n,) + a.shape[2:])
        cache.place(stream * cache.kv_size + cells, pos, np.uint64(1 << seq), shift)
    return len(data) - len(body) + r.at


# ---- the whole context -------------------------------------------------------------------------
def get_data(ctx) -> bytes:
    output_row, logits = ctx.outputs.to_state()
    header = {"shapes": [[c.n_stream, c.kv_size] for c in ctx.kv.caches], "n_outputs": len(logits),
              "n_batch_last": len(output_row), "n_vocab": ctx.n_vocab, **_cache_desc(ctx.kv)}
    arrays = []
    for cache in ctx.kv.caches:
        arrays += [cache.pos, cache.seqs, cache.shift, *_layers(cache)]
    arrays += [output_row, logits]
    return _pack(CTX_MAGIC, header, arrays)


def set_data(ctx, data: bytes) -> None:
    header, body = _unpack(CTX_MAGIC, data)
    _check_cache(ctx, header)
    mine = [[c.n_stream, c.kv_size] for c in ctx.kv.caches]
    if header["shapes"] != mine:
        raise InputError(f"state has KV caches of (streams, cells) {header['shapes']}; this context {mine}")
    r = _Reader(body)
    for cache in ctx.kv.caches:
        shape = (cache.n_stream, cache.kv_size)
        cache.set_cells(r.take(np.int32, shape), r.take(np.uint64, shape), r.take(np.int32, shape))
        for a in _layers(cache):
            a[...] = r.take(a.dtype, a.shape)
    output_row = r.take(np.int64, (header["n_batch_last"],))
    ctx.outputs.from_state(output_row, r.take(np.float32, (header["n_outputs"], header["n_vocab"])))


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
