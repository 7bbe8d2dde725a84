"""Micro-kernels written as LLVM vector code, for the products whose float sums ggml orders.

numba vectorises innermost loops only, so a kernel whose accumulators must stay in
registers across an outer loop (an fma chain per lane over the blocks of a row, for 16
columns at once) compiles to memory round trips per step. These kernels are LLVM IR with
explicit <16 x float> values (the accumulators are allocas that LLVM promotes to
registers), exposed to numba as intrinsics: a numba kernel does the task loop and the
unpacking, and calls one of these per tile of 16 columns. The arithmetic is the same
float32 operations, in the same order, as the numba reference loops in qexact.py.

Data layout: the activations are column-major for 16-wide loads, xq[e, n] (element e of
column n), with a column count padded to a multiple of 16; the matrix rows a task unpacks
are row-major floats. Q5_0/Q8_0 in ggml's order put both sides' elements lane-major
(qexact._at), so a lane's chain reads contiguous runs.
"""
from __future__ import annotations

import os

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import config
from numba.core import cgutils
from numba.extending import intrinsic

W = 16  # columns per tile: one AVX-512 register of float32


def target_features() -> dict[str, bool]:
    """The CPU features numba compiles for: the host's, or NUMBA_CPU_FEATURES when set (as
    numba itself decides; NUMBA_CPU_NAME=generic means none)."""
    if config.CPU_FEATURES is not None:
        return {f[1:]: f[0] == "+" for f in config.CPU_FEATURES.split(",") if f[:1] in "+-" and len(f) > 1}
    return dict(llvm.get_host_cpu_features())


_VNNI_FEATURES = ("avx512f", "avx512bw", "avx512vl", "avx512vnni")
# AVX512-VNNI: integer sums of 4 byte products per lane in one instruction (the same sums).
# Without it (or with GGMLPY_NO_VNNI=1) the integer sums run as exact float32 vector code.
VNNI = all(target_features().get(f, False) for f in _VNNI_FEATURES) and not os.environ.get("GGMLPY_NO_VNNI")
_F = ir.FloatType()
_D = ir.DoubleType()
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_VF = ir.VectorType(_F, W)
_VD = ir.VectorType(_D, W)


class _Emit:
    """Vector operations on float arrays' data pointers."""

    def __init__(self, context, builder):
        self.b = builder
        self.fma_v = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF, _VF, _VF]),
                                                    "llvm.fma.v16f32")

    def ptr(self, context, aryty, ary):
        return context.make_array(aryty)(context, self.b, ary).data

    def gep(self, ptr, idx):
        return self.b.gep(ptr, [idx])

    def load(self, ptr, idx):
        """16 floats from ptr[idx] (any alignment)."""
        p = self.b.bitcast(self.gep(ptr, idx), _VF.as_pointer())
        return self.b.load(p, align=4)

    def store(self, ptr, idx, vec):
        p = self.b.bitcast(self.gep(ptr, idx), _VF.as_pointer())
        self.b.store(vec, p, align=4)

    def scalar(self, ptr, idx):
        return self.b.load(self.gep(ptr, idx))

    def splat(self, x):
        v = self.b.insert_element(ir.Constant(_VF, ir.Undefined), x, ir.Constant(_I32, 0))
        return self.b.shuffle_vector(v, ir.Constant(_VF, ir.Undefined), ir.Constant(ir.VectorType(_I32, W), [0] * W))

    def fma(self, a, b, c):
        return self.b.call(self.fma_v, [a, b, c])

    def mul(self, a, b):
        return self.b.fmul(a, b)

    def add(self, a, b):
        return self.b.fadd(a, b)

    def i64(self, x):
        return x if x.type == _I64 else self.b.sext(x, _I64)

    def const(self, n):
        return ir.Constant(_I64, n)

    def acc(self, init=0.0, ty=_VF):
        slot = cgutils.alloca_once(self.b, ty)
        self.b.store(ir.Constant(ty, [init] * W), slot)
        return slot


def _dots(e, w_rows, x, k0, n):
    """[sum_k w_r[k0 + k] * x[(k0 + k) * 16 .. + 16] for each row pointer w_r], k < n: sums of
    integer products (exact in float32, any order), one vector of 16 columns per row."""
    b = e.b
    ps = [None] * len(w_rows)
    for k in range(n):
        idx = b.add(k0, e.const(k))
        xv = e.load(x, b.mul(idx, e.const(W)))
        for r, wr in enumerate(w_rows):
            wv = e.splat(e.scalar(wr, idx))
            ps[r] = e.mul(wv, xv) if ps[r] is None else e.fma(wv, xv, ps[r])
    return ps


def _row_ptrs(e, base, r0, stride, count):
    b = e.b
    return [e.gep(base, b.mul(b.add(r0, e.const(r)), stride)) for r in range(count)]


# rows per call of q0_lanes_tile and q0_blocks_tile: 3 x 16 columns of chains (of one lane, or of
# blocks) and of sums fill AVX2's 16 registers
Q0_ROWS = 3


def _q0_float_operands(e, wq_p, wd_p, xq_p, xd_p, r0_, tile_, nb_):
    """What the float Q0 tiles read: column tile `tile`'s integers and scales, and Q0_ROWS
    rows' integers and scales from r0."""
    b = e.b
    wrow = b.mul(nb_, e.const(32))
    xq_t = e.gep(xq_p, b.mul(tile_, b.mul(wrow, e.const(W))))
    xd_t = e.gep(xd_p, b.mul(tile_, b.mul(nb_, e.const(W))))
    return xq_t, xd_t, _row_ptrs(e, wq_p, r0_, wrow, Q0_ROWS), _row_ptrs(e, wd_p, r0_, nb_, Q0_ROWS)


