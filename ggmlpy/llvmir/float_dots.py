"""ggml-cpu's F32 and F16 dot products (floatdot.py, attention.py) as LLVM vector code, each in
its order as llama.cpp's AVX-512 build sums it: tinyBLAS's 16 lanes, ggml_vec_dot_f32's 4
accumulators of 16 lanes and GCC's compilation of its scalar leftovers, ggml_vec_dot_f16's
double sum. Operands are float32 (an F16 operand as its values)."""
from __future__ import annotations

from numba import types

from .emit import F32, F64, Emit, W, kernel


@kernel()
def float_tile_4x4(e, a, bm, out, m0, n0):
    """tinyBLAS's F32 or F16 product (AVX-512) for rows m0..m0 + 3 of a and n0..n0 + 3 of bm:
    out[n, m] = _mm512_reduce_add_ps of 16 lanes, lane t the fma chain over l of
    a[m, 16 l + t] * bm[n, 16 l + t]. a (M, K), bm (N, K) float32 (values of halves for F16),
    K a multiple of 16; out (N, M); all C-contiguous."""
    b = e.b
    k, m_all = e.shape(a, 1), e.shape(out, 1)
    arows = e.rows(a, m0, k, 4)
    brows = e.rows(bm, n0, k, 4)
    acc = [[e.acc() for _ in range(4)] for _ in range(4)]
    with e.loop(b.udiv(k, e.const(W))) as step:
        off = b.mul(step, e.const(W))
        av = [e.load(p, off) for p in arows]
        bv = [e.load(p, off) for p in brows]
        for i in range(4):
            for j in range(4):
                b.store(e.fma(av[i], bv[j], b.load(acc[i][j])), acc[i][j])
    for i in range(4):
        for j in range(4):
            idx = b.add(b.mul(b.add(n0, e.const(j)), m_all), b.add(m0, e.const(i)))
            b.store(e.hsum(e.lanes(b.load(acc[i][j]))), e.gep(out, idx))


@kernel(types.float32)
def dot_lanes16(e, a, x, k):
    """a[:k] . x[:k] as tinyBLAS sums it (AVX-512): 16 lanes, lane t the fma chain over
    a[16 l + t] * x[16 l + t], then _mm512_reduce_add_ps; k a multiple of 16. a, x 1-D float32
    arrays, contiguous (so are the other dots')."""
    b = e.b
    acc = e.acc()
    with e.loop(b.udiv(k, e.const(W))) as step:
        off = b.mul(step, e.const(W))
        b.store(e.fma(e.load(a, off), e.load(x, off), b.load(acc)), acc)
    return e.hsum(e.lanes(b.load(acc)))


def _blocks64(e: Emit, a, x, k):
    """ggml_vec_dot_f16/_f32's vector part over the whole 64-element blocks: 4 accumulators of
    16 lanes, reduced 0 + 2, 1 + 3, then the two, then _mm512_reduce_add_ps (+0.0 when
    k < 64); and where the leftovers start."""
    b = e.b
    accs = [e.acc() for _ in range(4)]
    n64 = b.udiv(k, e.const(64))
    with e.loop(n64) as block:
        base = b.mul(block, e.const(64))
        for j, slot in enumerate(accs):
            off = b.add(base, e.const(W * j))
            b.store(e.fma(e.load(a, off), e.load(x, off), b.load(slot)), slot)
    return e.hsum(e.lanes(e.hsum([b.load(slot) for slot in accs]))), b.mul(n64, e.const(64))


@kernel(types.float32)
def vec_dot_f32_row(e, a, x, k):
    """a[:k] . x[:k] as ggml_vec_dot_f32 (_blocks64), then the last k % 64 products in order,
    as GCC compiles ggml's scalar leftover loop `sumf += x[i]*y[i]`: it vectorises the
    products of whole groups of 16, then of 8 (each product rounded, then added), and fuses
    the last (k % 64) % 8 into fmas."""
    b = e.b
    lanes, start = _blocks64(e, a, x, k)
    total = e.slot(lanes)
    n_mul = b.and_(b.sub(k, start), e.const(~7))  # the leftovers GCC vectorises: rounded products
    with e.loop(n_mul) as i:
        i = b.add(start, i)
        b.store(b.fadd(b.load(total), b.fmul(e.at(a, i), e.at(x, i))), total)
    start = b.add(start, n_mul)
    with e.loop(b.sub(k, start)) as i:
        i = b.add(start, i)
        b.store(e.fma(e.at(a, i), e.at(x, i), b.load(total)), total)
    return b.load(total)


@kernel(types.float32)
def vec_dot_f16_row(e, a, x, k):
    """a[:k] . x[:k] as ggml_vec_dot_f16: _blocks64's lanes, their sum and the last k % 64
    products, each rounded to float32, added in double."""
    b = e.b
    lanes, start = _blocks64(e, a, x, k)
    total = e.slot(b.fpext(lanes, F64))
    with e.loop(b.sub(k, start)) as i:
        i = b.add(start, i)
        b.store(b.fadd(b.load(total), b.fpext(b.fmul(e.at(a, i), e.at(x, i)), F64)), total)
    return b.fptrunc(b.load(total), F32)
