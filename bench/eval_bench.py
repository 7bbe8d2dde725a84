"""HellaSwag scoring speed on Gemma 3 270M Q4_K_M: whole `llamapy-perplexity --hellaswag`
commands against llama.cpp's `llama-perplexity --hellaswag`, alternated, on a 400-task file
made from TinyStories by tests/eval_tasks.py (llama-perplexity's default --hellaswag-tasks).

Run by hand (not in CI):
    python bench/eval_bench.py --llama-cpp BIN_DIR [--threads 2] [--tasks 400] [--rounds 2]
Prints one line per run and the ratio of the best whole-command times; copy them into
bench/RESULTS.md with machine and date. Both commands load the model, read and tokenize the
tasks inside the time; their per-task lines must be the same (checked here).
"""
from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from eval_tasks import hellaswag_text, stories  # noqa: E402


def timed(cmd: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd[:3])} ...: {proc.stderr[-2000:]}")
    return elapsed, proc.stdout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", type=Path, required=True, help="folder with llama.cpp's llama-perplexity")
    ap.add_argument("--model", type=Path, help="default: Gemma 3 270M Q4_K_M from its package")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tasks", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=2)
    opts = ap.parse_args()
    if opts.model is None:
        from llamapy.defaults import default_model_path
        opts.model = Path(default_model_path(print))
    with tempfile.TemporaryDirectory() as work:
        tasks = Path(work) / "hellaswag.txt"
        tasks.write_text(hellaswag_text(random.Random(4), stories(), opts.tasks))
        args = ["-m", str(opts.model), "-f", str(tasks), "--hellaswag", "--hellaswag-tasks", str(opts.tasks),
                "-t", str(opts.threads)]
        commands = {"llamapy": [sys.executable, "-m", "llamapy.cli.perplexity", *args],
                    "llama.cpp": [str(opts.llama_cpp / "llama-perplexity"), *args]}
        best: dict[str, float] = {}
        outputs: dict[str, str] = {}
        for round_ in range(opts.rounds):
            for name, cmd in commands.items():
                elapsed, out = timed(cmd)
                best[name] = min(best.get(name, elapsed), elapsed)
                outputs[name] = out
                last = out.strip().splitlines()[-1]
                print(f"round {round_ + 1}: {name}: {opts.tasks} HellaSwag tasks in {elapsed:.1f} s "
                      f"({elapsed / opts.tasks * 1000:.0f} ms a task; last line: {last})", flush=True)
        same = outputs["llamapy"] == outputs["llama.cpp"]
        print(f"best: llamapy {best['llamapy']:.1f} s, llama.cpp {best['llama.cpp']:.1f} s: llamapy takes "
              f"{best['llamapy'] / best['llama.cpp']:.2f}x llama.cpp's time; per-task lines "
              f"{'identical' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
