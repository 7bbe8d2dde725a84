"""What training adds to memory over the floor of a Python process running numba kernels
(issue 16: no more than llama.cpp's whole 36 MB on stories260K).

    python bench/rss_floor.py [--repeat 3] [--threads 2]

  floor  python, numpy and numba imported, then one cached njit kernel and one parallel
         kernel loaded: numba's JIT, its runtime and its thread pool, with none of ours
  ft     llamapy-finetune on stories260K, full finetune, AdamW, -c 128 -b 128 -ub 128,
         1 epoch over 51 KB of TinyStories (warm numba cache): peak RSS and training tokens/s
Each in a fresh process, alternated; prints every run and the medians.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from peak_rss import peak_rss_mb  # bench/, beside this script

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("LLAMAPY_SHARED", REPO.parent / "shared"))

FLOOR = """
import numba, numpy as np
@numba.njit(cache=True)
def total(x):
    return x.sum()
@numba.njit(cache=True, parallel=True)
def total_parallel(x):
    s = 0.0
    for i in numba.prange(x.shape[0]):
        s += x[i]
    return s
total(np.ones(4)); total_parallel(np.ones(4))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", "-t", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="rss-floor-") as tmp:
        text = Path(tmp) / "tinystories-51k.txt"
        text.write_bytes((SHARED / "data/tinystories_sample.txt").read_bytes()[:51_000])
        floor_py = Path(tmp) / "floor.py"  # a file, so that numba can cache its kernels
        floor_py.write_text(FLOOR)
        ft = [sys.executable, "-m", "llamapy.cli.finetune", "-m", str(SHARED / "models/stories260K.gguf"), "-f", str(text),
              "--epochs", "1", "-c", "128", "-b", "128", "-ub", "128", "-t", str(args.threads),
              "-o", str(Path(tmp) / "out.gguf")]
        subprocess.run([sys.executable, str(floor_py)], check=True, cwd=tmp)  # warm both numba caches
        subprocess.run(ft, check=True, cwd=REPO, capture_output=True)
        floors, peaks, speeds = [], [], []
        for r in range(args.repeat):
            _, floor = peak_rss_mb([sys.executable, str(floor_py)], Path(tmp))
            run, peak = peak_rss_mb(ft, REPO)
            m = re.search(r"training: (\d+) tokens/s", run.stderr)
            floors.append(floor)
            peaks.append(peak)
            speeds.append(int(m.group(1)) if m else float("nan"))
            print(f"round {r + 1}: floor {floor:.1f} MB, finetune peak {peak:.1f} MB (+{peak - floor:.1f}), "
                  f"{speeds[-1]} tokens/s (load {os.getloadavg()[0]:.1f})", flush=True)
    f, p = statistics.median(floors), statistics.median(peaks)
    print(f"median: floor {f:.1f} MB, finetune peak {p:.1f} MB, training adds {p - f:.1f} MB; "
          f"{statistics.median(speeds):.0f} tokens/s")


if __name__ == "__main__":
    main()
