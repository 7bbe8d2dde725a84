"""float32 <-> IEEE half conversions for numba kernels (numba has no float16 type, so halves
travel as their uint16 bits).

Where numba compiles for conversion instructions (x86 F16C, every aarch64) they are LLVM's
fptrunc/fpext (llvmir/scalar.py), which vectorise to vcvtps2ph/vcvtph2ps: round to nearest
even, as ggml's GGML_FP32_TO_FP16 and numpy. Elsewhere (NUMBA_CPU_NAME=generic included)
integer selects give the same bits. (Only signaling NaNs differ: the instructions quieten
them, as ggml's conversions on such CPUs do.)
"""
from __future__ import annotations

import platform

import numpy as np
from numba import njit

from .llvmir.emit import target_has
from .llvmir.scalar import f32_to_half_bits, half_bits_to_f32


@njit(cache=True, inline="always")
def f32_to_f16_bits_select(x):
    """IEEE half bits of x, round to nearest even, written with selects only (so that loops
    over it vectorise)."""
    f = np.float32(x).view(np.uint32)
    sign = (f >> np.uint32(16)) & np.uint32(0x8000)
    a = np.uint32(f & np.uint32(0x7FFFFFFF))
    # normal halves: rebias the exponent, round the 13 dropped bits to nearest even
    normal = (a + np.uint32(0xC8000FFF) + ((a >> np.uint32(13)) & np.uint32(1))) >> np.uint32(13)
    # subnormal halves: adding 0.5 lets the float adder round the bits off
    sub = np.float32(a.view(np.float32) + np.float32(0.5)).view(np.uint32) - np.uint32(0x3F000000)
    special = np.uint32(0x7E00) if a > np.uint32(0x7F800000) else np.uint32(0x7C00)  # NaN, or inf/overflow
    h = special if a >= np.uint32(0x477FF000) else (normal if a >= np.uint32(0x38800000) else sub)
    return np.uint16(h | sign)


@njit(cache=True, inline="always")
def f16_bits_to_f32_select(h):
    """float32 value of IEEE half bits h (exact), with selects only."""
    h = np.uint32(h)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    a = h & np.uint32(0x7FFF)
    normal = (a << np.uint32(13)) + np.uint32(0x38000000)
    special = (a << np.uint32(13)) | np.uint32(0x7F800000)  # inf, NaN with its payload
    sub = np.float32(np.float32(a) * np.float32(2.0 ** -24)).view(np.uint32)  # exact: a < 2^10
    bits = special if a >= np.uint32(0x7C00) else (normal if a >= np.uint32(0x0400) else sub)
    return np.uint32(bits | sign).view(np.float32)


@njit(cache=True, inline="always")
def _f32_to_f16_bits_hw(x):
    return f32_to_half_bits(np.float32(x))


@njit(cache=True, inline="always")
def _f16_bits_to_f32_hw(h):
    return half_bits_to_f32(np.uint16(h))


HARDWARE = platform.machine().lower() in ("aarch64", "arm64") or target_has("f16c")  # numba's target's
f32_to_f16_bits = _f32_to_f16_bits_hw if HARDWARE else f32_to_f16_bits_select
f16_bits_to_f32 = _f16_bits_to_f32_hw if HARDWARE else f16_bits_to_f32_select
