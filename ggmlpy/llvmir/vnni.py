"""The quantized products' integer sums by AVX512-VNNI (vpdpbusd: 4 byte products per lane
and their sum in one instruction; the same exact sums), around the float arithmetic of
ggml's kernels in its order: the tiles of many columns (q0_*_vnni) and the row kernels of
few columns, which read a matrix row's packed blocks in place.

Without AVX512-VNNI (or with GGMLPY_NO_VNNI=1) qexact.py runs the integer sums as exact
float32 vector code instead (quant_tiles.py): the same numbers.
"""
from __future__ import annotations

import os

from llvmlite import ir
from numba import types

from .emit import F32, HALF, I8, I16, I32, VF, VI, Emit, W, kernel, target_has, vec

VNNI = target_has("avx512f", "avx512bw", "avx512vl", "avx512vnni") and not os.environ.get("GGMLPY_NO_VNNI")
BLOCK_ROWS = 8  # matrix rows per call of q0_blocks_vnni (8 chains of vpdpbusd hide its latency)

VI8 = vec(I32, 8)  # the row kernels' registers: 8 int32 lanes (32 bytes), 8 float32
VF8 = vec(F32, 8)
B32 = vec(I8, 32)


def _dp(e: Emit, acc, u, s):
    """vpdpbusd: acc + per lane the sum of the 4 products of unsigned bytes u and signed s."""
    return e.call(f"llvm.x86.avx512.vpdpbusd.{32 * acc.type.count}", acc.type, acc, u, s)


def _dpw(e: Emit, acc, a, b):
    """vpdpwssd: acc (<16 x i32>) + per lane the sum of the 2 products of int16 lanes of a and b,
    declared with the <16 x i32> operands LLVM 14-19 define (later ones upgrade the call)."""
    v = acc.type
    return e.call("llvm.x86.avx512.vpdpwssd.512", v, acc, e.b.bitcast(a, v), e.b.bitcast(b, v))


def _q0_operands(e: Emit, wu, wd, xq, xd, r0, tile, nb, rows: int):
    """What a Q0 tile reads: xq's tile and each row's unsigned bytes as int32 lanes (4 bytes
    each), xd's tile and each row's scales."""
    b = e.b
    xq_t = b.bitcast(e.gep(xq, b.mul(tile, b.mul(b.mul(nb, e.const(8)), e.const(64)))), I32.as_pointer())
    xd_t = e.gep(xd, b.mul(tile, b.mul(nb, e.const(W))))
    w_rows = [b.bitcast(p, I32.as_pointer()) for p in e.rows(wu, r0, b.mul(nb, e.const(32)), rows)]
    return xq_t, xd_t, w_rows, e.rows(wd, r0, nb, rows)


@kernel()
def q0_tile2_vnni(e, wu, wd, xq, xc, xd, res, r0, tile, nb):
    """q0_lanes_tile's numbers for 2 rows, the integer sums by AVX512-VNNI. wu (rows, 32 nb) int8
    bytes of the matrix integers plus a bias making them unsigned (natural order), wd (rows,
    nb); xq (tiles, 8 nb, 16, 4) int8: lane j of block b for 16 columns, 4 bytes each;
    xc (tiles, 8 nb, 16) int32: -bias times each lane's sum of x (vpdpbusd adding the
    products of w + bias and x to it gives the lane's exact integer sum, without a
    subtraction per row); xd (tiles, nb, 16); res (32,)."""
    b = e.b
    xq_t, xd_t, w_rows, d_rows = _q0_operands(e, wu, wd, xq, xd, r0, tile, nb, 2)
    xc_t = e.gep(xc, b.mul(tile, b.mul(b.mul(nb, e.const(8)), e.const(W))))
    accs = [[e.acc() for _ in range(8)] for _ in range(2)]
    with e.loop(nb) as blk:
        dx = e.load(xd_t, b.mul(blk, e.const(W)))
        s = [e.mul(e.splat(e.at(d_rows[r], blk)), dx) for r in range(2)]
        for j in range(8):
            lane = b.add(b.mul(blk, e.const(8)), e.const(j))
            xv = e.load(xq_t, b.mul(lane, e.const(W)), VI)
            corr = e.load(xc_t, b.mul(lane, e.const(W)), VI)
            for r in range(2):
                wv = e.splat(e.at(w_rows[r], lane))  # the lane's 4 unsigned bytes
                p = b.sitofp(_dp(e, corr, wv, xv), VF)  # starts from -bias * sum(x)
                slot = accs[r][j]
                b.store(e.fma(s[r], p, b.load(slot)), slot)
    for r in range(2):
        e.store(res, e.const(W * r), e.hsum([b.load(slot) for slot in accs[r]]))


