"""numba kernels of the training ops: losses, `*_back` ops, optimizer steps.

Same conventions as kernels.py: arrays are (ne3, ne2, ne1, ne0) views with any strides,
rows are independent and run in parallel, row sums are kept in float64 as ggml does.
"""
from __future__ import annotations

import numpy as np
from numba import get_thread_id, njit, prange

from ....row_math import EXP_MAX, dot_f64, exp_f32, max_f32, sum_f64
from ....rowops import exp_sum
from ..rows.kernels import GELU_COEF_A, SQRT_2_OVER_PI, _row_index, exp_shifted

F32 = np.float32


@njit(cache=True)
def rms_norm_back_f32(g, x, dst, eps):
    """dx = (g - y * mean(g * y)) / rms with y = x / rms, rms = sqrt(mean(x^2) + eps)."""
    n3, n2, n1, n0 = x.shape
    for r in range(n3 * n2 * n1):
        i3, i2, i1 = _row_index(r, n2, n1)
        sxx = 0.0
        sxg = 0.0
        for i0 in range(n0):
            v = np.float64(x[i3, i2, i1, i0])
            sxx += v * v
            sxg += v * np.float64(g[i3, i2, i1, i0])
        mean_xx = sxx / n0 + eps
        inv_rms = 1.0 / np.sqrt(mean_xx)
        # d/dx_i of x_j/rms: delta_ij/rms - x_i x_j / (n rms^3)
        c = F32(-sxg / (n0 * mean_xx) * inv_rms)
        s = F32(inv_rms)
        for i0 in range(n0):
            dst[i3, i2, i1, i0] = g[i3, i2, i1, i0] * s + x[i3, i2, i1, i0] * c


@njit(parallel=True, cache=True)
def soft_max_back_f32(g, y, dst, scale):
    """dx = scale * y * (g - dot(g, y)) per row."""
    n3, n2, n1, n0 = y.shape
    sc = F32(scale)
    for r in prange(n3 * n2 * n1):
        i3, i2, i1 = _row_index(r, n2, n1)
        gr, yr, dr = g[i3, i2, i1], y[i3, i2, i1], dst[i3, i2, i1]
        d = F32(dot_f64(gr, yr))
        for i0 in range(n0):
            dr[i0] = sc * yr[i0] * (gr[i0] - d)


@njit(parallel=True, cache=True)
def silu_back_f32(g, x, dst):
    """g * silu'(x), silu'(x) = s (1 + x (1 - s)) with s = sigmoid(x)."""
    n3, n2, n1, n0 = x.shape
    for r in prange(n3 * n2 * n1):
        i3, i2, i1 = _row_index(r, n2, n1)
        for i0 in range(n0):
            v = x[i3, i2, i1, i0]
            s = F32(1.0) / (F32(1.0) + exp_f32(min(-v, EXP_MAX)))
            dst[i3, i2, i1, i0] = g[i3, i2, i1, i0] * s * (F32(1.0) + v * (F32(1.0) - s))


@njit(parallel=True, cache=True)
def gelu_back_f32(g, x, dst):
    """g * d/dx [0.5 x (1 + tanh(u))], u = c (x + a x^3): g * 0.5 * (1 + t + x (1 - t^2) du/dx).

    With e = exp(2u): 1 + t = 2e / (e + 1) and 1 - t = 2 / (e + 1), so neither 1 + t nor
    1 - t^2 cancels (exact to a few ulp where tanh's form loses them for |x| large), and the
    loop vectorises (np.tanh is a scalar libm call in numba, ~6x slower). 2u is capped at 80,
    where exp stays finite and tanh is 1 to float precision.
    """
    n3, n2, n1, n0 = x.shape
    c = F32(SQRT_2_OVER_PI)
    a = F32(GELU_COEF_A)
    for r in prange(n3 * n2 * n1):
        i3, i2, i1 = _row_index(r, n2, n1)
        for i0 in range(n0):
            v = x[i3, i2, i1, i0]
            e = np.exp(min(F32(2.0) * c * v * (F32(1.0) + a * v * v), F32(80.0)))
            q = F32(1.0) / (e + F32(1.0))
            one_plus_t = F32(2.0) * e * q
            one_minus_t2 = one_plus_t * (F32(2.0) * q)
            dt = c * (F32(1.0) + F32(3.0) * a * v * v) * one_minus_t2
            dst[i3, i2, i1, i0] = g[i3, i2, i1, i0] * F32(0.5) * (one_plus_t + v * dt)


