"""Q4_K and Q6_K products of many columns (prompt processing, perplexity, a training forward):
the AVX512-VNNI tiles against the float32 tiles, side by side (the same numbers; checked).

    python bench/k_quant_tiles.py [--threads 2] [--shapes 2048x2048,8192x2048,2048x8192] [--cols 512] [--reps 7]

A shape is ROWSxK (the matrix's rows and row length); each product is planned once per
kernel and timed alternately, run for run; medians in ms and GMAC/s (rows x k x cols).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np

from ggmlpy import GGMLType as T
from ggmlpy import quants
from ggmlpy.backend.cpu.products import qexact, type_table
from ggmlpy.backend.cpu.plan import Scratch


def planned(type, n, m, k, vnni: bool):
    saved = qexact.VNNI
    qexact.VNNI = vnni
    try:
        return type_table.plan_mul_mat(type, n, m, k)
    finally:
        qexact.VNNI = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default="2048x2048,8192x2048,2048x8192")
    ap.add_argument("--cols", type=int, default=512)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    if not qexact.VNNI:
        raise SystemExit("this CPU has no AVX512-VNNI (or GGMLPY_NO_VNNI is set)")
    numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print(f"{args.cols} columns, {args.threads} threads; ms (median of {args.reps}), GMAC/s")
    for type in (T.Q4_K, T.Q6_K):
        for shape in args.shapes.split(","):
            m, k = map(int, shape.split("x"))
            rows = quants.quantize(rng.standard_normal((m, k)).astype(np.float32), type).reshape(m, -1)
            buf = rows.reshape(-1)
            offs = np.arange(m, dtype=np.int64) * rows.shape[1]
            x = rng.standard_normal((args.cols, k)).astype(np.float32)
            runs = {}
            for vnni in (False, True):
                out = np.empty((args.cols, m), np.float32)
                run, scratch = planned(type, args.cols, m, k, vnni), Scratch()
                run(buf, offs, x, out, scratch)  # compile, and the result to compare
                runs[vnni] = (run, scratch, out)
            assert np.array_equal(runs[False][2], runs[True][2]), "the two kernels disagree"
            times = {False: [], True: []}
            for _ in range(args.reps):
                for vnni, (run, scratch, out) in runs.items():
                    t = time.perf_counter()
                    run(buf, offs, x, out, scratch)
                    times[vnni].append(time.perf_counter() - t)
            macs = m * k * args.cols
            f, v = statistics.median(times[False]), statistics.median(times[True])
            print(f"{type.name} {shape}: float {f * 1e3:7.1f} ms ({macs / f / 1e9:5.0f} GMAC/s), "
                  f"VNNI {v * 1e3:7.1f} ms ({macs / v / 1e9:5.0f} GMAC/s), VNNI/float time {v / f:.2f}")


if __name__ == "__main__":
    main()
