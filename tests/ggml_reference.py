"""ggml-cpu's arithmetic (x86, AVX-512 build) written out in numpy, for tests/test_ggml_numerics.

Each function here transcribes a ggml kernel's float operations from its source (named in
the docstring) without sharing code with ggmlpy's kernels: numpy float32 arithmetic, a fused
multiply-add through 80-bit long double (the exact product and sum, rounded to 64 bits and
then to 24: the same as one rounding, as 64 >= 2 * 24 + 2), libm's expf and tanhf through
ctypes. The block layouts are ggml-common.h's.
"""
from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np

F32 = np.float32
LD = np.longdouble
_libm = ctypes.CDLL(ctypes.util.find_library("m"))
for _name in ("expf", "tanhf"):
    getattr(_libm, _name).restype = ctypes.c_float
    getattr(_libm, _name).argtypes = [ctypes.c_float]


def fma(a, b, c):
    """a * b + c rounded once to float32 (elementwise)."""
    return (LD(1) * np.asarray(a, F32) * np.asarray(b, F32) + np.asarray(c, F32)).astype(F32)


def expf(x):
    return np.vectorize(lambda v: F32(_libm.expf(float(v))), otypes=[F32])(np.asarray(x, F32))


def tanhf(x):
    return np.vectorize(lambda v: F32(_libm.tanhf(float(v))), otypes=[F32])(np.asarray(x, F32))


def half(x):
    return np.asarray(x, F32).astype(np.float16).astype(F32)


def hsum8(a):
    """AVX's hsum_float_8 over the last axis (8 lanes)."""
    a = np.asarray(a, F32)
    t = a[..., :4] + a[..., 4:]
    return (t[..., 0] + t[..., 2]) + (t[..., 1] + t[..., 3])


def reduce16(a):
    """GCC's _mm512_reduce_add_ps over the last axis (16 lanes)."""
    a = np.asarray(a, F32)
    t = a[..., :8] + a[..., 8:]
    u = t[..., :4] + t[..., 4:]
    return (u[..., 0] + u[..., 2]) + (u[..., 1] + u[..., 3])


def v_expf_avx512(x):
    """ggml_v_expf for __m512 (vec.h), elementwise."""
    x = np.asarray(x, F32)
    c = [F32(float.fromhex(h)) for h in ("0x1.0e4020p-7", "0x1.573e2ep-5", "0x1.555e66p-3", "0x1.fffdb6p-2",
                                         "0x1.ffffecp-1")]
    r = F32(float.fromhex("0x1.8p23"))
    with np.errstate(all="ignore"):
        z = fma(x, F32(float.fromhex("0x1.715476p+0")), r)
        n = z - r
        b = fma(-n, F32(float.fromhex("0x1.7f7d1cp-20")), fma(-n, F32(float.fromhex("0x1.62e4p-1")), x))
        u = b * b
        j = fma(fma(fma(c[0], b, c[1]), u, fma(c[2], b, c[3])), u, fma(c[4], b, F32(1.0)))
        res = (j.astype(np.float64) * np.exp2(np.where(np.isfinite(n), n, 0).astype(np.float64))).astype(F32)
        big = np.abs(n) > 192
        return np.where(big, np.where(n <= 0, F32(0.0), F32(np.inf)), np.where(np.isnan(n), n, res)).astype(F32)


# ---- activations -----------------------------------------------------------------------------
def quantize_q8_0(x):
    """quantize_row_q8_0 (x86): per 32 values d = half(amax / 127), q = rint(x * (127 / amax))."""
    x = np.asarray(x, F32).reshape(x.shape[0], -1, 32)
    amax = np.abs(x).max(-1)
    with np.errstate(divide="ignore"):
        idd = np.where(amax != 0, F32(127.0) / amax, F32(0.0)).astype(F32)
    q = np.rint((x * idd[..., None]).astype(F32)).astype(np.int64)
    return q.reshape(x.shape[0], -1), half(amax / F32(127.0))