@kernel()
def q0_blocks_vnni(e, wu, wd, xq, xcb, xd, res, r0, tile, nb):
    """The Q0 product of 8 matrix rows and 16 columns with one float multiply-add per block of
    32: the block's integer sum (exact) whole, acc = fma(d_w * d_x, isum, acc) over the blocks
    in order, where ggml's order keeps 8 lanes of 4 products each (q0_tile2_vnni); 2.4 times
    fewer vector operations, results equal to float32 rounding. Operands as q0_tile2_vnni's
    but xcb (tiles, nb, 16) int32: -bias times each block's sum of x; res (128,)."""
    b, rows = e.b, BLOCK_ROWS
    xq_t, xd_t, w_rows, d_rows = _q0_operands(e, wu, wd, xq, xd, r0, tile, nb, rows)
    xcb_t = e.gep(xcb, b.mul(tile, b.mul(nb, e.const(W))))
    accs = [e.acc() for _ in range(rows)]
    with e.loop(nb) as blk:
        dx = e.load(xd_t, b.mul(blk, e.const(W)))
        isum = [e.load(xcb_t, b.mul(blk, e.const(W)), VI)] * rows
        for j in range(8):
            lane = b.add(b.mul(blk, e.const(8)), e.const(j))
            xv = e.load(xq_t, b.mul(lane, e.const(W)), VI)
            for r in range(rows):
                isum[r] = _dp(e, isum[r], e.splat(e.at(w_rows[r], lane)), xv)
        for r in range(rows):
            s = e.mul(e.splat(e.at(d_rows[r], blk)), dx)
            b.store(e.fma(s, b.sitofp(isum[r], VF), b.load(accs[r])), accs[r])
    for r in range(rows):
        e.store(res, e.const(W * r), b.load(accs[r]))


@kernel()
def q4_k_nibbles(e, buf, o, nb, dst):
    """The 4-bit integers of the Q4_K row at buf[o] (nb super-blocks) to dst[256 i + e] as
    bytes, natural order: per 32 packed bytes of chunk c, the low nibbles are elements 64 c ..,
    the high ones 64 c + 32 ... (Explicit vectors: numba's loop cannot rule out that dst
    overlaps buf, and stays scalar.)"""
    b = e.b
    v32 = vec(I8, 32)
    with e.loop(nb) as i:
        src, out = b.add(o, b.mul(i, e.const(144))), b.mul(i, e.const(256))
        for c in range(4):
            qs = e.load(buf, b.add(src, e.const(16 + 32 * c)), v32, align=1)
            e.store(dst, b.add(out, e.const(64 * c)), b.and_(qs, e.const(15, v32)), align=1)
            e.store(dst, b.add(out, e.const(64 * c + 32)), b.lshr(qs, e.const(4, v32)), align=1)


Q4K_VNNI_ROWS = 4  # matrix rows per call of q4_k_tile_vnni: 2 chains each of vpdpbusd


