"""Quantized MUL_MAT against the float32 BLAS product of the same shape.

    python bench/quant_matmul.py [--threads 2] [--rows 640] [--k 2048] [--types Q4_K,Q6_K,Q8_0,Q5_0]
                                 [--cols 1,8,64,512] [--reps 7]

The weight has `rows` rows of `k` elements (gemma3-270m's ffn_down is 640 x 2048; its output
layer, in chunks, --rows 8192 --k 640 --cols 256); it is
multiplied with N = --cols activation columns through a graph on a reused
CpuBackend, and the transposed product (dx = dy @ W) is timed on the array-level API in
float32 and with bf16 dot products (bf16dot.py, what training uses for it where the CPU has
AVX512-BF16). For Q5_0 and Q8_0, qexact's block-sum product (the fused output layer's logits)
is timed against the same kernels in ggml's order. Each pair is timed alternately, run for
run (the machine's noise falls on both); medians, milliseconds.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np

import ggmlpy as gg
from ggmlpy import GGMLType as T
from ggmlpy import quants
from ggmlpy.backend.cpu import CpuBackend
from ggmlpy.backend.cpu.products import qmatmul, type_table
from ggmlpy.backend.cpu.plan import Scratch


def _alternated_ms(a, b, reps: int) -> tuple[float, float]:
    """Medians of `reps` runs of a and b, taken in turn (after one warm-up run of each)."""
    a(), b()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(reps):
        for fn, out in ((a, times[0]), (b, times[1])):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=640)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0,Q5_0")
    ap.add_argument("--cols", default="1,8,64,512", help="activation columns N, comma-separated")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    backend = CpuBackend(args.threads)
    numba.set_num_threads(args.threads)  # the array-level calls below run outside the backend
    scratch = Scratch()
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((args.rows, args.k)) * 0.05).astype(np.float32)
    print(f"W {args.rows} x {args.k}, threads {args.threads}; ms (median of {args.reps})")
    print(f"{'type':6} {'N':>5} {'quantized':>10} {'f32 BLAS':>9} {'ratio':>6} {'transposed':>11} {'bf16':>7} "
          f"{'ratio':>6} {'blocks':>7} {'ratio':>6}")
    for name in args.types.split(","):
        w_type = T[name]
        q = quants.quantize(w, w_type)
        w32 = quants.dequantize(q, w_type)
        wm = qmatmul.QuantMatrix.from_bytes(w_type, q, args.k)
        for n in (int(c) for c in args.cols.split(",")):
            x = rng.standard_normal((n, args.k)).astype(np.float32)
            gq = gg.new_graph(gg.mul_mat(ctx := gg.Context(), ctx.from_numpy(q, w_type), ctx.from_numpy(x)))
            # Prec.BLAS: sgemm, as training's F32 products (by default an F32 MUL_MAT sums in ggml's order)
            gf = gg.new_graph(gg.set_prec(gg.mul_mat(ctx2 := gg.Context(), ctx2.from_numpy(w32), ctx2.from_numpy(x)),
                                          gg.Prec.BLAS))
            gg.compute(gq, backend)
            gg.compute(gf, backend)
            tq, tf = _alternated_ms(lambda: backend.compute(gq), lambda: backend.compute(gf), args.reps)
            dy = rng.standard_normal((n, args.rows)).astype(np.float32)
            dx = np.empty((n, args.k), np.float32)
            tt, tb = _alternated_ms(lambda: qmatmul.mul_mat_qt(wm, dy, dx, scratch),
                                    lambda: qmatmul.mul_mat_qt(wm, dy, dx, scratch, bf16=True), args.reps)
            line = f"{name:6} {n:5d} {tq:10.2f} {tf:9.2f} {tq / tf:6.2f} {tt:11.2f} {tb:7.2f} {tb / tt:6.2f}"
            if type_table.cpu_type(w_type).packed and type_table.cpu_type(w_type).packed.block_sums:
                out = np.empty((n, args.rows), np.float32)
                ts, tk = _alternated_ms(lambda: type_table.mul_mat(w_type, wm.buf, wm.offs, x, out, scratch),
                                        lambda: type_table.mul_mat(w_type, wm.buf, wm.offs, x, out, scratch,
                                                                   block_sums=True), args.reps)
                line += f" {tk:7.2f} {tk / ts:6.2f}"
            print(line)


if __name__ == "__main__":
    main()
