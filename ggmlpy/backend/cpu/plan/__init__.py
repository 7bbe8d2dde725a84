"""Compute plans (ggml's cplan): a graph's nodes prepared as calls bound to the memory its
tensors have now, kept apart from the graph.

A plan knows what it was prepared on: the graph's node count (nodes are only appended)
and the binding of every tensor its calls read or write. When any of them changes (a
tensor rebound to new memory, a node added), the plan is stale and the backend prepares
a new one, so no caller ever has to clear anything. Checking is cheap: while no tensor
anywhere has been bound since the last check, a plan is valid without looking further.

What kernels need besides their operands is owned here too: per-plan tables (RoPE's
cos/sin of a positions tensor, shared by every rope of the graph), memory one step writes
for a later step of the same graph to read (a fused loss's softmax-weighted rows, made
by its forward step while the weight's rows pass through it, for its backward step) and
the backend's scratch buffers (ops run one at a time, so one buffer per use serves them all).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .... import tensor as tensor_module
from ....graph import Graph
from ....registry import OPS, OpKind
from ....tensor import Op, Tensor
from ..rows import kernels as K


class Scratch:
    """Growable float32 work buffers by name (a backend's: valid until the next `get` of
    the same name, which is the next op that uses it)."""

    def __init__(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}

    def get(self, name: str, n: int) -> np.ndarray:
        buf = self._buffers.get(name)
        if buf is None or buf.size < n:
            buf = self._buffers[name] = np.empty(n, dtype=np.float32)
        return buf[:n]


class RopeTable:
    """cos/sin of the positions in one positions tensor, for one set of rope parameters.
    Computed again only when the positions or frequency factors differ from those it was
    made from. They are compared on every use, except when both are leaves of the graph
    (inputs and weights, which no step writes): then once per run of the plan, by the
    run's first rope (a decode step's layers all rope with one table)."""

    def __init__(self, n_pos: int, args: tuple, plan: "Plan | None" = None) -> None:
        self.args = args
        self.plan = plan  # set when the positions and factors are leaves
        self.checked = -1  # the plan's run in which they were last compared
        self.pos = np.empty(n_pos, dtype=np.int64)
        self.ff = np.empty(0, dtype=np.float32)
        self.valid = False
        self.cos = np.empty((n_pos, args[0] // 2), dtype=np.float32)
        self.sin = np.empty((n_pos, args[0] // 2), dtype=np.float32)

    def refresh(self, pos: np.ndarray, ff: np.ndarray, has_ff: bool) -> None:
        if self.plan is not None:
            if self.checked == self.plan.n_runs:
                return
            self.checked = self.plan.n_runs
        if self.valid and K.same_values(self.pos, pos) and K.same_values(self.ff, ff):
            return
        K.rope_table(pos, ff, *self.args, has_ff, self.cos, self.sin)
        np.copyto(self.pos, pos)
        self.ff = ff.copy()
        self.valid = True


Step = tuple[str, Callable[[], None], bool]  # (op name, prepared call, worth every thread)


class Plan:
    """The prepared calls of one graph, in node order, and what they were prepared on."""

    def __init__(self, graph: Graph, scratch: Scratch,
                 prepare: Callable[[Tensor, "Plan"], Callable[[], None]], parallel: Callable[[Tensor], bool],
                 fuse: Callable[[list[Tensor], int, "Plan"], tuple[Callable[[], None], int] | None] | None = None
                 ) -> None:
        self.scratch = scratch
        self.n_runs = 0  # counted by the backend before each run of the steps
        self._rope_tables: dict[tuple, RopeTable] = {}
        self._shared: dict[tuple, np.ndarray] = {}
        self._nodes = graph.nodes
        self._users: dict[int, list[Tensor]] | None = None
        self.n_nodes = len(graph.nodes)
        computed = [n for n in graph.nodes if OPS[n.op].kind is OpKind.COMPUTE]
        # a run of nodes may be prepared as one call (fused.py): it computes every one of them
        self.steps: list[Step] = []
        i = 0
        while i < len(computed):
            n = computed[i]
            fused = fuse(computed, i, self) if fuse is not None else None
            if fused is not None:
                call, k = fused
                run = computed[i:i + k]
                self.steps.append(("+".join(m.op.name for m in run), call, any(parallel(m) for m in run)))
                i += k
                continue
            self.steps.append((n.op.name, prepare(n, self), parallel(n)))
            i += 1
        # the steps as runs of consecutive calls that want the same threads (one or all), for
        # the executor's plain loop: one thread switch per run, nothing else between calls
        self.runs: list[tuple[bool, tuple[Callable[[], None], ...]]] = []
        for _, run, par in self.steps:
            if self.runs and self.runs[-1][0] == par:
                self.runs[-1] = (par, self.runs[-1][1] + (run,))
            else:
                self.runs.append((par, (run,)))
        self._nodes, self._users = [], None  # only preparing asks who uses a node
        bases = {id(b): b for n in computed for t in (n, *n.src) for b in (t.view_src or t,)}
        self._bindings = [(t, t.binding) for t in bases.values()]
        self._checked = tensor_module.BINDINGS

    def valid_for(self, graph: Graph) -> bool:
        """Whether the graph is still the one prepared, on the same memory."""
        if len(graph.nodes) != self.n_nodes:
            return False
        if self._checked == tensor_module.BINDINGS:
            return True
        if any(t.binding != b for t, b in self._bindings):
            return False
        self._checked = tensor_module.BINDINGS
        return True

    def users(self, node: Tensor) -> list[Tensor]:
        """The nodes of this plan's graph that read `node` (a kernel may do more work for a
        later step that needs it)."""
        if self._users is None:
            self._users = {}
            for n in self._nodes:
                for s in n.src:
                    self._users.setdefault(id(s), []).append(n)
        return self._users.get(id(node), [])

    def shared(self, key: tuple, shape: tuple[int, ...], create: bool = True) -> np.ndarray:
        """A float32 array of this plan, the same for every step that asks with `key`: one
        step writes it (create), a later one reads it (it lives as long as the plan)."""
        buf = self._shared.get(key)
        if not create and (buf is None or buf.shape != shape):
            raise KeyError(f"no step of this plan makes {key[0]!r} of shape {shape}")
        if buf is None or buf.shape != shape:
            buf = self._shared[key] = np.zeros(shape, dtype=np.float32)
        return buf

    def rope_table(self, pos: Tensor, freq_factors: Tensor | None, args: tuple) -> RopeTable:
        """The table every rope of this plan with these positions, factors and parameters reads."""
        key = (id(pos), id(freq_factors), args)
        if key not in self._rope_tables:
            leaves = all(t is None or (t.op == Op.NONE and t.view_src is None) for t in (pos, freq_factors))
            self._rope_tables[key] = RopeTable(pos.nelements(), args, self if leaves else None)
        return self._rope_tables[key]