@kernel()
def q4_k_tile_vnni(e, wu, wsc, wd, wdm, wmin, xq, xd, xbs, res, r0, tile, nb):
    """quant_tiles.q4_k_tile's numbers (ggml_gemm_q4_K_8x8_q8_K) for Q4K_VNNI_ROWS rows x 16
    columns, the integer sums by AVX512-VNNI: per 64-element chunk, the two sub-blocks' sums
    of q * q8 (vpdpbusd, exact), then P = isum_2 * sc_2 + isum_1 * sc_1, exact in float32 as
    the float tile's sum of (q * sc) * q8 is; the rest as there.

    wu (rows, 256 nb) uint8: the rows' 4-bit integers, natural order; wsc, wmin (rows, 8 nb):
    each sub-block's scale and min; wd, wdm (rows, nb); xq (tiles, 64 nb, 16, 4) int8: 4
    consecutive integers of each of 16 columns; xd (tiles, nb, 16); xbs (tiles, 8 nb, 16);
    res (16 rows,)."""
    b, n = e.b, Q4K_VNNI_ROWS
    k_all = b.mul(nb, e.const(256))
    xq_t = b.bitcast(e.gep(xq, b.mul(tile, b.mul(k_all, e.const(W)))), I32.as_pointer())
    xd_t = e.gep(xd, b.mul(tile, b.mul(nb, e.const(W))))
    xbs_t = e.gep(xbs, b.mul(tile, b.mul(nb, e.const(8 * W))))
    w_rows = [b.bitcast(p, I32.as_pointer()) for p in e.rows(wu, r0, k_all, n)]
    d_rows, dm_rows = e.rows(wd, r0, nb, n), e.rows(wdm, r0, nb, n)
    sc_rows = e.rows(wsc, r0, b.mul(nb, e.const(8)), n)
    m_rows = e.rows(wmin, r0, b.mul(nb, e.const(8)), n)
    acc = [e.acc() for _ in range(n)]
    accm = [e.acc() for _ in range(n)]
    zero = e.const(0, VI)
    with e.loop(b.mul(nb, e.const(4))) as ch:  # chunk: super-block ch // 4, sub-blocks 2 ch and 2 ch + 1
        blk = b.udiv(ch, e.const(4))
        isum = [[zero, zero] for _ in range(n)]
        for g in range(8):
            for half in range(2):
                quad = b.add(b.mul(ch, e.const(16)), e.const(8 * half + g))
                xv = e.load(xq_t, b.mul(quad, e.const(W)), VI)
                for r in range(n):
                    isum[r][half] = _dp(e, isum[r][half], e.splat(e.at(w_rows[r], quad)), xv)
        dx = e.load(xd_t, b.mul(blk, e.const(W)))
        s1 = b.mul(ch, e.const(2))
        s2 = b.add(s1, e.const(1))
        bs1 = e.load(xbs_t, b.mul(s1, e.const(W)))
        bs2 = e.load(xbs_t, b.mul(s2, e.const(W)))
        for r in range(n):
            p = e.fma(b.sitofp(isum[r][1], VF), e.splat(e.at(sc_rows[r], s2)),
                      e.mul(b.sitofp(isum[r][0], VF), e.splat(e.at(sc_rows[r], s1))))  # exact integers
            mins = e.fma(e.splat(e.at(m_rows[r], s2)), bs2, e.mul(e.splat(e.at(m_rows[r], s1)), bs1))
            sd = e.mul(e.splat(e.at(d_rows[r], blk)), dx)
            sm = e.mul(e.splat(e.at(dm_rows[r], blk)), dx)
            b.store(e.fma(p, sd, b.load(acc[r])), acc[r])
            b.store(e.fma(mins, sm, b.load(accm[r])), accm[r])
    for r in range(n):
        e.store(res, e.const(W * r), b.fsub(b.load(acc[r]), b.load(accm[r])))


Q6K_VNNI_ROWS = 4  # matrix rows per call of q6_k_tile_vnni


@kernel()
def q6_k_tile_vnni(e, wu, wsc, wd, xq, xbs, xd, res, r0, tile, nb):
    """quant_tiles.q6_k_tile's numbers (ggml-cpu/tiled's Q6_K product) for Q6K_VNNI_ROWS rows
    x 16 columns, the integer sums by AVX512-VNNI: per 16-element group s, vpdpbusd sums the
    unsigned 6-bit integers (q + 32) times q8 from -32 times the group's q8 sum, which is
    sum (q * q8) exactly; times the group's scale, added over the super-block in int32
    (exact: the float tile adds the same integers in double), rounded to float32 once, times
    d, then acc = fma(that, d_x, acc).

    wu (rows, 256 nb) uint8: q + 32, natural order; wsc (rows, 16 nb) int32: the groups'
    scales; wd (rows, nb); xq (tiles, 64 nb, 16, 4) int8; xbs (tiles, 16 nb, 16) float32: each
    group's q8 sum; xd (tiles, nb, 16); res (16 rows,)."""
    b, n = e.b, Q6K_VNNI_ROWS
    k_all = b.mul(nb, e.const(256))
    xq_t = b.bitcast(e.gep(xq, b.mul(tile, b.mul(k_all, e.const(W)))), I32.as_pointer())
    xd_t = e.gep(xd, b.mul(tile, b.mul(nb, e.const(W))))
    xbs_t = e.gep(xbs, b.mul(tile, b.mul(nb, e.const(16 * W))))
    w_rows = [b.bitcast(p, I32.as_pointer()) for p in e.rows(wu, r0, k_all, n)]
    sc_rows = e.rows(wsc, r0, b.mul(nb, e.const(16)), n)
    d_rows = e.rows(wd, r0, nb, n)
    acc = [e.acc() for _ in range(n)]
    minus32 = e.const(-32, VI)
    with e.loop(nb) as blk:
        tot = [e.const(0, VI)] * n
        for s in range(16):
            group = b.add(b.mul(blk, e.const(16)), e.const(s))
            corr = b.mul(b.fptosi(e.load(xbs_t, b.mul(group, e.const(W))), VI), minus32)
            isum = [corr] * n
            for g in range(4):
                quad = b.add(b.mul(blk, e.const(64)), e.const(4 * s + g))
                xv = e.load(xq_t, b.mul(quad, e.const(W)), VI)
                for r in range(n):
                    isum[r] = _dp(e, isum[r], e.splat(e.at(w_rows[r], quad)), xv)
            for r in range(n):
                tot[r] = b.add(tot[r], b.mul(isum[r], e.splat(e.at(sc_rows[r], group))))
        dx = e.load(xd_t, b.mul(blk, e.const(W)))
        for r in range(n):
            rs = e.mul(b.sitofp(tot[r], VF), e.splat(e.at(d_rows[r], blk)))
            b.store(e.fma(rs, dx, b.load(acc[r])), acc[r])
    for r in range(n):
        e.store(res, e.const(W * r), b.load(acc[r]))


