"""Single-value intrinsics numba lacks: a fused multiply-add of float32 (ggml's arithmetic,
backend/cpu/simd.py) and the IEEE half conversions of half.py."""
from __future__ import annotations

from numba import types

from .emit import kernel


@kernel(types.float32, (types.float32,) * 3)
def fma_f32(e, a, b, c):
    """a * b + c rounded once (LLVM's llvm.fma: the vfmadd instruction, or an exact
    emulation on CPUs without it)."""
    return e.fma(a, b, c)


@kernel(types.uint16, (types.float32,))
def f32_to_half_bits(e, x):
    """IEEE half bits of x, to nearest even (vcvtps2ph; only where the target converts)."""
    return e.to_half_bits(x)


@kernel(types.float32, (types.uint16,))
def half_bits_to_f32(e, h):
    """The float32 value of IEEE half bits h (vcvtph2ps; only where the target converts)."""
    return e.from_half_bits(h)
