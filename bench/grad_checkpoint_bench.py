"""Gradient checkpointing: peak RSS, planned memory and training speed with and without
`--grad-checkpoint`, side by side (runs alternate, each in a fresh process).

Two runs of llamapy-finetune at -c 1024: LoRA on the README's main-job model (gemma-3-270m
Q4_K_M, its demo text) and a full finetune of stories260K (the first 60,000 characters of
the TinyStories sample). `--root DIR` runs another checkout's apps (say, main's worktree,
which may not know the flag: its runs are then without it only).

    python bench/grad_checkpoint_bench.py [--repeat 2] [--threads 1] [--only gemma|stories]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("LLAMAPY_SHARED", ROOT.parent / "shared"))


def peak_rss_mb(cmd: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    """Run cmd in a child and return its result and the child's peak RSS in MB."""
    wrapper = ("import resource, subprocess, sys;"
               "r = subprocess.run(sys.argv[1:], capture_output=True, text=True);"
               "sys.stdout.write(r.stdout); sys.stderr.write(r.stderr);"
               "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr);"
               "sys.exit(r.returncode)")
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    r = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, cwd=cwd, env=env)
    kb = int(re.search(r"PEAK_RSS_KB (\d+)", r.stderr).group(1))
    return r, kb / 1024


def configs(tmp: Path) -> dict[str, list[str]]:
    stories_text = tmp / "stories60k.txt"
    stories_text.write_text((SHARED / "data" / "tinystories_sample.txt").read_text()[:60_000])
    return {
        "gemma": ["--epochs", "1", "-c", "1024"],  # the main job (default model, demo text, LoRA) at -c 1024
        "stories": ["-m", str(SHARED / "models" / "stories260K.gguf"), "-f", str(stories_text), "--epochs", "1",
                    "-c", "1024"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=2, help="alternations of without/with")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", choices=["gemma", "stories"])
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout whose apps run")
    ap.add_argument("--without-only", action="store_true", help="skip the --grad-checkpoint runs")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in configs(Path(tmp)).items():
            if args.only and name != args.only:
                continue
            for rep in range(args.repeat):
                for extra in ([], ["--grad-checkpoint"]):
                    if extra and args.without_only:
                        continue
                    cmd = [sys.executable, "-m", "apps.finetune", *flags, "-t", str(args.threads),
                           "-o", str(Path(tmp) / "out.gguf"), "--lora-out", str(Path(tmp) / "lora.gguf"), *extra]
                    r, rss = peak_rss_mb(cmd, args.root)
                    if r.returncode:
                        sys.exit(r.stderr)
                    tps = re.search(r"training: (\d+) tokens/s", r.stderr).group(1)
                    planned = re.search(r"graph arenas ([\d.,]+ [MG]B).*; ([\d.,]+ [MG]B) in all", r.stderr)
                    loss = re.findall(r"val: .*?loss=([\d.]+)", r.stderr)
                    print(f"{name:8s} {'--grad-checkpoint' if extra else 'plain':17s} run {rep + 1}: "
                          f"{tps:>6s} training tokens/s, peak RSS {rss:6.0f} MB, planned arenas {planned.group(1)} "
                          f"({planned.group(2)} in all), val loss {loss[-1] if loss else '-'}", flush=True)


if __name__ == "__main__":
    main()
