"""Batch-1 generation speed: llama-bench's tg test (one token per decode, no sampling) and
generation with a sampler chain on the CPU and in the graph (-bs).

    python bench/generate_bench.py [--model PATH] [--threads 1 2] [--n 32] [--rounds 5]

Each figure is the best of `rounds` runs after a warmup (graphs planned, kernels compiled),
in tokens per second. Compare with llama.cpp's `llama-bench -t T -n 32` measured side by
side on the same machine (the golden README quotes tg32 11,000 t/s at -t 2).
"""
from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import numpy as np

from llamapy import Batch, Context, load_model
from llamapy.generate import Generator

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


def tg(model, threads: int, n: int, rounds: int) -> float:
    """llama-bench's tg<n>: n single-token decodes into an empty context (random tokens)."""
    ctx = Context(model, n_ctx=max(256, n + 8), n_threads=threads)
    ctx.set_warmup(True)
    rng = np.random.default_rng(0)
    best = 0.0
    for _ in range(rounds):
        ctx.memory_clear()
        toks = rng.integers(0, model.hparams.n_vocab, n)
        t0 = time.perf_counter()
        for i, t in enumerate(toks):
            ctx.decode(Batch.from_tokens([int(t)], pos0=i))
        best = max(best, n / (time.perf_counter() - t0))
    return best


def generate(model, threads: int, n: int, rounds: int, backend: bool) -> float:
    """Prompt, then n tokens sampled (default chain, seed 1) by llamapy's generation loop
    (llamapy.generate.Generator: each decoded before the next is sampled)."""
    best = 0.0
    for _ in range(rounds + 1):  # the first round warms up
        gen = Generator(Context(model, n_ctx=max(256, n + 64), n_threads=threads), seed=1, backend_sampling=backend)
        gen.feed(gen.tokenize("Once upon a time"))
        t0 = time.perf_counter()
        for _piece in gen.stream(n):
            pass
        rate = len(gen.tokens) / (time.perf_counter() - t0)
        best = max(best, rate) if _ else best
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(SHARED / "models" / "stories260K.gguf"))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    model = load_model(args.model)
    print(f"# {Path(args.model).name} on {platform.machine()} / {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    print("| threads | tg%d (t/s) | generate, CPU chain (t/s) | generate, chain in graph -bs (t/s) |" % args.n)
    print("|---|---|---|---|")
    for t in args.threads:
        a = tg(model, t, args.n, args.rounds)
        b = generate(model, t, args.n, args.rounds, False)
        c = generate(model, t, args.n, args.rounds, True)
        print(f"| {t} | {a:,.0f} | {b:,.0f} | {c:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
