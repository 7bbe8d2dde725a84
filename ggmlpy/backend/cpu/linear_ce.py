"""LINEAR_CROSS_ENTROPY and its back op on the CPU: a linear layer's product, log-softmax,
loss and gradient, a bounded chunk of the weight's rows (the classes) at a time.

Forward, per chunk of classes c0..c1: z = x~ W[c0:c1]^T with the tile products of the
unfused mul_mat(w, x) (the same tiles and activation rounding, so the same float32
logits), from W's packed rows (quantized), a converted block (F16/BF16) or a view (F32);
then each row's running max, exp-sum, first argmax and target logit (lce_fold_chunk, which
turns the block into exp(z - max)). When the plan's graph also takes the gradient in x,
the same block is accumulated into soft = sum_c exp(z_c - max) W[c], rescaled whenever a
row's max grows (as flash attention accumulates its values): dx_r = a_r soft_r / s_r -
b_r W[ids[r]] then needs no second pass over W, so a training step multiplies by W twice,
as the unfused graph does (forward and backward products), and dequantizes it once.
The gradient in W needs every row's final log-sum-exp for every class, so it takes a
second pass that recomputes each chunk's logits: dW[c] = dz_c^T x.

Memory per call: a (rows, chunk) logits block, a (chunk, K) float block of W and the rows
of x; never rows x classes (262,144 x 256 floats for one Gemma 3 training window).
"""
from __future__ import annotations

import numpy as np

from ... import convert
from ...ops_train import LCE_FIELDS, LCE_LSE
from ...tensor import Op, Tensor
from ...types import GGMLType, traits
from . import train_kernels as TK
from .gemm import GRAIN, SLICE_COLS, matmul
from .kernel_table import KernelTable, Prepared, require_f32
from .plan import Plan, Scratch
from .qmatmul import QuantMatrix, row_offsets, tile_rows

KERNELS = KernelTable()

CHUNK_BYTES = 1 << 23  # a chunk's logits block and W's float rows: about this many bytes each
# rows of x per BLAS call where softmax(z) W adds up over a chunk's classes: fixed (not per
# thread count, so results are too); 32-row calls measured 1.8x slower for 256 x 640 x 3,200
SOFT_SLICE_ROWS = 128


def _parallel(node: Tensor) -> bool:
    """Worth every thread when the product is (every graph's output layer but a toy's)."""
    w, x = (node.src[2], node.src[3]) if node.op == Op.LINEAR_CROSS_ENTROPY_BACK else node.src[:2]
    return x.nelements() * w.ne[1] >= 2 * GRAIN


def _f32_into(values: np.ndarray, type: GGMLType, out: np.ndarray) -> np.ndarray:
    """out = the float32 values of a plain-typed array (F16, BF16 bits), without temporaries."""
    if type == GGMLType.BF16:
        bits = out.view(np.uint32)
        np.copyto(bits, values)
        bits <<= 16
    else:
        np.copyto(out, values)
    return out