@intrinsic
def q0_lanes_tile(typingctx, wq, wd, xq, xd, sbuf, res, r0, tile, nb):
    """Q0_ROWS matrix rows (r0..) x the 16 columns of column tile `tile` of the Q5_0/Q8_0
    product in ggml's order: res[16 r + c] = hsum8 over lanes j of the fma chain over blocks
    b of (wd[row, b] * xd[tile, b, c]) * (lane j's 4 integer products of block b, exact).

    One lane at a time: the lanes' chains are independent, so running them one after another
    changes no bit, and only 3 rows x 16 columns of chains are live at once (in registers on
    AVX2; all 8 lanes of 2 rows at once spilled on every step: 1.45x slower, bench/RESULTS.md,
    eighth session). wq (rows, 32 nb) the rows'
    integers and xq (tiles, 32 nb, 16) the columns', both lane-major (qexact._at: lane j of
    every block is one run of 4 nb), wd (rows, nb), xd (tiles, nb, 16); sbuf (3 nb 16,)
    takes the scale products d_w d_x, computed once for the 8 lanes; res (48,)."""
    sig = types.void(wq, wd, xq, xd, sbuf, res, r0, tile, nb)
    rows = Q0_ROWS

    def codegen(context, builder, signature, args):
        e = _Emit(context, builder)
        wq_p, wd_p, xq_p, xd_p, s_p, res_p = (e.ptr(context, ty, a) for ty, a in zip(signature.args[:6], args[:6]))
        r0_, tile_, nb_ = (e.i64(a) for a in args[6:])
        b = builder
        xq_t, xd_t, w_rows, d_rows = _q0_float_operands(e, wq_p, wd_p, xq_p, xd_p, r0_, tile_, nb_)
        s_rows = _row_ptrs(e, s_p, e.const(0), b.mul(nb_, e.const(W)), rows)
        with cgutils.for_range(b, nb_) as loop:
            blk = loop.index
            dx = e.load(xd_t, b.mul(blk, e.const(W)))
            for r in range(rows):
                e.store(s_rows[r], b.mul(blk, e.const(W)), e.mul(e.splat(e.scalar(d_rows[r], blk)), dx))
        lanes = cgutils.alloca_once(b, ir.ArrayType(_VF, 8 * rows))  # each row's 8 lane sums

        def lane(r, j):
            return b.gep(lanes, [ir.Constant(_I32, 0), b.trunc(b.add(e.const(8 * r), j), _I32)])
        with cgutils.for_range(b, e.const(8)) as lane_loop:  # a loop, not unrolled: 8x less to compile
            j = lane_loop.index
            run = b.mul(nb_, b.mul(j, e.const(4)))  # lane j's run
            accs = [e.acc() for _ in range(rows)]
            with cgutils.for_range(b, nb_) as loop:
                blk = loop.index
                base = b.add(b.mul(blk, e.const(4)), run)
                ps = [None] * rows
                for t in range(4):  # the lane's 4 products: exact, any order
                    idx = b.add(base, e.const(t))
                    xv = e.load(xq_t, b.mul(idx, e.const(W)))
                    for r in range(rows):
                        wv = e.splat(e.scalar(w_rows[r], idx))
                        ps[r] = e.mul(wv, xv) if ps[r] is None else e.fma(wv, xv, ps[r])
                for r in range(rows):
                    sv = e.load(s_rows[r], b.mul(blk, e.const(W)))
                    b.store(e.fma(sv, ps[r], b.load(accs[r])), accs[r])
            for r in range(rows):
                b.store(b.load(accs[r]), lane(r, j))
        for r in range(rows):
            a = [b.load(lane(r, e.const(i))) for i in range(8)]
            t = [e.add(a[i], a[i + 4]) for i in range(4)]
            e.store(res_p, e.const(W * r), e.add(e.add(t[0], t[2]), e.add(t[1], t[3])))
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def q0_blocks_tile(typingctx, wq, wd, xq, xd, res, r0, tile, nb):
    """q0_blocks_vnni's numbers in float32 vector code, for CPUs without AVX512-VNNI: per
    block of 32, each row's integer sum with 16 columns whole (32 products of integers, exact
    in float32), then acc = fma(d_w * d_x, isum, acc) over the blocks in order. One float
    multiply-add per 32 products where ggml's 8 lanes take 8 (q0_lanes_tile), 1.2x faster.
    Operands as q0_lanes_tile's, but in natural order (a block's 32 elements together);
    res (48,)."""
    sig = types.void(wq, wd, xq, xd, res, r0, tile, nb)
    rows = Q0_ROWS

    def codegen(context, builder, signature, args):
        e = _Emit(context, builder)
        wq_p, wd_p, xq_p, xd_p, res_p = (e.ptr(context, ty, a) for ty, a in zip(signature.args[:5], args[:5]))
        r0_, tile_, nb_ = (e.i64(a) for a in args[5:])
        b = builder
        xq_t, xd_t, w_rows, d_rows = _q0_float_operands(e, wq_p, wd_p, xq_p, xd_p, r0_, tile_, nb_)
        accs = [e.acc() for _ in range(rows)]
        with cgutils.for_range(b, nb_) as loop:
            blk = loop.index
            isums = _dots(e, w_rows, xq_t, b.mul(blk, e.const(32)), 32)
            dx = e.load(xd_t, b.mul(blk, e.const(W)))
            for r in range(rows):
                s = e.mul(e.splat(e.scalar(d_rows[r], blk)), dx)
                b.store(e.fma(s, isums[r], b.load(accs[r])), accs[r])
        for r in range(rows):
            e.store(res_p, e.const(W * r), b.load(accs[r]))
        return context.get_dummy_value()
    return sig, codegen

Q4K_ROWS = 4


@intrinsic
def q4_k_tile(typingctx, wq, wd, wdm, wmin, xq, xd, xbs, res, r0, tile, nb):
    """Q4K_ROWS matrix rows (r0..) x 16 columns of ggml_gemm_q4_K_8x8_q8_K: per 64-element
    chunk c (c = 4 i + chunk of super-block i), with P = sum of wq[row, k] * xq[tile, k, :]
    over the chunk (integer: q * scale times q8) and I = sum over its two sub-blocks s of
    wmin[row, s] * xbs[tile, s, :] (min times the sub-block's q8 sum):
    acc = fma(P, wd[row, i] * xd[tile, i, :], acc), accm = fma(I, wdm[row, i] * xd[tile, i, :], accm);
    res[16 r + c] = acc - accm.

    wq (rows, 256 nb), wd, wdm (rows, nb), wmin (rows, 8 nb), xq (tiles, 256 nb, 16),
    xd (tiles, nb, 16), xbs (tiles, 8 nb, 16), res (16 Q4K_ROWS,)."""
    sig = types.void(wq, wd, wdm, wmin, xq, xd, xbs, res, r0, tile, nb)

    def codegen(context, builder, signature, args):
        e = _Emit(context, builder)
        wq_p, wd_p, wdm_p, wm_p, xq_p, xd_p, xbs_p, res_p = (
            e.ptr(context, ty, a) for ty, a in zip(signature.args[:8], args[:8]))
        r0_, tile_, nb_ = (e.i64(a) for a in args[8:])
        b = builder
        n = Q4K_ROWS
        k_all = b.mul(nb_, e.const(256))
        xq_t = e.gep(xq_p, b.mul(tile_, b.mul(k_all, e.const(W))))
        xd_t = e.gep(xd_p, b.mul(tile_, b.mul(nb_, e.const(W))))
        xbs_t = e.gep(xbs_p, b.mul(tile_, b.mul(nb_, e.const(8 * W))))
        w_rows = _row_ptrs(e, wq_p, r0_, k_all, n)
        d_rows = _row_ptrs(e, wd_p, r0_, nb_, n)
        dm_rows = _row_ptrs(e, wdm_p, r0_, nb_, n)
        m_rows = _row_ptrs(e, wm_p, r0_, b.mul(nb_, e.const(8)), n)
        acc = [e.acc() for _ in range(n)]
        accm = [e.acc() for _ in range(n)]
        with cgutils.for_range(b, b.mul(nb_, e.const(4))) as loop:
            ch = loop.index  # chunk: super-block ch // 4, sub-blocks 2 (ch % 4), +1
            blk = b.udiv(ch, e.const(4))
            ps = _dots(e, w_rows, xq_t, b.mul(ch, e.const(64)), 64)
            dx = e.load(xd_t, b.mul(blk, e.const(W)))
            s1 = b.mul(ch, e.const(2))
            bs1 = e.load(xbs_t, b.mul(s1, e.const(W)))
            bs2 = e.load(xbs_t, b.mul(b.add(s1, e.const(1)), e.const(W)))
            for r in range(n):
                mins = e.fma(e.splat(e.scalar(m_rows[r], b.add(s1, e.const(1)))), bs2,
                             e.mul(e.splat(e.scalar(m_rows[r], s1)), bs1))  # exact integers
                sd = e.mul(e.splat(e.scalar(d_rows[r], blk)), dx)
                sm = e.mul(e.splat(e.scalar(dm_rows[r], blk)), dx)
                b.store(e.fma(ps[r], sd, b.load(acc[r])), acc[r])
                b.store(e.fma(mins, sm, b.load(accm[r])), accm[r])
        for r in range(n):
            e.store(res_p, e.const(W * r), b.fsub(b.load(acc[r]), b.load(accm[r])))
        return context.get_dummy_value()
    return sig, codegen


Q6K_ROWS = 4


