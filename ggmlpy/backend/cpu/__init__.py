"""The CPU backend: computes graphs with numpy/BLAS and numba kernels."""
from __future__ import annotations

import time
from collections import defaultdict

import numba
import numpy as np

from ...alloc import GraphAllocator
from ...graph import Graph
from ...tensor import VIEW_OPS, Op
from . import compute_sampling, compute_train, matmul  # noqa: F401  (register their ops)
from .compute import prepare
from .gemm import GRAIN

# Below this much work an op runs on one thread: waking the other costs more. Work is
# result elements, times the reduced dimension for products (which gemm.py cuts into
# slices of GRAIN multiply-adds; with fewer than two slices a second thread idles).
PARALLEL_MIN_ELEMENTS = 1 << 13
PARALLEL_MIN_MACS = 2 * GRAIN
_PRODUCTS = (Op.MUL_MAT, Op.OUT_PROD)


def _thread_setter():
    """numba.set_num_threads without its per-call locking (~1.5 us, and a graph switches
    between one thread and all of them around a hundred times): numba's own setter,
    reached once its threads are launched."""
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)  # launches the pool
    from numba.np.ufunc import parallel
    return getattr(parallel, "_set_num_threads", None) or numba.set_num_threads


_set_threads = _thread_setter()


def _parallel(node) -> bool:
    if node.op in _PRODUCTS:
        return node.nelements() * node.src[0].ne[0 if node.op == Op.MUL_MAT else 1] >= PARALLEL_MIN_MACS
    return node.nelements() >= PARALLEL_MIN_ELEMENTS


class CpuBackend:
    """Executes graphs in node order. `compute` plans a graph once and reuses the plan.

    `profile` (a dict) collects seconds per op type when given, for finding hot ops.
    """

    name = "CPU"

    def __init__(self, n_threads: int | None = None) -> None:
        self.profile: dict[str, float] | None = None
        self.set_n_threads(n_threads or numba.config.NUMBA_NUM_THREADS)

    def set_n_threads(self, n_threads: int) -> None:
        """Threads for numba's pool, which runs every kernel and product (BLAS included)."""
        self.n_threads = max(1, min(n_threads, numba.config.NUMBA_NUM_THREADS))

    def supports_op(self, op: Op) -> bool:
        from .compute import PREPARE
        return op in PREPARE or op in VIEW_OPS or op == Op.NONE

    def new_allocator(self) -> GraphAllocator:
        return GraphAllocator()

    def compute(self, graph: Graph) -> None:
        if graph.plan is None:
            graph.plan = [(node.op.name, prepare(node), _parallel(node))
                          for node in graph.nodes if node.op not in VIEW_OPS and node.op != Op.NONE]
        with np.errstate(all="ignore"):  # inf/nan are results here (as in ggml), not warnings
            self._run_plan(graph.plan)

    def _run_plan(self, plan) -> None:
        threads = 0
        profile = self.profile
        for name, run, parallel in plan:
            want = self.n_threads if parallel else 1
            if want != threads:
                _set_threads(want)
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
