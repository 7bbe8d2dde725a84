"""The float32 vector micro-kernels of the quantized products (qexact.py), in the float order
ggml's kernels fix.

numba vectorises innermost loops only, so a kernel whose accumulators must stay in
registers across an outer loop (an fma chain per lane over the blocks of a row, for 16
columns at once) compiles to memory round trips per step. These kernels keep explicit
<16 x float> accumulators (allocas that LLVM promotes to registers): a numba kernel does the
task loop and the unpacking, and calls one of these per tile of 16 columns (or, for few
columns, of 16 matrix rows). The arithmetic is the same float32 operations, in the same
order, as the numba reference loops in qexact.py.

Data layout: the activations are column-major for 16-wide loads, xq[e, n] (element e of
column n), with a column count padded to a multiple of 16; the matrix rows a task unpacks
are row-major floats. Q5_0/Q8_0 in ggml's order put both sides' elements lane-major
(qexact._at), so a lane's chain reads contiguous runs.
"""
from __future__ import annotations

from llvmlite import ir

from .emit import F32, I32, VD, VF, Emit, W, kernel

# rows per call of q0_lanes_tile and q0_blocks_tile: 3 x 16 columns of chains (of one lane, or of
# blocks) and of sums fill AVX2's 16 registers
Q0_ROWS = 3
Q4K_ROWS = 4
Q6K_ROWS = 4


def _dots(e: Emit, w_rows, x, k0, n: int) -> list:
    """[sum_k w_r[k0 + k] * x[(k0 + k) * 16 .. + 16] for each row pointer w_r], k < n: sums of
    integer products (exact in float32, any order), one vector of 16 columns per row."""
    b = e.b
    ps = [None] * len(w_rows)
    for k in range(n):
        idx = b.add(k0, e.const(k))
        xv = e.load(x, b.mul(idx, e.const(W)))
        for r, wr in enumerate(w_rows):
            wv = e.splat(e.at(wr, idx))
            ps[r] = e.mul(wv, xv) if ps[r] is None else e.fma(wv, xv, ps[r])
    return ps


def _dots_t(e: Emit, w, x, k0, n: int):
    """sum_k w[(k0 + k) * 16 .. + 16] * x[k0 + k], k < n: a tile of 16 matrix rows (column
    layout) times one activation column; integer products, exact in any order."""
    b = e.b
    p = None
    for k in range(n):
        idx = b.add(k0, e.const(k))
        t_w = e.load(w, b.mul(idx, e.const(W)))
        xv = e.splat(e.at(x, idx))
        p = e.mul(t_w, xv) if p is None else e.fma(t_w, xv, p)
    return p


def _q0_operands(e: Emit, wq, wd, xq, xd, r0, tile, nb):
    """What the float Q0 tiles read: column tile `tile`'s integers and scales, and Q0_ROWS
    rows' integers and scales from r0."""
    b = e.b
    wrow = b.mul(nb, e.const(32))
    xq_t = e.gep(xq, b.mul(tile, b.mul(wrow, e.const(W))))
    xd_t = e.gep(xd, b.mul(tile, b.mul(nb, e.const(W))))
    return xq_t, xd_t, e.rows(wq, r0, wrow, Q0_ROWS), e.rows(wd, r0, nb, Q0_ROWS)