@intrinsic
def q6_k_tile(typingctx, wq, wd, xq, xd, res, r0, tile, nb):
    """Q6K_ROWS matrix rows x 16 columns of ggml-cpu/tiled's Q6_K product: per super-block i
    the integer sum of wq[row, k] * xq[tile, k, :] (sixteen 16-element sums, each exact in
    float32, added in double), rounded to float32, times wd[row, i], then
    acc = fma(that, xd[tile, i, :], acc); res[16 r + c] = acc.

    wq (rows, 256 nb): q * scale of the row's elements, wd (rows, nb), xq (tiles, 256 nb, 16),
    xd (tiles, nb, 16), res (16 Q6K_ROWS,)."""
    sig = types.void(wq, wd, xq, xd, res, r0, tile, nb)

    def codegen(context, builder, signature, args):
        e = _Emit(context, builder)
        wq_p, wd_p, xq_p, xd_p, res_p = (e.ptr(context, ty, a) for ty, a in zip(signature.args[:5], args[:5]))
        r0_, tile_, nb_ = (e.i64(a) for a in args[5:])
        b = builder
        n = Q6K_ROWS
        k_all = b.mul(nb_, e.const(256))
        xq_t = e.gep(xq_p, b.mul(tile_, b.mul(k_all, e.const(W))))
        xd_t = e.gep(xd_p, b.mul(tile_, b.mul(nb_, e.const(W))))
        w_rows = _row_ptrs(e, wq_p, r0_, k_all, n)
        d_rows = _row_ptrs(e, wd_p, r0_, nb_, n)
        acc = [e.acc() for _ in range(n)]
        isum = [e.acc(ty=_VD) for _ in range(n)]
        with cgutils.for_range(b, nb_) as loop:
            blk = loop.index
            for r in range(n):
                b.store(ir.Constant(_VD, [0.0] * W), isum[r])
            with cgutils.for_range(b, e.const(16)) as sub:
                k0 = b.add(b.mul(blk, e.const(256)), b.mul(sub.index, e.const(16)))
                ps = _dots(e, w_rows, xq_t, k0, 16)
                for r in range(n):
                    b.store(b.fadd(b.load(isum[r]), b.fpext(ps[r], _VD)), isum[r])
            dx = e.load(xd_t, b.mul(blk, e.const(W)))
            for r in range(n):
                rs = e.mul(b.fptrunc(b.load(isum[r]), _VF), e.splat(e.scalar(d_rows[r], blk)))
                b.store(e.fma(rs, dx, b.load(acc[r])), acc[r])
        for r in range(n):
            e.store(res_p, e.const(W * r), b.load(acc[r]))
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def q4_k_gemv_tile(typingctx, wq, wd, wdm, wmin, x, xd, xbs, res, col, nb):
    """16 matrix rows (a tile in column layout) x column `col` of ggml_gemv_q4_K_8x8_q8_K:
    per super-block i, the integer sum over its elements of wq[k, :] * x[col, k] (per chunk
    exact in float32, added in double), rounded to float32, and I = sum over its sub-blocks s
    of wmin[s, :] * xbs[col, s]: acc = fma(sum, wd[i, :] * xd[col, i], acc),
    accm = fma(I, wdm[i, :] * xd[col, i], accm); res[:16] = acc - accm.

    wq (256 nb, 16), wd, wdm (nb, 16), wmin (8 nb, 16), x (cols, 256 nb), xd (cols, nb),
    xbs (cols, 8 nb), res (16,)."""
    sig = types.void(wq, wd, wdm, wmin, x, xd, xbs, res, col, nb)

    def codegen(context, builder, signature, args):
        e = _Emit(context, builder)
        wq_p, wd_p, wdm_p, wm_p, x_p, xd_p, xbs_p, res_p = (
            e.ptr(context, ty, a) for ty, a in zip(signature.args[:8], args[:8]))
        col_, nb_ = (e.i64(a) for a in args[8:])
        b = builder
        xr = e.gep(x_p, b.mul(col_, b.mul(nb_, e.const(256))))
        xdr = e.gep(xd_p, b.mul(col_, nb_))
        xbr = e.gep(xbs_p, b.mul(col_, b.mul(nb_, e.const(8))))
        acc, accm, isum = e.acc(), e.acc(), e.acc(ty=_VD)
        with cgutils.for_range(b, nb_) as loop:
            blk = loop.index
            b.store(ir.Constant(_VD, [0.0] * W), isum)
            with cgutils.for_range(b, e.const(4)) as chunk:
                k0 = b.add(b.mul(blk, e.const(256)), b.mul(chunk.index, e.const(64)))
                p = _dots_t(e, wq_p, xr, k0, 64)
                b.store(b.fadd(b.load(isum), b.fpext(p, _VD)), isum)
            mins = None
            for sb in range(8):
                idx = b.add(b.mul(blk, e.const(8)), e.const(sb))
                t = e.mul(e.load(wm_p, b.mul(idx, e.const(W))), e.splat(e.scalar(xbr, idx)))
                mins = t if mins is None else e.add(mins, t)  # exact integers
            dx = e.splat(e.scalar(xdr, blk))
            sd = e.mul(e.load(wd_p, b.mul(blk, e.const(W))), dx)
            sm = e.mul(e.load(wdm_p, b.mul(blk, e.const(W))), dx)
            b.store(e.fma(b.fptrunc(b.load(isum), _VF), sd, b.load(acc)), acc)
            b.store(e.fma(mins, sm, b.load(accm)), accm)
        e.store(res_p, e.const(0), b.fsub(b.load(acc), b.load(accm)))
        return context.get_dummy_value()
    return sig, codegen


def _dots_t(e, w, x, k0, n):
    """sum_k w[(k0 + k) * 16 .. + 16] * x[k0 + k], k < n: a tile of 16 matrix rows (column
    layout) times one activation column; integer products, exact in any order."""
    b = e.b
    p = None
    for k in range(n):
        idx = b.add(k0, e.const(k))
        t_w = e.load(w, b.mul(idx, e.const(W)))
        xv = e.splat(e.scalar(x, idx))
        p = e.mul(t_w, xv) if p is None else e.fma(t_w, xv, p)
    return p


