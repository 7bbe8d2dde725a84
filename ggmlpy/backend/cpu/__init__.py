"""The CPU backend: computes graphs with numpy/BLAS and numba kernels."""
from __future__ import annotations

import time
from collections import defaultdict

import numba
import numpy as np

from ...graph import Graph
from ...registry import OPS, OpKind
from . import dispatch


def _thread_setter():
    """numba.set_num_threads without its per-call locking (~1.5 us, and a graph switches
    between one thread and all of them around a hundred times): numba's own setter,
    reached once its threads are launched."""
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)  # launches the pool
    from numba.np.ufunc import parallel
    return getattr(parallel, "_set_num_threads", None) or numba.set_num_threads


_set_threads = _thread_setter()


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

    def compute(self, graph: Graph) -> None:
        if graph.plan is None:
            graph.plan = [(node.op.name, dispatch.prepare(node), dispatch.parallel(node))
                          for node in graph.nodes if OPS[node.op].kind is OpKind.COMPUTE]
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
