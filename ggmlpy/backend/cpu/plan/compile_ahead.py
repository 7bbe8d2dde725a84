"""Compile-ahead: on the first run after installing (numba's cache empty), a forked child
compiles a plan's kernels from its last step backwards while this process runs the plan
from its first. numba loads a kernel from its on-disk cache when it meets a new signature,
so the two meet in the middle and a first run's compile time is shared between two cores.

Both processes save to the same cache, so its saves are serialised by a file lock (numba
writes a function's index before its data: two processes saving two signatures of one
function at once could otherwise pair one's index entry with the other's code).

The child never executes a kernel: numba's OpenMP pool does not survive a fork, and its
data is whatever the arena held. Every numba call in the child compiles (or loads) the
kernel for the arguments' types, drops it from memory again and stops that step, so the
next step's kernels are reached. It stops where this process's run has got to (a counter
in shared memory), and is killed when the run ends.
"""
from __future__ import annotations

import mmap
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence

import numpy as np

from ....numba_compat import cache_saves_lockable, compile_instead_of_running, lock_cache_saves


class _Compiled(Exception):
    """Raised in the child instead of running a kernel it has just compiled."""


def available() -> bool:
    """Forking is only safe for a plain process on a system with fork and a spare core:
    never under MPI (its library does not support fork) or on one core; and numba must
    save its cache the way numba_compat.lock_cache_saves expects.
    GGMLPY_COMPILE_AHEAD=0 turns it off (to compare, bench/cold_start.py)."""
    return (os.environ.get("GGMLPY_COMPILE_AHEAD", "1") != "0" and hasattr(os, "fork")
            and (os.cpu_count() or 1) > 1 and "mpi4py" not in sys.modules
            and cache_saves_lockable())


def safe_to_fork() -> bool:
    """No other Python thread is running (a server's, a user's): one holding a lock at the
    fork would leave the child waiting on it for ever."""
    return threading.active_count() == 1


class CompileAhead:
    """The child compiling `steps` backwards, and the shared counter of this process's step."""

    def __init__(self, steps: Sequence[Callable[[], None]], first: int = 0) -> None:
        """Fork the child; this process is at step `first`."""
        self._shared = mmap.mmap(-1, 8)
        self._progress = np.frombuffer(self._shared, dtype=np.int64)
        self._progress[0] = first
        lock_cache_saves()
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            status = 0
            try:
                _compile_backwards(steps, self._progress)
            except BaseException:  # noqa: BLE001 -- the child only helps: it never reports
                status = 1
            finally:
                os._exit(status)

    def at(self, step: int) -> None:
        """This process is about to run `step`: the child stops when it gets there."""
        self._progress[0] = step

    def close(self) -> None:
        """End the child (its cache writes are atomic: numba replaces files whole)."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


def _compile_backwards(steps: Sequence[Callable[[], None]], progress: np.ndarray) -> None:
    # Ctrl-C reaches the whole process group: the parent's handlers (a trainer saving its
    # checkpoint) must not run here too; the parent ends this process itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.nice(5)  # the run in the parent comes first when the cores are busy
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    compile_instead_of_running(_Compiled)
    with np.errstate(all="ignore"):
        for i in range(len(steps) - 1, 0, -1):
            if progress[0] >= i:
                return
            try:
                steps[i]()
            except Exception:  # noqa: BLE001 -- _Compiled, or a step confused by stale data
                pass
