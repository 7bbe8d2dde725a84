"""Products on packed blocks with few activation columns (generation's path) against a float64
numpy reference on the activations rounded as ggml rounds them, for every type that has such a
kernel: qdot.py's (Q5_K) within one float32 step plus float64 rounding of the scale-and-min
terms; qexact.py's (Q4_0, Q5_0, Q8_0, Q4_K, Q6_K), which sum in ggml's order
(test_ggml_numerics.py checks that bit for bit), within the rounding of that order: one
float32 rounding per step of a chain as long as the blocks of a row, on the magnitudes of the
terms, scales and mins apart."""
from __future__ import annotations

import numpy as np
import pytest

import ggmlpy as gg
from ggmlpy import GGMLType, quants
from ggmlpy.backend.cpu.plan import Scratch
from ggmlpy.backend.cpu.products.qmatmul import QuantMatrix, mul_mat_q
from ggmlpy.backend.cpu.products.type_table import cpu_type, round_activations


BLOCKS_32 = (GGMLType.Q4_0, GGMLType.Q5_0, GGMLType.Q8_0)
K_QUANTS = (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K)
SUPER_BLOCK_BYTES = {GGMLType.Q4_K: 144, GGMLType.Q5_K: 176}  # d, dmin: the first 4 bytes of each


def reference_f64(q: np.ndarray, m: int, k: int, x: np.ndarray, type: GGMLType) -> np.ndarray:
    w = quants.dequantize(q, type).reshape(m, k).astype(np.float64)
    xr = round_activations(np.array(x, dtype=np.float32), type).astype(np.float64)
    return xr @ w.T


def _scale_and_min_parts(q: np.ndarray, m: int, k: int, type: GGMLType) -> tuple[np.ndarray, np.ndarray]:
    """|d * scale * q| and |dmin * min| of every weight (the two terms a K-quant's weights
    are made of; the second is 0 for the other types), as float64 (m, k)."""
    if type not in SUPER_BLOCK_BYTES:
        return np.abs(quants.dequantize(q, type).reshape(m, k).astype(np.float64)), np.zeros((m, k))
    blocks = q.reshape(-1, SUPER_BLOCK_BYTES[type]).copy()
    no_min, no_scale = blocks.copy(), blocks.copy()
    no_min[:, 2:4] = 0  # dmin = 0
    no_scale[:, 0:2] = 0  # d = 0
    parts = [np.abs(quants.dequantize(b.reshape(-1), type).reshape(m, k).astype(np.float64)) for b in (no_min, no_scale)]
    return parts[0], parts[1]


def assert_equals_reference(out, q, m, k, x, type):
    """qdot's Q5_K: within one float32 step of it plus one float32 rounding per weight: its dequantized values
    (d * scale) * q - dmin * min, the reference's weights, are rounded to float32 where the
    kernel keeps the integer sums exact. qexact's types sum in ggml's order: per row a float32
    fma chain over the blocks (or 64-element chunks) and a final reduction, each step rounding
    once, the scales' and mins' sums kept apart until the end; the bound is one float32 step
    per step of the chain on the magnitudes of both."""
    ref = reference_f64(q, m, k, x, type)
    xr = np.abs(round_activations(np.array(x, dtype=np.float32), type).astype(np.float64))
    spacing = np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)
    if cpu_type(type).ggml_order:
        w_scale, w_min = _scale_and_min_parts(q, m, k, type)
        steps = k // 32 + 8
        bound = spacing + steps * 2.0 ** -24 * (xr @ (w_scale + w_min).T)
        assert np.all(np.abs(out - ref) <= bound), np.max(np.abs(out - ref) / bound)
        return
    w = np.abs(quants.dequantize(q, type).reshape(m, k).astype(np.float64))
    bound = spacing + 2.0 ** -24 * (xr @ w.T)
    assert np.all(np.abs(out - ref) <= bound), np.max(np.abs(out - ref) / bound)


def assert_few_column_kernel(type, n_columns=1):
    """The type has one few-column kernel on its blocks: qexact's (any column count) or qdot's."""
    assert cpu_type(type).plan_product(n_columns, 8, 256) is not None


@pytest.mark.parametrize("type", BLOCKS_32 + K_QUANTS, ids=lambda t: t.name)
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_every_type_equals_the_float64_product_of_the_rounded_activations(type, layout):
    rng = np.random.default_rng(int(type))
    m, k = 70, 512
    w = (rng.standard_normal((m, k)) * rng.uniform(0.01, 10, (m, 1))).astype(np.float32)
    w[1] += rng.uniform(0, 3)  # a row with an offset: the K-quants' mins at work
    w[0, :256] = 0.0  # an all-zero (super-)block
    q = quants.quantize(w, type)
    x = (rng.standard_normal((1, 2 * k)) * 3).astype(np.float32)
    x[0, :512] = 0.0  # all-zero activation blocks (the first 256 of the strided view)
    x = x[:, ::2] if layout == "strided" else np.ascontiguousarray(x[:, k:])
    big = np.full((3, 2 * m), np.nan, dtype=np.float32)
    out = big[1:2, ::2] if layout == "strided" else np.empty((1, m), np.float32)
    assert_few_column_kernel(type)
    mul_mat_q(QuantMatrix.from_bytes(type, q.reshape(m, -1), k), x, out, Scratch())
    assert_equals_reference(out, q, m, k, x, type)
    if layout == "strided":
        assert np.isnan(big[0]).all() and np.isnan(big[1, 1::2]).all()  # nothing written outside the view