@njit(parallel=True, cache=True)
def cross_entropy_rows(logits, labels, out, scratch):
    """out[r] = -sum(labels * log_softmax(logits)) of row r, in double. scratch: a row of
    work per thread (numba.get_num_threads() x ne0), so no row allocates."""
    n3, n2, n1, n0 = logits.shape
    for r in prange(n3 * n2 * n1):
        i3, i2, i1 = _row_index(r, n2, n1)
        row, lab = logits[i3, i2, i1], labels[i3, i2, i1]
        m, s = exp_sum(row, scratch[get_thread_id()])
        log_sum = np.log(s) + np.float64(m)
        out[r] = log_sum * sum_f64(lab) - dot_f64(lab, row)


@njit(parallel=True, cache=True)
def cross_entropy_back_f32(d, logits, labels, dst):
    """dst = (softmax(logits) * sum(labels) - labels) * d / rows, in float as ggml.

    The gradient of the forward for label rows of any sum: ggml's (softmax - labels)
    assumes each row sums to 1; a weighted row scales its gradient and an all-zero row
    (an ignored datapoint) has none. For a distribution the sum is 1.0 and the product by
    it exact, so those rows get ggml's bits. dst may be logits itself (the allocator places
    the op over the logits): each element is read before it is written."""
    n3, n2, n1, n0 = logits.shape
    n_rows = n3 * n2 * n1
    sc = F32(d / n_rows)
    for r in prange(n_rows):
        i3, i2, i1 = _row_index(r, n2, n1)
        dr, lab = dst[i3, i2, i1], labels[i3, i2, i1]
        _, s = exp_sum(logits[i3, i2, i1], dr)
        inv = F32(1.0 / s)
        weight = F32(sum_f64(lab))
        for i0 in range(n0):
            dr[i0] = (dr[i0] * inv * weight - lab[i0]) * sc


@njit(parallel=True, cache=True)
def cross_entropy_rows_ids(logits, ids, weights, out, scratch):
    """cross_entropy_rows for label rows weights[r] * onehot(ids[r]) (nothing where ids[r] < 0),
    without the dense rows: the same double sums, so the same bits."""
    n3, n2, n1, n0 = logits.shape
    for r in prange(n3 * n2 * n1):
        i3, i2, i1 = _row_index(r, n2, n1)
        t, w = ids[i3, i2, i1], np.float64(weights[i3, i2, i1])
        if t < 0 or w == 0.0:
            out[r] = 0.0
            continue
        row = logits[i3, i2, i1]
        m, s = exp_sum(row, scratch[get_thread_id()])
        out[r] = (np.log(s) + np.float64(m)) * w - w * np.float64(row[t])


@njit(parallel=True, cache=True)
def cross_entropy_back_ids_f32(d, logits, ids, weights, dst):
    """cross_entropy_back_f32 for label rows weights[r] * onehot(ids[r]) (zero where ids[r] < 0);
    dst may be logits itself, as there."""
    n3, n2, n1, n0 = logits.shape
    n_rows = n3 * n2 * n1
    sc = F32(d / n_rows)
    for r in prange(n_rows):
        i3, i2, i1 = _row_index(r, n2, n1)
        dr = dst[i3, i2, i1]
        t = ids[i3, i2, i1]
        weight = weights[i3, i2, i1] if t >= 0 else F32(0.0)
        if weight == 0.0:
            dr[:] = F32(0.0) * sc  # the dense form's (0 - 0) * sc: -0.0 for a negative gradient
            continue
        _, s = exp_sum(logits[i3, i2, i1], dr)
        inv = F32(1.0 / s)
        for i0 in range(n0):
            v = dr[i0] * inv * weight
            if i0 == t:
                v = v - weight
            dr[i0] = v * sc


