"""Graph allocator (ggml's gallocr): every intermediate tensor of a graph gets a place in
one arena, planned from tensor lifetimes so that memory is reused as soon as the last
consumer of a tensor has run. Ops the registry marks `inplace` may write over a dying
operand of their shape.

The plan is made once per graph; `peak_bytes` is known before anything is computed.
"""
from __future__ import annotations

import bisect

import numpy as np

from .graph import Graph
from .registry import OPS
from .tensor import Flag, Op, Tensor

ALIGNMENT = 64


def _aligned(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


class FreeList:
    """Best-fit placement of blocks in a growing arena; freed neighbours merge."""

    def __init__(self) -> None:
        self.free: list[tuple[int, int]] = []  # (offset, size), sorted by offset
        self.top = 0
        self.peak = 0

    def alloc(self, size: int) -> int:
        size = _aligned(max(size, 1))
        best = -1
        for i, (off, sz) in enumerate(self.free):
            if sz >= size and (best < 0 or sz < self.free[best][1]):
                best = i
        if best >= 0:
            off, sz = self.free[best]
            if sz == size:
                del self.free[best]
            else:
                self.free[best] = (off + size, sz - size)
            return off
        if self.free and self.free[-1][0] + self.free[-1][1] == self.top:
            off, _ = self.free.pop()  # grow the last free block at the top
        else:
            off = self.top
        self.top = off + size
        self.peak = max(self.peak, self.top)
        return off

    def release(self, offset: int, size: int) -> None:
        size = _aligned(max(size, 1))
        i = bisect.bisect_left(self.free, (offset, 0))
        self.free.insert(i, (offset, size))
        if i + 1 < len(self.free) and offset + size == self.free[i + 1][0]:  # merge right
            self.free[i] = (offset, size + self.free[i + 1][1])
            del self.free[i + 1]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == offset:  # merge left
            self.free[i - 1] = (self.free[i - 1][0], self.free[i - 1][1] + self.free[i][1])
            del self.free[i]


class GraphAllocator:
    """Plans and binds the memory of one graph's unallocated tensors.

    Tensors that already have data (weights, KV cache, optimizer state) are left alone.
    Inputs, outputs and leafs keep their place for the whole graph; everything else is
    freed after its last consumer.
    """

    def __init__(self) -> None:
        self.arena: np.ndarray | None = None
        self.peak_bytes = 0
        self.offsets: dict[int, int] = {}
        self._bound: list[list[tuple[Tensor, int]]] = []  # each graph bound in the arena: (tensor, offset)

    def plan(self, graph: Graph) -> int:
        """Compute offsets for every tensor that needs memory; returns the peak in bytes."""
        owned = {}  # id -> tensor, tensors this allocator places
        for t in graph.leafs + graph.nodes:
            if t.buffer is None and t.view_src is None:
                owned[id(t)] = t
        children: dict[int, int] = {}
        views: dict[int, int] = {}
        for node in graph.nodes:
            for s in node.src:
                children[id(s)] = children.get(id(s), 0) + 1
            if node.view_src is not None:
                views[id(node.view_src)] = views.get(id(node.view_src), 0) + 1

        fl = FreeList()
        offsets: dict[int, int] = {}
        pinned = Flag.INPUT | Flag.OUTPUT | Flag.PARAM
        # a pinned view (an output that is a reshape of a node, say) pins the bytes it views
        pinned_bases = {id(t.view_src) for t in graph.nodes if t.view_src is not None and t.flags & pinned}

        def place(t: Tensor) -> None:
            if id(t) in owned and id(t) not in offsets:
                offsets[id(t)] = fl.alloc(t.nbytes())

        def release(t: Tensor) -> None:
            if id(t) in owned and not (t.flags & pinned) and id(t) not in pinned_bases and t.op != Op.NONE:
                fl.release(offsets[id(t)], t.nbytes())

        # inputs first, so that nothing computed can overwrite them; leafs stay put
        for t in graph.leafs + [n for n in graph.nodes if n.flags & Flag.INPUT]:
            place(t)

        for node in graph.nodes:
            if id(node) in owned and id(node) not in offsets:
                donor = self._inplace_donor(node, owned, children, views, pinned, pinned_bases)
                if donor is not None:
                    offsets[id(node)] = offsets[id(donor)]
                    owned.pop(id(donor))  # the node now owns those bytes
                else:
                    place(node)
            for s in node.src:
                children[id(s)] -= 1
                if children[id(s)] == 0 and views.get(id(s), 0) == 0:
                    self._retire(s, children, views, release)

        self.offsets = offsets
        self.peak_bytes = fl.peak
        return fl.peak

    @staticmethod
    def _inplace_donor(node, owned, children, views, pinned, pinned_bases=frozenset()) -> Tensor | None:
        if not OPS[node.op].inplace:
            return None
        for s in node.src:
            if (id(s) in owned and s.view_src is None and children.get(id(s)) == 1 and views.get(id(s), 0) == 0
                    and not (s.flags & pinned) and id(s) not in pinned_bases and s.op != Op.NONE and s.type == node.type
                    and s.ne == node.ne and s.nb == node.nb):
                return s
        return None

    @staticmethod
    def _retire(t: Tensor, children, views, release) -> None:
        if t.view_src is not None:
            base = t.view_src
            views[id(base)] -= 1
            if views[id(base)] == 0 and children.get(id(base), 0) == 0:
                release(base)
        else:
            release(t)

    def alloc_graph(self, graph: Graph) -> None:
        """Plan, make the arena large enough, and bind every tensor (callers cache the result per graph).

        Graphs allocated by one allocator share its arena, which is as large as the largest
        plan (a training window's ubatch graphs, say): compute them one at a time and read a
        graph's results before computing another. When a graph needs more than the arena
        holds, the arena grows and the graphs bound before move into it (rebound tensors:
        their compute plans are rebuilt, their inputs must be set again)."""
        peak = self.plan(graph)
        tensors = {id(t): t for t in graph.leafs + graph.nodes}
        placed = [(tensors[tid], off) for tid, off in self.offsets.items()]
        self._bound.append(placed)
        rebind = [placed]
        if self.arena is None or self.arena.nbytes < peak:
            self.arena = np.empty(max(peak, ALIGNMENT) + ALIGNMENT, dtype=np.uint8)
            rebind = self._bound
        base = -self.arena.ctypes.data % ALIGNMENT
        for group in rebind:
            for t, off in group:
                t.bind(self.arena, base + off)
