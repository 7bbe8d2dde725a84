"""Conversions between ggml's element (non-block) storage types and float32 (numpy,
vectorised): one codec per type, so callers never branch on a type."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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


def _bf16_into(bits: np.ndarray, out: np.ndarray) -> None:
    """out = the float32 values of BF16 bits, without temporaries."""
    wide = out.view(np.uint32)
    np.copyto(wide, bits)
    wide <<= 16


def _identity(x: np.ndarray) -> np.ndarray:
    return x


def _as_f32(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32)


def _f16_round(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _copy_into(values: np.ndarray, out: np.ndarray) -> None:
    np.copyto(out, values)


@dataclass(frozen=True)
class Codec:
    """How values of one storage type become float32 and back, as ggml converts them."""

    to_f32: Callable[[np.ndarray], np.ndarray]  # a view when the values are float32 already
    to_f32_into: Callable[[np.ndarray, np.ndarray], None]  # (values, float32 out)
    round_to: Callable[[np.ndarray], np.ndarray]  # float32 rounded through the type
    encode: Callable[[np.ndarray], np.ndarray]  # float values as the type stores them (numpy casts the rest)


_CAST = Codec(_as_f32, _copy_into, _identity, _identity)  # F32, F64, integers: numpy's casts
CODECS: dict[GGMLType, Codec] = {
    GGMLType.F32: Codec(_identity, _copy_into, _identity, _identity),
    GGMLType.F16: Codec(_as_f32, _copy_into, _f16_round, _identity),
    GGMLType.BF16: Codec(bf16_to_f32, _bf16_into, lambda x: bf16_to_f32(f32_to_bf16(x)), f32_to_bf16),
}


def codec(type: GGMLType) -> Codec:
    return CODECS.get(type, _CAST)


def is_float(type: GGMLType) -> bool:
    """Whether the type stores floating-point values (NaN and infinity are possible)."""
    return type in CODECS


def to_f32(arr: np.ndarray, type: GGMLType) -> np.ndarray:
    """Values of a plain-typed array as float32 (a view when already float32)."""
    return codec(type).to_f32(arr)


def to_f32_into(values: np.ndarray, type: GGMLType, out: np.ndarray) -> np.ndarray:
    """out = the float32 values of a plain-typed array, without temporaries."""
    codec(type).to_f32_into(values, out)
    return out


def round_to(arr: np.ndarray, type: GGMLType) -> np.ndarray:
    """float32 values rounded through `type`, as ggml does when it converts an operand."""
    return codec(type).round_to(arr)


def store(dst: np.ndarray, values: np.ndarray, type: GGMLType) -> None:
    """Write float values into a typed destination view, converting as ggml does."""
    np.copyto(dst, codec(type).encode(values).reshape(dst.shape), casting="unsafe")
