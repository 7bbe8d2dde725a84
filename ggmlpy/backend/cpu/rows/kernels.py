"""numba kernels of the CPU backend, written to reproduce ggml's float32 arithmetic.

Arrays arrive in ggml order reversed: shape (ne3, ne2, ne1, ne0), any strides. Rows
(the innermost dimension) are independent. Kernels with much work per element (attention,
the transcendental activations) run their rows on numba's threads (parallel=True); the
cheap row passes (norms, adds, rope, row gathers and scatters) run on one thread: they cost
O(rows x width) next to the products' O(rows x width^2), while a parallel=True kernel
costs numba 0.5-4 s more to compile on a cold start (bench/compile_profile.py).
Accumulations that ggml does in `ggml_float` (double) are done in float64 here too.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ....half import f16_bits_to_f32, f32_to_f16_bits
from ....llvmir.scalar import fma_f32
from ....row_math import exp_f32, max_f32, sum_f64, sum_sq_f64
from ..simd import expf_avx512, reduce16

F32 = np.float32


@njit(cache=True, inline="always")
def _row_index(r, n2, n1):
    return r // (n2 * n1), (r // n1) % n2, r % n1


@njit(cache=True)
def rms_norm_f32(x, dst, eps):
    n3, n2, n1, n0 = x.shape
    for r in range(n3 * n2 * n1):
        i3, i2, i1 = _row_index(r, n2, n1)
        xr, dr = x[i3, i2, i1], dst[i3, i2, i1]
        mean = F32(sum_sq_f64(xr) / n0)
        sc = F32(1.0) / np.sqrt(mean + F32(eps))
        for i0 in range(n0):
            dr[i0] = xr[i0] * sc


OP_ADD, OP_SUB, OP_MUL, OP_DIV = 0, 1, 2, 3


@njit(cache=True, inline="always")
def _binary_op(x, y, op):
    if op == OP_ADD:
        return x + y
    if op == OP_SUB:
        return x - y
    if op == OP_MUL:
        return x * y
    return x / y


@njit(cache=True)
def binary_rows_f32(a, b, dst, op):
    """dst[r] = a[r] (op) b[r % rows(b)] for C-contiguous [rows, n0] arrays; one IEEE op per
    element, as numpy's. Indexed without row views (a view per row costs as much as the row);
    LLVM takes the op's branch out of the loop, which stays a vector loop."""
    n1, n0 = a.shape
    b1 = b.shape[0]
    for r in range(n1):
        rb = r % b1
        for i in range(n0):
            dst[r, i] = _binary_op(a[r, i], b[rb, i], op)


@njit(cache=True)
def norm_f32(x, dst, eps):
    n3, n2, n1, n0 = x.shape
    for r in range(n3 * n2 * n1):
        i3, i2, i1 = _row_index(r, n2, n1)
        xr, dr = x[i3, i2, i1], dst[i3, i2, i1]
        mean = F32(sum_f64(xr) / n0)
        for i0 in range(n0):
            dr[i0] = xr[i0] - mean
        variance = F32(sum_sq_f64(dr) / n0)
        sc = F32(1.0) / np.sqrt(variance + F32(eps))
        for i0 in range(n0):
            dr[i0] *= sc


@njit(cache=True)
def f16_to_f32(src_bits, dst):
    """dst = the float32 values of the half bits in src_bits (1-D, so the loop vectorises)."""
    for i in range(src_bits.shape[0]):
        dst[i] = f16_bits_to_f32(src_bits[i])


@njit(cache=True)
def f16_cells_to_f32(src_bits, dst, used):
    """dst[i3, :used] = the float32 values of src_bits[i3, :used] ([n3, n_kv, h, d], any
    strides: the KV streams of several sequences, each a view with a gap after its cells)."""
    n3, _, nh, nd = src_bits.shape
    for i3 in range(n3):
        for c in range(used):
            for h in range(nh):
                for d in range(nd):
                    dst[i3, c, h, d] = f16_bits_to_f32(src_bits[i3, c, h, d])


