"""How many cores other processes leave free, so a busy machine slows a graph in proportion.

Every op of a plan is a parallel region whose threads meet at its end: when another program
keeps a core busy, the thread sharing that core arrives late at every meeting and the one
that arrived first spins, and a step of small ops runs at a fraction of its idle speed
(stories260K training on 2 threads next to one busy process: 0.31x; on 1 thread 0.63x,
bench/RESULTS.md). Results do not depend on the thread count (the kernels split rows, never
a sum), so the executor runs on the cores that are free: this module measures them from the
kernel's counters, the machine's busy time (/proc/stat) less this process's own, over the
last half second. Where /proc/stat does not exist every core counts as free.
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

SAMPLE_SECONDS = 0.5
FIRST_SAMPLE_SECONDS = 0.1  # the first measurement comes sooner: a short run is mostly its start


def _machine_busy_seconds(path: str = "/proc/stat") -> float | None:
    """CPU seconds all cores have spent on anything but idling since boot (user, nice,
    system, irq, softirq and steal: a hypervisor's steal is time the cores were not ours
    either), or None where the counters cannot be read."""
    try:
        with open(path, "rb") as f:
            fields = f.readline().split()
        if fields[0] != b"cpu":
            return None
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    except (OSError, ValueError, IndexError):
        return None
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class FreeCores:
    """The cores others leave free, sampled at most every SAMPLE_SECONDS: `threads(wanted)`
    is wanted, or fewer when other processes keep cores busy (at least one)."""

    def __init__(self, n_cores: int | None = None,
                 machine_busy: Callable[[], float | None] = _machine_busy_seconds,
                 own_busy: Callable[[], float] = time.process_time,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.n_cores = n_cores or os.cpu_count() or 1
        self._machine_busy, self._own_busy, self._clock = machine_busy, own_busy, clock
        self.free = float(self.n_cores)  # the last measurement
        self._last: tuple[float, float, float] | None = None
        self._next = 0.0
        self._sample(self._clock())  # the counters at creation: the first measurement is over
        self._next = self._clock() + FIRST_SAMPLE_SECONDS  # the first FIRST_SAMPLE_SECONDS

    def _sample(self, now: float) -> None:
        machine = self._machine_busy()
        if machine is None:
            return
        own = self._own_busy()
        if self._last is not None:
            t0, machine0, own0 = self._last
            others = max(0.0, (machine - machine0) - (own - own0)) / max(now - t0, 1e-9)
            self.free = max(0.0, self.n_cores - others)
        self._last = (now, machine, own)

    def threads(self, wanted: int) -> int:
        """wanted, or the cores other processes leave free when fewer (at least 1)."""
        now = self._clock()
        if now >= self._next:
            self._next = now + SAMPLE_SECONDS
            self._sample(now)
        return max(1, min(wanted, math.floor(self.free + 0.5)))
