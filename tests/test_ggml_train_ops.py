"""CPU kernels of ggmlpy's training ops against plain float64 numpy references.

Same conventions as test_ggml_ops.py (whose helpers are reused): each reference is written
from ggml's definition of the op, inputs are float32, the reference evaluates in float64,
inputs also come through NON-CONTIGUOUS views (`make` layouts contig/perm/trans/pad), and
|got - ref| <= RTOL * scale element-wise, where `scale` holds the float32 computation's
unavoidable error terms (noted per test when it is not |ref|).

Covered: sum, sum_rows, mean, repeat, repeat_back, acc, out_prod, argmax, count_equal,
add_inplace, cross_entropy_loss(_back), rms_norm_back, soft_max_ext_back, rope_back,
silu_back, gelu_back, get_rows_back, opt_step_adamw, opt_step_sgd.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from test_ggml_ops import (
    F32_EPS,
    LAYOUTS,
    RTOL,
    _gelu_ref,
    assert_close,
    bcast_tile,
    make,
    randn,
    rope_angles,
    rope_ref,
    run,
)

import ggmlpy as gg
from ggmlpy import GGMLType as T


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(4321)


def shape_of(ne) -> gg.Tensor:
    """A data-less tensor that only carries a shape (numpy order), as repeat/repeat_back's target."""
    return gg.Tensor(T.F32, tuple(ne[::-1]))


