"""CPU kernels of ggmlpy against plain float64 numpy references.

Each reference below is written from ggml's definition of the op (ggml.h / ggml-cpu/ops.cpp),
not from ggmlpy's kernels: inputs are float32 (or the storage type under test), the
reference evaluates in float64, and the kernel's float32 result is compared with it.

Layouts: every op also runs on NON-CONTIGUOUS inputs, built the way graphs build them,
as views of a tensor with data (see `make`):
  contig  a plain tensor
  perm    dims 1 and 2 swapped in memory, then `permute(0, 2, 1, 3)` (like a permuted K/Q)
  trans   dims 0 and 1 swapped in memory, then `transpose` (ne0 is not unit-stride)
  pad     a `view_4d` with padded rows, a gap between dim-2 slices and a 1-element offset

Tolerances (float32 eps = 1.19e-7), checked as |got - ref| <= RTOL * scale element-wise:
  add/sub/mul/div must be correctly rounded: |err| <= eps/2 * |ref| (one IEEE float32 op).
  Everything else: RTOL = 1e-6 (about 8 ulp); `scale` is |ref| unless a test says otherwise, where
  the float32 computation has an unavoidable absolute error term:
    gelu, geglu   ggml's half table (GGML_GELU_FP16): x rounded to half, GELU rounded to half;
                  checked bit for bit against that definition in float64, one half-ulp apart
                  allowed where float32 and float64 round GELU to different halves
    scale+bias    |x*s| + |b|              (x*s + b cancels)
    norm          |ref| + |mean| / std     (x - mean cancels)
    soft_max      |ref| * (1 + |v| + max)  (exp turns the absolute error of v into a relative one)
    rope          (|x0| + |x1|) * mscale   (x0*cos - x1*sin cancels)
    mul_mat       sum_k |a_k| |b_k|        (float32 accumulation over K)
  Conversions (cpy, get_rows, set_rows, cont, views) are compared bit for bit.
"""
from __future__ import annotations

import hashlib
import itertools
import math

import numpy as np
import pytest
from numba import njit

import ggmlpy as gg
from ggmlpy import half
from ggmlpy import GGMLType as T
from ggmlpy.backend.cpu.attention.small_head_attention import MAX_HEAD_DIM as SMALL_HEAD_DIM

RTOL = 1e-6
F32_EPS = float(np.finfo(np.float32).eps)


# ---- helpers ---------------------------------------------------------------------------
def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, round to nearest, ties to even (finite values only).

    Written as a choice between the two neighbouring bf16 values in float64, independently
    of the bit trick ggmlpy.convert uses.
    """
    u = np.asarray(x, dtype=np.float32).view(np.uint32)
    trunc = (u >> 16).astype(np.uint32)  # toward zero
    lo = (trunc << 16).view(np.float32).astype(np.float64)
    hi = ((trunc + 1) << 16).view(np.float32).astype(np.float64)  # next bf16 away from zero
    x64 = np.asarray(x, dtype=np.float32).astype(np.float64)
    d_lo, d_hi = np.abs(x64 - lo), np.abs(hi - x64)
    up = (d_hi < d_lo) | ((d_hi == d_lo) & (trunc & 1 == 1))
    return np.where(up, trunc + 1, trunc).astype(np.uint16)


def bf16_value(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def encode(x: np.ndarray, type: T) -> np.ndarray:
    """Storage array for logical values x in a tensor of `type`."""
    if type == T.BF16:
        return bf16_bits(x)
    return np.asarray(x).astype(gg.traits(type).np_dtype)


def decode(stored: np.ndarray, type: T) -> np.ndarray:
    """Logical float64 values of a storage array."""
    if type == T.BF16:
        return bf16_value(stored)
    return np.asarray(stored).astype(np.float64)


LAYOUTS = ("contig", "perm", "trans", "pad")


def make(ctx: gg.Context, x: np.ndarray, layout: str = "contig", type: T = T.F32) -> gg.Tensor:
    """A tensor whose logical values (numpy shape ne3, ne2, ne1, ne0) are `x` stored as `type`."""
    assert x.ndim == 4
    stored = encode(x, type)
    n3, n2, n1, n0 = x.shape
    if layout == "contig":
        return ctx.from_numpy(stored, type)
    if layout == "perm":
        base = ctx.from_numpy(np.ascontiguousarray(stored.transpose(0, 2, 1, 3)), type)
        t = gg.permute(ctx, base, 0, 2, 1, 3)
        degenerate = n1 == 1 or n2 == 1
    elif layout == "trans":
        base = ctx.from_numpy(np.ascontiguousarray(stored.swapaxes(2, 3)), type)
        t = gg.transpose(ctx, base)
        degenerate = n0 == 1 or n1 == 1
    elif layout == "pad":
        buf = np.zeros((n3, n2 + 1, n1, n0 + 3), dtype=stored.dtype)  # rows padded, a gap after each dim-2 run
        buf[:, :n2, :, 1:n0 + 1] = stored
        base = ctx.from_numpy(buf, type)
        t = gg.view_4d(ctx, base, n0, n1, n2, n3, base.nb[1], base.nb[2], base.nb[3], offset=base.nb[0])
        degenerate = n1 * n2 * n3 == 1  # one row is contiguous whatever the row strides (ggml_is_contiguous)
    else:
        raise ValueError(layout)
    assert t.ne == (n0, n1, n2, n3)
    assert degenerate or not t.is_contiguous(), f"layout {layout} of {x.shape} is contiguous"
    return t


def run(out: gg.Tensor) -> np.ndarray:
    """Allocate and compute the graph of `out`; its values as a (ne3, ne2, ne1, ne0) array."""
    gg.compute(gg.new_graph(out))
    return np.ascontiguousarray(out.array())


def assert_close(got, ref, scale=None, rtol: float = RTOL) -> None:
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    finite = np.isfinite(ref)
    assert np.array_equal(got[~finite], ref[~finite]), "non-finite values differ"
    scale = np.abs(ref) if scale is None else np.broadcast_to(np.asarray(scale, dtype=np.float64), ref.shape)
    err, bound = np.abs(got - ref)[finite], rtol * scale[finite]
    bad = ~(err <= bound)
    if bad.any():
        worst = np.max(err / np.maximum(scale[finite], 1e-300))
        raise AssertionError(f"{bad.sum()} of {bad.size} values outside {rtol:g} * scale; worst |err|/scale = {worst:.3g}")


def bcast_tile(b: np.ndarray, shape) -> np.ndarray:
    """ggml's repeat of b over `shape`: element i of a dim of size n reads b at i % b.n."""
    idx = np.ix_(*[np.arange(n) % m for n, m in zip(shape, b.shape)])
    return b[idx]


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def randn(rng, shape, scale=1.0, offset=0.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale + offset).astype(np.float32)


# ---- binary element-wise -----------------------------------------------------------------
BINARY = {"add": (gg.add, np.add), "sub": (gg.sub, np.subtract), "mul": (gg.mul, np.multiply),
          "div": (gg.div, np.divide)}

