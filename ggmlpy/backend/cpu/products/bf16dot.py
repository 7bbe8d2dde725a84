"""Products through a matrix W given by rows, out (N, K) [+]= G (N, M) @ W (M, K), by bf16
dot products: the backward passes through frozen quantized weights (OUT_PROD of a quantized
W, the gradient of mul_mat(W, x) in x) and softmax(z) W in the fused output layer.

Both operands are rounded to bfloat16 (to nearest even, ggml's conversion): 8 significant
bits, about what ggml's quantized forward products keep of their activations (8-bit integers
per block of 32). Their products are exact in float32, and every output element sums them in
float32 in one fixed order (out's value if it accumulates, then the pairs of W's rows, first
to last), so results depend on neither threads nor tiles. AVX512-BF16's vdpbf16ps does 32
multiply-adds per instruction, twice float32 FMA.

W is loaded a tile of rows at a time (its type's dequantizer, into a float32 scratch) and
packed as pairs of rows, the instruction's layout: wp[p, k] holds rows 2p and 2p + 1 of
column k. G is packed the same way along its rows: gp[n, p] holds G[n, 2p] and G[n, 2p + 1].
Without AVX512-BF16 (or with GGMLPY_NO_BF16=1), the same rounded operands go through BLAS:
the same numbers up to float32 summation order.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numba import njit, prange

from .... import convert
from ....llvmir.bf16 import BF16, tile
from ....types import GGMLType
from ..plan import Scratch
from .gemm import matmul

LANES = 16           # float32 lanes of one vector (16 columns of out)
TILE_COLS = 4        # vectors of columns per micro-tile (64 columns)
TILE_ROWS = 6        # rows of out per micro-tile: 24 accumulators in registers
TILE_BYTES = 1 << 20  # W's packed pairs per tile of rows: about this many bytes

LoadRows = Callable[[int, int, np.ndarray], object]


# ---- packing --------------------------------------------------------------------------------------
@njit(cache=True, inline="always")
def _bf16_bits(x):
    """bfloat16 bits of a float32 (to nearest even; NaNs kept quiet), in the low 16 bits
    (branch-free, so that loops of it vectorise)."""
    u = np.uint32(np.float32(x).view(np.uint32))
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    quiet = (u >> np.uint32(16)) | np.uint32(64)
    return quiet if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000) else rounded


@njit(cache=True, inline="always")
def _pair(lo, hi):
    return _bf16_bits(lo) | (_bf16_bits(hi) << np.uint32(16))


@njit(parallel=True, cache=True)
def pack_row_pairs(rows, n_rows, wp):
    """wp[p, k] = bf16 of rows[2p, k] | bf16 of rows[2p + 1, k] << 16, for the first n_rows
    rows (a missing last row of a pair is zero)."""
    for p in prange(n_rows // 2):
        lo, hi, dst = rows[2 * p], rows[2 * p + 1], wp[p]
        for k in range(wp.shape[1]):
            dst[k] = _pair(lo[k], hi[k])
    if n_rows % 2:
        lo, dst = rows[n_rows - 1], wp[n_rows // 2]
        for k in range(wp.shape[1]):
            dst[k] = _bf16_bits(lo[k])


@njit(parallel=True, cache=True)
def pack_col_pairs(g, gp):
    """gp[n, p] = bf16 of g[n, 2p] | bf16 of g[n, 2p + 1] << 16 (g: any strides; the
    gradients and logits blocks it gets have contiguous rows); rows of gp past g's and a
    missing last column of a pair are zero."""
    n_rows, m = g.shape
    half = m // 2
    gp[n_rows:, :] = 0
    for n in prange(n_rows):
        src, dst = g[n], gp[n]
        for p in range(half):
            dst[p] = _pair(src[2 * p], src[2 * p + 1])
        if m % 2:
            dst[half] = _bf16_bits(src[m - 1])


# ---- the micro-tiles (LLVM vector code: ggmlpy/llvmir/bf16.py) ---------------------------------------
_tile_wide = tile(TILE_ROWS, TILE_COLS)  # 64 columns
_tile_narrow = tile(TILE_ROWS, 1)        # the last columns, 16 at a time


@njit(cache=True, inline="always")
def _load(res, out, t0, k0, width, n_rows, accumulate):
    """res = the tile of out (or zeros): the sums go on from there, so W's tiles of rows add
    up in the same order as one tile would."""
    for t in range(TILE_ROWS):
        for j in range(width):
            res[t * width + j] = out[t0 + t, k0 + j] if accumulate and t0 + t < n_rows else 0.0


@njit(cache=True, inline="always")
def _store(res, out, t0, k0, width, n_rows):
    for t in range(min(TILE_ROWS, n_rows - t0)):
        for j in range(width):
            out[t0 + t, k0 + j] = res[t * width + j]


@njit(parallel=True, cache=True)
def _product(wp, gp, p0, out, n_rows, accumulate):
    """out[:n_rows] (+)= G[:, 2 p0:..] @ W over wp's pairs, a task per 64 (then 16) columns."""
    k = out.shape[1]
    wide = k // (LANES * TILE_COLS)
    narrow = (k - wide * LANES * TILE_COLS) // LANES
    n_pairs = wp.shape[0]
    for task in prange(wide + narrow):
        res = np.empty(TILE_ROWS * TILE_COLS * LANES, dtype=np.float32)
        for t0 in range(0, n_rows, TILE_ROWS):
            if task < wide:
                k0 = task * LANES * TILE_COLS
                _load(res, out, t0, k0, LANES * TILE_COLS, n_rows, accumulate)
                _tile_wide(wp, gp, res, t0, k0, p0, n_pairs)
                _store(res, out, t0, k0, LANES * TILE_COLS, n_rows)
            else:
                k0 = wide * LANES * TILE_COLS + (task - wide) * LANES
                _load(res, out, t0, k0, LANES, n_rows, accumulate)
                _tile_narrow(wp, gp, res, t0, k0, p0, n_pairs)
                _store(res, out, t0, k0, LANES, n_rows)


