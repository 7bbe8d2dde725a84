"""The CPU backend: computes graphs with numpy/BLAS and numba kernels."""
from __future__ import annotations

import os
import time
import weakref
from collections import defaultdict
from collections.abc import Callable

import numba
import numpy as np

from ...cores import FreeCores
from ...graph import Graph
from ...numba_compat import compile_count, fast_thread_setter, lean_parfor_libraries, on_first_compile  # noqa: F401 -- public
from .plan import Plan, Scratch, compile_ahead, dispatch
from .products import bf16dot
from .train import train_kernels

SUM_SQUARES_SERIAL = 1 << 20  # elements: a serial sum of squares takes ~1 ms there


lean_parfor_libraries()  # before any of the kernels above compiles
# the executor switches between one thread and all around a hundred times a graph
_set_threads = fast_thread_setter()


class CpuBackend:
    """Executes graphs in node order. A graph is prepared into a `Plan` once and the plan is
    reused while it is valid (plan.py); plans live here, beside the graphs, and go with them.

    `profile` (a dict) collects seconds per op type when given, for finding hot ops.
    """

    name = "CPU"

    def __init__(self, n_threads: int | None = None) -> None:
        self.profile: dict[str, float] | None = None
        # the threads a run uses: n_threads, or fewer while other processes keep cores busy
        # (ggmlpy/cores.py); GGMLPY_FIXED_THREADS=1 always uses n_threads (for measuring the threads)
        self.free_cores = None if os.environ.get("GGMLPY_FIXED_THREADS") == "1" else FreeCores()
        self.scratch = Scratch()
        self._plans: weakref.WeakKeyDictionary[Graph, Plan] = weakref.WeakKeyDictionary()
        self.set_n_threads(n_threads or numba.config.NUMBA_NUM_THREADS)
        # a plan's first run shares its compiling with a child (_first_run)
        self._compile_ahead = compile_ahead.available()
        self._plans_run: weakref.WeakSet[Plan] = weakref.WeakSet()

    @property
    def bf16_dot_products(self) -> bool:
        """Whether this CPU multiplies pairs of bf16 values in one instruction (AVX512-BF16),
        which makes products set to Prec.BF16 twice as fast as float32's."""
        return bf16dot.BF16

    def set_n_threads(self, n_threads: int) -> None:
        """Threads for numba's pool, which runs every kernel and product (BLAS included)."""
        self.n_threads = max(1, min(n_threads, numba.config.NUMBA_NUM_THREADS))

    def plan(self, graph: Graph) -> Plan:
        """The graph's plan: the one prepared before while it is valid, else a new one."""
        plan = self._plans.get(graph)
        if plan is None or not plan.valid_for(graph):
            plan = self._plans[graph] = Plan(graph, self.scratch, dispatch.prepare, dispatch.parallel, dispatch.fuse)
        return plan

    def compute(self, graph: Graph) -> None:
        plan = self.plan(graph)
        with np.errstate(all="ignore"):  # inf/nan are results here (as in ggml), not warnings
            self._run(plan)

    def _run(self, plan: Plan) -> None:
        plan.n_runs += 1
        if self._compile_ahead and plan not in self._plans_run:
            self._plans_run.add(plan)
            self._first_run(plan)
            return
        self._run_steps(plan, None)

    def _first_run(self, plan: Plan) -> None:
        """A plan's first run. When a step compiles a kernel (the first run after installing,
        or a model of another shape or type than those run before), a child process compiles
        the steps from the last one backwards meanwhile (compile_ahead.py), from then on."""
        steps = [run for _, run, _ in plan.steps]
        compiles = compile_count()
        seen = compiles()
        ahead = None

        def at_step(i: int) -> None:
            nonlocal ahead
            if ahead is None and compiles() != seen and i < len(steps) - 1 and compile_ahead.safe_to_fork():
                ahead = compile_ahead.CompileAhead(steps, first=i)
            if ahead is not None:
                ahead.at(i)
        try:
            self._run_steps(plan, at_step)
        finally:
            if ahead is not None:
                ahead.close()

    def threads_now(self) -> int:
        """The threads the next run uses: n_threads, or the cores other processes leave free."""
        return self.n_threads if self.free_cores is None else self.free_cores.threads(self.n_threads)

    def _run_steps(self, plan: Plan, at_step: Callable[[int], None] | None) -> None:
        threads = 0
        profile = self.profile
        n_threads = self.threads_now()
        if at_step is None and profile is None:  # the plain loop: calls, and a switch per run
            for parallel, calls in plan.runs:
                want = n_threads if parallel else 1
                if want != threads:
                    _set_threads(want)
                    threads = want
                for run in calls:
                    run()
            return
        for i, (name, run, parallel) in enumerate(plan.steps):
            if at_step is not None:
                at_step(i)
            want = n_threads if parallel else 1
            if want != threads:
                _set_threads(want)
                threads = want
            if profile is None:
                run()
                continue
            t0 = time.perf_counter()
            run()
            profile[name] += time.perf_counter() - t0

    def sum_squares(self, array: np.ndarray) -> float:
        """Sum of the squares of the elements of a contiguous F32 array, in float64 (a global
        gradient norm over the flat gradient buffer); the same for any thread count. Below
        SUM_SQUARES_SERIAL elements one thread sums it: waking the others costs more (ms on a
        busy machine) than the sum."""
        _set_threads(self.n_threads if array.size >= SUM_SQUARES_SERIAL else 1)
        return float(train_kernels.sum_sq_f64(array.reshape(-1)))

    def scale(self, array: np.ndarray, factor: float) -> None:
        """Multiply a contiguous F32 array by `factor` in place (gradient clipping)."""
        _set_threads(self.n_threads)
        train_kernels.scale_f32(array.reshape(-1), factor)

    def enable_profile(self) -> dict[str, float]:
        self.profile = defaultdict(float)
        return self.profile
