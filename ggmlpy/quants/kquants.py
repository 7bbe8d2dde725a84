"""The 256-element super-block types Q2_K .. Q6_K and Q8_K (ggml-common.h layouts).

  Q2_K   84 bytes: scales[16] (4-bit scale | 4-bit min << 4), qs[64], d, dmin (f16)
  Q3_K  110 bytes: hmask[32], qs[64], scales[12] (16 6-bit scales), d
  Q4_K  144 bytes: d, dmin, scales[12] (8 6-bit scales, 8 6-bit mins), qs[128]
  Q5_K  176 bytes: d, dmin, scales[12], qh[32], qs[128]
  Q6_K  210 bytes: ql[128], qh[64], scales[16] (int8), d
  Q8_K  292 bytes: d (f32), qs[256] (int8), bsums[16] (int16 sums of 16 quants)

Element e of a super-block: Q2_K/Q3_K take 2 bits at shift 2*((e%128)//32) of
qs[32*(e//128) + e%32] (Q3_K's high bit is bit e//32 of hmask[e%32], set meaning "no
-4"), scale e//16; Q4_K/Q5_K take the low (high) nibble of qs[32*(e//64) + e%32] for
e%64 < 32 (>= 32), scale/min e//32, fifth bit e//32 of qh[e%32]; Q6_K is described
at its kernel.

Kernel signatures as in simple.py. Quantizers follow ggml's quantize_row_*_ref (no
importance matrix), float32 operation for operation, without fused multiply-adds.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .common import F32, QK_K, f16_to_f32, nearest_int, put_f16

GROUP_MAX_EPS = F32(1e-15)


@njit(cache=True, inline="always")
def scale_min_k4(j, buf, o):
    """ggml's getscale_min_k4: 6-bit scale and min j of the 12 bytes at buf[o]."""
    if j < 4:
        return np.int32(buf[o + j]) & 63, np.int32(buf[o + j + 4]) & 63
    sc = (np.int32(buf[o + j + 4]) & 0xF) | ((np.int32(buf[o + j - 4]) >> 6) << 4)
    m = (np.int32(buf[o + j + 4]) >> 4) | ((np.int32(buf[o + j]) >> 6) << 4)
    return sc, m


