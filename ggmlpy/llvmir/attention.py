"""Flash attention's inner products as LLVM vector code, in ggml-cpu's fma order: the 4 x 64
tiles of attention.py (simd_gemm's order) and the lane kernels of small_head_attention.py,
where the 32 queries of a tile are the lanes of two registers and every cell one fma."""
from __future__ import annotations

from .emit import W, kernel

LANES = 2 * W  # queries per tile of the lane kernels: two registers


@kernel()
def attn_scores_4x64(e, kt, qt, kq, r0, dk):
    """Flash attention's scores for query rows r0 .. r0 + 3 of a tile against a tile of 64
    cells: kq[r0 + r, c] = fma chain over d of kt[d, c] * qt[r0 + r, d], from 0 (simd_gemm's
    order). kt (dk, 64), qt (64, dk), kq (64, 64), all C-contiguous."""
    b = e.b
    qrows = e.rows(qt, r0, dk, 4)
    acc = [[e.acc() for _ in range(4)] for _ in range(4)]
    with e.loop(dk) as d:
        kv = [e.load(kt, b.add(b.mul(d, e.const(64)), e.const(W * v))) for v in range(4)]
        for r in range(4):
            qs = e.splat(e.at(qrows[r], d))
            for v in range(4):
                b.store(e.fma(kv[v], qs, b.load(acc[r][v])), acc[r][v])
    for r in range(4):
        for v in range(4):
            e.store(kq, b.add(b.mul(b.add(r0, e.const(r)), e.const(64)), e.const(W * v)), b.load(acc[r][v]))


@kernel()
def attn_values_4x64(e, vt, kq, vkq, r0, d0):
    """Flash attention's output for rows r0 .. r0 + 3, columns d0 .. d0 + 63:
    vkq[r, d] = fma chain over the 64 cells c of vt[c, d] * kq[r, c], continuing from vkq
    (simd_gemm's order). vt (64, dv), kq (64, 64), vkq (64, dv), all C-contiguous."""
    b = e.b
    dv = e.shape(vt, 1)

    def at(r, v):  # vkq[r0 + r, d0 + 16 v]
        return b.add(b.mul(b.add(r0, e.const(r)), dv), b.add(d0, e.const(W * v)))
    slots = [[e.slot(e.load(vkq, at(r, v))) for v in range(4)] for r in range(4)]
    with e.loop(e.const(64)) as c:
        vv = [e.load(vt, b.add(b.mul(c, dv), b.add(d0, e.const(W * v)))) for v in range(4)]
        for r in range(4):
            p = e.splat(e.at(kq, b.add(b.mul(b.add(r0, e.const(r)), e.const(64)), c)))
            for v in range(4):
                b.store(e.fma(vv[v], p, b.load(slots[r][v])), slots[r][v])
    for r in range(4):
        for v in range(4):
            e.store(vkq, at(r, v), b.load(slots[r][v]))


@kernel()
def lanes_scores(e, kh, qt, mt, s, tm, a, b_, sc, slope, has_mask):
    """The scores of LANES queries against cells a .. b - 1 of a tile: s[c, i] = (fma chain
    over d of kh[c, d] * qt[d, i], from 0) * sc [+ slope * mt[c, i]], and the running max
    tm[i] = tm[i] > s ? tm[i] : s (ggml's MAX). kh (cells, dk) any row stride; qt (dk, LANES),
    mt (cells, LANES), s (64, LANES) C-contiguous; tm (LANES,); sc, slope float32."""
    b = e.b
    sc_v, slope_v = e.splat(sc), e.splat(slope)
    ks, dk = e.stride(kh, 0), e.shape(kh, 1)
    lanes = e.const(LANES)
    tms = [e.slot(e.load(tm, e.const(W * v))) for v in range(2)]
    with e.loop(b_, a) as c:
        xs = [e.acc() for _ in range(2)]
        krow = e.gep(kh, b.mul(c, ks))
        with e.loop(dk) as d:
            kd = e.splat(e.at(krow, d))
            for v in range(2):
                q = e.load(qt, b.add(b.mul(d, lanes), e.const(W * v)))
                b.store(e.fma(kd, q, b.load(xs[v])), xs[v])
        for v in range(2):
            b.store(e.mul(b.load(xs[v]), sc_v), xs[v])
        with b.if_then(has_mask):
            for v in range(2):
                m = e.load(mt, b.add(b.mul(c, lanes), e.const(W * v)))
                b.store(e.add(b.load(xs[v]), e.mul(slope_v, m)), xs[v])
        for v in range(2):
            x = b.load(xs[v])
            e.store(s, b.add(b.mul(c, lanes), e.const(W * v)), x)
            t = b.load(tms[v])
            b.store(b.select(b.fcmp_ordered(">", t, x), t, x), tms[v])
    for v in range(2):
        e.store(tm, e.const(W * v), b.load(tms[v]))


@kernel()
def lanes_values(e, p, vh, acc, a, b_):
    """The output of LANES queries over cells a .. b - 1 of a tile: acc[d, i] = fma chain over
    c of vh[c, d] * p[c, i], continuing from acc. vh (cells, dv) any row stride; p (64, LANES),
    acc (dv, LANES) C-contiguous."""
    b = e.b
    vs, dv = e.stride(vh, 0), e.shape(vh, 1)
    lanes = e.const(LANES)
    with e.loop(dv) as d:
        xs = [e.slot(e.load(acc, b.add(b.mul(d, lanes), e.const(W * v)))) for v in range(2)]
        with e.loop(b_, a) as c:
            vd = e.splat(e.at(vh, b.add(b.mul(c, vs), d)))
            for v in range(2):
                pv = e.load(p, b.add(b.mul(c, lanes), e.const(W * v)))
                b.store(e.fma(vd, pv, b.load(xs[v])), xs[v])
        for v in range(2):
            e.store(acc, b.add(b.mul(d, lanes), e.const(W * v)), b.load(xs[v]))