@intrinsic
def q6_k_gemv_tile(typingctx, wu, wsc, wd, x, xd, xbs, res, col, nb):
    """16 matrix rows (a tile in column layout) x column `col` of ggml_vec_dot_q6_K_q8_K
    (AVX2): per super-block, 8 lanes l, lane = sum over halves h and groups g of
    wsc[16 i + 8 h + 2 g + (l >= 4), :] * sum_t wu[256 i + 128 h + 32 g + 4 l + t, :] * x[...]
    minus 32 (xbs[16 i + 2 l] wsc[.. 2 l] + xbs[16 i + 2 l + 1] wsc[.. 2 l + 1]) (integers,
    summed in double), acc_l = fma(xd[col, i] * wd[i, :], lane, acc_l); res = hsum8(acc).

    wu (256 nb, 16): the unsigned 6-bit integers; wsc (16 nb, 16) the scales; wd (nb, 16);
    x (cols, 256 nb), xd (cols, nb), xbs (cols, 16 nb): Q8_K's 16-element sums."""
    sig = types.void(wu, wsc, wd, x, xd, xbs, res, col, nb)

    def codegen(context, builder, signature, args):
        e = _Emit(context, builder)
        wu_p, wsc_p, wd_p, x_p, xd_p, xbs_p, res_p = (
            e.ptr(context, ty, a) for ty, a in zip(signature.args[:7], args[:7]))
        col_, nb_ = (e.i64(a) for a in args[7:])
        b = builder
        xr = e.gep(x_p, b.mul(col_, b.mul(nb_, e.const(256))))
        xdr = e.gep(xd_p, b.mul(col_, nb_))
        xbr = e.gep(xbs_p, b.mul(col_, b.mul(nb_, e.const(16))))
        acc = [e.acc() for _ in range(8)]
        with cgutils.for_range(b, nb_) as loop:
            blk = loop.index
            e0 = b.mul(blk, e.const(256))
            s0 = b.mul(blk, e.const(16))
            d = e.mul(e.splat(e.scalar(xdr, blk)), e.load(wd_p, b.mul(blk, e.const(W))))
            for lane in range(8):
                tot = None
                for h in range(2):
                    for g in range(4):
                        k0 = b.add(e0, e.const(128 * h + 32 * g + 4 * lane))
                        p = _dots_t(e, wu_p, xr, k0, 4)
                        sc = e.load(wsc_p, b.mul(b.add(s0, e.const(8 * h + 2 * g + (1 if lane >= 4 else 0))), e.const(W)))
                        term = b.fpext(e.mul(sc, p), _VD)  # |sc * p| < 2^23: exact
                        tot = term if tot is None else b.fadd(tot, term)
                sub = None
                for u in range(2):
                    si = b.add(s0, e.const(2 * lane + u))
                    t = e.mul(e.load(wsc_p, b.mul(si, e.const(W))), e.splat(e.scalar(xbr, si)))
                    sub = t if sub is None else e.add(sub, t)  # exact integers
                lane_v = b.fptrunc(b.fsub(tot, b.fpext(e.mul(sub, e.splat(ir.Constant(_F, 32.0))), _VD)), _VF)
                b.store(e.fma(d, lane_v, b.load(acc[lane])), acc[lane])
        a = [b.load(slot) for slot in acc]
        t = [e.add(a[i], a[i + 4]) for i in range(4)]
        e.store(res_p, e.const(0), e.add(e.add(t[0], t[2]), e.add(t[1], t[3])))
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def attn_scores_4x64(typingctx, kt, qt, kq, r0, dk):
    """Flash attention's scores for query rows r0 .. r0 + 3 of a tile against a tile of 64
    cells: kq[r0 + r, c] = fma chain over d of kt[d, c] * qt[r0 + r, d], from 0 (simd_gemm's
    order). kt (dk, 64), qt (64, dk), kq (64, 64), all C-contiguous."""
    sig = types.void(kt, qt, kq, r0, dk)

    def codegen(context, builder, signature, args):
        e = _Emit(context, builder)
        kt_p, q_p, kq_p = (e.ptr(context, ty, a) for ty, a in zip(signature.args[:3], args[:3]))
        r0_, dk_ = (e.i64(a) for a in args[3:])
        b = builder
        qrows = [e.gep(q_p, b.mul(b.add(r0_, e.const(r)), dk_)) for r in range(4)]
        acc = [[e.acc() for _ in range(4)] for _ in range(4)]
        with cgutils.for_range(b, dk_) as loop:
            d = loop.index
            kv = [e.load(kt_p, b.add(b.mul(d, e.const(64)), e.const(W * v))) for v in range(4)]
            for r in range(4):
                qs = e.splat(e.scalar(qrows[r], d))
                for v in range(4):
                    b.store(e.fma(kv[v], qs, b.load(acc[r][v])), acc[r][v])
        for r in range(4):
            for v in range(4):
                e.store(kq_p, b.add(b.mul(b.add(r0_, e.const(r)), e.const(64)), e.const(W * v)), b.load(acc[r][v]))
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def attn_values_4x64(typingctx, vt, kq, vkq, r0, d0):
    """Flash attention's output for rows r0 .. r0 + 3, columns d0 .. d0 + 63:
    vkq[r, d] = fma chain over the 64 cells c of vt[c, d] * kq[r, c], continuing from vkq
    (simd_gemm's order). vt (64, dv), kq (64, 64), vkq (64, dv), all C-contiguous."""
    sig = types.void(vt, kq, vkq, r0, d0)

    def codegen(context, builder, signature, args):
        e = _Emit(context, builder)
        vt_p, kq_p, vkq_p = (e.ptr(context, ty, a) for ty, a in zip(signature.args[:3], args[:3]))
        r0_, d0_ = (e.i64(a) for a in args[3:])
        b = builder
        dv = b.extract_value(context.make_array(signature.args[0])(context, b, args[0]).shape, 1)
        slots = [[e.acc() for _ in range(4)] for _ in range(4)]
        for r in range(4):
            for v in range(4):
                idx = b.add(b.mul(b.add(r0_, e.const(r)), dv), b.add(d0_, e.const(W * v)))
                b.store(e.load(vkq_p, idx), slots[r][v])
        with cgutils.for_range(b, e.const(64)) as loop:
            c = loop.index
            vv = [e.load(vt_p, b.add(b.mul(c, dv), b.add(d0_, e.const(W * v)))) for v in range(4)]
            for r in range(4):
                p = e.splat(e.scalar(kq_p, b.add(b.mul(b.add(r0_, e.const(r)), e.const(64)), c)))
                for v in range(4):
                    b.store(e.fma(vv[v], p, b.load(slots[r][v])), slots[r][v])
        for r in range(4):
            for v in range(4):
                idx = b.add(b.mul(b.add(r0_, e.const(r)), dv), b.add(d0_, e.const(W * v)))
                e.store(vkq_p, idx, b.load(slots[r][v]))
        return context.get_dummy_value()
    return sig, codegen


_VI = ir.VectorType(_I32, W)
_I8 = ir.IntType(8)


def _q0_vnni_operands(e, context, signature, args, rows):
    """What a Q0 VNNI tile reads, for args (wu, wd, xq, xc, xd, res, r0, tile, nb): vpdpbusd,
    xq's tile as int32 lanes, the corrections' array and the tile index (their layout is the
    caller's), xd's tile, each row's unsigned bytes as int32 lanes and its scales, res, nb."""
    b = e.b
    wu_p, wd_p, xq_p, xc_p, xd_p, res_p = (e.ptr(context, ty, a) for ty, a in zip(signature.args[:6], args[:6]))
    r0_, tile_, nb_ = (e.i64(a) for a in args[6:])
    dp = cgutils.get_or_insert_function(b.module, ir.FunctionType(_VI, [_VI, _VI, _VI]), "llvm.x86.avx512.vpdpbusd.512")
    lanes = b.mul(nb_, e.const(8))
    xq_t = b.bitcast(e.gep(xq_p, b.mul(tile_, b.mul(lanes, e.const(64)))), _I32.as_pointer())  # 16 i32 per lane
    xd_t = e.gep(xd_p, b.mul(tile_, b.mul(nb_, e.const(W))))
    w_rows = [b.bitcast(e.gep(wu_p, b.mul(b.add(r0_, e.const(r)), b.mul(nb_, e.const(32)))), _I32.as_pointer())
              for r in range(rows)]
    d_rows = _row_ptrs(e, wd_p, r0_, nb_, rows)
    return dp, xq_t, xc_p, tile_, xd_t, w_rows, d_rows, res_p, nb_


def _splat_i32(b, x):
    return b.shuffle_vector(b.insert_element(ir.Constant(_VI, ir.Undefined), x, ir.Constant(_I32, 0)),
                            ir.Constant(_VI, ir.Undefined), ir.Constant(_VI, [0] * W))


