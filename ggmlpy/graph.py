"""Compute graphs: the nodes reachable from chosen tensors, in dependency order."""
from __future__ import annotations

from .tensor import Flag, Op, Tensor


class Graph:
    """`nodes` are computed in order; `leafs` are tensors without an op (weights, inputs).

    A graph can be computed many times: a backend prepares a plan for it once and reuses
    it while the graph (nodes are only ever appended) and the memory of its tensors stay
    the same.
    """

    def __init__(self) -> None:
        self.nodes: list[Tensor] = []
        self.leafs: list[Tensor] = []
        self._seen: set[int] = set()
        self.grads: dict[int, Tensor] = {}      # param id -> its gradient (build_backward_expand)
        self.grad_accs: dict[int, Tensor] = {}  # param id -> its gradient accumulator

    def copy(self) -> "Graph":
        """A graph with the same nodes, to extend without changing this one (ggml_graph_dup)."""
        g = Graph()
        g.nodes, g.leafs, g._seen = list(self.nodes), list(self.leafs), set(self._seen)
        g.grads, g.grad_accs = dict(self.grads), dict(self.grad_accs)
        return g

    def get_grad(self, tensor: Tensor) -> Tensor | None:
        return self.grads.get(id(tensor))

    def __len__(self) -> int:
        return len(self.nodes)

    def visit(self, tensor: Tensor) -> None:
        """Append `tensor` and everything it depends on, sources first (ggml's visit order)."""
        stack = [(tensor, False)]
        while stack:
            t, expanded = stack.pop()
            if id(t) in self._seen:
                continue
            if expanded:
                self._seen.add(id(t))
                if t.op == Op.NONE and not t.flags & Flag.PARAM:
                    self.leafs.append(t)
                else:
                    self.nodes.append(t)
                continue
            stack.append((t, True))
            for s in reversed(t.src):
                if id(s) not in self._seen:
                    stack.append((s, False))


def build_forward_expand(graph: Graph, tensor: Tensor) -> Graph:
    graph.visit(tensor)
    return graph


def new_graph(*outputs: Tensor) -> Graph:
    graph = Graph()
    for t in outputs:
        graph.visit(t)
    return graph
