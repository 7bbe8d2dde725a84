"""Finetune speed and peak memory on stories260K, the setting of llama.cpp's golden figures.

Runs `llamapy-finetune` in a fresh process per configuration (so peak RSS is that run's)
on the first 51 KB of the TinyStories sample, and reports training tokens/s (from the
tool's own summary line: forward + backward + optimizer step after the first window, whose
graph building and kernel loading are start-up) and
peak RSS, next to the Python interpreter's baseline RSS with llamapy imported.

    python bench/finetune_bench.py [--threads 2] [--epochs 1]
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
CONFIGS = [  # (label, extra flags)
    ("adamw -c 128 -b 128 -ub 128", ["-c", "128", "-b", "128", "-ub", "128"]),
    ("sgd   -c 128 -b 128 -ub 128", ["-c", "128", "-b", "128", "-ub", "128", "-opt", "sgd", "-lr", "1e-3"]),
    ("adamw -c 256 -b 256 -ub 128", ["-c", "256", "-b", "256", "-ub", "128"]),
]


def peak_rss_mb(cmd: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    """Run cmd in a child and return its result and the child's peak RSS in MB."""
    wrapper = ("import resource, subprocess, sys;"
               "r = subprocess.run(sys.argv[1:], capture_output=True, text=True);"
               "sys.stdout.write(r.stdout); sys.stderr.write(r.stderr);"
               "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr);"
               "sys.exit(r.returncode)")
    r = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, cwd=ROOT)
    kb = int(re.search(r"PEAK_RSS_KB (\d+)", r.stderr).group(1))
    return r, kb / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=2, help="runs per configuration; the best is kept")
    args = ap.parse_args()
    text = (SHARED / "data" / "tinystories_sample.txt").read_text()[:51_000]
    with tempfile.TemporaryDirectory() as tmp:
        text_path = Path(tmp) / "stories51k.txt"
        text_path.write_text(text)
        _, base_mb = peak_rss_mb([sys.executable, "-c", "import llamapy, ggmlpy.backend.cpu"])
        print(f"python + llamapy imported: {base_mb:.0f} MB peak RSS")
        one_kernel = ("import numpy as np, llamapy; from ggmlpy.backend.cpu import kernels as K;"
                      "x = np.ones((1, 1, 1, 8), np.float32); K.rms_norm_f32(x, x.copy(), 1e-5)")
        _, runtime_mb = peak_rss_mb([sys.executable, "-c", one_kernel])
        print(f"... and numba's runtime loaded (one cached kernel run): {runtime_mb:.0f} MB peak RSS")
        for label, flags in CONFIGS:
            best = None
            for _ in range(args.repeat):
                cmd = [sys.executable, "-m", "llamapy.cli.finetune", "-m", str(SHARED / "models" / "stories260K.gguf"),
                       "-f", str(text_path), "--epochs", str(args.epochs), "-t", str(args.threads),
                       "-o", str(Path(tmp) / "out.gguf"), *flags]
                r, rss = peak_rss_mb(cmd)
                if r.returncode:
                    sys.exit(r.stderr)
                tps = float(re.search(r"training: (\d+) tokens/s", r.stderr).group(1))
                if best is None or tps > best[0]:
                    best = (tps, rss)
            print(f"{label}  -t {args.threads}: {best[0]:8.0f} training tokens/s, peak RSS {best[1]:.0f} MB")


if __name__ == "__main__":
    main()
