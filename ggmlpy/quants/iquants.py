"""ggml's non-linear block type IQ4_NL (ggml-common.h's block_iq4_nl).

  IQ4_NL  18 bytes: d (f16), qs[16]               x = d * KVALUES_IQ4NL[q]
Nibble j of qs holds element j (low) and element j + 16 (high), as in Q4_0; a nibble indexes
a 16-entry table of int8 values spaced for normally distributed weights instead of standing
for nibble - 8.

Kernel signatures as in simple.py. The quantizer is ggml's quantize_iq4_nl without an
importance matrix (what llama-quantize runs without --imatrix): its scale search
(quantize_row_iq4_nl_impl, ntry 7), float32 operation for operation, without fused
multiply-adds (ggml-quants.c is built without -march, so the C has none either).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .common import F32, f16_to_f32, put_f16

QK = 32
BLOCK_BYTES = 18
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # kvalues_iq4nl
_VALUES = np.array(KVALUES_IQ4NL, dtype=np.float32)
GROUP_MAX_EPS = F32(1e-15)
NTRY = 7  # quantize_iq4_nl's scale candidates: (itry - 127) / max for itry in -7..7


@njit(parallel=True, cache=True)
def dequantize_iq4_nl(buf, offs, dst):
    nb = dst.shape[1] // QK
    for r in prange(offs.shape[0]):
        y = dst[r]
        for i in range(nb):
            o = offs[r] + i * BLOCK_BYTES
            d = f16_to_f32(buf[o], buf[o + 1])
            for j in range(16):
                q = np.int32(buf[o + 2 + j])
                y[i * QK + j] = d * _VALUES[q & 0xF]
                y[i * QK + j + 16] = d * _VALUES[q >> 4]


@njit(cache=True, inline="always")
def _best_index(x):
    """ggml's best_index_int8 over the table: the index of the value nearest x (a binary search;
    ties to the upper one)."""
    if x <= _VALUES[0]:
        return 0
    if x >= _VALUES[15]:
        return 15
    ml, mu = 0, 15
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if x < _VALUES[mav]:
            mu = mav
        else:
            ml = mav
    return mu - 1 if x - _VALUES[mu - 1] < _VALUES[mu] - x else mu


@njit(cache=True, inline="always")
def _fit(xb, id):
    """(sum w q x, sum w q^2) of the block quantized with inverse scale id, w = x^2."""
    sumqx = F32(0.0)
    sumq2 = F32(0.0)
    for j in range(QK):
        q = _VALUES[_best_index(id * xb[j])]
        w = xb[j] * xb[j]
        sumqx += w * q * xb[j]
        sumq2 += w * q * q
    return sumqx, sumq2


@njit(cache=True)
def _block_scale(xb):
    """The block's scale as quantize_row_iq4_nl_impl chooses it: from -max / -127, then the
    best of the 15 candidates (itry - 127) / max by sum(w q x)^2 / sum(w q^2); 0 for a block
    below GROUP_MAX_EPS."""
    amax = F32(0.0)
    mx = F32(0.0)
    for j in range(QK):
        ax = abs(xb[j])
        if ax > amax:
            amax = ax
            mx = xb[j]
    if amax < GROUP_MAX_EPS:
        return F32(0.0)
    d = -mx / _VALUES[0]
    sumqx, sumq2 = _fit(xb, F32(1.0) / d)
    d = sumqx / sumq2 if sumq2 > 0 else F32(0.0)
    best = d * sumqx
    for itry in range(-NTRY, NTRY + 1):
        sumqx, sumq2 = _fit(xb, F32(itry + KVALUES_IQ4NL[0]) / mx)
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            d = sumqx / sumq2
            best = d * sumqx
    return d


@njit(parallel=True, cache=True)
def quantize_iq4_nl(x, out):
    """ggml's quantize_iq4_nl (no importance matrix): per block the scale of _block_scale,
    stored as f16, and each element's nearest table value at 1 / that scale (in float32,
    before its f16 rounding)."""
    nb = x.shape[1] // QK
    for r in prange(x.shape[0]):
        xr, y = x[r], out[r]
        for i in range(nb):
            o = i * BLOCK_BYTES
            xb = xr[i * QK:(i + 1) * QK]
            d = _block_scale(xb)
            put_f16(y, o, d)
            id = F32(1.0) / d if d != 0 else F32(0.0)
            for j in range(16):
                lo = _best_index(id * xb[j])
                hi = _best_index(id * xb[j + 16])
                y[o + 2 + j] = np.uint8(lo | (hi << 4))
