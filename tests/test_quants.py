"""Block-quantized types: layouts, (de)quantization and products against independent references.

References:
  - dequantization: gguf.quants.dequantize (gguf's numpy port of ggml), compared bit for
    bit on valid random blocks (random quant bytes, finite random fp16 scales) and on
    real blocks of the gemma3 Q4_K_M model (slow). gguf has no Q8_K; its reference is
    written here from ggml's dequantize_row_q8_K (d * q).
  - quantization: gguf.quants.quantize bit for bit where gguf implements it (Q4_0, Q4_1,
    Q5_0, Q5_1, Q8_0); for the K-quants, ggml's own test-quantize-fns bounds on its
    synthetic data, plus relative-RMSE bounds on Gaussian rows.
  - products: float64 numpy on the dequantized matrix and the rounded activations. ggml
    quantizes the activations to the weight type's vec_dot_type before its integer dot
    products (Q4_0/Q5_0/Q8_0 -> Q8_0, Q4_1/Q5_1 -> Q8_1, Q2_K..Q6_K -> Q8_K); the values
    it then multiplies are rebuilt here in numpy from ggml's definitions (ref_round_activations:
    x86 quantize_row_q8_0/q8_1 and quantize_row_q8_K). Dequantized weights and rounded
    activations are exact float32 values, so the only error is float32 accumulation, for
    every type alike: |got - ref| <= MATMUL_RTOL[type] * sum_k |w_k x_k|.
"""
from __future__ import annotations


import gguf
import numpy as np
import pytest
from numba import njit

import ggmlpy as gg
from ggmlpy import GGMLType as T
from ggmlpy import quants as Q
from ggmlpy.backend.cpu.products import qmatmul, type_table
from ggmlpy.quants.common import f32_to_f16_bits
from ggmlpy.types import type_from_name

G = gguf.GGMLQuantizationType
ALL = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_K]
GGUF_QUANTIZES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
# byte ranges of each block's fp16 scale fields (Q8_K: one float32 at 0..4)
F16_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
              T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}
ids = lambda t: t.name  # noqa: E731


def ref_dequantize(data: np.ndarray, type: T) -> np.ndarray:
    if type == T.Q8_K:
        blocks = data.reshape(-1, 292)
        d = blocks[:, :4].copy().view(np.float32)
        q = blocks[:, 4:260].view(np.int8).astype(np.float32)
        return (d * q).reshape(*data.shape[:-1], -1)
    return gguf.quants.dequantize(data, G[type.name])


def ref_round_activations(x: np.ndarray, type: T) -> np.ndarray:
    """The activation values ggml-cpu's products with a `type` matrix use, in numpy.

    Q8_0 / Q8_1 (x86 quantize_row_q8_0/q8_1, AVX2): per 32 values, amax = max |x|,
    d = fp16(amax / 127), q = rint(x * (127 / amax)) ties to even; value d * q.
    Q8_K (quantize_row_q8_K_ref): per 256 values, m = the first value of largest magnitude,
    iscale = -127 / m, q = min(127, nearest_int(iscale * x)) (ties to even), d = 1 / iscale
    kept in float32; value d * q. Other types (Q8_K weights): x unchanged."""
    x = np.asarray(x, np.float32)
    vdt = {T.Q4_0: 32, T.Q5_0: 32, T.Q8_0: 32, T.Q4_1: 32, T.Q5_1: 32,
           T.Q2_K: 256, T.Q3_K: 256, T.Q4_K: 256, T.Q5_K: 256, T.Q6_K: 256}.get(type)
    if vdt is None:
        return x.copy()
    b = x.reshape(-1, vdt)
    with np.errstate(divide="ignore", invalid="ignore"):
        if vdt == 32:
            amax = np.abs(b).max(axis=1, keepdims=True)
            d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
            inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
            q = np.rint(b * inv) + np.float32(0)  # the int8 quants: no -0
        else:
            m = np.take_along_axis(b, np.abs(b).argmax(axis=1)[:, None], axis=1)
            iscale = np.float32(-127) / m
            q = np.minimum(np.float32(127), np.rint(b * iscale)) + np.float32(0)
            d = np.where(m != 0, np.float32(1) / iscale, np.float32(0)).astype(np.float32)
            q = np.where(m != 0, q, np.float32(0))
    out = (d * q).astype(np.float32)
    assert out.dtype == np.float32
    return out.reshape(x.shape)