# numpy shapes (ne3, ne2, ne1, ne0) of a and b; ggml repeats b wherever its size divides a's
BCAST_SHAPES = {
    "same": ((2, 3, 4, 64), (2, 3, 4, 64)),
    "ne0_64_vs_16": ((2, 3, 4, 64), (2, 3, 4, 16)),
    "size1_dims23": ((2, 3, 4, 64), (1, 1, 4, 64)),
    "per_dim2_scalar": ((2, 3, 4, 64), (1, 3, 1, 1)),
    "divisors_all_dims": ((4, 6, 4, 64), (2, 2, 2, 32)),
}
BINARY_LAYOUTS = [("contig", "contig"), ("perm", "contig"), ("contig", "pad"), ("trans", "perm"), ("pad", "trans")]


@pytest.mark.parametrize("layouts", BINARY_LAYOUTS, ids=lambda l: "-".join(l))
@pytest.mark.parametrize("shapes", BCAST_SHAPES.values(), ids=BCAST_SHAPES.keys())
@pytest.mark.parametrize("name", BINARY)
def test_binary(rng, name, shapes, layouts):
    op, ref_op = BINARY[name]
    a = randn(rng, shapes[0])
    b = randn(rng, shapes[1])
    if name == "div":
        b = (np.sign(b) * rng.uniform(0.5, 2.0, b.shape)).astype(np.float32)
    ctx = gg.Context()
    out = op(ctx, make(ctx, a, layouts[0]), make(ctx, b, layouts[1]))
    ref = ref_op(a.astype(np.float64), bcast_tile(b.astype(np.float64), a.shape))
    # a single float32 operation on exact float32 inputs: correctly rounded, within 0.5 ulp
    assert_close(run(out), ref, rtol=F32_EPS / 2)


def test_binary_rejects_non_divisor_broadcast():
    ctx = gg.Context()
    a = ctx.from_numpy(np.zeros((4, 64), np.float32))
    with pytest.raises(ValueError):
        gg.add(ctx, a, ctx.from_numpy(np.zeros((4, 24), np.float32)))


