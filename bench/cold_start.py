"""The first run after installing (an empty numba cache), with and without compile-ahead
(ggmlpy/backend/cpu/plan/compile_ahead.py), alternated so that the host's drift hits both alike.

    python bench/cold_start.py [--repeat 2] [--threads 2] [--only ppl,lora]

  ppl   llamapy-perplexity on stories260K, 16 chunks of -c 128: wall seconds of the command
        (issue 16's bound: 8 s)
  lora  the README main job's shape (LoRA rank 8 on Gemma 3 270M Q4_K_M, 3,000 characters of
        the Python docs, 1 epoch): seconds from the model loaded to the first optimizer step
        done, as llamapy-finetune prints it (the bound: 10 s); and the whole command
Each run gets a fresh NUMBA_CACHE_DIR. Prints every run, then the median of each side.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("LLAMAPY_SHARED", REPO.parent / "shared"))


def commands(threads: int) -> dict[str, list[str]]:
    py = sys.executable
    return {
        "ppl": [py, "-m", "llamapy.cli.perplexity", "-m", str(SHARED / "models/stories260K.gguf"),
                "-f", str(SHARED / "data/wiki.test.raw"), "-c", "128", "--chunks", "16", "-t", str(threads)],
        "lora": [py, "-m", "llamapy.cli.finetune", "--demo-chars", "3000", "--epochs", "1", "-t", str(threads),
                 "--lora-out", "{tmp}/adapter.gguf"],
    }


def run(cmd: list[str], ahead: bool) -> tuple[float, float | None]:
    """Wall seconds of the command and, for a finetune, its printed start-up seconds."""
    with tempfile.TemporaryDirectory(prefix="cold-") as tmp:
        env = {**os.environ, "NUMBA_CACHE_DIR": tmp, "GGMLPY_COMPILE_AHEAD": "1" if ahead else "0",
               "PYTHONPATH": str(REPO)}
        t0 = time.perf_counter()
        done = subprocess.run([c.format(tmp=tmp) for c in cmd], cwd=tmp, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-2000:]}")
    m = re.search(r"after the first window's ([\d.]+) s", done.stderr)
    return wall, float(m.group(1)) if m else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", "-t", type=int, default=2)
    ap.add_argument("--only", default="ppl,lora")
    args = ap.parse_args()
    cmds = commands(args.threads)
    results: dict[tuple[str, bool], list[tuple[float, float | None]]] = {}
    for r in range(args.repeat):
        for name in args.only.split(","):
            for ahead in ((True, False) if r % 2 == 0 else (False, True)):
                wall, first = run(cmds[name], ahead)
                results.setdefault((name, ahead), []).append((wall, first))
                extra = f", first window {first:.1f} s" if first is not None else ""
                print(f"{name:4s} compile-ahead {'on ' if ahead else 'off'}: {wall:6.1f} s{extra}  "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
    for name in args.only.split(","):
        on, off = results[(name, True)], results[(name, False)]
        for i, what in enumerate(("whole command", "first window")):
            a = [x[i] for x in on if x[i] is not None]
            b = [x[i] for x in off if x[i] is not None]
            if a and b:
                ma, mb = statistics.median(a), statistics.median(b)
                print(f"{name} {what}: on {ma:.1f} s, off {mb:.1f} s, on/off {ma / mb:.2f}")


if __name__ == "__main__":
    main()
