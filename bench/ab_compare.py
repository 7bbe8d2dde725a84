"""This checkout against another (an earlier commit in a git worktree), side by side: the
same commands alternated A, B, A, B, ... so that the host's drift hits both alike.

    git worktree add /tmp/base <commit>
    python bench/ab_compare.py --base /tmp/base [--repeat 3] [--threads 2] [--only ppl,ft,lora]

Measures, each in a fresh process (peak RSS is that run's):
  ppl   llamapy-perplexity on stories260K, whole wiki.test.raw, -c 128: tokens/s (its own line)
  ft    llamapy-finetune on stories260K, 51 KB of TinyStories, AdamW -c 128 -b 128 -ub 128,
        1 epoch: training tokens/s (after the first window) and peak RSS
  lora  llamapy-finetune's main job (LoRA rank 8 on Gemma 3 270M Q4_K_M, the Python docs)
        on its first 4,000 characters, 1 epoch: training tokens/s and peak RSS
  main  the README's main job as it is (`llamapy-finetune`: 16,000 characters, 2 epochs):
        training tokens/s and peak RSS
  gen   batch-1 generation in process on stories260K (llama-bench's tg32: 32 single-token
        decodes into an empty context, best of 5 after a warm-up): tokens/s
  save  save_model_to_file of Gemma 3 270M Q4_K_M as loaded (the whole file, its 262,144-token
        vocabulary included), best of 3: MB/s written
Prints every run and, per measure, the median of each side and their ratio.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

from peak_rss import peak_rss_mb  # bench/, beside this script

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("LLAMAPY_SHARED", ROOT.parent / "shared"))
STORIES = SHARED / "models" / "stories260K.gguf"


GEN = """
import sys, time
import numpy as np
from llamapy import Batch, Context, load_model
model = load_model(sys.argv[1])
ctx = Context(model, n_ctx=256, n_threads=int(sys.argv[2]))
rng = np.random.default_rng(0)
best = 0.0
for _ in range(6):
    ctx.memory_clear()
    t0 = time.perf_counter()
    for i, t in enumerate(rng.integers(0, model.hparams.n_vocab, 32)):
        ctx.decode(Batch.from_tokens([int(t)], pos0=i))
    best = max(best, 32 / (time.perf_counter() - t0))
print(f"tg32 = {best:.1f} tokens/s", file=sys.stderr)
"""


SAVE = """
import os, sys, time
from llamapy import load_model, save_model_to_file
from llamapy.defaults import default_model_path
model = load_model(default_model_path())
out = os.path.join(sys.argv[1], "saved.gguf")
times = []
for _ in range(3):
    t0 = time.perf_counter()
    save_model_to_file(model, out)
    times.append(time.perf_counter() - t0)
best = min(times)
print(f"save = {os.path.getsize(out) / 1e6 / best:.1f} MB/s ({best:.2f} s)", file=sys.stderr)
"""


def run(checkout: Path, argv: list[str]) -> tuple[str, float]:
    """Run `python argv` from `checkout`; its stderr and peak RSS in MB. A tool's module is
    named as that checkout names it (before 2026-11-27 the tools were `apps.<tool>`)."""
    if argv[0] == "-m" and argv[1].startswith("llamapy.cli.") and (checkout / "apps").is_dir():
        argv = ["-m", "apps." + argv[1].removeprefix("llamapy.cli.").replace("completion", "cli"), *argv[2:]]
    r, mb = peak_rss_mb([sys.executable, *argv], checkout)
    if r.returncode:
        raise SystemExit(f"{checkout}: {argv[:2]} failed:\n{r.stderr[-3000:]}")
    return r.stderr, mb


def measures(tmp: Path, threads: int) -> dict[str, tuple[list[str], str]]:
    """name -> (python's arguments, regex of the figure in stderr: tokens/s, or MB/s for save)."""
    text = tmp / "stories51k.txt"
    text.write_text((SHARED / "data" / "tinystories_sample.txt").read_text()[:51_000])
    t = ["-t", str(threads)]
    return {
        "ppl": (["-m", "llamapy.cli.perplexity", "-m", str(STORIES), "-f", str(SHARED / "data" / "wiki.test.raw"),
                 "-c", "128", *t], r"= ([0-9.]+) tokens/s"),
        "ft": (["-m", "llamapy.cli.finetune", "-m", str(STORIES), "-f", str(text), "--epochs", "1", "-c", "128", "-b", "128",
                "-ub", "128", "-o", str(tmp / "ft.gguf"), *t], r"training: (\d+) tokens/s"),
        "lora": (["-m", "llamapy.cli.finetune", "--demo-chars", "4000", "--epochs", "1", "--lora-out", str(tmp / "ad.gguf"), *t],
                 r"training: (\d+) tokens/s"),
        "main": (["-m", "llamapy.cli.finetune", "--lora-out", str(tmp / "main.gguf"), *t], r"training: (\d+) tokens/s"),
        "gen": (["-c", GEN, str(STORIES), str(threads)], r"tg32 = ([0-9.]+) tokens/s"),
        "save": (["-c", SAVE, str(tmp)], r"save = ([0-9.]+) MB/s"),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", type=Path, required=True, help="the other checkout (B)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="ppl,ft,lora,gen")
    ap.add_argument("--no-warmup", action="store_true", help="the numba caches of both sides are warm already")
    args = ap.parse_args()
    sides = {"A (this)": ROOT, "B (base)": args.base.resolve()}
    with tempfile.TemporaryDirectory() as tmp:
        table = measures(Path(tmp), args.threads)
        for name in args.only.split(","):
            cmd, pattern = table[name]
            unit = pattern.rsplit(" ", 1)[1]  # what the figure counts: tokens/s, MB/s
            for checkout in sides.values() if not args.no_warmup else ():  # warm both sides' numba caches
                run(checkout, cmd)
            got: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
            for i in range(args.repeat):
                for side, checkout in sides.items():
                    err, rss = run(checkout, cmd)
                    tps = float(re.search(pattern, err).group(1))
                    got[side].append((tps, rss))
                    print(f"{name} run {i + 1} {side}: {tps:,.1f} {unit}, peak RSS {rss:,.0f} MB", flush=True)
            med = {side: (statistics.median(x for x, _ in v), statistics.median(r for _, r in v)) for side, v in got.items()}
            (a_tps, a_rss), (b_tps, b_rss) = med.values()
            print(f"{name}: median A {a_tps:,.1f} {unit} {a_rss:,.0f} MB | B {b_tps:,.1f} {unit} {b_rss:,.0f} MB | "
                  f"A/B speed {a_tps / b_tps:.3f}, memory {a_rss / b_rss:.3f}", flush=True)


if __name__ == "__main__":
    main()