# ---- unary element-wise ------------------------------------------------------------------
def _gelu_ref(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def _gelu_ggml_ref(x, b=None):
    """GELU (times b) as ggml-cpu computes it (ggml_vec_gelu_f32 / ggml_vec_geglu_f32 with
    GGML_GELU_FP16): 0 at or below -10, x at or above 10, between them the entry of ggml's
    half table at x rounded to half (numpy's rounding here); float32 results."""
    from ggmlpy.backend.cpu.rows.kernels import GELU_TABLE
    x = np.asarray(x, dtype=np.float32)
    looked_up = GELU_TABLE[x.astype(np.float16).view(np.uint16)]
    act = np.where(x <= -10.0, np.float32(0.0), np.where(x >= 10.0, x, looked_up))
    if b is None:
        return act
    return np.where(x <= -10.0, np.float32(0.0), act * np.asarray(b, dtype=np.float32))


# name -> (build, input generator, reference, error scale)
UNARY = {
    "sqr": (gg.sqr, lambda r, s: randn(r, s, 3.0), np.square, None),
    "sqrt": (gg.sqrt, lambda r, s: r.uniform(0.01, 50.0, s).astype(np.float32), np.sqrt, None),
    "log": (gg.log, lambda r, s: r.uniform(0.01, 50.0, s).astype(np.float32), np.log, None),
    "exp": (gg.exp, lambda r, s: randn(r, s, 3.0), np.exp, None),
    "silu": (gg.silu, lambda r, s: randn(r, s, 4.0), lambda x: x / (1.0 + np.exp(-x)), None),
    "scale": (lambda ctx, a: gg.scale(ctx, a, 0.37), lambda r, s: randn(r, s, 3.0), lambda x: x * np.float64(np.float32(0.37)), None),
    "scale_bias": (lambda ctx, a: gg.scale(ctx, a, -1.5, 0.25), lambda r, s: randn(r, s, 3.0), lambda x: x * -1.5 + 0.25,
                   lambda x, ref: np.abs(x * 1.5) + 0.25),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", UNARY)
def test_unary(rng, name, layout):
    build, gen, ref_fn, scale_fn = UNARY[name]
    x = gen(rng, (2, 3, 5, 33))
    ctx = gg.Context()
    got = run(build(ctx, make(ctx, x, layout)))
    x64 = x.astype(np.float64)
    ref = ref_fn(x64)
    assert_close(got, ref, None if scale_fn is None else scale_fn(x64, ref))


@pytest.mark.parametrize("fn", ["silu_f32", "swiglu_f32"])
def test_silu_over_its_input_is_the_same(rng, fn):
    """The graph computes SiLU and SwiGLU over their input when it dies there: the same bits."""
    from ggmlpy.backend.cpu.rows import kernels as K
    a, g = randn(rng, (2, 3, 5, 37), 4.0), randn(rng, (2, 3, 5, 37))
    args = (a, g) if fn == "swiglu_f32" else (a,)
    out = np.empty_like(a)
    getattr(K, fn)(*args, out)
    over = a.copy()
    getattr(K, fn)(*((over, g) if fn == "swiglu_f32" else (over,)), over)
    np.testing.assert_array_equal(over, out)


# SHA-256 of ggml's GELU table (ggml_table_gelu_f16, 65,536 halves) as llama.cpp's CPU backend
# builds it: read from the vendored build's library (llama-cpp-python 0.3.36, AVX-512 machine)
# with ctypes after ggml_cpu_init(), `hashlib.sha256(bytes(table))`.
GGML_GELU_TABLE_SHA256 = "5eceda6f287dec9dc0bcfa24516d6744a031a5c52d1984688b4558aeb1daf909"


def test_gelu_table_is_ggmls():
    """Bit for bit ggml's table; and GELU rounded to half: float32's cancellation in
    1 + tanh(u) for x << 0 aside (|x| * 2 eps), within one half-ulp of the float64 GELU."""
    from ggmlpy.backend.cpu.rows.kernels import GELU_TABLE
    assert hashlib.sha256(GELU_TABLE.astype(np.float16).view(np.uint16).tobytes()).hexdigest() == GGML_GELU_TABLE_SHA256
    halves = np.arange(1 << 16).astype(np.uint16).view(np.float16)
    finite = np.isfinite(halves)
    x = halves[finite].astype(np.float64)
    ref = _gelu_ref(x)
    got = GELU_TABLE[finite].astype(np.float64)
    ulp = np.spacing(np.abs(ref).astype(np.float16)).astype(np.float64)
    assert np.all(np.abs(got - ref) <= ulp + np.abs(x) * 2 * F32_EPS)
    assert np.mean(got == ref.astype(np.float16)) > 0.99


def _gelu_inputs(rng, shape):
    """Normal values, plus the edges of the table: +-10 and just inside, large, -0."""
    x = randn(rng, shape, 3.0)
    edges = np.array([10.0, -10.0, 9.999, -9.999, 10.001, -10.001, 250.0, -250.0, -0.0, 0.0], np.float32)
    x.reshape(-1)[:edges.size] = edges
    return x


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gelu(rng, layout):
    x = _gelu_inputs(rng, (2, 3, 5, 33))
    ctx = gg.Context()
    np.testing.assert_array_equal(run(gg.gelu(ctx, make(ctx, x, layout))), _gelu_ggml_ref(x))


@pytest.mark.parametrize("layouts", [("contig", "contig"), ("perm", "contig"), ("contig", "trans"), ("pad", "perm")],
                         ids=lambda l: "-".join(l))
def test_geglu_split(rng, layouts):
    a, b = _gelu_inputs(rng, (2, 3, 4, 40)), randn(rng, (2, 3, 4, 40))
    b.reshape(-1)[1] = np.inf  # a = -10 there: 0 whatever b is (ggml writes 0)
    ctx = gg.Context()
    got = run(gg.geglu_split(ctx, make(ctx, a, layouts[0]), make(ctx, b, layouts[1])))
    np.testing.assert_array_equal(got, _gelu_ggml_ref(a, b))


GLU = {"swiglu": (gg.swiglu_split, lambda a: a / (1.0 + np.exp(-a)), None)}


@pytest.mark.parametrize("layouts", [("contig", "contig"), ("perm", "contig"), ("contig", "trans"), ("pad", "perm")],
                         ids=lambda l: "-".join(l))
@pytest.mark.parametrize("name", GLU)
def test_glu_split(rng, name, layouts):
    build, act, cancels = GLU[name]
    a, b = randn(rng, (2, 3, 4, 40), 3.0), randn(rng, (2, 3, 4, 40))
    ctx = gg.Context()
    got = run(build(ctx, make(ctx, a, layouts[0]), make(ctx, b, layouts[1])))
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    ref = act(a64) * b64
    assert_close(got, ref, np.maximum(np.abs(ref), np.abs(a64 * b64)) if cancels else None)


# ---- normalization -------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_rms_norm(rng, eps, layout):
    x = randn(rng, (2, 3, 5, 96), 2.0, 0.5)
    ctx = gg.Context()
    got = run(gg.rms_norm(ctx, make(ctx, x, layout), eps))
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt(np.mean(x64 ** 2, axis=-1, keepdims=True) + np.float32(eps))
    assert_close(got, ref)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_norm(rng, eps, layout):
    x = randn(rng, (2, 3, 5, 96), 2.0, 3.0)  # rows with a clear mean to remove
    ctx = gg.Context()
    got = run(gg.norm(ctx, make(ctx, x, layout), eps))
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=-1, keepdims=True)
    std = np.sqrt(((x64 - mean) ** 2).mean(axis=-1, keepdims=True) + np.float32(eps))
    ref = (x64 - mean) / std
    assert_close(got, ref, np.abs(ref) + np.abs(mean) / std)


# ---- soft_max_ext ---------------------------------------------------------------------------
def alibi_slopes(n_head: int, max_bias: float) -> np.ndarray:
    """ALiBi slope per head, as ggml defines it (ggml_soft_max_ext with max_bias > 0)."""
    if max_bias <= 0:
        return np.ones(n_head)
    n_log2 = 2 ** int(math.floor(math.log2(n_head)))
    m0 = 2.0 ** (-max_bias / n_log2)
    m1 = 2.0 ** (-(max_bias / 2.0) / n_log2)
    return np.array([m0 ** (h + 1) if h < n_log2 else m1 ** (2 * (h - n_log2) + 1) for h in range(n_head)])


def soft_max_ref(x, mask, scale, max_bias):
    """softmax over rows of x*scale + slope[head]*mask, mask repeated over dims 2/3 by index modulo."""
    v = x.astype(np.float64) * np.float64(np.float32(scale))
    if mask is not None:
        n3, n2, n1, n0 = x.shape
        m = mask[np.ix_(np.arange(n3) % mask.shape[0], np.arange(n2) % mask.shape[1], np.arange(n1), np.arange(n0))]
        v = v + alibi_slopes(n2, max_bias)[None, :, None, None] * m
    mx = v.max(axis=-1, keepdims=True)
    e = np.exp(v - mx)
    ref = e / e.sum(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        err_scale = ref * (1.0 + np.where(np.isfinite(v), np.abs(v), 0.0) + np.abs(mx))
    return ref, err_scale


def causal_mask(rng, n2, n3, n1_pad, n0, n_kv_valid=None, alibi=False) -> np.ndarray:
    """Mask rows with -inf after a causal limit (every row keeps at least one entry)."""
    m = np.zeros((n3, n2, n1_pad, n0), dtype=np.float32)
    for i1 in range(n1_pad):
        limit = n0 - n1_pad + i1 + 1 if n_kv_valid is None else n_kv_valid
        m[..., i1, max(limit, 1):] = -np.inf
        if alibi:
            m[..., i1, :max(limit, 1)] = -np.arange(max(limit, 1))[::-1]  # -distance, as llama.cpp fills it
        else:
            m[..., i1, :max(limit, 1)] += rng.uniform(-1, 0, m[..., i1, :max(limit, 1)].shape)
    return m


SOFT_MAX_CASES = {
    # name: (x shape, mask shape (ne3, ne2, ne1, ne0) or None, mask type, scale, max_bias)
    "no_mask": ((2, 3, 5, 40), None, None, 1.0, 0.0),
    "no_mask_scaled": ((2, 3, 5, 40), None, None, 0.125, 0.0),
    "mask_f32": ((2, 3, 5, 40), (1, 1, 5, 40), T.F32, 0.125, 0.0),
    "mask_f16": ((2, 3, 5, 40), (1, 1, 5, 40), T.F16, 0.125, 0.0),
    "mask_padded_rows": ((2, 3, 5, 40), (1, 1, 8, 40), T.F32, 1.0, 0.0),
    "mask_bcast_dim2": ((2, 6, 5, 40), (1, 3, 5, 40), T.F32, 0.5, 0.0),
    "mask_bcast_dim3": ((4, 3, 5, 40), (2, 1, 5, 40), T.F16, 0.5, 0.0),
    "mask_per_head_batch": ((2, 3, 5, 40), (2, 3, 5, 40), T.F32, 0.5, 0.0),
    "alibi_6_heads": ((2, 6, 5, 40), (1, 1, 5, 40), T.F32, 0.125, 8.0),
    "alibi_4_heads_f16": ((1, 4, 5, 40), (1, 1, 5, 40), T.F16, 1.0, 8.0),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", SOFT_MAX_CASES.values(), ids=SOFT_MAX_CASES.keys())
def test_soft_max_ext(rng, case, layout):
    x_shape, m_shape, m_type, scale, max_bias = case
    x = randn(rng, x_shape, 2.0)
    ctx = gg.Context()
    a = make(ctx, x, layout)
    mask_vals = None
    mask = None
    if m_shape is not None:
        m3, m2, m1, m0 = m_shape
        mask_f32 = causal_mask(rng, m2, m3, m1, m0, alibi=max_bias > 0)
        mask_vals = decode(encode(mask_f32, m_type), m_type)  # F16 masks hold f16-rounded values
        # the padded-rows case also reads its mask through a strided view
        mask = make(ctx, mask_f32, "pad" if m1 > x_shape[2] else "contig", m_type)
    got = run(gg.soft_max_ext(ctx, a, mask, scale, max_bias))
    ref, err_scale = soft_max_ref(x, mask_vals, scale, max_bias)
    assert_close(got, ref, err_scale)
    if mask_vals is not None:
        masked = np.isinf(bcast_tile(mask_vals[:, :, :x_shape[2]], x_shape))
        assert masked.any() and np.all(got[masked] == 0.0)
    np.testing.assert_allclose(got.sum(axis=-1), 1.0, rtol=4e-6)


def test_soft_max_alibi_slopes_differ_per_head(rng):
    """With max_bias > 0 the mask is weighted per head: heads must not share one result."""
    x = np.zeros((1, 6, 2, 16), dtype=np.float32)
    mask = -np.arange(16, dtype=np.float32)[::-1].copy() * np.ones((1, 1, 2, 16), np.float32)
    ctx = gg.Context()
    got = run(gg.soft_max_ext(ctx, ctx.from_numpy(x), ctx.from_numpy(mask), 1.0, 8.0))
    ref, err_scale = soft_max_ref(x, mask.astype(np.float64), 1.0, 8.0)
    assert_close(got, ref, err_scale)
    assert len({round(float(v), 6) for v in got[0, :, 0, -1]}) == 6


# ---- flash_attn_ext ----------------------------------------------------------------------------
def flash_attn_ref(q, k, v, mask, scale, max_bias, softcap, half_steps=0):
    """softmax(q.k * scale [then softcap * tanh(s / softcap), ggml's logit softcap] + slope * mask) . v
    in float64 (a query that sees no cell outputs 0); q: (n3, n_head, n_q, dk), k/v: (n3, n_head_kv,
    n_kv, d), mask: (m3, m2, >= n_q, n_kv) or None.
    Returns (out (n3, n_q, n_head, dv), error scale): the score error of float32 dot products
    becomes a relative error of the weights through exp, and the weighted sum adds its own;
    `half_steps` roundings of the output sum to half (ggml's one-chunk kernel over an F16 V)
    add up to one half-ulp each."""
    n3, n_head, n_q, _ = q.shape
    group = n_head // k.shape[1]
    kk, vv = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.einsum("bhqd,bhkd->bhqk", q, kk) * np.float64(np.float32(scale))
    dot_abs = np.einsum("bhqd,bhkd->bhqk", np.abs(q), np.abs(kk)) * abs(scale)
    if softcap:
        s = np.tanh(s / softcap) * softcap
    if mask is not None:
        m = mask[np.ix_(np.arange(n3) % mask.shape[0], np.arange(n_head) % mask.shape[1], np.arange(n_q),
                        np.arange(mask.shape[3]))]
        s = s + alibi_slopes(n_head, max_bias)[None, :, None, None] * m
    mx = s.max(axis=-1, keepdims=True)
    seen = np.isfinite(mx)
    p = np.where(seen, np.exp(s - np.where(seen, mx, 0.0)), 0.0)
    total = p.sum(axis=-1, keepdims=True)
    w = np.divide(p, total, out=np.zeros_like(p), where=total > 0)
    out = w @ vv
    spread = np.max(np.where(np.isfinite(s), dot_abs + np.abs(s), 0.0), axis=-1, keepdims=True)
    err_scale = (w @ np.abs(vv)) * (1.0 + spread + np.sqrt(kk.shape[2]) + half_steps * 2.0 ** -11 / RTOL)
    return out.transpose(0, 2, 1, 3), err_scale.transpose(0, 2, 1, 3)


FLASH_ATTN_CASES = {
    # name: (n3, n_head, n_head_kv, n_q, n_kv, dk, dv, mask (m3, m2) or None, kv type, scale, max_bias, softcap)
    "small_heads_gqa": (2, 8, 4, 70, 96, 8, 8, (2, 1), T.F16, 0.35, 0.0, 0.0),
    "one_mask_for_all": (3, 4, 4, 33, 40, 8, 8, (1, 1), T.F32, 0.25, 0.0, 0.0),
    "decode_one_query": (2, 8, 4, 1, 96, 8, 8, (2, 1), T.F16, 0.35, 0.0, 0.0),
    "no_mask": (1, 4, 2, 40, 50, 64, 64, None, T.F32, 0.125, 0.0, 0.0),
    "alibi": (1, 6, 3, 20, 30, 8, 8, (1, 1), T.F32, 0.5, 8.0, 0.0),
    "softcap": (2, 4, 2, 35, 64, 8, 8, (2, 1), T.F16, 0.125, 0.0, 30.0),
    "wide_heads_blas": (1, 4, 1, 40, 64, 256, 256, (1, 1), T.F16, 0.0625, 0.0, 0.0),
    "wide_heads_softcap": (1, 2, 1, 20, 32, 128, 128, (1, 1), T.F32, 0.09, 0.0, 20.0),
}


@pytest.mark.parametrize("layout", ("contig", "perm"))
@pytest.mark.parametrize("case", FLASH_ATTN_CASES.values(), ids=FLASH_ATTN_CASES.keys())
def test_flash_attn_ext(rng, case, layout):
    n3, n_head, n_head_kv, n_q, n_kv, dk, dv, mask_dims, kv_type, scale, max_bias, softcap = case
    q = randn(rng, (n3, n_head, n_q, dk))
    k = randn(rng, (n3, n_head_kv, n_kv, dk))
    v = randn(rng, (n3, n_head_kv, n_kv, dv))
    ctx = gg.Context()
    mask_vals = mask = None
    if mask_dims is not None:
        m3, m2 = mask_dims
        n_q_pad = -(-n_q // 16) * 16  # llama.cpp pads the mask's rows
        mask_f32 = causal_mask(rng, m2, m3, n_q_pad, n_kv, alibi=max_bias > 0)
        mask_f32[0, 0, 1] = -np.inf  # a query that sees no cell: its output is 0
        mask_vals = decode(encode(mask_f32, T.F16), T.F16)
        mask = ctx.from_numpy(encode(mask_f32, T.F16), T.F16)
    # K and V as the cache holds them (cells by heads), seen as [d, n_kv, n_head_kv, n3]
    k_t = make(ctx, k, layout, kv_type)
    v_t = make(ctx, v, layout, kv_type)
    out = gg.flash_attn_ext(ctx, make(ctx, q, layout), k_t, v_t, mask, scale, max_bias, softcap)
    got = run(out)
    # under 64 query rows ggml takes its one-chunk kernel: Q rounded to the K type, the output
    # summed in the V type (halves: a rounding per cell and per rescale); bit for bit in
    # test_ggml_numerics. Small heads take small_head_attention.py: float32 throughout.
    one_chunk_half = n_q < 64 and kv_type == T.F16 and max(dk, dv) > SMALL_HEAD_DIM
    q_ref = decode(encode(q, T.F16), T.F16) if one_chunk_half else q.astype(np.float64)
    ref, err_scale = flash_attn_ref(q_ref, decode(encode(k, kv_type), kv_type), decode(encode(v, kv_type), kv_type),
                                    mask_vals, scale, max_bias, softcap, half_steps=2 * n_kv if one_chunk_half else 0)
    assert_close(got, ref, err_scale)
    if mask_dims is not None and n_q > 1:
        assert np.all(got[0, 1] == 0.0)  # the query that sees no cell


# ---- rope_ext ----------------------------------------------------------------------------------
def yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow):
    def corr_dim(n_rot):
        return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(freq_base))
    return max(0.0, math.floor(corr_dim(beta_fast))), min(n_dims - 1.0, math.ceil(corr_dim(beta_slow)))


def rope_angles(pos, n_dims, n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow, ff):
    """cos/sin (n_tokens, n_dims/2) and the magnitude scale, as ggml's rope_yarn / rope_cache_init define them.

    ggml defines the angle by a float32 recurrence (theta *= theta_scale per pair, then
    /freq_factor, *freq_scale and the YaRN mix, all in float32). Its rounding grows with the
    position (|error| ~ p * k * eps rad), far above 1e-6 at p ~ 1000, so the angle is
    reproduced with numpy float32 scalars in ggml's order; cos, sin and the rotation are float64.
    """
    f32 = np.float32
    half = n_dims // 2
    theta_scale = f32(f32(freq_base) ** (f32(-2.0) / f32(n_dims)))
    low, high = yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow)
    mscale = float(attn_factor)
    if ext_factor != 0.0:
        mscale *= 1.0 + 0.1 * math.log(1.0 / freq_scale)
    theta = np.asarray(pos).astype(np.float32)
    cos = np.empty((len(pos), half))
    sin = np.empty((len(pos), half))
    for k in range(half):
        extrap = theta / (f32(ff[k]) if ff is not None else f32(1.0))
        interp = f32(freq_scale) * extrap
        th = interp
        if ext_factor != 0.0:
            y = (f32(k) - f32(low)) / f32(max(0.001, high - low))
            ramp = (f32(1.0) - min(f32(1.0), max(f32(0.0), y))) * f32(ext_factor)
            th = interp * (f32(1.0) - ramp) + extrap * ramp
        cos[:, k] = np.cos(th.astype(np.float64))
        sin[:, k] = np.sin(th.astype(np.float64))
        theta = theta * theta_scale
    return cos, sin, mscale


def rope_ref(x, pos, n_dims, mode, cos, sin, mscale):
    """Rotate pairs (2k, 2k+1) (NORM) or (k, k + n_dims/2) (NEOX) of each head by angle [token, k]."""
    x = x.astype(np.float64)
    out = x.copy()
    scale = np.abs(x) * mscale
    half = n_dims // 2
    k = np.arange(half)
    j0, j1 = (k, k + half) if mode == gg.ROPE_TYPE_NEOX else (2 * k, 2 * k + 1)
    c = cos[None, :, None, :] * mscale  # x: (ne3, tokens, heads, head_dim)
    s = sin[None, :, None, :] * mscale
    x0, x1 = x[..., j0], x[..., j1]
    out[..., j0] = x0 * c - x1 * s
    out[..., j1] = x0 * s + x1 * c
    err = scale.copy()
    err[..., j0] = err[..., j1] = (np.abs(x0) + np.abs(x1)) * mscale
    err[..., n_dims:] = 0.0  # untouched dims are copied exactly
    return out, err


ROPE_CASES = {
    # name: (head_dim, n_dims, freq_base, freq_scale, with freq_factors, ext_factor, attn_factor)
    "full": (64, 64, 10000.0, 1.0, False, 0.0, 1.0),
    "partial_n_dims": (48, 32, 10000.0, 1.0, False, 0.0, 1.0),
    "base_scale": (64, 64, 500000.0, 0.25, False, 0.0, 1.0),
    "freq_factors": (64, 64, 500000.0, 1.0, True, 0.0, 1.0),
    "freq_factors_partial": (48, 32, 10000.0, 0.5, True, 0.0, 1.0),
    "yarn": (64, 64, 10000.0, 0.25, False, 1.0, 1.0),
    "yarn_partial_attn": (48, 32, 1000000.0, 0.125, True, 0.5, 0.9),
}


@pytest.mark.parametrize("layout", ["contig", "perm", "pad"])
@pytest.mark.parametrize("mode", [gg.ROPE_TYPE_NORM, gg.ROPE_TYPE_NEOX], ids=["norm", "neox"])
@pytest.mark.parametrize("case", ROPE_CASES.values(), ids=ROPE_CASES.keys())
def test_rope_ext(rng, case, mode, layout):
    head_dim, n_dims, base, fscale, with_ff, ext, attn = case
    n_ctx_orig, beta_fast, beta_slow = 64, 32.0, 1.0
    pos = np.array([0, 1, 7, 63, 200, 4095, 3], dtype=np.int32)
    x = randn(rng, (2, len(pos), 3, head_dim))  # ne: [head_dim, n_head, n_tokens, 2]
    ff = rng.uniform(1.0, 8.0, n_dims // 2).astype(np.float32) if with_ff else None
    ctx = gg.Context()
    out = gg.rope_ext(ctx, make(ctx, x, layout), ctx.from_numpy(pos, T.I32),
                      ctx.from_numpy(ff) if with_ff else None, n_dims, mode, n_ctx_orig, base, fscale, ext, attn,
                      beta_fast, beta_slow)
    got = run(out)
    cos, sin, mscale = rope_angles(pos, n_dims, n_ctx_orig, base, fscale, ext, attn, beta_fast, beta_slow, ff)
    ref, err = rope_ref(x, pos, n_dims, mode, cos, sin, mscale)
    assert_close(got, ref, err)
    np.testing.assert_array_equal(got[..., n_dims:], x[..., n_dims:])


@pytest.mark.parametrize("mode", [gg.ROPE_TYPE_NORM, gg.ROPE_TYPE_NEOX], ids=["norm", "neox"])
def test_rope_matches_closed_form_angles(rng, mode):
    """Sanity check of the recurrence itself: theta_k = p * base^(-2k/n_dims), exact in float64.

    The float32 recurrence drifts by at most ~ p * k * eps rad, which bounds the tolerance here.
    """
    n_dims, base = 64, 10000.0
    pos = np.arange(0, 40, 3, dtype=np.int32)
    x = randn(rng, (1, len(pos), 2, n_dims))
    ctx = gg.Context()
    got = run(gg.rope_ext(ctx, ctx.from_numpy(x), ctx.from_numpy(pos, T.I32), None, n_dims, mode, 64, base, 1.0))
    theta = pos[:, None].astype(np.float64) * base ** (-2.0 * np.arange(n_dims // 2) / n_dims)
    ref, err = rope_ref(x, pos, n_dims, mode, np.cos(theta), np.sin(theta), 1.0)
    assert_close(got, ref, err, rtol=RTOL + 2 * pos.max() * (n_dims // 2) * F32_EPS)


def test_rope_neox_pairs_halves_norm_pairs_neighbours():
    """Structure check: with p=1 and one active pair, NORM rotates (0,1), NEOX rotates (0, n_dims/2)."""
    n_dims = 4
    x = np.zeros((1, 1, 1, 6), np.float32)
    x[..., :] = [1, 2, 3, 4, 5, 6]
    for mode, pair in ((gg.ROPE_TYPE_NORM, (0, 1)), (gg.ROPE_TYPE_NEOX, (0, 2))):
        ctx = gg.Context()
        got = run(gg.rope_ext(ctx, ctx.from_numpy(x), ctx.from_numpy(np.array([1], np.int32), T.I32), None,
                              n_dims, mode, 64, 10000.0, 1.0))[0, 0, 0]
        a, b = x[0, 0, 0, pair[0]], x[0, 0, 0, pair[1]]
        assert got[pair[0]] == pytest.approx(a * math.cos(1) - b * math.sin(1), rel=1e-6)
        assert got[pair[1]] == pytest.approx(a * math.sin(1) + b * math.cos(1), rel=1e-6)
        np.testing.assert_array_equal(got[4:], [5, 6])


# ---- get_rows / set_rows --------------------------------------------------------------------------
GET_ROWS_CASES = {
    # name: (table numpy shape (ne3, ne2, rows, ne0), index numpy shape (1, ne12, ne11, ne10))
    "1d_indices": ((1, 1, 10, 24), (1, 1, 1, 7)),
    "2d_indices": ((1, 3, 10, 24), (1, 1, 3, 5)),
    "3d_indices": ((2, 3, 10, 24), (1, 2, 3, 4)),
}


@pytest.mark.parametrize("layouts", [("contig", "contig"), ("perm", "contig"), ("pad", "perm"), ("trans", "pad")],
                         ids=lambda l: "-".join(l))
@pytest.mark.parametrize("case", GET_ROWS_CASES.values(), ids=GET_ROWS_CASES.keys())
@pytest.mark.parametrize("type", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_get_rows(rng, type, case, layouts):
    a_shape, i_shape = case
    table = randn(rng, a_shape)
    idx = rng.integers(0, a_shape[2], i_shape).astype(np.int32)
    idx.flat[0] = a_shape[2] - 1  # the last row is reachable
    ctx = gg.Context()
    out = gg.get_rows(ctx, make(ctx, table, layouts[0], type), make(ctx, idx, layouts[1], T.I32))
    got = run(out)
    assert out.type == T.F32 and got.dtype == np.float32
    values = decode(encode(table, type), type)  # the table as stored
    n12, n11, n10 = i_shape[1:]
    ref = np.empty((n12, n11, n10, a_shape[3]))
    for i12, i11, i10 in itertools.product(range(n12), range(n11), range(n10)):
        ref[i12, i11, i10] = values[i12, i11, idx[0, i12, i11, i10]]
    np.testing.assert_array_equal(got, ref)


SET_ROWS_CASES = {
    # name: (rows numpy shape (ne3, ne2, n, ne0), index numpy shape (1, c2, c1, n)); destination has 10 rows
    "2d": ((1, 1, 4, 24), (1, 1, 1, 4)),
    "per_dim2_indices": ((1, 3, 4, 24), (1, 1, 3, 4)),
    "indices_bcast_dim2_dim3": ((2, 2, 4, 24), (1, 1, 1, 4)),
    "indices_per_dim3": ((2, 2, 4, 24), (1, 2, 1, 4)),
}


@pytest.mark.parametrize("dst_layout", ["contig", "pad"])
@pytest.mark.parametrize("src_layout", ["contig", "perm", "trans"])
@pytest.mark.parametrize("case", SET_ROWS_CASES.values(), ids=SET_ROWS_CASES.keys())
@pytest.mark.parametrize("idx_type", [T.I32, T.I64], ids=lambda t: t.name)
@pytest.mark.parametrize("dst_type", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_set_rows(rng, dst_type, idx_type, case, src_layout, dst_layout):
    b_shape, c_shape = case
    n3, n2, n, n0 = b_shape
    rows = 10
    dst0 = randn(rng, (n3, n2, rows, n0))
    src = randn(rng, b_shape)
    idx = np.stack([rng.permutation(rows)[:n] for _ in range(c_shape[1] * c_shape[2])]).reshape(c_shape)
    ctx = gg.Context()
    dst = make(ctx, dst0, dst_layout, dst_type)
    out = gg.set_rows(ctx, dst, make(ctx, src, src_layout), make(ctx, idx, "contig", idx_type))
    got = run(out)
    ref = encode(dst0, dst_type)
    src_stored = encode(src, dst_type)
    for i3, i2, i in itertools.product(range(n3), range(n2), range(n)):
        ref[i3, i2, idx[0, i3 % c_shape[1], i2 % c_shape[2], i]] = src_stored[i3, i2, i]
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(dst.array(), ref)  # the destination itself was written


def test_set_rows_rejects_rows_that_do_not_match_destination_dims_2_3():
    """ggml asserts a.ne2 == b.ne2 and a.ne3 == b.ne3 (no silent partial write)."""
    ctx = gg.Context()
    a = ctx.from_numpy(np.zeros((2, 10, 24), np.float32))
    b = ctx.from_numpy(np.ones((1, 4, 24), np.float32))
    with pytest.raises(ValueError):
        gg.set_rows(ctx, a, b, ctx.from_numpy(np.arange(4, dtype=np.int64), T.I64))


def test_set_rows_leaves_padding_alone(rng):
    """Writing through a strided destination view touches only the view's elements."""
    ctx = gg.Context()
    buf = np.full((1, 1, 6, 16), 7.0, np.float32)
    base = ctx.from_numpy(buf)
    dst = gg.view_2d(ctx, base, 8, 3, base.nb[1] * 2, offset=base.nb[0] * 4)  # every other row, columns 4..11
    src = randn(rng, (1, 1, 2, 8))
    run(gg.set_rows(ctx, dst, ctx.from_numpy(src), ctx.from_numpy(np.array([2, 0], np.int64), T.I64)))
    expected = buf.copy()
    expected[0, 0, 4, 4:12] = src[0, 0, 0]
    expected[0, 0, 0, 4:12] = src[0, 0, 1]
    np.testing.assert_array_equal(base.array(), expected)


# ---- cpy / cont ----------------------------------------------------------------------------------
def special_values(rng, shape) -> np.ndarray:
    """Random floats plus bf16 ties, f16 subnormals and exact halves, in a float32 array."""
    x = randn(rng, shape, 10.0).reshape(-1)
    ties = (bf16_bits(rng.standard_normal(8).astype(np.float32)).astype(np.uint32) << 16) | 0x8000
    x[:8] = ties.view(np.float32)  # exactly half-way between two bf16 values
    x[8:12] = [6.0e-6, -3.0e-7, 2.0 ** -24 * 3, 1.0 + 2.0 ** -11]  # f16 subnormals and an f16 tie
    x[12:14] = [0.0, -0.0]
    return x.reshape(shape)


CPY_TYPES = [(T.F32, T.F16), (T.F16, T.F32), (T.F32, T.BF16), (T.BF16, T.F32), (T.F32, T.F32), (T.F16, T.F16)]


@pytest.mark.parametrize("dst_kind", ["same_shape", "transposed_dst_view", "new_shape"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("types", CPY_TYPES, ids=lambda t: f"{t[0].name}->{t[1].name}")
def test_cpy(rng, types, layout, dst_kind):
    src_type, dst_type = types
    x = special_values(rng, (2, 3, 4, 10))
    ctx = gg.Context()
    src = make(ctx, x, layout, src_type)
    values = decode(encode(x, src_type), src_type)  # what the source holds
    if dst_kind == "same_shape":
        dst = make(ctx, np.zeros(x.shape, np.float32), "contig", dst_type)
        ref_values = values
    elif dst_kind == "transposed_dst_view":  # like writing V into a transposed cache
        dst = make(ctx, np.zeros(x.shape, np.float32), "trans", dst_type)
        ref_values = values
    else:
        dst = make(ctx, np.zeros((1, 4, 6, 10), np.float32), "contig", dst_type)
        ref_values = values.reshape(1, 4, 6, 10)  # ggml copies in element order
    got = run(gg.cpy(ctx, src, dst))
    np.testing.assert_array_equal(got.view(np.uint8), encode(ref_values.astype(np.float32), dst_type).view(np.uint8))
    np.testing.assert_array_equal(np.ascontiguousarray(dst.array()).view(np.uint8), got.view(np.uint8))


@pytest.mark.parametrize("new_shape", [None, (6, 40), (3, 4, 20)], ids=["same", "2d", "3d"])
@pytest.mark.parametrize("layout", ["perm", "trans", "pad"])
@pytest.mark.parametrize("type", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_cont(rng, type, layout, new_shape):
    x = randn(rng, (2, 3, 4, 10))
    ctx = gg.Context()
    src = make(ctx, x, layout, type)
    out = gg.cont(ctx, src) if new_shape is None else gg.cont(ctx, src, *new_shape)
    got = run(out)
    assert out.is_contiguous() and out.type == type
    stored = encode(x, type)
    ref = stored if new_shape is None else stored.reshape((1,) * (4 - len(new_shape)) + new_shape[::-1])
    np.testing.assert_array_equal(got, ref)


# ---- mul_mat ---------------------------------------------------------------------------------------
MUL_MAT_CASES = {
    # name: (a numpy shape (ne03, ne02, ne01, ne00), b numpy shape (ne13, ne12, ne11, ne10))
    "2d": ((1, 1, 24, 64), (1, 1, 7, 64)),
    "vector": ((1, 1, 24, 64), (1, 1, 1, 64)),
    "b_batched_over_one_a": ((1, 1, 24, 64), (2, 3, 5, 64)),
    "batched": ((2, 3, 12, 64), (2, 3, 5, 64)),
    "gqa_dim2": ((1, 2, 12, 64), (1, 6, 5, 64)),
    "gqa_dim3": ((2, 1, 12, 64), (4, 1, 5, 64)),
    "gqa_dim2_dim3": ((2, 2, 12, 64), (4, 6, 5, 64)),
}
MUL_MAT_LAYOUTS = [("contig", "contig"), ("trans", "contig"), ("perm", "contig"), ("contig", "perm"),
                   ("pad", "trans"), ("perm", "pad")]


def mul_mat_ref(a64, b64):
    """dst[i3, i2, i1, i0] = dot(a[i3 / r3, i2 / r2, i0, :], b[i3, i2, i1, :]) with r = b.ne / a.ne."""
    r3, r2 = b64.shape[0] // a64.shape[0], b64.shape[1] // a64.shape[1]
    a_rep = np.repeat(np.repeat(a64, r3, axis=0), r2, axis=1)  # block repeat: i02 = i12 / r2
    ref = np.einsum("xyik,xyjk->xyji", a_rep, b64)
    scale = np.einsum("xyik,xyjk->xyji", np.abs(a_rep), np.abs(b64))
    return ref, scale


@pytest.mark.parametrize("layouts", MUL_MAT_LAYOUTS, ids=lambda l: "-".join(l))
@pytest.mark.parametrize("case", MUL_MAT_CASES.values(), ids=MUL_MAT_CASES.keys())
@pytest.mark.parametrize("a_type", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_mul_mat(rng, a_type, case, layouts):
    a_shape, b_shape = case
    a, b = randn(rng, a_shape), randn(rng, b_shape)
    ctx = gg.Context()
    out = gg.mul_mat(ctx, make(ctx, a, layouts[0], a_type), make(ctx, b, layouts[1]))
    assert out.ne == (a_shape[2], b_shape[2], b_shape[1], b_shape[0])
    got = run(out)
    # ggml converts b to a's type before the dot products (vec_dot_type of F16/BF16)
    b_used = decode(encode(b, a_type), a_type)
    ref, scale = mul_mat_ref(decode(encode(a, a_type), a_type), b_used)
    assert_close(got, ref, scale)


def test_mul_mat_gqa_uses_block_mapping_not_modulo(rng):
    """b matrices 0..2 use a's matrix 0 and 3..5 use matrix 1 (i02 = i12 / (ne12 / ne02))."""
    a = np.stack([np.full((1, 4, 8), v, np.float32) for v in (1.0, 2.0)], axis=1)  # (1, 2, 4, 8)
    b = np.ones((1, 6, 1, 8), np.float32)
    ctx = gg.Context()
    got = run(gg.mul_mat(ctx, ctx.from_numpy(a), ctx.from_numpy(b)))
    np.testing.assert_array_equal(got[0, :, 0, 0], [8, 8, 8, 16, 16, 16])


def test_mul_mat_rejects_bad_broadcast():
    ctx = gg.Context()
    a = ctx.from_numpy(np.zeros((3, 4, 8), np.float32))  # ne2 = 3 does not divide b's ne2 = 4
    with pytest.raises(ValueError):
        gg.mul_mat(ctx, a, ctx.from_numpy(np.zeros((4, 2, 8), np.float32)))


# ---- views -------------------------------------------------------------------------------------------
def permute_ref(x4: np.ndarray, axes) -> np.ndarray:
    """ggml_permute: ggml dim i of the source becomes dim axes[i]; numpy axis j is ggml dim 3 - j."""
    src_dim_of = {ax: i for i, ax in enumerate(axes)}  # result ggml dim -> source ggml dim
    return np.transpose(x4, [3 - src_dim_of[3 - j] for j in range(4)])


@pytest.mark.parametrize("axes", list(itertools.permutations(range(4))), ids=lambda a: "".join(map(str, a)))
def test_permute(rng, axes):
    x = randn(rng, (2, 3, 4, 5))
    ctx = gg.Context()
    out = gg.permute(ctx, ctx.from_numpy(x), *axes)
    got = run(out)
    np.testing.assert_array_equal(got, permute_ref(x, axes))
    np.testing.assert_array_equal(run(gg.cont(ctx, out)), permute_ref(x, axes))


def test_transpose_and_views_of_views(rng):
    x = randn(rng, (2, 3, 4, 5))
    ctx = gg.Context()
    t = ctx.from_numpy(x)
    tr = gg.transpose(ctx, t)
    np.testing.assert_array_equal(run(tr), x.swapaxes(2, 3))
    # permute of a transpose of a strided view: offsets and strides compose
    v = gg.view_4d(ctx, t, 3, 4, 2, 2, t.nb[1], t.nb[2], t.nb[3], offset=2 * t.nb[0])
    p = gg.permute(ctx, gg.transpose(ctx, v), 2, 0, 1, 3)
    ref = permute_ref(x[..., 2:5][:, :2].swapaxes(2, 3), (2, 0, 1, 3))
    np.testing.assert_array_equal(run(p), ref)
    np.testing.assert_array_equal(run(gg.cont(ctx, p)), ref)


def test_view_and_reshape(rng):
    x = randn(rng, (1, 2, 6, 8))  # ne (8, 6, 2)
    ctx = gg.Context()
    t = ctx.from_numpy(x)
    es = t.nb[0]
    # 1-D window
    np.testing.assert_array_equal(run(gg.view_1d(ctx, t, 10, 5 * es)).reshape(-1), x.reshape(-1)[5:15])
    # 2-D window: rows 1..3 of matrix 1, columns 2..6
    v2 = gg.view_2d(ctx, t, 5, 3, t.nb[1], t.nb[2] + t.nb[1] + 2 * es)
    np.testing.assert_array_equal(run(v2)[0, 0], x[0, 1, 1:4, 2:7])
    # 3-D window with every other row
    v3 = gg.view_3d(ctx, t, 4, 3, 2, 2 * t.nb[1], t.nb[2], 4 * es)
    np.testing.assert_array_equal(run(v3)[0], x[0, :, 0::2, 4:8])
    # reshape keeps element order
    np.testing.assert_array_equal(run(gg.reshape_2d(ctx, t, 16, 6))[0, 0], x.reshape(6, 16))
    np.testing.assert_array_equal(run(gg.reshape_4d(ctx, t, 4, 2, 3, 4)), x.reshape(4, 3, 2, 4))
    with pytest.raises(ValueError):
        gg.reshape_2d(ctx, gg.transpose(ctx, t), 16, 6)  # not contiguous
    with pytest.raises(ValueError):
        gg.view_2d(ctx, t, 8, 13, t.nb[1])  # past the end


def test_views_of_intermediates(rng):
    """Views of computed tensors read the computed bytes (reshape / transpose / window of exp(x))."""
    x = randn(rng, (1, 1, 6, 8))
    ctx = gg.Context()
    e = gg.exp(ctx, ctx.from_numpy(x))
    ref = np.exp(x.astype(np.float64))
    r = gg.reshape_2d(ctx, e, 12, 4)
    tr = gg.transpose(ctx, e)
    w = gg.view_2d(ctx, e, 3, 2, e.nb[1] * 2, e.nb[0] * 5)
    outs = [gg.cont(ctx, r), gg.cont(ctx, tr), gg.scale(ctx, w, 2.0)]
    graph = gg.new_graph(*outs)
    for o in outs:
        o.set_output()
    gg.compute(graph)
    assert_close(outs[0].array()[0, 0], ref.reshape(4, 12))
    assert_close(outs[1].array()[0, 0], ref[0, 0].T)
    assert_close(outs[2].array()[0, 0], 2 * ref[0, 0, 0:4:2, 5:8])


# ---- concat ---------------------------------------------------------------------------------
@pytest.mark.parametrize("layouts", [("contig", "contig"), ("perm", "pad"), ("trans", "contig")], ids=lambda l: "-".join(l))
@pytest.mark.parametrize("dim", [0, 1, 2, 3])
def test_concat(rng, dim, layouts):
    a_shape = [2, 3, 4, 5]
    b_shape = list(a_shape)
    b_shape[3 - dim] = 2
    a, b = randn(rng, a_shape), randn(rng, b_shape)
    ctx = gg.Context()
    got = run(gg.concat(ctx, make(ctx, a, layouts[0]), make(ctx, b, layouts[1]), dim))
    assert np.array_equal(got, np.concatenate([a, b], axis=3 - dim))


# ---- half-precision bits in numba (the KV cache's writes and the attention's reads) -----------------
@njit(cache=True)
def _halves_to_f32_select(bits, out):
    for i in range(bits.shape[0]):
        out[i] = half.f16_bits_to_f32_select(bits[i])


@njit(cache=True)
def _f32_to_halves_select(x, out):
    for i in range(x.shape[0]):
        out[i] = half.f32_to_f16_bits_select(x[i])


def _f16_kernels(path: str):
    """(halves -> float32, float32 -> halves) through the kernels the backend runs, or
    through the integer-select versions used on CPUs without conversion instructions."""
    from ggmlpy.backend.cpu.rows import kernels as K

    if path == "select":
        return _halves_to_f32_select, _f32_to_halves_select

    def to_halves(x, out):
        src = x.reshape(1, 1, -1, 1)
        K.set_rows_f16(src, np.arange(x.shape[0], dtype=np.int64).reshape(1, 1, -1), out.reshape(1, 1, -1, 1))
    return K.f16_to_f32, to_halves


@pytest.mark.parametrize("path", ["backend", "select"])
def test_f16_bits_round_trip_as_numpy(path):
    """Every half bit pattern decodes to numpy's value, and float32 values (ties, subnormals,
    overflow, inf, NaN included) round to numpy's half bits (NaNs compared as NaN: the CPU's
    conversion quietens signaling ones)."""
    to_f32, to_halves = _f16_kernels(path)
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = np.empty(halves.shape, np.float32)
    to_f32(halves, got)
    ref = halves.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32))

    rng = np.random.default_rng(11)
    finite = ref[np.isfinite(ref)].astype(np.float64)
    finite.sort()
    x = np.concatenate([
        rng.standard_normal(200_000).astype(np.float32) * np.float32(2.0) ** rng.integers(-30, 20, 200_000),
        (finite[:-1] + np.diff(finite) / 2).astype(np.float32),  # every tie between neighbouring halves
        np.array([65504.0, 65520.0, 65519.99, 1e6, -1e6, np.inf, -np.inf, 0.0, -0.0, 2.0 ** -25, 2.0 ** -26, np.nan],
                 np.float32)])
    bits = np.zeros(x.shape[0], np.uint16)
    to_halves(x, bits)
    with np.errstate(over="ignore", invalid="ignore"):  # numpy warns when it rounds to inf, as it should
        ref_bits = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(bits[~nan], ref_bits[~nan])
    assert np.all(np.isnan(bits[nan].view(np.float16)))


def test_f16_cells_of_several_streams_as_numpy():
    """The KV reader of several sequences' streams: each stream a strided view of its first
    cells (a gap after them, heads before cells), converted up to `used` cells, as numpy."""
    from ggmlpy.backend.cpu.rows import kernels as K
    rng = np.random.default_rng(3)
    cache = rng.standard_normal((4, 2, 64, 16)).astype(np.float16)  # [streams, heads, kv_size, d]
    cells = cache[:, :, :40].transpose(0, 2, 1, 3)                 # [streams, n_kv 40, heads, d]: not contiguous
    assert not cells.flags.c_contiguous
    out = np.full(cells.shape, np.nan, np.float32)
    K.f16_cells_to_f32(cells.view(np.uint16), out, 33)
    np.testing.assert_array_equal(out[:, :33], cells[:, :33].astype(np.float32))
    assert np.isnan(out[:, 33:]).all()  # cells past `used` are not read
