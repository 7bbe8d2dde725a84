"""Conversions between ggml's float storage types and float32 (numpy, vectorised)."""
from __future__ import annotations

import numpy as np

from .types import GGMLType


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round to nearest even, NaNs kept quiet (ggml_compute_fp32_to_bf16)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((u >> 16) | 64).astype(np.uint16), rounded)


def to_f32(arr: np.ndarray, type: GGMLType) -> np.ndarray:
    """Values of a plain-typed array as float32 (a view when already float32)."""
    if type == GGMLType.F32:
        return arr
    if type == GGMLType.BF16:
        return bf16_to_f32(arr)
    return arr.astype(np.float32)


def round_to(arr: np.ndarray, type: GGMLType) -> np.ndarray:
    """float32 values rounded through `type`, as ggml does when it converts an operand."""
    if type == GGMLType.F16:
        return arr.astype(np.float16).astype(np.float32)
    if type == GGMLType.BF16:
        return bf16_to_f32(f32_to_bf16(arr))
    return arr


def store(dst: np.ndarray, values: np.ndarray, type: GGMLType) -> None:
    """Write float values into a typed destination view, converting as ggml does."""
    if type == GGMLType.BF16:
        np.copyto(dst, f32_to_bf16(values).reshape(dst.shape))
    else:
        np.copyto(dst, values, casting="unsafe")
