"""Gemma 3 270M Q4_K_M inference speed of this checkout against another (a worktree of main),
side by side: fresh processes alternated A, B, A, B, so that a busy host's drift hits both.

    git worktree add /work/wt-mainref main
    python bench/gemma3_ab.py --base /work/wt-mainref [--repeat 3] [--threads 1]

Each process (PYTHONPATH set to its checkout, warm numba cache) loads the model and, after a
warm-up of each shape, measures
  pp256  one decode of a 256-token prompt (one ubatch; llama-bench's pp256): tokens/s
  tg64   greedy generation: 64 tokens after an 8-token prompt, each the argmax of the last
         logits, one decode per token (llama-completion --temp 0): tokens/s
as the best of 3 rounds. Prints every run and, per measure, each side's median and the
ratio this / base.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("LLAMAPY_SHARED", ROOT.parent / "shared"))

CODE = """
import sys, time
import numpy as np
from llamapy import Batch, Context, load_model
from llamapy.defaults import default_model_path
model = load_model(str(default_model_path()))
threads = int(sys.argv[2])
toks = model.vocab.tokenize(open(sys.argv[1], encoding="utf-8").read()[:20000])[:256]
assert len(toks) == 256
ctx = Context(model, n_ctx=512, n_batch=256, n_ubatch=256, n_threads=threads)

def pp():
    ctx.memory_clear()
    t0 = time.perf_counter()
    ctx.decode(Batch.from_tokens(toks))
    return 256 / (time.perf_counter() - t0)

def tg(n):
    ctx.memory_clear()
    ctx.decode(Batch.from_tokens(toks[:8]))
    t0 = time.perf_counter()
    for i in range(n):
        nxt = int(np.argmax(ctx.get_logits()[-1]))
        ctx.decode(Batch.from_tokens([nxt], pos0=8 + i))
    return n / (time.perf_counter() - t0)

pp(); tg(4)  # warm-up: graphs planned, kernels loaded
print(f"pp256 = {max(pp() for _ in range(3)):.2f} tokens/s")
print(f"tg64 = {max(tg(64) for _ in range(3)):.2f} tokens/s")
"""


def run(checkout: Path, threads: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run([sys.executable, "-c", CODE, str(SHARED / "data" / "wiki.test.raw"), str(threads)],
                         capture_output=True, text=True, env=env, cwd=checkout)
    if out.returncode:
        sys.exit(f"{checkout} failed: {out.stderr[-800:]}")
    return {k: float(v) for k, v in re.findall(r"(\w+) = ([0-9.]+) tokens/s", out.stdout)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, type=Path)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    sides = {"base": args.base.resolve(), "this": ROOT}
    results: dict[str, list[dict[str, float]]] = {k: [] for k in sides}
    for r in range(args.repeat):
        for name, checkout in sides.items():
            got = run(checkout, args.threads)
            results[name].append(got)
            print(f"{name} run {r + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in got.items()), flush=True)
    print("| measure (tokens/s) | base | this | this / base |")
    print("|---|---|---|---|")
    for k in results["this"][0]:
        a = statistics.median(d[k] for d in results["base"])
        b = statistics.median(d[k] for d in results["this"])
        print(f"| {k} | {a:.2f} | {b:.2f} | {b / a:.3f} |")


if __name__ == "__main__":
    main()