@kernel()
def q0_lanes_tile(e, wq, wd, xq, xd, sbuf, res, r0, tile, nb):
    """Q0_ROWS matrix rows (r0..) x the 16 columns of column tile `tile` of the Q5_0/Q8_0
    product in ggml's order: res[16 r + c] = hsum8 over lanes j of the fma chain over blocks
    b of (wd[row, b] * xd[tile, b, c]) * (lane j's 4 integer products of block b, exact).

    One lane at a time: the lanes' chains are independent, so running them one after another
    changes no bit, and only 3 rows x 16 columns of chains are live at once (in registers on
    AVX2; all 8 lanes of 2 rows at once spilled on every step: 1.45x slower, bench/RESULTS.md,
    eighth session). wq (rows, 32 nb) the rows' integers and xq (tiles, 32 nb, 16) the
    columns', both lane-major (qexact._at: lane j of every block is one run of 4 nb),
    wd (rows, nb), xd (tiles, nb, 16); sbuf (3 nb 16,) takes the scale products d_w d_x,
    computed once for the 8 lanes; res (48,)."""
    b, rows = e.b, Q0_ROWS
    xq_t, xd_t, w_rows, d_rows = _q0_operands(e, wq, wd, xq, xd, r0, tile, nb)
    s_rows = e.rows(sbuf, e.const(0), b.mul(nb, e.const(W)), rows)
    with e.loop(nb) as blk:
        dx = e.load(xd_t, b.mul(blk, e.const(W)))
        for r in range(rows):
            e.store(s_rows[r], b.mul(blk, e.const(W)), e.mul(e.splat(e.at(d_rows[r], blk)), dx))
    lanes = e.array(VF, 8 * rows)  # each row's 8 lane sums

    def lane(r, j):
        return b.gep(lanes, [ir.Constant(I32, 0), b.trunc(b.add(e.const(8 * r), j), I32)])
    with e.loop(e.const(8)) as j:  # a loop, not unrolled: 8x less to compile
        run = b.mul(nb, b.mul(j, e.const(4)))  # lane j's run
        accs = [e.acc() for _ in range(rows)]
        with e.loop(nb) as blk:
            ps = _dots(e, w_rows, xq_t, b.add(b.mul(blk, e.const(4)), run), 4)  # exact, any order
            for r in range(rows):
                sv = e.load(s_rows[r], b.mul(blk, e.const(W)))
                b.store(e.fma(sv, ps[r], b.load(accs[r])), accs[r])
        for r in range(rows):
            b.store(b.load(accs[r]), lane(r, j))
    for r in range(rows):
        e.store(res, e.const(W * r), e.hsum([b.load(lane(r, e.const(i))) for i in range(8)]))


@kernel()
def q0_blocks_tile(e, wq, wd, xq, xd, res, r0, tile, nb):
    """q0_blocks_vnni's numbers in float32 vector code, for CPUs without AVX512-VNNI: per
    block of 32, each row's integer sum with 16 columns whole (32 products of integers, exact
    in float32), then acc = fma(d_w * d_x, isum, acc) over the blocks in order. One float
    multiply-add per 32 products where ggml's 8 lanes take 8 (q0_lanes_tile), 1.2x faster.
    Operands as q0_lanes_tile's, but in natural order (a block's 32 elements together);
    res (48,)."""
    b, rows = e.b, Q0_ROWS
    xq_t, xd_t, w_rows, d_rows = _q0_operands(e, wq, wd, xq, xd, r0, tile, nb)
    accs = [e.acc() for _ in range(rows)]
    with e.loop(nb) as blk:
        isums = _dots(e, w_rows, xq_t, b.mul(blk, e.const(32)), 32)
        dx = e.load(xd_t, b.mul(blk, e.const(W)))
        for r in range(rows):
            s = e.mul(e.splat(e.at(d_rows[r], blk)), dx)
            b.store(e.fma(s, isums[r], b.load(accs[r])), accs[r])
    for r in range(rows):
        e.store(res, e.const(W * r), b.load(accs[r]))