@intrinsic
def q0_tile2_vnni(typingctx, wu, wd, xq, xc, xd, res, r0, tile, nb):
    """q0_lanes_tile's numbers for 2 rows, the integer sums by AVX512-VNNI. wu (rows, 32 nb) int8
    bytes of the matrix integers plus a bias making them unsigned (natural order), wd (rows,
    nb); xq (tiles, 8 nb, 16, 4) int8: lane j of block b for 16 columns, 4 bytes each;
    xc (tiles, 8 nb, 16) int32: -bias times each lane's sum of x (vpdpbusd adding the
    products of w + bias and x to it gives the lane's exact integer sum, without a
    subtraction per row); xd (tiles, nb, 16); res (32,)."""
    sig = types.void(wu, wd, xq, xc, xd, res, r0, tile, nb)

    def codegen(context, builder, signature, args):
        e = _Emit(context, builder)
        b = builder
        dp, xq_t, xc_p, tile_, xd_t, w_rows, d_rows, res_p, nb_ = _q0_vnni_operands(e, context, signature, args, 2)
        xc_t = e.gep(xc_p, b.mul(tile_, b.mul(b.mul(nb_, e.const(8)), e.const(W))))
        accs = [[e.acc() for _ in range(8)] for _ in range(2)]
        with cgutils.for_range(b, nb_) as loop:
            blk = loop.index
            dx = e.load(xd_t, b.mul(blk, e.const(W)))
            s = [e.mul(e.splat(e.scalar(d_rows[r], blk)), dx) for r in range(2)]
            for j in range(8):
                lane = b.add(b.mul(blk, e.const(8)), e.const(j))
                xv = b.load(b.bitcast(e.gep(xq_t, b.mul(lane, e.const(W))), _VI.as_pointer()), align=4)
                corr = b.load(b.bitcast(e.gep(xc_t, b.mul(lane, e.const(W))), _VI.as_pointer()), align=4)
                for r in range(2):
                    wv = _splat_i32(b, b.load(e.gep(w_rows[r], lane)))  # the lane's 4 unsigned bytes
                    p = b.sitofp(b.call(dp, [corr, wv, xv]), _VF)  # starts from -bias * sum(x)
                    slot = accs[r][j]
                    b.store(e.fma(s[r], p, b.load(slot)), slot)
        for r in range(2):
            a = [b.load(slot) for slot in accs[r]]
            t = [e.add(a[i], a[i + 4]) for i in range(4)]
            e.store(res_p, e.const(W * r), e.add(e.add(t[0], t[2]), e.add(t[1], t[3])))
        return context.get_dummy_value()
    return sig, codegen


BLOCK_ROWS = 8  # matrix rows per call of q0_blocks_vnni (8 chains of vpdpbusd hide its latency)


@intrinsic
def q0_blocks_vnni(typingctx, wu, wd, xq, xcb, xd, res, r0, tile, nb):
    """The Q0 product of 8 matrix rows and 16 columns with one float multiply-add per block of
    32: the block's integer sum (exact) whole, acc = fma(d_w * d_x, isum, acc) over the blocks
    in order, where ggml's order keeps 8 lanes of 4 products each (q0_tile2_vnni); 2.4 times
    fewer vector operations, results equal to float32 rounding. Operands as q0_tile2_vnni's
    but xcb (tiles, nb, 16) int32: -bias times each block's sum of x; res (128,)."""
    sig = types.void(wu, wd, xq, xcb, xd, res, r0, tile, nb)

    def codegen(context, builder, signature, args):
        e = _Emit(context, builder)
        b = builder
        rows = BLOCK_ROWS
        dp, xq_t, xc_p, tile_, xd_t, w_rows, d_rows, res_p, nb_ = _q0_vnni_operands(e, context, signature, args, rows)
        xcb_t = e.gep(xc_p, b.mul(tile_, b.mul(nb_, e.const(W))))
        accs = [e.acc() for _ in range(rows)]
        with cgutils.for_range(b, nb_) as loop:
            blk = loop.index
            dx = e.load(xd_t, b.mul(blk, e.const(W)))
            corr = b.load(b.bitcast(e.gep(xcb_t, b.mul(blk, e.const(W))), _VI.as_pointer()), align=4)
            isum = [corr] * rows
            for j in range(8):
                lane = b.add(b.mul(blk, e.const(8)), e.const(j))
                xv = b.load(b.bitcast(e.gep(xq_t, b.mul(lane, e.const(W))), _VI.as_pointer()), align=4)
                for r in range(rows):
                    isum[r] = b.call(dp, [isum[r], _splat_i32(b, b.load(e.gep(w_rows[r], lane))), xv])
            for r in range(rows):
                s = e.mul(e.splat(e.scalar(d_rows[r], blk)), dx)
                b.store(e.fma(s, b.sitofp(isum[r], _VF), b.load(accs[r])), accs[r])
        for r in range(rows):
            e.store(res_p, e.const(W * r), b.load(accs[r]))
        return context.get_dummy_value()
    return sig, codegen


_VI8 = ir.VectorType(_I32, 8)
_VF8 = ir.VectorType(_F, 8)


@intrinsic
def q8_0_row_vnni(typingctx, buf, o, xu, xd, nb):
    """ggml_vec_dot_q8_0_q8_0 of the Q8_0 row at buf[o] (its packed blocks, used in place)
    and one activation column: per block, 8 lanes of 4 products by AVX512-VNNI, lane_j =
    fma(d_w * d_x, isum_j, lane_j), then hsum8 (as q0_lanes_tile computes it, for one column).
    xu (32 nb,) uint8: the activations' integers plus 128; xd (nb,) their scales."""
    sig = types.float32(buf, o, xu, xd, nb)

    def codegen(context, builder, signature, args):
        e = _Emit(context, builder)
        b = builder
        buf_p = e.ptr(context, signature.args[0], args[0])
        xu_p = e.ptr(context, signature.args[2], args[2])
        xd_p = e.ptr(context, signature.args[3], args[3])
        o_, nb_ = e.i64(args[1]), e.i64(args[4])
        dp = cgutils.get_or_insert_function(b.module, ir.FunctionType(_VI8, [_VI8, _VI8, _VI8]),
                                            "llvm.x86.avx512.vpdpbusd.256")
        fma8 = cgutils.get_or_insert_function(b.module, ir.FunctionType(_VF8, [_VF8, _VF8, _VF8]), "llvm.fma.v8f32")
        zero = ir.Constant(_VI8, [0] * 8)
        ones = ir.Constant(_VI8, [0x01010101] * 8)
        seven = ir.Constant(_VI8, [7] * 8)
        acc = cgutils.alloca_once(b, _VF8)
        b.store(ir.Constant(_VF8, [0.0] * 8), acc)
        with cgutils.for_range(b, nb_) as loop:
            blk = loop.index
            bo = b.add(o_, b.mul(blk, e.const(34)))
            dw = b.fpext(b.load(b.bitcast(e.gep(buf_p, bo), ir.HalfType().as_pointer()), align=1), _F)
            w = b.load(b.bitcast(e.gep(buf_p, b.add(bo, e.const(2))), _VI8.as_pointer()), align=1)
            xv = b.load(b.bitcast(e.gep(xu_p, b.mul(blk, e.const(32))), _VI8.as_pointer()), align=1)
            isum = b.sub(b.call(dp, [zero, xv, w]), b.shl(b.call(dp, [zero, ones, w]), seven))  # sum (x + 128) w - 128 sum w
            s = b.fmul(dw, e.scalar(xd_p, blk))
            sv = b.shuffle_vector(b.insert_element(ir.Constant(_VF8, ir.Undefined), s, ir.Constant(_I32, 0)),
                                  ir.Constant(_VF8, ir.Undefined), ir.Constant(_VI8, [0] * 8))
            b.store(b.call(fma8, [sv, b.sitofp(isum, _VF8), b.load(acc)]), acc)
        a = b.load(acc)
        lane = [b.extract_element(a, ir.Constant(_I32, i)) for i in range(8)]
        t = [b.fadd(lane[i], lane[i + 4]) for i in range(4)]
        return b.fadd(b.fadd(t[0], t[2]), b.fadd(t[1], t[3]))
    return sig, codegen


def _reduce16(e, v):
    """GCC's _mm512_reduce_add_ps of a <16 x float>: upper 8 onto lower 8, upper 4 onto lower
    4, then (0 + 2) + (1 + 3)."""
    b = e.b
    lane = [b.extract_element(v, ir.Constant(_I32, i)) for i in range(W)]
    t = [b.fadd(lane[i], lane[i + 8]) for i in range(8)]
    u = [b.fadd(t[i], t[i + 4]) for i in range(4)]
    return b.fadd(b.fadd(u[0], u[2]), b.fadd(u[1], u[3]))