def tiles_sum(x: np.ndarray, small) -> np.ndarray:
    """The tiles of x (each dim a multiple of small's) summed: ggml's repeat_back."""
    shape = []
    for big, n in zip(x.shape, small):
        shape += [big // n, n]
    return x.reshape(shape).sum(axis=(0, 2, 4, 6))


def softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# ---- reductions ----------------------------------------------------------------------------------
RED_SHAPES = {"4d": (2, 3, 5, 40), "one_row": (1, 1, 1, 17), "col": (1, 3, 7, 1)}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", RED_SHAPES.values(), ids=RED_SHAPES.keys())
def test_sum(rng, shape, layout):
    x = randn(rng, shape, 2.0, 0.3)
    ctx = gg.Context()
    out = gg.sum(ctx, make(ctx, x, layout))
    assert out.ne == (1, 1, 1, 1)
    x64 = x.astype(np.float64)
    # accumulated in double, rounded once to float32 (+ a double-rounding term on sum|x|)
    assert_close(run(out), np.full((1, 1, 1, 1), x64.sum()), np.abs(x64.sum()) + 1e-6 * np.abs(x64).sum())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", RED_SHAPES.values(), ids=RED_SHAPES.keys())
@pytest.mark.parametrize("op", ["sum_rows", "mean"])
def test_sum_rows_and_mean(rng, op, shape, layout):
    x = randn(rng, shape, 2.0, 0.3)
    ctx = gg.Context()
    out = getattr(gg, op)(ctx, make(ctx, x, layout))
    assert out.ne == (1,) + tuple(shape[::-1][1:])
    x64 = x.astype(np.float64)
    n = 1 if op == "sum_rows" else shape[-1]
    ref = x64.sum(axis=-1, keepdims=True) / n
    assert_close(run(out), ref, np.abs(ref) + 1e-6 * np.abs(x64).sum(axis=-1, keepdims=True) / n)


# ---- repeat / repeat_back ----------------------------------------------------------------------------
# (small numpy shape, tiled numpy shape)
TILINGS = {
    "identity": ((2, 3, 4, 5), (2, 3, 4, 5)),
    "rows": ((1, 1, 1, 8), (2, 3, 4, 8)),
    "per_dim2_scalar": ((1, 3, 1, 1), (2, 3, 4, 16)),
    "every_dim": ((2, 1, 3, 5), (4, 3, 6, 10)),
    "scalar": ((1, 1, 1, 1), (2, 2, 2, 3)),
    "dim0_only": ((1, 1, 4, 6), (1, 1, 4, 24)),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tiling", TILINGS.values(), ids=TILINGS.keys())
def test_repeat(rng, tiling, layout):
    small, big = tiling
    x = randn(rng, small)
    ctx = gg.Context()
    out = gg.repeat(ctx, make(ctx, x, layout), shape_of(big))
    assert out.ne == big[::-1]
    np.testing.assert_array_equal(run(out), bcast_tile(x, big))  # a copy: bit for bit


def test_repeat_tiles_rather_than_stretches():
    """ggml's repeat puts whole copies side by side: [a b] -> [a b a b], not [a a b b]."""
    ctx = gg.Context()
    x = np.array([[[[1.0, 2.0]]]], np.float32)
    np.testing.assert_array_equal(run(gg.repeat(ctx, ctx.from_numpy(x), shape_of((1, 1, 1, 4))))[0, 0, 0], [1, 2, 1, 2])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tiling", TILINGS.values(), ids=TILINGS.keys())
def test_repeat_back(rng, tiling, layout):
    small, big = tiling
    x = randn(rng, big)
    ctx = gg.Context()
    out = gg.repeat_back(ctx, make(ctx, x, layout), shape_of(small))
    assert out.ne == small[::-1]
    x64 = x.astype(np.float64)
    # float32 accumulation over the tiles: the bound is the sum of |terms| per result
    assert_close(run(out), tiles_sum(x64, small), tiles_sum(np.abs(x64), small))


def test_repeat_back_is_the_adjoint_of_repeat(rng):
    """<repeat(a), g> == <a, repeat_back(g)>."""
    small, big = TILINGS["every_dim"]
    a, g = randn(rng, small), randn(rng, big)
    ctx = gg.Context()
    ra = run(gg.repeat(ctx, ctx.from_numpy(a), shape_of(big))).astype(np.float64)
    rg = run(gg.repeat_back(ctx, ctx.from_numpy(g), shape_of(small))).astype(np.float64)
    assert np.sum(ra * g) == pytest.approx(np.sum(a * rg), rel=1e-6)


# ---- acc ------------------------------------------------------------------------------------------------
def acc_ref(a: np.ndarray, b: np.ndarray, nb1: int, nb2: int, nb3: int, offset: int) -> np.ndarray:
    """a (contiguous) with b added at byte offset + i0*4 + i1*nb1 + i2*nb2 + i3*nb3."""
    out = a.astype(np.float64).reshape(-1).copy()
    i3, i2, i1, i0 = np.indices(b.shape)
    pos = (offset + i0 * 4 + i1 * nb1 + i2 * nb2 + i3 * nb3) // 4
    assert len(np.unique(pos)) == pos.size, "windows must not overlap themselves"
    out[pos.reshape(-1)] += b.astype(np.float64).reshape(-1)
    return out.reshape(a.shape)


# name -> (a numpy shape, b numpy shape, strides (nb1, nb2, nb3) and offset as functions of a's nb)
ACC_CASES = {
    "2d_window_row1_col2": ((1, 1, 6, 10), (1, 1, 3, 4), lambda nb: (nb[1], nb[2], nb[3], nb[1] + 2 * nb[0])),
    "every_other_row": ((2, 3, 6, 10), (2, 2, 3, 4), lambda nb: (2 * nb[1], nb[2], nb[3], nb[2] + nb[0])),
    "dims_2_3_strided": ((3, 4, 4, 8), (2, 2, 2, 3), lambda nb: (nb[1], 2 * nb[2], nb[3], nb[3] + 5 * nb[0])),
    "flat_rows_of_a_1d": ((1, 2, 3, 10), (1, 1, 4, 5), lambda nb: (12 * nb[0], 0, 0, 3 * nb[0])),
    "whole": ((2, 3, 4, 5), (2, 3, 4, 5), lambda nb: (nb[1], nb[2], nb[3], 0)),
}


@pytest.mark.parametrize("b_layout", LAYOUTS)
@pytest.mark.parametrize("case", ACC_CASES.values(), ids=ACC_CASES.keys())
def test_acc(rng, case, b_layout):
    a_shape, b_shape, strides = case
    a, b = randn(rng, a_shape), randn(rng, b_shape)
    ctx = gg.Context()
    at = ctx.from_numpy(a)
    nb1, nb2, nb3, offset = strides(at.nb)
    out = gg.acc(ctx, at, make(ctx, b, b_layout), nb1, nb2, nb3, offset)
    assert out.ne == at.ne
    got = run(out)
    # one float32 addition per element: correctly rounded
    assert_close(got, acc_ref(a, b, nb1, nb2, nb3, offset), rtol=F32_EPS / 2)
    np.testing.assert_array_equal(at.array(), a)  # a itself is left alone


def test_acc_rejects_a_window_past_the_end():
    ctx = gg.Context()
    a = ctx.from_numpy(np.zeros((4, 6), np.float32))
    with pytest.raises(ValueError):
        gg.acc(ctx, a, ctx.from_numpy(np.zeros((2, 3), np.float32)), a.nb[1], a.nb[2], a.nb[3], 3 * a.nb[1] + a.nb[0] * 4)


# ---- add_inplace -----------------------------------------------------------------------------------------
def test_add_inplace_writes_into_a(rng):
    a, b = randn(rng, (2, 3, 4, 8)), randn(rng, (1, 3, 1, 8))
    ctx = gg.Context()
    at = ctx.from_numpy(a)
    out = gg.add_inplace(ctx, at, make(ctx, b, "pad"))
    assert out.view_src is at
    got = run(out)
    ref = a.astype(np.float64) + bcast_tile(b.astype(np.float64), a.shape)
    assert_close(got, ref, rtol=F32_EPS / 2)
    np.testing.assert_array_equal(at.array(), got)


# ---- out_prod --------------------------------------------------------------------------------------------
OUT_PROD_CASES = {
    # name: (a numpy shape (ne03, ne02, ne01 = j, ne00), b numpy shape (ne13, ne12, ne11 = j, ne10))
    "2d": ((1, 1, 5, 4), (1, 1, 5, 3)),
    "vectors": ((1, 1, 1, 6), (1, 1, 1, 7)),
    "batched": ((2, 3, 5, 4), (2, 3, 5, 3)),
    "bcast_dim2": ((1, 2, 5, 4), (1, 6, 5, 3)),
    "bcast_dim3": ((2, 1, 5, 4), (4, 1, 5, 3)),
    "bcast_dim2_dim3": ((2, 2, 5, 4), (4, 6, 5, 3)),
}
OUT_PROD_LAYOUTS = [("contig", "contig"), ("trans", "contig"), ("perm", "contig"), ("contig", "perm"),
                    ("pad", "trans"), ("perm", "pad")]


def out_prod_ref(a64, b64):
    """dst[i3, i2, i1, i0] = sum_j a[i3 / r3, i2 / r2, j, i0] * b[i3, i2, j, i1] (block mapping, as mul_mat)."""
    r3, r2 = b64.shape[0] // a64.shape[0], b64.shape[1] // a64.shape[1]
    a_rep = np.repeat(np.repeat(a64, r3, axis=0), r2, axis=1)  # i02 = i12 / r2
    ref = np.einsum("xyja,xyjb->xyba", a_rep, b64)
    scale = np.einsum("xyja,xyjb->xyba", np.abs(a_rep), np.abs(b64))
    return ref, scale


@pytest.mark.parametrize("layouts", OUT_PROD_LAYOUTS, ids=lambda l: "-".join(l))
@pytest.mark.parametrize("case", OUT_PROD_CASES.values(), ids=OUT_PROD_CASES.keys())
def test_out_prod(rng, case, layouts):
    a_shape, b_shape = case
    a, b = randn(rng, a_shape), randn(rng, b_shape)
    ctx = gg.Context()
    out = gg.out_prod(ctx, make(ctx, a, layouts[0]), make(ctx, b, layouts[1]))
    assert out.ne == (a_shape[3], b_shape[3], b_shape[1], b_shape[0])
    ref, scale = out_prod_ref(a.astype(np.float64), b.astype(np.float64))
    assert_close(run(out), ref, scale)


def test_out_prod_broadcast_uses_block_mapping_not_modulo(rng):
    """With b.ne2 = 3 * a.ne2, b's slices 0,1,2 pair with a's slice 0 (i12 / r2), not 0,1,0 (i12 % ne02)."""
    a, b = randn(rng, (1, 2, 5, 4)), randn(rng, (1, 6, 5, 3))
    ctx = gg.Context()
    got = run(gg.out_prod(ctx, ctx.from_numpy(a), ctx.from_numpy(b)))
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    for i12 in range(6):
        np.testing.assert_allclose(got[0, i12], b64[0, i12].T @ a64[0, i12 // 3], rtol=1e-5, atol=1e-5)
    modulo = b64[0, 1].T @ a64[0, 1]
    assert not np.allclose(got[0, 1], modulo, rtol=1e-3)


def test_out_prod_is_the_weight_gradient_of_mul_mat(rng):
    """out_prod(x, g) (x: [K, N], g: [M, N]) is dL/dW^T for y = mul_mat(W, x): sum_n x[n, k] g[n, m]."""
    x, g = randn(rng, (1, 1, 9, 6)), randn(rng, (1, 1, 9, 4))
    ctx = gg.Context()
    got = run(gg.out_prod(ctx, ctx.from_numpy(x), ctx.from_numpy(g)))  # [K=6, M=4] -> numpy (4, 6)
    ref = g[0, 0].astype(np.float64).T @ x[0, 0].astype(np.float64)
    assert_close(got[0, 0], ref, np.abs(g[0, 0]).T.astype(np.float64) @ np.abs(x[0, 0]).astype(np.float64))


# ---- argmax, count_equal --------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["contig", "trans", "pad"])
def test_argmax_first_index_on_ties(rng, layout):
    x = randn(rng, (1, 1, 9, 20))
    x[0, 0, 0, [3, 7, 15]] = 9.0            # a three-way tie for the max
    x[0, 0, 1, :] = 0.5                      # a constant row
    x[0, 0, 2, [0, 19]] = 9.0                # first and last
    x[0, 0, 3, :] = -np.inf
    x[0, 0, 3, [5, 6]] = -1e30               # ties below zero
    x[0, 0, 4, 19] = 50.0                    # the last element alone
    x[0, 0, 5] = -np.abs(x[0, 0, 5])         # all negative
    x[0, 0, 5, 11] = -1e-30
    ctx = gg.Context()
    out = gg.argmax(ctx, make(ctx, x, layout))
    assert out.type == T.I32 and out.ne == (9, 1, 1, 1)
    got = run(out)[0, 0, 0]
    np.testing.assert_array_equal(got, np.argmax(x[0, 0], axis=1))  # numpy also takes the first
    assert list(got[:6]) == [3, 0, 0, 5, 19, 11]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_count_equal(rng, layout):
    a = rng.integers(0, 3, (2, 3, 4, 10)).astype(np.int32)
    b = rng.integers(0, 3, (2, 3, 4, 10)).astype(np.int32)
    b[1, 2] = a[1, 2]
    ctx = gg.Context()
    out = gg.count_equal(ctx, make(ctx, a, layout, T.I32), make(ctx, b, "pad", T.I32))
    assert out.type == T.I64
    got = run(out)
    assert got.dtype == np.int64 and got.reshape(-1)[0] == np.count_nonzero(a == b)


def test_accuracy_from_argmax_and_count_equal(rng):
    """The accuracy pattern of ggml-opt: count_equal(argmax(logits), argmax(labels))."""
    logits = randn(rng, (1, 1, 32, 10))
    labels = np.zeros_like(logits)
    truth = rng.integers(0, 10, 32)
    truth[:12] = np.argmax(logits[0, 0, :12], axis=1)  # at least 12 right
    labels[0, 0, np.arange(32), truth] = 1.0
    ctx = gg.Context()
    out = gg.count_equal(ctx, gg.argmax(ctx, ctx.from_numpy(logits)), gg.argmax(ctx, ctx.from_numpy(labels)))
    assert run(out).reshape(-1)[0] == np.count_nonzero(np.argmax(logits[0, 0], axis=1) == truth)


# ---- cross entropy ------------------------------------------------------------------------------------------
def ce_inputs(rng, shape, kind: str, logit_offset: float = 0.0):
    logits = randn(rng, shape, 3.0, logit_offset)
    if kind == "soft":
        labels = softmax64(randn(rng, shape, 2.0)).astype(np.float32)
    else:  # one-hot; "weighted": rows scaled by weights in [0, 3), the first row ignored (all zero)
        labels = np.zeros(shape, np.float32)
        flat = labels.reshape(-1, shape[-1])
        flat[np.arange(flat.shape[0]), rng.integers(0, shape[-1], flat.shape[0])] = 1.0
        if kind == "weighted":
            flat *= rng.uniform(0.0, 3.0, (flat.shape[0], 1)).astype(np.float32)
            flat[0] = 0.0
    return logits, labels


def log_softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    mx = x.max(axis=-1, keepdims=True)
    return x - mx - np.log(np.exp(x - mx).sum(axis=-1, keepdims=True))


CE_SHAPES = {"2d": (1, 1, 6, 11), "4d": (2, 3, 4, 9)}


@pytest.mark.parametrize("layouts", [("contig", "contig"), ("perm", "contig"), ("trans", "pad"), ("pad", "perm")],
                         ids=lambda l: "-".join(l))
@pytest.mark.parametrize("kind", ["soft", "one_hot", "weighted"])
@pytest.mark.parametrize("shape", CE_SHAPES.values(), ids=CE_SHAPES.keys())
@pytest.mark.parametrize("offset", [0.0, 1000.0], ids=["centred", "large_logits"])
def test_cross_entropy_loss(rng, shape, kind, layouts, offset):
    logits, labels = ce_inputs(rng, shape, kind, offset)
    ctx = gg.Context()
    out = gg.cross_entropy_loss(ctx, make(ctx, logits, layouts[0]), make(ctx, labels, layouts[1]))
    assert out.ne == (1, 1, 1, 1)
    ls = log_softmax64(logits)
    n_rows = math.prod(shape[:-1])
    ref = -(labels * ls).sum() / n_rows
    # float32 (logit - max) carries eps/2 * |logit - max| into the log-sum-exp of each row
    v = np.abs(logits.astype(np.float64) - logits.max(axis=-1, keepdims=True))
    scale = np.abs(ref) + (np.abs(labels) * (np.abs(ls) + 1.0 + v.max(axis=-1, keepdims=True))).sum() / n_rows
    assert_close(run(out), np.full((1, 1, 1, 1), ref), scale)


@pytest.mark.parametrize("layout", ["contig", "perm", "trans", "pad"])
@pytest.mark.parametrize("shape", CE_SHAPES.values(), ids=CE_SHAPES.keys())
@pytest.mark.parametrize("d", [1.0, -0.37])
def test_cross_entropy_with_label_ids_is_the_dense_one_to_the_bit(rng, shape, layout, d):
    """Labels as ids and weights (negative id or zero weight: ignored) give the loss and the
    gradient of the dense rows weights * onehot(ids), bit for bit, on any logits layout."""
    logits, _ = ce_inputs(rng, shape, "one_hot", 10.0)
    n_rows = math.prod(shape[:-1])
    ids = rng.integers(0, shape[-1], n_rows).astype(np.int32)
    weights = rng.uniform(0.0, 3.0, n_rows).astype(np.float32)
    ids[0], weights[1] = -1, 0.0
    dense = np.zeros((n_rows, shape[-1]), np.float32)
    keep = ids >= 0
    dense[np.flatnonzero(keep), ids[keep]] = weights[keep]
    rows = shape[:-1][::-1] + (1,)  # ne of the ids: one per logits row
    results = []
    for sparse in (True, False):
        ctx = gg.Context()
        lg = make(ctx, logits, layout)
        if sparse:
            labels = (ctx.from_numpy(ids.reshape(rows[::-1]), T.I32), ctx.from_numpy(weights.reshape(rows[::-1])))
        else:
            labels = (ctx.from_numpy(dense.reshape(shape)),)
        loss = gg.cross_entropy_loss(ctx, lg, *labels)
        back = gg.cross_entropy_loss_back(ctx, ctx.from_numpy(np.array([d], np.float32)), lg, *labels)
        results.append((run(loss).tobytes(), run(back).tobytes()))
    assert results[0] == results[1]


@pytest.mark.parametrize("sparse", [True, False], ids=["ids", "rows"])
def test_cross_entropy_rows_share_no_work_row_between_threads(rng, sparse):
    """Rows in parallel, each thread on its own work row of the backend's scratch: the loss
    on every thread equals the loss on one, to the bit."""
    logits, labels = ce_inputs(rng, (1, 1, 32, 100_000), "one_hot", 2.0)  # rows long enough to overlap
    ids = labels.reshape(32, 100_000).argmax(axis=1).astype(np.int32)
    results = []
    for threads in (1, 2):
        ctx = gg.Context()
        lab = (ctx.from_numpy(ids.reshape(1, 32), T.I32), ctx.from_numpy(np.ones((1, 32), np.float32))) if sparse \
            else (ctx.from_numpy(labels),)
        loss = gg.cross_entropy_loss(ctx, ctx.from_numpy(logits), *lab)
        gg.compute(gg.new_graph(loss), gg.CpuBackend(threads))
        results.append(loss.numpy().tobytes())
    assert results[0] == results[1]


@pytest.mark.parametrize("layouts", [("contig", "contig"), ("perm", "contig"), ("trans", "pad"), ("pad", "perm")],
                         ids=lambda l: "-".join(l))
@pytest.mark.parametrize("kind", ["soft", "one_hot", "weighted"])
@pytest.mark.parametrize("shape", CE_SHAPES.values(), ids=CE_SHAPES.keys())
@pytest.mark.parametrize("d", [1.0, -0.37])
def test_cross_entropy_loss_back(rng, shape, kind, layouts, d):
    logits, labels = ce_inputs(rng, shape, kind)
    ctx = gg.Context()
    grad = ctx.from_numpy(np.array([d], np.float32))
    out = gg.cross_entropy_loss_back(ctx, grad, make(ctx, logits, layouts[0]), make(ctx, labels, layouts[1]))
    assert out.ne == tuple(shape[::-1])
    n_rows = math.prod(shape[:-1])
    p = softmax64(logits)
    dd = np.float64(np.float32(d))
    weight = labels.astype(np.float64).sum(axis=-1, keepdims=True)  # 1 but for weighted rows
    ref = (p * weight - labels) * dd / n_rows
    v = np.abs(logits.astype(np.float64) - logits.max(axis=-1, keepdims=True))
    scale = (p * (1.0 + v) * weight + np.abs(labels)) * abs(dd) / n_rows
    result = run(out)
    assert_close(result, ref, scale)
    if kind == "weighted":  # an ignored row has no gradient at all
        assert not result.reshape(-1, shape[-1])[0].any()


# ---- rms_norm_back ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layouts", [("contig", "contig"), ("perm", "contig"), ("contig", "trans"), ("pad", "perm"),
                                     ("trans", "pad")], ids=lambda l: "-".join(l))
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_rms_norm_back(rng, eps, layouts):
    g, x = randn(rng, (2, 3, 4, 48)), randn(rng, (2, 3, 4, 48), 1.5, 0.4)
    ctx = gg.Context()
    out = gg.rms_norm_back(ctx, make(ctx, g, layouts[0]), make(ctx, x, layouts[1]), eps)
    g64, x64 = g.astype(np.float64), x.astype(np.float64)
    n = x.shape[-1]
    ms = np.mean(x64 ** 2, axis=-1, keepdims=True) + np.float64(np.float32(eps))
    rms = np.sqrt(ms)
    # d/dx_i sum_j g_j x_j / rms = g_i / rms - x_i * sum_j(g_j x_j) / (n rms^3)
    term = x64 * np.sum(g64 * x64, axis=-1, keepdims=True) / (n * ms * rms)
    ref = g64 / rms - term
    assert_close(run(out), ref, np.abs(g64 / rms) + np.abs(term))  # the two terms cancel


def test_rms_norm_back_is_the_vjp_of_rms_norm(rng):
    """Finite differences of the float64 rms_norm in direction u: <rms_norm_back(g, x), u>."""
    g, x, u = randn(rng, (1, 1, 3, 16)), randn(rng, (1, 1, 3, 16)), randn(rng, (1, 1, 3, 16))
    eps = 1e-5
    ctx = gg.Context()
    got = run(gg.rms_norm_back(ctx, ctx.from_numpy(g), ctx.from_numpy(x), eps)).astype(np.float64)

    def f(x64):
        return np.sum(g * x64 / np.sqrt(np.mean(x64 ** 2, axis=-1, keepdims=True) + np.float64(np.float32(eps))))
    h = 1e-6
    fd = (f(x + h * u.astype(np.float64)) - f(x - h * u.astype(np.float64))) / (2 * h)
    assert np.sum(got * u) == pytest.approx(fd, rel=1e-5)


# ---- soft_max_ext_back ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layouts", [("contig", "contig"), ("perm", "contig"), ("contig", "trans"), ("pad", "perm")],
                         ids=lambda l: "-".join(l))
@pytest.mark.parametrize("scale", [1.0, 0.35])
def test_soft_max_ext_back(rng, scale, layouts):
    g = randn(rng, (2, 3, 5, 24))
    y = softmax64(randn(rng, (2, 3, 5, 24), 2.0)).astype(np.float32)
    y[0, 1, 2, 5:] = 0.0  # a masked tail, as a causal mask leaves it
    ctx = gg.Context()
    out = gg.soft_max_ext_back(ctx, make(ctx, g, layouts[0]), make(ctx, y, layouts[1]), scale)
    g64, y64 = g.astype(np.float64), y.astype(np.float64)
    dot = np.sum(g64 * y64, axis=-1, keepdims=True)
    sc = np.float64(np.float32(scale))
    ref = sc * y64 * (g64 - dot)
    got = run(out)
    assert_close(got, ref, sc * y64 * (np.abs(g64) + np.abs(dot)))  # g - dot cancels
    assert np.all(got[0, 1, 2, 5:] == 0.0)


def test_soft_max_back_through_the_graph_matches_the_jacobian(rng):
    """The gradient that build_backward_expand produces for soft_max_ext(x, mask, scale) equals J^T g."""
    x, w = randn(rng, (1, 2, 3, 7)), randn(rng, (1, 2, 3, 7))
    scale = 0.6
    ctx = gg.Context()
    xt = ctx.from_numpy(x).set_param()
    loss = gg.sum(ctx, gg.mul(ctx, gg.soft_max_ext(ctx, xt, None, scale), ctx.from_numpy(w))).set_loss()
    graph = gg.new_graph(loss)
    gg.build_backward_expand(ctx, graph)
    gg.compute(graph)
    got = graph.get_grad(xt).array().astype(np.float64)
    y = softmax64(x.astype(np.float64) * np.float32(scale))
    ref = np.float32(scale) * y * (w - np.sum(w * y, axis=-1, keepdims=True))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


# ---- rope_back -------------------------------------------------------------------------------------------------
ROPE_BACK_CASES = {
    # name: (head_dim, n_dims, freq_base, freq_scale, with freq_factors, ext_factor, attn_factor)
    "full": (64, 64, 10000.0, 1.0, False, 0.0, 1.0),
    "partial_n_dims": (48, 32, 10000.0, 1.0, False, 0.0, 1.0),
    "freq_factors_partial": (48, 32, 10000.0, 0.5, True, 0.0, 1.0),
    "yarn_attn_factor": (48, 32, 1000000.0, 0.125, True, 0.5, 0.9),
}
ROPE_POS = np.array([0, 1, 7, 63, 200, 4095, 3], dtype=np.int32)


def _rope_nodes(ctx, rng, case, mode, x_tensor, g_tensor):
    _head_dim, n_dims, base, fscale, with_ff, ext, attn = case
    ff = rng.uniform(1.0, 8.0, n_dims // 2).astype(np.float32) if with_ff else None
    fwd = gg.rope_ext(ctx, x_tensor, ctx.from_numpy(ROPE_POS, T.I32), ctx.from_numpy(ff) if with_ff else None,
                      n_dims, mode, 64, base, fscale, ext, attn, 32.0, 1.0)
    back = gg.rope_back(ctx, g_tensor if g_tensor is not None else fwd, fwd)
    return fwd, back, ff


@pytest.mark.parametrize("layout", ["contig", "perm", "pad"])
@pytest.mark.parametrize("mode", [gg.ROPE_TYPE_NORM, gg.ROPE_TYPE_NEOX], ids=["norm", "neox"])
@pytest.mark.parametrize("case", ROPE_BACK_CASES.values(), ids=ROPE_BACK_CASES.keys())
def test_rope_back(rng, case, mode, layout):
    """rope_back(g) = mscale * R(-theta) g: the transpose of rope (its inverse when mscale = 1), as ggml's sin_sign = -1."""
    head_dim, n_dims, base, fscale, _with_ff, ext, attn = case
    g = randn(rng, (2, len(ROPE_POS), 3, head_dim))
    ctx = gg.Context()
    x_dummy = ctx.from_numpy(np.zeros_like(g))
    _, back, ff = _rope_nodes(ctx, rng, case, mode, x_dummy, make(ctx, g, layout))
    assert back.op == gg.Op.ROPE_BACK
    got = run(back)
    cos, sin, mscale = rope_angles(ROPE_POS, n_dims, 64, base, fscale, ext, attn, 32.0, 1.0, ff)
    ref, err = rope_ref(g, ROPE_POS, n_dims, mode, cos, -sin, mscale)
    assert_close(got, ref, err)
    np.testing.assert_array_equal(got[..., n_dims:], g[..., n_dims:])


@pytest.mark.parametrize("mode", [gg.ROPE_TYPE_NORM, gg.ROPE_TYPE_NEOX], ids=["norm", "neox"])
@pytest.mark.parametrize("case", ROPE_BACK_CASES.values(), ids=ROPE_BACK_CASES.keys())
def test_rope_then_rope_back_gives_the_input_back(rng, case, mode):
    """rope_back(rope(x)) = mscale^2 x: exactly x for plain rope (attn_factor 1, no YaRN)."""
    head_dim, n_dims, base, fscale, _with_ff, ext, attn = case
    x = randn(rng, (1, len(ROPE_POS), 4, head_dim))
    ctx = gg.Context()
    _fwd, back, ff = _rope_nodes(ctx, rng, case, mode, ctx.from_numpy(x), None)
    got = run(back)
    _, _, mscale = rope_angles(ROPE_POS, n_dims, 64, base, fscale, ext, attn, 32.0, 1.0, ff)
    m2 = np.ones(head_dim)
    m2[:n_dims] = mscale ** 2
    ref = x.astype(np.float64) * m2
    half = n_dims // 2
    pair = np.arange(head_dim)
    partner = np.where(pair < n_dims, (pair + half) % n_dims if mode == gg.ROPE_TYPE_NEOX else pair ^ 1, pair)
    # two rotations in float32 by the same rounded cos/sin: a few ulp of |x0| + |x1|
    scale = (np.abs(x) + np.abs(x[..., partner])) * m2
    assert_close(got, ref, scale, rtol=4 * F32_EPS)
    if mscale == 1.0:
        assert_close(got, x, scale, rtol=4 * F32_EPS)


def test_rope_back_is_the_adjoint_of_rope(rng):
    """<rope(x), g> == <x, rope_back(g)> in float64, with YaRN and attn_factor on."""
    case = ROPE_BACK_CASES["yarn_attn_factor"]
    x, g = randn(rng, (1, len(ROPE_POS), 3, 48)), randn(rng, (1, len(ROPE_POS), 3, 48))
    ctx = gg.Context()
    fwd, back, _ = _rope_nodes(ctx, rng, case, gg.ROPE_TYPE_NEOX, ctx.from_numpy(x), ctx.from_numpy(g))
    gg.compute(gg.new_graph(fwd, back))
    lhs = np.sum(fwd.array().astype(np.float64) * g)
    rhs = np.sum(x.astype(np.float64) * back.array())
    assert lhs == pytest.approx(rhs, rel=1e-5)


# ---- silu_back, gelu_back -------------------------------------------------------------------------------------
def silu_back_ref(g, x):
    s = 1.0 / (1.0 + np.exp(-x))
    ref = g * s * (1.0 + x * (1.0 - s))
    # float32: exp/sigmoid relative errors, and 1 + x (1 - s) cancels near x = -1.28
    return ref, np.abs(g) * s * (2.0 + np.abs(x))


def gelu_back_ref(g, x):
    """g * 0.5 * (1 + t + x (1 - t^2) du/dx), t = tanh(u), with 1 + t and 1 - t in forms that do not cancel."""
    c, a = math.sqrt(2.0 / math.pi), 0.044715
    u = c * (x + a * x ** 3)
    with np.errstate(over="ignore"):
        one_plus_t, one_minus_t = 2.0 / (1.0 + np.exp(-2.0 * u)), 2.0 / (1.0 + np.exp(2.0 * u))
    terms = (one_plus_t, x * c * (1.0 + 3.0 * a * x * x) * one_plus_t * one_minus_t)
    ref = g * 0.5 * (terms[0] + terms[1])
    # relative to each term (they cancel only near x = -0.75), times the float32 rounding of u
    # amplified by exp (1 + |u|); a floor where exp(2u) leaves float32's range
    return ref, np.abs(g) * 0.5 * ((np.abs(terms[0]) + np.abs(terms[1])) * (1.0 + np.abs(u)) + 1e-30)


@pytest.mark.parametrize("layouts", [("contig", "contig"), ("perm", "contig"), ("contig", "trans"), ("pad", "perm"),
                                     ("trans", "pad")], ids=lambda l: "-".join(l))
@pytest.mark.parametrize("name", ["silu_back", "gelu_back"])
def test_activation_back(rng, name, layouts):
    g, x = randn(rng, (2, 3, 4, 40)), randn(rng, (2, 3, 4, 40), 3.5)
    x[0, 0, 0, :6] = [0.0, -1.2785, 12.0, -12.0, 30.0, -30.0]
    ctx = gg.Context()
    out = getattr(gg, name)(ctx, make(ctx, g, layouts[0]), make(ctx, x, layouts[1]))
    ref, scale = (silu_back_ref if name == "silu_back" else gelu_back_ref)(g.astype(np.float64), x.astype(np.float64))
    assert_close(run(out), ref, scale)


@pytest.mark.parametrize("name", ["silu", "gelu"])
def test_activation_back_is_the_derivative_of_the_forward(rng, name):
    """Central differences of the float64 forward at x (away from the float32 forward's noise)."""
    x = randn(rng, (1, 1, 1, 64), 2.5)
    g = np.ones_like(x)
    ctx = gg.Context()
    got = run(getattr(gg, name + "_back")(ctx, ctx.from_numpy(g), ctx.from_numpy(x)))
    f = (lambda v: v / (1.0 + np.exp(-v))) if name == "silu" else _gelu_ref
    h = 1e-6
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(got, (f(x64 + h) - f(x64 - h)) / (2 * h), rtol=1e-5, atol=1e-6)


# ---- get_rows_back ------------------------------------------------------------------------------------------------
GET_ROWS_BACK_CASES = {
    # name: (table numpy shape (ne3, ne2, ne1, ne0), indices numpy shape (1, n12, n11, n10), indices)
    "2d_repeated": ((1, 1, 6, 8), [[[[3, 0, 3, 1, 3, 5]]]]),
    "3d": ((1, 2, 5, 4), [[[[2, 2, 0], [1, 0, 1]]]]),
    "4d": ((2, 3, 5, 4), [[[[4, 4], [0, 1], [2, 2]], [[3, 3], [3, 3], [0, 4]]]]),
    "all_one_row": ((1, 1, 4, 16), [[[[2] * 9]]]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", GET_ROWS_BACK_CASES.values(), ids=GET_ROWS_BACK_CASES.keys())
def test_get_rows_back(rng, case, layout):
    table_shape, idx = case
    idx = np.array(idx, np.int32)
    _, n12, n11, n10 = idx.shape
    g = randn(rng, (n12, n11, n10, table_shape[3]))
    ctx = gg.Context()
    like = ctx.from_numpy(np.zeros(table_shape, np.float32))
    out = gg.get_rows_back(ctx, make(ctx, g, layout), ctx.from_numpy(idx, T.I32), like)
    assert out.ne == like.ne
    ref = np.zeros(table_shape)
    scale = np.zeros(table_shape)
    for i12 in range(n12):
        for i11 in range(n11):
            np.add.at(ref[i12, i11], idx[0, i12, i11], g[i12, i11].astype(np.float64))
            np.add.at(scale[i12, i11], idx[0, i12, i11], np.abs(g[i12, i11]).astype(np.float64))
    got = run(out)
    assert_close(got, ref, scale)  # float32 sums of the repeated rows
    untouched = scale == 0
    assert untouched.any() and np.all(got[untouched] == 0.0)


def test_get_rows_back_is_the_adjoint_of_get_rows(rng):
    table, g = randn(rng, (1, 2, 5, 4)), randn(rng, (1, 2, 3, 4))
    idx = np.array([[[[2, 2, 0], [1, 0, 1]]]], np.int32)
    ctx = gg.Context()
    rows = ctx.from_numpy(idx, T.I32)
    picked = run(gg.get_rows(ctx, ctx.from_numpy(table), rows)).astype(np.float64)
    back = run(gg.get_rows_back(ctx, ctx.from_numpy(g), rows, ctx.from_numpy(table))).astype(np.float64)
    assert np.sum(picked * g) == pytest.approx(np.sum(table * back), rel=1e-6)


# ---- optimizer steps ----------------------------------------------------------------------------------------------
def adamw_hparams(t: int, alpha=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.1) -> np.ndarray:
    """The 7 floats of opt_step_adamw at step t (1-based), as ggml-opt fills them."""
    return np.array([alpha, beta1, beta2, eps, wd, 1.0 / (1.0 - beta1 ** t), 1.0 / (1.0 - beta2 ** t)], np.float32)


def adamw_ref(w, g, m, v, p):
    """ggml's opt_step_adamw in float64 from float32 state and params."""
    alpha, beta1, beta2, eps, wd, beta1h, beta2h = (np.float64(x) for x in p)
    m1 = m * beta1 + g * (1.0 - beta1)
    v1 = v * beta2 + g * g * (1.0 - beta2)
    upd = alpha * (m1 * beta1h) / (np.sqrt(v1 * beta2h) + eps)
    w1 = w * (1.0 - alpha * wd) - upd
    return w1, m1, v1, np.abs(w * (1.0 - alpha * wd)) + np.abs(upd)


def _opt_graph(ctx, out):
    graph = gg.new_graph(out)
    gg.GraphAllocator().alloc_graph(graph)
    return graph, gg.CpuBackend(2)


@pytest.mark.parametrize("shape", [(1, 1, 1, 37), (2, 3, 4, 5)], ids=["1d", "4d"])
def test_opt_step_adamw_several_steps(rng, shape):
    """Graph built and allocated once, computed per step with new gradients and bias corrections."""
    w0 = randn(rng, shape)
    ctx = gg.Context()
    w = ctx.from_numpy(w0).set_param()
    g = ctx.from_numpy(np.zeros(shape, np.float32))
    m = ctx.from_numpy(np.zeros(shape, np.float32))
    v = ctx.from_numpy(np.zeros(shape, np.float32))
    params = ctx.from_numpy(np.zeros(7, np.float32))
    out = gg.opt_step_adamw(ctx, w, g, m, v, params)
    assert out.view_src is w
    graph, backend = _opt_graph(ctx, out)

    # the same steps in float64 end to end, to bound the drift over all steps
    w64, m64, v64 = w0.astype(np.float64), np.zeros(shape), np.zeros(shape)
    for t in range(1, 7):
        grad = randn(rng, shape, 0.5 * t)
        if t == 3:
            grad.reshape(-1)[:3] = 0.0  # zero gradients: only decay and momentum move w
        p = adamw_hparams(t, alpha=1e-2 / t, wd=0.0 if t == 2 else 0.1)
        g.array()[...] = grad
        params.array()[...] = p
        w_prev, m_prev, v_prev = (np.array(x.array(), np.float64) for x in (w, m, v))
        backend.compute(graph)
        # one step from the kernel's own previous state: each float32 step within a few ulp
        w1, m1, v1, w_scale = adamw_ref(w_prev, grad.astype(np.float64), m_prev, v_prev, p)
        assert_close(m.array(), m1, np.abs(m_prev * p[1]) + np.abs(grad * (1 - p[1])))
        assert_close(v.array(), v1, np.abs(v1))
        assert_close(w.array(), w1, w_scale, rtol=2 * RTOL)
        w64, m64, v64, _ = adamw_ref(w64, grad.astype(np.float64), m64, v64, p)
    np.testing.assert_allclose(w.array(), w64, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m.array(), m64, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(v.array(), v64, rtol=1e-5, atol=1e-9)


def test_opt_step_adamw_first_step_moves_each_weight_by_about_alpha(rng):
    """With bias correction, step 1 is alpha * g / (|g| + eps'): every weight moves by ~alpha (wd = 0)."""
    w0, grad = randn(rng, (1, 1, 1, 50)), randn(rng, (1, 1, 1, 50))
    ctx = gg.Context()
    w = ctx.from_numpy(w0)
    out = gg.opt_step_adamw(ctx, w, ctx.from_numpy(grad), ctx.from_numpy(np.zeros_like(w0)),
                            ctx.from_numpy(np.zeros_like(w0)), ctx.from_numpy(adamw_hparams(1, alpha=1e-3, wd=0.0)))
    run(out)
    np.testing.assert_allclose(w0 - w.array(), 1e-3 * np.sign(grad), rtol=1e-4)


def test_opt_step_sgd_several_steps(rng):
    shape = (2, 1, 3, 11)
    w0 = randn(rng, shape)
    ctx = gg.Context()
    w = ctx.from_numpy(w0).set_param()
    g = ctx.from_numpy(np.zeros(shape, np.float32))
    params = ctx.from_numpy(np.zeros(2, np.float32))
    out = gg.opt_step_sgd(ctx, w, g, params)
    assert out.view_src is w
    graph, backend = _opt_graph(ctx, out)
    w64 = w0.astype(np.float64)
    for t in range(1, 5):
        grad = randn(rng, shape)
        p = np.array([0.1 / t, 0.0 if t == 2 else 0.05], np.float32)
        g.array()[...] = grad
        params.array()[...] = p
        w_prev = np.array(w.array(), np.float64)
        backend.compute(graph)
        alpha, wd = np.float64(p[0]), np.float64(p[1])
        keep = np.float64(np.float32(1.0) - p[0] * p[1])  # (1 - alpha*wd) is formed in float32
        ref = w_prev * keep - alpha * grad
        assert_close(w.array(), ref, np.abs(w_prev * keep) + np.abs(alpha * grad))
        w64 = w64 * (1.0 - alpha * wd) - alpha * grad
    np.testing.assert_allclose(w.array(), w64, rtol=1e-5, atol=1e-6)


def test_optimizer_steps_reject_mismatched_operands():
    ctx = gg.Context()
    w = ctx.from_numpy(np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError):
        gg.opt_step_sgd(ctx, w, ctx.from_numpy(np.zeros((4, 3), np.float32)), ctx.from_numpy(np.zeros(2, np.float32)))
    with pytest.raises(ValueError):
        gg.opt_step_adamw(ctx, w, w, w, w, ctx.from_numpy(np.zeros(6, np.float32)))
