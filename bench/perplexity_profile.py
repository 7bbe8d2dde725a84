"""Per-op time of perplexity on stories260K (the executor's profile option): seconds per op
type, calls, and microseconds per call.

Run by hand:  python bench/perplexity_profile.py [n_ubatch] [threads] [chunks]
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
    model = llamapy.load_model(SHARED / "models" / "stories260K.gguf")
    tokens = model.vocab.tokenize((SHARED / "data" / "wiki.test.raw").read_text(encoding="utf-8"))
    perplexity(model, tokens, 128, 2048, n_ubatch, 32, threads)  # compile / warm caches
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
    perplexity(model, tokens, 128, 2048, n_ubatch, chunks, threads)
    elapsed = time.perf_counter() - t0
    prof = profiles[0]
    print(f"-ub {n_ubatch} -t {threads}: {chunks * 128 / elapsed:,.0f} tokens/s; "
          f"compute {sum(prof.values()):.3f} s of {elapsed:.3f} s")
    for op, seconds in sorted(prof.items(), key=lambda kv: -kv[1]):
        print(f"  {op:16s} {seconds:.3f} s  {calls[op]:6d} calls  {seconds / calls[op] * 1e6:7.1f} us/call")


if __name__ == "__main__":
    main()