@njit(cache=True, inline="always")
def _q3_scale(j, buf, o):
    """Signed 6-bit scale j of Q3_K's 12 scale bytes at buf[o] (already minus 32)."""
    lo = (np.int32(buf[o + j]) & 0xF) if j < 8 else (np.int32(buf[o + j - 8]) >> 4)
    hi = (np.int32(buf[o + 8 + j % 4]) >> (2 * (j // 4))) & 3
    return (lo | (hi << 4)) - 32


@njit(cache=True, inline="always")
def _f32_at(buf, o):
    u = (np.int64(buf[o]) | (np.int64(buf[o + 1]) << 8)
         | (np.int64(buf[o + 2]) << 16) | (np.int64(buf[o + 3]) << 24))
    return np.uint32(u).view(np.float32)


# ---- dequantize --------------------------------------------------------------------
@njit(parallel=True, cache=True)
def dequantize_q2_k(buf, offs, dst):
    nb = dst.shape[1] // QK_K
    for r in prange(offs.shape[0]):
        y = dst[r]
        for i in range(nb):
            o = offs[r] + i * 84
            d = f16_to_f32(buf[o + 80], buf[o + 81])
            dmin = f16_to_f32(buf[o + 82], buf[o + 83])
            for h in range(2):
                for j in range(4):
                    for s in range(2):
                        isc = 8 * h + 2 * j + s
                        sc = np.int32(buf[o + isc])
                        dl = d * F32(sc & 0xF)
                        ml = dmin * F32(sc >> 4)
                        base = i * QK_K + 128 * h + 32 * j + 16 * s
                        qo = o + 16 + 32 * h + 16 * s
                        for l in range(16):
                            q = (np.int32(buf[qo + l]) >> (2 * j)) & 3
                            y[base + l] = dl * F32(q) - ml


@njit(parallel=True, cache=True)
def dequantize_q3_k(buf, offs, dst):
    nb = dst.shape[1] // QK_K
    for r in prange(offs.shape[0]):
        y = dst[r]
        for i in range(nb):
            o = offs[r] + i * 110
            d_all = f16_to_f32(buf[o + 108], buf[o + 109])
            for h in range(2):
                for j in range(4):
                    for s in range(2):
                        isc = 8 * h + 2 * j + s
                        dl = d_all * F32(_q3_scale(isc, buf, o + 96))
                        base = i * QK_K + 128 * h + 32 * j + 16 * s
                        qo = o + 32 + 32 * h + 16 * s
                        ho = o + 16 * s
                        bit = 4 * h + j
                        for l in range(16):
                            q = (np.int32(buf[qo + l]) >> (2 * j)) & 3
                            hb = (np.int32(buf[ho + l]) >> bit) & 1
                            y[base + l] = dl * F32(q - 4 + 4 * hb)


@njit(parallel=True, cache=True)
def dequantize_q4_k(buf, offs, dst):
    nb = dst.shape[1] // QK_K
    for r in prange(offs.shape[0]):
        y = dst[r]
        for i in range(nb):
            o = offs[r] + i * 144
            d = f16_to_f32(buf[o], buf[o + 1])
            dmin = f16_to_f32(buf[o + 2], buf[o + 3])
            for c in range(4):
                sc1, m1 = scale_min_k4(2 * c, buf, o + 4)
                sc2, m2 = scale_min_k4(2 * c + 1, buf, o + 4)
                d1, mm1 = d * F32(sc1), dmin * F32(m1)
                d2, mm2 = d * F32(sc2), dmin * F32(m2)
                base = i * QK_K + 64 * c
                qo = o + 16 + 32 * c
                for l in range(32):
                    q = np.int32(buf[qo + l])
                    y[base + l] = d1 * F32(q & 0xF) - mm1
                    y[base + 32 + l] = d2 * F32(q >> 4) - mm2


@njit(parallel=True, cache=True)
def dequantize_q5_k(buf, offs, dst):
    nb = dst.shape[1] // QK_K
    for r in prange(offs.shape[0]):
        y = dst[r]
        for i in range(nb):
            o = offs[r] + i * 176
            d = f16_to_f32(buf[o], buf[o + 1])
            dmin = f16_to_f32(buf[o + 2], buf[o + 3])
            for c in range(4):
                sc1, m1 = scale_min_k4(2 * c, buf, o + 4)
                sc2, m2 = scale_min_k4(2 * c + 1, buf, o + 4)
                d1, mm1 = d * F32(sc1), dmin * F32(m1)
                d2, mm2 = d * F32(sc2), dmin * F32(m2)
                base = i * QK_K + 64 * c
                qo = o + 48 + 32 * c
                for l in range(32):
                    q = np.int32(buf[qo + l])
                    qh = np.int32(buf[o + 16 + l])
                    h1 = ((qh >> (2 * c)) & 1) << 4
                    h2 = ((qh >> (2 * c + 1)) & 1) << 4
                    y[base + l] = d1 * F32((q & 0xF) + h1) - mm1
                    y[base + 32 + l] = d2 * F32((q >> 4) + h2) - mm2


@njit(parallel=True, cache=True)
def dequantize_q6_k(buf, offs, dst):
    """Per half h of a super-block (128 elements): ql[64h + l + 32*(g%2)] gives the low
    nibble (g < 2) or high nibble of element 128h + 32g + l, bits 2g..2g+1 of qh[32h + l]
    its top two bits; value (d * scales[e//16]) * (q - 32)."""
    for r in prange(offs.shape[0]):
        _dequantize_q6_k_row(buf, offs[r], dst[r])


@njit(cache=True)
def _dequantize_q6_k_row(buf, o0, y):
    """One row: its 16-element groups k = 8h + 2g + s in order, a loop rather than nested
    constant loops, which LLVM unrolls sixteen-fold (seconds of compile for no speed)."""
    nb = y.shape[0] // QK_K
    for i in range(nb):
        o = o0 + i * 210
        d = f16_to_f32(buf[o + 208], buf[o + 209])
        for k in range(16):
            h, g, s = k // 8, (k // 2) % 4, k % 2
            dl = d * F32(np.int8(buf[o + 192 + k]))
            base = i * QK_K + 16 * k
            qlo = o + 64 * h + 32 * (g % 2) + 16 * s
            qho = o + 128 + 32 * h + 16 * s
            shift = 4 * (g // 2)
            for l in range(16):
                lo = (np.int32(buf[qlo + l]) >> shift) & 0xF
                hi = (np.int32(buf[qho + l]) >> (2 * g)) & 3
                y[base + l] = dl * F32((lo | (hi << 4)) - 32)


@njit(parallel=True, cache=True)
def dequantize_q8_k(buf, offs, dst):
    nb = dst.shape[1] // QK_K
    for r in prange(offs.shape[0]):
        y = dst[r]
        for i in range(nb):
            o = offs[r] + i * 292
            d = _f32_at(buf, o)
            for l in range(QK_K):
                y[i * QK_K + l] = d * F32(np.int8(buf[o + 4 + l]))


# ---- ggml's scale search helpers ---------------------------------------------------
@njit(cache=True)
def signed_absmax(x, xo, n):
    """(max |x|, the signed x of largest magnitude, first one on ties) over x[xo:xo+n]."""
    mx = F32(0.0)
    amax = F32(0.0)
    for i in range(n):
        ax = abs(x[xo + i])
        if ax > amax:
            amax = ax
            mx = x[xo + i]
    return amax, mx


_QX_TRIALS = 18  # make_qx_quants' trial scales: k = -9..-1, 1..9


@njit(cache=True, error_model="numpy")
def make_qx_quants(n, nmax, x, xo, L, lo, trial):
    """make_qx_quants(n, nmax, x + xo, L + lo, rmse_type=1, qw=NULL): symmetric levels
    L in [0, 2*nmax) with weights x^2; returns the scale. The 18 trial scales are summed side
    by side (each in ggml's order, a vector lane per trial) and then compared in ggml's order;
    trial: float32 scratch (3, 18)."""
    amax, mx = signed_absmax(x, xo, n)
    if amax < GROUP_MAX_EPS:
        for i in range(n):
            L[lo + i] = 0
        return F32(0.0)
    fnmax = F32(nmax)
    iscale = -fnmax / mx
    sumlx = F32(0.0)
    suml2 = F32(0.0)
    for i in range(n):
        v = x[xo + i]
        l = max(-nmax, min(nmax - 1, nearest_int(iscale * v)))
        L[lo + i] = l + nmax
        w = v * v
        sumlx += w * v * F32(l)
        suml2 += w * F32(l) * F32(l)
    scale = sumlx / suml2 if suml2 != 0 else F32(0.0)
    best = scale * sumlx
    iscales, sumlxs, suml2s = trial[0], trial[1], trial[2]
    for j in range(_QX_TRIALS):
        k = j - 9 if j < 9 else j - 8
        iscales[j] = -(fnmax + F32(0.1) * F32(k)) / mx
        sumlxs[j] = F32(0.0)
        suml2s[j] = F32(0.0)
    for i in range(n):
        v = x[xo + i]
        w = v * v
        wv = w * v
        for j in range(_QX_TRIALS):
            fl = F32(max(-nmax, min(nmax - 1, nearest_int(iscales[j] * v))))
            sumlxs[j] += wv * fl
            suml2s[j] += w * fl * fl
    for j in range(_QX_TRIALS):
        sumlx, suml2 = sumlxs[j], suml2s[j]
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            for i in range(n):
                L[lo + i] = nmax + max(-nmax, min(nmax - 1, nearest_int(iscales[j] * x[xo + i])))
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@njit(cache=True)
def make_q3_quants(n, nmax, x, xo, L, lo):
    """make_q3_quants(n, nmax, x + xo, L + lo, do_rmse=true); returns the scale."""
    amax, mx = signed_absmax(x, xo, n)
    if amax < GROUP_MAX_EPS:
        for i in range(n):
            L[lo + i] = 0
        return F32(0.0)
    iscale = -F32(nmax) / mx
    sumlx = F32(0.0)
    suml2 = F32(0.0)
    for i in range(n):
        v = x[xo + i]
        l = max(-nmax, min(nmax - 1, nearest_int(iscale * v)))
        L[lo + i] = l
        w = v * v
        sumlx += w * v * F32(l)
        suml2 += w * F32(l) * F32(l)
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            v = x[xo + i]
            w = v * v
            li = F32(L[lo + i])
            slx = sumlx - w * v * li
            if slx > 0:
                sl2 = suml2 - w * li * li
                new_l = max(-nmax, min(nmax - 1, nearest_int(v * sl2 / slx)))
                if new_l != L[lo + i]:
                    slx += w * v * F32(new_l)
                    sl2 += w * F32(new_l) * F32(new_l)
                    if sl2 > 0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[lo + i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    for i in range(n):
        L[lo + i] += nmax
    return sumlx / suml2 if suml2 > 0 else F32(0.0)


@njit(cache=True)
def make_qkx2_quants(n, nmax, x, xo, w, L, lo, Laux, rmin, rdelta, nstep, use_mad):
    """make_qkx2_quants: asymmetric levels L in [0, nmax] for x[xo:xo+n] with weights w;
    returns (scale, the_min) where x ~ scale * L - the_min."""
    mn = x[xo]
    mx = x[xo]
    sum_w = w[0]
    sum_x = sum_w * x[xo]
    for i in range(1, n):
        v = x[xo + i]
        if v < mn:
            mn = v
        if v > mx:
            mx = v
        sum_w += w[i]
        sum_x += w[i] * v
    if mn > 0:
        mn = F32(0.0)
    if mx == mn:
        for i in range(n):
            L[lo + i] = 0
        return F32(0.0), -mn
    fnmax = F32(nmax)
    iscale = fnmax / (mx - mn)
    scale = F32(1.0) / iscale
    best_error = F32(0.0)
    for i in range(n):
        v = x[xo + i]
        l = max(0, min(nmax, nearest_int(iscale * (v - mn))))
        L[lo + i] = l
        diff = scale * F32(l) + mn - v
        diff = abs(diff) if use_mad else diff * diff
        best_error += w[i] * diff
    if nstep < 1:
        return scale, -mn
    for k in range(nstep + 1):
        iscale = (rmin + rdelta * F32(k) + fnmax) / (mx - mn)
        sum_l = F32(0.0)
        sum_l2 = F32(0.0)
        sum_xl = F32(0.0)
        for i in range(n):  # the levels first: a loop LLVM vectorises
            Laux[i] = max(0, min(nmax, nearest_int(iscale * (x[xo + i] - mn))))
        for i in range(n):  # then the sums, in ggml's order (latency-bound chains)
            fl = F32(Laux[i])
            sum_l += w[i] * fl
            sum_l2 += w[i] * fl * fl
            sum_xl += w[i] * fl * x[xo + i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > 0:
                this_min = F32(0.0)
                this_scale = sum_xl / sum_l2
            cur_error = F32(0.0)
            for i in range(n):
                diff = this_scale * F32(Laux[i]) + this_min - x[xo + i]
                diff = abs(diff) if use_mad else diff * diff
                cur_error += w[i] * diff
            if cur_error < best_error:
                for i in range(n):
                    L[lo + i] = Laux[i]
                best_error = cur_error
                scale = this_scale
                mn = this_min
    return scale, -mn


@njit(cache=True, inline="always")
def _f16_value(y, o):
    return f16_to_f32(y[o], y[o + 1])


@njit(cache=True, inline="always")
def _pack_2bit(L, y, qo):
    for j in range(0, QK_K, 128):
        for l in range(32):
            y[qo + j // 4 + l] = np.uint8(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6))


# ---- quantize (ggml's quantize_row_*_ref) -------------------------------------------
@njit(parallel=True, cache=True)
def quantize_q2_k(x, out):
    nb = x.shape[1] // QK_K
    q4scale = F32(15.0)
    for r in prange(x.shape[0]):
        xr, y = x[r], out[r]
        L = np.zeros(QK_K, dtype=np.int32)
        Laux = np.zeros(16, dtype=np.int32)
        w = np.empty(16, dtype=np.float32)
        scales = np.empty(16, dtype=np.float32)
        mins = np.empty(16, dtype=np.float32)
        for i in range(nb):
            xo, o = i * QK_K, i * 84
            max_scale = F32(0.0)
            max_min = F32(0.0)
            for j in range(16):
                for l in range(16):
                    w[l] = abs(xr[xo + 16 * j + l])
                s, m = make_qkx2_quants(16, 3, xr, xo + 16 * j, w, L, 16 * j, Laux,
                                        F32(-0.5), F32(0.1), 15, True)
                scales[j], mins[j] = s, m
                if s > max_scale:
                    max_scale = s
                if m > max_min:
                    max_min = m
            if max_scale > 0:
                iscale = q4scale / max_scale
                for j in range(16):
                    y[o + j] = np.uint8(nearest_int(iscale * scales[j]) & 0xFF)
                put_f16(y, o + 80, max_scale / q4scale)
            else:
                for j in range(16):
                    y[o + j] = 0
                put_f16(y, o + 80, F32(0.0))
            if max_min > 0:
                iscale = q4scale / max_min
                for j in range(16):
                    y[o + j] = np.uint8((np.int32(y[o + j]) | (nearest_int(iscale * mins[j]) << 4)) & 0xFF)
                put_f16(y, o + 82, max_min / q4scale)
            else:
                put_f16(y, o + 82, F32(0.0))
            dd, dm_all = _f16_value(y, o + 80), _f16_value(y, o + 82)
            for j in range(16):
                sc = np.int32(y[o + j])
                d = dd * F32(sc & 0xF)
                if d == 0:
                    continue
                dm = dm_all * F32(sc >> 4)
                for ii in range(16):
                    L[16 * j + ii] = max(0, min(3, nearest_int((xr[xo + 16 * j + ii] + dm) / d)))
            _pack_2bit(L, y, o + 16)


@njit(parallel=True, cache=True)
def quantize_q3_k(x, out):
    nb = x.shape[1] // QK_K
    for r in prange(x.shape[0]):
        xr, y = x[r], out[r]
        L = np.zeros(QK_K, dtype=np.int32)
        scales = np.empty(16, dtype=np.float32)
        for i in range(nb):
            xo, o = i * QK_K, i * 110
            max_scale = F32(0.0)
            amax = F32(0.0)
            for j in range(16):
                s = make_q3_quants(16, 4, xr, xo + 16 * j, L, 16 * j)
                scales[j] = s
                if abs(s) > amax:
                    amax = abs(s)
                    max_scale = s
            for k in range(12):
                y[o + 96 + k] = 0
            if max_scale != 0:
                iscale = F32(-32.0) / max_scale
                for j in range(16):
                    l = np.int32(np.int8(nearest_int(iscale * scales[j]) & 0xFF))
                    l = max(-32, min(31, l)) + 32
                    if j < 8:
                        y[o + 96 + j] = np.uint8(l & 0xF)
                    else:
                        y[o + 96 + j - 8] = np.uint8(np.int32(y[o + 96 + j - 8]) | ((l & 0xF) << 4))
                    l >>= 4
                    y[o + 96 + 8 + j % 4] = np.uint8(np.int32(y[o + 104 + j % 4]) | (l << (2 * (j // 4))))
                put_f16(y, o + 108, F32(1.0) / iscale)
            else:
                put_f16(y, o + 108, F32(0.0))
            dd = _f16_value(y, o + 108)
            for j in range(16):
                d = dd * F32(_q3_scale(j, y, o + 96))
                if d == 0:
                    continue
                for ii in range(16):
                    L[16 * j + ii] = max(-4, min(3, nearest_int(xr[xo + 16 * j + ii] / d))) + 4
            for k in range(32):
                y[o + k] = 0
            for j in range(QK_K):
                if L[j] > 3:
                    y[o + j % 32] = np.uint8(np.int32(y[o + j % 32]) | (1 << (j // 32)))
                    L[j] -= 4
            _pack_2bit(L, y, o + 32)


# ---- Q4_K / Q5_K: make_qkx2_quants over many groups of 32 side by side -------------------
QKX_LANES = 32  # groups searched at once (4 super-blocks): each loop over them is a vector loop
_MN, _MX, _SW, _SX, _BEST, _ACT, _ISC, _SL, _SL2, _SXL, _TS, _TM, _CUR, _TAKE, _SCALE = range(15)
_QKX_STATE = 15  # rows of the per-lane state


@njit(cache=True, error_model="numpy")
def make_qkx2_quants_lanes(n, nmax, xw, L, Laux, rmin, rdelta, nstep, st):
    """make_qkx2_quants (use_mad false) for QKX_LANES groups of n values at once, each lane
    with ggml's operations in ggml's order (the same bits as the scalar function, lane by
    lane); branches become selects. xw: the groups' x (n, lanes) then their weights (n,
    lanes), flattened; L and Laux: levels (n, lanes); st: state (_QKX_STATE, lanes). Leaves
    each lane's scale in st row _SCALE and its min (negated) in row _MN. The lanes live in
    memory, not registers (numba vectorises innermost loops only), hence 32 lanes: enough
    independent work per step to hide the round trips (Q4_K 2.9x the scalar search,
    bench/RESULTS.md)."""
    G = QKX_LANES
    W0 = n * G
    for g in range(G):
        v = xw[g]
        st[_MN * G + g] = v
        st[_MX * G + g] = v
        st[_SW * G + g] = xw[W0 + g]
        st[_SX * G + g] = xw[W0 + g] * v
    for i in range(1, n):
        for g in range(G):
            v = xw[i * G + g]
            w = xw[W0 + i * G + g]
            mn = st[_MN * G + g]
            st[_MN * G + g] = v if v < mn else mn
            mx = st[_MX * G + g]
            st[_MX * G + g] = v if v > mx else mx
            st[_SW * G + g] += w
            st[_SX * G + g] += w * v
    fnmax = F32(nmax)
    for g in range(G):
        mn = st[_MN * G + g]
        mn = F32(0.0) if mn > 0 else mn
        st[_MN * G + g] = mn
        flat = st[_MX * G + g] == mn  # all levels 0, scale 0: the lane takes no trial
        st[_ACT * G + g] = F32(0.0) if flat else F32(1.0)
        iscale = fnmax / (st[_MX * G + g] - mn)
        st[_ISC * G + g] = iscale
        st[_SCALE * G + g] = F32(0.0) if flat else F32(1.0) / iscale
        st[_BEST * G + g] = F32(0.0)
    for i in range(n):
        for g in range(G):
            v = xw[i * G + g]
            mn = st[_MN * G + g]
            l = max(0, min(nmax, nearest_int(st[_ISC * G + g] * (v - mn))))
            l = l if st[_ACT * G + g] != 0 else 0
            L[i * G + g] = l
            diff = st[_SCALE * G + g] * F32(l) + mn - v
            st[_BEST * G + g] += xw[W0 + i * G + g] * (diff * diff)
    for k in range(nstep + 1):
        for g in range(G):
            st[_ISC * G + g] = (rmin + rdelta * F32(k) + fnmax) / (st[_MX * G + g] - st[_MN * G + g])
            st[_SL * G + g] = F32(0.0)
            st[_SL2 * G + g] = F32(0.0)
            st[_SXL * G + g] = F32(0.0)
        for i in range(n):
            for g in range(G):
                v = xw[i * G + g]
                l = max(0, min(nmax, nearest_int(st[_ISC * G + g] * (v - st[_MN * G + g]))))
                Laux[i * G + g] = l
                fl = F32(l)
                wl = xw[W0 + i * G + g] * fl
                st[_SL * G + g] += wl
                st[_SL2 * G + g] += wl * fl
                st[_SXL * G + g] += wl * v
        for g in range(G):
            sum_w, sum_x = st[_SW * G + g], st[_SX * G + g]
            sum_l, sum_l2, sum_xl = st[_SL * G + g], st[_SL2 * G + g], st[_SXL * G + g]
            D = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            positive = this_min > 0
            st[_TS * G + g] = sum_xl / sum_l2 if positive else this_scale
            st[_TM * G + g] = F32(0.0) if positive else this_min
            st[_TAKE * G + g] = D
            st[_CUR * G + g] = F32(0.0)
        for i in range(n):
            for g in range(G):
                diff = st[_TS * G + g] * F32(Laux[i * G + g]) + st[_TM * G + g] - xw[i * G + g]
                st[_CUR * G + g] += xw[W0 + i * G + g] * (diff * diff)
        for g in range(G):
            better = st[_ACT * G + g] != 0 and st[_TAKE * G + g] > 0 and st[_CUR * G + g] < st[_BEST * G + g]
            if better:
                st[_BEST * G + g] = st[_CUR * G + g]
                st[_SCALE * G + g] = st[_TS * G + g]
                st[_MN * G + g] = st[_TM * G + g]
            st[_TAKE * G + g] = F32(1.0) if better else F32(0.0)
        for i in range(n):
            for g in range(G):
                L[i * G + g] = Laux[i * G + g] if st[_TAKE * G + g] != 0 else L[i * G + g]


@njit(cache=True)
def _qkx_scratch():
    """A row's buffers for the Q4_K/Q5_K quantizers: the lanes' x and weights, levels, trial
    levels and state, then one block's levels, scales and mins."""
    G = QKX_LANES
    return (np.empty(2 * 32 * G, dtype=np.float32), np.empty(32 * G, dtype=np.int32),
            np.empty(32 * G, dtype=np.int32), np.empty(_QKX_STATE * G, dtype=np.float32),
            np.zeros(QK_K, dtype=np.int32), np.empty(8, dtype=np.float32), np.empty(8, dtype=np.float32))


@njit(cache=True)
def _qkx_search(xr, b0, nblk, nmax, rmin, rdelta, nstep, scratch):
    """The scale search of quantize_row_q4_K_ref / q5_K_ref for the super-blocks b0 ..
    b0 + nblk (nblk <= QKX_LANES // 8) of row xr, their groups side by side; lanes past them
    repeat group 0 and are not read."""
    xw, Lw, Laux, st = scratch[0], scratch[1], scratch[2], scratch[3]
    G = QKX_LANES
    for g in range(G):
        src = g if g < 8 * nblk else 0
        xo = (b0 + src // 8) * QK_K + 32 * (src % 8)
        sum_x2 = F32(0.0)
        for l in range(32):
            v = xr[xo + l]
            sum_x2 += v * v
        av_x = np.sqrt(sum_x2 / F32(32.0))
        for l in range(32):
            xw[l * G + g] = xr[xo + l]
            xw[32 * G + l * G + g] = av_x + abs(xr[xo + l])
    make_qkx2_quants_lanes(32, nmax, xw, Lw, Laux, rmin, rdelta, nstep, st)


@njit(cache=True)
def _quantize_qkx_block(xr, xo, y, o, nmax, bi, scratch):
    """The rest of quantize_row_q4_K_ref / q5_K_ref for one super-block (the bi-th of the last
    _qkx_search): fills the d, dmin and scales fields at y[o:] and the block's levels
    scratch[4] (0..nmax)."""
    Lw, st, L, scales, mins = scratch[1], scratch[3], scratch[4], scratch[5], scratch[6]
    G = QKX_LANES
    max_scale = F32(0.0)
    max_min = F32(0.0)
    for j in range(8):
        g = 8 * bi + j
        s, m = st[_SCALE * G + g], -st[_MN * G + g]
        scales[j], mins[j] = s, m
        for l in range(32):
            L[32 * j + l] = Lw[l * G + g]
        if s > max_scale:
            max_scale = s
        if m > max_min:
            max_min = m
    inv_scale = F32(63.0) / max_scale if max_scale > 0 else F32(0.0)
    inv_min = F32(63.0) / max_min if max_min > 0 else F32(0.0)
    so = o + 4
    for j in range(8):
        ls = min(63, nearest_int(inv_scale * scales[j]) & 0xFF)
        lm = min(63, nearest_int(inv_min * mins[j]) & 0xFF)
        if j < 4:
            y[so + j] = np.uint8(ls)
            y[so + j + 4] = np.uint8(lm)
        else:
            y[so + j + 4] = np.uint8((ls & 0xF) | ((lm & 0xF) << 4))
            y[so + j - 4] = np.uint8(np.int32(y[so + j - 4]) | ((ls >> 4) << 6))
            y[so + j] = np.uint8(np.int32(y[so + j]) | ((lm >> 4) << 6))
    put_f16(y, o, max_scale / F32(63.0))
    put_f16(y, o + 2, max_min / F32(63.0))
    dd, dm_all = _f16_value(y, o), _f16_value(y, o + 2)
    for j in range(8):
        sc, m = scale_min_k4(j, y, so)
        d = dd * F32(sc)
        if d == 0:
            continue
        dm = dm_all * F32(m)
        for ii in range(32):
            L[32 * j + ii] = max(0, min(nmax, nearest_int((xr[xo + 32 * j + ii] + dm) / d)))


@njit(cache=True, inline="always")
def _pack_q4_k(L, y, o):
    for c in range(4):
        for l in range(32):
            y[o + 16 + 32 * c + l] = np.uint8(L[64 * c + l] | (L[64 * c + 32 + l] << 4))


@njit(cache=True, inline="always")
def _pack_q5_k(L, y, o):
    for l in range(32):
        y[o + 16 + l] = 0
    for c in range(4):
        for l in range(32):
            l1 = L[64 * c + l]
            l2 = L[64 * c + 32 + l]
            h = np.int32(y[o + 16 + l])
            if l1 > 15:
                l1 -= 16
                h |= 1 << (2 * c)
            if l2 > 15:
                l2 -= 16
                h |= 2 << (2 * c)
            y[o + 16 + l] = np.uint8(h)
            y[o + 48 + 32 * c + l] = np.uint8(l1 | (l2 << 4))


@njit(parallel=True, cache=True)
def _quantize_qkx(x, out, nmax, rmin, rdelta, nstep, block_bytes):
    """quantize_row_q4_K_ref (nmax 15) or q5_K_ref (nmax 31) on every row, in parallel."""
    nb = x.shape[1] // QK_K
    for r in prange(x.shape[0]):
        xr, y = x[r], out[r]
        scratch = _qkx_scratch()
        for b0 in range(0, nb, QKX_LANES // 8):
            nblk = min(QKX_LANES // 8, nb - b0)
            _qkx_search(xr, b0, nblk, nmax, rmin, rdelta, nstep, scratch)
            for bi in range(nblk):
                i = b0 + bi
                o = i * block_bytes
                _quantize_qkx_block(xr, i * QK_K, y, o, nmax, bi, scratch)
                if nmax == 15:
                    _pack_q4_k(scratch[4], y, o)
                else:
                    _pack_q5_k(scratch[4], y, o)


@njit(cache=True)
def quantize_q4_k(x, out):
    _quantize_qkx(x, out, 15, F32(-1.0), F32(0.1), 20, 144)


@njit(cache=True)
def quantize_q5_k(x, out):
    _quantize_qkx(x, out, 31, F32(-0.5), F32(0.1), 15, 176)


@njit(parallel=True, cache=True)
def quantize_q6_k(x, out):
    nb = x.shape[1] // QK_K
    for r in prange(x.shape[0]):
        xr, y = x[r], out[r]
        L = np.zeros(QK_K, dtype=np.int32)
        trial = np.empty((3, _QX_TRIALS), dtype=np.float32)
        scales = np.empty(16, dtype=np.float32)
        for i in range(nb):
            xo, o = i * QK_K, i * 210
            max_scale = F32(0.0)
            max_abs_scale = F32(0.0)
            for ib in range(16):
                s = make_qx_quants(16, 32, xr, xo + 16 * ib, L, 16 * ib, trial)
                scales[ib] = s
                if abs(s) > max_abs_scale:
                    max_abs_scale = abs(s)
                    max_scale = s
            if max_abs_scale < GROUP_MAX_EPS:
                for k in range(210):
                    y[o + k] = 0
                continue
            iscale = F32(-128.0) / max_scale
            put_f16(y, o + 208, F32(1.0) / iscale)
            for ib in range(16):
                y[o + 192 + ib] = np.uint8(min(127, nearest_int(iscale * scales[ib])) & 0xFF)
            dd = _f16_value(y, o + 208)
            for j in range(16):
                d = dd * F32(np.int8(y[o + 192 + j]))
                if d == 0:
                    continue
                for ii in range(16):
                    L[16 * j + ii] = max(-32, min(31, nearest_int(xr[xo + 16 * j + ii] / d))) + 32
            for h in range(2):
                for l in range(32):
                    e = 128 * h + l
                    q1, q2, q3, q4 = L[e], L[e + 32], L[e + 64], L[e + 96]
                    y[o + 64 * h + l] = np.uint8((q1 & 0xF) | ((q3 & 0xF) << 4))
                    y[o + 64 * h + 32 + l] = np.uint8((q2 & 0xF) | ((q4 & 0xF) << 4))
                    y[o + 128 + 32 * h + l] = np.uint8((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6))


@njit(parallel=True, cache=True)
def quantize_q8_k(x, out):
    """quantize_row_q8_K: the activations' rounding (activation_superblock_scale,
    activation_q8_k) in ggml's 292-byte block: d (float32), 256 int8, 16 int16 sums."""
    nb = x.shape[1] // QK_K
    for r in prange(x.shape[0]):
        xr, y = x[r], out[r]
        for i in range(nb):
            xo, o = i * QK_K, i * 292
            d, iscale = activation_superblock_scale(xr, xo)
            for s in range(16):
                tot = 0
                for j in range(16):
                    q = activation_q8_k(xr[xo + 16 * s + j], iscale)
                    y[o + 4 + 16 * s + j] = np.uint8(q & 0xFF)
                    tot += q
                y[o + 260 + 2 * s] = np.uint8(tot & 0xFF)
                y[o + 261 + 2 * s] = np.uint8((tot >> 8) & 0xFF)
            bits = np.int64(F32(d).view(np.uint32))
            for k in range(4):
                y[o + k] = np.uint8((bits >> (8 * k)) & 0xFF)


@njit(parallel=True, cache=True)
def round_rows_q8_k(x):
    """In place: every row of x (float32[:, ::1], ne0 a multiple of 256) replaced by the values
    d * q of its Q8_K blocks, as quantize_row_q8_K (= quantize_row_q8_K_ref on x86) makes
    them for the activations of a K-quant product: max the signed element of largest
    magnitude, iscale = -127 / max, q = min(127, nearest_int(iscale * x)), d = 1 / iscale
    (a float32, not an fp16)."""
    nb = x.shape[1] // QK_K
    for r in prange(x.shape[0]):
        xr = x[r]
        for i in range(nb):
            xo = i * QK_K
            d, iscale = activation_superblock_scale(xr, xo)
            if d == 0:
                for j in range(QK_K):
                    xr[xo + j] = F32(0.0)
                continue
            for j in range(QK_K):
                xr[xo + j] = F32(d * F32(activation_q8_k(xr[xo + j], iscale)))


@njit(cache=True, inline="always")
def activation_superblock_scale(xr, xo):
    """(d, iscale) of the activations' Q8_K super-block at xr[xo:xo + 256] (round_rows_q8_k):
    activation_q8_k gives its integers; (0, 0) for an all-zero block."""
    amax, mx = signed_absmax(xr, xo, QK_K)
    if amax == 0:
        return F32(0.0), F32(0.0)
    iscale = F32(-127.0) / mx
    return F32(F32(1.0) / iscale), iscale


@njit(cache=True, inline="always")
def activation_q8_k(v, iscale):
    """The integer of v in its Q8_K super-block (iscale from activation_superblock_scale):
    min(127, nearest_int(iscale * v)), as quantize_row_q8_K_ref. Every Q8_K quantizer
    rounds here (0 in an all-zero block, where iscale is 0)."""
    return min(127, nearest_int(iscale * v))