def _lane_fma(e: Emit, acc, scale, isum) -> None:
    """acc = fma(scale in every lane, the 8 lanes' integer sums, acc)."""
    e.b.store(e.fma(e.splat(scale, 8), e.b.sitofp(isum, VF8), e.b.load(acc)), acc)


def _q0_row(e: Emit, buf, o, xd, nb, block_bytes: int, lane_sums):
    """The float part of the Q0 row kernels in ggml's order: per block, lane_j =
    fma(d_w * d_x, isum_j, lane_j), then hsum8; lane_sums(bo, blk) gives block blk's 8 lane
    integer sums (bo: its offset in buf, where d_w is)."""
    b = e.b
    acc = e.acc(VF8)
    with e.loop(nb) as blk:
        bo = b.add(o, b.mul(blk, e.const(block_bytes)))
        dw = e.half(buf, bo)
        isum = lane_sums(bo, blk)
        _lane_fma(e, acc, b.fmul(dw, e.at(xd, blk)), isum)
    return e.hsum(e.lanes(b.load(acc)))


@kernel(types.float32)
def q8_0_row_vnni(e, buf, o, xu, xd, nb):
    """ggml_vec_dot_q8_0_q8_0 of the Q8_0 row at buf[o] (its packed blocks, used in place)
    and one activation column: per block, 8 lanes of 4 products by AVX512-VNNI, lane_j =
    fma(d_w * d_x, isum_j, lane_j), then hsum8 (as q0_lanes_tile computes it, for one column).
    xu (32 nb,) uint8: the activations' integers plus 128; xd (nb,) their scales."""
    b = e.b
    zero, ones, seven = e.const(0, VI8), e.const(0x01010101, VI8), e.const(7, VI8)

    def lane_sums(bo, blk):  # sum (x + 128) w - 128 sum w
        w = e.load(buf, b.add(bo, e.const(2)), VI8, align=1)
        xv = e.load(xu, b.mul(blk, e.const(32)), VI8, align=1)
        return b.sub(_dp(e, zero, xv, w), b.shl(_dp(e, zero, ones, w), seven))
    return _q0_row(e, buf, o, xd, nb, 34, lane_sums)


@kernel(types.float32)
def q5_0_row_vnni(e, buf, o, xs, xsum, xd, nb):
    """ggml_vec_dot_q5_0_q8_0 of the Q5_0 row at buf[o] (packed blocks, used in place) and one
    activation column: per block the 32 5-bit integers (plus 16: unsigned) by AVX512-VNNI
    against the column's int8 integers xs, minus 16 xsum (its lane sums), lane_j =
    fma(d_w * d_x, isum_j, lane_j); hsum8. xs (32 nb,) int8, xsum (8 nb,) int32, xd (nb,)."""
    b = e.b
    b16, v32 = vec(I8, 16), vec(I32, 32)
    zero = e.const(0, VI8)
    bitmask = ir.Constant(v32, [1 << i for i in range(32)])

    def lane_sums(bo, blk):
        qh = e.load(buf, b.add(bo, e.const(2)), I32, align=1)
        qs = e.load(buf, b.add(bo, e.const(6)), b16, align=1)
        lo = b.and_(qs, e.const(15, b16))
        hi = b.lshr(qs, e.const(4, b16))
        nib = b.shuffle_vector(lo, hi, ir.Constant(v32, list(range(32))))
        bit = b.icmp_unsigned("!=", b.and_(e.splat(qh, 32), bitmask), e.const(0, v32))
        u = b.or_(nib, b.select(bit, e.const(16, B32), e.const(0, B32)))
        w = b.bitcast(u, VI8)  # integer + 16, unsigned
        xv = e.load(xs, b.mul(blk, e.const(32)), VI8, align=1)
        xsv = e.load(xsum, b.mul(blk, e.const(8)), VI8)
        return b.sub(_dp(e, zero, w, xv), b.shl(xsv, e.const(4, VI8)))
    return _q0_row(e, buf, o, xd, nb, 22, lane_sums)