@njit(cache=True)
def set_rows_f16(src, idx, dst_bits):
    """Row i1 of src[i3, i2] goes, rounded to half, to row idx[i3 % c2, i2 % c1, i1] of
    dst_bits[i3, i2] (the bits of an F16 tensor)."""
    n3, n2, n1, n0 = src.shape
    c2, c1 = idx.shape[0], idx.shape[1]
    for r in range(n3 * n2 * n1):
        i3, i2, i1 = _row_index(r, n2, n1)
        row = idx[i3 % c2, i2 % c1, i1]
        for i0 in range(n0):
            dst_bits[i3, i2, row, i0] = f32_to_f16_bits(src[i3, i2, i1, i0])


@njit(cache=True)
def alibi_slope(max_bias, h, n_head):
    if max_bias <= 0.0:
        return F32(1.0)
    n_head_log2 = 1 << int(math.floor(math.log2(n_head)))
    m0 = F32(2.0) ** (F32(-max_bias) / F32(n_head_log2))
    m1 = F32(2.0) ** (F32(-max_bias / 2.0) / F32(n_head_log2))
    if h < n_head_log2:
        return m0 ** F32(h + 1)
    return m1 ** F32(2 * (h - n_head_log2) + 1)


@njit(cache=True)
def exp_shifted(v, shift):
    """v = exp(v - shift) in place."""
    for i in range(v.shape[0]):
        v[i] = exp_f32(v[i] - shift)


SOFT_MAX_CHUNK = 16  # the vector step of ggml_vec_soft_max_f32 in ggml's AVX-512 build