def random_blocks(rng, type: T, n_rows: int, n_blocks: int) -> np.ndarray:
    """Random quant bytes with valid scales: finite fp16 of mixed signs and magnitudes
    (normal, subnormal, zero); every quant bit pattern occurs."""
    tr = gg.traits(type)
    data = rng.integers(0, 256, (n_rows, n_blocks, tr.type_size), dtype=np.uint8)
    if type == T.Q8_K:
        data[..., :4] = (rng.standard_normal((n_rows, n_blocks, 1)) * 0.01).astype(np.float32).view(np.uint8)
    for o in F16_FIELDS.get(type, []):
        mag = 10.0 ** rng.uniform(-7, 2, (n_rows, n_blocks, 1))
        h = (rng.choice([-1.0, 1.0], mag.shape) * mag).astype(np.float16)
        h[rng.random(h.shape) < 0.05] = 0
        data[..., o:o + 2] = h.view(np.uint8)
    return data.reshape(n_rows, n_blocks * tr.type_size)


# ---- fp16 helpers ------------------------------------------------------------------------------
@njit(cache=True)
def _to_f16_bits(x, out):
    for i in range(x.shape[0]):
        out[i] = f32_to_f16_bits(x[i])


def test_f32_to_f16_rounds_like_numpy():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = np.concatenate([x[np.isfinite(x)], np.float32([0.0, -0.0, 65504, 65519.99, 65520, 1e-8, 2.0**-25,
                                                       3 * 2.0**-26, 2.0**-14, np.inf, -np.inf])])
    # halfway cases between neighbouring halves: exact ties
    h = np.arange(0, 0x7BFF, 7, dtype=np.uint16)
    lo, hi = h.view(np.float16).astype(np.float64), (h + 1).view(np.float16).astype(np.float64)
    x = np.concatenate([x, ((lo + hi) / 2).astype(np.float32), -((lo + hi) / 2).astype(np.float32)])
    out = np.empty(x.shape, np.uint16)
    _to_f16_bits(x, out)
    with np.errstate(over="ignore"):
        ref = x.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(out, ref)


# ---- geometry ----------------------------------------------------------------------------------
@pytest.mark.parametrize("type", ALL, ids=ids)
def test_traits_match_gguf(type):
    tr = gg.traits(type)
    assert (tr.blck_size, tr.type_size) == gguf.GGML_QUANT_SIZES[G[type.name]]
    assert tr.is_quantized and gg.row_size(type, 4 * tr.blck_size) == 4 * tr.type_size
    assert type_from_name(type.name) == type