@intrinsic
def float_tile_4x4(typingctx, a, bm, out, m0, n0):
    """tinyBLAS's F32 or F16 product (AVX-512) for rows m0..m0 + 3 of a and n0..n0 + 3 of bm:
    out[n, m] = _mm512_reduce_add_ps of 16 lanes, lane t the fma chain over l of
    a[m, 16 l + t] * bm[n, 16 l + t]. a (M, K), bm (N, K) float32 (values of halves for F16),
    K a multiple of 16; out (N, M); all C-contiguous."""
    sig = types.void(a, bm, out, m0, n0)

    def codegen(context, builder, signature, args):
        e = _Emit(context, builder)
        b = builder
        a_p, b_p, o_p = (e.ptr(context, ty, x) for ty, x in zip(signature.args[:3], args[:3]))
        m0_, n0_ = e.i64(args[3]), e.i64(args[4])
        ashape = context.make_array(signature.args[0])(context, b, args[0]).shape
        k = b.extract_value(ashape, 1)
        m_all = b.extract_value(context.make_array(signature.args[2])(context, b, args[2]).shape, 1)
        arows = _row_ptrs(e, a_p, m0_, k, 4)
        brows = _row_ptrs(e, b_p, n0_, k, 4)
        acc = [[e.acc() for _ in range(4)] for _ in range(4)]
        with cgutils.for_range(b, b.udiv(k, e.const(W))) as loop:
            off = b.mul(loop.index, e.const(W))
            av = [e.load(p, off) for p in arows]
            bv = [e.load(p, off) for p in brows]
            for i in range(4):
                for j in range(4):
                    b.store(e.fma(av[i], bv[j], b.load(acc[i][j])), acc[i][j])
        for i in range(4):
            for j in range(4):
                idx = b.add(b.mul(b.add(n0_, e.const(j)), m_all), b.add(m0_, e.const(i)))
                b.store(_reduce16(e, b.load(acc[i][j])), e.gep(o_p, idx))
        return context.get_dummy_value()
    return sig, codegen


def _float_dot(kind: str):
    @intrinsic
    def float_dot(typingctx, a, bv, k):
        """One element of ggml-cpu's float products over a[:k] and bv[:k] (1-D float32 arrays,
        contiguous), in its order (AVX-512): kind "lanes16" as tinyBLAS sums it (16 lanes, lane
        t the fma chain over a[16 l + t] * bv[16 l + t], then _mm512_reduce_add_ps; k a multiple
        of 16); "f32" as ggml_vec_dot_f32 (4 accumulators of 16 lanes over each 64 elements,
        reduced 0 + 2, 1 + 3, then the two, then _mm512_reduce_add_ps; then the last k % 64
        products in order, as GCC compiles ggml's scalar leftover loop `sumf += x[i]*y[i]`: it
        vectorises the products of whole groups of 16, then of 8 (each product rounded, then
        added), and fuses the last (k % 64) % 8 into fmas); "f16" as ggml_vec_dot_f16 (the same
        lanes, their sum and the last products, each rounded to float32, added in double)."""
        sig = types.float32(a, bv, k)

        def codegen(context, builder, signature, args):
            e, b = _Emit(context, builder), builder
            a_p, b_p = (e.ptr(context, ty, x) for ty, x in zip(signature.args[:2], args[:2]))
            k_ = e.i64(args[2])
            if kind == "lanes16":
                acc = e.acc()
                with cgutils.for_range(b, b.udiv(k_, e.const(W))) as loop:
                    off = b.mul(loop.index, e.const(W))
                    b.store(e.fma(e.load(a_p, off), e.load(b_p, off), b.load(acc)), acc)
                return _reduce16(e, b.load(acc))
            accs = [e.acc() for _ in range(4)]
            n64 = b.udiv(k_, e.const(64))
            with cgutils.for_range(b, n64) as loop:
                base = b.mul(loop.index, e.const(64))
                for j, slot in enumerate(accs):
                    off = b.add(base, e.const(W * j))
                    b.store(e.fma(e.load(a_p, off), e.load(b_p, off), b.load(slot)), slot)
            v = [b.load(slot) for slot in accs]
            lanes = _reduce16(e, e.add(e.add(v[0], v[2]), e.add(v[1], v[3])))  # +0.0 when k < 64
            start = b.mul(n64, e.const(64))
            if kind == "f32":
                fma = cgutils.get_or_insert_function(b.module, ir.FunctionType(_F, [_F, _F, _F]), "llvm.fma.f32")
                total = cgutils.alloca_once_value(b, lanes)
                rest = b.sub(k_, start)
                n_mul = b.and_(rest, e.const(~7))  # the leftovers GCC vectorises: rounded products
                with cgutils.for_range(b, n_mul) as loop:
                    i = b.add(start, loop.index)
                    b.store(b.fadd(b.load(total), b.fmul(e.scalar(a_p, i), e.scalar(b_p, i))), total)
                start = b.add(start, n_mul)
                with cgutils.for_range(b, b.sub(k_, start)) as loop:
                    i = b.add(start, loop.index)
                    b.store(b.call(fma, [e.scalar(a_p, i), e.scalar(b_p, i), b.load(total)]), total)
                return b.load(total)
            total = cgutils.alloca_once_value(b, b.fpext(lanes, _D))
            with cgutils.for_range(b, b.sub(k_, start)) as loop:
                i = b.add(start, loop.index)
                b.store(b.fadd(b.load(total), b.fpext(b.fmul(e.scalar(a_p, i), e.scalar(b_p, i)), _D)), total)
            return b.fptrunc(b.load(total), _F)
        return sig, codegen
    return float_dot


dot_lanes16 = _float_dot("lanes16")
vec_dot_f32_row = _float_dot("f32")
vec_dot_f16_row = _float_dot("f16")


def _bcast8(b, x):
    """<8 x T> of scalar x."""
    vt = ir.VectorType(x.type, 8)
    return b.shuffle_vector(b.insert_element(ir.Constant(vt, ir.Undefined), x, ir.Constant(_I32, 0)),
                            ir.Constant(vt, ir.Undefined), ir.Constant(_VI8, [0] * 8))


def _hsum8_vec(b, a):
    lane = [b.extract_element(a, ir.Constant(_I32, i)) for i in range(8)]
    t = [b.fadd(lane[i], lane[i + 4]) for i in range(4)]
    return b.fadd(b.fadd(t[0], t[2]), b.fadd(t[1], t[3]))


def _dp256(b):
    return cgutils.get_or_insert_function(b.module, ir.FunctionType(_VI8, [_VI8, _VI8, _VI8]),
                                          "llvm.x86.avx512.vpdpbusd.256")


def _fma8(b):
    return cgutils.get_or_insert_function(b.module, ir.FunctionType(_VF8, [_VF8, _VF8, _VF8]), "llvm.fma.v8f32")


_V32I8 = ir.VectorType(_I8, 32)


def _load_bytes32(e, ptr, idx):
    """32 bytes at ptr[idx] (an i8 / u8 pointer) as <8 x i32>."""
    return e.b.load(e.b.bitcast(e.gep(ptr, idx), _VI8.as_pointer()), align=1)


