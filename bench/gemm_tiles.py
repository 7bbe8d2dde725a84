"""Float products in whole rows of 32 against 32 x 32 tiles (gemm.SLICE_COLS), the shapes
training meets, on numba's threads.

    python bench/gemm_tiles.py [-t 2]

Prints microseconds per product (best of 5 repetitions) for x @ W.T (the forward layout)
and x @ W (the backward layout), each both ways, alternated, and whether the bits agree.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import ggmlpy.backend.cpu as cpu
from ggmlpy.backend.cpu.products import gemm

SHAPES = [(128, 128, 384), (128, 128, 128), (128, 384, 128), (128, 128, 512), (256, 128, 384), (32, 128, 384)]


def best_us(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t0) / reps)
    return 1e6 * min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()
    cpu._set_threads(a.threads)
    rng = np.random.default_rng(0)
    tiles = gemm.SLICE_COLS
    print(f"BLAS {gemm.BLAS}, -t {a.threads}; us per product: whole rows of {gemm.SLICE_ROWS} / tiles of "
          f"{gemm.SLICE_ROWS} x {tiles}")
    for t, k, m in SHAPES:
        x = rng.standard_normal((t, k), dtype=np.float32)
        w = rng.standard_normal((m, k), dtype=np.float32)
        for layout, rhs in (("x @ W.T", w.T), ("x @ W  ", np.ascontiguousarray(w.T))):
            outs, us = [], []
            for cols in (1 << 30, tiles):
                gemm.SLICE_COLS = cols
                out = np.empty((t, m), np.float32)
                us.append(best_us(gemm.Matmul(x, rhs, out), 300))
                outs.append(out)
            gemm.SLICE_COLS = tiles
            print(f"{t:4d} x {k:4d} -> {m:5d}  {layout}: {us[0]:7.1f} / {us[1]:7.1f} us  "
                  f"({us[0] / us[1]:.2f}x, bits {'equal' if np.array_equal(*outs) else 'differ'})")


if __name__ == "__main__":
    main()