# ---- dequantize --------------------------------------------------------------------------------
@pytest.mark.parametrize("type", ALL, ids=ids)
def test_dequantize_bit_exact_random_blocks(type):
    rng = np.random.default_rng(int(type))
    data = random_blocks(rng, type, 7, 5)
    got = Q.dequantize(data, type)
    ref = ref_dequantize(data, type)
    assert got.dtype == np.float32 and got.shape == ref.shape
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("type", ALL, ids=ids)
def test_dequantize_strided_and_batched(type):
    """Rows at arbitrary byte offsets of one buffer (here every other row, reversed)."""
    rng = np.random.default_rng(7)
    data = random_blocks(rng, type, 10, 2)
    w = qmatmul.QuantMatrix(type, data.reshape(-1), np.arange(9, -1, -2, dtype=np.int64) * data.shape[1],
                            data.shape[1] // gg.traits(type).type_size * gg.traits(type).blck_size)
    out = np.empty((5, w.k), np.float32)
    w.dequantize_rows(0, 5, out)
    np.testing.assert_array_equal(out, ref_dequantize(data[9::-2], type))
    # leading dims are kept, as in gguf
    assert Q.dequantize(data.reshape(2, 5, -1), type).shape == (2, 5, w.k)


# ---- quantize ----------------------------------------------------------------------------------
def awkward_rows(rng, ne0: int) -> np.ndarray:
    """Gaussian rows of several magnitudes plus blocks ggml's code treats specially."""
    rows = [rng.standard_normal(ne0) * s for s in (1e-3, 0.02, 1.0, 300.0)]
    rows.append(rng.standard_normal(ne0) + 5.0)                  # all positive (min > 0)
    rows.append(-np.abs(rng.standard_normal(ne0)))               # all negative
    rows.append(np.zeros(ne0))                                   # all zero
    rows.append(np.full(ne0, 0.75))                              # constant
    r = rng.integers(-8, 8, ne0) * 0.25                          # many exact ties
    rows.append(r)
    sparse = np.zeros(ne0)
    sparse[rng.integers(0, ne0, 5)] = rng.standard_normal(5)
    rows.append(sparse)                                          # mostly-zero blocks
    rows.append(rng.standard_normal(ne0) * 1e-30)                # below GROUP_MAX_EPS scale
    return np.stack(rows).astype(np.float32)


@pytest.mark.parametrize("type", GGUF_QUANTIZES, ids=ids)
def test_quantize_bit_exact_vs_gguf(type):
    rng = np.random.default_rng(3)
    x = np.concatenate([awkward_rows(rng, 256), rng.standard_normal((20, 256)).astype(np.float32)])
    got = Q.quantize(x, type)
    ref = gguf.quants.quantize(x, G[type.name])
    np.testing.assert_array_equal(got, ref)


def ggml_total_error(type: T) -> float:
    """ggml tests/test-quantize-fns.cpp: data 0.1 + 2 cos(i), error sqrt(sum d^2) / n."""
    n = 32 * 128
    x = (0.1 + 2 * np.cos(np.arange(n, dtype=np.float32))).astype(np.float32)
    y = Q.dequantize(Q.quantize(x[None], type), type)[0]
    return float(np.sqrt(np.sum((x.astype(np.float64) - y) ** 2)) / n)


GGML_MAX_TOTAL_ERROR = {T.Q2_K: 0.0075, T.Q3_K: 0.0040}  # others: 0.002


@pytest.mark.parametrize("type", ALL, ids=ids)
def test_quantize_error_within_ggml_bounds(type):
    assert ggml_total_error(type) < GGML_MAX_TOTAL_ERROR.get(type, 0.002)


# relative RMSE ||x - deq(q(x))|| / ||x|| on N(0, 1) rows of 1024: the measured values + 10%
# (bits per weight 4.5 .. 8.5; they match ggml's known quality ordering)
REL_RMSE = {T.Q4_0: 0.10, T.Q4_1: 0.09, T.Q5_0: 0.048, T.Q5_1: 0.043, T.Q8_0: 0.0062,
            T.Q2_K: 0.35, T.Q3_K: 0.172, T.Q4_K: 0.082, T.Q5_K: 0.041, T.Q6_K: 0.0205, T.Q8_K: 0.0083}


@pytest.mark.parametrize("type", ALL, ids=ids)
def test_quantize_roundtrip_rmse(type):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((16, 1024)).astype(np.float32)
    y = Q.dequantize(Q.quantize(x, type), type).astype(np.float64)
    rel = np.sqrt(np.sum((x - y) ** 2, axis=1) / np.sum(x.astype(np.float64) ** 2, axis=1))
    assert rel.max() < REL_RMSE[type]
    # special rows: finite, zero stays zero, tiny and constant rows behave
    z = awkward_rows(rng, 512)
    yz = Q.dequantize(Q.quantize(z, type), type)
    assert np.isfinite(yz).all()
    np.testing.assert_array_equal(yz[6], 0.0)
    err = np.abs(yz - z).max(axis=1) / np.maximum(np.abs(z).max(axis=1), 1e-37)
    assert err[[0, 1, 2, 3, 7]].max() < 0.75


@pytest.mark.parametrize("type", ALL, ids=ids)
def test_requantize_is_stable(type):
    """Quantizing dequantized values loses nothing more: error of the second round trip
    is no larger than the first's (for Q4_0..Q8_0 the bytes come back identical)."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((4, 512)).astype(np.float32)
    q1 = Q.quantize(x, type)
    y1 = Q.dequantize(q1, type)
    y2 = Q.dequantize(Q.quantize(y1, type), type)
    assert np.sqrt(np.mean((y2 - x) ** 2)) <= 1.02 * np.sqrt(np.mean((y1 - x) ** 2))


# ---- activation rounding (the vec_dot_type quantization of a product's other operand) ------------
def _activation_rows(rng, k):
    """Rows with every kind of block: Gaussian at several scales, all zero, exact ties of
    x * 127 / amax (d = 1), a single non-zero value, negative extremes, tiny values."""
    x = (rng.standard_normal((6, k)) * np.float32([[1e-3], [0.1], [1], [30], [1e4], [1]])).astype(np.float32)
    x[5, :32] = 0
    t = np.float32(127) * (rng.integers(-254, 255, k) / np.float32(254))  # halves: (2j + 1) / 2
    t[0] = 127                                                             # amax 127: factor 1
    ties = t.astype(np.float32)
    ties[::32] = 127
    single = np.zeros(k, np.float32)
    single[3] = -2.5
    neg = -np.abs(x[2])
    sub = (rng.standard_normal(k) * 1e-30).astype(np.float32)
    return np.vstack([x, ties, single, neg, sub]).astype(np.float32)


@pytest.mark.parametrize("type", ALL, ids=ids)
def test_activation_rounding_matches_ggml(type):
    """type_table.round_activations against the numpy rebuild of ggml's activation quantizers."""
    rng = np.random.default_rng(int(type) + 3)
    x = _activation_rows(rng, 512)
    got = type_table.round_activations(x, type)
    ref = ref_round_activations(x, type)
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))
    np.testing.assert_array_equal(x, _activation_rows(np.random.default_rng(int(type) + 3), 512))  # input kept
    if type != T.Q8_K:
        assert not np.array_equal(got, x)  # the rounding did something


