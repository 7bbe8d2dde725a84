"""Where a generated token's time goes: greedy generation as llamapy-cli does it (-c 4096,
warmup, the prompt, then one token per decode), timed per part, in process.

    python bench/decode_step.py [--model PATH] [-t 1 2] [-n 127] [--rounds 7] [--ops]

For each thread count, the best and median over `rounds` generations of n tokens (each
after the same prompt, in a context warmed up once) of, per token:
  decode     Context.decode of the one-token batch (what llama_perf's "eval time" counts)
  graph      the backend running the graph's prepared steps (kernels and their calls)
  around     decode minus graph: batch checks, ubatch split, KV slot search and placing,
             the span, graph lookup, inputs and mask, outputs
  sample     the sampler chain (greedy) on the logits
  batch      Batch.from_tokens (the CLI makes one per token, inside its eval timer)
With --ops, the graph's time per op type (the backend's profile; its timer adds ~0.1 us
per step). Runs on any checkout with this API: point PYTHONPATH at it to compare.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

from llamapy import Batch, Context, load_model
from llamapy.sampling import default_chain

SHARED = Path(os.environ.get("LLAMAPY_SHARED", Path(__file__).resolve().parents[1].parent / "shared"))
PROMPT = "Once upon a time"


def generation(model, threads: int, n: int, rounds: int, ops: bool, prompt_tokens: int = 0
               ) -> tuple[dict[str, list[float]], dict]:
    ctx = Context(model, n_ctx=4096, n_threads=threads)
    ctx.set_warmup(True)
    graph_time = [0.0]
    run = ctx.backend._run

    def timed_run(plan):
        t0 = time.perf_counter()
        run(plan)
        graph_time[0] += time.perf_counter() - t0
    ctx.backend._run = timed_run
    prompt = model.vocab.tokenize(PROMPT, add_special=True)
    if prompt_tokens:
        text = (SHARED / "data" / "wiki.test.raw").read_text(encoding="utf-8")[:8 * prompt_tokens]
        prompt = model.vocab.tokenize(text, add_special=True)[:prompt_tokens]
    parts: dict[str, list[float]] = {k: [] for k in ("decode", "graph", "around", "sample", "batch")}
    for _ in range(rounds):
        ctx.memory_clear()
        chain = default_chain(model.vocab.n_tokens, temp=0.0)
        ctx.decode(Batch.from_tokens(prompt))
        graph_time[0] = 0.0
        t_dec = t_sample = t_batch = 0.0
        for i in range(n):
            t0 = time.perf_counter()
            token = chain.sample(ctx, -1)
            t1 = time.perf_counter()
            batch = Batch.from_tokens([token], pos0=len(prompt) + i)
            t2 = time.perf_counter()
            ctx.decode(batch)
            t3 = time.perf_counter()
            t_sample += t1 - t0
            t_batch += t2 - t1
            t_dec += t3 - t2
        for k, v in (("decode", t_dec), ("graph", graph_time[0]), ("around", t_dec - graph_time[0]),
                     ("sample", t_sample), ("batch", t_batch)):
            parts[k].append(v / n * 1e6)
    profile = {}
    if ops:
        prof = ctx.backend.enable_profile()
        ctx.memory_clear()
        ctx.decode(Batch.from_tokens(prompt))
        prof.clear()
        for i in range(n):
            ctx.decode(Batch.from_tokens([1], pos0=len(prompt) + i))
        profile = {k: v / n * 1e6 for k, v in prof.items()}
        ctx.backend.profile = None
    return parts, profile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(SHARED / "models" / "stories260K.gguf"))
    ap.add_argument("-t", "--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("-n", type=int, default=127)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ops", action="store_true")
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="a prompt of this many tokens of wiki.test.raw instead of the short one (a longer context)")
    args = ap.parse_args()
    model = load_model(args.model)
    print(f"# {Path(args.model).name}, {platform.machine()} / Python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, load average {os.getloadavg()[0]:.2f}; us per generated token")
    for t in args.threads:
        parts, profile = generation(model, t, args.n, args.rounds, args.ops, args.prompt_tokens)
        d = parts["decode"]
        print(f"-t {t}: decode best {min(d):.1f} median {statistics.median(d):.1f} "
              f"({1e6 / min(d):,.0f} / {1e6 / statistics.median(d):,.0f} tokens/s)")
        for k in ("graph", "around", "sample", "batch"):
            print(f"  {k:7s} median {statistics.median(parts[k]):6.1f}")
        for op, us in sorted(profile.items(), key=lambda kv: -kv[1]):
            print(f"  op {op:16s} {us:6.1f}")


if __name__ == "__main__":
    main()