@njit(cache=True)
def get_rows_back_f32(g, idx, dst):
    """dst[i12, i11, idx[i12, i11, i10]] += g[i12, i11, i10]; serial, as rows may repeat."""
    dst[:] = 0
    n12, n11, n10 = idx.shape
    n0 = dst.shape[3]
    for i12 in range(n12):
        for i11 in range(n11):
            for i10 in range(n10):
                row = idx[i12, i11, i10]
                for i0 in range(n0):
                    dst[i12, i11, row, i0] += g[i12, i11, i10, i0]


@njit(parallel=True, cache=True)
def adamw_step_f32(w, g, m, v, p):
    """ggml's opt_step_adamw on flat arrays; p = alpha, beta1, beta2, eps, wd, beta1h, beta2h."""
    alpha, beta1, beta2, eps, wd, beta1h, beta2h = p[0], p[1], p[2], p[3], p[4], p[5], p[6]
    keep = F32(1.0) - alpha * wd
    for i in prange(w.shape[0]):
        gi = g[i]
        m[i] = m[i] * beta1 + gi * (F32(1.0) - beta1)
        v[i] = v[i] * beta2 + gi * gi * (F32(1.0) - beta2)
        mh = m[i] * beta1h
        vh = np.sqrt(v[i] * beta2h) + eps
        w[i] = w[i] * keep - alpha * mh / vh


@njit(parallel=True, cache=True)
def sgd_step_f32(w, g, p):
    """ggml's opt_step_sgd on flat arrays; p = alpha, wd."""
    alpha, wd = p[0], p[1]
    keep = F32(1.0) - alpha * wd
    for i in prange(w.shape[0]):
        w[i] = w[i] * keep - alpha * g[i]


NORM_CHUNK = 1 << 16  # fixed partial-sum chunks: the norm does not depend on the thread count


@njit(parallel=True, cache=True)
def sum_sq_f64(x):
    """Sum of squares of a flat F32 array in float64, in fixed chunks summed in order."""
    n_chunks = (x.shape[0] + NORM_CHUNK - 1) // NORM_CHUNK
    partial = np.zeros(n_chunks, np.float64)
    for c in prange(n_chunks):
        s = 0.0
        for i in range(c * NORM_CHUNK, min((c + 1) * NORM_CHUNK, x.shape[0])):
            xi = np.float64(x[i])
            s += xi * xi
        partial[c] = s
    total = 0.0
    for c in range(n_chunks):
        total += partial[c]
    return total


@njit(cache=True)
def scale_f32(x, factor):
    """x *= factor in place (flat F32; factor rounded to F32 as PyTorch's mul_ does)."""
    f = F32(factor)
    for i in range(x.shape[0]):
        x[i] = x[i] * f