def _q4_k_scales(e: Emit, buf, bo):
    """The 8 six-bit scales and 8 mins of the Q4_K super-block at buf[bo], as 4 i32 words of 4
    bytes each (scales in words 0-1, mins in 2-3), by ggml's word arithmetic on its 12 bytes."""
    b = e.b
    u = [b.load(b.bitcast(e.gep(buf, b.add(bo, e.const(4 + 4 * w))), I32.as_pointer()), align=1) for w in range(3)]
    c = lambda n: ir.Constant(I32, n)
    m1, m2, m3 = c(0x3F3F3F3F), c(0x0F0F0F0F), c(0x03030303)
    w3 = b.or_(b.and_(b.lshr(u[2], c(4)), m2), b.shl(b.and_(b.lshr(u[1], c(6)), m3), c(4)))
    w2 = b.and_(u[1], m1)
    w1 = b.or_(b.and_(u[2], m2), b.shl(b.and_(b.lshr(u[0], c(6)), m3), c(4)))
    w0 = b.and_(u[0], m1)
    return [w0, w1, w2, w3]


@kernel()
def q4_k_tile_packed_vnni(e, buf, offs, m0, xq, xd, xbs, res, tile, nb):
    """q4_k_tile_vnni's numbers for Q4K_VNNI_ROWS rows read in place (buf[offs[m0 + r]], the
    file's blocks: nothing unpacked), for products of few columns, where unpacking every row
    would cost more than the product: 4 packed bytes hold 4 consecutive elements in their low
    nibbles (or, 32 elements on, in their high ones); the scales and mins are decoded here.
    Operands as q4_k_tile_vnni's."""
    b, n = e.b, Q4K_VNNI_ROWS
    k_all = b.mul(nb, e.const(256))
    xq_t = b.bitcast(e.gep(xq, b.mul(tile, b.mul(k_all, e.const(W)))), I32.as_pointer())
    xd_t = e.gep(xd, b.mul(tile, b.mul(nb, e.const(W))))
    xbs_t = e.gep(xbs, b.mul(tile, b.mul(nb, e.const(8 * W))))
    o = [e.at(offs, b.add(m0, e.const(r))) for r in range(n)]
    acc = [e.acc() for _ in range(n)]
    accm = [e.acc() for _ in range(n)]
    zero = e.const(0, VI)
    low, four = ir.Constant(I32, 0x0F0F0F0F), ir.Constant(I32, 4)
    with e.loop(nb) as blk:
        dx = e.load(xd_t, b.mul(blk, e.const(W)))
        bo = [b.add(o[r], b.mul(blk, e.const(144))) for r in range(n)]
        words = [_q4_k_scales(e, buf, bo[r]) for r in range(n)]
        sd = [e.mul(e.splat(e.half(buf, bo[r])), dx) for r in range(n)]
        sm = [e.mul(e.splat(e.half(buf, b.add(bo[r], e.const(2)))), dx) for r in range(n)]
        for c in range(4):
            isum = [[zero, zero] for _ in range(n)]
            for g in range(8):
                packed = [b.load(b.bitcast(e.gep(buf, b.add(bo[r], e.const(16 + 32 * c + 4 * g))), I32.as_pointer()),
                                 align=1) for r in range(n)]
                for half in range(2):
                    quad = b.add(b.mul(blk, e.const(64)), e.const(16 * c + 8 * half + g))
                    xv = e.load(xq_t, b.mul(quad, e.const(W)), VI)
                    for r in range(n):
                        q4 = b.and_(b.lshr(packed[r], four) if half else packed[r], low)
                        isum[r][half] = _dp(e, isum[r][half], e.splat(q4), xv)
            s1, s2 = 2 * c, 2 * c + 1
            sub1 = b.add(b.mul(blk, e.const(8)), e.const(s1))
            bs1 = e.load(xbs_t, b.mul(sub1, e.const(W)))
            bs2 = e.load(xbs_t, b.mul(b.add(sub1, e.const(1)), e.const(W)))
            for r in range(n):
                w = words[r]
                sc1, sc2 = (b.and_(b.lshr(w[s // 4], ir.Constant(I32, 8 * (s % 4))), ir.Constant(I32, 0xFF))
                            for s in (s1, s2))
                mn1, mn2 = (b.and_(b.lshr(w[2 + s // 4], ir.Constant(I32, 8 * (s % 4))), ir.Constant(I32, 0xFF))
                            for s in (s1, s2))
                f = lambda v: e.splat(b.sitofp(v, F32))  # noqa: E731 -- exact small integers
                p = e.fma(b.sitofp(isum[r][1], VF), f(sc2), e.mul(b.sitofp(isum[r][0], VF), f(sc1)))
                mins = e.fma(f(mn2), bs2, e.mul(f(mn1), bs1))
                b.store(e.fma(p, sd[r], b.load(acc[r])), acc[r])
                b.store(e.fma(mins, sm[r], b.load(accm[r])), accm[r])
    for r in range(n):
        e.store(res, e.const(W * r), b.fsub(b.load(acc[r]), b.load(accm[r])))


Q4K_ROW_CALL = 8  # rows per call of q4_k_rows_vnni: one float lane each, the column's loads shared
V16 = vec(I16, 32)  # 32 int16 lanes (vpmaddubsw's products, vpdpwssd's operands)


def _mask(idx: list):
    return ir.Constant(vec(I32, len(idx)), idx)


def _fold_runs(e: Emit, vectors: list, runs: int) -> list:
    """Sums of equal runs of lanes: `vectors` (<16 x i32>) hold the runs in order, `runs` to a
    vector. Adjacent vectors are folded pairwise (each run's two halves added) until a run is
    one lane, or one vector is left; then its runs of 2 are summed (<8 x i32>). Integers: any
    order."""
    b = e.b
    while len(vectors) > 1 and runs < 16:
        width = 16 // runs
        lo = [t * width + u for t in range(runs) for u in range(width // 2)]
        lo += [16 + j for j in lo]
        hi = [j + width // 2 for j in lo]
        vectors = [b.add(b.shuffle_vector(a, c, _mask(lo)), b.shuffle_vector(a, c, _mask(hi)))
                   for a, c in zip(vectors[0::2], vectors[1::2])]
        runs *= 2
    if runs < 16:
        v = vectors[0]
        vectors = [b.add(b.shuffle_vector(v, v, _mask(list(range(0, 16, 2)))),
                         b.shuffle_vector(v, v, _mask(list(range(1, 16, 2)))))]
    return vectors


def _per_chunk(e: Emit, pair: list) -> list:
    """The 4 <8 x i32> of chunk c's sums over 8 rows, from 2 vectors of [row: chunks 0-3] x 4."""
    return [e.b.shuffle_vector(pair[0], pair[1], _mask([4 * r + c for r in range(8)])) for c in range(4)]


def _q4_k_rows(e: Emit, buf, offs, m0, xs, xd, bs32, res, nb, chunked: bool) -> None:
    """q4_k_rows_vnni's body; `chunked`: the float sums per 64-element chunk (the gemm's order)."""
    b, rows = e.b, Q4K_ROW_CALL
    v16i32, v64i8 = vec(I32, 16), vec(I8, 64)
    lanes4 = lambda pattern: [4 * q + j for q in range(4) for j in pattern]  # noqa: E731 -- per 128-bit lane
    o = [e.at(offs, b.add(m0, e.const(r))) for r in range(rows)]
    nxt = [e.at(offs, b.add(m0, e.const(rows + r))) for r in range(rows)]
    acc, accm = e.acc(VF8), e.acc(VF8)
    m1, m2, m3 = (e.const(c, v16i32) for c in (0x3F3F3F3F, 0x0F0F0F0F, 0x03030303))
    shift_u2 = ir.Constant(v16i32, [0, 0, 0, 4] * 4)  # word 3 takes u2's high nibbles
    odd_words = ir.Constant(vec(ir.IntType(1), 16), [False, True, False, True] * 4)
    zero = e.const(0, v16i32)
    with e.loop(nb) as i:
        xi = b.mul(i, e.const(256))
        half = [e.load(xs, b.add(xi, e.const(32 * k)), VI8, align=1) for k in range(8)]  # 32 elements each
        join = _mask(list(range(16)))
        # per pair p of 64-byte chunks: the x of their low nibbles and of their high ones
        xlo = [b.bitcast(b.shuffle_vector(half[4 * p], half[4 * p + 2], join), v64i8) for p in range(2)]
        xhi = [b.bitcast(b.shuffle_vector(half[4 * p + 1], half[4 * p + 3], join), v64i8) for p in range(2)]
        bs = b.trunc(e.load(bs32, b.mul(i, e.const(8)), VI8), vec(I16, 8))
        # a row's 16 words [8 scales, 8 mins] times [0 x 8, the 8 sums]: 4 pair sums of m_s bs_s
        bs_pair = b.shuffle_vector(bs, e.const(0, vec(I16, 8)), _mask(([8] * 8 + list(range(8))) * 2))
        bo = [b.add(o[r], b.mul(i, e.const(144))) for r in range(rows)]
        for r in range(rows):  # the next call's rows: 8 streams at once outrun the hardware's prefetcher
            ahead = b.add(nxt[r], b.mul(i, e.const(144)))
            for line in range(0, 144, 64):
                e.prefetch(e.gep(buf, b.add(ahead, e.const(line))))
        head = [e.load(buf, bo[r], vec(I32, 4), align=1) for r in range(rows)]
        quad = [b.shuffle_vector(b.shuffle_vector(head[4 * g], head[4 * g + 1], _mask(list(range(8)))),
                                 b.shuffle_vector(head[4 * g + 2], head[4 * g + 3], _mask(list(range(8)))),
                                 _mask(list(range(16)))) for g in range(2)]  # lane q: [d | dmin, u0, u1, u2]
        words = []
        for h in quad:  # ggml's 12-byte decode, [w0, w1, w2, w3] per row
            s1 = b.shuffle_vector(h, h, _mask(lanes4([1, 3, 2, 3])))  # u0, u2, u1, u2
            s2 = b.shuffle_vector(h, h, _mask(lanes4([1, 1, 2, 2])))  # u0, u0, u1, u1
            even = b.and_(s1, m1)
            odd = b.or_(b.and_(b.lshr(s1, shift_u2), m2), b.shl(b.and_(b.lshr(s2, e.const(6, v16i32)), m3),
                                                               e.const(4, v16i32)))
            words.append(b.zext(b.bitcast(b.select(odd_words, odd, even), v64i8), vec(I16, 64)))
        dots, mins = [], []
        for r in range(rows):
            src, q = words[r // 4], 16 * (r % 4)  # the row's words: 8 scales, then 8 mins
            if r % 2 == 0:
                pair = b.shuffle_vector(src, src, _mask(list(range(q, q + 32))))
                mins.append(e.call("llvm.x86.avx512.pmaddw.d.512", v16i32, pair, bs_pair))
            lane = zero
            for p in range(2):  # lanes 0-7: chunk 2 p, 8-15: chunk 2 p + 1
                qs = e.load(buf, b.add(bo[r], e.const(16 + 64 * p)), v64i8, align=1)
                for nib, x, s in ((b.and_(qs, e.const(15, v64i8)), xlo[p], 4 * p),
                                  (b.lshr(qs, e.const(4, v64i8)), xhi[p], 4 * p + 1)):
                    prod = e.call("llvm.x86.avx512.pmaddubs.w.512", V16, nib, x)  # |sum| <= 2 * 15 * 128
                    scale = b.shuffle_vector(src, src, _mask([q + s] * 16 + [q + s + 2] * 16))
                    lane = _dpw(e, lane, prod, scale)
                if chunked:
                    dots.append(lane)
                    lane = zero
            if not chunked:
                dots.append(lane)
        dword = b.shuffle_vector(quad[0], quad[1], _mask(list(range(0, 32, 4))))
        halves = b.bitcast(dword, vec(HALF, 16))
        dx = e.splat(e.at(xd, i), 8)
        sd = b.fmul(b.fpext(b.shuffle_vector(halves, halves, _mask(list(range(0, 16, 2)))), VF8), dx)
        sm = b.fmul(b.fpext(b.shuffle_vector(halves, halves, _mask(list(range(1, 16, 2)))), VF8), dx)
        if chunked:  # per chunk: its two sub-blocks' sums; mins: a row's lanes 4-7 of its pmaddwd run
            isums = _per_chunk(e, _fold_runs(e, dots, 2))
            pick = [4, 5, 6, 7, 12, 13, 14, 15]
            imins = _per_chunk(e, [b.shuffle_vector(mins[2 * g], mins[2 * g + 1], _mask(pick + [16 + j for j in pick]))
                                   for g in range(2)])
        else:
            isums, imins = _fold_runs(e, dots, 1), _fold_runs(e, mins, 2)
        for isum, imin in zip(isums, imins):
            b.store(e.fma(b.sitofp(isum, VF8), sd, b.load(acc)), acc)
            b.store(e.fma(b.sitofp(imin, VF8), sm, b.load(accm)), accm)
    e.store(res, e.const(0), b.fsub(b.load(acc), b.load(accm)))


@kernel()
def q4_k_rows_vnni(e, buf, offs, m0, xs, xd, bs32, res, nb):
    """ggml_gemv_q4_K_8x8_q8_K for Q4K_ROW_CALL Q4_K rows (at buf[offs[m0 + r]], used in place)
    and one column, a row per float lane: per super-block i, isum = sum over sub-blocks s of
    sc_s * (nibbles . xs) and imin = sum of m_s * bs32[8 i + s] (exact integers: vpmaddubsw's
    pair products, vpdpwssd's scaled sums, then a fold of the 8 rows' lanes together);
    acc = fma(isum, d * xd[i], acc), accm = fma(imin, dmin * xd[i], accm); res[r] = acc - accm.
    The scales and mins are decoded for 4 rows at once, a row's 16 header bytes per 128-bit
    lane. offs[m0 + 8 ..  m0 + 15]: the next call's rows, prefetched super-block by super-block
    (without it the 8 streams read at about half the memory's speed). xs (256 nb,) int8; bs32
    (8 nb,) int32: the column's 32-element sums; res (8,) float32."""
    _q4_k_rows(e, buf, offs, m0, xs, xd, bs32, res, nb, chunked=False)


@kernel()
def q4_k_rows_chunks_vnni(e, buf, offs, m0, xs, xd, bs32, res, nb):
    """q4_k_rows_vnni in ggml_gemm_q4_K_8x8_q8_K's order (a column of a group of 4): the fmas
    per 64-element chunk of a super-block (its 2 sub-blocks' isum and imin), 4 a super-block."""
    _q4_k_rows(e, buf, offs, m0, xs, xd, bs32, res, nb, chunked=True)


def _vector(e: Emit, values):
    """<8 x i32> of 8 i32 values."""
    v = ir.Constant(VI8, ir.Undefined)
    for i, x in enumerate(values):
        v = e.b.insert_element(v, x, ir.Constant(I32, i))
    return v


@kernel(types.float32)
def q6_k_row_vnni(e, buf, o, xs, xd, bse, bso, nb):
    """ggml_vec_dot_q6_K_q8_K (AVX2) for the Q6_K row at buf[o] (used in place) and one
    column: per super-block, lane l (of 8) = sum over halves h and groups g of
    scale[8 h + 2 g + (l >= 4)] * (unsigned 6-bit integers . xs over 4 l .. 4 l + 3 of the
    group) (AVX512-VNNI) - 32 (bse[l] scale[2 l] + bso[l] scale[2 l + 1]);
    lane = fma(xd[i] * d, lane, lane); hsum8. xs (256 nb,) int8; bse, bso (8 nb,) int32: the
    column's 16-element sums of even and odd sub-blocks."""
    b = e.b
    zero = e.const(0, VI8)
    acc = e.acc(VF8)
    with e.loop(nb) as i:
        bo = b.add(o, b.mul(i, e.const(210)))
        scale = [b.sext(e.at(buf, b.add(bo, e.const(192 + s))), I32) for s in range(16)]
        tot = zero
        for h in range(2):
            qh = b.bitcast(e.load(buf, b.add(bo, e.const(128 + 32 * h)), VI8, align=1), B32)
            ql = [b.bitcast(e.load(buf, b.add(bo, e.const(64 * h + 32 * part)), VI8, align=1), B32)
                  for part in range(2)]
            for g in range(4):
                low = b.and_(ql[g % 2], e.const(15, B32)) if g < 2 else b.lshr(ql[g % 2], e.const(4, B32))
                high = b.shl(b.and_(b.lshr(qh, e.const(2 * g, B32)), e.const(3, B32)), e.const(4, B32))
                u6 = b.bitcast(b.or_(low, high), VI8)
                xv = e.load(xs, b.add(b.mul(i, e.const(256)), e.const(128 * h + 32 * g)), VI8, align=1)
                sv = _vector(e, [scale[8 * h + 2 * g]] * 4 + [scale[8 * h + 2 * g + 1]] * 4)
                tot = b.add(tot, b.mul(_dp(e, zero, u6, xv), sv))
        even = e.load(bse, b.mul(i, e.const(8)), VI8)
        odd = e.load(bso, b.mul(i, e.const(8)), VI8)
        sub = b.add(b.mul(even, _vector(e, scale[0::2])), b.mul(odd, _vector(e, scale[1::2])))
        lanes = b.sub(tot, b.shl(sub, e.const(5, VI8)))
        _lane_fma(e, acc, b.fmul(e.at(xd, i), e.half(buf, b.add(bo, e.const(208)))), lanes)
    return e.hsum(e.lanes(b.load(acc)))
