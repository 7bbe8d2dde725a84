"""The micro-tile of bf16dot.py's products by AVX512-BF16's vdpbf16ps (32 bf16 multiply-adds in
one instruction, twice float32 FMA), its accumulators kept in registers across the pairs.

Without AVX512-BF16 (or with GGMLPY_NO_BF16=1) BF16 is False and bf16dot.py multiplies the
same rounded operands through BLAS.
"""
from __future__ import annotations

import os

from .emit import BFLOAT, VF, VI, W, kernel, target_has, vec

BF16 = target_has("avx512bf16") and not os.environ.get("GGMLPY_NO_BF16")

_VBF = vec(BFLOAT, 2 * W)  # a register of bf16 pairs


def tile(rows: int, cols: int):
    """An intrinsic res[rows * cols * 16] += G[t0:t0 + rows] @ W[:, k0:k0 + 16 cols] over the
    pairs p0..p0 + n_pairs of gp and 0..n_pairs of wp (uint32 arrays of bf16 pairs, rows of
    any stride; res float32, row-major, rows of 16 cols floats), adding the pairs one after
    the other to what res holds."""

    @kernel()
    def bf16_tile(e, wp, gp, res, t0, k0, p0, n_pairs):
        b = e.b
        w_stride, g_stride = e.stride(wp, 0), e.stride(gp, 0)
        g_rows = [e.gep(gp, b.add(b.mul(b.add(t0, e.const(t)), g_stride), p0)) for t in range(rows)]
        offs = [[e.const((t * cols + c) * W) for c in range(cols)] for t in range(rows)]
        accs = [[e.slot(e.load(res, off)) for off in row] for row in offs]
        with e.loop(n_pairs) as p:
            w_row = e.gep(wp, b.add(b.mul(p, w_stride), k0))
            wv = [b.bitcast(e.load(w_row, e.const(W * c), VI), _VBF) for c in range(cols)]
            for t in range(rows):
                gv = b.bitcast(e.splat(e.at(g_rows[t], p)), _VBF)  # G's pair (t, p) in every lane
                for c in range(cols):
                    slot = accs[t][c]
                    b.store(e.call("llvm.x86.avx512bf16.dpbf16ps.512", VF, b.load(slot), gv, wv[c]), slot)
        for row, slots in zip(offs, accs):
            for off, slot in zip(row, slots):
                e.store(res, off, b.load(slot))
    return bf16_tile
