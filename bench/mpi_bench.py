"""Data-parallel training on one machine: 1 rank x 2 threads against 2 ranks x 1 thread.

    python bench/mpi_bench.py [--repeat 2] [--skip-gemma3]

Both take the same optimizer steps (2 ranks with -b B each equal 1 process with -b 2B: the
same windows, accumulated) through `llamapy-finetune`, alternated A B B A. Reported per
run: training tokens/s (after the first window), and for 2 ranks the time spent summing
the gradients per step (the Allreduce of the flat gradient buffer). Workloads:
- stories260K, full finetune, 40,000 characters of TinyStories, -c 64;
- gemma-3-270m Q4_K_M, LoRA rank 8 (the default seven matrices), 6,000 characters of the
  Python docs, -c 128 (the model from the `models` extra).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("LLAMAPY_SHARED", ROOT.parent / "shared"))


def run(ranks: int, threads: int, args: list[str]) -> dict:
    cmd = [sys.executable, "-m", "llamapy.cli.finetune", *args, "-t", str(threads)]
    if ranks > 1:
        cmd = [shutil.which("mpirun"), "-n", str(ranks), *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if r.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")
    tps = float(re.search(r"training: (\d+) tokens/s", r.stderr).group(1))
    reduce = re.search(r"summing the gradients took ([0-9.]+) ms per step \(([0-9.]+) MB", r.stderr)
    return {"tokens_per_s": tps, "reduce_ms": float(reduce.group(1)) if reduce else None,
            "grad_mb": float(reduce.group(2)) if reduce else None}


def workloads(tmp: Path, skip_gemma3: bool) -> list[tuple[str, list[str], int]]:
    stories = tmp / "stories.txt"
    stories.write_text((SHARED / "data" / "tinystories_sample.txt").read_text(encoding="utf-8")[:40_000])
    out = [("stories260K full finetune, -c 64", ["-m", str(SHARED / "models" / "stories260K.gguf"), "-f", str(stories),
            "-c", "64", "--epochs", "1", "-o", str(tmp / "out.gguf"), "--seed", "1"], 64)]
    if not skip_gemma3:
        import pydoc_data.topics as topics
        docs = tmp / "docs.txt"
        docs.write_text("\n\n".join(topics.topics.values())[:6_000])
        out.append(("gemma-3-270m Q4_K_M LoRA rank 8, -c 128", ["-f", str(docs), "-c", "128", "--epochs", "1",
                    "--lora-out", str(tmp / "ad.gguf"), "--seed", "1"], 128))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--skip-gemma3", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        for name, args, ctx in workloads(Path(d), a.skip_gemma3):
            one = ["-b", str(2 * ctx)]
            two = ["-b", str(ctx)]
            rows = []
            for i in range(a.repeat):
                order = [("1x2", 1, 2, one), ("2x1", 2, 1, two)]
                for label, ranks, threads, b in (order if i % 2 == 0 else order[::-1]):
                    res = run(ranks, threads, args + b)
                    rows.append((label, res))
                    extra = f", gradients summed in {res['reduce_ms']:.2f} ms per step ({res['grad_mb']:.2f} MB)" \
                        if res["reduce_ms"] is not None else ""
                    print(f"{name}: {label} (ranks x threads): {res['tokens_per_s']:.0f} tokens/s{extra}", flush=True)
            best = {k: max(r["tokens_per_s"] for lab, r in rows if lab == k) for k in ("1x2", "2x1")}
            print(f"{name}: best 2 ranks x 1 thread / 1 rank x 2 threads = {best['2x1'] / best['1x2']:.2f}x "
                  f"({datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores)\n", flush=True)


if __name__ == "__main__":
    main()
