"""Perplexity speed on stories260K, and start-up time with a cold and a warm numba cache;
with --llama-cpp BIN_DIR, llama.cpp's llama-perplexity on the same runs, side by side.

Run by hand (not in CI):  python bench/perplexity_bench.py [--threads 2] [--llama-cpp DIR]
Prints one line per measurement; copy them into bench/RESULTS.md with machine and date.
Whole runs are compared by wall time (both tokenize the text and load the model inside it).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHARED = Path(os.environ.get("LLAMAPY_SHARED", Path(__file__).resolve().parents[2] / "shared"))
MODEL = SHARED / "models" / "stories260K.gguf"
TEXT = SHARED / "data" / "wiki.test.raw"


def run(args: list[str], env: dict[str, str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "llamapy.cli.perplexity", *args], capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(proc.stderr)
    return elapsed, proc.stderr


def run_llama_cpp(binary: Path, args: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run([str(binary), *args], capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(proc.stderr[-2000:])
    return elapsed, re.search(r"Final estimate: PPL = ([0-9.]+)", proc.stderr).group(1)


def tokens_per_s(stderr: str) -> float:
    return float(re.search(r"= ([0-9.]+) tokens/s", stderr).group(1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-cpp", type=Path, help="folder with llama.cpp's llama-perplexity, to run it side by side")
    opts = ap.parse_args()
    base = ["-m", str(MODEL), "-f", str(TEXT), "-t", str(opts.threads)]
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as cache:
        env["NUMBA_CACHE_DIR"] = cache
        cold, _ = run(base + ["-c", "128", "--chunks", "16"], env)
        warm, _ = run(base + ["-c", "128", "--chunks", "16"], env)
        print(f"start-up + 16 chunks at -c 128: cold numba cache {cold:.2f} s, warm {warm:.2f} s")
        for n_ctx in (128, 512):
            elapsed, err = run(base + ["-c", str(n_ctx)], env)
            final = re.search(r"Final estimate: PPL = ([0-9.]+)", err).group(1)
            print(f"-c {n_ctx}: {tokens_per_s(err):,.0f} tokens/s (whole run {elapsed:.1f} s, PPL {final})")
            if opts.llama_cpp:
                # the golden README's command: -b = -c (one chunk per batch)
                theirs, their_ppl = run_llama_cpp(opts.llama_cpp / "llama-perplexity", base + ["-c", str(n_ctx), "-b", str(n_ctx)])
                print(f"-c {n_ctx}: llama.cpp llama-perplexity -b {n_ctx}: whole run {theirs:.1f} s (PPL {their_ppl}); "
                      f"llamapy's whole run takes {elapsed / theirs:.2f}x its time")


if __name__ == "__main__":
    main()
