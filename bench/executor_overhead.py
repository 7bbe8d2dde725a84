"""Per-op cost of the CPU executor: a graph of many ops on tiny tensors, where the kernels'
own work is negligible, computed again and again on a reused plan.

    python bench/executor_overhead.py [--ops 1000] [--rounds 20] [--threads 1]

Prints microseconds per op for a chain of each kind (ADD of rows, MUL of a row by a
broadcast weight, RMS_NORM, MUL_MAT of one token with an F32 matrix, SCALE), best of
`rounds`. llama.cpp's per-op cost on the same machine is about 1 us (stories260K: 0.11 ms
per token for ~100 ops, kernels included).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import ggmlpy as gg
from ggmlpy import GGMLType as T
from ggmlpy.backend.cpu import CpuBackend


def chain(kind: str, n_ops: int) -> tuple[gg.Graph, gg.Tensor]:
    ctx = gg.Context()
    rng = np.random.default_rng(0)
    x = ctx.from_numpy(rng.standard_normal((1, 64)).astype(np.float32), T.F32)
    w = ctx.from_numpy(rng.standard_normal((64, 64)).astype(np.float32) / 8, T.F32)
    g = ctx.from_numpy(rng.standard_normal((1, 64)).astype(np.float32), T.F32)
    y = x
    for _ in range(n_ops):
        if kind == "ADD":
            y = gg.add(ctx, y, x)
        elif kind == "MUL":
            y = gg.mul(ctx, y, g)
        elif kind == "RMS_NORM":
            y = gg.rms_norm(ctx, y, 1e-5)
        elif kind == "MUL_MAT":
            y = gg.mul_mat(ctx, w, y)
        elif kind == "SCALE":
            y = gg.scale(ctx, y, 0.5)
    graph = gg.new_graph(y)
    return graph, y


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    backend = CpuBackend(args.threads)
    print(f"threads {args.threads}, {args.ops} ops per graph, best of {args.rounds}: us per op")
    for kind in ("ADD", "MUL", "RMS_NORM", "SCALE", "MUL_MAT"):
        graph, _ = chain(kind, args.ops)
        gg.compute(graph, backend)  # allocated (planned arena) and prepared once
        best = float("inf")
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            backend.compute(graph)
            best = min(best, time.perf_counter() - t0)
        print(f"{kind:9s} {best / args.ops * 1e6:6.2f}")


if __name__ == "__main__":
    main()
