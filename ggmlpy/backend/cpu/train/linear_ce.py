"""LINEAR_CROSS_ENTROPY and its back op on the CPU: a linear layer's product, log-softmax,
loss and gradient, a bounded chunk of the weight's rows (the classes) at a time.

Forward, per chunk of classes c0..c1: z = x~ W[c0:c1]^T with the products of the unfused
mul_mat(w, x), so the same float32 logits up to rounding: qexact.py's kernels on W's packed
rows for the types it serves (the activations quantized by the kernel; Q5_0 and Q8_0 with
one float multiply-add per block of 32, 1.5-1.8x faster than ggml's 8 lanes per block and
as exact, Q4_K and Q6_K in ggml's order), else the same tiles and activation rounding as
qmatmul's tile path, from W's packed rows dequantized (other quantized types), a converted
block (F16/BF16) or a view (F32);
then each row's running max, exp-sum, first argmax and target logit (lce_fold_chunk, which
turns the block into exp(z - max)). When the plan's graph also takes the gradient in x,
the same block is accumulated into soft = sum_c exp(z_c - max) W[c], rescaled whenever a
row's max grows (as flash attention accumulates its values): dx_r = a_r soft_r / s_r -
b_r W[ids[r]] then needs no second pass over W, so a training step multiplies by W twice,
as the unfused graph does (forward and backward products), and dequantizes it once: the
second product runs on W's float32 rows, or, for a quantized W and a node set to Prec.BF16
(as OUT_PROD through it can be), by bf16 dot products from tiles of its packed rows.
The gradient in W needs every row's final log-sum-exp for every class, so it takes a
second pass that recomputes each chunk's logits: dW[c] = dz_c^T x; unless every class fits
in one chunk (a small output layer), whose softmax the forward step then keeps for it.

Memory per call: a (rows, chunk) logits block, a (chunk, K) float block of W and the rows
of x; never rows x classes (262,144 x 256 floats for one Gemma 3 training window).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .... import convert
from ....ops import Prec, prec_of
from ....ops_train import LCE_FIELDS, LCE_LSE
from ....tensor import Op, Tensor
from ....types import traits
from ..plan import Plan, Scratch
from ..plan.kernel_table import KernelTable, Prepared, require_f32
from ..products import bf16dot
from ..products.gemm import GRAIN, SLICE_COLS, Matmul
from ..products.qmatmul import QuantMatrix, row_offsets, tile_rows
from ..products.type_table import cpu_type
from . import train_kernels as TK

KERNELS = KernelTable()

CHUNK_BYTES = 1 << 23  # a chunk's logits block and W's float rows: about this many bytes each
# rows of x per BLAS call where softmax(z) W adds up over a chunk's classes: fixed (not per
# thread count, so results are too); 32-row calls measured 1.8x slower for 256 x 640 x 3,200
SOFT_SLICE_ROWS = 128


def _parallel(node: Tensor) -> bool:
    """Worth every thread when the product is (every graph's output layer but a toy's)."""
    w, x = (node.src[2], node.src[3]) if node.op == Op.LINEAR_CROSS_ENTROPY_BACK else node.src[:2]
    return x.nelements() * w.ne[1] >= 2 * GRAIN


class WeightRows:
    """The rows of W (one per class) as float32 blocks, a chunk at a time, and the
    activations rounded as the unfused MUL_MAT rounds them for W's type (its record in the
    type table): products over row slices of W with the existing kernels, never a float
    copy of the whole matrix."""

    def __init__(self, w: Tensor) -> None:
        self.type = w.type
        self.cpu = cpu_type(w.type)
        self.k, self.m = w.ne[0], w.ne[1]
        self.quant: QuantMatrix | None = None
        self.rows: np.ndarray | None = None
        self.exact = self.cpu.ggml_order  # products by the table's kernels on the packed rows
        if traits(w.type).is_quantized:
            self.quant = QuantMatrix(w.type, w.buffer, row_offsets(w)[0, 0], self.k)
            self.tile = tile_rows(self.k, self.m)  # mul_mat_q's tiles
        else:
            self.rows = w.array()[0, 0]  # (classes, K) in W's storage type
            self.tile = SLICE_COLS  # the float product's column tiles
        self.f32_rows = self.rows is not None and self.rows.dtype == np.float32  # W's own rows serve as they are

    def chunk(self, n_rows: int) -> int:
        """Classes per chunk: whole tiles, about CHUNK_BYTES for the larger block, and no more
        tiles than the classes fill (a small output layer is one chunk of its own size)."""
        per = CHUNK_BYTES // (4 * max(n_rows, self.k, 1))
        return min(max(self.tile, per // self.tile * self.tile), -(-self.m // self.tile) * self.tile)

    def round_activations(self, x: np.ndarray) -> None:
        """x (rows, K, C-contiguous) rounded in place as ggml rounds a product's activations
        (left as it is for qexact's kernels, which quantize it themselves)."""
        if not self.exact and self.cpu.round_activations is not None and x.size:
            self.cpu.round_activations(x)

    def load(self, c0: int, c1: int, out: np.ndarray) -> None:
        """out = rows c0..c1 as float32 (c1 - c0, K); nothing to do when out is W's own rows (F32)."""
        if self.quant is not None:
            self.quant.dequantize_rows(c0, c1, out)
        elif not self.f32_rows:
            convert.to_f32_into(self.rows[c0:c1], self.type, out)

    def rows_at(self, idx: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out[i] = row idx[i] of W as float32."""
        if self.quant is not None:
            self.quant.dequantize(self.quant.buf, self.quant.offs[idx], out)
        elif self.f32_rows:
            np.take(self.rows, idx, axis=0, out=out)
        else:
            convert.to_f32_into(self.rows[idx], self.type, out)
        return out

    def product(self, x: np.ndarray, wc: np.ndarray, z: np.ndarray, c0: int, scratch: Scratch) -> list[Callable]:
        """z (rows, C) = x (rows, K) @ W[c0:c0 + C]^T planned as the unfused product computes
        it: qexact's kernel on the packed rows, or BLAS on wc (the rows as float32) in the
        tile path's tiles."""
        if self.exact:
            q, offs = self.quant, self.quant.offs[c0:c0 + z.shape[1]]
            exact = self.cpu.plan_product(x.shape[0], offs.shape[0], self.k, block_sums=True)
            return [lambda: exact(q.buf, offs, x, z, scratch)]
        if self.quant is None:
            return [Matmul(x, wc.T, z)]
        t, n = self.tile, wc.shape[0]
        full = n // t * t
        plans = []
        if full:  # one BLAS call per tile of t classes, as mul_mat_q makes them
            tiles = wc[:full].reshape(full // t, t, self.k).swapaxes(1, 2)
            outs = np.reshape(z[:, :full], (z.shape[0], full // t, t), copy=False).swapaxes(0, 1)
            plans.append(Matmul(x, tiles, outs, slice_rows=None))
        if full < n:
            plans.append(Matmul(x, wc[full:].T, z[:, full:], slice_rows=None))
        return plans


@dataclass
class Chunk:
    """Classes c0..c1: W's rows as float32 (a view of W, or of a block `load` fills; None
    when nothing reads them), the logits block and their product with x, planned once."""

    c0: int
    c1: int
    w: np.ndarray | None  # (c1 - c0, K)
    z: np.ndarray  # (rows, c1 - c0)
    product: list[Callable]

    def logits(self, wr: WeightRows) -> None:
        """z = x W[c0:c1]^T, W's float rows loaded into w first when anything reads them."""
        if self.w is not None:
            wr.load(self.c0, self.c1, self.w)
        for mm in self.product:
            mm()

    def add_softmax_rows(self, wr: WeightRows, soft: np.ndarray, scratch: Scratch, bf16: bool) -> Callable:
        """soft += z W[c0:c1], planned: BLAS on the float rows, or with `bf16` bf16 dot
        products over W's rows (the float block when the forward product loaded it, else
        tiles dequantized from the packed rows)."""
        if not bf16:
            return Matmul(self.z, self.w, soft, accumulate=True, slice_rows=SOFT_SLICE_ROWS)
        c0, w = self.c0, self.w
        load = (lambda r0, r1, dst: wr.load(c0 + r0, c0 + r1, dst)) if w is None else \
            (lambda r0, r1, dst: np.copyto(dst, w[r0:r1]))
        return lambda: bf16dot.product(load, self.c1 - c0, self.z, soft, scratch, accumulate=True)


def chunks(wr: WeightRows, x: np.ndarray, scratch: Scratch, logits: np.ndarray | None = None,
           float_rows: bool = False, classes: int | None = None) -> list[Chunk]:
    """W's classes in chunks of whole tiles (`classes` each, or as many as suit x's rows),
    their products with x (rows, K) planned on the backend's scratch (one logits block and,
    where the product or the caller (`float_rows`) reads W's rows as float32, one block of
    them serve every chunk), or into `logits` when given (all classes in one chunk)."""
    n, k = x.shape
    c = classes or wr.chunk(n)
    zbuf = scratch.get("lce logits", n * c) if logits is None else logits.reshape(-1)
    float_rows = float_rows or not wr.exact  # qexact's kernels read the packed rows
    wbuf = scratch.get("lce weight rows", c * k).reshape(c, k) if float_rows and not wr.f32_rows else None
    out = []
    for c0 in range(0, wr.m, c):
        c1 = min(wr.m, c0 + c)
        w = None if not float_rows else wr.rows[c0:c1] if wr.f32_rows else wbuf[:c1 - c0]
        z = zbuf[:n * (c1 - c0)].reshape(n, c1 - c0)
        out.append(Chunk(c0, c1, w, z, wr.product(x, w, z, c0, scratch)))
    return out


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

    def buffer(self, scratch: Scratch, rounded: bool) -> np.ndarray:
        """The (rows, K) block of the backend's scratch that `load` fills (x rounded or as it is)."""
        return scratch.get("lce rounded inputs" if rounded else "lce inputs", self.n * self.k).reshape(self.n, self.k)

    def load(self, out: np.ndarray, rounded: bool) -> np.ndarray:
        """x's rows into out (rows, K); rounded for W's product when asked."""
        np.copyto(out.reshape(self.x.shape), self.x)
        if rounded:
            self.w.round_activations(out)
        return out


def _stash_key(node: Tensor) -> tuple:
    return ("linear cross-entropy softmax rows", id(node))


def _probs_key(node: Tensor) -> tuple:
    return ("linear cross-entropy probabilities", id(node))


def _keeps_probs(wr: WeightRows, n: int) -> bool:
    """Whether the forward step keeps the softmax for the gradient in W: when every class fits
    in one chunk (a small output layer), which the backward would otherwise compute again."""
    return wr.m <= wr.chunk(n)


SKIP_ROWS_STEP = 32  # skipped rows leave the rest in a block of a multiple of this many (few plans per graph)


@KERNELS.register(Op.LINEAR_CROSS_ENTROPY, parallel=_parallel)
def _linear_cross_entropy(node: Tensor, plan: Plan) -> Prepared:
    w, x, ids, weights = node.src
    require_f32(node, x, weights)
    wr = WeightRows(w)
    inp = RowInputs(x, ids, weights, wr)
    n, k = inp.n, inp.k
    out = np.reshape(node.array(), (n, LCE_FIELDS), copy=False)
    wants = {u.op_params[0] for u in plan.users(node) if u.op == Op.LINEAR_CROSS_ENTROPY_BACK and u.src[1] is node}
    wants_dx = 1 in wants
    soft = plan.shared(_stash_key(node), (n, k)) if wants_dx else None
    probs = plan.shared(_probs_key(node), (n, wr.m)) if 0 in wants and _keeps_probs(wr, n) else None
    skip = _skips_ignored(node)
    xr = inp.buffer(plan.scratch, rounded=True)
    bf16 = wr.quant is not None and prec_of(node) == Prec.BF16
    classes = wr.chunk(n)  # the same chunks whatever rows are left: each row's sums keep their order
    planned: dict[int, tuple[list[Chunk], list[Callable]]] = {}

    def planned_for(rows: int) -> tuple[list[Chunk], list[Callable]]:
        """The products over the first `rows` rows of the buffers, planned once per count."""
        if rows not in planned:
            todo = chunks(wr, xr[:rows], plan.scratch, probs, float_rows=wants_dx and not bf16, classes=classes)
            accumulate = [c.add_softmax_rows(wr, soft[:rows], plan.scratch, bf16) for c in todo] if wants_dx else []
            planned[rows] = todo, accumulate
        return planned[rows]

    m, zt, arg = np.empty(n, np.float32), np.empty(n, np.float32), np.empty(n, np.int64)
    s, rescale = np.empty(n, np.float64), np.empty(n, np.float64)
    block = np.empty((n, LCE_FIELDS), np.float32)

    def rows_of(id_rows: np.ndarray, weight_rows: np.ndarray):
        """The rows to compute (None: all, in place) and, when some are skipped, their ids and
        weights moved to the front, the block's row count (whole steps) and the inputs moved too."""
        if not skip or probs is not None:  # one chunk of few classes: nothing worth skipping
            return None, id_rows, weight_rows, n
        live = np.flatnonzero(id_rows >= 0)
        rows = min(n, max(SKIP_ROWS_STEP, -(-len(live) // SKIP_ROWS_STEP) * SKIP_ROWS_STEP))
        if rows == n:
            return None, id_rows, weight_rows, n
        moved = xr[live]
        xr[:len(live)] = moved
        xr[len(live):rows] = 0.0
        ids_c, weights_c = np.zeros(rows, np.int32), np.zeros(rows, np.float32)
        ids_c[:len(live)], weights_c[:len(live)] = id_rows[live], weight_rows[live]
        return live, ids_c, weights_c, rows

    def run() -> None:
        id_rows, weight_rows = inp.labels()
        inp.load(xr, rounded=True)
        live, ids_c, weights_c, rows = rows_of(id_rows, weight_rows)
        todo, accumulate = planned_for(rows)
        mm, ss, zz, aa, rr = m[:rows], s[:rows], zt[:rows], arg[:rows], rescale[:rows]
        mm.fill(-np.inf)
        ss.fill(0.0)
        zz.fill(0.0)
        aa.fill(0)
        if soft is not None:
            soft[:rows].fill(0.0)
        for i, c in enumerate(todo):
            c.logits(wr)
            TK.lce_fold_chunk(c.z, c.c0, ids_c, mm, ss, aa, zz, rr)
            if soft is not None:  # z now holds exp(z - max): add its rows' share of softmax(z) W
                TK.scale_rows_f32(soft[:rows], rr)
                accumulate[i]()
        dst = out if live is None else block[:rows]
        TK.lce_finish(mm, ss, zz, ids_c, weights_c, aa, dst)
        np.divide(1.0, ss, out=rr)
        if soft is not None:
            TK.scale_rows_f32(soft[:rows], rr)
        if probs is not None:  # the one chunk's exp(z - max) becomes softmax(z)
            TK.scale_rows_f32(probs, rr)
        if live is not None:  # each computed row back in its place, the skipped ones zero
            out.fill(0.0)
            out[live] = block[:len(live)]
            if soft is not None:
                kept = soft[:len(live)].copy()
                soft.fill(0.0)
                soft[live] = kept
        elif skip:
            ignored = id_rows < 0
            out[ignored] = 0.0
            if soft is not None:
                soft[ignored] = 0.0
    return run


def _skips_ignored(node: Tensor) -> bool:
    """Whether a LINEAR_CROSS_ENTROPY node leaves out its rows with a negative id."""
    return len(node.op_params) > 1 and bool(node.op_params[1])


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

    skip = _skips_ignored(rows)

    def coefficients() -> tuple[np.ndarray, np.ndarray]:
        id_rows, weight_rows = inp.labels()
        np.copyto(grads.reshape(gv.shape), gv)
        TK.lce_coefficients(grads, id_rows, weight_rows, a, b)
        if skip:  # a skipped row's fields are constants: no gradient
            a[id_rows < 0] = 0.0
        return id_rows, weight_rows

    if node.op_params[0] == 1:  # dx = a soft - b W[ids], soft made by the forward step
        soft = plan.shared(_stash_key(rows), (n, k), create=False)
        dst = np.reshape(node.array(), (n, k), copy=False)
        target = scratch.get("lce target rows", n * k).reshape(n, k)
        label_rows = np.empty(n, np.int64)

        def run_dx() -> None:
            id_rows, _ = coefficients()
            np.maximum(id_rows, 0, out=label_rows)
            TK.lce_dx(a, b, soft, wr.rows_at(label_rows, target), dst)
        return run_dx

    xr, xp = inp.buffer(scratch, rounded=True), inp.buffer(scratch, rounded=False)
    dst = node.array()[0, 0]  # (classes, K)
    if _keeps_probs(wr, n):  # dW = (a softmax - b onehot)^T x from the softmax the forward step kept
        probs = plan.shared(_probs_key(rows), (n, wr.m), create=False)
        dw_kept = Matmul(probs.T, xp, dst)

        def run_dw_kept() -> None:
            id_rows, _ = coefficients()
            inp.load(xp, rounded=False)
            TK.lce_grad_probs(probs, id_rows, a, b)
            dw_kept()
        return run_dw_kept

    todo = chunks(wr, xr, scratch)
    # the gradient in W uses x as it is (as OUT_PROD does), the logits x rounded for W
    dw = [Matmul(c.z.T, xp, dst[c.c0:c.c1]) for c in todo]
    lse = np.empty(n, np.float32)

    def run_dw() -> None:
        id_rows, _ = coefficients()
        np.copyto(lse.reshape(rv.shape[:-1]), rv[..., LCE_LSE])
        if skip:  # a skipped row's lse field is 0, not its logits' lse: exp(z - inf) keeps its row 0
            lse[id_rows < 0] = np.inf
        inp.load(xr, rounded=True)
        inp.load(xp, rounded=False)
        for c, product in zip(todo, dw):
            c.logits(wr)
            TK.lce_grad_chunk(c.z, c.c0, lse, id_rows, a, b)
            product()
    return run_dw
