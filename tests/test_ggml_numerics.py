"""ggmlpy's CPU kernels against ggml-cpu's arithmetic transcribed in numpy (ggml_reference.py):
bit for bit, for the kernels that follow ggml's rounding order (the products with Q4_0, Q5_0, Q8_0,
Q4_K, Q6_K and F16 matrices, softmax, flash attention, ggml_v_expf).

Every product runs through both of its kernels where it has two (AVX512-VNNI integer sums, and
float32 ones for CPUs without them; both exact), over every column count that changes ggml's
formula, with strided activations, results written into a view, and matrix rows addressed by
offsets into a shared buffer. On real tensors these kernels reproduce llama.cpp's outputs bit
for bit (the slow tests of test_gemma3.py: perplexity and greedy text equal to llama.cpp's).
"""
from __future__ import annotations

import numpy as np
import pytest
from ggml_reference import (flash_attn, mul_mat_float, mul_mat_q0, mul_mat_q0_blocks, mul_mat_q4_k, mul_mat_q6_k,
                            decode_q4_0, decode_q5_0, decode_q8_0, half, soft_max, v_expf_avx512)
from numba import njit

import ggmlpy as gg
from ggmlpy import GGMLType as T
from ggmlpy import quants
from ggmlpy.backend.cpu.plan import Scratch
from ggmlpy.backend.cpu.products.qmatmul import QuantMatrix, mul_mat_q
from ggmlpy.backend.cpu.products.type_table import cpu_type
from ggmlpy.backend.cpu.simd import expf_avx512

F32 = np.float32


def quantized_rows(rng, type, m, k):
    w = (rng.standard_normal((m, k)) * rng.uniform(0.05, 3.0, (m, 1))).astype(F32)
    w[0, :256] = 0.0  # an all-zero block
    return quants.quantize(w, type).reshape(m, -1)


def activations(rng, n, k):
    x = (rng.standard_normal((n, 2 * k)) * rng.uniform(0.1, 20.0, (n, 1))).astype(F32)
    x[0, :512] = 0.0  # all-zero activation blocks (scale 0)
    if n > 1:
        x[1, 7] = 1e4  # one block dominated by a large value
    return x[:, ::2]  # strided rows


def reference(type, rows, x):
    if type == T.Q4_0:  # ggml repacks the matrices of rows % 8 == 0 (8x8 kernels: block sums)
        return (mul_mat_q0_blocks if len(rows) % 8 == 0 else mul_mat_q0)(*decode_q4_0(rows), x)
    if type == T.Q5_0:
        return mul_mat_q0(*decode_q5_0(rows), x)
    if type == T.Q8_0:
        return mul_mat_q0(*decode_q8_0(rows), x)
    if type == T.Q4_K:
        return mul_mat_q4_k(rows, x)
    return mul_mat_q6_k(rows, x)


COLUMNS = [1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 37]  # gemv / gemm, Q4_K's groups of 4, Q6_K's 8, tiles of 16


@pytest.mark.parametrize("type, m, k", [(T.Q4_0, 48, 640), (T.Q4_0, 37, 320), (T.Q5_0, 40, 640), (T.Q8_0, 35, 320),
                                        (T.Q4_K, 48, 512), (T.Q6_K, 37, 512)],
                         ids=lambda v: getattr(v, "name", str(v)))
@pytest.mark.parametrize("n", COLUMNS)
def test_quantized_products_are_ggmls(kernels, type, m, k, n):
    rng = np.random.default_rng(m * 100 + n)
    rows = quantized_rows(rng, type, m, k)
    x = activations(rng, n, k)
    big = np.full((n, m + 3), np.nan, F32)
    out = big[:, 2:m + 2]  # a view inside a larger array
    mul_mat_q(QuantMatrix.from_bytes(type, rows, k), x, out, Scratch())
    np.testing.assert_array_equal(out, reference(type, rows, x))
    assert np.isnan(big[:, :2]).all() and np.isnan(big[:, m + 2:]).all()


@pytest.mark.parametrize("type", [T.Q4_0, T.Q5_0, T.Q6_K], ids=lambda t: t.name)
def test_rows_addressed_by_offset_in_a_shared_buffer(kernels, type):
    """Rows inside a larger buffer (a memory-mapped file), in any order."""
    rng = np.random.default_rng(3)
    m, k = 20, 256
    rows = quantized_rows(rng, type, m, k)
    row_bytes = rows.shape[1]
    buf = np.zeros(7 + m * row_bytes, dtype=np.uint8)
    order = rng.permutation(m)
    for slot, r in enumerate(order):
        buf[7 + slot * row_bytes:7 + (slot + 1) * row_bytes] = rows[r]
    offs = np.empty(m, dtype=np.int64)
    offs[order] = 7 + np.arange(m) * row_bytes
    for n in (1, 9, 20):
        x = activations(rng, n, k)
        out = np.empty((n, m), F32)
        mul_mat_q(QuantMatrix(type, buf, offs, k), x, out, Scratch())
        np.testing.assert_array_equal(out, reference(type, rows, x))