@intrinsic
def q5_0_row_vnni(typingctx, buf, o, xs, xsum, xd, nb):
    """ggml_vec_dot_q5_0_q8_0 of the Q5_0 row at buf[o] (packed blocks, used in place) and one
    activation column: per block the 32 5-bit integers (plus 16: unsigned) by AVX512-VNNI
    against the column's int8 integers xs, minus 16 xsum (its lane sums), lane_j =
    fma(d_w * d_x, isum_j, lane_j); hsum8. xs (32 nb,) int8, xsum (8 nb,) int32, xd (nb,)."""
    sig = types.float32(buf, o, xs, xsum, xd, nb)

    def codegen(context, builder, signature, args):
        e = _Emit(context, builder)
        b = builder
        buf_p = e.ptr(context, signature.args[0], args[0])
        xs_p, xsum_p, xd_p = (e.ptr(context, signature.args[i], args[i]) for i in (2, 3, 4))
        o_, nb_ = e.i64(args[1]), e.i64(args[5])
        dp, fma8 = _dp256(b), _fma8(b)
        zero = ir.Constant(_VI8, [0] * 8)
        sixteen = ir.Constant(_VI8, [4] * 8)
        bitmask = ir.Constant(ir.VectorType(_I32, 32), [1 << i for i in range(32)])
        acc = cgutils.alloca_once(b, _VF8)
        b.store(ir.Constant(_VF8, [0.0] * 8), acc)
        with cgutils.for_range(b, nb_) as loop:
            blk = loop.index
            bo = b.add(o_, b.mul(blk, e.const(22)))
            dw = b.fpext(b.load(b.bitcast(e.gep(buf_p, bo), ir.HalfType().as_pointer()), align=1), _F)
            qh = b.load(b.bitcast(e.gep(buf_p, b.add(bo, e.const(2))), _I32.as_pointer()), align=1)
            qs = b.load(b.bitcast(e.gep(buf_p, b.add(bo, e.const(6))), ir.VectorType(_I8, 16).as_pointer()), align=1)
            lo = b.and_(qs, ir.Constant(ir.VectorType(_I8, 16), [15] * 16))
            hi = b.lshr(qs, ir.Constant(ir.VectorType(_I8, 16), [4] * 16))
            nib = b.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
            qhv = b.shuffle_vector(b.insert_element(ir.Constant(ir.VectorType(_I32, 32), ir.Undefined), qh,
                                                    ir.Constant(_I32, 0)),
                                   ir.Constant(ir.VectorType(_I32, 32), ir.Undefined),
                                   ir.Constant(ir.VectorType(_I32, 32), [0] * 32))
            bit = b.icmp_unsigned("!=", b.and_(qhv, bitmask), ir.Constant(ir.VectorType(_I32, 32), [0] * 32))
            u = b.or_(nib, b.select(bit, ir.Constant(_V32I8, [16] * 32), ir.Constant(_V32I8, [0] * 32)))
            w = b.bitcast(u, _VI8)  # integer + 16, unsigned
            xv = _load_bytes32(e, xs_p, b.mul(blk, e.const(32)))
            xsv = b.load(b.bitcast(e.gep(xsum_p, b.mul(blk, e.const(8))), _VI8.as_pointer()), align=4)
            isum = b.sub(b.call(dp, [zero, w, xv]), b.shl(xsv, sixteen))
            s = b.fmul(dw, e.scalar(xd_p, blk))
            b.store(b.call(fma8, [_bcast8(b, s), b.sitofp(isum, _VF8), b.load(acc)]), acc)
        return _hsum8_vec(b, b.load(acc))
    return sig, codegen


def _ivec8(b, vals):
    """<8 x i32> from 8 i32 values."""
    v = ir.Constant(_VI8, ir.Undefined)
    for i, x in enumerate(vals):
        v = b.insert_element(v, x, ir.Constant(_I32, i))
    return v


def _i8splat32(n):
    return ir.Constant(_V32I8, [n] * 32)


def _hsum_i32(b, v):
    total = b.extract_element(v, ir.Constant(_I32, 0))
    for i in range(1, 8):
        total = b.add(total, b.extract_element(v, ir.Constant(_I32, i)))
    return total


def _half_at(e, ptr, idx):
    b = e.b
    return b.fpext(b.load(b.bitcast(e.gep(ptr, idx), ir.HalfType().as_pointer()), align=1), _F)


@intrinsic
def q4_k_row_vnni(typingctx, buf, o, sc, mn, xs, xd, bs32, nb):
    """ggml_gemv_q4_K_8x8_q8_K for the Q4_K row at buf[o] (used in place) and one column: per
    super-block i, isum = sum over sub-blocks s of sc[8 i + s] * (nibbles . xs) (AVX512-VNNI,
    exact integers), imin = sum of mn[8 i + s] * bs32[8 i + s];
    acc = fma(isum, d * xd[i], acc), accm = fma(imin, dmin * xd[i], accm); acc - accm.
    sc, mn (8 nb,) int32: the row's decoded 6-bit scales and mins; xs (256 nb,) int8;
    bs32 (8 nb,) int32: the column's 32-element sums."""
    sig = types.float32(buf, o, sc, mn, xs, xd, bs32, nb)

    def codegen(context, builder, signature, args):
        e = _Emit(context, builder)
        b = builder
        buf_p, sc_p, mn_p, xs_p, xd_p, bs_p = (e.ptr(context, signature.args[i], args[i]) for i in (0, 2, 3, 4, 5, 6))
        o_, nb_ = e.i64(args[1]), e.i64(args[7])
        dp = _dp256(b)
        zero = ir.Constant(_VI8, [0] * 8)
        acc = cgutils.alloca_once_value(b, ir.Constant(_F, 0.0))
        accm = cgutils.alloca_once_value(b, ir.Constant(_F, 0.0))
        with cgutils.for_range(b, nb_) as loop:
            i = loop.index
            bo = b.add(o_, b.mul(i, e.const(144)))
            lanes = zero
            for c in range(4):
                qs = b.bitcast(_load_bytes32(e, buf_p, b.add(bo, e.const(16 + 32 * c))), _V32I8)
                lo = b.bitcast(b.and_(qs, _i8splat32(15)), _VI8)
                hi = b.bitcast(b.lshr(qs, _i8splat32(4)), _VI8)
                x0 = _load_bytes32(e, xs_p, b.add(b.mul(i, e.const(256)), e.const(64 * c)))
                x1 = _load_bytes32(e, xs_p, b.add(b.mul(i, e.const(256)), e.const(64 * c + 32)))
                s1 = _bcast8(b, e.scalar(sc_p, b.add(b.mul(i, e.const(8)), e.const(2 * c))))
                s2 = _bcast8(b, e.scalar(sc_p, b.add(b.mul(i, e.const(8)), e.const(2 * c + 1))))
                lanes = b.add(lanes, b.add(b.mul(b.call(dp, [zero, lo, x0]), s1), b.mul(b.call(dp, [zero, hi, x1]), s2)))
            isum = _hsum_i32(b, lanes)
            imin = ir.Constant(_I32, 0)
            for s in range(8):
                idx = b.add(b.mul(i, e.const(8)), e.const(s))
                imin = b.add(imin, b.mul(e.scalar(mn_p, idx), e.scalar(bs_p, idx)))
            dx = e.scalar(xd_p, i)
            sd = b.fmul(_half_at(e, buf_p, bo), dx)
            sm = b.fmul(_half_at(e, buf_p, b.add(bo, e.const(2))), dx)
            fma = cgutils.get_or_insert_function(b.module, ir.FunctionType(_F, [_F, _F, _F]), "llvm.fma.f32")
            b.store(b.call(fma, [b.sitofp(isum, _F), sd, b.load(acc)]), acc)
            b.store(b.call(fma, [b.sitofp(imin, _F), sm, b.load(accm)]), accm)
        return b.fsub(b.load(acc), b.load(accm))
    return sig, codegen


