"""Speed on a busy machine: a command's throughput idle and next to CPU-bound processes
(`python -c "while True: pass"`, as another program on a laptop), alternated idle / busy in
one run, each a fresh process; prints the medians and the ratio busy / idle.

    python bench/under_load.py [--hogs 1] [--rounds 3] [--what finetune|generate|both] [-t 2]
                               [--env NAME=VALUE ...]

finetune: stories260K, 24 KB of TinyStories, -c 128 -b 128 -ub 128 (training tokens/s from
the tool's summary line); generate: Gemma 3 270M Q4_K_M greedy, 64 tokens (eval
tokens/s from the llama_perf lines). --env sets variables of the measured command (e.g. a
threading-layer setting) to compare variants side by side.
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

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"


def finetune_cmd(tmp: Path, threads: int) -> tuple[list[str], re.Pattern]:
    text = tmp / "train.txt"
    if not text.exists():
        sample = SHARED / "data" / "tinystories_sample.txt"
        text.write_text(sample.read_text(encoding="utf-8", errors="replace")[:24_000], encoding="utf-8")
    cmd = [sys.executable, "-m", "llamapy", "finetune", "-m", str(SHARED / "models" / "stories260K.gguf"),
           "-f", str(text), "-c", "128", "-b", "128", "-ub", "128", "-t", str(threads), "--epochs", "1",
           "-o", str(tmp / "out.gguf")]
    return cmd, re.compile(r"([\d.]+) tokens/s after the first window")


def generate_cmd(tmp: Path, threads: int) -> tuple[list[str], re.Pattern]:
    from llamapy.defaults import default_model_path
    cmd = [sys.executable, "-m", "llamapy", "cli", "-m", str(default_model_path(print)), "-p", "Once upon a time",
           "-n", "64", "--temp", "0", "-t", str(threads), "-no-cnv"]
    return cmd, re.compile(r"eval time =.*?([\d.]+) tokens per second")


def measure(cmd: list[str], pattern: re.Pattern, env: dict[str, str]) -> float:
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    found = pattern.findall(run.stdout + run.stderr)
    if run.returncode or not found:
        sys.exit(f"{cmd[2:4]} failed ({run.returncode}): {run.stderr[-800:]}")
    return float(found[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hogs", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--what", choices=["finetune", "generate", "both"], default="both")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--env", nargs="*", default=[], help="NAME=VALUE for the measured command")
    args = ap.parse_args()
    bad = [kv for kv in args.env if "=" not in kv or kv.startswith("=")]
    if bad:
        ap.error(f"--env takes NAME=VALUE, not {bad[0]!r}")
    env = dict(os.environ, **dict(kv.split("=", 1) for kv in args.env))
    whats = ["finetune", "generate"] if args.what == "both" else [args.what]
    print(f"{os.cpu_count()} cores, -t {args.threads}, {args.hogs} busy process(es), env {args.env or 'default'}, "
          f"load {os.getloadavg()[0]:.2f}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for what in whats:
            cmd, pattern = (finetune_cmd if what == "finetune" else generate_cmd)(tmp, args.threads)
            measure(cmd, pattern, env)  # warm: page cache, numba's cache
            speeds: dict[str, list[float]] = {"idle": [], "busy": []}
            for r in range(args.rounds):
                for state in (("idle", "busy") if r % 2 == 0 else ("busy", "idle")):
                    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                            for _ in range(args.hogs if state == "busy" else 0)]
                    try:
                        time.sleep(0.2 if hogs else 0)
                        speeds[state].append(measure(cmd, pattern, env))
                    finally:
                        for h in hogs:
                            h.kill()
                            h.wait()
                    print(f"  {what} {state:4} {speeds[state][-1]:9.1f} tokens/s")
            idle, busy = (statistics.median(speeds[s]) for s in ("idle", "busy"))
            print(f"{what}: idle {idle:.1f}, busy {busy:.1f} tokens/s, busy/idle {busy / idle:.2f}x")


if __name__ == "__main__":
    main()
