"""The CPU backend: computes graphs with numpy/BLAS and numba kernels."""
from __future__ import annotations

import time
from collections import defaultdict

import numba

from ...alloc import GraphAllocator
from ...graph import Graph
from ...tensor import VIEW_OPS, Op
from .compute import prepare


class CpuBackend:
    """Executes graphs in node order. `compute` plans a graph once and reuses the plan.

    `profile` (a dict) collects seconds per op type when given, for finding hot ops.
    """

    name = "CPU"

    def __init__(self, n_threads: int | None = None) -> None:
        self.n_threads = n_threads or numba.config.NUMBA_NUM_THREADS
        self.profile: dict[str, float] | None = None

    def set_n_threads(self, n_threads: int) -> None:
        self.n_threads = max(1, min(n_threads, numba.config.NUMBA_NUM_THREADS))

    def supports_op(self, op: Op) -> bool:
        from .compute import PREPARE
        return op in PREPARE or op in VIEW_OPS or op == Op.NONE

    def new_allocator(self) -> GraphAllocator:
        return GraphAllocator()

    def compute(self, graph: Graph) -> None:
        if graph.plan is None:
            graph.plan = [(node.op.name, prepare(node)) for node in graph.nodes
                          if node.op not in VIEW_OPS and node.op != Op.NONE]
        numba.set_num_threads(self.n_threads)
        if self.profile is None:
            for _, run in graph.plan:
                run()
            return
        for name, run in graph.plan:
            t0 = time.perf_counter()
            run()
            self.profile[name] = self.profile.get(name, 0.0) + time.perf_counter() - t0

    def enable_profile(self) -> dict[str, float]:
        self.profile = defaultdict(float)
        return self.profile
