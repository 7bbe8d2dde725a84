"""bf16dot.py's products, out (N, K) [+]= G (N, M) @ W (M, K) on bf16-rounded operands, against
float64 numpy on the same rounded values (so only float32 summation separates them), on both
paths (AVX512-BF16 and BLAS), and the nodes that use them (set_prec) against float32."""
from __future__ import annotations

import numba
import numpy as np
import pytest
from test_quants import quantized_weights

import ggmlpy as gg
from ggmlpy import GGMLType as T
from ggmlpy import convert
from ggmlpy.backend.cpu.products import bf16dot, qmatmul
from ggmlpy.backend.cpu.plan import Scratch


def ref_bf16(x: np.ndarray) -> np.ndarray:
    return convert.round_to(np.asarray(x, np.float32), T.BF16).astype(np.float64)


@pytest.fixture(params=["avx512bf16", "blas"])
def path(request, monkeypatch):
    if request.param == "avx512bf16" and not bf16dot.BF16:
        pytest.skip("this CPU has no AVX512-BF16")
    monkeypatch.setattr(bf16dot, "BF16", request.param == "avx512bf16")
    return request.param


def run(w: np.ndarray, g: np.ndarray, out: np.ndarray, accumulate: bool = False) -> np.ndarray:
    return bf16dot.product(lambda r0, r1, dst: np.copyto(dst, w[r0:r1]), w.shape[0], g, out, Scratch(), accumulate)


def check(got: np.ndarray, g: np.ndarray, w: np.ndarray, base: np.ndarray | None = None) -> None:
    gr, wr = ref_bf16(g), ref_bf16(w)
    ref = gr @ wr + (0.0 if base is None else base)
    scale = np.abs(gr) @ np.abs(wr) + (0.0 if base is None else np.abs(base))
    assert (np.abs(got - ref) <= 2e-6 * scale + 1e-30).all(), float((np.abs(got - ref) / scale).max())


# N rows of out (tiles of 6), M rows of W (pairs, an odd one), K columns (64 wide and 16 narrow)
SHAPES = [(1, 2, 16), (5, 7, 80), (6, 64, 64), (13, 33, 208), (40, 301, 640)]


@pytest.mark.parametrize("n, m, k", SHAPES)
def test_product_against_float64_on_the_rounded_values(path, n, m, k):
    rng = np.random.default_rng(n * 1000 + m + k)
    w = rng.standard_normal((m, k)).astype(np.float32)
    g = rng.standard_normal((n, m)).astype(np.float32)
    check(run(w, g, np.full((n, k), np.nan, np.float32)), g, w)


@pytest.mark.parametrize("layout", ["transposed", "strided"])
def test_any_layout_of_g_and_accumulating_into_out(path, layout):
    rng = np.random.default_rng(3)
    m, n, k = 45, 11, 96
    w = rng.standard_normal((m, k)).astype(np.float32)
    if layout == "transposed":  # columns contiguous, as a transposed gradient
        g = np.ascontiguousarray(rng.standard_normal((m, n)).astype(np.float32)).T
    else:
        g = rng.standard_normal((n, 2 * m + 1)).astype(np.float32)[:, 1::2]
    base = rng.standard_normal((n, k)).astype(np.float32)
    check(run(w, g, base.copy(), accumulate=True), g, w, base.astype(np.float64))


def test_tiles_of_rows_sum_in_one_order(monkeypatch):
    """Many tiles of W's rows (tiny TILE_BYTES) give the same bits as one tile, and as one thread."""
    if not bf16dot.BF16:
        pytest.skip("this CPU has no AVX512-BF16")
    rng = np.random.default_rng(5)
    w = rng.standard_normal((150, 128)).astype(np.float32)
    g = rng.standard_normal((20, 150)).astype(np.float32)
    whole = run(w, g, np.empty((20, 128), np.float32))
    monkeypatch.setattr(bf16dot, "TILE_BYTES", 1)
    np.testing.assert_array_equal(run(w, g, np.empty((20, 128), np.float32)), whole)
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        np.testing.assert_array_equal(run(w, g, np.empty((20, 128), np.float32)), whole)
    finally:
        numba.set_num_threads(threads)


