"""What a backend is to the code above it (ggml's `ggml_backend_i`): a `Protocol`, so a
backend implements it by having these members, and nothing above the backends (the
optimizer, llamapy) imports a concrete one.

Memory is planned by ggmlpy's GraphAllocator, not by a backend; a backend plans a graph's
computation (its kernels bound to the current buffers), computes planned graphs, and gives
the few whole-buffer vector ops an optimizer step needs beside its graph (a global
gradient norm and clipping).
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..graph import Graph


@runtime_checkable
class Backend(Protocol):
    """A device that computes graphs (backend/cpu's CpuBackend is one)."""

    name: str
    n_threads: int

    @property
    def bf16_dot_products(self) -> bool:
        """Whether products on bf16 operands are faster here than float32's (a trainer then
        runs its backward products through frozen weights in bf16)."""

    def set_n_threads(self, n_threads: int) -> None:
        """Threads (or the device's equivalent) later computations use."""

    def plan(self, graph: Graph) -> Any:
        """The graph's compute plan: prepared once, reused while the graph's buffers stay bound."""

    def compute(self, graph: Graph) -> None:
        """Compute `graph` (allocated) through its plan."""

    def sum_squares(self, array: np.ndarray) -> float:
        """The sum of the squares of a contiguous F32 buffer, in float64 (a global gradient norm)."""

    def scale(self, array: np.ndarray, factor: float) -> None:
        """Multiply a contiguous F32 buffer by `factor` in place (gradient clipping)."""
