"""FLASH_ATTN_EXT alone, in stories260K's shape at -c 128 -ub 512: 4 sequences of 128 queries,
8 heads of 8 over 4 KV heads, F16 K/V, causal mask. Microseconds per call, best of repeats.

Run by hand (not in CI):  python bench/attention_bench.py [--threads 1 2]
"""
from __future__ import annotations

import argparse
import math
import time

import numpy as np

import ggmlpy as gg
from ggmlpy import GGMLType


def build(rng: np.random.Generator) -> gg.Graph:
    n_seq, n_q, n_head, n_head_kv, d = 4, 128, 8, 4, 8
    ctx = gg.Context()

    def heads_view(values: np.ndarray, type: GGMLType) -> gg.Tensor:
        """[d, tokens, heads, seqs] seen through memory laid out as the graph and the KV cache
        hold it (tokens outer, heads inner)."""
        t = ctx.from_numpy(np.ascontiguousarray(values.transpose(0, 2, 1, 3)), type)
        return gg.permute(ctx, t, 0, 2, 1, 3)

    q = heads_view(rng.standard_normal((n_seq, n_head, n_q, d)).astype(np.float32), GGMLType.F32)
    k = heads_view(rng.standard_normal((n_seq, n_head_kv, n_q, d)).astype(np.float16), GGMLType.F16)
    v = heads_view(rng.standard_normal((n_seq, n_head_kv, n_q, d)).astype(np.float16), GGMLType.F16)
    causal = np.triu(np.full((n_q, n_q), -np.inf, dtype=np.float32), 1)
    mask = ctx.from_numpy(np.broadcast_to(causal, (n_seq, 1, n_q, n_q)).copy())
    return gg.new_graph(gg.flash_attn_ext(ctx, q, k, v, mask, 1 / math.sqrt(d)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--calls", type=int, default=50)
    opts = ap.parse_args()
    graph = build(np.random.default_rng(0))
    for threads in opts.threads:
        backend = gg.CpuBackend(threads)
        gg.compute(graph, backend)  # plan, allocate, compile or load the kernel
        best = math.inf
        for _ in range(20):
            t0 = time.perf_counter()
            for _ in range(opts.calls):
                backend.compute(graph)
            best = min(best, (time.perf_counter() - t0) / opts.calls)
        print(f"-t {threads}: {best * 1e6:.0f} us per call")


if __name__ == "__main__":
    main()
