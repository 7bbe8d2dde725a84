"""Products with a block-quantized matrix, computed from the packed blocks.

A product takes the kernel its type's record (type_table.py) plans for its shape, when
there is one: Q4_0, Q5_0, Q8_0, Q4_K and Q6_K matrices (Gemma 3's and most Q4_K_M models')
through qexact.py, which sums as llama.cpp's x86 kernels do, bit for bit; Q5_K with a few
activation columns (generation) through qdot.py's integer dot products on the blocks. Each
product's kernel is chosen when its plan is prepared (plan_mul_mat_q), never per call.
Every other product:

A quantized matrix W (M rows of K elements, as ggml stores weights) is never expanded
whole: a tile of rows is dequantized into a small float32 scratch (about TILE_BYTES)
by the type's numba kernel, in parallel over the tile's rows, and multiplied with BLAS
against all columns of the other operand, so the dequantization cost is shared by the
whole batch and memory stays bounded.

  mul_mat_q:  out (N, M) = X~ (N, K) @ W^T     ggml_mul_mat(W, x); X~ is X rounded as ggml
                                               rounds activations (quantized to the type's
                                               vec_dot_type: Q8_0, Q8_1 or Q8_K)
  mul_mat_qt: out (N, K) = G (N, M) @ W        the transposed product (ggml_out_prod(W, g)),
                                               e.g. the gradient of mul_mat w.r.t. x (float32,
                                               or bf16 dot products: bf16dot.py)

Rows are addressed by byte offsets into one flat uint8 buffer, so strided and
broadcast layouts, memory-mapped files and arenas are all handled the same way.
"""
from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np

from .... import quants
from ....tensor import Tensor
from ....types import GGMLType
from ..plan import Scratch
from . import bf16dot
from .gemm import matmul
from .type_table import cpu_type

TILE_BYTES = 1 << 20


