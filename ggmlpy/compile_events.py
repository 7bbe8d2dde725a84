"""numba's compile event, without the kernels: a front end hooks it before anything compiles,
and a tool that never runs a model does not load the CPU backend to do so."""
from __future__ import annotations

import os
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