class WeightRows:
    """The rows of W (one per class) as float32 blocks, a chunk at a time, and the
    activations rounded as the unfused MUL_MAT rounds them for W's type: products over row
    slices of W with the existing kernels, never a float copy of the whole matrix."""

    def __init__(self, w: Tensor) -> None:
        self.type = w.type
        self.k, self.m = w.ne[0], w.ne[1]
        self.quant: QuantMatrix | None = None
        self.rows: np.ndarray | None = None
        if traits(w.type).is_quantized:
            self.quant = QuantMatrix(w.type, w.buffer, row_offsets(w)[0, 0], self.k)
            self.tile = tile_rows(self.k, self.m)  # mul_mat_q's tiles
        else:
            self.rows = w.array()[0, 0]  # (classes, K) in W's storage type
            self.tile = SLICE_COLS  # the float product's column tiles

    def chunk(self, n_rows: int) -> int:
        """Classes per chunk: whole tiles, about CHUNK_BYTES for the larger block."""
        per = CHUNK_BYTES // (4 * max(n_rows, self.k, 1))
        return max(self.tile, per // self.tile * self.tile)

    def round_activations(self, x: np.ndarray) -> None:
        """x (rows, K, C-contiguous) rounded in place as ggml rounds a product's activations."""
        if self.quant is not None:
            if self.quant.round_activations is not None and x.size:
                self.quant.round_activations(x)
        elif self.type in (GGMLType.F16, GGMLType.BF16):
            np.copyto(x, convert.round_to(x, self.type))

    def block(self, c0: int, c1: int, buf: np.ndarray) -> np.ndarray:
        """Rows c0..c1 as float32 (c1 - c0, K): a view of W when it is F32, else written into buf."""
        if self.quant is not None:
            return self.quant.dequantize_rows(c0, c1, buf)
        if self.type == GGMLType.F32:
            return self.rows[c0:c1]
        return _f32_into(self.rows[c0:c1], self.type, buf[:c1 - c0])

    def rows_at(self, idx: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out[i] = row idx[i] of W as float32."""
        if self.quant is not None:
            self.quant.dequantize(self.quant.buf, self.quant.offs[idx], out)
        elif self.type == GGMLType.F32:
            np.take(self.rows, idx, axis=0, out=out)
        else:
            _f32_into(self.rows[idx], self.type, out)
        return out

    def product(self, x: np.ndarray, wc: np.ndarray, z: np.ndarray) -> None:
        """z (rows, C) = x (rows, K) @ wc^T, cut into the unfused product's tiles."""
        if self.quant is None:
            matmul(x, wc.T, z)
            return
        t, n = self.tile, wc.shape[0]
        full = n // t * t
        if full:  # one BLAS call per tile of t classes, as mul_mat_q makes them
            tiles = wc[:full].reshape(full // t, t, self.k).swapaxes(1, 2)
            outs = np.reshape(z[:, :full], (z.shape[0], full // t, t), copy=False).swapaxes(0, 1)
            matmul(x, tiles, outs, slice_rows=None)
        if full < n:
            matmul(x, wc[full:].T, z[:, full:], slice_rows=None)


class RowInputs:
    """The per-row inputs of a call gathered into C-contiguous arrays: x as (rows, K)
    (and rounded for W's product), the label ids and weights, the rows' gradient fields."""

    def __init__(self, x: Tensor, ids: Tensor, weights: Tensor, weight_rows: WeightRows) -> None:
        self.x, self.ids, self.weights = x.array(), ids.array(), weights.array()
        self.n, self.k = x.nelements() // x.ne[0], x.ne[0]
        self.w = weight_rows
        self.id_rows = np.empty(self.n, dtype=np.int32)
        self.weight_rows = np.empty(self.n, dtype=np.float32)

    def labels(self) -> tuple[np.ndarray, np.ndarray]:
        np.copyto(self.id_rows, self.ids.reshape(-1))
        np.copyto(self.weight_rows, self.weights.reshape(-1))
        if self.n and self.id_rows.max() >= self.w.m:
            raise ValueError(f"LINEAR_CROSS_ENTROPY: label id {int(self.id_rows.max())} is not below {self.w.m} classes")
        return self.id_rows, self.weight_rows

    def inputs(self, scratch: Scratch, rounded: bool) -> np.ndarray:
        """x's rows (rows, K) in scratch; rounded for W's product when asked."""
        out = scratch.get("lce rounded inputs" if rounded else "lce inputs", self.n * self.k).reshape(self.n, self.k)
        np.copyto(out.reshape(self.x.shape), self.x)
        if rounded:
            self.w.round_activations(out)
        return out


def _chunks(w: WeightRows, n: int):
    c = w.chunk(n)
    return [(c0, min(w.m, c0 + c)) for c0 in range(0, w.m, c)], c


def _stash_key(node: Tensor) -> tuple:
    return ("linear cross-entropy softmax rows", id(node))


@KERNELS.register(Op.LINEAR_CROSS_ENTROPY, parallel=_parallel)
def _linear_cross_entropy(node: Tensor, plan: Plan) -> Prepared:
    w, x, ids, weights = node.src
    require_f32(node, x, weights)
    wr = WeightRows(w)
    inp = RowInputs(x, ids, weights, wr)
    n, k = inp.n, inp.k
    out = np.reshape(node.array(), (n, LCE_FIELDS), copy=False)
    wants_dx = any(u.op == Op.LINEAR_CROSS_ENTROPY_BACK and u.op_params[0] == 1 and u.src[1] is node
                   for u in plan.users(node))
    soft = plan.shared(_stash_key(node), (n, k)) if wants_dx else None
    chunks, c = _chunks(wr, n)
    m, zt, arg = np.empty(n, np.float32), np.empty(n, np.float32), np.empty(n, np.int64)
    s, rescale = np.empty(n, np.float64), np.empty(n, np.float64)
    scratch = plan.scratch

    def run() -> None:
        id_rows, weight_rows = inp.labels()
        xr = inp.inputs(scratch, rounded=True)
        m.fill(-np.inf)
        s.fill(0.0)
        zt.fill(0.0)
        arg.fill(0)
        if soft is not None:
            soft.fill(0.0)
        zbuf = scratch.get("lce logits", n * c)
        wbuf = scratch.get("lce weight rows", c * k).reshape(c, k)
        for c0, c1 in chunks:
            wc = wr.block(c0, c1, wbuf)
            z = zbuf[:n * (c1 - c0)].reshape(n, c1 - c0)
            wr.product(xr, wc, z)
            TK.lce_fold_chunk(z, c0, id_rows, m, s, arg, zt, rescale)
            if soft is not None:  # z now holds exp(z - max): add its rows' share of softmax(z) W
                TK.scale_rows_f32(soft, rescale)
                matmul(z, wc, soft, accumulate=True, slice_rows=SOFT_SLICE_ROWS)
        TK.lce_finish(m, s, zt, id_rows, weight_rows, arg, out)
        if soft is not None:
            TK.scale_rows_f32(soft, 1.0 / s)
    return run


@KERNELS.register(Op.LINEAR_CROSS_ENTROPY_BACK, parallel=_parallel)
def _linear_cross_entropy_back(node: Tensor, plan: Plan) -> Prepared:
    g, rows, w, x, ids, weights = node.src
    require_f32(node, g, rows, x, weights)
    wr = WeightRows(w)
    inp = RowInputs(x, ids, weights, wr)
    n, k = inp.n, inp.k
    gv, rv = g.array(), rows.array()
    grads = np.empty((n, LCE_FIELDS), np.float32)
    a, b = np.empty(n, np.float32), np.empty(n, np.float32)
    scratch = plan.scratch

    def coefficients() -> tuple[np.ndarray, np.ndarray]:
        id_rows, weight_rows = inp.labels()
        np.copyto(grads.reshape(gv.shape), gv)
        TK.lce_coefficients(grads, id_rows, weight_rows, a, b)
        return id_rows, weight_rows

    if node.op_params[0] == 1:  # dx = a soft - b W[ids], soft made by the forward step
        soft = plan.shared(_stash_key(rows), (n, k), create=False)
        dst = np.reshape(node.array(), (n, k), copy=False)

        def run_dx() -> None:
            id_rows, _ = coefficients()
            target = wr.rows_at(np.maximum(id_rows, 0), scratch.get("lce target rows", n * k).reshape(n, k))
            TK.lce_dx(a, b, soft, target, dst)
        return run_dx

    chunks, c = _chunks(wr, n)
    dst = node.array()[0, 0]  # (classes, K)
    lse = np.empty(n, np.float32)

    def run_dw() -> None:
        id_rows, _ = coefficients()
        np.copyto(lse.reshape(rv.shape[:-1]), rv[..., LCE_LSE])
        xr = inp.inputs(scratch, rounded=True)
        xp = inp.inputs(scratch, rounded=False)  # the gradient in W uses x as it is, as OUT_PROD does
        zbuf = scratch.get("lce logits", n * c)
        wbuf = scratch.get("lce weight rows", c * k).reshape(c, k)
        for c0, c1 in chunks:
            z = zbuf[:n * (c1 - c0)].reshape(n, c1 - c0)
            wr.product(xr, wr.block(c0, c1, wbuf), z)
            TK.lce_grad_chunk(z, c0, lse, id_rows, a, b)
            matmul(z.T, xp, dst[c0:c1])
    return run_dw
