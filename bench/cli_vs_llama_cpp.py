"""Generation and prompt processing of llamapy-cli against llama.cpp's llama-completion, side
by side: the same model, prompt and flags, the two commands alternated A B A B.

    python bench/cli_vs_llama_cpp.py --llama-cpp BUILD/bin [--model PATH] [-p PROMPT] [-n 128] [-t 2] [--repeat 3]
                                     [--base CHECKOUT] [--warmup]

Each run is a fresh process (model load and, for llamapy, numba's warm cache included in the
wall time); its own perf lines give prompt and generation speed (llama_perf_context_print's
"prompt eval time" and "eval time"). Prints every run, then the medians and llamapy / llama.cpp.
llama-completion runs with --no-warmup unless --warmup (llama-completion's default, as
llamapy-cli, which always warms up). --base adds a third side, llamapy-cli of another
checkout (e.g. main in a git worktree), alternated with the other two. The load average is
printed before each round.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from llamapy.defaults import default_model_path

PROMPT = "The history of the printing press begins"
_PERF = re.compile(r"(prompt eval|eval) time =\s*([0-9.]+) ms /\s*(\d+) (?:tokens|runs)")


def run(cmd: list[str], env: dict | None = None, cwd: str | None = None) -> dict[str, float]:
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=env, cwd=cwd)
    wall = time.perf_counter() - t0
    if out.returncode:
        sys.exit(f"{cmd[0]} failed: {out.stderr[-500:]}")
    got = {"wall s": wall}
    for kind, ms, n in _PERF.findall(out.stdout + out.stderr):
        got[f"{kind} t/s"] = int(n) / (float(ms) / 1e3) if float(ms) else float("nan")
    if len(got) == 1:
        print(f"  (no perf lines from {cmd[0]}; stderr ends: {out.stderr[-300:]!r})", flush=True)
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", required=True, help="directory with llama-completion")
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("-p", "--prompt", default=PROMPT)
    ap.add_argument("--base", help="another llamapy checkout, run as a third side")
    ap.add_argument("--warmup", action="store_true", help="let llama-completion warm up (its default)")
    args = ap.parse_args()
    common = ["-m", os.path.abspath(args.model), "-p", args.prompt, "-n", str(args.n), "--temp", "0", "-t", str(args.t)]
    sides = {
        "llama.cpp": [f"{args.llama_cpp}/llama-completion", *common, "-no-cnv", *([] if args.warmup else ["--no-warmup"])],
        "llamapy": [sys.executable, "-m", "llamapy.cli.completion", *common],
    }
    # `python -m` imports from its working directory first: each checkout runs in its own
    here = str(Path(__file__).resolve().parents[1])
    envs = {"llama.cpp": None, "llamapy": {**os.environ, "PYTHONPATH": here}}
    cwds = {"llama.cpp": None, "llamapy": here}
    if args.base:
        sides["base"] = sides["llamapy"]
        envs["base"] = {**os.environ, "PYTHONPATH": os.path.abspath(args.base)}
        cwds["base"] = os.path.abspath(args.base)
    results: dict[str, list[dict[str, float]]] = {k: [] for k in sides}
    for r in range(args.repeat):
        print(f"round {r + 1}: load average {os.getloadavg()[0]:.2f}", flush=True)
        for name, cmd in sides.items():
            got = run(cmd, envs[name], cwds[name])
            results[name].append(got)
            print(f"{name:9s} run {r + 1}: " + ", ".join(f"{k} {v:,.2f}" for k, v in got.items()), flush=True)
    keys = sorted(set().union(*(d.keys() for d in results["llamapy"])) & set().union(*(d.keys() for d in results["llama.cpp"])))
    others = [k for k in sides if k != "llama.cpp"]
    print("| measure | llama.cpp | " + " | ".join(others) + " | " + " | ".join(f"{k} / llama.cpp" for k in others) + " |")
    print("|---" * (1 + 2 * len(others) + 1) + "|")
    for k in keys:
        a = statistics.median(d[k] for d in results["llama.cpp"] if k in d)  # runs that printed it
        bs = [statistics.median(d[k] for d in results[o] if k in d) for o in others]
        ratios = [a / b if k == "wall s" else b / a for b in bs]
        note = " (time: llama.cpp / llamapy)" if k == "wall s" else ""
        print(f"| {k} | {a:,.2f} | " + " | ".join(f"{b:,.2f}" for b in bs) + " | "
              + " | ".join(f"{r:.3f}" for r in ratios) + f"{note} |")


if __name__ == "__main__":
    main()