def quantize_q8_k(x):
    """quantize_row_q8_K_ref: per 256 values the element of largest magnitude mx, iscale =
    -127 / mx, q = min(127, round-half-even(iscale * x)), d = 1 / iscale; sums of 16."""
    x = np.asarray(x, F32)
    n, k = x.shape
    xb = x.reshape(n, -1, 256)
    idx = np.abs(xb).argmax(-1)
    mx = np.take_along_axis(xb, idx[..., None], -1)[..., 0]
    with np.errstate(divide="ignore"):
        iscale = np.where(mx != 0, F32(-127.0) / mx, F32(0.0)).astype(F32)
        d = np.where(mx != 0, F32(1.0) / iscale, F32(0.0)).astype(F32)
    q = np.minimum(127, np.rint((iscale[..., None] * xb).astype(F32))).astype(np.int64)
    return q.reshape(n, k), d, q.reshape(n, -1, 16).sum(-1)


# ---- matrix blocks ---------------------------------------------------------------------------
def decode_q5_0(rows):
    """rows (M, 22 nb) uint8 -> integers (M, 32 nb), d (M, nb)."""
    b = rows.reshape(rows.shape[0], -1, 22)
    d = b[..., :2].copy().view(np.float16)[..., 0].astype(F32)
    qh = b[..., 2:6].copy().view(np.uint32)[..., 0].astype(np.int64)
    qs = b[..., 6:].astype(np.int64)
    nib = np.concatenate([qs & 15, qs >> 4], -1)
    bits = (qh[..., None] >> np.arange(32)) & 1
    return ((nib | (bits << 4)) - 16).reshape(rows.shape[0], -1), d


def decode_q4_0(rows):
    """rows (M, 18 nb) uint8 -> integers (M, 32 nb), d (M, nb)."""
    b = rows.reshape(rows.shape[0], -1, 18)
    d = b[..., :2].copy().view(np.float16)[..., 0].astype(F32)
    qs = b[..., 2:].astype(np.int64)
    return (np.concatenate([qs & 15, qs >> 4], -1) - 8).reshape(rows.shape[0], -1), d


def decode_q8_0(rows):
    b = rows.reshape(rows.shape[0], -1, 34)
    d = b[..., :2].copy().view(np.float16)[..., 0].astype(F32)
    return b[..., 2:].view(np.int8).astype(np.int64).reshape(rows.shape[0], -1), d


KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])  # ggml-common.h


def decode_iq4_nl(rows):
    """rows (M, 18 nb) uint8 -> integers (M, 32 nb) (kvalues_iq4nl[nibble]), d (M, nb)."""
    b = rows.reshape(rows.shape[0], -1, 18)
    d = b[..., :2].copy().view(np.float16)[..., 0].astype(F32)
    qs = b[..., 2:].astype(np.int64)
    return KVALUES_IQ4NL[np.concatenate([qs & 15, qs >> 4], -1)].reshape(rows.shape[0], -1), d


def _scale_min_k4(j, s):
    if j < 4:
        return s[..., j] & 63, s[..., j + 4] & 63
    return (s[..., j + 4] & 15) | ((s[..., j - 4] >> 6) << 4), (s[..., j + 4] >> 4) | ((s[..., j] >> 6) << 4)


def decode_q4_k(rows):
    """rows (M, 144 nb) -> q (M, 256 nb) 0..15, scales and mins (M, nb, 8), d and dmin (M, nb)."""
    b = rows.reshape(rows.shape[0], -1, 144)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(F32)
    dmin = b[..., 2:4].copy().view(np.float16)[..., 0].astype(F32)
    s = b[..., 4:16].astype(np.int64)
    sc = np.stack([_scale_min_k4(j, s)[0] for j in range(8)], -1)
    mn = np.stack([_scale_min_k4(j, s)[1] for j in range(8)], -1)
    qs = b[..., 16:].astype(np.int64).reshape(b.shape[0], b.shape[1], 4, 32)
    q = np.concatenate([qs & 15, qs >> 4], -1)  # chunk c: 32 low nibbles, then 32 high
    return q.reshape(rows.shape[0], -1), sc, mn, d, dmin


