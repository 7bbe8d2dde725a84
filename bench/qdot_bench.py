"""Few-column quantized products (generated tokens) of the types qdot.py serves (Q4_0, Q5_K):
integer dot products on the packed blocks against the tile path (dequantize tiles, BLAS),
alternated A B A B. (Q5_0, Q8_0, Q4_K and Q6_K take qexact.py's kernels for any column
count; there is no tile path for them to compare with.)

    python bench/qdot_bench.py [--threads 1] [--reps 9] [--columns 1] [--types Q4_0,Q5_K]

Shapes are gemma-3-270m's: (rows x k) 2048 x 640 (ffn_up/gate), 640 x 2048 (ffn_down).
Medians in milliseconds, and the bytes of packed weights read per second.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np

from ggmlpy import GGMLType as T
from ggmlpy import quants
from dataclasses import replace

from ggmlpy.backend.cpu.products import type_table
from ggmlpy.backend.cpu.plan import Scratch
from ggmlpy.backend.cpu.products.qmatmul import QuantMatrix, mul_mat_q

SHAPES = {T.Q4_0: [(2048, 640)], T.Q5_K: [(640, 2048)]}


def run(w: QuantMatrix, x: np.ndarray, out: np.ndarray, scratch: Scratch, integer: bool) -> float:
    saved = type_table.CPU_TYPES[w.type]  # the integer kernel for this many columns, or none
    packed = replace(saved.packed, max_columns=x.shape[0]) if integer else None
    type_table.CPU_TYPES[w.type] = replace(saved, packed=packed)
    try:
        t0 = time.perf_counter()
        mul_mat_q(w, x, out, scratch)
        return time.perf_counter() - t0
    finally:
        type_table.CPU_TYPES[w.type] = saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--types", default="Q4_0,Q5_K")
    ap.add_argument("--columns", type=int, default=1, help="activation columns (tokens) per product")
    args = ap.parse_args()
    numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print(f"threads {args.threads}, columns {args.columns}; median ms (GB/s of packed weights): integer dots | tile path | ratio")
    for name in args.types.split(","):
        type = T[name]
        for m, k in SHAPES[type]:
            rows = np.concatenate([quants.quantize(rng.standard_normal((min(m, 4096), k)).astype(np.float32), type)
                                   .reshape(min(m, 4096), -1)] * -(-m // 4096))[:m]
            w = QuantMatrix.from_bytes(type, rows, k)
            x = rng.standard_normal((args.columns, k)).astype(np.float32)
            outs = np.empty((args.columns, m), np.float32), np.empty((args.columns, m), np.float32)
            scratch = Scratch()
            times: dict[bool, list[float]] = {True: [], False: []}
            for rep in range(args.reps + 1):
                for integer in (True, False):
                    t = run(w, x, outs[integer], scratch, integer)
                    if rep:
                        times[integer].append(t)
            a, b = (statistics.median(times[i]) * 1e3 for i in (True, False))
            rel = np.max(np.abs(outs[1] - outs[0])) / np.max(np.abs(outs[0]))
            print(f"{name:5s} {m:6d} x {k:4d}: {a:8.3f} ({rows.nbytes / a / 1e6:5.1f}) | {b:8.3f} "
                  f"({rows.nbytes / b / 1e6:5.1f}) | {b / a:5.2f}x   max diff {rel:.1e}")


if __name__ == "__main__":
    main()
