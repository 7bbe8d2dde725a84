"""Generation and prompt processing of llamapy-cli against llama.cpp's llama-completion, side
by side: the same model, prompt and flags, the two commands alternated A B A B.

    python bench/cli_vs_llama_cpp.py --llama-cpp BUILD/bin [--model PATH] [-n 128] [-t 2] [--repeat 3]

Each run is a fresh process (model load and, for llamapy, numba's warm cache included in the
wall time); its own perf lines give prompt and generation speed (llama_perf_context_print's
"prompt eval time" and "eval time"). Prints every run, then the medians and llamapy / llama.cpp.
"""
from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time

from llamapy.defaults import default_model_path

PROMPT = "The history of the printing press begins"
_PERF = re.compile(r"(prompt eval|eval) time =\s*([0-9.]+) ms /\s*(\d+) (?:tokens|runs)")


def run(cmd: list[str]) -> dict[str, float]:
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode:
        sys.exit(f"{cmd[0]} failed: {out.stderr[-500:]}")
    got = {"wall s": wall}
    for kind, ms, n in _PERF.findall(out.stdout + out.stderr):
        got[f"{kind} t/s"] = int(n) / (float(ms) / 1e3) if float(ms) else float("nan")
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", required=True, help="directory with llama-completion")
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    common = ["-m", args.model, "-p", PROMPT, "-n", str(args.n), "--temp", "0", "-t", str(args.t)]
    sides = {
        "llama.cpp": [f"{args.llama_cpp}/llama-completion", *common, "-no-cnv", "--no-warmup"],
        "llamapy": [sys.executable, "-m", "apps.cli", *common],
    }
    results: dict[str, list[dict[str, float]]] = {k: [] for k in sides}
    for r in range(args.repeat):
        for name, cmd in sides.items():
            got = run(cmd)
            results[name].append(got)
            print(f"{name:9s} run {r + 1}: " + ", ".join(f"{k} {v:,.2f}" for k, v in got.items()), flush=True)
    keys = sorted(set().union(*(d.keys() for d in results["llamapy"])) & set().union(*(d.keys() for d in results["llama.cpp"])))
    print("| measure | llama.cpp | llamapy | llamapy / llama.cpp |")
    print("|---|---|---|---|")
    for k in keys:
        a = statistics.median(d[k] for d in results["llama.cpp"])
        b = statistics.median(d[k] for d in results["llamapy"])
        ratio = a / b if k == "wall s" else b / a
        print(f"| {k} | {a:,.2f} | {b:,.2f} | {ratio:.3f}{' (time: llama.cpp / llamapy)' if k == 'wall s' else ''} |")


if __name__ == "__main__":
    main()