def test_activation_rounding_details():
    """The points where ggml's activation quantizers differ from the naive ones."""
    # Q8_0 (x86): ties to even (the reference roundf would give 3 and -3) with factor 127 / amax = 1
    x = np.zeros((1, 32), np.float32)
    x[0, :4] = [127, 2.5, -2.5, 3.5]
    np.testing.assert_array_equal(type_table.round_activations(x, T.Q8_0)[0, :4], [127, 2, -2, 4])
    # Q8_0: d is stored in fp16, so values are fp16(amax / 127) * q, not amax / 127 * q
    x = np.full((1, 32), 0.3, np.float32)
    d16 = np.float32(np.float16(np.float32(0.3) / np.float32(127)))
    assert type_table.round_activations(x, T.Q5_0)[0, 0] == d16 * np.float32(127) != np.float32(0.3)
    # Q8_K: d = 1 / iscale in float32 (no fp16): the largest value comes back to float32 rounding
    x = np.full((1, 256), 0.3, np.float32)
    iscale = np.float32(-127) / np.float32(0.3)
    assert type_table.round_activations(x, T.Q4_K)[0, 0] == np.float32(np.float32(1) / iscale) * np.float32(-127)
    # Q8_K: the same values as quantizing to Q8_K and dequantizing
    rng = np.random.default_rng(5)
    x = _activation_rows(rng, 768)
    via_blocks = ref_dequantize(Q.quantize(x, T.Q8_K), T.Q8_K)
    np.testing.assert_array_equal(type_table.round_activations(x, T.Q6_K).view(np.uint32), via_blocks.view(np.uint32))
    # the product path uses them: a Q8_0 identity (d = 1, q = 1 on the diagonal) picks them out
    eye = np.zeros((64, 2, 34), np.uint8)
    eye[:, :, :2] = np.float16(1).reshape(1).view(np.uint8)
    eye[np.arange(64), np.arange(64) // 32, 2 + np.arange(64) % 32] = 1
    np.testing.assert_array_equal(ref_dequantize(eye.reshape(64, 68), T.Q8_0), np.eye(64))
    ctx = gg.Context()
    xa = (rng.standard_normal((3, 64))).astype(np.float32)
    out = gg.mul_mat(ctx, ctx.from_numpy(eye.reshape(64, 68), T.Q8_0), ctx.from_numpy(xa))
    gg.compute(gg.new_graph(out))
    np.testing.assert_array_equal(out.array()[0, 0], ref_round_activations(xa, T.Q8_0))


# ---- products ------------------------------------------------------------------------------------
# float32 accumulation only (see module docstring); identical for every type
MATMUL_RTOL = {t: 4e-6 for t in ALL}
MATMUL_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_K]


def quantized_weights(rng, type: T, shape) -> tuple[np.ndarray, np.ndarray]:
    """(packed rows, their float64 values) for a weight of numpy shape (..., rows, K)."""
    x = (rng.standard_normal(shape) * 0.1).astype(np.float32)
    q = Q.quantize(x, type)
    return q, ref_dequantize(q, type).astype(np.float64)