@kernel()
def q4_k_tile(e, wq, wd, wdm, wmin, xq, xd, xbs, res, r0, tile, nb):
    """Q4K_ROWS matrix rows (r0..) x 16 columns of ggml_gemm_q4_K_8x8_q8_K: per 64-element
    chunk c (c = 4 i + chunk of super-block i), with P = sum of wq[row, k] * xq[tile, k, :]
    over the chunk (integer: q * scale times q8) and I = sum over its two sub-blocks s of
    wmin[row, s] * xbs[tile, s, :] (min times the sub-block's q8 sum):
    acc = fma(P, wd[row, i] * xd[tile, i, :], acc), accm = fma(I, wdm[row, i] * xd[tile, i, :], accm);
    res[16 r + c] = acc - accm.

    wq (rows, 256 nb), wd, wdm (rows, nb), wmin (rows, 8 nb), xq (tiles, 256 nb, 16),
    xd (tiles, nb, 16), xbs (tiles, 8 nb, 16), res (16 Q4K_ROWS,)."""
    b, n = e.b, Q4K_ROWS
    k_all = b.mul(nb, e.const(256))
    xq_t = e.gep(xq, b.mul(tile, b.mul(k_all, e.const(W))))
    xd_t = e.gep(xd, b.mul(tile, b.mul(nb, e.const(W))))
    xbs_t = e.gep(xbs, b.mul(tile, b.mul(nb, e.const(8 * W))))
    w_rows = e.rows(wq, r0, k_all, n)
    d_rows = e.rows(wd, r0, nb, n)
    dm_rows = e.rows(wdm, r0, nb, n)
    m_rows = e.rows(wmin, r0, b.mul(nb, e.const(8)), n)
    acc = [e.acc() for _ in range(n)]
    accm = [e.acc() for _ in range(n)]
    with e.loop(b.mul(nb, e.const(4))) as ch:  # chunk: super-block ch // 4, sub-blocks 2 (ch % 4), +1
        blk = b.udiv(ch, e.const(4))
        ps = _dots(e, w_rows, xq_t, b.mul(ch, e.const(64)), 64)
        dx = e.load(xd_t, b.mul(blk, e.const(W)))
        s1 = b.mul(ch, e.const(2))
        bs1 = e.load(xbs_t, b.mul(s1, e.const(W)))
        bs2 = e.load(xbs_t, b.mul(b.add(s1, e.const(1)), e.const(W)))
        for r in range(n):
            mins = e.fma(e.splat(e.at(m_rows[r], b.add(s1, e.const(1)))), bs2,
                         e.mul(e.splat(e.at(m_rows[r], s1)), bs1))  # exact integers
            sd = e.mul(e.splat(e.at(d_rows[r], blk)), dx)
            sm = e.mul(e.splat(e.at(dm_rows[r], blk)), dx)
            b.store(e.fma(ps[r], sd, b.load(acc[r])), acc[r])
            b.store(e.fma(mins, sm, b.load(accm[r])), accm[r])
    for r in range(n):
        e.store(res, e.const(W * r), b.fsub(b.load(acc[r]), b.load(accm[r])))


@kernel()
def q6_k_tile(e, wq, wd, xq, xd, res, r0, tile, nb):
    """Q6K_ROWS matrix rows x 16 columns of ggml-cpu/tiled's Q6_K product: per super-block i
    the integer sum of wq[row, k] * xq[tile, k, :] (sixteen 16-element sums, each exact in
    float32, added in double), rounded to float32, times wd[row, i], then
    acc = fma(that, xd[tile, i, :], acc); res[16 r + c] = acc.

    wq (rows, 256 nb): q * scale of the row's elements, wd (rows, nb), xq (tiles, 256 nb, 16),
    xd (tiles, nb, 16), res (16 Q6K_ROWS,)."""
    b, n = e.b, Q6K_ROWS
    k_all = b.mul(nb, e.const(256))
    xq_t = e.gep(xq, b.mul(tile, b.mul(k_all, e.const(W))))
    xd_t = e.gep(xd, b.mul(tile, b.mul(nb, e.const(W))))
    w_rows = e.rows(wq, r0, k_all, n)
    d_rows = e.rows(wd, r0, nb, n)
    acc = [e.acc() for _ in range(n)]
    isum = [e.acc(VD) for _ in range(n)]
    with e.loop(nb) as blk:
        for r in range(n):
            b.store(e.const(0.0, VD), isum[r])
        with e.loop(e.const(16)) as sub:
            ps = _dots(e, w_rows, xq_t, b.add(b.mul(blk, e.const(256)), b.mul(sub, e.const(16))), 16)
            for r in range(n):
                b.store(b.fadd(b.load(isum[r]), b.fpext(ps[r], VD)), isum[r])
        dx = e.load(xd_t, b.mul(blk, e.const(W)))
        for r in range(n):
            rs = e.mul(b.fptrunc(b.load(isum[r]), VF), e.splat(e.at(d_rows[r], blk)))
            b.store(e.fma(rs, dx, b.load(acc[r])), acc[r])
    for r in range(n):
        e.store(res, e.const(W * r), b.load(acc[r]))


