"""Products with block-quantized matrices in ggml-cpu's own summation order.

ggml quantizes the activations to the matrix type's vec_dot_type (Q8_0, Q8_K) and sums
integer products per group of elements; those sums are exact. What it rounds is the float
arithmetic around them, in an order each of its kernels fixes, and that order is
reproduced here (simd.py says why it matters), for the kernels llama.cpp's x86 build runs:

  Q5_0, Q8_0 (x Q8_0)   ggml_vec_dot_q*_0_q8_0 and llamafile's tinyBLAS_Q0_AVX (any number
                        of columns): per 32-block b, 8 lanes of 4 products each,
                        lane_j = fma(d_w[b] * d_x[b], isum[b, j], lane_j), then hsum8.
  Q4_0, IQ4_NL (x Q8_0) the 8x8-repacked kernels every such matrix with rows % 8 == 0 gets
                        (ggml_gemm / ggml_gemv_q4_0_8x8_q8_0, _iq4_nl_8x8_q8_0: one template,
                        any number of columns): per 32-block b, acc = fma(isum[b], d_w[b] *
                        d_x[b], acc), one chain; other matrices: Q5_0's order (tinyBLAS_Q0_AVX
                        from 2 columns; for one column ggml_vec_dot_q4_0_q8_0, the same order, or
                        ggml_vec_dot_iq4_nl_q8_0, which pairs the blocks in two chains:
                        _q0_pairs_vec_dot).
                        IQ4_NL's integers are a 16-value table's entries (Q0Rows.values).
  Q4_K (x Q8_K)         the 8x8-repacked kernels every Q4_K matrix with rows % 8 == 0 gets:
                        columns in groups of 4 through ggml_gemm_q4_K_8x8_q8_K (per 64-element
                        chunk: acc = fma(isum, d_w * d_x, acc), the mins in a second sum,
                        acc - acc_min), the last columns % 4 through its gemv (the same per
                        256-element super-block).
  Q6_K (x Q8_K)         8 columns or more: the tiled kernel (ggml-cpu/tiled: per super-block
                        acc = fma(f(isum) * d_w, d_x, acc)); fewer: ggml_vec_dot_q6_K_q8_K
                        (8 lanes over ggml's mix of elements and scales, then hsum8).

So, as in ggml, the number of columns (tokens in a ubatch) picks the formula for Q4_K and
Q6_K products, never the thread count (the number of rows picks Q4_0's). The sums of integer products are float32 where every
partial sum stays below 2^24 (exact in any order, so they vectorise), float64 otherwise.
The float work runs in llvmir's vector micro-kernels, 16 columns (or, for fewer columns,
16 matrix rows) at a time; the matrix rows are unpacked from their blocks per task into
integers (float32) in the kernels' layout, so nothing of the matrix is kept expanded.
With AVX512-VNNI the integer sums are vpdpbusd's (llvmir/vnni.py): the Q4_K/Q6_K tiles take
rows unpacked to bytes, or, for a Q4_K product of fewer than 64 columns, read them in place;
the few-column row kernels always read the blocks in place (Q4_K's up to 11 columns, 8 rows
a call, groups of 4 columns in the gemm's order).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import njit, prange

from ....llvmir.emit import W
from ....llvmir.quant_tiles import (
    Q0_ROWS,
    Q4K_ROWS,
    Q6K_ROWS,
    q0_blocks_tile,
    q0_lanes_tile,
    q4_k_gemv_tile,
    q4_k_tile,
    q6_k_gemv_tile,
    q6_k_tile,
)
from ....llvmir.scalar import fma_f32
from ....llvmir.vnni import (
    BLOCK_ROWS,
    Q4K_ROW_CALL,
    Q4K_VNNI_ROWS,
    Q6K_VNNI_ROWS,
    VNNI,
    q0_blocks_vnni,
    q0_tile2_vnni,
    q4_k_nibbles,
    q4_k_rows_chunks_vnni,
    q4_k_rows_vnni,
    q4_k_tile_packed_vnni,
    q4_k_tile_vnni,
    q5_0_row_vnni,
    q6_k_row_vnni,
    q6_k_tile_vnni,
    q8_0_row_vnni,
)
from ....quants.common import F32, QK_K, f16_to_f32
from ....quants.kquants import activation_q8_k, activation_superblock_scale, scale_min_k4
from ....quants.simple import activation_block_scale, activation_q8_0
from ..simd import hsum8

QK = 32
Q4_0_BYTES = 18          # bytes of a block: f16 d, then the elements
Q5_0_BYTES = 22
Q8_0_BYTES = 34
ROW_GROUP = 32           # matrix rows a task unpacks (then multiplied with every column tile)
Q0_GEMV_MAX_COLS = 15    # up to this many columns, Q0 products run over tiles of 16 matrix rows
Q6_K_TILED_MIN_COLS = 8  # ggml_tiled_min_batch: the tiled kernel from 8 columns
Q4_K_GEMM_GROUP = 4      # ggml's repacked Q4_K gemm takes columns in groups of 4
Q4_K_TILE_MIN_COLS = 12    # fewer columns: the VNNI row kernels, a column at a time (rows read once a column)
Q4_K_UNPACK_MIN_COLS = 64  # from this many columns the VNNI gemm unpacks its rows first (else reads them in place)
GEMV_ROWS = 16           # matrix rows per task of the few-column kernels (their scratch shared)
Q4K_GEMV_ROWS = 64       # the Q4_K row kernel's: 8 calls of 8 rows
INT_SUMS = {"reassoc", "contract", "nsz"}  # float32 sums of integer products: exact in any order


# ---- activations ---------------------------------------------------------------------------------
@njit(cache=True, inline="always")
def _at(e, nb, lane_major):
    """Where element e of a row of nb blocks goes in the float kernels' layout: e itself, or
    lane-major, where ggml's lane j of every block (elements 4 j .. 4 j + 3) comes together:
    (j, b, t) at j 4 nb + 4 b + t, so one lane's chain over the blocks reads a contiguous run."""
    if not lane_major:
        return e
    return ((e % QK) // 4) * 4 * nb + 4 * (e // QK) + e % 4


# where quantize_q8_0 puts element e = 32 b + 4 j + t (lane j of block b) of column n
ROWS, TILES, LANES, QUADS = 0, 1, 2, 3


@njit(cache=True, inline="always")
def _tile_column(x, tile, cols, c):
    """Column c of a tile of `cols`: x's row, and whether it is one (the tiles' padding past
    x's last row reads that row, for the quantizers to give it scale 0: integers 0)."""
    n = tile * cols + c
    return x[min(n, x.shape[0] - 1)], n < x.shape[0]


@njit(cache=True, inline="always")
def _q8_0_lanes(xb, idd, dst, step, sums, sums_step, weight):
    """Block xb's 8 lanes of 4 integers, lane j at dst[step j:][:4], and weight * its sum at
    sums[sums_step j] (the steps constants where inlined: the stores then vectorise)."""
    for j in range(8):
        tot = 0
        for t in range(4):
            q = np.int32(activation_q8_0(xb[4 * j + t], idd))
            dst[step * j + t] = q
            tot += q
        sums[sums_step * j] = weight * tot


@njit(parallel=True, cache=True)
def quantize_q8_0(x, layout, xq, xd, xc, weight):
    """x (N, K) -> its Q8_0 blocks as ggml-cpu's quantize_row_q8_0 rounds them (quants.simple:
    activation_block_scale, activation_q8_0), written flat in the layout a kernel reads:
      ROWS    xq[n, e], xd[n, b], xc[n, 8 b + j]
      TILES   tiles of 16 columns: xq[n // 16, e, n % 16], xd[n // 16, b, n % 16]; columns
              past N have scale 0 and integers 0
      LANES   TILES with e lane-major (_at)
      QUADS   TILES with a lane's 4 integers together: xq[n // 16, 8 b + j, n % 16, t],
              xc[n // 16, 8 b + j, n % 16]
    xq float32 for the float kernels (ROWS, TILES, LANES), int8 for the VNNI ones (ROWS,
    QUADS); xc (int32; ROWS: empty for none): weight * the sum of lane j's 4 integers. One
    body, compiled once per xq type; each layout's store loop has constant strides into a view
    of the block's place, so LLVM vectorises it."""
    k = x.shape[1]
    nb = k // QK
    cols = 1 if layout == ROWS else W
    for tile in prange(xd.shape[0] // (nb * cols)):
        for c in range(cols):
            xr, real = _tile_column(x, tile, cols, c)
            for b in range(nb):
                d, idd = activation_block_scale(xr, b * QK) if real else (F32(0.0), F32(0.0))
                xd[(tile * nb + b) * cols + c] = d
                xb = xr[b * QK:b * QK + QK]
                sums = xc[8 * (tile * nb + b) * cols + c:]  # lane 0's sum
                if layout == QUADS:
                    _q8_0_lanes(xb, idd, xq[(tile * k + b * QK) * W + 4 * c:], 4 * W, sums, W, weight)
                elif layout == ROWS:
                    dst = xq[tile * k + b * QK:]
                    for e in range(QK):
                        dst[e] = activation_q8_0(xb[e], idd)
                    for j in range(8 if xc.shape[0] else 0):  # the lane sums, read back
                        sums[j] = weight * np.int32(dst[4 * j] + dst[4 * j + 1] + dst[4 * j + 2] + dst[4 * j + 3])
                else:  # TILES, LANES: lane j at _at(its element 0), the columns between
                    for j in range(8):
                        dst = xq[(tile * k + _at(b * QK + 4 * j, nb, layout == LANES)) * W + c:]
                        for t in range(4):
                            dst[t * W] = activation_q8_0(xb[4 * j + t], idd)


@njit(cache=True, inline="always")
def _q8_k_sub_block(xs, o, iscale, dst, step, quads):
    """The integers of xs[o:o + 16] to dst[step (o + j)], or with `quads` (o a multiple of 4)
    in runs of 4 every 4 step: dst[4 step ((o + j) // 4) + (o + j) % 4] (step and quads
    constants where inlined, so the stores vectorise); their sum."""
    tot = 0
    for j in range(16):
        q = activation_q8_k(xs[o + j], iscale)
        if quads:
            dst[4 * step * ((o + j) // 4) + (o + j) % 4] = q
        else:
            dst[step * (o + j)] = q
        tot += q
    return tot


@njit(parallel=True, cache=True)
def quantize_q8_k(x, layout, xq, xd, bs):
    """x (N, K) -> its Q8_K super-blocks as quantize_row_q8_K rounds them (quants.kquants:
    activation_superblock_scale, activation_q8_k), written flat in the layout a kernel reads
    (quantize_q8_0's names):
      ROWS    xq[n, e], xd[n, i], bs[n, g]
      TILES   tiles of 16 columns: xq[n // 16, e, n % 16], xd[n // 16, i, n % 16], bs[n // 16, g, n % 16]
      QUADS   TILES with 4 consecutive integers together: xq[n // 16, e // 4, n % 16, e % 4]
    xq float32 (ROWS, TILES) or int8 (ROWS, QUADS: the VNNI kernels), xd the scale of
    super-block i, bs the sum of the integers of group g (bs's size picks groups of 16 or 32
    elements; empty for none); columns past N have scale 0 and integers 0."""
    k = x.shape[1]
    nb = k // QK_K
    cols = 1 if layout == ROWS else W
    groups = bs.shape[0] // xd.shape[0]  # sums per super-block: 16, 8 or 0
    for tile in prange(xd.shape[0] // (nb * cols)):
        for i in range(nb):  # a tile's super-block i, column by column: their stores adjacent
            for c in range(cols):
                xr, real = _tile_column(x, tile, cols, c)
                xs = xr[i * QK_K:(i + 1) * QK_K]
                d, iscale = activation_superblock_scale(xs, 0) if real else (F32(0.0), F32(0.0))
                xd[(tile * nb + i) * cols + c] = d
                sums = bs[(tile * nb + i) * groups * cols + c:]  # group g at sums[cols g]
                prev = 0
                for s in range(16):
                    if layout == ROWS:
                        tot = _q8_k_sub_block(xs, 16 * s, iscale, xq[tile * k + i * QK_K:], 1, False)
                    elif layout == QUADS:
                        tot = _q8_k_sub_block(xs, 16 * s, iscale, xq[(tile * k + i * QK_K) * W + 4 * c:], W, True)
                    else:
                        tot = _q8_k_sub_block(xs, 16 * s, iscale, xq[(tile * k + i * QK_K) * W + c:], W, False)
                    if groups == 16:
                        sums[cols * s] = tot
                    elif groups == 8 and s % 2:
                        sums[cols * (s // 2)] = prev + tot
                    prev = tot


# ---- matrix rows -----------------------------------------------------------------------------------
@njit(cache=True, inline="always")
def _u32(buf, o):
    return (np.int64(buf[o]) | (np.int64(buf[o + 1]) << 8)
            | (np.int64(buf[o + 2]) << 16) | (np.int64(buf[o + 3]) << 24))


@njit(cache=True, inline="always")
def _decode_q0_block(buf, o, block_bytes, values, w):
    """w[e] = integer of element e of the Q4_0 / Q5_0 / Q8_0 block (18 / 22 / 34 bytes) at
    buf[o] (natural order); with `values` (IQ4_NL: 18 bytes) the integer is values[nibble]."""
    if block_bytes == Q8_0_BYTES:
        for e in range(QK):
            w[e] = F32(np.int8(buf[o + 2 + e]))
    elif values.shape[0]:
        for e in range(16):
            q = np.int32(buf[o + 2 + e])
            w[e] = values[q & 0xF]
            w[e + 16] = values[q >> 4]
    elif block_bytes == Q4_0_BYTES:
        for e in range(16):
            q = np.int32(buf[o + 2 + e])
            w[e] = F32((q & 0xF) - 8)
            w[e + 16] = F32((q >> 4) - 8)
    else:
        qh = _u32(buf, o + 2)
        for e in range(16):
            q = np.int32(buf[o + 6 + e])
            w[e] = F32(((q & 0xF) | (np.int32((qh >> e) & 1) << 4)) - 16)
            w[e + 16] = F32(((q >> 4) | (np.int32((qh >> (e + 16)) & 1) << 4)) - 16)


@njit(cache=True)
def _unpack_q0_rows(buf, offs, m0, block_bytes, values, wq, wd, lane_major):
    """Rows m0.. (as many as wq has; past the last matrix row, the last again) -> wq[r, _at(e)]
    = integer of element e, wd[r, b] = d."""
    nb = wd.shape[1]
    w = np.empty(QK, dtype=np.float32)
    for r in range(wq.shape[0]):
        o0 = offs[min(m0 + r, offs.shape[0] - 1)]
        for b in range(nb):
            o = o0 + b * block_bytes
            wd[r, b] = f16_to_f32(buf[o], buf[o + 1])
            if not lane_major:
                _decode_q0_block(buf, o, block_bytes, values, wq[r, b * QK:(b + 1) * QK])
                continue
            _decode_q0_block(buf, o, block_bytes, values, w)
            for j in range(8):
                run = 4 * (j * nb + b)  # _at's place of element 4 j of block b
                for t in range(4):
                    wq[r, run + t] = w[4 * j + t]


@njit(cache=True)
def _unpack_q0_rows_u8(buf, offs, m0, block_bytes, uvalues, wu, wd):
    """Rows m0.. -> wu[r, k] = integer of element k + the type's bias (Q0Rows.bias), the bits as
    stored made unsigned (Q8_0's flipped sign bit, Q5_0's five bits, Q4_0's nibble) or, with
    `uvalues` (IQ4_NL), uvalues[nibble] (its table + its bias), wd[r, b] = d."""
    nb = wd.shape[1]
    for r in range(wu.shape[0]):
        o0 = offs[min(m0 + r, offs.shape[0] - 1)]
        dst = wu[r]
        for b in range(nb):
            o = o0 + b * block_bytes
            wd[r, b] = f16_to_f32(buf[o], buf[o + 1])
            if block_bytes == Q8_0_BYTES:
                for e in range(QK):
                    dst[b * QK + e] = buf[o + 2 + e] ^ np.uint8(0x80)
            elif uvalues.shape[0]:
                for e in range(16):
                    q = buf[o + 2 + e]
                    dst[b * QK + e] = uvalues[q & np.uint8(0xF)]
                    dst[b * QK + e + 16] = uvalues[q >> np.uint8(4)]
            elif block_bytes == Q4_0_BYTES:
                for e in range(16):
                    q = buf[o + 2 + e]
                    dst[b * QK + e] = q & np.uint8(0xF)
                    dst[b * QK + e + 16] = q >> np.uint8(4)
            else:
                qh = _u32(buf, o + 2)
                for e in range(16):
                    q = buf[o + 6 + e]
                    dst[b * QK + e] = (q & np.uint8(0xF)) | np.uint8(((qh >> e) & 1) << 4)
                    dst[b * QK + e + 16] = (q >> np.uint8(4)) | np.uint8(((qh >> (e + 16)) & 1) << 4)


@njit(cache=True)
def _unpack_q4_k_rows(buf, offs, m0, wq, wd, wdm, wmin):
    """Rows m0.. -> wq[r, k] = q * scale, wd/wdm[r, i] = d/dmin, wmin[r, s] = min (transposed
    views for a tile's column layout: wq[k, r], ...)."""
    nb = wd.shape[1]
    for r in range(wq.shape[0]):
        o0 = offs[min(m0 + r, offs.shape[0] - 1)]
        for i in range(nb):
            o = o0 + i * 144
            d, dmin = f16_to_f32(buf[o], buf[o + 1]), f16_to_f32(buf[o + 2], buf[o + 3])
            wd[r, i] = d
            wdm[r, i] = dmin
            for c in range(4):
                sc1, m1 = scale_min_k4(2 * c, buf, o + 4)
                sc2, m2 = scale_min_k4(2 * c + 1, buf, o + 4)
                wmin[r, 8 * i + 2 * c] = F32(m1)
                wmin[r, 8 * i + 2 * c + 1] = F32(m2)
                qo = o + 16 + 32 * c
                for l in range(32):
                    q = np.int32(buf[qo + l])
                    wq[r, QK_K * i + 64 * c + l] = F32((q & 0xF) * sc1)
                    wq[r, QK_K * i + 64 * c + 32 + l] = F32((q >> 4) * sc2)


@njit(cache=True)
def _unpack_q4_k_rows_u8(buf, offs, m0, wu, wsc, wd, wdm, wmin):
    """Rows m0.. -> wu[r, k] = the 4-bit integer (natural order), wsc/wmin[r, s] = sub-block
    s's scale and min, wd/wdm[r, i] = d/dmin of super-block i."""
    nb = wd.shape[1]
    for r in range(wu.shape[0]):
        o0 = offs[min(m0 + r, offs.shape[0] - 1)]
        q4_k_nibbles(buf, o0, nb, wu[r])
        for i in range(nb):
            o = o0 + i * 144
            wd[r, i] = f16_to_f32(buf[o], buf[o + 1])
            wdm[r, i] = f16_to_f32(buf[o + 2], buf[o + 3])
            for s in range(8):
                sc, m = scale_min_k4(s, buf, o + 4)
                wsc[r, 8 * i + s] = F32(sc)
                wmin[r, 8 * i + s] = F32(m)


@njit(cache=True, inline="always")
def _q6_k_value(buf, o, e):
    """Integer (-32..31) of element e of the Q6_K super-block at buf[o]."""
    h, rest = e // 128, e % 128
    g, l = rest // 32, rest % 32
    lo = (np.int32(buf[o + 64 * h + 32 * (g % 2) + l]) >> (4 * (g // 2))) & 0xF
    hi = (np.int32(buf[o + 128 + 32 * h + l]) >> (2 * g)) & 3
    return (lo | (hi << 4)) - 32


@njit(cache=True)
def _unpack_q6_k_rows(buf, offs, m0, wq, wd):
    """Rows m0.. -> wq[r, k] = q * scale of the element's sub-block, wd[r, i] = d."""
    nb = wd.shape[1]
    for r in range(wq.shape[0]):
        o0 = offs[min(m0 + r, offs.shape[0] - 1)]
        for i in range(nb):
            o = o0 + i * 210
            wd[r, i] = f16_to_f32(buf[o + 208], buf[o + 209])
            for e in range(QK_K):
                wq[r, QK_K * i + e] = F32(_q6_k_value(buf, o, e) * np.int32(np.int8(buf[o + 192 + e // 16])))


@njit(cache=True)
def _unpack_q6_k_rows_u8(buf, offs, m0, wu, wsc, wd):
    """Rows m0.. -> wu[r, k] = the 6-bit integer + 32 (its stored bits; natural order),
    wsc[r, s] = group s's scale, wd[r, i] = d. Per half of a super-block, each of 32 low-bit
    and high-bit bytes gives 4 elements 32 apart (dequantize_row_q6_K's loop; it vectorises)."""
    nb = wd.shape[1]
    for r in range(wu.shape[0]):
        o0 = offs[min(m0 + r, offs.shape[0] - 1)]
        for i in range(nb):
            o = o0 + i * 210
            wd[r, i] = f16_to_f32(buf[o + 208], buf[o + 209])
            for s in range(16):
                wsc[r, 16 * i + s] = np.int32(np.int8(buf[o + 192 + s]))
            for h in range(2):
                ql, qh = buf[o + 64 * h:o + 64 * h + 64], buf[o + 128 + 32 * h:o + 160 + 32 * h]
                dst = wu[r, QK_K * i + 128 * h:QK_K * i + 128 * h + 128]
                for l in range(32):
                    lo, hi, high = ql[l], ql[l + 32], qh[l]
                    dst[l] = (lo & np.uint8(0xF)) | ((high & np.uint8(3)) << np.uint8(4))
                    dst[l + 32] = (hi & np.uint8(0xF)) | (((high >> np.uint8(2)) & np.uint8(3)) << np.uint8(4))
                    dst[l + 64] = (lo >> np.uint8(4)) | (((high >> np.uint8(4)) & np.uint8(3)) << np.uint8(4))
                    dst[l + 96] = (hi >> np.uint8(4)) | ((high >> np.uint8(6)) << np.uint8(4))


@njit(cache=True)
def _unpack_q6_k_tile(buf, offs, m0, wu, wsc, wd):
    """Rows m0..m0 + 15 in column layout: wu[k, r] = unsigned 6-bit integer, wsc[s, r] =
    scale, wd[i, r] = d."""
    nb = wd.shape[0]
    for r in range(W):
        o0 = offs[min(m0 + r, offs.shape[0] - 1)]
        for i in range(nb):
            o = o0 + i * 210
            wd[i, r] = f16_to_f32(buf[o + 208], buf[o + 209])
            for s in range(16):
                wsc[16 * i + s, r] = F32(np.int8(buf[o + 192 + s]))
            for e in range(QK_K):
                wu[QK_K * i + e, r] = F32(_q6_k_value(buf, o, e) + 32)


# ---- products --------------------------------------------------------------------------------------
@njit(cache=True, inline="always")
def _store_column(out, res, n, m0, m_rows):
    """out[n, m0 + r] = res[r] for a gemv tile's rows inside out."""
    for r in range(min(W, m_rows - m0)):
        out[n, m0 + r] = res[r]


@njit(cache=True, inline="always")
def _store_tile(out, res, rows, m0, n0, m_rows, n_cols):
    """out[n0 + c, m0 + r] = res[16 r + c] inside out (a run of rows per column: out's rows
    are the columns)."""
    r_end = min(rows, m_rows - m0)
    for c in range(min(W, n_cols - n0)):
        dst = out[n0 + c]
        for r in range(r_end):
            dst[m0 + r] = res[W * r + c]


@njit(parallel=True, cache=True)
def _q0_gemm(buf, offs, block_bytes, values, blocks, xq, xd, out):
    """out = the Q0 product (Q4_0, Q5_0, Q8_0, IQ4_NL), in ggml's order (q0_lanes_tile, xq lane-major) or with
    `blocks` by block sums (q0_blocks_tile, xq in natural order): one kernel for both, as a
    training step takes both (the layers' products and the output layer's), compiled once."""
    m_rows, n_cols = offs.shape[0], out.shape[0]
    nb = xd.shape[1]
    group = ROW_GROUP // Q0_ROWS * Q0_ROWS  # whole tiles of rows
    for task in prange((m_rows + group - 1) // group):
        m0 = task * group
        wq = np.empty((group, nb * QK), dtype=np.float32)
        wd = np.empty((group, nb), dtype=np.float32)
        sbuf = np.empty(0 if blocks else Q0_ROWS * nb * W, dtype=np.float32)  # q0_lanes_tile's lane sums
        res = np.empty(Q0_ROWS * W, dtype=np.float32)
        _unpack_q0_rows(buf, offs, m0, block_bytes, values, wq, wd, not blocks)
        for tile in range(xq.shape[0]):
            for r in range(0, min(group, m_rows - m0), Q0_ROWS):
                if blocks:
                    q0_blocks_tile(wq, wd, xq, xd, res, r, tile, nb)
                else:
                    q0_lanes_tile(wq, wd, xq, xd, sbuf, res, r, tile, nb)
                _store_tile(out, res, Q0_ROWS, m0 + r, tile * W, m_rows, n_cols)


@njit(parallel=True, cache=True)
def _q0_gemm_vnni(buf, offs, block_bytes, uvalues, xq, xc, xd, out):
    """_q0_gemm in ggml's order with AVX512-VNNI (q0_tile2_vnni, 2 rows a step). It and
    _q0_blocks_gemm_vnni stay two drivers, unlike _q0_gemm: one with a `blocks` flag made the
    row step a run-time value and the block-sum product 1.4x slower (bench/RESULTS.md,
    fifth session)."""
    m_rows, n_cols = offs.shape[0], out.shape[0]
    nb = xd.shape[1]
    for task in prange((m_rows + ROW_GROUP - 1) // ROW_GROUP):
        m0 = task * ROW_GROUP
        wu = np.empty((ROW_GROUP, nb * QK), dtype=np.uint8)
        wd = np.empty((ROW_GROUP, nb), dtype=np.float32)
        res = np.empty(2 * W, dtype=np.float32)
        _unpack_q0_rows_u8(buf, offs, m0, block_bytes, uvalues, wu, wd)
        for tile in range(xq.shape[0]):
            for r in range(0, min(ROW_GROUP, m_rows - m0), 2):
                q0_tile2_vnni(wu, wd, xq, xc, xd, res, r, tile, nb)
                _store_tile(out, res, 2, m0 + r, tile * W, m_rows, n_cols)


@njit(parallel=True, cache=True)
def _q0_blocks_gemm_vnni(buf, offs, block_bytes, uvalues, xq, xcb, xd, out):
    m_rows, n_cols = offs.shape[0], out.shape[0]
    nb = xd.shape[1]
    for task in prange((m_rows + ROW_GROUP - 1) // ROW_GROUP):
        m0 = task * ROW_GROUP
        wu = np.empty((ROW_GROUP, nb * QK), dtype=np.uint8)
        wd = np.empty((ROW_GROUP, nb), dtype=np.float32)
        res = np.empty(BLOCK_ROWS * W, dtype=np.float32)
        _unpack_q0_rows_u8(buf, offs, m0, block_bytes, uvalues, wu, wd)
        for tile in range(xq.shape[0]):
            for r in range(0, min(ROW_GROUP, m_rows - m0), BLOCK_ROWS):
                q0_blocks_vnni(wu, wd, xq, xcb, xd, res, r, tile, nb)
                _store_tile(out, res, BLOCK_ROWS, m0 + r, tile * W, m_rows, n_cols)


@njit(parallel=True, cache=True)
def _q5_0_gemv_vnni(buf, offs, xs, xsum, xd, out):
    nb = xd.shape[1]
    for m in prange(offs.shape[0]):
        for n in range(out.shape[0]):
            out[n, m] = q5_0_row_vnni(buf, offs[m], xs[n], xsum[n], xd[n], nb)


@njit(parallel=True, cache=True)
def _q4_k_gemv_vnni(buf, offs, xq, xd, bs32, out, n_chunked):
    """xq, bs32 (quantize_q8_k's float32 rows) made the int8 / int32 the row kernels take, here:
    a few columns, so the quantizer needs no int8 form (one specialisation less to compile).
    The first n_chunked columns (groups of 4) in the gemm's order (q4_k_rows_chunks_vnni), the
    rest in the gemv's. Rows 8 at a time (the kernels'), with the next 8 rows' offsets to
    prefetch; past the last row the offsets repeat it (its results are dropped)."""
    nb = xd.shape[1]
    m_rows = offs.shape[0]
    xs = xq.astype(np.int8)
    b32 = bs32.astype(np.int32)
    for task in prange((m_rows + Q4K_GEMV_ROWS - 1) // Q4K_GEMV_ROWS):
        res = np.empty(Q4K_ROW_CALL, dtype=np.float32)
        call = np.empty(2 * Q4K_ROW_CALL, dtype=np.int64)
        for m in range(task * Q4K_GEMV_ROWS, min(m_rows, task * Q4K_GEMV_ROWS + Q4K_GEMV_ROWS), Q4K_ROW_CALL):
            for r in range(2 * Q4K_ROW_CALL):
                call[r] = offs[min(m + r, m_rows - 1)]
            for n in range(out.shape[0]):
                if n < n_chunked:
                    q4_k_rows_chunks_vnni(buf, call, 0, xs[n], xd[n], b32[n], res, nb)
                else:
                    q4_k_rows_vnni(buf, call, 0, xs[n], xd[n], b32[n], res, nb)
                for r in range(min(Q4K_ROW_CALL, m_rows - m)):
                    out[n, m + r] = res[r]


@njit(parallel=True, cache=True)
def _q6_k_gemv_vnni(buf, offs, xq, xd, bs16, out):
    """As _q4_k_gemv_vnni: the float32 rows made int8, the 16-element sums split into the even
    and odd sub-blocks' (int32) that q6_k_row_vnni takes."""
    nb = xd.shape[1]
    xs = xq.astype(np.int8)
    bse = bs16[:, 0::2].astype(np.int32)
    bso = bs16[:, 1::2].astype(np.int32)
    for m in prange(offs.shape[0]):
        for n in range(out.shape[0]):
            out[n, m] = q6_k_row_vnni(buf, offs[m], xs[n], xd[n], bse[n], bso[n], nb)


@njit(parallel=True, cache=True)
def _q8_0_gemv_vnni(buf, offs, xs, xd, out):
    """xs (N, K) int8: the columns' integers, made in place the unsigned integer + 128 that
    q8_0_row_vnni takes (bits ^ 0x80)."""
    nb = xd.shape[1]
    xu = xs.view(np.uint8)
    xu ^= np.uint8(0x80)
    for m in prange(offs.shape[0]):
        for n in range(out.shape[0]):
            out[n, m] = q8_0_row_vnni(buf, offs[m], xu[n], xd[n], nb)


@njit(parallel=True, cache=True, fastmath={"contract"})
def _q0_gemv(buf, offs, block_bytes, values, xq, xd, out):
    """Few columns (generation): a row at a time, each block decoded once for every column.
    xq (N, K): the activations' integers in natural order, xd (N, nb). Lane j of block b is
    the exact sum of the 4 products 4 j .. 4 j + 3, fma'd into lane j's chain; hsum8."""
    m_rows, n_cols = offs.shape[0], out.shape[0]
    nb = xd.shape[1]
    for task in prange((m_rows + GEMV_ROWS - 1) // GEMV_ROWS):
        w = np.empty(QK, dtype=np.float32)
        acc = np.empty((n_cols, 8), dtype=np.float32)
        for m in range(task * GEMV_ROWS, min(m_rows, task * GEMV_ROWS + GEMV_ROWS)):
            acc[:] = 0.0
            for b in range(nb):
                o = offs[m] + b * block_bytes
                _decode_q0_block(buf, o, block_bytes, values, w)
                dw = f16_to_f32(buf[o], buf[o + 1])
                for n in range(n_cols):
                    x = xq[n, b * QK:(b + 1) * QK]
                    s = dw * xd[n, b]
                    a = acc[n]
                    for j in range(8):
                        p = w[4 * j] * x[4 * j] + w[4 * j + 1] * x[4 * j + 1] + w[4 * j + 2] * x[4 * j + 2] + w[4 * j + 3] * x[4 * j + 3]
                        a[j] = fma_f32(s, p, a[j])
            for n in range(n_cols):
                a = acc[n]
                out[n, m] = hsum8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7])


@njit(parallel=True, cache=True)
def _q0_pairs_vec_dot(buf, offs, block_bytes, values, xq, xd, out):
    """One column (xq (1, K), xd (1, nb)) in ggml_vec_dot_iq4_nl_q8_0's order (x86, AVX2 and
    AVX-512 builds alike), which llama.cpp runs for a single column of a matrix it does not
    repack (llamafile's sgemm takes 2 columns and more): the blocks in pairs, the even ones
    into one chain of 8 lanes and the odd ones into another, lane j = fma(d_w * d_x, the exact
    sum of the products 4 j .. 4 j + 3, lane j); hsum8 of the two chains added lane by lane;
    a last unpaired block then added as total + (d_w * d_x) * its exact sum, each step rounded
    (no fma there: checked against ggml's kernel)."""
    m_rows = offs.shape[0]
    nb = xd.shape[1]
    x, dx = xq[0], xd[0]
    for task in prange((m_rows + GEMV_ROWS - 1) // GEMV_ROWS):
        w = np.empty(QK, dtype=np.float32)
        acc = np.empty(16, dtype=np.float32)
        for m in range(task * GEMV_ROWS, min(m_rows, task * GEMV_ROWS + GEMV_ROWS)):
            acc[:] = 0.0
            for b in range(nb - nb % 2):
                o = offs[m] + b * block_bytes
                _decode_q0_block(buf, o, block_bytes, values, w)
                s = f16_to_f32(buf[o], buf[o + 1]) * dx[b]
                xb = x[b * QK:(b + 1) * QK]
                c = 8 * (b % 2)
                for j in range(8):
                    p = w[4 * j] * xb[4 * j] + w[4 * j + 1] * xb[4 * j + 1] + w[4 * j + 2] * xb[4 * j + 2] + w[4 * j + 3] * xb[4 * j + 3]
                    acc[c + j] = fma_f32(s, p, acc[c + j])
            total = hsum8(acc[0] + acc[8], acc[1] + acc[9], acc[2] + acc[10], acc[3] + acc[11],
                          acc[4] + acc[12], acc[5] + acc[13], acc[6] + acc[14], acc[7] + acc[15])
            if nb % 2:
                o = offs[m] + (nb - 1) * block_bytes
                _decode_q0_block(buf, o, block_bytes, values, w)
                xb = x[(nb - 1) * QK:nb * QK]
                isum = F32(0.0)
                for e in range(QK):
                    isum += w[e] * xb[e]  # integers below 2^24: exact in any order
                total += F32(f16_to_f32(buf[o], buf[o + 1]) * dx[nb - 1]) * isum
            out[0, m] = total


@njit(cache=True, fastmath=INT_SUMS)
def _q4_0_block_sums(buf, o, values, x, sums):
    """sums[b] = the integer sum of the 32 products of Q4_0 (with `values`: IQ4_NL) block b of
    the row at buf[o] with x, in float32 straight from the nibbles: every partial sum is an
    integer below 2^24, exact in any order (so vectorised)."""
    half = x.shape[0] // sums.shape[0] // 2  # 16, as a run-time count: LLVM vectorises the loop then
    for b in range(sums.shape[0]):
        w = buf[o + b * Q4_0_BYTES + 2:o + b * Q4_0_BYTES + 2 + half]
        xb = x[b * QK:b * QK + QK]
        s = F32(0.0)
        if values.shape[0]:
            for j in range(half):
                q = np.int32(w[j])
                s += values[q & 0xF] * xb[j] + values[q >> 4] * xb[half + j]
        else:
            for j in range(half):
                q = np.int32(w[j])
                s += F32((q & 0xF) - 8) * xb[j] + F32((q >> 4) - 8) * xb[half + j]
        sums[b] = s


@njit(parallel=True, cache=True)
def _q4_0_gemv(buf, offs, values, xq, xd, out):
    """Few columns of ggml_gemv_q4_0_8x8_q8_0 / ggml_gemv_iq4_nl_8x8_q8_0 (the repacked Q4_0 and
    IQ4_NL, one template in ggml): per row and column, acc = fma(d_w * d_x, the block's integer
    sum, acc) over the blocks in order. xq (N, K) the activations' integers in natural order,
    xd (N, nb)."""
    m_rows, n_cols = offs.shape[0], out.shape[0]
    nb = xd.shape[1]
    for task in prange((m_rows + GEMV_ROWS - 1) // GEMV_ROWS):
        sums = np.empty(nb, dtype=np.float32)
        wd = np.empty(nb, dtype=np.float32)
        for m in range(task * GEMV_ROWS, min(m_rows, task * GEMV_ROWS + GEMV_ROWS)):
            o = offs[m]
            for b in range(nb):
                wd[b] = f16_to_f32(buf[o + b * Q4_0_BYTES], buf[o + b * Q4_0_BYTES + 1])
            for n in range(n_cols):
                _q4_0_block_sums(buf, o, values, xq[n], sums)
                acc = F32(0.0)
                for b in range(nb):
                    acc = fma_f32(wd[b] * xd[n, b], sums[b], acc)
                out[n, m] = acc


@njit(parallel=True, cache=True)
def _q4_k_gemm(buf, offs, tq, td, tbs, out, n_gemm):
    m_rows = offs.shape[0]
    nb = td.shape[1]
    for task in prange((m_rows + ROW_GROUP - 1) // ROW_GROUP):
        m0 = task * ROW_GROUP
        wq = np.empty((ROW_GROUP, nb * QK_K), dtype=np.float32)
        wd = np.empty((ROW_GROUP, nb), dtype=np.float32)
        wdm = np.empty((ROW_GROUP, nb), dtype=np.float32)
        wmin = np.empty((ROW_GROUP, nb * 8), dtype=np.float32)
        res = np.empty(Q4K_ROWS * W, dtype=np.float32)
        _unpack_q4_k_rows(buf, offs, m0, wq, wd, wdm, wmin)
        for tile in range((n_gemm + W - 1) // W):
            for r in range(0, min(ROW_GROUP, m_rows - m0), Q4K_ROWS):
                q4_k_tile(wq, wd, wdm, wmin, tq, td, tbs, res, r, tile, nb)
                _store_tile(out, res, Q4K_ROWS, m0 + r, tile * W, m_rows, n_gemm)


@njit(parallel=True, cache=True)
def _q4_k_gemm_vnni(buf, offs, tq, td, tbs, out, n_gemm):
    """_q4_k_gemm with the integer sums by AVX512-VNNI (q4_k_tile_vnni): the same numbers."""
    m_rows = offs.shape[0]
    nb = td.shape[1]
    for task in prange((m_rows + ROW_GROUP - 1) // ROW_GROUP):
        m0 = task * ROW_GROUP
        wu = np.empty((ROW_GROUP, nb * QK_K), dtype=np.uint8)
        wsc = np.empty((ROW_GROUP, nb * 8), dtype=np.float32)
        wd = np.empty((ROW_GROUP, nb), dtype=np.float32)
        wdm = np.empty((ROW_GROUP, nb), dtype=np.float32)
        wmin = np.empty((ROW_GROUP, nb * 8), dtype=np.float32)
        res = np.empty(Q4K_VNNI_ROWS * W, dtype=np.float32)
        _unpack_q4_k_rows_u8(buf, offs, m0, wu, wsc, wd, wdm, wmin)
        for tile in range((n_gemm + W - 1) // W):
            for r in range(0, min(ROW_GROUP, m_rows - m0), Q4K_VNNI_ROWS):
                q4_k_tile_vnni(wu, wsc, wd, wdm, wmin, tq, td, tbs, res, r, tile, nb)
                _store_tile(out, res, Q4K_VNNI_ROWS, m0 + r, tile * W, m_rows, n_gemm)


@njit(parallel=True, cache=True)
def _q4_k_gemm_packed_vnni(buf, offs, tq, td, tbs, out, n_gemm):
    """_q4_k_gemm_vnni's numbers with the rows read in place (q4_k_tile_packed_vnni): for few
    columns, where unpacking every row would cost more than the product."""
    m_rows = offs.shape[0]
    nb = td.shape[1]
    for task in prange((m_rows + ROW_GROUP - 1) // ROW_GROUP):
        m0 = task * ROW_GROUP
        res = np.empty(Q4K_VNNI_ROWS * W, dtype=np.float32)
        rows = np.empty(Q4K_VNNI_ROWS, dtype=np.int64)
        for r in range(0, min(ROW_GROUP, m_rows - m0), Q4K_VNNI_ROWS):
            for j in range(Q4K_VNNI_ROWS):
                rows[j] = offs[min(m0 + r + j, m_rows - 1)]
            for tile in range((n_gemm + W - 1) // W):
                q4_k_tile_packed_vnni(buf, rows, 0, tq, td, tbs, res, tile, nb)
                _store_tile(out, res, Q4K_VNNI_ROWS, m0 + r, tile * W, m_rows, n_gemm)


@njit(parallel=True, cache=True)
def _q4_k_gemv(buf, offs, xq, xd, bs32, out):
    m_rows = offs.shape[0]
    nb = xd.shape[1]
    for task in prange((m_rows + W - 1) // W):
        m0 = task * W
        wq = np.empty((nb * QK_K, W), dtype=np.float32)
        wd = np.empty((nb, W), dtype=np.float32)
        wdm = np.empty((nb, W), dtype=np.float32)
        wmin = np.empty((nb * 8, W), dtype=np.float32)
        res = np.empty(W, dtype=np.float32)
        _unpack_q4_k_rows(buf, offs, m0, wq.T, wd.T, wdm.T, wmin.T)  # the tile's rows, in column layout
        for n in range(out.shape[0]):
            q4_k_gemv_tile(wq, wd, wdm, wmin, xq, xd, bs32, res, n, nb)
            _store_column(out, res, n, m0, m_rows)


@njit(parallel=True, cache=True)
def _q6_k_tiled(buf, offs, tq, td, out):
    m_rows, n_cols = offs.shape[0], out.shape[0]
    nb = td.shape[1]
    for task in prange((m_rows + ROW_GROUP - 1) // ROW_GROUP):
        m0 = task * ROW_GROUP
        wq = np.empty((ROW_GROUP, nb * QK_K), dtype=np.float32)
        wd = np.empty((ROW_GROUP, nb), dtype=np.float32)
        res = np.empty(Q6K_ROWS * W, dtype=np.float32)
        _unpack_q6_k_rows(buf, offs, m0, wq, wd)
        for tile in range(tq.shape[0]):
            for r in range(0, min(ROW_GROUP, m_rows - m0), Q6K_ROWS):
                q6_k_tile(wq, wd, tq, td, res, r, tile, nb)
                _store_tile(out, res, Q6K_ROWS, m0 + r, tile * W, m_rows, n_cols)


@njit(parallel=True, cache=True)
def _q6_k_tiled_vnni(buf, offs, tq, tbs, td, out):
    """_q6_k_tiled with the integer sums by AVX512-VNNI (q6_k_tile_vnni): the same numbers."""
    m_rows, n_cols = offs.shape[0], out.shape[0]
    nb = td.shape[1]
    for task in prange((m_rows + ROW_GROUP - 1) // ROW_GROUP):
        m0 = task * ROW_GROUP
        wu = np.empty((ROW_GROUP, nb * QK_K), dtype=np.uint8)
        wsc = np.empty((ROW_GROUP, nb * 16), dtype=np.int32)
        wd = np.empty((ROW_GROUP, nb), dtype=np.float32)
        res = np.empty(Q6K_VNNI_ROWS * W, dtype=np.float32)
        _unpack_q6_k_rows_u8(buf, offs, m0, wu, wsc, wd)
        for tile in range(tq.shape[0]):
            for r in range(0, min(ROW_GROUP, m_rows - m0), Q6K_VNNI_ROWS):
                q6_k_tile_vnni(wu, wsc, wd, tq, tbs, td, res, r, tile, nb)
                _store_tile(out, res, Q6K_VNNI_ROWS, m0 + r, tile * W, m_rows, n_cols)


@njit(parallel=True, cache=True)
def _q6_k_vec_dot(buf, offs, xq, xd, bs16, out):
    m_rows = offs.shape[0]
    nb = xd.shape[1]
    for task in prange((m_rows + W - 1) // W):
        m0 = task * W
        wu = np.empty((nb * QK_K, W), dtype=np.float32)
        wsc = np.empty((nb * 16, W), dtype=np.float32)
        wd = np.empty((nb, W), dtype=np.float32)
        res = np.empty(W, dtype=np.float32)
        _unpack_q6_k_tile(buf, offs, m0, wu, wsc, wd)
        for n in range(out.shape[0]):
            q6_k_gemv_tile(wu, wsc, wd, xq, xd, bs16, res, n, nb)
            _store_column(out, res, n, m0, m_rows)


def _bytes(scratch, name: str, n: int) -> np.ndarray:
    """n bytes of the backend's scratch (its buffers are float32)."""
    return scratch.get(name, (n + 3) // 4).view(np.uint8)[:n]


Activations = Callable[[np.ndarray, Any], tuple[np.ndarray, ...]]  # (x, scratch) -> the kernel's operands


def _q8_0_input(n: int, k: int, layout: int, int8: bool = False, weight: int = 0) -> Activations:
    """The plan's activation step of a Q8_0-block product: x (n, k) quantized by quantize_q8_0
    in `layout` into the backend's scratch, returned as (xq, xd, xc) in the kernel's shapes
    (xc: only with a lane-sum weight)."""
    nb = k // QK
    lead, tail = ((n,), ()) if layout == ROWS else (((n + W - 1) // W,), (W,))
    cols = lead[0] * (tail[0] if tail else 1)
    q_shape = lead + ((8 * nb,) + tail + (4,) if layout == QUADS else (k,) + tail)

    def quantize(x, scratch):
        xq = _bytes(scratch, "q8_0_i8", cols * k).view(np.int8) if int8 else scratch.get("q8_0", cols * k)
        xd = scratch.get("q8_0_d", cols * nb)
        xc = scratch.get("q8_0_c", cols * nb * 8 if weight else 0).view(np.int32)
        quantize_q8_0(x, layout, xq, xd, xc, weight)
        return (xq.reshape(q_shape), xd.reshape(lead + (nb,) + tail)) + ((xc.reshape(lead + (8 * nb,) + tail),)
                                                                         if weight else ())
    return quantize


def _q8_k_input(n: int, k: int, layout: int, group: int = 0) -> Activations:
    """The plan's activation step of a Q8_K product: x (n, k) quantized by quantize_q8_k in
    `layout` into the backend's scratch, returned as (xq, xd[, bs]) in the kernel's shapes, bs
    the sums of groups of `group` elements (0: none)."""
    nb = k // QK_K
    lead, tail = ((n,), ()) if layout == ROWS else (((n + W - 1) // W,), (W,))
    size = lead[0] * (tail[0] if tail else 1)
    sums = QK_K // group * nb if group else 0
    tag = ("q8_k", "q8_k_tiles", "", "q8_k_quads")[layout]  # a Q4_K product takes two at once
    q_shape = lead + ((k // 4,) + tail + (4,) if layout == QUADS else (k,) + tail)

    def quantize(x, scratch):
        xq = _bytes(scratch, tag, size * k).view(np.int8) if layout == QUADS else scratch.get(tag, size * k)
        xd = scratch.get(tag + "_d", size * nb)
        bs = scratch.get(tag + "_bs", size * sums)
        quantize_q8_k(x, layout, xq, xd, bs)
        return (xq.reshape(q_shape), xd.reshape(lead + (nb,) + tail)) + ((bs.reshape(lead + (sums,) + tail),)
                                                                         if group else ())
    return quantize


# ---- planners (the type table's rows hold them: type_table.py) ------------------------------------
Product = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, Any], None]  # (buf, offs, x, out, scratch)


def _nothing(buf, offs, x, out, scratch) -> None:
    """The product of no columns."""


@dataclass(frozen=True)
class Q0Rows:
    """A type of 32-element blocks with an f16 scale and integers (Q4_0, Q5_0, Q8_0, IQ4_NL), as
    the Q0 kernels read its rows."""

    block_bytes: int
    bias: int  # integer + bias: VNNI's unsigned operand (the stored bits, but for a `values` type)
    repack_rows: int = 0  # ggml repacks matrices with a multiple of this many rows (Q4_0: 8), summed by blocks
    vnni_gemv: Callable[[int, int], Product] | None = None  # its own few-column VNNI kernel, planned for (n, k)
    values: tuple[int, ...] = ()  # 18-byte blocks whose nibble n is the integer values[n] (IQ4_NL), not n - 8
    pairs_vec_dot: bool = False  # ggml's vec_dot (one column, not repacked) pairs the blocks (_q0_pairs_vec_dot)


def plan_q0(rows: Q0Rows, n: int, m: int, k: int, block_sums: bool = False) -> Product:
    """The product out (n, m) = x (n, k) times the m rows at buf[offs] (ggml's sums, module
    doc), chosen once for its shape: the returned call quantizes x into the backend's
    scratch and runs one kernel, deciding nothing.

    block_sums (more than Q0_GEMV_MAX_COLS columns, else ignored): one float multiply-add per
    block of 32 and column, in place of ggml's 8 lanes of 4 products (llvmir.vnni.q0_blocks_vnni,
    or q0_blocks_tile without AVX512-VNNI: the same bits), the same integer products, float32
    rounding apart from ggml's, a column's results the same whatever columns come with it.
    For the output layer fused with the loss (linear_ce.py), which needs logits, not
    llama.cpp's bits. (Few columns keep the gemv kernels: 2-10x faster there,
    bench/quant_matmul.py.)"""
    if n == 0:
        return _nothing
    few = n <= Q0_GEMV_MAX_COLS
    block_bytes, bias = rows.block_bytes, rows.bias  # bias: makes the matrix integers unsigned
    values = np.array(rows.values, dtype=np.float32)  # the float kernels' table (empty: none)
    uvalues = (np.array(rows.values, dtype=np.int32) + bias).astype(np.uint8)  # the VNNI kernels': + bias
    # ggml repacks the Q4_0 and IQ4_NL matrices whose rows are a multiple of 8 and sums them by
    # blocks (ggml_gemm / ggml_gemv_*_8x8_q8_0), whatever the column count
    repacked = rows.repack_rows > 0 and m % rows.repack_rows == 0
    if repacked and few:
        act = _q8_0_input(n, k, ROWS)

        def run(buf, offs, x, out, scratch):
            _q4_0_gemv(buf, offs, values, *act(x, scratch), out)
    elif n == 1 and rows.pairs_vec_dot:
        act = _q8_0_input(n, k, ROWS)

        def run(buf, offs, x, out, scratch):
            _q0_pairs_vec_dot(buf, offs, block_bytes, values, *act(x, scratch), out)
    elif (block_sums or repacked) and not VNNI and not few:
        act = _q8_0_input(n, k, TILES)

        def run(buf, offs, x, out, scratch):
            _q0_gemm(buf, offs, block_bytes, values, True, *act(x, scratch), out)
    elif (block_sums or repacked) and not few:
        act = _q8_0_input(n, k, QUADS, int8=True, weight=-bias)

        def run(buf, offs, x, out, scratch):
            xq, xd, xc = act(x, scratch)
            xcb = scratch.get("q8_0_cb", xd.size).view(np.int32).reshape(xd.shape)
            np.sum(xc.reshape(xd.shape[0], -1, 8, W), axis=2, out=xcb)
            _q0_blocks_gemm_vnni(buf, offs, block_bytes, uvalues, xq, xcb, xd, out)
    elif VNNI and few and rows.vnni_gemv is not None:
        run = rows.vnni_gemv(n, k)
    elif VNNI and not few:
        act = _q8_0_input(n, k, QUADS, int8=True, weight=-bias)

        def run(buf, offs, x, out, scratch):
            xq, xd, xc = act(x, scratch)
            _q0_gemm_vnni(buf, offs, block_bytes, uvalues, xq, xc, xd, out)
    elif few:
        act = _q8_0_input(n, k, ROWS)

        def run(buf, offs, x, out, scratch):
            _q0_gemv(buf, offs, block_bytes, values, *act(x, scratch), out)
    else:
        act = _q8_0_input(n, k, LANES)

        def run(buf, offs, x, out, scratch):
            _q0_gemm(buf, offs, block_bytes, values, False, *act(x, scratch), out)
    return run


def plan_q8_0_gemv_vnni(n: int, k: int) -> Product:
    """Q8_0's few-column VNNI kernel (q8_0_row_vnni)."""
    act = _q8_0_input(n, k, ROWS, int8=True)

    def run(buf, offs, x, out, scratch):
        _q8_0_gemv_vnni(buf, offs, *act(x, scratch), out)
    return run


def plan_q5_0_gemv_vnni(n: int, k: int) -> Product:
    """Q5_0's few-column VNNI kernel (q5_0_row_vnni: the activations' sums for the bias)."""
    act = _q8_0_input(n, k, ROWS, int8=True, weight=1)

    def run(buf, offs, x, out, scratch):
        xq, xd, xsum = act(x, scratch)
        _q5_0_gemv_vnni(buf, offs, xq, xsum, xd, out)
    return run


def plan_q4_k(n: int, m: int, k: int, block_sums: bool = False) -> Product:
    """The Q4_K product in the order of ggml's repacked kernels (plan_q0's contract; block_sums
    changes nothing: these are already the fastest order)."""
    if n == 0:
        return _nothing
    n_gemm = n - n % Q4_K_GEMM_GROUP  # groups of columns in the gemm's order, the rest in the gemv's
    n_tiled = 0 if VNNI and n_gemm < Q4_K_TILE_MIN_COLS else n_gemm  # a group or two: column by column
    n_chunked = n_gemm - n_tiled  # columns of the row kernels in the gemm's order
    tiles = _q8_k_input(n_tiled, k, QUADS if VNNI else TILES, group=32)
    rest = _q8_k_input(n - n_tiled, k, ROWS, group=32)
    gemm = _q4_k_gemm
    if VNNI:
        gemm = _q4_k_gemm_vnni if n_tiled >= Q4_K_UNPACK_MIN_COLS else _q4_k_gemm_packed_vnni

    def run(buf, offs, x, out, scratch):
        if n_tiled:
            gemm(buf, offs, *tiles(x[:n_tiled], scratch), out, n_tiled)
        if n_tiled < n:
            if VNNI:
                _q4_k_gemv_vnni(buf, offs, *rest(x[n_tiled:], scratch), out[n_tiled:], n_chunked)
            else:
                _q4_k_gemv(buf, offs, *rest(x[n_tiled:], scratch), out[n_tiled:])
    return run


def plan_q6_k(n: int, m: int, k: int, block_sums: bool = False) -> Product:
    """The Q6_K product: ggml's tiled kernel from Q6_K_TILED_MIN_COLS columns, its vec_dot below
    (plan_q0's contract; block_sums changes nothing)."""
    if n == 0:
        return _nothing
    if n >= Q6_K_TILED_MIN_COLS:
        if VNNI:
            act = _q8_k_input(n, k, QUADS, group=16)

            def run(buf, offs, x, out, scratch):
                xq, xd, bs = act(x, scratch)
                _q6_k_tiled_vnni(buf, offs, xq, bs, xd, out)
        else:
            act = _q8_k_input(n, k, TILES)

            def run(buf, offs, x, out, scratch):
                _q6_k_tiled(buf, offs, *act(x, scratch), out)
    else:
        act = _q8_k_input(n, k, ROWS, group=16)
        gemv = _q6_k_gemv_vnni if VNNI else _q6_k_vec_dot

        def run(buf, offs, x, out, scratch):
            gemv(buf, offs, *act(x, scratch), out)
    return run
