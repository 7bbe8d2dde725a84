"""numba's public set_num_threads against the private setter it ends in, as the executor
uses them (bench/RESULTS.md has the figures and the decision).

    python bench/thread_setter_bench.py [--rounds 5]

Prints the cost of one call of each and llama-bench's tg32 on stories260K (32 single-token
decodes, best of `rounds`) with each setter, alternated in one process.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numba
import numpy as np

import ggmlpy.backend.cpu as cpu
from llamapy import Batch, Context, load_model

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


def per_call(setter, n: int = 200_000) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        setter(1 + (i & 1))
    return (time.perf_counter() - t0) / n


def tg32(ctx, n_vocab: int, rounds: int) -> float:
    rng = np.random.default_rng(0)
    best = 0.0
    for _ in range(rounds):
        ctx.memory_clear()
        t0 = time.perf_counter()
        for i, t in enumerate(rng.integers(0, n_vocab, 32)):
            ctx.decode(Batch.from_tokens([int(t)], pos0=i))
        best = max(best, 32 / (time.perf_counter() - t0))
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(SHARED / "models" / "stories260K.gguf"))
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    setters = {"private": cpu._thread_setter(), "public": numba.set_num_threads}
    for name, setter in setters.items():
        print(f"{name}: {per_call(setter) * 1e6:.2f} us a call")
    model = load_model(args.model)
    ctx = Context(model, n_ctx=256, n_threads=numba.config.NUMBA_NUM_THREADS)
    tg32(ctx, model.hparams.n_vocab, 1)  # warm-up: kernels compiled, graphs planned
    got = {name: [] for name in setters}
    for _ in range(3):
        for name, setter in setters.items():
            cpu._set_threads = setter
            got[name].append(tg32(ctx, model.hparams.n_vocab, args.rounds))
    for name, v in got.items():
        print(f"tg32 with the {name} setter: {max(v):,.0f} tokens/s (runs {', '.join(f'{x:,.0f}' for x in v)})")
    print(f"private/public: {max(got['private']) / max(got['public']):.3f}")


if __name__ == "__main__":
    main()
