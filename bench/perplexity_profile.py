"""Per-op time of perplexity (the executor's profile option): seconds per op type, calls,
and microseconds per call; stories260K -c 128 unless a model and -c are given.

Run by hand:  python bench/perplexity_profile.py [n_ubatch] [threads] [chunks] [model.gguf] [n_ctx]
"""
from __future__ import annotations

import os
import sys
import time
from collections import Counter
from pathlib import Path

import llamapy
import llamapy.context as context_module
from llamapy.perplexity import perplexity

SHARED = Path(os.environ.get("LLAMAPY_SHARED", Path(__file__).resolve().parents[2] / "shared"))


def main() -> None:
    n_ubatch = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    chunks = int(sys.argv[3]) if len(sys.argv) > 3 else 160
    model = llamapy.load_model(sys.argv[4] if len(sys.argv) > 4 else SHARED / "models" / "stories260K.gguf")
    n_ctx = int(sys.argv[5]) if len(sys.argv) > 5 else 128
    tokens = model.vocab.tokenize((SHARED / "data" / "wiki.test.raw").read_text(encoding="utf-8"))
    perplexity(model, tokens, n_ctx, 2048, n_ubatch, min(chunks, 32), threads)  # compile / warm caches
    profiles = []
    calls: Counter[str] = Counter()
    original_init = context_module.Context.__init__

    def init_with_profile(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        profiles.append(self.backend.enable_profile())
        run = self.backend._run

        def counting_run(plan):
            calls.update(name for name, _, _ in plan.steps)
            run(plan)
        self.backend._run = counting_run

    context_module.Context.__init__ = init_with_profile
    t0 = time.perf_counter()
    perplexity(model, tokens, n_ctx, 2048, n_ubatch, chunks, threads)
    elapsed = time.perf_counter() - t0
    prof = profiles[-1]
    print(f"-ub {n_ubatch} -t {threads}: {chunks * n_ctx / elapsed:,.0f} tokens/s; "
          f"compute {sum(prof.values()):.3f} s of {elapsed:.3f} s")
    for op, seconds in sorted(prof.items(), key=lambda kv: -kv[1]):
        print(f"  {op:16s} {seconds:.3f} s  {calls[op]:6d} calls  {seconds / calls[op] * 1e6:7.1f} us/call")


if __name__ == "__main__":
    main()