# ---- products --------------------------------------------------------------------------------------
def tile_pairs(k: int, m: int) -> int:
    """Pairs of W's rows per tile: about TILE_BYTES packed, at least 8, at most all."""
    return max(1, min((m + 1) // 2, max(8, TILE_BYTES // (4 * max(k, 1)))))


def product(load_rows: LoadRows, m: int, g: np.ndarray, out: np.ndarray, scratch: Scratch,
            accumulate: bool = False) -> np.ndarray:
    """out (N, K) (+)= g (N, M) @ W (M, K) with both operands rounded to bf16, W's rows r0..r1
    written as float32 into a (r1 - r0, K) array by load_rows(r0, r1, dst)."""
    n, k = out.shape
    if n == 0:
        return out
    if m == 0:
        if not accumulate:
            out[...] = 0
        return out
    if not (BF16 and k % LANES == 0 and out.strides[1] == 4):
        return _product_blas(load_rows, m, g, out, scratch, accumulate)
    pairs = tile_pairs(k, m)
    rows = scratch.get("bf16 rows", 2 * pairs * k).reshape(2 * pairs, k)
    wp = scratch.get("bf16 row pairs", pairs * k).view(np.uint32).reshape(pairs, k)
    n_pad = -(-n // TILE_ROWS) * TILE_ROWS
    gp = scratch.get("bf16 column pairs", n_pad * ((m + 1) // 2)).view(np.uint32).reshape(n_pad, (m + 1) // 2)
    pack_col_pairs(g, gp)
    for r0 in range(0, m, 2 * pairs):
        r1 = min(m, r0 + 2 * pairs)
        load_rows(r0, r1, rows[:r1 - r0])
        tile = wp[:(r1 - r0 + 1) // 2]
        pack_row_pairs(rows, r1 - r0, tile)
        _product(tile, gp, r0 // 2, out, n, accumulate or r0 > 0)
    return out


def _product_blas(load_rows: LoadRows, m: int, g: np.ndarray, out: np.ndarray, scratch: Scratch,
                  accumulate: bool) -> np.ndarray:
    """The same rounded operands through BLAS (CPUs without AVX512-BF16)."""
    k = out.shape[1]
    rows_per_tile = 2 * tile_pairs(k, m)
    rows = scratch.get("bf16 rows", rows_per_tile * k).reshape(rows_per_tile, k)
    gr = convert.round_to(np.ascontiguousarray(g, dtype=np.float32), GGMLType.BF16)
    for r0 in range(0, m, rows_per_tile):
        r1 = min(m, r0 + rows_per_tile)
        tile = rows[:r1 - r0]
        load_rows(r0, r1, tile)
        np.copyto(tile, convert.round_to(tile, GGMLType.BF16))
        matmul(gr[:, r0:r1], tile, out, accumulate=accumulate or r0 > 0)
    return out
