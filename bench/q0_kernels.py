"""The two Q5_0/Q8_0 products by column tiles, alternated: ggml's order (every MUL_MAT) and
block sums (the fused output layer's logits), on qexact.mul_mat directly.

    python bench/q0_kernels.py [--threads 2] [--rows 8192] [--k 640] [--cols 256] [--reps 15]

Prints the best of --reps runs of each, milliseconds and GFLOP/s (2 M K N per product).
"""
from __future__ import annotations

import argparse
import time

import numba
import numpy as np

from ggmlpy import GGMLType as T
from ggmlpy import quants
from ggmlpy.backend.cpu import qexact, qmatmul
from ggmlpy.backend.cpu.plan import Scratch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--k", type=int, default=640)
    ap.add_argument("--cols", type=int, default=256)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    m, k, n = args.rows, args.k, args.cols
    w = (rng.standard_normal((m, k)) * 0.05).astype(np.float32)
    x = rng.standard_normal((n, k)).astype(np.float32)
    print(f"W {m} x {k} by {n} columns, threads {args.threads}, VNNI {qexact.VNNI}; best of {args.reps}")
    for type in (T.Q8_0, T.Q5_0):
        qm = qmatmul.QuantMatrix.from_bytes(type, quants.quantize(w, type), k)
        out, scratch = np.empty((n, m), np.float32), Scratch()
        runs = {"ggml order": lambda: qexact.mul_mat(type, qm.buf, qm.offs, x, out, scratch),
                "block sums": lambda: qexact.mul_mat(type, qm.buf, qm.offs, x, out, scratch, block_sums=True)}
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(args.reps):
            for name, run in runs.items():
                t0 = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - t0)
        flops = 2 * m * k * n
        print(f"{type.name}: " + "   ".join(f"{name} {t * 1e3:.1f} ms ({flops / t / 1e9:.0f} GFLOP/s)"
                                         for name, t in best.items())
              + f"   ratio {best['ggml order'] / best['block sums']:.2f}")


if __name__ == "__main__":
    main()
