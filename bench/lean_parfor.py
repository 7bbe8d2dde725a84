"""Parallel kernels compiled with and without numba_compat.lean_parfor_libraries: compile CPU
seconds (fresh NUMBA_CACHE_DIR each run) and the best run time, alternated in fresh processes.

    python bench/lean_parfor.py [--rounds 2]

Kernels: small-head flash attention (stories260K's heads: 8 values, 8/4 heads, 200 queries
over 256 cells), the Q8_K activation quantizer (512 x 2048) and swiglu (512 x 2048).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

ONE = r"""
import time
import numpy as np
from ggmlpy.backend.cpu.rows import kernels as K
from ggmlpy.backend.cpu.products import qexact as Q
from ggmlpy.backend.cpu.attention import small_head_attention as SHA

rng = np.random.default_rng(0)
q = rng.random((1, 8, 200, 8)).astype(np.float32)
k, v = (rng.random((1, 256, 4, 8)).astype(np.float32) for _ in range(2))
mask = np.triu(np.full((200, 256), -np.inf, np.float32), 57)[None, None]
att = np.zeros((1, 200, 8, 8), np.float32)
x = rng.standard_normal((512, 2048)).astype(np.float32)
xq, xd, bs = np.empty(512 * 2048, np.float32), np.empty(512 * 8, np.float32), np.empty(512 * 8 * 16, np.float32)
a = x.reshape(1, 1, 512, 2048)
g, out = a.copy(), np.empty_like(a)
calls = {"attention": lambda: SHA.flash_attn_f32(q, k, v, mask, att, 0.3, 0.0, 0.0, True, (0,) * 8, (0,) * 8),
         "quantize_q8_k": lambda: Q.quantize_q8_k(x, Q.ROWS, xq, xd, bs),
         "swiglu": lambda: K.swiglu_f32(a, g, out)}
for name, call in calls.items():
    t = time.process_time()
    call()
    compile_s = time.process_time() - t
    runs = []
    for _ in range(30):
        t = time.perf_counter()
        call()
        runs.append(time.perf_counter() - t)
    print(f"{name} {compile_s:.2f} {min(runs) * 1e3:.3f}")
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    got: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for mode in ("numba", "lean"):
            with tempfile.TemporaryDirectory() as cache:
                r = subprocess.run([sys.executable, "-c", ONE], capture_output=True, text=True, check=True,
                                   env={**os.environ, "NUMBA_CACHE_DIR": cache,
                                        "GGMLPY_LEAN_PARFOR": "0" if mode == "numba" else "1"})
            for line in r.stdout.split("\n"):
                if line:
                    name, compile_s, run_ms = line.split()
                    got.setdefault((name, mode), []).append((float(compile_s), float(run_ms)))
                    print(f"{mode:5} {name:14} compile {float(compile_s):5.2f} s CPU, run {float(run_ms):.3f} ms",
                          flush=True)
    for name in dict.fromkeys(n for n, _ in got):
        compile_s = {m: min(c for c, _ in got[name, m]) for m in ("numba", "lean")}
        run_ms = {m: min(r for _, r in got[name, m]) for m in ("numba", "lean")}
        print(f"{name}: compile lean/numba {compile_s['lean'] / compile_s['numba']:.2f}, "
              f"run lean/numba {run_ms['lean'] / run_ms['numba']:.3f}")


if __name__ == "__main__":
    main()