def test_rounding_is_ggmls_bf16_conversion():
    """Ties to even, overflow to infinity, NaNs quiet: as convert.f32_to_bf16 (ggml's)."""
    special = np.array([1.0, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, -2.5e-39, 3.4e38, np.inf, -np.inf, np.nan,
                        np.float32(np.uint32(0x7F800001).view(np.float32))], np.float32)
    x = np.concatenate([special, np.random.default_rng(1).standard_normal(247).astype(np.float32)])
    pairs = np.empty((1, x.size // 2), np.uint32)
    bf16dot.pack_col_pairs(x.reshape(1, -1), pairs)
    np.testing.assert_array_equal(pairs.view(np.uint16).reshape(-1), convert.f32_to_bf16(x))


@pytest.mark.parametrize("type", [T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_out_prod_of_a_quantized_matrix_with_prec_bf16(path, type):
    """OUT_PROD set to Prec.BF16 takes bf16dot's product over W's dequantized rows; unset, float32."""
    rng = np.random.default_rng(int(type))
    k = 256
    q, wv = quantized_weights(rng, type, (70, k))
    g = rng.standard_normal((70, 9)).astype(np.float32)  # ggml's b: [9, 70]
    results = {}
    for prec in (gg.Prec.DEFAULT, gg.Prec.BF16):
        ctx = gg.Context()
        node = gg.out_prod(ctx, ctx.from_numpy(q, type), ctx.from_numpy(g))
        if prec == gg.Prec.BF16:
            gg.set_prec(node, prec)
        gg.compute(gg.new_graph(node))
        results[prec] = node.numpy().reshape(9, k).astype(np.float64)
    gt = g.T.astype(np.float64)
    check(results[gg.Prec.BF16], g.T, wv.astype(np.float32))
    exact = gt @ wv
    assert (np.abs(results[gg.Prec.DEFAULT] - exact) <= 4e-6 * (np.abs(gt) @ np.abs(wv))).all()


def test_set_prec_refuses_other_ops():
    ctx = gg.Context()
    a = ctx.from_numpy(np.ones((4, 4), np.float32))
    with pytest.raises(ValueError, match="MUL_MAT has no BF16"):
        gg.set_prec(gg.mul_mat(ctx, a, a), gg.Prec.BF16)
    with pytest.raises(ValueError, match="ADD has no precision to set"):
        gg.set_prec(gg.add(ctx, a, a), gg.Prec.BLAS)


def test_mul_mat_qt_takes_either_arithmetic():
    rng = np.random.default_rng(9)
    q, wv = quantized_weights(rng, T.Q8_0, (40, 64))
    g = rng.standard_normal((3, 40)).astype(np.float32)
    w = qmatmul.QuantMatrix.from_bytes(T.Q8_0, q, 64)
    f32 = qmatmul.mul_mat_qt(w, g, np.empty((3, 64), np.float32))
    bf = qmatmul.mul_mat_qt(w, g, np.empty((3, 64), np.float32), bf16=True)
    assert (np.abs(f32 - g.astype(np.float64) @ wv) <= 4e-6 * (np.abs(g) @ np.abs(wv))).all()
    check(bf, g, wv.astype(np.float32))


@pytest.mark.parametrize("type", [T.Q8_0, T.Q4_0, T.Q6_K], ids=lambda t: t.name)
def test_fused_output_layer_with_prec_bf16(path, monkeypatch, type):
    """LINEAR_CROSS_ENTROPY set to Prec.BF16 sums softmax(z) W for dx by bf16 dot products
    (from the packed rows, or for types without qexact's kernels from the float rows the
    forward product loaded): dx within 2^-8 of each product of the float64 reference, chunk
    after chunk; the loss rows are unchanged."""
    from test_linear_cross_entropy import graph_with_gradients, k_for, labels, logits_gradient, weight

    from ggmlpy.backend.cpu.train import linear_ce
    monkeypatch.setattr(linear_ce, "CHUNK_BYTES", 1)  # several chunks
    rng = np.random.default_rng(int(type) + 5)
    k, n_classes, n = k_for(type), 70, 9
    ctx = gg.Context()
    w, wv = weight(ctx, rng, type, n_classes, k)
    x = (rng.standard_normal((n, k)) * 2.0).astype(np.float32)
    xt = ctx.from_numpy(x).set_param()
    ids, wts, idv, wtv = labels(ctx, rng, (n,), n_classes)
    fw = rng.standard_normal((n, 3)).astype(np.float32)
    _, _, graph = graph_with_gradients(ctx, w, xt, ids, wts, True, fw)
    lce = [node for node in graph.nodes if node.op == gg.Op.LINEAR_CROSS_ENTROPY]
    assert len(lce) == 1
    gg.set_prec(lce[0], gg.Prec.BF16)
    gg.compute(graph)
    dz, soft = logits_gradient(x, wv, type, fw, idv, wtv)
    got = graph.get_grad(xt).numpy().reshape(n, k)
    tol = 4e-6 * (np.abs(dz) @ np.abs(wv)).max() + 2.0 ** -8 * (np.abs(soft) @ np.abs(wv))
    err = np.abs(got - dz @ wv)
    assert (err <= tol).all()
    assert err.max() > 1e-6 * np.abs(dz @ wv).max()  # bf16 products, not float32 ones
