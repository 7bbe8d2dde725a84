"""Quantized MUL_MAT against the float32 BLAS product of the same shape.

    python bench/quant_matmul.py [--threads 2] [--rows 640] [--k 2048] [--types Q4_K,Q6_K,Q8_0,Q5_0]

The weight has `rows` rows of `k` elements (gemma3-270m's ffn_down is 640 x 2048); it is
multiplied with N = 1, 8, 64, 512 activation columns through a graph on a reused
CpuBackend, and the transposed product (dx = dy @ W) is timed on the array-level API in
float32 and with bf16 dot products (bf16dot.py, what training uses for it where the CPU has
AVX512-BF16). For Q5_0 and Q8_0, qexact's block-sum product (the fused output layer's logits)
is timed against the same kernels in ggml's order. Medians of several runs, milliseconds.
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
from ggmlpy.backend.cpu import CpuBackend, qexact, qmatmul
from ggmlpy.backend.cpu.plan import Scratch


def _median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=640)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0,Q5_0")
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
        for n in (1, 8, 64, 512):
            x = rng.standard_normal((n, args.k)).astype(np.float32)
            gq = gg.new_graph(gg.mul_mat(ctx := gg.Context(), ctx.from_numpy(q, w_type), ctx.from_numpy(x)))
            gf = gg.new_graph(gg.mul_mat(ctx2 := gg.Context(), ctx2.from_numpy(w32), ctx2.from_numpy(x)))
            gg.compute(gq, backend)
            gg.compute(gf, backend)
            tq = _median_ms(lambda: backend.compute(gq), args.reps)
            tf = _median_ms(lambda: backend.compute(gf), args.reps)
            dy = rng.standard_normal((n, args.rows)).astype(np.float32)
            dx = np.empty((n, args.k), np.float32)
            tt = _median_ms(lambda: qmatmul.mul_mat_qt(wm, dy, dx, scratch), args.reps)
            tb = _median_ms(lambda: qmatmul.mul_mat_qt(wm, dy, dx, scratch, bf16=True), args.reps)
            line = f"{name:6} {n:5d} {tq:10.2f} {tf:9.2f} {tq / tf:6.2f} {tt:11.2f} {tb:7.2f} {tb / tt:6.2f}"
            if qexact.block_sums(w_type):
                out = np.empty((n, args.rows), np.float32)
                ts = _median_ms(lambda: qexact.mul_mat(w_type, wm.buf, wm.offs, x, out, scratch), args.reps)
                tk = _median_ms(lambda: qexact.mul_mat(w_type, wm.buf, wm.offs, x, out, scratch, block_sums=True),
                                args.reps)
                line += f" {tk:7.2f} {tk / ts:6.2f}"
            print(line)


if __name__ == "__main__":
    main()
