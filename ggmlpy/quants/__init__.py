"""ggml's block-quantized types: numba kernels on the packed bytes, and a numpy-level API.

`KERNELS[type]` holds the type's row kernels:
  dequantize(buf, offs, dst): buf a flat uint8 array, offs (int64) the byte offset of
      each row in buf, dst a C-contiguous float32 (len(offs), ne0) array.
  quantize(x, out) or None: x a C-contiguous float32 (rows, ne0) array, out the
      C-contiguous uint8 (rows, row bytes) array receiving ggml's blocks.
Every kernel has a single numba specialization (the argument types above), compiled
on first use and cached on disk.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..numba_compat import lean_parfor_libraries
from ..types import GGMLType, row_size, traits
from . import iquants as _i
from . import kquants as _k
from . import simple as _s

lean_parfor_libraries()  # before any of their kernels compiles


@dataclass(frozen=True)
class QuantKernels:
    dequantize: Callable
    quantize: Callable | None


KERNELS: dict[GGMLType, QuantKernels] = {
    GGMLType.Q4_0: QuantKernels(_s.dequantize_q4_0, _s.quantize_q4_0),
    GGMLType.Q4_1: QuantKernels(_s.dequantize_q4_1, _s.quantize_q4_1),
    GGMLType.Q5_0: QuantKernels(_s.dequantize_q5_0, _s.quantize_q5_0),
    GGMLType.Q5_1: QuantKernels(_s.dequantize_q5_1, _s.quantize_q5_1),
    GGMLType.Q8_0: QuantKernels(_s.dequantize_q8_0, _s.quantize_q8_0),
    GGMLType.Q2_K: QuantKernels(_k.dequantize_q2_k, _k.quantize_q2_k),
    GGMLType.Q3_K: QuantKernels(_k.dequantize_q3_k, _k.quantize_q3_k),
    GGMLType.Q4_K: QuantKernels(_k.dequantize_q4_k, _k.quantize_q4_k),
    GGMLType.Q5_K: QuantKernels(_k.dequantize_q5_k, _k.quantize_q5_k),
    GGMLType.Q6_K: QuantKernels(_k.dequantize_q6_k, _k.quantize_q6_k),
    GGMLType.Q8_K: QuantKernels(_k.dequantize_q8_k, _k.quantize_q8_k),
    GGMLType.IQ4_NL: QuantKernels(_i.dequantize_iq4_nl, _i.quantize_iq4_nl),
}


def kernels(type: GGMLType) -> QuantKernels:
    try:
        return KERNELS[GGMLType(type)]
    except KeyError:
        raise NotImplementedError(f"no quantization kernels for {GGMLType(type).name}") from None


def flat_buffer(buf: np.ndarray) -> np.ndarray:
    """buf as a read-only flat uint8 ndarray: the one buffer type the kernels are compiled
    for (read-only memory maps and writable arenas alike)."""
    flat = np.asarray(buf).view(np.uint8).reshape(-1)
    if flat.flags.writeable:
        flat = flat.view()
        flat.flags.writeable = False
    return flat


def dequantize_rows_into(type: GGMLType, buf: np.ndarray, offs: np.ndarray, dst: np.ndarray) -> None:
    """dst[r] = the float32 values of the row starting at byte offs[r] of the flat buffer."""
    kernels(type).dequantize(flat_buffer(buf), np.ascontiguousarray(offs, dtype=np.int64), dst)


def dequantize(data: np.ndarray, type: GGMLType) -> np.ndarray:
    """float32 values of quantized rows: data (..., row bytes) uint8 -> (..., ne0).

    The counterpart of gguf.quants.dequantize.
    """
    tr = traits(type)
    data = np.asarray(data).view(np.uint8)
    nbytes = data.shape[-1]
    if nbytes % tr.type_size:
        raise ValueError(f"{nbytes} bytes per row is not a multiple of {tr.name}'s block size {tr.type_size}")
    ne0 = nbytes // tr.type_size * tr.blck_size
    flat = np.ascontiguousarray(data).reshape(-1)
    n = flat.size // nbytes if nbytes else 0
    out = np.empty((n, ne0), dtype=np.float32)
    if n:
        dequantize_rows_into(type, flat, np.arange(n, dtype=np.int64) * nbytes, out)
    return out.reshape(*data.shape[:-1], ne0)


def quantize(x: np.ndarray, type: GGMLType) -> np.ndarray:
    """ggml's reference quantization of float rows: x (..., ne0) -> uint8 (..., row bytes).

    The counterpart of gguf.quants.quantize (bit-identical where gguf implements the type).
    """
    k = kernels(type)
    if k.quantize is None:
        raise NotImplementedError(f"quantization to {GGMLType(type).name} is not implemented")
    x = np.asarray(x, dtype=np.float32)
    ne0 = x.shape[-1]
    nbytes = row_size(type, ne0)
    rows = np.ascontiguousarray(x.reshape(-1, ne0))
    out = np.empty((rows.shape[0], nbytes), dtype=np.uint8)
    if rows.shape[0]:
        k.quantize(rows, out)
    return out.reshape(*x.shape[:-1], nbytes)
