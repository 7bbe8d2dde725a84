"""MUL_MAT with an F32 or F16 first operand as ggml-cpu computes it (simd.py says why the
order), so that results do not depend on the BLAS library or the CPU it runs on.

For F16, ggml rounds the second operand to F16 first. Then, with at least 2 of its rows, K
a multiple of 16 and the first operand's rows a multiple of 4, it hands the product to
llamafile's tinyBLAS (AVX-512: 16 lanes, lane t summing elements t, t + 16, ... by fma,
the lanes added as _mm512_reduce_add_ps); otherwise each element is ggml_vec_dot_f16 or
ggml_vec_dot_f32. Without flash attention an F16 cache's attention products (K x Q,
V x softmax) come here; F32 weights (small models) do too. ggml_vec_dot_f32's tail past
its 64-element blocks is a plain C loop, summed as GCC compiles it (llvmir/float_dots.py:
the rounded products of whole groups of 8 added in order, the last K % 8 by fma): so an F32
model's FFN down product (K = n_ff, 172 on stories260K) is llama.cpp's bit for bit.

(numba caches this module's kernels by this file's date: a change to the llvmir intrinsics
they call needs a change here too, or a cleared __pycache__, to take effect.)

Arrays: a [a3, a2, M, K] and b [b3, b2, N, K] float32 (values of halves for F16; b2 a
multiple of a2, b3 of a3, as ggml broadcasts), out [b3, b2, N, M].
"""
from __future__ import annotations

from numba import njit, prange

from ....llvmir.float_dots import dot_lanes16, float_tile_4x4, vec_dot_f16_row, vec_dot_f32_row

LANES = 16


def uses_tinyblas(m: int, n: int, k: int) -> bool:
    """llamafile_sgemm's conditions for an F32 or F16 product (AVX-512 build)."""
    return n >= 2 and k % LANES == 0 and m % 4 == 0


@njit(parallel=True, cache=True)
def mul_mat(a, b, out, tinyblas, halves):
    """out = the products (module doc); a, b C-contiguous float32, out C-contiguous; halves:
    an F16 product. Each matrix pair's rows four at a time: with tinyblas (M a multiple of 4)
    its 4 x 4 blocks and the columns past the last whole block in tinyBLAS's lanes, else
    each element as ggml_vec_dot_f16/_f32 (LLVM vector code, llvmir/float_dots.py: quick to compile)."""
    a3, a2, m_rows, k = a.shape
    b3, b2, n_cols = b.shape[0], b.shape[1], b.shape[2]
    r3, r2 = b3 // a3, b2 // a2
    mb = (m_rows + 3) // 4
    n4 = n_cols - n_cols % 4 if tinyblas else 0
    for task in prange(b3 * b2 * mb):
        i3 = task // (b2 * mb)
        i2 = (task // mb) % b2
        m0 = (task % mb) * 4
        am, bm, om = a[i3 // r3, i2 // r2], b[i3, i2], out[i3, i2]
        for n0 in range(0, n4, 4):
            float_tile_4x4(am, bm, om, m0, n0)
        for m in range(m0, min(m0 + 4, m_rows)):
            for n in range(n4, n_cols):
                if tinyblas:
                    om[n, m] = dot_lanes16(am[m], bm[n], k)
                elif halves:
                    om[n, m] = vec_dot_f16_row(am[m], bm[n], k)
                else:
                    om[n, m] = vec_dot_f32_row(am[m], bm[n], k)
