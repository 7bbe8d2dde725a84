"""Backends: the interface code above them uses (`Backend`), and the default one.

`default_backend` is the one place outside a backend's folder that names a concrete
backend, so that the optimizer and llamapy stay independent of which devices exist.
"""
from __future__ import annotations

from .interface import Backend

__all__ = ["Backend", "default_backend"]


def default_backend(n_threads: int | None = None) -> Backend:
    """The backend a computation gets when its caller names none: the CPU's."""
    from .cpu import CpuBackend  # its kernels load numba's compiled code: only when first asked for
    return CpuBackend(n_threads)
