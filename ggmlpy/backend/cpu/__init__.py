"""The CPU backend: computes graphs with numpy/BLAS and numba kernels."""
from __future__ import annotations

import os
import time
from collections import defaultdict

# numba's OpenMP workers otherwise spin after each parallel kernel and starve the BLAS
# threads that run next (measured: 2 threads slower than 1). Must precede the first
# parallel kernel, when numba loads libgomp.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numba
import numpy as np
from threadpoolctl import threadpool_limits

from ...alloc import GraphAllocator
from ...graph import Graph
from ...tensor import VIEW_OPS, Op
from . import compute_train, matmul  # noqa: F401  (register their ops)
from .compute import prepare

# Below this many result elements a kernel runs on one thread: waking more costs more.
PARALLEL_MIN_ELEMENTS = 1 << 16


class CpuBackend:
    """Executes graphs in node order. `compute` plans a graph once and reuses the plan.

    `profile` (a dict) collects seconds per op type when given, for finding hot ops.
    """

    name = "CPU"

    def __init__(self, n_threads: int | None = None) -> None:
        self.profile: dict[str, float] | None = None
        self.set_n_threads(n_threads or numba.config.NUMBA_NUM_THREADS)

    def set_n_threads(self, n_threads: int) -> None:
        """Threads for numba kernels and for BLAS (whose own default would oversubscribe)."""
        self.n_threads = max(1, min(n_threads, numba.config.NUMBA_NUM_THREADS))
        threadpool_limits(limits=self.n_threads, user_api="blas")

    def supports_op(self, op: Op) -> bool:
        from .compute import PREPARE
        return op in PREPARE or op in VIEW_OPS or op == Op.NONE

    def new_allocator(self) -> GraphAllocator:
        return GraphAllocator()

    def compute(self, graph: Graph) -> None:
        if graph.plan is None:
            graph.plan = [(node.op.name, prepare(node), node.nelements() >= PARALLEL_MIN_ELEMENTS)
                          for node in graph.nodes if node.op not in VIEW_OPS and node.op != Op.NONE]
        with np.errstate(all="ignore"):  # inf/nan are results here (as in ggml), not warnings
            self._run_plan(graph.plan)

    def _run_plan(self, plan) -> None:
        threads = 0
        profile = self.profile
        for name, run, parallel in plan:
            want = self.n_threads if parallel else 1
            if want != threads:
                numba.set_num_threads(want)
                threads = want
            if profile is None:
                run()
                continue
            t0 = time.perf_counter()
            run()
            profile[name] += time.perf_counter() - t0

    def enable_profile(self) -> dict[str, float]:
        self.profile = defaultdict(float)
        return self.profile