def assert_product_close(got, ref, scale, type):
    err = np.abs(np.asarray(got, np.float64) - ref)
    assert (err <= MATMUL_RTOL[type] * scale + 1e-30).all(), float((err / np.maximum(scale, 1e-30)).max())


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 16 rows, so the tests cross tile boundaries with small matrices."""
    monkeypatch.setattr(qmatmul, "TILE_BYTES", 1)


@pytest.mark.parametrize("n", [1, 7, 37])
@pytest.mark.parametrize("type", MATMUL_TYPES, ids=ids)
def test_mul_mat_quantized(small_tiles, type, n):
    rng = np.random.default_rng(int(type) * 100 + n)
    k = 2 * gg.traits(type).blck_size if gg.traits(type).blck_size == 256 else 96
    q, w = quantized_weights(rng, type, (45, k))  # 45 rows: 2 full tiles and a partial one
    x = rng.standard_normal((n, k)).astype(np.float32)
    ctx = gg.Context()
    out = gg.mul_mat(ctx, ctx.from_numpy(q, type), ctx.from_numpy(x))
    assert out.ne == (45, n, 1, 1)
    gg.compute(gg.new_graph(out))
    got = out.array()[0, 0]
    xr = ref_round_activations(x, type).astype(np.float64)
    ref = xr @ w.T
    assert_product_close(got, ref, np.abs(xr) @ np.abs(w).T, type)


BCAST = {
    # name: (a numpy shape (ne03, ne02, M, K) without K, b numpy shape (ne13, ne12, N))
    "b_batched_over_one_a": ((1, 1, 20), (2, 3, 5)),
    "per_matrix": ((2, 3, 12), (2, 3, 4)),
    "gqa_dim2": ((1, 2, 12), (1, 6, 3)),
    "gqa_dim2_dim3": ((2, 2, 12), (4, 6, 1)),
}


@pytest.mark.parametrize("n", [1, 13, 40])
@pytest.mark.parametrize("type", [T.Q5_0, T.Q8_0], ids=ids)
def test_block_sums_products(type, n):
    """qexact's block_sums kernel (the fused output layer's logits, from 16 columns; fewer
    take the gemv kernels): one float multiply-add per block of 32, so float32 rounding only
    from the rounded activations' exact products, and each column's results the same bits
    whatever columns come with it (16 or more)."""
    from ggmlpy.backend.cpu.products import qexact, type_table
    from ggmlpy.backend.cpu.plan import Scratch
    rng = np.random.default_rng(int(type) + n)
    k, m = 160, 45  # 45 rows: a partial group of 8 and of 32
    q, w = quantized_weights(rng, type, (m, k))
    x = rng.standard_normal((n, k)).astype(np.float32)
    qm = qmatmul.QuantMatrix.from_bytes(type, q, k)
    out = np.full((n, m), np.nan, np.float32)
    type_table.mul_mat(type, qm.buf, qm.offs, x, out, Scratch(), block_sums=True)
    xr = ref_round_activations(x, type).astype(np.float64)
    assert_product_close(out, xr @ w.T, np.abs(xr) @ np.abs(w).T, type)
    for i0 in range(0, n - qexact.Q0_GEMV_MAX_COLS, 5):  # windows of 16 columns
        part = np.empty((qexact.Q0_GEMV_MAX_COLS + 1, m), np.float32)
        type_table.mul_mat(type, qm.buf, qm.offs, x[i0:i0 + len(part)], part, Scratch(), block_sums=True)
        np.testing.assert_array_equal(part, out[i0:i0 + len(part)])


@pytest.mark.parametrize("vnni", [True, False], ids=["vnni", "float"])
@pytest.mark.parametrize("type", [T.Q5_0, T.Q8_0], ids=ids)
def test_block_sums_bits(type, vnni, monkeypatch):
    """Both block-sum kernels' float arithmetic (AVX512-VNNI's, and the float32 one other CPUs
    run), bit for bit: per block, the exact integer sum, then acc = fma(d_w * d_x, sum, acc)
    in block order (ggml_reference.mul_mat_q0_blocks)."""
    from ggml_reference import decode_q5_0, decode_q8_0, mul_mat_q0_blocks
    from ggmlpy.backend.cpu.products import qexact, type_table
    from ggmlpy.backend.cpu.plan import Scratch
    if vnni and not qexact.VNNI:
        pytest.skip("this CPU has no AVX512-VNNI")
    monkeypatch.setattr(qexact, "VNNI", vnni)
    rng = np.random.default_rng(7 + int(type))
    k, m, n = 192, 37, 35  # partial row groups and a partial column tile
    q, _ = quantized_weights(rng, type, (m, k))
    x = rng.standard_normal((n, k)).astype(np.float32) * 3
    qm = qmatmul.QuantMatrix.from_bytes(type, q, k)
    out = np.empty((n, m), np.float32)
    type_table.mul_mat(type, qm.buf, qm.offs, x, out, Scratch(), block_sums=True)
    decode = decode_q5_0 if type == T.Q5_0 else decode_q8_0
    np.testing.assert_array_equal(out, mul_mat_q0_blocks(*decode(q.reshape(m, -1)), x))


@pytest.mark.parametrize("b_layout", ["contig", "perm", "trans"])
@pytest.mark.parametrize("case", BCAST.values(), ids=BCAST.keys())
@pytest.mark.parametrize("type", [T.Q8_0, T.Q4_K, T.Q6_K], ids=ids)
def test_mul_mat_quantized_broadcast_and_layouts(small_tiles, type, case, b_layout):
    from test_ggml_ops import make, mul_mat_ref
    rng = np.random.default_rng(42)
    k = gg.traits(type).blck_size * (1 if type != T.Q8_0 else 3)
    q, w = quantized_weights(rng, type, case[0] + (k,))
    x = rng.standard_normal(case[1] + (k,)).astype(np.float32)
    ctx = gg.Context()
    out = gg.mul_mat(ctx, ctx.from_numpy(q, type), make(ctx, x, b_layout))
    gg.compute(gg.new_graph(out))
    ref, scale = mul_mat_ref(w, ref_round_activations(x, type).astype(np.float64))
    assert_product_close(out.array(), ref, scale, type)


def test_mul_mat_quantized_view_with_padded_rows(small_tiles):
    """a is a view of every other row of a bigger quantized tensor, starting one row in."""
    rng = np.random.default_rng(9)
    q, w = quantized_weights(rng, T.Q4_K, (40, 512))
    ctx = gg.Context()
    base = ctx.from_numpy(q, T.Q4_K)
    a = gg.view_2d(ctx, base, 512, 19, 2 * base.nb[1], base.nb[1])
    x = rng.standard_normal((3, 512)).astype(np.float32)
    out = gg.mul_mat(ctx, a, ctx.from_numpy(x))
    gg.compute(gg.new_graph(out))
    wv = w[1:39:2]
    xr = ref_round_activations(x, T.Q4_K).astype(np.float64)
    assert_product_close(out.array()[0, 0], xr @ wv.T, np.abs(xr) @ np.abs(wv).T, T.Q4_K)


@pytest.mark.parametrize("n", [1, 13])
@pytest.mark.parametrize("type", MATMUL_TYPES, ids=ids)
def test_mul_mat_transposed(small_tiles, type, n):
    """dx = dy @ W (the product with W^T that gradients w.r.t. activations need)."""
    rng = np.random.default_rng(int(type) + 7 * n)
    k = gg.traits(type).blck_size * (1 if gg.traits(type).blck_size == 256 else 4)
    q, w = quantized_weights(rng, type, (50, k))
    g = rng.standard_normal((n, 50)).astype(np.float32)
    out = np.full((n, k), np.nan, np.float32)
    qmatmul.mul_mat_qt(qmatmul.QuantMatrix.from_bytes(type, q, k), g, out)
    assert_product_close(out, g.astype(np.float64) @ w, np.abs(g) @ np.abs(w), type)


# ---- get_rows ------------------------------------------------------------------------------------
@pytest.mark.parametrize("type", ALL, ids=ids)
def test_get_rows_quantized(type):
    rng = np.random.default_rng(int(type))
    k = gg.traits(type).blck_size * 2
    table = random_blocks(rng, type, 2 * 3 * 6, k // gg.traits(type).blck_size).reshape(2, 3, 6, -1)
    idx = rng.integers(0, 6, (1, 2, 3, 4)).astype(np.int32)
    idx.flat[0] = 5
    ctx = gg.Context()
    out = gg.get_rows(ctx, ctx.from_numpy(table, type), ctx.from_numpy(idx, T.I32))
    assert out.type == T.F32 and out.ne == (k, 4, 3, 2)
    gg.compute(gg.new_graph(out))
    values = ref_dequantize(table, type)
    i12, i11 = np.arange(2)[:, None, None], np.arange(3)[None, :, None]
    np.testing.assert_array_equal(out.array(), values[i12, i11, idx[0]])


def test_get_rows_quantized_into_strided_result():
    """A GET_ROWS result viewed with a gap: rows land through a scratch copy."""
    rng = np.random.default_rng(1)
    table = random_blocks(rng, T.Q6_K, 9, 1)
    idx = np.array([8, 0, 3], np.int32)
    ctx = gg.Context()
    rows = gg.get_rows(ctx, ctx.from_numpy(table, T.Q6_K), ctx.from_numpy(idx, T.I32))
    out = gg.cont(ctx, gg.view_2d(ctx, rows, 128, 3, rows.nb[1], 0))
    gg.compute(gg.new_graph(out))
    np.testing.assert_array_equal(out.array()[0, 0], ref_dequantize(table, T.Q6_K)[idx][:, :128])


# ---- real model blocks (slow) --------------------------------------------------------------------
@pytest.mark.slow
def test_real_gemma3_blocks(gemma3_path):
    """A few rows of every quantized tensor: dequantization bit-exact against gguf-py's, and a
    product with them (the file read by llamapy's reader: gguf-py's takes 26 s over Gemma 3's
    262,144-token vocabulary)."""
    from llamapy.gguf_file import GGUFFile
    seen = set()
    rng = np.random.default_rng(0)
    for name, t in GGUFFile(gemma3_path).tensors.items():
        type = T(int(t.type))
        if not gg.traits(type).is_quantized:
            continue
        rows = t.array().reshape(-1, t.nb[1])
        pick = np.unique(np.r_[0:3, rows.shape[0] - 3:rows.shape[0], rng.integers(0, rows.shape[0], 4)])
        sample = np.ascontiguousarray(rows[pick])
        got = Q.dequantize(sample, type)
        ref = gguf.quants.dequantize(sample, G[type.name])
        np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32), err_msg=name)
        if type not in seen:  # one product per type, straight from the memory-mapped file
            seen.add(type)
            k = got.shape[1]
            w = qmatmul.QuantMatrix(type, rows.reshape(-1), np.asarray(pick) * rows.shape[1], k)
            x = rng.standard_normal((5, k)).astype(np.float32)
            out = qmatmul.mul_mat_q(w, x, np.empty((5, len(pick)), np.float32))
            xr = ref_round_activations(x, type).astype(np.float64)
            ref64 = xr @ ref.astype(np.float64).T
            assert_product_close(out, ref64, np.abs(xr) @ np.abs(ref.astype(np.float64)).T, type)
    assert {T.Q4_K, T.Q6_K} <= seen, seen


# ---- conversions -------------------------------------------------------------------------------
@pytest.mark.parametrize("type", [T.Q8_0, T.Q4_0, T.Q5_1], ids=ids)
def test_set_rows_into_quantized(type):
    """SET_ROWS into a quantized table (a quantized KV cache) quantizes like ggml's reference."""
    rng = np.random.default_rng(2)
    rows = rng.standard_normal((1, 2, 3, 64)).astype(np.float32)
    idx = np.array([[[4, 0, 2]]], np.int64)
    ctx = gg.Context()
    table = ctx.from_numpy(np.zeros((2, 5, 2 * gg.traits(type).type_size), np.uint8), type)
    out = gg.set_rows(ctx, table, ctx.from_numpy(rows), ctx.from_numpy(idx, T.I64))
    gg.compute(gg.new_graph(out))
    got = table.array()[0]
    for i2 in range(2):
        np.testing.assert_array_equal(got[i2, [4, 0, 2]], gguf.quants.quantize(rows[0, i2], G[type.name]))
        np.testing.assert_array_equal(got[i2, [1, 3]], 0)