# ---- a linear layer followed by cross-entropy (linear_ce.py runs these over chunks of classes) ----
@njit(parallel=True, cache=True)
def lce_fold_chunk(z, c0, ids, m, s, arg, zt, rescale):
    """Fold the logits of classes c0..c0+C (z: (rows, C)) into each row's running max m,
    sum s = sum(exp(z - m)) (float exp, double sum, as log-softmax), first argmax and
    target logit zt; z becomes exp(z - m) for the new m (the chunk's softmax numerators),
    and rescale[r] = exp(m_before - m) is what the row's earlier sums were multiplied by."""
    n_rows, n_cols = z.shape
    for r in prange(n_rows):
        row = z[r]
        t = ids[r] - c0
        if 0 <= t < n_cols:
            zt[r] = row[t]
        cm = max_f32(row)
        f = 1.0
        if cm > m[r]:  # strictly larger: an equal maximum of a later chunk is not the first
            f = np.exp(np.float64(m[r]) - np.float64(cm)) if m[r] > -np.inf else 0.0
            s[r] *= f
            m[r] = cm
            for i in range(n_cols):
                if row[i] == cm:
                    arg[r] = c0 + i
                    break
        rescale[r] = f
        mr = m[r]
        if mr == -np.inf:  # every logit so far is -inf (or NaN): nothing to add yet
            for i in range(n_cols):
                row[i] = F32(0.0) if row[i] == -np.inf else row[i]
            continue
        exp_shifted(row, mr)
        s[r] += sum_f64(row)


@njit(parallel=True, cache=True)
def lce_finish(m, s, zt, ids, weights, arg, out):
    """out[r] = (weights[r] * (lse_r - zt_r) or 0 where ids[r] < 0, lse_r, argmax_r) with
    lse_r = log(s_r) + m_r, in double before the float32 store (cross_entropy_rows_ids' sums)."""
    for r in prange(m.shape[0]):
        lse = np.log(s[r]) + np.float64(m[r])
        w = np.float64(weights[r])
        out[r, 0] = 0.0 if ids[r] < 0 or w == 0.0 else lse * w - w * np.float64(zt[r])
        out[r, 1] = lse
        out[r, 2] = F32(arg[r])


@njit(cache=True)
def scale_rows_f32(a, f):
    """a[r] *= f[r] (float32), skipped where f[r] is 1."""
    for r in range(a.shape[0]):
        if f[r] != 1.0:
            fr = F32(f[r])
            for i in range(a.shape[1]):
                a[r, i] *= fr


@njit(parallel=True, cache=True)
def lce_coefficients(g, ids, weights, a, b):
    """Per row, the gradient of the loss in the logits is a_r softmax(z_r) - b_r onehot(ids[r]):
    a = g_lse + weights * g_loss and b = weights * g_loss where the row counts, a = g_lse and
    b = 0 where it does not (its loss field is constant zero). g: (rows, LCE_FIELDS)."""
    for r in prange(g.shape[0]):
        w = weights[r] if ids[r] >= 0 else F32(0.0)
        b[r] = w * g[r, 0]
        a[r] = g[r, 1] + b[r]


@njit(parallel=True, cache=True)
def lce_dx(a, b, soft, target, dst):
    """dst[r] = a_r * soft[r] - b_r * target[r]: soft = softmax(z_r) W, target = W[ids[r]]."""
    for r in prange(dst.shape[0]):
        ar, br = a[r], b[r]
        for i in range(dst.shape[1]):
            dst[r, i] = ar * soft[r, i] - br * target[r, i]


@njit(parallel=True, cache=True)
def lce_grad_chunk(z, c0, lse, ids, a, b):
    """z (rows, C), the logits of classes c0..c0+C, becomes the gradient of the loss in them:
    a_r * exp(z - lse_r) - b_r at the row's label."""
    n_rows, n_cols = z.shape
    for r in prange(n_rows):
        row, lr, ar = z[r], lse[r], a[r]
        for i in range(n_cols):
            row[i] = ar * exp_f32(row[i] - lr)
        t = ids[r] - c0
        if 0 <= t < n_cols:
            row[t] -= b[r]


@njit(parallel=True, cache=True)
def lce_grad_probs(p, ids, a, b):
    """p (rows, classes), each row's softmax, becomes the gradient of the loss in the logits:
    a_r * p - b_r at the row's label (lce_grad_chunk when the forward kept the softmax)."""
    for r in prange(p.shape[0]):
        row, ar = p[r], a[r]
        for i in range(p.shape[1]):
            row[i] = ar * row[i]
        if ids[r] >= 0:
            row[ids[r]] -= b[r]