@kernel()
def q4_k_gemv_tile(e, wq, wd, wdm, wmin, x, xd, xbs, res, col, nb):
    """16 matrix rows (a tile in column layout) x column `col` of ggml_gemv_q4_K_8x8_q8_K:
    per super-block i, the integer sum over its elements of wq[k, :] * x[col, k] (per chunk
    exact in float32, added in double), rounded to float32, and I = sum over its sub-blocks s
    of wmin[s, :] * xbs[col, s]: acc = fma(sum, wd[i, :] * xd[col, i], acc),
    accm = fma(I, wdm[i, :] * xd[col, i], accm); res[:16] = acc - accm.

    wq (256 nb, 16), wd, wdm (nb, 16), wmin (8 nb, 16), x (cols, 256 nb), xd (cols, nb),
    xbs (cols, 8 nb), res (16,)."""
    b = e.b
    xr = e.gep(x, b.mul(col, b.mul(nb, e.const(256))))
    xdr = e.gep(xd, b.mul(col, nb))
    xbr = e.gep(xbs, b.mul(col, b.mul(nb, e.const(8))))
    acc, accm, isum = e.acc(), e.acc(), e.acc(VD)
    with e.loop(nb) as blk:
        b.store(e.const(0.0, VD), isum)
        with e.loop(e.const(4)) as chunk:
            p = _dots_t(e, wq, xr, b.add(b.mul(blk, e.const(256)), b.mul(chunk, e.const(64))), 64)
            b.store(b.fadd(b.load(isum), b.fpext(p, VD)), isum)
        mins = None
        for sb in range(8):
            idx = b.add(b.mul(blk, e.const(8)), e.const(sb))
            t = e.mul(e.load(wmin, b.mul(idx, e.const(W))), e.splat(e.at(xbr, idx)))
            mins = t if mins is None else e.add(mins, t)  # exact integers
        dx = e.splat(e.at(xdr, blk))
        sd = e.mul(e.load(wd, b.mul(blk, e.const(W))), dx)
        sm = e.mul(e.load(wdm, b.mul(blk, e.const(W))), dx)
        b.store(e.fma(b.fptrunc(b.load(isum), VF), sd, b.load(acc)), acc)
        b.store(e.fma(mins, sm, b.load(accm)), accm)
    e.store(res, e.const(0), b.fsub(b.load(acc), b.load(accm)))


@kernel()
def q6_k_gemv_tile(e, wu, wsc, wd, x, xd, xbs, res, col, nb):
    """16 matrix rows (a tile in column layout) x column `col` of ggml_vec_dot_q6_K_q8_K
    (AVX2): per super-block, 8 lanes l, lane = sum over halves h and groups g of
    wsc[16 i + 8 h + 2 g + (l >= 4), :] * sum_t wu[256 i + 128 h + 32 g + 4 l + t, :] * x[...]
    minus 32 (xbs[16 i + 2 l] wsc[.. 2 l] + xbs[16 i + 2 l + 1] wsc[.. 2 l + 1]) (integers,
    summed in double), acc_l = fma(xd[col, i] * wd[i, :], lane, acc_l); res = hsum8(acc).

    wu (256 nb, 16): the unsigned 6-bit integers; wsc (16 nb, 16) the scales; wd (nb, 16);
    x (cols, 256 nb), xd (cols, nb), xbs (cols, 16 nb): Q8_K's 16-element sums."""
    b = e.b
    xr = e.gep(x, b.mul(col, b.mul(nb, e.const(256))))
    xdr = e.gep(xd, b.mul(col, nb))
    xbr = e.gep(xbs, b.mul(col, b.mul(nb, e.const(16))))
    acc = [e.acc() for _ in range(8)]
    with e.loop(nb) as blk:
        e0 = b.mul(blk, e.const(256))
        s0 = b.mul(blk, e.const(16))
        d = e.mul(e.splat(e.at(xdr, blk)), e.load(wd, b.mul(blk, e.const(W))))
        for lane in range(8):
            tot = None
            for h in range(2):
                for g in range(4):
                    p = _dots_t(e, wu, xr, b.add(e0, e.const(128 * h + 32 * g + 4 * lane)), 4)
                    sc = e.load(wsc, b.mul(b.add(s0, e.const(8 * h + 2 * g + (1 if lane >= 4 else 0))), e.const(W)))
                    term = b.fpext(e.mul(sc, p), VD)  # |sc * p| < 2^23: exact
                    tot = term if tot is None else b.fadd(tot, term)
            sub = None
            for u in range(2):
                si = b.add(s0, e.const(2 * lane + u))
                t = e.mul(e.load(wsc, b.mul(si, e.const(W))), e.splat(e.at(xbr, si)))
                sub = t if sub is None else e.add(sub, t)  # exact integers
            lane_v = b.fptrunc(b.fsub(tot, b.fpext(e.mul(sub, e.splat(ir.Constant(F32, 32.0))), VD)), VF)
            b.store(e.fma(d, lane_v, b.load(acc[lane])), acc[lane])
    e.store(res, e.const(0), e.hsum([b.load(slot) for slot in acc]))