@pytest.mark.parametrize("type", [T.Q4_0, T.Q8_0, T.Q4_K, T.Q6_K], ids=ids)
def test_cpy_between_f32_and_quantized(type):
    rng = np.random.default_rng(4)
    k = 256
    x = rng.standard_normal((3, 2, k)).astype(np.float32)
    ctx = gg.Context()
    src = ctx.from_numpy(x)
    dst = ctx.new_tensor(type, (k, 2, 3))
    q = gg.cpy(ctx, src, dst)
    back = gg.cont(ctx, gg.cpy(ctx, q, ctx.new_tensor(T.F32, (2 * k, 3))))  # reshaped on the way back
    gg.compute(gg.new_graph(back))
    ref_q = Q.quantize(x, type)
    np.testing.assert_array_equal(dst.array()[0], ref_q)
    np.testing.assert_array_equal(back.array()[0, 0], ref_dequantize(ref_q, type).reshape(3, 2 * k))


def test_the_q4_k_scale_search_side_by_side_is_the_scalar_one_bit_for_bit():
    """make_qkx2_quants_lanes (32 groups at once, selects for branches) gives each group the
    scale, min and levels of ggml's scalar make_qkx2_quants, for Q4_K's and Q5_K's settings,
    on groups that take its rare paths: flat, all positive, all negative, tiny, huge, zeros."""
    from ggmlpy.quants import kquants as K
    rng = np.random.default_rng(7)
    G = K.QKX_LANES
    groups = rng.standard_normal((G, 32)).astype(np.float32)
    groups[1] = 0.25
    groups[2] = np.abs(groups[2])
    groups[3] = -np.abs(groups[3])
    groups[4] *= np.float32(1e-20)
    groups[5] *= np.float32(1e15)
    groups[6] = 0.0
    groups[7, :31] = 0.0
    groups[8] = np.round(groups[8] * 4) / 4  # values on a grid: ties in the rounding
    for nmax, rmin, rdelta, nstep in ((15, -1.0, 0.1, 20), (31, -0.5, 0.1, 15)):
        weights = np.sqrt(np.mean(groups * groups, axis=1, dtype=np.float32))[:, None] + np.abs(groups)
        xw = np.concatenate([groups.T.reshape(-1), weights.astype(np.float32).T.reshape(-1)])
        L = np.zeros(32 * G, np.int32)
        st = np.zeros(K._QKX_STATE * G, np.float32)
        K.make_qkx2_quants_lanes(32, nmax, xw, L, np.zeros(32 * G, np.int32), np.float32(rmin), np.float32(rdelta),
                                 nstep, st)
        for g in range(G):
            Lg = np.zeros(32, np.int32)
            scale, the_min = K.make_qkx2_quants(32, nmax, groups[g], 0, weights[g].astype(np.float32), Lg, 0,
                                                np.zeros(32, np.int32), np.float32(rmin), np.float32(rdelta), nstep,
                                                False)
            assert np.float32(scale).view(np.uint32) == st[K._SCALE * G + g].view(np.uint32), g
            assert np.float32(the_min).view(np.uint32) == (-st[K._MN * G + g]).view(np.uint32), g
            assert np.array_equal(Lg, L.reshape(32, G)[:, g]), g


