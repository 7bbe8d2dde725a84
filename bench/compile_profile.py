"""Where a cold start goes: numba compile time per kernel during one run of a command, with
an empty numba cache (a fresh NUMBA_CACHE_DIR).

    python bench/compile_profile.py llamapy.cli.perplexity -m ../shared/models/stories260K.gguf \
        -f ../shared/data/wiki.test.raw --chunks 16 -t 1

Listens to numba's "numba:compile" events and sums CPU seconds (process time, less
sensitive to a busy machine than wall time) per compiled function. A function's time
includes the functions it compiles on the way (nested ones are counted in both), so the
list shows where to look, not a partition.
"""
from __future__ import annotations

import os
import runpy
import sys
import tempfile
import time

os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="numba-cold-")

from numba.core import event  # noqa: E402  (after NUMBA_CACHE_DIR is set)


class CompileTimes(event.Listener):
    def __init__(self) -> None:
        self.started: dict[int, float] = {}
        self.seconds: dict[str, float] = {}
        self.compiles: dict[str, int] = {}

    def on_start(self, ev) -> None:
        self.started[id(ev.data["dispatcher"])] = time.process_time()

    def on_end(self, ev) -> None:
        d = ev.data["dispatcher"]
        t0 = self.started.pop(id(d), None)
        if t0 is not None:
            name = f"{d.py_func.__module__}.{d.py_func.__qualname__}"
            self.seconds[name] = self.seconds.get(name, 0.0) + time.process_time() - t0
            self.compiles[name] = self.compiles.get(name, 0) + 1


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: compile_profile.py MODULE [ARGS...]")
    times = CompileTimes()
    event.register("numba:compile", times)
    module, sys.argv = sys.argv[1], sys.argv[1:]
    cpu0, wall0 = time.process_time(), time.perf_counter()
    try:
        runpy.run_module(module, run_name="__main__")
    except SystemExit:
        pass
    print(f"\n{module}: {time.process_time() - cpu0:.1f} s CPU, {time.perf_counter() - wall0:.1f} s wall; "
          "compile CPU seconds by function (nested included), and how many signatures:", file=sys.stderr)
    for name, s in sorted(times.seconds.items(), key=lambda kv: -kv[1])[:30]:
        print(f"  {s:6.2f}  x{times.compiles[name]:<2d} {name}", file=sys.stderr)


if __name__ == "__main__":
    main()