def tile_rows(k: int, m: int) -> int:
    """Rows per tile: about TILE_BYTES of float32 scratch, at least 16, at most m."""
    t = max(16, (TILE_BYTES // (4 * max(k, 1))) // 16 * 16)
    return max(1, min(m, t))


def row_offsets(t: Tensor) -> np.ndarray:
    """Byte offset of each row of t in t.buffer: int64 array of shape (ne3, ne2, ne1)."""
    ne, nb = t.ne, t.nb
    i3 = np.arange(ne[3], dtype=np.int64)[:, None, None] * nb[3]
    i2 = np.arange(ne[2], dtype=np.int64)[None, :, None] * nb[2]
    i1 = np.arange(ne[1], dtype=np.int64)[None, None, :] * nb[1]
    return t.offset + i3 + i2 + i1


class QuantMatrix:
    """Rows of a quantized matrix: `type`, K elements per row, row r at buf[offs[r]]."""

    __slots__ = ("type", "buf", "offs", "k", "dequantize", "round_activations")

    def __init__(self, type: GGMLType, buf: np.ndarray, offs: np.ndarray, k: int) -> None:
        self.type = GGMLType(type)
        self.buf = quants.flat_buffer(buf)
        self.offs = np.ascontiguousarray(offs, dtype=np.int64).reshape(-1)
        self.k = int(k)
        self.dequantize = quants.kernels(self.type).dequantize
        self.round_activations = cpu_type(self.type).round_activations

    @classmethod
    def from_bytes(cls, type: GGMLType, rows: np.ndarray, k: int) -> "QuantMatrix":
        """From a C-contiguous (M, row bytes) uint8 array."""
        rows = np.ascontiguousarray(rows, dtype=np.uint8)
        return cls(type, rows.reshape(-1), np.arange(rows.shape[0], dtype=np.int64) * rows.shape[1], k)

    @property
    def m(self) -> int:
        return self.offs.shape[0]

    def dequantize_rows(self, r0: int, r1: int, out: np.ndarray) -> np.ndarray:
        """Rows r0..r1 as float32, written into (and returned as) out[:r1 - r0]."""
        dst = out[: r1 - r0]
        self.dequantize(self.buf, self.offs[r0:r1], dst)
        return dst


def _tiles(w: QuantMatrix, scratch: Scratch, tiles: int = 1) -> tuple[int, np.ndarray]:
    """Rows per tile and room for `tiles` dequantized tiles in the backend's scratch."""
    t = tile_rows(w.k, w.m)
    return t, scratch.get("tile", tiles * t * w.k).reshape(tiles * t, w.k)


ProductQ = Callable[[np.ndarray, np.ndarray, Scratch], None]  # (x, out, scratch)


def plan_mul_mat_q(w: QuantMatrix, n: int) -> ProductQ:
    """The product out[n, m] = sum_k x~[n, k] * W[m, k] (x: (n, K) float32, out: (n, M)
    float32 view) for n columns, chosen once: the returned call decides nothing.

    x~ is x rounded as ggml-cpu rounds the activations of the product (quantized to W's
    vec_dot_type and back: exactly the values its integer dot products use), written
    into `scratch` (the backend's; tiles go there too); x is left unchanged. Where the type
    table plans a kernel on the packed rows for this shape (CpuType.plan_product), that
    kernel; otherwise the tiles below.

    Tiles are dequantized one group at a time, a tile per thread, and each tile's product
    is one whole BLAS call: the result is the same for any thread count and the float
    rounding of every product is that of an unsliced (N, K) x (K, tile) GEMM."""
    packed = cpu_type(w.type).plan_product(n, w.m, w.k)  # the type table's kernel on the packed rows
    if packed is not None:
        return lambda x, out, scratch: packed(w.buf, w.offs, x, out, scratch)
    return lambda x, out, scratch: _mul_mat_tiles(w, x, out, scratch)


def _mul_mat_tiles(w: QuantMatrix, x: np.ndarray, out: np.ndarray, scratch: Scratch) -> None:
    group = max(1, numba.get_num_threads())
    t, tiles_buf = _tiles(w, scratch, group)
    if w.round_activations is not None and x.size:
        n = x.shape[0] * x.shape[1]
        xr = scratch.get("activations", n).reshape(x.shape)
        np.copyto(xr, x)
        w.round_activations(xr)
        x = xr
    n_full = w.m // t
    for r0 in range(0, n_full * t, group * t):
        g = min(group, n_full - r0 // t)
        tiles = w.dequantize_rows(r0, r0 + g * t, tiles_buf).reshape(g, t, w.k)
        outs = np.reshape(out[:, r0:r0 + g * t], (out.shape[0], g, t), copy=False).swapaxes(0, 1)
        matmul(x, tiles.swapaxes(1, 2), outs, slice_rows=None)
    if n_full * t < w.m:
        r0 = n_full * t
        tile = w.dequantize_rows(r0, w.m, tiles_buf)
        matmul(x, tile.T, out[:, r0:], slice_rows=None)


def mul_mat_q(w: QuantMatrix, x: np.ndarray, out: np.ndarray, scratch: Scratch | None = None) -> np.ndarray:
    """plan_mul_mat_q's product for these operands, chosen and run at once (a one-off product;
    a graph's nodes choose theirs when the plan is prepared)."""
    plan_mul_mat_q(w, x.shape[0])(x, out, scratch or Scratch())
    return out


# rows of G per BLAS call in mul_mat_qt: 1.24-1.28x faster than gemm's 16 on the shapes of a
# Gemma 3 window (bench/RESULTS.md, eighth session), and still fixed (a row's result is the
# same for any thread count and any ubatch of a multiple of 64 rows). Only backward passes
# take this product, and their gradients sum over the ubatch's tokens anyway.
BACKWARD_SLICE_ROWS = 64


def mul_mat_qt(w: QuantMatrix, g: np.ndarray, out: np.ndarray, scratch: Scratch | None = None,
               bf16: bool = False) -> np.ndarray:
    """out[n, k] = sum_m g[n, m] * W[m, k]  (g: (N, M) float32, out: (N, K) float32), from
    tiles of W's rows dequantized from their blocks: through BLAS in float32, or with `bf16`
    by bf16 dot products (bf16dot.py)."""
    scratch = scratch or Scratch()
    if bf16:
        return bf16dot.product(lambda r0, r1, dst: w.dequantize_rows(r0, r1, dst), w.m, g, out, scratch)
    t, tile_buf = _tiles(w, scratch)
    for r0 in range(0, w.m, t):
        r1 = min(w.m, r0 + t)
        tile = w.dequantize_rows(r0, r1, tile_buf)
        matmul(g[:, r0:r1], tile, out, accumulate=r0 > 0, slice_rows=BACKWARD_SLICE_ROWS)
    if w.m == 0:
        out[...] = 0
    return out


def get_rows_q(w: QuantMatrix, idx: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[i] = row idx[i] of W as float32 (out: C-contiguous (len(idx), K))."""
    offs = w.offs[np.asarray(idx, dtype=np.int64).reshape(-1)]
    w.dequantize(w.buf, offs, out)
    return out
