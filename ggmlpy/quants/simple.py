"""The 32-element block types Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (ggml-common.h layouts).

  Q4_0  18 bytes: d (f16), qs[16]                 x = (q - 8) * d
  Q4_1  20 bytes: d, m (f16), qs[16]              x = q * d + m
  Q5_0  22 bytes: d, qh[4] (u32 LE), qs[16]       x = (q - 16) * d, q = nibble | bit << 4
  Q5_1  24 bytes: d, m, qh[4], qs[16]             x = q * d + m
  Q8_0  34 bytes: d, qs[32] (int8)                x = q * d
Nibble j of qs holds element j (low) and element j + 16 (high); bit j of qh is the fifth
bit of element j.

Kernel signatures (one numba specialization each):
  dequantize: (buf uint8[::1], offs int64[::1], dst float32[:, ::1]); row r of dst is
              the row whose bytes start at buf[offs[r]].
  quantize:   (x float32[:, ::1], out uint8[:, ::1]); rows independent.
Quantizers are ggml's quantize_row_*_ref, float32 operation for operation.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .common import F32, f16_round, f16_to_f32, put_f16, roundf

QK = 32


# ---- dequantize --------------------------------------------------------------------
@njit(parallel=True, cache=True)
def dequantize_q4_0(buf, offs, dst):
    nb = dst.shape[1] // QK
    for r in prange(offs.shape[0]):
        y = dst[r]
        for i in range(nb):
            o = offs[r] + i * 18
            d = f16_to_f32(buf[o], buf[o + 1])
            for j in range(16):
                q = np.int32(buf[o + 2 + j])
                y[i * QK + j] = F32((q & 0xF) - 8) * d
                y[i * QK + j + 16] = F32((q >> 4) - 8) * d


@njit(parallel=True, cache=True)
def dequantize_q4_1(buf, offs, dst):
    nb = dst.shape[1] // QK
    for r in prange(offs.shape[0]):
        y = dst[r]
        for i in range(nb):
            o = offs[r] + i * 20
            d = f16_to_f32(buf[o], buf[o + 1])
            m = f16_to_f32(buf[o + 2], buf[o + 3])
            for j in range(16):
                q = np.int32(buf[o + 4 + j])
                y[i * QK + j] = F32(q & 0xF) * d + m
                y[i * QK + j + 16] = F32(q >> 4) * d + m


@njit(cache=True, inline="always")
def _u32(buf, o):
    return (np.int64(buf[o]) | (np.int64(buf[o + 1]) << 8)
            | (np.int64(buf[o + 2]) << 16) | (np.int64(buf[o + 3]) << 24))


@njit(parallel=True, cache=True)
def dequantize_q5_0(buf, offs, dst):
    nb = dst.shape[1] // QK
    for r in prange(offs.shape[0]):
        y = dst[r]
        for i in range(nb):
            o = offs[r] + i * 22
            d = f16_to_f32(buf[o], buf[o + 1])
            qh = np.int64(_u32(buf, o + 2))
            for j in range(16):
                q = np.int32(buf[o + 6 + j])
                h0 = np.int32((qh >> j) & 1) << 4
                h1 = np.int32((qh >> (j + 16)) & 1) << 4
                y[i * QK + j] = F32(((q & 0xF) | h0) - 16) * d
                y[i * QK + j + 16] = F32(((q >> 4) | h1) - 16) * d


@njit(parallel=True, cache=True)
def dequantize_q5_1(buf, offs, dst):
    nb = dst.shape[1] // QK
    for r in prange(offs.shape[0]):
        y = dst[r]
        for i in range(nb):
            o = offs[r] + i * 24
            d = f16_to_f32(buf[o], buf[o + 1])
            m = f16_to_f32(buf[o + 2], buf[o + 3])
            qh = np.int64(_u32(buf, o + 4))
            for j in range(16):
                q = np.int32(buf[o + 8 + j])
                h0 = np.int32((qh >> j) & 1) << 4
                h1 = np.int32((qh >> (j + 16)) & 1) << 4
                y[i * QK + j] = F32((q & 0xF) | h0) * d + m
                y[i * QK + j + 16] = F32((q >> 4) | h1) * d + m


@njit(parallel=True, cache=True)
def dequantize_q8_0(buf, offs, dst):
    nb = dst.shape[1] // QK
    for r in prange(offs.shape[0]):
        y = dst[r]
        for i in range(nb):
            o = offs[r] + i * 34
            d = f16_to_f32(buf[o], buf[o + 1])
            for j in range(QK):
                y[i * QK + j] = F32(np.int8(buf[o + 2 + j])) * d


# ---- quantize (ggml's quantize_row_*_ref) -------------------------------------------
@njit(cache=True, inline="always")
def _absmax_signed(x, b):
    """(max |v|, the first v reaching it) over block b of row x."""
    amax = F32(0.0)
    mx = F32(0.0)
    for j in range(QK):
        v = x[b * QK + j]
        if amax < abs(v):
            amax = abs(v)
            mx = v
    return amax, mx


@njit(cache=True, inline="always")
def _min_max(x, b):
    mn = F32(3.4028234663852886e38)
    mx = F32(-3.4028234663852886e38)
    for j in range(QK):
        v = x[b * QK + j]
        if v < mn:
            mn = v
        if v > mx:
            mx = v
    return mn, mx


@njit(parallel=True, cache=True)
def quantize_q4_0(x, out):
    nb = x.shape[1] // QK
    for r in prange(x.shape[0]):
        xr, y = x[r], out[r]
        for i in range(nb):
            o = i * 18
            _, mx = _absmax_signed(xr, i)
            d = mx / F32(-8.0)
            idd = F32(1.0) / d if d != 0 else F32(0.0)
            put_f16(y, o, d)
            for j in range(16):
                x0 = xr[i * QK + j] * idd
                x1 = xr[i * QK + 16 + j] * idd
                q0 = min(15, np.int32(x0 + F32(8.5)))
                q1 = min(15, np.int32(x1 + F32(8.5)))
                y[o + 2 + j] = np.uint8(q0 | (q1 << 4))


@njit(parallel=True, cache=True)
def quantize_q4_1(x, out):
    nb = x.shape[1] // QK
    for r in prange(x.shape[0]):
        xr, y = x[r], out[r]
        for i in range(nb):
            o = i * 20
            mn, mx = _min_max(xr, i)
            d = (mx - mn) / F32(15.0)
            idd = F32(1.0) / d if d != 0 else F32(0.0)
            put_f16(y, o, d)
            put_f16(y, o + 2, mn)
            for j in range(16):
                x0 = (xr[i * QK + j] - mn) * idd
                x1 = (xr[i * QK + 16 + j] - mn) * idd
                q0 = min(15, np.int32(x0 + F32(0.5)))
                q1 = min(15, np.int32(x1 + F32(0.5)))
                y[o + 4 + j] = np.uint8(q0 | (q1 << 4))


@njit(cache=True, inline="always")
def _put_u32(y, o, v):
    for k in range(4):
        y[o + k] = np.uint8((v >> (8 * k)) & 0xFF)


@njit(parallel=True, cache=True)
def quantize_q5_0(x, out):
    nb = x.shape[1] // QK
    for r in prange(x.shape[0]):
        xr, y = x[r], out[r]
        for i in range(nb):
            o = i * 22
            _, mx = _absmax_signed(xr, i)
            d = mx / F32(-16.0)
            idd = F32(1.0) / d if d != 0 else F32(0.0)
            put_f16(y, o, d)
            qh = np.int64(0)
            for j in range(16):
                x0 = xr[i * QK + j] * idd
                x1 = xr[i * QK + 16 + j] * idd
                q0 = min(31, np.int32(x0 + F32(16.5)))
                q1 = min(31, np.int32(x1 + F32(16.5)))
                y[o + 6 + j] = np.uint8((q0 & 0xF) | ((q1 & 0xF) << 4))
                qh |= np.int64((q0 >> 4) & 1) << j
                qh |= np.int64((q1 >> 4) & 1) << (j + 16)
            _put_u32(y, o + 2, qh)


@njit(parallel=True, cache=True)
def quantize_q5_1(x, out):
    nb = x.shape[1] // QK
    for r in prange(x.shape[0]):
        xr, y = x[r], out[r]
        for i in range(nb):
            o = i * 24
            mn, mx = _min_max(xr, i)
            d = (mx - mn) / F32(31.0)
            idd = F32(1.0) / d if d != 0 else F32(0.0)
            put_f16(y, o, d)
            put_f16(y, o + 2, mn)
            qh = np.int64(0)
            for j in range(16):
                x0 = (xr[i * QK + j] - mn) * idd
                x1 = (xr[i * QK + 16 + j] - mn) * idd
                q0 = np.int32(x0 + F32(0.5)) & 0xFF
                q1 = np.int32(x1 + F32(0.5)) & 0xFF
                y[o + 8 + j] = np.uint8((q0 & 0xF) | ((q1 & 0xF) << 4))
                qh |= np.int64((q0 >> 4) & 1) << j
                qh |= np.int64((q1 >> 4) & 1) << (j + 16)
            _put_u32(y, o + 4, qh)


@njit(parallel=True, cache=True)
def quantize_q8_0(x, out):
    nb = x.shape[1] // QK
    for r in prange(x.shape[0]):
        xr, y = x[r], out[r]
        for i in range(nb):
            o = i * 34
            amax, _ = _absmax_signed(xr, i)
            d = amax / F32(127.0)
            idd = F32(1.0) / d if d != 0 else F32(0.0)
            put_f16(y, o, d)
            for j in range(QK):
                y[o + 2 + j] = np.uint8(np.int32(roundf(xr[i * QK + j] * idd)) & 0xFF)


# ---- activations: the rounding ggml applies to the other operand of a quantized product ----
@njit(parallel=True, cache=True)
def round_rows_q8_0(x):
    """In place: every row of x (float32[:, ::1], ne0 a multiple of 32) replaced by the values
    of its Q8_0 (or Q8_1) blocks as ggml-cpu's x86 quantize_row_q8_0 / q8_1 (AVX, AVX2)
    produce them for the activations of a product:
        amax = max |x|,  d = fp16(amax / 127),  q = rint(x * (127 / amax))  (ties to even)
    and the value is d * q. (The scalar quantize_row_q8_0_ref differs: x * (1 / d), ties
    away from zero.)"""
    nb = x.shape[1] // QK
    for r in prange(x.shape[0]):
        xr = x[r]
        for i in range(nb):
            o = i * QK
            d, idd = activation_block_scale(xr, o)
            for j in range(QK):
                q = np.int32(activation_q8_0(xr[o + j], idd))  # an integer: no -0
                xr[o + j] = F32(d * F32(q))


@njit(cache=True, inline="always")
def activation_block_scale(xr, o):
    """(d, 127 / amax) of the activations' Q8_0 block at xr[o:o + 32] (round_rows_q8_0);
    activation_q8_0 gives its integers."""
    amax = F32(0.0)
    for j in range(QK):
        a = abs(xr[o + j])
        if a > amax:
            amax = a
    return f16_round(amax / F32(127.0)), (F32(127.0) / amax if amax != 0 else F32(0.0))


@njit(cache=True, inline="always")
def activation_q8_0(v, idd):
    """The integer of v in its activations' Q8_0 block (idd from activation_block_scale):
    rint(v * idd), ties to even, as a float32 (-0 for small negatives: stored as an integer,
    it is 0). Every Q8_0 activation quantizer rounds here."""
    return np.rint(F32(v * idd))
