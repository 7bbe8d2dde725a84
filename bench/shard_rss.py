"""Training memory against corpus size with token shards (issue 35, acceptance 3): a 2 MB and
a 2 GB text (TinyStories repeated) tokenized by llamapy-tokenize, then llamapy-finetune
--data on each for the same time; the peak RSS of each command side by
side (and -f on the 2 MB text, the in-memory path, for reference).

    python bench/shard_rss.py [--big-mb 2048] [--seconds 40] [--dir /tmp/shard-rss]

The texts and shards go to --dir (about 3 GB for the 2 GB text) and are kept for a rerun.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from peak_rss import peak_rss_mb  # bench/, beside this script

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
MODEL = SHARED / "models" / "stories260K.gguf"


def make_text(path: Path, megabytes: float) -> None:
    if path.exists() and path.stat().st_size >= megabytes * 2**20 * 0.99:
        return
    source = (SHARED / "data" / "tinystories_sample.txt").read_bytes()
    left = int(megabytes * 2**20)
    with open(path, "wb") as out:
        while left > 0:
            out.write(source[:left])
            left -= len(source[:left])


def run_measured(cmd: list[str], stop_after: float | None = None) -> tuple[str, float, float]:
    """stderr, peak RSS in MB (the largest process of the command) and wall seconds; with
    `stop_after`, killed after that many seconds (its peak RSS is the kernel's record)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO)
    if stop_after is not None:
        try:
            proc.wait(stop_after)
        except subprocess.TimeoutExpired:
            proc.kill()
    stderr = proc.stderr.read()
    _, _, usage = os.wait4(proc.pid, 0)
    proc.returncode = 0
    return stderr, usage.ru_maxrss / 1024, time.perf_counter() - t0


def children_peak(cmd: list[str]) -> tuple[str, float, float]:
    """Like run_measured, for a command whose work is in child processes (the tokenizers):
    peak_rss.peak_rss_mb's wrapper, timed."""
    t = time.perf_counter()
    r, rss = peak_rss_mb(cmd, REPO)
    return r.stderr, rss, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--big-mb", type=float, default=2048)
    ap.add_argument("--small-mb", type=float, default=2)
    ap.add_argument("--seconds", type=float, default=40, help="training time of each run before Ctrl-C")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/shard-rss"))
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    rows = []
    for name, mb in (("small", args.small_mb), ("big", args.big_mb)):
        text, shards = args.dir / f"{name}.txt", args.dir / f"{name}-shards"
        make_text(text, mb)
        if not shards.exists():
            err, rss, seconds = children_peak([py, "-m", "llamapy.cli.tokenize", "-m", str(MODEL), str(text),
                                               "-o", str(shards), "-t", "2"])
            last = [ln for ln in err.splitlines() if "tokens (" in ln]
            print(f"tokenize {name}: {seconds:.1f} s, peak RSS {rss:.0f} MB; {last[-1] if last else err[-300:]}")
            rows.append((f"llamapy-tokenize, {mb:g} MB text", rss, seconds))
    finetune = [py, "-m", "llamapy.cli.finetune", "-m", str(MODEL), "-c", str(args.ctx), "-t", "2", "--seed", "1",
                "--shuffle", "-o", str(args.dir / "out.gguf")]
    runs = [("-f, 2 MB text (in memory)", ["-f", str(args.dir / "small.txt")]),
            (f"--data, {args.small_mb:g} MB text's shards", ["--data", str(args.dir / "small-shards")]),
            (f"--data, {args.big_mb:g} MB text's shards", ["--data", str(args.dir / "big-shards")])]
    for rounds in range(2):  # alternated: the machine's state moves
        for label, data in runs:
            err, rss, seconds = run_measured(finetune + data, stop_after=args.seconds)
            windows = re.findall(r"data=(\d+)/(\d+)", err)
            done = f"{windows[-1][0]}/{windows[-1][1]} windows" if windows else "?"
            print(f"round {rounds + 1}: {label}: peak RSS {rss:.0f} MB, {seconds:.0f} s, {done}")
            rows.append((f"finetune {label} (round {rounds + 1})", rss, seconds))
    print("\n| command | peak RSS MB | seconds |\n|---|---:|---:|")
    for label, rss, seconds in rows:
        print(f"| {label} | {rss:.0f} | {seconds:.0f} |")


if __name__ == "__main__":
    main()
