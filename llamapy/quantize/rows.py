"""Rows of one tensor type to another, a slab at a time: the source rows as float32 (copied,
widened from F16/BF16 or dequantized), then checked finite and written in the new type
(ggml's reference quantizers, ggml's F16 and BF16 rounding). The block kernels run in
parallel over rows on numba's threads, so a slab holds many rows.
"""
from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
from numba import njit, prange

from ggmlpy import GGMLType
from ggmlpy import convert
from ggmlpy.quants import dequantize_rows_into, kernels
from ggmlpy.types import row_size, traits

from ..errors import ModelLoadError

@njit(parallel=True, cache=True)
def _first_bad_row(bits):
    """The first row of float32 values (their bits: uint32[:, ::1]) holding a NaN or an
    infinity (all exponent bits set), or -1. An integer count per row, which vectorizes."""
    n = bits.shape[0]
    bad = np.zeros(n, dtype=np.int64)
    for r in prange(n):
        row = bits[r]
        count = 0
        for j in range(row.shape[0]):
            count += (row[j] & 0x7F800000) == 0x7F800000
        bad[r] = count
    for r in range(n):
        if bad[r]:
            return r
    return -1


def _read(fd: int, offset: int, out: np.ndarray) -> None:
    """out's bytes from the file at `offset` (read(2) into the buffer: cheaper than faulting
    in the pages of a memory map, which is read once here)."""
    view = memoryview(out).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise ModelLoadError(f"the input file ends {len(view) - done} bytes early")
        done += n


def _to_f32(src: np.ndarray, type: GGMLType, out: np.ndarray) -> None:
    """out (rows, ne0) = the float32 values of the row bytes src (rows, row bytes) of a type
    other than F32 (whose rows _first_bad_row copies)."""
    tr = traits(type)
    if not tr.is_quantized:
        convert.to_f32_into(src.view(tr.np_dtype), type, out)
    else:
        nbytes = src.shape[1]
        flat = np.ascontiguousarray(src).reshape(-1)
        dequantize_rows_into(type, flat, np.arange(out.shape[0], dtype=np.int64) * nbytes, out)


def _from_f32(x: np.ndarray, type: GGMLType, out: np.ndarray) -> np.ndarray:
    """x (rows, ne0) float32 in `type`'s row bytes, written to out (rows, row bytes) when the
    type has a kernel; returns the bytes."""
    tr = traits(type)
    if not tr.is_quantized:
        return convert.codec(type).encode(x).astype(tr.np_dtype, copy=False).view(np.uint8)
    kernels(type).quantize(x, out)
    return out


def convert_rows(name: str, fd: int, offset: int, src_type: GGMLType, dst_type: GGMLType, ne0: int, n_rows: int,
                 slab_bytes: int) -> Iterator[np.ndarray]:
    """The rows of a tensor (`n_rows` rows of `ne0` values of `src_type` at `offset` in the file
    `fd`) in `dst_type` (the bytes themselves when the type stays), as consecutive pieces made
    in buffers of about `slab_bytes`. A source value that is NaN or infinite is a
    ModelLoadError naming the tensor and row, as llama.cpp's loader checks every tensor it reads."""
    src_row, dst_row = row_size(src_type, ne0), row_size(dst_type, ne0)
    checked = convert.is_float(src_type) or traits(src_type).is_quantized  # ggml_validate_row_data passes integers
    rows = max(1, min(n_rows, slab_bytes // (src_row + dst_row + 4 * ne0)))
    raw = np.empty((rows, src_row), dtype=np.uint8)
    same = traits(src_type).np_dtype == np.float32  # the rows read are float32 values already
    x = raw.view(np.float32) if same else np.empty((rows, ne0), dtype=np.float32)
    out = np.empty((rows, dst_row), dtype=np.uint8) if traits(dst_type).is_quantized else None
    for r0 in range(0, n_rows, rows):
        n = min(rows, n_rows - r0)
        src, xs = raw[:n], x[:n]
        _read(fd, offset + r0 * src_row, src)
        if checked:
            if not same:
                _to_f32(src, src_type, xs)
            bad = _first_bad_row(xs.view(np.uint32))
            if bad >= 0:
                raise ModelLoadError(f"tensor {name!r} has invalid data (NaN or infinity) in row {r0 + bad}")
        yield src if src_type == dst_type else _from_f32(xs, dst_type, None if out is None else out[:n])