@pytest.mark.parametrize("type", BLOCKS_32 + K_QUANTS, ids=lambda t: t.name)
def test_extreme_values_stay_exact(type):
    """Largest weights against largest activations: every float32 partial sum of a block is
    an integer below 2^24 (and every int32 one of the VNNI kernels exact), so nothing rounds
    before the scales."""
    rng = np.random.default_rng(11)
    m, k = 8, 256
    w = np.where(rng.random((m, k)) < 0.5, -1.0, 1.0).astype(np.float32) * 7.0
    w[:, ::7] = 7.5  # the top of the range after scaling
    q = quants.quantize(w, type)
    x = np.where(rng.random((1, k)) < 0.5, -5.0, 5.0).astype(np.float32)
    out = np.empty((1, m), np.float32)
    mul_mat_q(QuantMatrix.from_bytes(type, q.reshape(m, -1), k), x, out, Scratch())
    assert_equals_reference(out, q, m, k, x, type)


@pytest.mark.parametrize("type", [GGMLType.Q4_0, GGMLType.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("m, k", [(1, 32), (37, 64), (300, 640)])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_one_column_equals_the_float64_product_of_the_rounded_activations(type, m, k, layout):
    rng = np.random.default_rng(m + k)
    w = (rng.standard_normal((m, k)) * rng.uniform(0.01, 10, (m, 1))).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block (scale 0)
    q = quants.quantize(w, type)
    x = rng.standard_normal((1, 2 * k)).astype(np.float32)
    x[0, :64] = 0.0  # all-zero activation blocks
    x = x[:, ::2] if layout == "strided" else np.ascontiguousarray(x[:, :k])
    big = np.full((3, 2 * m), np.nan, dtype=np.float32)
    out = big[1:2, ::2] if layout == "strided" else np.empty((1, m), np.float32)
    assert_few_column_kernel(type)
    mul_mat_q(QuantMatrix.from_bytes(type, q.reshape(m, -1), k), x, out, Scratch())
    assert_equals_reference(out, q, m, k, x, type)
    if layout == "strided":
        assert np.isnan(big[0]).all() and np.isnan(big[1, 1::2]).all()  # nothing written outside the view


def test_rows_addressed_by_offset_in_a_shared_buffer():
    """Rows of a matrix inside a larger buffer (a memory-mapped file), in any order."""
    rng = np.random.default_rng(3)
    m, k = 20, 256
    q = quants.quantize(rng.standard_normal((m, k)).astype(np.float32), GGMLType.Q5_K).reshape(m, -1)
    row_bytes = q.shape[1]
    buf = np.zeros(7 + m * row_bytes, dtype=np.uint8)
    order = rng.permutation(m)
    for slot, r in enumerate(order):
        buf[7 + slot * row_bytes:7 + (slot + 1) * row_bytes] = q[r]
    offs = np.empty(m, dtype=np.int64)
    offs[order] = 7 + np.arange(m) * row_bytes
    x = rng.standard_normal((1, k)).astype(np.float32)
    out = np.empty((1, m), np.float32)
    assert cpu_type(GGMLType.Q5_K).plan_product(1, 8, 256) is not None
    mul_mat_q(QuantMatrix(GGMLType.Q5_K, buf, offs, k), x, out, Scratch())
    assert_equals_reference(out, q.reshape(-1), m, k, x, GGMLType.Q5_K)


def test_the_graph_product_of_one_token_takes_it_and_agrees_with_the_tile_path():
    rng = np.random.default_rng(5)
    m, k = 64, 256
    wq = quants.quantize(rng.standard_normal((m, k)).astype(np.float32), GGMLType.Q5_K)
    x = rng.standard_normal((1, k)).astype(np.float32)
    results = {}
    tile_path = cpu_type(GGMLType.Q5_K).packed.max_columns + 1  # the tile path (dequantize + BLAS): same rounded values
    for n_cols in (1, tile_path):
        ctx = gg.Context()
        w = ctx.from_numpy(wq.reshape(1, 1, m, -1), GGMLType.Q5_K)
        xt = ctx.from_numpy(np.repeat(x, n_cols, axis=0).reshape(1, 1, n_cols, k), GGMLType.F32)
        y = gg.mul_mat(ctx, w, xt)
        gg.compute(gg.new_graph(y))
        results[n_cols] = np.ascontiguousarray(y.array()).reshape(n_cols, m)[0].copy()
    assert_equals_reference(results[1][None], wq, m, k, x, GGMLType.Q5_K)
    np.testing.assert_allclose(results[tile_path], results[1], rtol=1e-5, atol=1e-5)
