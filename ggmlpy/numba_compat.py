"""What ggmlpy relies on in numba beyond its public decorators, in one place: the compile
event a front end hooks before anything compiles (without loading the CPU backend), and the
start of numba's lowering registries without the packages it probes for features no kernel
uses."""
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


# What numba imports when its registries load, for features no ggmlpy kernel uses: scipy's
# BLAS (np.dot in njit code; products call BLAS through backend/cpu/gemm.py) and cffi's
# C parser (cffi functions called from njit code).
_UNUSED_BY_KERNELS = ("scipy.linalg", "cffi")


def start_numba_registries() -> None:
    """Load numba's lowering registries (what its first compile or cache load does) with
    scipy.linalg and cffi hidden: numba imports them at that moment for features no ggmlpy
    kernel uses (_UNUSED_BY_KERNELS), 0.15 s of every command's start where they are
    installed. For processes that run only ggmlpy's kernels (the command-line tools): those
    numba features stay off in them, the packages themselves import normally afterwards.
    Does nothing once the registries are loaded; a package already imported stays seen."""
    if "numba.np.arraymath" in sys.modules:
        return
    from numba.core.registry import cpu_target

    hidden = [name for name in _UNUSED_BY_KERNELS if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # importing it fails at once: numba's probe finds nothing
    try:
        cpu_target.target_context.refresh()
    finally:
        for name in hidden:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]