@njit(cache=True)
def finite_spans(mask, spans):
    """spans[i3, i2, i1] = (lo, hi) covering the entries of mask row (i3, i2, i1) above -inf,
    widened to multiples of SOFT_MAX_CHUNK from the row's start (capped at its end): ggml
    sums the row's exponentials in such chunks, and a chunk of -inf entries adds exactly 0,
    so only the span is computed (half of a causal mask). A row with no such entry gets an
    empty span."""
    m3, m2, m1, n0 = mask.shape
    for i3 in range(m3):
        for i2 in range(m2):
            for i1 in range(m1):
                row = mask[i3, i2, i1]
                lo = 0
                while lo < n0 and row[lo] == -np.inf:
                    lo += 1
                hi = n0
                while hi > lo and row[hi - 1] == -np.inf:
                    hi -= 1
                if hi > lo:
                    lo = lo - lo % SOFT_MAX_CHUNK
                    hi = min(n0, -(-hi // SOFT_MAX_CHUNK) * SOFT_MAX_CHUNK)
                spans[i3, i2, i1, 0] = lo
                spans[i3, i2, i1, 1] = hi


@njit(cache=True)
def _exp_minus(d, mx):
    """d = ggml_v_expf(d - mx): a vector loop (in place: nothing for LLVM to rule out)."""
    for i in range(d.shape[0]):
        d[i] = expf_avx512(d[i] - mx)


@njit(parallel=True, cache=True)
def soft_max_f32(x, mask, dst, scale, max_bias, has_mask, empty_row):
    """dst = softmax(x * scale + slope * mask) per row, as ggml_compute_forward_soft_max_f32
    computes it (simd.py): the mask added by fma, the exponentials of each 16 entries by
    ggml_v_expf and summed in GCC's _mm512_reduce_add_ps order, those sums added in double
    (entries past the last 16: libm's expf, added one by one), the row scaled by 1 / sum.

    A row whose mask is -inf everywhere is `empty_row`: NaN for ggml's soft_max
    (exp(-inf - -inf)), 0 for attention weights (a query that sees nothing outputs 0)."""
    n3, n2, n1, n0 = x.shape
    m3, m2 = mask.shape[0], mask.shape[1]
    spans = np.empty((m3, m2, mask.shape[2], 2), dtype=np.int64)
    if has_mask:
        finite_spans(mask, spans)
    sc = F32(scale)
    n_chunked = n0 - n0 % SOFT_MAX_CHUNK
    for r in prange(n3 * n2 * n1):
        i3, i2, i1 = _row_index(r, n2, n1)
        dr = dst[i3, i2, i1]
        lo, hi = 0, n0
        if has_mask:
            lo, hi = spans[i3 % m3, i2 % m2, i1, 0], spans[i3 % m3, i2 % m2, i1, 1]
        if lo >= hi:
            dr[:] = empty_row
            continue
        dr[:lo] = 0
        dr[hi:] = 0
        # views of the span, indexed from 0: a loop over range(lo, hi) would index with a
        # possibly negative number, which numba wraps around, and LLVM then keeps it scalar
        d, xr = dr[lo:hi], x[i3, i2, i1, lo:hi]
        if has_mask:
            mr = mask[i3 % m3, i2 % m2, i1, lo:hi]
            slope = alibi_slope(max_bias, i2, n2)
            for i0 in range(hi - lo):
                d[i0] = fma_f32(slope, mr[i0], xr[i0] * sc)
        else:
            for i0 in range(hi - lo):
                d[i0] = xr[i0] * sc
        mx = max_f32(d)
        n_vec = min(hi, n_chunked) - lo
        n_vec += (-n_vec) % SOFT_MAX_CHUNK  # the chunks' end (lo and n_chunked are multiples of 16)
        _exp_minus(d[:n_vec], mx)  # one vector loop, then the chunks' sums in their order
        total = 0.0
        for i0 in range(0, n_vec, SOFT_MAX_CHUNK):
            total += np.float64(reduce16(d, i0))
        for i0 in range(n_vec, hi - lo):
            e = F32(math.exp(d[i0] - mx))
            d[i0] = e
            total += np.float64(e)
        inv = F32(1.0 / total)
        for i0 in range(hi - lo):
            d[i0] *= inv


# fused multiply-adds where GCC fuses ggml's scalar code (-ffp-contract=fast on an FMA machine)
_FMA = {"contract"}


@njit(cache=True)
def attn_cells_seen(mask):
    """1 + the last cell some row of mask ([m3, m2, n_rows, n_kv]) does not mask (-inf): the
    cells attention reads."""
    n_kv = mask.shape[3]
    hi = 0
    for i3 in range(mask.shape[0]):
        for i2 in range(mask.shape[1]):
            for r in range(mask.shape[2]):
                j = n_kv
                while j > hi and mask[i3, i2, r, j - 1] == -np.inf:
                    j -= 1
                hi = max(hi, j)
    return hi


@njit(cache=True)
def _rope_yarn_corr_dim(n_dims, n_ctx_orig, n_rot, base):
    return F32(n_dims) * F32(math.log(F32(n_ctx_orig) / (F32(n_rot) * F32(2.0 * math.pi)))) / (F32(2.0) * F32(math.log(base)))


@njit(cache=True)
def rope_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow):
    start = math.floor(_rope_yarn_corr_dim(n_dims, n_ctx_orig, beta_fast, freq_base))
    end = math.ceil(_rope_yarn_corr_dim(n_dims, n_ctx_orig, beta_slow, freq_base))
    return F32(max(0.0, start)), F32(min(n_dims - 1.0, end))


@njit(cache=True)
def rope_cache(p, ne0, n_dims, freq_base, freq_scale, ext_factor, attn_factor, corr0, corr1, ff, has_ff, out_cos, out_sin):
    """cos/sin per rotated pair at position p, in ggml's iterative float32 order."""
    theta_scale = F32(freq_base) ** (F32(-2.0) / F32(n_dims))
    theta = F32(p)
    fs = F32(freq_scale)
    for i0 in range(0, ne0, 2):
        extrap = theta / (F32(ff[i0 // 2]) if has_ff else F32(1.0))
        interp = fs * extrap
        th = interp
        mscale = F32(attn_factor)
        if ext_factor != 0.0:
            y = (F32(i0 // 2) - F32(corr0)) / max(F32(0.001), F32(corr1) - F32(corr0))  # float32, as rope_yarn_ramp
            ramp = (F32(1.0) - min(F32(1.0), max(F32(0.0), y))) * F32(ext_factor)
            th = interp * (F32(1.0) - ramp) + extrap * ramp
            mscale *= F32(1.0) + F32(0.1) * F32(math.log(F32(1.0) / fs))
        out_cos[i0 // 2] = F32(math.cos(th)) * mscale
        out_sin[i0 // 2] = F32(math.sin(th)) * mscale
        theta *= theta_scale


@njit(cache=True)
def rope_table(pos, ff, n_dims, freq_base, freq_scale, ext_factor, attn_factor, corr0, corr1, has_ff, cos, sin):
    """cos[i], sin[i]: the n_dims/2 rotations at position pos[i] (ggml's rope cache)."""
    for i in range(pos.shape[0]):
        # angles for the n_dims/2 rotated pairs only: freq_factors holds just n_dims/2 values
        rope_cache(pos[i], n_dims, n_dims, freq_base, freq_scale, ext_factor, attn_factor, corr0, corr1, ff, has_ff,
                   cos[i], sin[i])


@njit(cache=True)
def same_values(a, b):
    """a == b element for element, of 1-D arrays (np.array_equal without its ~15 us of Python)."""
    if a.shape[0] != b.shape[0]:
        return False
    for i in range(a.shape[0]):
        if a[i] != b[i]:
            return False
    return True


@njit(cache=True, fastmath=_FMA)
def rope_f32(x, cos, sin, dst, n_dims, neox, sign):
    """Rotate pairs of each head by the token's row of cos/sin; `sign` -1 gives the inverse
    rotation (rope_back). Pairs are (k, k + n_dims/2) in NEOX mode, (2k, 2k + 1) otherwise.
    Indexed without row views (each costs about as much as rotating a short row).

    Compiled with fused multiply-adds as GCC compiles ggml's rotate_pairs (-ffp-contract=fast
    on an FMA machine): x0*cos - x1*sin rounds as ggml's does, bit for bit on Gemma 3's
    tensors from llama.cpp. (The angles, rope_cache, are not fused: the YaRN mix, the one
    multiply-add there, is unchecked against ggml's build.)"""
    n3, n2, n1, n0 = x.shape
    half = n_dims // 2
    sg = F32(sign)
    for r in range(n3 * n2):
        i3 = r // n2
        i2 = r % n2
        for i1 in range(n1):
            if neox:
                for k in range(half):
                    c, s = cos[i2, k], sin[i2, k] * sg
                    a, b = x[i3, i2, i1, k], x[i3, i2, i1, k + half]
                    dst[i3, i2, i1, k] = a * c - b * s
                    dst[i3, i2, i1, k + half] = a * s + b * c
            else:
                for k in range(half):
                    c, s = cos[i2, k], sin[i2, k] * sg
                    a, b = x[i3, i2, i1, 2 * k], x[i3, i2, i1, 2 * k + 1]
                    dst[i3, i2, i1, 2 * k] = a * c - b * s
                    dst[i3, i2, i1, 2 * k + 1] = a * s + b * c
            for i0 in range(n_dims, n0):
                dst[i3, i2, i1, i0] = x[i3, i2, i1, i0]


@njit(cache=True)
def get_rows(src, idx, dst):
    """dst[i12, i11, i10, :] = src[i12, i11, idx[i12, i11, i10], :] (with conversion to dst's type)."""
    n12, n11, n10 = idx.shape
    n0 = dst.shape[3]
    for r in range(n12 * n11 * n10):
        i12, i11, i10 = _row_index(r, n11, n10)
        row = idx[i12, i11, i10]
        for i0 in range(n0):
            dst[i12, i11, i10, i0] = src[i12, i11, row, i0]


SILU_CHUNK = 16  # ggml_vec_silu_f32 / ggml_vec_swiglu_f32's vector step (AVX-512 build)


@njit(cache=True, inline="always")
def _silu_vec(v):
    """ggml_v_silu: x / (1 + ggml_v_expf(0 - x)), on a row's full 16-element chunks."""
    return v / (F32(1.0) + expf_avx512(F32(0.0) - v))


@njit(cache=True, inline="always")
def _silu_tail(v):
    """ggml_silu_f32 (libm's expf), on the elements past a row's last full chunk."""
    return v / (F32(1.0) + F32(math.exp(-v)))


@njit(cache=True, inline="always")
def _silu_into(x, g, out, n_vec, gated):
    """out = silu(x) [* g]: ggml_v_silu over the full 16-element chunks, ggml_silu_f32 after."""
    if gated:
        for i in range(n_vec):
            out[i] = _silu_vec(x[i]) * g[i]
        for i in range(n_vec, x.shape[0]):
            out[i] = _silu_tail(x[i]) * g[i]
    else:
        for i in range(n_vec):
            out[i] = _silu_vec(x[i])
        for i in range(n_vec, x.shape[0]):
            out[i] = _silu_tail(x[i])


@njit(cache=True, error_model="numpy")  # numpy's: no zero-division branch in the vector loop
def _silu_row(x, g, out, n_vec, gated, inplace):
    """out = silu(x) [* g], written over x where `inplace` (out is x): LLVM vectorises a loop
    only where it can rule out that the output overlaps an input, which an output written
    over its input (the graph's in-place ops) never passes; one array for both keeps it a
    vector loop."""
    if inplace:
        _silu_into(x, g, x, n_vec, gated)
    else:
        _silu_into(x, g, out, n_vec, gated)


@njit(parallel=True, cache=True)
def silu_f32(x, dst):
    n3, n2, n1, n0 = x.shape
    n_vec = n0 - n0 % SILU_CHUNK
    inplace = x.ctypes.data == dst.ctypes.data and x.strides == dst.strides
    for r in prange(n3 * n2 * n1):
        i3, i2, i1 = _row_index(r, n2, n1)
        _silu_row(x[i3, i2, i1], x[i3, i2, i1], dst[i3, i2, i1], n_vec, False, inplace)


@njit(parallel=True, cache=True)
def swiglu_f32(a, b, dst):
    n3, n2, n1, n0 = a.shape
    n_vec = n0 - n0 % SILU_CHUNK
    inplace = a.ctypes.data == dst.ctypes.data and a.strides == dst.strides
    for r in prange(n3 * n2 * n1):
        i3, i2, i1 = _row_index(r, n2, n1)
        _silu_row(a[i3, i2, i1], b[i3, i2, i1], dst[i3, i2, i1], n_vec, True, inplace)


GELU_COEF_A = 0.044715
SQRT_2_OVER_PI = 0.79788456080286535587989211986876
GELU_TABLE_MAX = F32(10.0)  # beyond +-10 ggml's GELU is x or 0, not the table


@njit(cache=True, fastmath={"contract"})
def _gelu_table(out):
    """out[h] = ggml_gelu_f32 of the half with bits h, rounded to half, as float32: libm's
    tanhf, the multiply-adds fused as GCC fuses them on an FMA machine (ggml-cpu is built
    with -ffp-contract=fast), the roundings to half by the CPU's conversions, as ggml's."""
    for i in range(out.shape[0]):
        x = f16_bits_to_f32(np.uint16(i))
        g = F32(0.5) * x * (F32(1.0) + math.tanh(F32(SQRT_2_OVER_PI) * x * (F32(1.0) + F32(GELU_COEF_A) * x * x)))
        out[i] = f16_bits_to_f32(f32_to_f16_bits(g))


def gelu_table_f16() -> np.ndarray:
    """ggml's GELU table (ggml_table_gelu_f16, GGML_GELU_FP16): GELU of every half value,
    rounded to half, indexed by the half's bits, held as float32 values. Bit for bit the
    table of llama.cpp's CPU backend (tests/test_ggml_ops.py has its hash)."""
    out = np.empty(1 << 16, dtype=np.float32)
    with np.errstate(all="ignore"):
        _gelu_table(out)
    nan = np.isnan(out)
    out[nan] = np.copysign(np.float32(np.nan), out[nan])  # ggml's NaN entries carry no payload
    return out


GELU_TABLE = gelu_table_f16()


@njit(cache=True, inline="always")
def gelu_tab(x, table):
    """ggml_vec_gelu_f32 as ggml-cpu builds it (GGML_GELU_FP16): 0 at or below -10, x at or
    above 10, else the table's value at x rounded to half."""
    if x <= -GELU_TABLE_MAX:
        return F32(0.0)
    if x >= GELU_TABLE_MAX:
        return x
    return table[f32_to_f16_bits(x)]


@njit(parallel=True, cache=True)
def gelu_f32(x, dst, table):
    n3, n2, n1, n0 = x.shape
    for r in prange(n3 * n2 * n1):
        i3, i2, i1 = _row_index(r, n2, n1)
        for i0 in range(n0):
            dst[i3, i2, i1, i0] = gelu_tab(x[i3, i2, i1, i0], table)


@njit(parallel=True, cache=True)
def geglu_f32(a, b, dst, table):
    """gelu(a) * b as ggml_vec_geglu_f32 (0 where a <= -10, whatever b is)."""
    n3, n2, n1, n0 = a.shape
    for r in prange(n3 * n2 * n1):
        i3, i2, i1 = _row_index(r, n2, n1)
        for i0 in range(n0):
            x = a[i3, i2, i1, i0]
            dst[i3, i2, i1, i0] = F32(0.0) if x <= -GELU_TABLE_MAX else gelu_tab(x, table) * b[i3, i2, i1, i0]