def decode_q6_k(rows):
    """rows (M, 210 nb) -> q (M, 256 nb) -32..31, scales (M, nb, 16), d (M, nb)."""
    b = rows.reshape(rows.shape[0], -1, 210)
    ql, qh = b[..., :128].astype(np.int64), b[..., 128:192].astype(np.int64)
    sc = b[..., 192:208].view(np.int8).astype(np.int64)
    d = b[..., 208:210].copy().view(np.float16)[..., 0].astype(F32)
    q = np.empty(b.shape[:2] + (256,), dtype=np.int64)
    for h in range(2):
        for g in range(4):
            lo = (ql[..., 64 * h + 32 * (g % 2):64 * h + 32 * (g % 2) + 32] >> (4 * (g // 2))) & 15
            hi = (qh[..., 32 * h:32 * h + 32] >> (2 * g)) & 3
            q[..., 128 * h + 32 * g:128 * h + 32 * g + 32] = (lo | (hi << 4)) - 32
    return q.reshape(rows.shape[0], -1), sc, d


# ---- products ----------------------------------------------------------------------------------
def mul_mat_q0(w, dw, x):
    """ggml_vec_dot_q5_0/q8_0_q8_0 and tinyBLAS_Q0_AVX: w (M, 32 nb) integers, dw (M, nb); x
    float32 activations (N, K). Returns (N, M)."""
    xq, dx = quantize_q8_0(x)
    n, m, nb = x.shape[0], w.shape[0], dw.shape[1]
    lanes = np.einsum("mbjt,nbjt->nmbj", w.reshape(m, nb, 8, 4), xq.reshape(n, nb, 8, 4))
    acc = np.zeros((n, m, 8), F32)
    for b in range(nb):
        s = (dw[None, :, b] * dx[:, None, b]).astype(F32)
        acc = fma(s[..., None], lanes[:, :, b].astype(F32), acc)
    return hsum8(acc)


def mul_mat_q0_blocks(w, dw, x):
    """The block-sum order of ggml's repacked Q4_0 (ggml_gemm / ggml_gemv_q4_0_8x8_q8_0) and of
    the fused output layer's Q5_0/Q8_0 logits (qexact's block_sums): per block the exact
    integer sum of 32 products, acc = fma(d_w * d_x, sum, acc) in block order. Arguments as
    mul_mat_q0's; returns (N, M)."""
    xq, dx = quantize_q8_0(x)
    n, m, nb = x.shape[0], w.shape[0], dw.shape[1]
    sums = np.einsum("mbe,nbe->nmb", w.reshape(m, nb, 32), xq.reshape(n, nb, 32))
    acc = np.zeros((n, m), F32)
    for b in range(nb):
        acc = fma((dw[None, :, b] * dx[:, None, b]).astype(F32), sums[:, :, b].astype(F32), acc)
    return acc


def mul_mat_q0_pairs(w, dw, x):
    """ggml_vec_dot_iq4_nl_q8_0 (x86 AVX2 path, one column at a time): blocks in pairs, the even
    ones in one chain of 8 lanes, the odd ones in another (lane j: the exact sum of the products
    4 j .. 4 j + 3, fma'd with d_w * d_x); hsum_float_8 of the chains added lane by lane; an
    unpaired last block added as sumf + d * sum, rounded twice. Arguments as mul_mat_q0's."""
    xq, dx = quantize_q8_0(x)
    n, m, nb = x.shape[0], w.shape[0], dw.shape[1]
    lanes = np.einsum("mbjt,nbjt->nmbj", w.reshape(m, nb, 8, 4), xq.reshape(n, nb, 8, 4))
    acc = np.zeros((2, n, m, 8), F32)
    for b in range(nb - nb % 2):
        s = (dw[None, :, b] * dx[:, None, b]).astype(F32)
        acc[b % 2] = fma(s[..., None], lanes[:, :, b].astype(F32), acc[b % 2])
    total = hsum8(acc[0] + acc[1])
    if nb % 2:
        d = (dw[None, :, -1] * dx[:, None, -1]).astype(F32)
        total = (total + (d * lanes[:, :, -1].sum(-1).astype(F32)).astype(F32)).astype(F32)
    return total


def mul_mat_q4_k(rows, x):
    """ggml's repacked Q4_K: columns in groups of 4 by ggml_gemm_q4_K_8x8_q8_K (per 64-element
    chunk), the rest by its gemv (per super-block)."""
    q, sc, mn, d, dmin = decode_q4_k(rows)
    xq, dx, bs16 = quantize_q8_k(x)
    n, m, nb = x.shape[0], rows.shape[0], d.shape[1]
    dots = np.einsum("msk,nsk->nms", q.reshape(m, nb * 8, 32), xq.reshape(n, nb * 8, 32)).reshape(n, m, nb, 8)
    isub = dots * sc[None]                                            # per sub-block
    bs32 = bs16.reshape(n, nb, 8, 2).sum(-1)
    imin = mn[None] * bs32[:, None]                                   # (n, m, nb, 8)
    out = np.empty((n, m), F32)
    n_gemm = n - n % 4
    acc = np.zeros((n, m), F32)
    accm = np.zeros((n, m), F32)
    for i in range(nb):
        sd = (d[None, :, i] * dx[:, None, i]).astype(F32)
        sm = (dmin[None, :, i] * dx[:, None, i]).astype(F32)
        for c in range(4):  # gemm: per chunk
            acc[:n_gemm] = fma((isub[:n_gemm, :, i, 2 * c] + isub[:n_gemm, :, i, 2 * c + 1]).astype(F32),
                               sd[:n_gemm], acc[:n_gemm])
            accm[:n_gemm] = fma((imin[:n_gemm, :, i, 2 * c] + imin[:n_gemm, :, i, 2 * c + 1]).astype(F32),
                                sm[:n_gemm], accm[:n_gemm])
        acc[n_gemm:] = fma(isub[n_gemm:, :, i].sum(-1).astype(F32), sd[n_gemm:], acc[n_gemm:])  # gemv
        accm[n_gemm:] = fma(imin[n_gemm:, :, i].sum(-1).astype(F32), sm[n_gemm:], accm[n_gemm:])
    out[:] = acc - accm
    return out


def mul_mat_q6_k(rows, x):
    """ggml-cpu/tiled from 8 columns (per super-block acc = fma(f(isum) * d_w, d_x, acc)),
    ggml_vec_dot_q6_K_q8_K (AVX2 lanes) below."""
    q, sc, d = decode_q6_k(rows)
    xq, dx, bs16 = quantize_q8_k(x)
    n, m, nb = x.shape[0], rows.shape[0], d.shape[1]
    if n >= 8:
        dots = np.einsum("msk,nsk->nms", q.reshape(m, nb * 16, 16), xq.reshape(n, nb * 16, 16)).reshape(n, m, nb, 16)
        isum = (dots * sc[None]).sum(-1)
        acc = np.zeros((n, m), F32)
        for i in range(nb):
            r = (isum[:, :, i].astype(F32) * d[None, :, i]).astype(F32)
            acc = fma(r, dx[:, None, i], acc)
        return acc
    u = (q + 32).reshape(m, nb, 2, 4, 8, 4)               # (h, g, lane, t) of each super-block
    xl = xq.reshape(n, nb, 2, 4, 8, 4)
    part = np.einsum("mihglt,nihglt->nmihgl", u, xl)       # 4 products per lane
    scale_idx = (8 * np.arange(2)[:, None, None] + 2 * np.arange(4)[None, :, None]
                 + (np.arange(8)[None, None, :] >= 4))     # (h, g, lane)
    lanes = (part * sc[:, :, scale_idx][None]).sum((3, 4))  # (n, m, nb, 8)
    sub = bs16.reshape(n, nb, 8, 2)[:, None] * sc.reshape(m, nb, 8, 2)[None]
    lanes = lanes - 32 * sub.sum(-1)
    acc = np.zeros((n, m, 8), F32)
    for i in range(nb):
        dd = (dx[:, None, i] * d[None, :, i]).astype(F32)
        acc = fma(dd[..., None], lanes[:, :, i].astype(F32), acc)
    return hsum8(acc)


def mul_mat_float(a, b, halves: bool):
    """MUL_MAT of F16 (halves) or F32 a (M, K) and F32 b (N, K), rounded to F16 for F16 a:
    tinyBLAS (AVX-512) when N >= 2, K % 16 == 0 and M % 4 == 0, else ggml_vec_dot_f16 or
    ggml_vec_dot_f32. Returns (N, M)."""
    if halves:
        a, b = half(a), half(b)
    m, k = a.shape
    n = b.shape[0]
    if n >= 2 and k % 16 == 0 and m % 4 == 0:
        acc = np.zeros((n, m, 16), F32)
        for l in range(0, k, 16):
            acc = fma(a[None, :, l:l + 16], b[:, None, l:l + 16], acc)
        return reduce16(acc)
    vec_dot = vec_dot_f16 if halves else vec_dot_f32
    return vec_dot(a[None, :, :], b[:, None, :])


def vec_dot_f16(x, y):
    """ggml_vec_dot_f16 (AVX-512 without FP16 arithmetic) over the last axis."""
    x, y = np.broadcast_arrays(half(x), half(y))
    k = x.shape[-1]
    np_ = k - k % 64
    acc = np.zeros(x.shape[:-1] + (64,), F32)
    for i in range(0, np_, 64):
        acc = fma(x[..., i:i + 64], y[..., i:i + 64], acc)
    s = acc.reshape(acc.shape[:-1] + (4, 16))
    s0 = s[..., 0, :] + s[..., 2, :]
    s1 = s[..., 1, :] + s[..., 3, :]
    total = reduce16(s0 + s1).astype(np.float64) if np_ else np.zeros(x.shape[:-1])
    for i in range(np_, k):
        total = total + (x[..., i] * y[..., i]).astype(np.float64)
    return total.astype(F32)


def vec_dot_f32(x, y):
    """ggml_vec_dot_f32 (AVX-512) over the last axis, its leftover loop `sumf += x[i]*y[i]` as
    GCC compiles it (-O3, FMA): the products of whole groups of 8 rounded then added in order,
    the last (k % 64) % 8 fused."""
    x, y = np.broadcast_arrays(np.asarray(x, F32), np.asarray(y, F32))
    k = x.shape[-1]
    np_ = k - k % 64
    acc = np.zeros(x.shape[:-1] + (64,), F32)
    for i in range(0, np_, 64):
        acc = fma(x[..., i:i + 64], y[..., i:i + 64], acc)
    s = acc.reshape(acc.shape[:-1] + (4, 16))
    total = reduce16((s[..., 0, :] + s[..., 2, :]) + (s[..., 1, :] + s[..., 3, :])) if np_ else np.zeros(x.shape[:-1], F32)
    fused = k - (k - np_) % 8
    for i in range(np_, fused):
        total = (total + (x[..., i] * y[..., i]).astype(F32)).astype(F32)
    for i in range(fused, k):
        total = fma(x[..., i], y[..., i], total)
    return total.astype(F32)


# ---- softmax and attention ---------------------------------------------------------------------
def soft_max_sum(w, mx):
    """ggml_vec_soft_max_f32 (AVX-512): (exp values, their sum in double) of rows w."""
    n = w.shape[-1]
    nc = n - n % 16
    p = np.empty_like(w)
    p[..., :nc] = v_expf_avx512(w[..., :nc] - mx[..., None])
    total = np.zeros(w.shape[:-1])
    for i in range(0, nc, 16):
        total = total + reduce16(p[..., i:i + 16]).astype(np.float64)
    for i in range(nc, n):
        p[..., i] = expf(w[..., i] - mx)
        total = total + p[..., i].astype(np.float64)
    return p, total


def soft_max(x, mask, scale, slope=1.0):
    """ggml_compute_forward_soft_max_f32 of rows x with mask rows (None: no mask)."""
    w = (np.asarray(x, F32) * F32(scale)).astype(F32)
    if mask is not None:
        w = fma(F32(slope), np.asarray(mask, F32), w)
    mx = w.max(-1)
    with np.errstate(all="ignore"):
        p, total = soft_max_sum(w, mx)
        return (p * (1.0 / total).astype(F32)[..., None]).astype(F32)


def flash_attn(q, k, v, mask, scale, softcap=0.0, slope=None, half_kv=True, tiled=None):
    """FLASH_ATTN_EXT (ops.cpp) of q (H, NQ, DK), k (HKV, NKV, DK), v (HKV, NKV, DV), mask
    (NQ, NKV) or None; slope per head or None. K, V halves when half_kv. Returns (NQ, H, DV):
    the tiled kernel from 64 query rows, the one-chunk kernel below (or as `tiled` says)."""
    h_, nq, dk = q.shape
    hkv, nkv, dv = v.shape
    k, v = (half(k), half(v)) if half_kv else (np.asarray(k, F32), np.asarray(v, F32))
    sc = F32(scale / softcap) if softcap else F32(scale)
    out = np.empty((nq, h_, dv), F32)
    for h in range(h_):
        hk = h // (h_ // hkv)
        sl = F32(1.0) if slope is None else F32(slope[h])
        mrow = np.zeros((nq, nkv), F32) if mask is None else (sl * np.asarray(mask, F32)).astype(F32)
        if (nq >= 64) if tiled is None else tiled:
            out[:, h] = _tiled(q[h], k[hk], v[hk], mrow, sc, softcap)
        else:
            out[:, h] = _one_chunk(q[h], k[hk], v[hk], mrow, sc, softcap, half_kv)
    return out


def _post(s, sc, softcap):
    s = (s * sc).astype(F32)
    return (tanhf(s) * F32(softcap)).astype(F32) if softcap else s


def _tiled(q, k, v, mrow, sc, softcap):
    nq, dk = q.shape
    nkv, dv = v.shape
    mx = np.full(nq, -np.inf, F32)
    sm = np.zeros(nq, F32)
    vkq = np.zeros((nq, dv), F32)
    with np.errstate(all="ignore"):
        for c0 in range(0, nkv, 64):
            kt = np.zeros((64, dk), F32)
            vt = np.zeros((64, dv), F32)
            kt[:min(64, nkv - c0)] = k[c0:c0 + 64]
            vt[:min(64, nkv - c0)] = v[c0:c0 + 64]
            kq = np.zeros((nq, 64), F32)
            for d in range(dk):  # fma chains over the head dimension
                kq = fma(kt[None, :, d], q[:, None, d], kq)
            kq = _post(kq, sc, softcap)
            m = np.full((nq, 64), -np.inf, F32)
            m[:, :min(64, nkv - c0)] = mrow[:, c0:c0 + 64]
            kq = (kq + m).astype(F32)
            tmax = kq.max(1)
            live = tmax != -np.inf
            mnew = np.maximum(mx, tmax)
            grow = live & (mnew > mx)
            ms = expf(np.where(grow, mx - mnew, 0))
            vkq = np.where(grow[:, None], (vkq * ms[:, None]).astype(F32), vkq)
            sm = np.where(grow, (sm * ms).astype(F32), sm)
            mx = np.where(live, mnew, mx)
            p, total = soft_max_sum(kq, np.where(live, mnew, 0))
            sm = np.where(live, (sm.astype(np.float64) + total).astype(F32), sm)
            p = np.where(live[:, None], p, F32(0.0))
            for c in range(64):  # fma chains over the cells
                vkq = fma(vt[None, c], p[:, c:c + 1], vkq)
    with np.errstate(divide="ignore"):
        inv = np.where(sm == 0, F32(0.0), (F32(1.0) / sm).astype(F32))
    return (vkq * inv[:, None]).astype(F32)


def _one_chunk(q, k, v, mrow, sc, softcap, half_kv):
    nq, dk = q.shape
    nkv, dv = v.shape
    out = np.empty((nq, dv), F32)
    qv = half(q) if half_kv else np.asarray(q, F32)
    for iq in range(nq):
        mx, sm = F32(-np.inf), F32(0.0)
        vkq = np.zeros(dv, F32)
        for ic in range(nkv):
            if mrow[iq, ic] == -np.inf:
                continue
            dot = vec_dot_f16(k[ic], qv[iq]) if half_kv else vec_dot_f32(k[ic], qv[iq])
            s = F32(_post(dot, sc, softcap) + mrow[iq, ic])
            ms, vs = F32(1.0), F32(1.0)
            if s > mx:
                ms = expf(mx - s)[()]
                mx = s
                vkq = (vkq * ms).astype(F32)
                if half_kv:
                    vkq = half(vkq)
            else:
                vs = expf(s - mx)[()]
            vkq = fma(v[ic], vs, vkq)
            if half_kv:
                vkq = half(vkq)
            sm = fma(sm, ms, vs)[()]
        inv = F32(0.0) if sm == 0 else F32(F32(1.0) / sm)
        out[iq] = (vkq * inv).astype(F32)
    return out