@pytest.mark.parametrize("n", [1, 5, 8])
def test_q4_k_rows_not_a_multiple_of_8_take_the_repacked_order_too(kernels, n):
    """ggml repacks only Q4_K matrices whose rows are a multiple of 8 (the others it sums with
    ggml_vec_dot_q4_K_q8_K); here every Q4_K matrix takes the repacked kernels' order, so that
    a type has one kernel. Q5_K is not claimed by qexact (qdot.py, the tile path). 140 rows:
    two tasks of 64 rows and a last one of 12 (8 rows a call, then 4)."""
    rng = np.random.default_rng(60 + n)
    m, k = 140, 512
    rows = quantized_rows(rng, T.Q4_K, m, k)
    x = activations(rng, n, k)
    out = np.empty((n, m), F32)
    mul_mat_q(QuantMatrix.from_bytes(T.Q4_K, rows, k), x, out, Scratch())
    np.testing.assert_array_equal(out, reference(T.Q4_K, rows, x))
    assert cpu_type(T.Q4_0).ggml_order and not cpu_type(T.Q5_K).ggml_order


def test_the_graph_product_uses_them():
    rng = np.random.default_rng(5)
    m, k, n = 24, 256, 6
    rows = quantized_rows(rng, T.Q6_K, m, k)
    x = np.ascontiguousarray(activations(rng, n, k))
    ctx = gg.Context()
    w = ctx.from_numpy(rows.reshape(1, 1, m, -1), T.Q6_K)
    y = gg.mul_mat(ctx, w, ctx.from_numpy(x.reshape(1, 1, n, k)))
    gg.compute(gg.new_graph(y))
    np.testing.assert_array_equal(y.array().reshape(n, m), reference(T.Q6_K, rows, x))