@intrinsic
def q6_k_row_vnni(typingctx, buf, o, xs, xd, bse, bso, nb):
    """ggml_vec_dot_q6_K_q8_K (AVX2) for the Q6_K row at buf[o] (used in place) and one
    column: per super-block, lane l (of 8) = sum over halves h and groups g of
    scale[8 h + 2 g + (l >= 4)] * (unsigned 6-bit integers . xs over 4 l .. 4 l + 3 of the
    group) (AVX512-VNNI) - 32 (bse[l] scale[2 l] + bso[l] scale[2 l + 1]);
    lane = fma(xd[i] * d, lane, lane); hsum8. xs (256 nb,) int8; bse, bso (8 nb,) int32: the
    column's 16-element sums of even and odd sub-blocks."""
    sig = types.float32(buf, o, xs, xd, bse, bso, nb)

    def codegen(context, builder, signature, args):
        e = _Emit(context, builder)
        b = builder
        buf_p, xs_p, xd_p, be_p, bo_p = (e.ptr(context, signature.args[i], args[i]) for i in (0, 2, 3, 4, 5))
        o_, nb_ = e.i64(args[1]), e.i64(args[6])
        dp, fma8 = _dp256(b), _fma8(b)
        zero = ir.Constant(_VI8, [0] * 8)
        acc = cgutils.alloca_once(b, _VF8)
        b.store(ir.Constant(_VF8, [0.0] * 8), acc)
        with cgutils.for_range(b, nb_) as loop:
            i = loop.index
            bo = b.add(o_, b.mul(i, e.const(210)))
            scale = [b.sext(e.scalar(buf_p, b.add(bo, e.const(192 + s))), _I32) for s in range(16)]
            tot = zero
            for h in range(2):
                qh = b.bitcast(_load_bytes32(e, buf_p, b.add(bo, e.const(128 + 32 * h))), _V32I8)
                ql = [b.bitcast(_load_bytes32(e, buf_p, b.add(bo, e.const(64 * h + 32 * part))), _V32I8)
                      for part in range(2)]
                for g in range(4):
                    low = b.and_(ql[g % 2], _i8splat32(15)) if g < 2 else b.lshr(ql[g % 2], _i8splat32(4))
                    high = b.shl(b.and_(b.lshr(qh, _i8splat32(2 * g)), _i8splat32(3)), _i8splat32(4))
                    u6 = b.bitcast(b.or_(low, high), _VI8)
                    xv = _load_bytes32(e, xs_p, b.add(b.mul(i, e.const(256)), e.const(128 * h + 32 * g)))
                    sv = _ivec8(b, [scale[8 * h + 2 * g]] * 4 + [scale[8 * h + 2 * g + 1]] * 4)
                    tot = b.add(tot, b.mul(b.call(dp, [zero, u6, xv]), sv))
            be = b.load(b.bitcast(e.gep(be_p, b.mul(i, e.const(8))), _VI8.as_pointer()), align=4)
            bso = b.load(b.bitcast(e.gep(bo_p, b.mul(i, e.const(8))), _VI8.as_pointer()), align=4)
            sub = b.add(b.mul(be, _ivec8(b, scale[0::2])), b.mul(bso, _ivec8(b, scale[1::2])))
            lanes = b.sub(tot, b.shl(sub, ir.Constant(_VI8, [5] * 8)))
            d = b.fmul(e.scalar(xd_p, i), _half_at(e, buf_p, b.add(bo, e.const(208))))
            b.store(b.call(fma8, [_bcast8(b, d), b.sitofp(lanes, _VF8), b.load(acc)]), acc)
        return _hsum8_vec(b, b.load(acc))
    return sig, codegen


# ---- small-head attention (small_head_attention.py): the queries of a tile are the lanes ----
LANES = 2 * W  # queries per tile: two registers


def _row_stride(context, b, aryty, ary):
    """The first-dimension stride of a 2-D float32 array, in elements."""
    return b.sdiv(b.extract_value(context.make_array(aryty)(context, b, ary).strides, 0), ir.Constant(_I64, 4))


@intrinsic
def lanes_scores(typingctx, kh, qt, mt, s, tm, a, b_, sc, slope, has_mask):
    """The scores of LANES queries against cells a .. b - 1 of a tile: s[c, i] = (fma chain
    over d of kh[c, d] * qt[d, i], from 0) * sc [+ slope * mt[c, i]], and the running max
    tm[i] = tm[i] > s ? tm[i] : s (ggml's MAX). kh (cells, dk) any row stride; qt (dk, LANES),
    mt (cells, LANES), s (64, LANES) C-contiguous; tm (LANES,)."""
    if sc != types.float32 or slope != types.float32:
        return None
    sig = types.void(kh, qt, mt, s, tm, a, b_, sc, slope, has_mask)

    def codegen(context, builder, signature, args):
        e = _Emit(context, builder)
        b = builder
        kh_p, qt_p, mt_p, s_p, tm_p = (e.ptr(context, ty, x) for ty, x in zip(signature.args[:5], args[:5]))
        a_, b1 = e.i64(args[5]), e.i64(args[6])
        sc_v, slope_v = e.splat(args[7]), e.splat(args[8])
        masked = args[9]
        ks = _row_stride(context, b, signature.args[0], args[0])
        dk = b.extract_value(context.make_array(signature.args[0])(context, b, args[0]).shape, 1)
        lanes = e.const(LANES)
        tms = [e.acc() for _ in range(2)]
        for v in range(2):
            b.store(e.load(tm_p, e.const(W * v)), tms[v])
        with cgutils.for_range_slice(b, a_, b1, e.const(1)) as (c, _):
            xs = [e.acc() for _ in range(2)]
            krow = e.gep(kh_p, b.mul(c, ks))
            with cgutils.for_range(b, dk) as loop:
                d = loop.index
                kd = e.splat(e.scalar(krow, d))
                for v in range(2):
                    q = e.load(qt_p, b.add(b.mul(d, lanes), e.const(W * v)))
                    b.store(e.fma(kd, q, b.load(xs[v])), xs[v])
            for v in range(2):
                x = e.mul(b.load(xs[v]), sc_v)
                b.store(x, xs[v])
            with b.if_then(masked):
                for v in range(2):
                    m = e.load(mt_p, b.add(b.mul(c, lanes), e.const(W * v)))
                    b.store(e.add(b.load(xs[v]), e.mul(slope_v, m)), xs[v])
            for v in range(2):
                x = b.load(xs[v])
                e.store(s_p, b.add(b.mul(c, lanes), e.const(W * v)), x)
                t = b.load(tms[v])
                b.store(b.select(b.fcmp_ordered(">", t, x), t, x), tms[v])
        for v in range(2):
            e.store(tm_p, e.const(W * v), b.load(tms[v]))
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def lanes_values(typingctx, p, vh, acc, a, b_):
    """The output of LANES queries over cells a .. b - 1 of a tile: acc[d, i] = fma chain over
    c of vh[c, d] * p[c, i], continuing from acc. vh (cells, dv) any row stride; p (64, LANES),
    acc (dv, LANES) C-contiguous."""
    sig = types.void(p, vh, acc, a, b_)

    def codegen(context, builder, signature, args):
        e = _Emit(context, builder)
        b = builder
        p_p, vh_p, acc_p = (e.ptr(context, ty, x) for ty, x in zip(signature.args[:3], args[:3]))
        a_, b1 = e.i64(args[3]), e.i64(args[4])
        vs = _row_stride(context, b, signature.args[1], args[1])
        dv = b.extract_value(context.make_array(signature.args[1])(context, b, args[1]).shape, 1)
        lanes = e.const(LANES)
        with cgutils.for_range(b, dv) as outer:
            d = outer.index
            xs = [e.acc() for _ in range(2)]
            for v in range(2):
                b.store(e.load(acc_p, b.add(b.mul(d, lanes), e.const(W * v))), xs[v])
            with cgutils.for_range_slice(b, a_, b1, e.const(1)) as (c, _):
                vd = e.splat(e.scalar(vh_p, b.add(b.mul(c, vs), d)))
                for v in range(2):
                    pv = e.load(p_p, b.add(b.mul(c, lanes), e.const(W * v)))
                    b.store(e.fma(vd, pv, b.load(xs[v])), xs[v])
            for v in range(2):
                e.store(acc_p, b.add(b.mul(d, lanes), e.const(W * v)), b.load(xs[v]))
        return context.get_dummy_value()
    return sig, codegen
