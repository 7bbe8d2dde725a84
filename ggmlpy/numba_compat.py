"""What ggmlpy relies on in numba beyond its public decorators, in one place: the compile
event a front end hooks before anything compiles (without loading the CPU backend), and the
start of numba's lowering registries without its scipy probe."""
from __future__ import annotations

import os
import sys
from collections.abc import Callable


def on_first_compile(callback: Callable[[], None]) -> None:
    """Call `callback` once, when numba starts compiling a kernel in this process (not when it
    loads one from its on-disk cache): a front end can say why the first run is slow exactly
    when it is. Uses numba's event API ("numba:compile" fires on cache misses only)."""
    from numba.core import event

    pid = os.getpid()

    class FirstCompile(event.Listener):
        def on_start(self, ev: event.Event) -> None:
            if os.getpid() == pid:  # not in a compile-ahead child
                event.unregister("numba:compile", self)
                callback()

        def on_end(self, ev: event.Event) -> None:
            pass

    event.register("numba:compile", FirstCompile())


def load_numba_without_scipy() -> None:
    """Load numba's lowering registries (what its first compile or cache load does) with scipy
    hidden. numba.np.arraymath imports scipy.linalg at that moment to find a BLAS for np.dot
    in njit code: 0.1 s of every command's start where scipy is installed, and no ggmlpy
    kernel uses it (products call BLAS through backend/cpu/gemm.py). For processes that run
    only ggmlpy's kernels (the command-line tools): numba's np.dot stays unavailable in them,
    scipy.linalg itself imports normally afterwards. Does nothing once it or the registries
    are loaded."""
    if "scipy.linalg" in sys.modules or "numba.np.arraymath" in sys.modules:
        return
    from numba.core.registry import cpu_target

    sys.modules["scipy.linalg"] = None  # importing it fails at once: numba's probe finds no BLAS
    try:
        cpu_target.target_context.refresh()
    finally:
        if sys.modules.get("scipy.linalg", 0) is None:
            del sys.modules["scipy.linalg"]