@pytest.mark.parametrize("n_cols", [1, 5, 40])
def test_a_product_decides_its_kernel_when_the_plan_is_prepared(monkeypatch, n_cols):
    """Every MUL_MAT of a quantized matrix picks its kernel and activation layout once, when
    the plan is prepared: running the plan again consults no chooser (ggml-cpu's
    type_traits_cpu lookup is per node, not per call)."""
    from ggmlpy.backend.cpu.products import qdot, qexact, type_table
    rng = np.random.default_rng(3)
    ctx = gg.Context()
    outs = []
    for type in MATMUL_TYPES + [T.Q4_0, T.Q5_K]:
        k = gg.traits(type).blck_size * (1 if gg.traits(type).blck_size == 256 else 8)
        q, _ = quantized_weights(rng, type, (16, k))
        x = rng.standard_normal((n_cols, k)).astype(np.float32)
        outs.append(gg.mul_mat(ctx, ctx.from_numpy(q, type), ctx.from_numpy(x)))
    graph = gg.new_graph(outs[0])
    for out in outs[1:]:
        gg.build_forward_expand(graph, out)
    from ggmlpy.backend.cpu import CpuBackend
    backend = CpuBackend()
    gg.compute(graph, backend)
    first = [o.array().copy() for o in outs]

    def chooser_called(*args, **kwargs):
        raise AssertionError("a kernel was chosen while the plan ran")
    for module, name in ((type_table.CpuType, "plan_product"), (qexact, "plan_q0"), (qexact, "plan_q4_k"),
                         (qexact, "plan_q6_k"), (qdot, "plan_q5_k"), (qmatmul, "plan_mul_mat_q")):
        monkeypatch.setattr(module, name, chooser_called)
    for o in outs:
        o.array()[...] = np.nan
    gg.compute(graph, backend)  # the same plan, run again
    for o, f in zip(outs, first):
        assert np.array_equal(o.array(), f)