# ---- F32 and F16 products ----------------------------------------------------------------------
@pytest.mark.parametrize("m, n, k", [(8, 5, 64), (12, 1, 64), (6, 7, 64), (8, 6, 72), (16, 33, 256), (12, 9, 172)])
@pytest.mark.parametrize("layout", ["contig", "trans"])
@pytest.mark.parametrize("type", [T.F16, T.F32])
def test_float_products_are_ggmls(type, m, n, k, layout):
    """tinyBLAS's 16 lanes (N >= 2, K % 16 == 0, M % 4 == 0) or ggml_vec_dot_f16/_f32 (the
    rest), with a transposed first operand (an F16 cache's V seen as V^T) and GQA-style
    broadcasting: the same bits on any CPU and BLAS."""
    rng = np.random.default_rng(m * n + k)
    a = rng.standard_normal((2, m, k)).astype(np.float16 if type == T.F16 else F32)
    b = (rng.standard_normal((4, n, k)) * 3).astype(F32)
    ctx = gg.Context()
    if layout == "trans":
        at = gg.transpose(ctx, ctx.from_numpy(np.ascontiguousarray(a.swapaxes(1, 2)).reshape(1, 2, k, m), type))
    else:
        at = ctx.from_numpy(a.reshape(1, 2, m, k), type)
    y = gg.mul_mat(ctx, at, ctx.from_numpy(b.reshape(1, 4, n, k)))
    gg.compute(gg.new_graph(y))
    got = y.array().reshape(4, n, m)
    for h in range(4):
        np.testing.assert_array_equal(got[h], mul_mat_float(a[h // 2].astype(F32), b[h], type == T.F16))


def test_training_graphs_sum_f32_products_by_blas():
    """A training graph's F32 products take Prec.BLAS (speed; any float32 order), its other
    products and every product of a plain graph ggml's order."""
    rng = np.random.default_rng(3)
    ctx = gg.Context()
    w = ctx.from_numpy(rng.standard_normal((8, 32)).astype(F32)).set_param()
    wh = ctx.from_numpy(rng.standard_normal((8, 32)).astype(np.float16), T.F16)
    x = ctx.from_numpy(rng.standard_normal((5, 32)).astype(F32))
    y = gg.add(ctx, gg.mul_mat(ctx, w, x), gg.mul_mat(ctx, wh, x))
    plain = gg.new_graph(y)
    products = [n for n in plain.nodes if n.op == gg.Op.MUL_MAT]
    assert [gg.prec_of(n) for n in products] == [gg.Prec.DEFAULT] * 2
    gg.compute(plain)
    exact = y.array().copy()
    train = gg.opt.TrainGraph(ctx, gg.sum(ctx, y), gg.sum(ctx, y), grad_accs={})
    assert [gg.prec_of(n) for n in products] == [gg.Prec.BLAS, gg.Prec.DEFAULT]
    gg.compute(train.forward)
    xv = x.array().reshape(5, 32)
    reference = (xv.astype(np.float64) @ w.array().reshape(8, 32).T
                 + half(xv).astype(np.float64) @ wh.array().reshape(8, 32).astype(np.float64).T)  # ggml rounds x to F16
    np.testing.assert_allclose(y.array().reshape(5, 8), reference, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y.array(), exact, rtol=1e-5, atol=1e-5)


# ---- softmax, exp ------------------------------------------------------------------------------
@njit
def _expf_avx512(x, out):
    for i in range(x.shape[0]):
        out[i] = expf_avx512(x[i])


def test_expf_avx512_is_ggml_v_expf():
    x = np.concatenate([np.linspace(-120, 100, 200001, dtype=F32),
                        np.array([-np.inf, np.inf, np.nan, 0.0, -0.0, -87.3, -103.97, -104.0, 88.7, 89.0,
                                  -133.0, -134.0, 133.0, 134.0, -200.0, 200.0, 3e38, -3e38], F32)])
    out = np.empty_like(x)
    _expf_avx512(x, out)
    np.testing.assert_array_equal(out, v_expf_avx512(x))


@pytest.mark.parametrize("n0", [16, 37, 512])
@pytest.mark.parametrize("max_bias", [0.0, 8.0])
def test_soft_max_is_ggmls(n0, max_bias):
    rng = np.random.default_rng(n0)
    x = (rng.standard_normal((1, 3, 6, n0)) * 4).astype(F32)
    mask = np.zeros((1, 1, 6, n0), F32)
    for i in range(6):  # causal-like rows, one row fully visible, one with a negative bias
        mask[0, 0, i, min(n0, 3 + 7 * i):] = -np.inf
    mask[0, 0, 5] = -0.5 * np.arange(n0)
    ctx = gg.Context()
    y = gg.soft_max_ext(ctx, ctx.from_numpy(x), ctx.from_numpy(mask), 0.7, max_bias)
    gg.compute(gg.new_graph(y))
    n_head_log2 = 2
    for h in range(3):
        slope = 1.0 if max_bias == 0 else (2.0 ** (-max_bias / n_head_log2)) ** (h + 1) if h < 2 else \
            (2.0 ** (-max_bias / 2 / n_head_log2)) ** (2 * (h - n_head_log2) + 1)
        ref = soft_max(x[0, h], mask[0, 0], 0.7, np.float32(slope))
        np.testing.assert_array_equal(y.array()[0, h], ref)


def test_soft_max_rows_do_not_depend_on_the_masked_cells_after_them():
    """A training ubatch's attention row spans the cells before it: 16 for the first of
    n_ubatch 16, 64 in a whole window of 64. A token's weights are the same for every such
    length that is a multiple of ggml's 16-entry chunks (-inf cells add exactly 0): one of
    the properties that keep a window's loss independent of n_ubatch (test_gemma3.py)."""
    rng = np.random.default_rng(4)
    n_rows = 16
    x = (rng.standard_normal((1, 2, n_rows, 64)) * 6).astype(F32)
    mask = np.zeros((1, 1, n_rows, 64), F32)
    for i in range(n_rows):
        mask[0, 0, i, i + 1:] = -np.inf
    outs = {}
    for n_kv in (16, 32, 48, 64):
        ctx = gg.Context()
        y = gg.soft_max_ext(ctx, ctx.from_numpy(np.ascontiguousarray(x[..., :n_kv])),
                            ctx.from_numpy(np.ascontiguousarray(mask[..., :n_kv])), 0.0625, 0.0)
        gg.compute(gg.new_graph(y))
        outs[n_kv] = y.array()
        assert not outs[n_kv][..., 16:].any()
    for n_kv in (32, 48, 64):
        np.testing.assert_array_equal(outs[n_kv][..., :16], outs[16])


# ---- flash attention ---------------------------------------------------------------------------
ATTN = {
    # name: (n_q, n_kv, n_head, n_head_kv, dk, dv, softcap, with_mask, max_bias)
    "tiled_gemma": (70, 150, 4, 1, 256, 256, 0.0, True, 0.0),
    "tiled_head_48": (64, 64, 2, 2, 48, 48, 0.0, True, 0.0),
    "tiled_dk_ne_dv": (96, 130, 2, 1, 64, 32, 0.0, True, 0.0),
    "tiled_softcap_alibi": (64, 80, 4, 2, 80, 80, 30.0, True, 8.0),
    "tiled_no_mask": (65, 20, 2, 1, 64, 64, 0.0, False, 0.0),
    "one_chunk_gemma": (1, 200, 4, 1, 256, 256, 0.0, True, 0.0),
    "one_chunk_prompt": (13, 40, 4, 2, 64, 64, 0.0, True, 0.0),
    "one_chunk_softcap": (5, 17, 2, 1, 48, 48, 50.0, True, 0.0),
}


# heads up to 32 values (small_head_attention.py): ggml's tiled arithmetic for every ubatch
SMALL_HEAD_ATTN = {
    "small_tiled": (70, 150, 4, 2, 8, 8, 0.0, True, 0.0),
    "small_decode": (1, 200, 8, 4, 8, 8, 0.0, True, 0.0),
    "small_prompt_softcap_alibi": (13, 100, 4, 2, 16, 16, 30.0, True, 8.0),
    "small_dk_ne_dv_no_mask": (40, 20, 2, 1, 32, 16, 0.0, False, 0.0),
}


@pytest.mark.parametrize("kv_type", [T.F16, T.F32], ids=lambda t: t.name)
@pytest.mark.parametrize("case", ATTN.values(), ids=ATTN.keys())
def test_flash_attn_is_ggmls(case, kv_type):
    check_flash_attn(case, kv_type, tiled=None)


@pytest.mark.parametrize("kv_type", [T.F16, T.F32], ids=lambda t: t.name)
@pytest.mark.parametrize("case", SMALL_HEAD_ATTN.values(), ids=SMALL_HEAD_ATTN.keys())
def test_small_head_flash_attn_is_ggmls_tiled_kernel(case, kv_type):
    check_flash_attn(case, kv_type, tiled=True)


def check_flash_attn(case, kv_type, tiled):
    n_q, n_kv, n_head, n_head_kv, dk, dv, softcap, with_mask, max_bias = case
    rng = np.random.default_rng(n_q * n_kv + dk)
    q = (rng.standard_normal((n_q, n_head, dk)) * 0.3).astype(F32)  # the graph's layout: permuted view
    k = rng.standard_normal((n_kv, n_head_kv, dk)).astype(F32)
    v = rng.standard_normal((n_kv, n_head_kv, dv)).astype(F32)
    mask = np.zeros((n_q, n_kv), F32)
    for i in range(n_q):  # causal over the last n_q cells, and a window of 100
        mask[i, n_kv - n_q + i + 1:] = -np.inf
        mask[i, :max(0, n_kv - n_q + i - 100)] = -np.inf
    if n_q > 3:
        mask[3] = -np.inf  # a query that sees nothing: output 0
    ctx = gg.Context()
    qt = gg.permute(ctx, ctx.from_numpy(q.reshape(1, n_q, n_head, dk)), 0, 2, 1, 3)
    kt = gg.permute(ctx, ctx.from_numpy(k.reshape(1, n_kv, n_head_kv, dk).astype(
        np.float16 if kv_type == T.F16 else F32), kv_type), 0, 2, 1, 3)
    vt = gg.permute(ctx, ctx.from_numpy(v.reshape(1, n_kv, n_head_kv, dv).astype(
        np.float16 if kv_type == T.F16 else F32), kv_type), 0, 2, 1, 3)
    mt = ctx.from_numpy(mask.reshape(1, 1, n_q, n_kv)) if with_mask else None
    y = gg.flash_attn_ext(ctx, qt, kt, vt, mt, 0.125, max_bias, softcap)
    gg.compute(gg.new_graph(y))
    slope = None
    if max_bias:
        n_log2 = 1 << int(np.floor(np.log2(n_head)))
        m0, m1 = F32(2.0) ** (F32(-max_bias) / n_log2), F32(2.0) ** (F32(-max_bias / 2) / n_log2)
        slope = [m0 ** F32(h + 1) if h < n_log2 else m1 ** F32(2 * (h - n_log2) + 1) for h in range(n_head)]
    ref = flash_attn(q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2), mask if with_mask else None,
                     0.125, softcap, slope, half_kv=kv_type == T.F16, tiled=tiled)
    np.testing.assert_array_equal(y.array().reshape(n_q, n_head, dv), ref)
