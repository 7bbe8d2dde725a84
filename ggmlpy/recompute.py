"""Gradient checkpointing: a backward graph that recomputes forward intermediates instead
of keeping them (the idea of ggml's old ggml_build_backward_gradient_checkpointing).

Without it, every forward intermediate a gradient rule reads (a norm's input, a softmax's
output, the activations a weight's gradient multiplies) lives from the forward pass until
its backward consumer, so a training graph holds the activations of every layer at once.
With checkpoints, the backward nodes read instead:

- the checkpoints themselves (kept alive from the forward pass: a few small tensors,
  such as a model's residual stream at layer boundaries);
- tensors that are kept anyway: leafs, params, graph inputs and outputs, tensors with
  memory of their own, and views of those;
- recomputed copies of every other forward node: the same op on the recomputed copies of
  its sources, made once and shared by all its backward consumers.

`build_backward_expand` adds each gradient to the graph as soon as it is built, so a copy
is computed right before its first backward consumer: the backward pass recomputes one
segment (the forward nodes between consecutive checkpoints) at a time, the allocator
frees the forward pass's intermediates as soon as the forward pass is done with them, and
a segment's copies as soon as its backward is. Recomputation repeats the same kernels on
the same inputs: the gradients are those of the plain graph.

Which tensors are checkpoints is the caller's business (ggmlpy knows no model);
`checkpoint_stride` says which k makes the estimated peak smallest when every k-th of a
sequence of candidate boundaries is kept.
"""
from __future__ import annotations

from collections.abc import Sequence

from .context import Context
from .graph import Graph
from .registry import OPS, OpKind
from .tensor import Flag, Tensor

_KEPT_FLAGS = Flag.INPUT | Flag.OUTPUT | Flag.PARAM


class Recomputer:
    """The forward nodes of `graph` as the backward pass reads them: `copy(t)` is t itself
    when t is a checkpoint or kept anyway, else its recomputed copy (made once)."""

    def __init__(self, ctx: Context, graph: Graph, checkpoints: Sequence[Tensor]) -> None:
        self.ctx = ctx
        self.forward = {id(t) for t in graph.nodes}
        # a kept view (an output that reshapes a node, say) keeps the bytes it views (as the allocator does)
        self.kept_bases = {id(t.view_src) for t in graph.nodes if t.view_src is not None and t.flags & _KEPT_FLAGS}
        for c in checkpoints:
            if id(c) not in self.forward:
                raise ValueError(f"gradient checkpointing: checkpoint {c.name or c!r} is not a node of the graph")
        self.copies: dict[int, Tensor] = {id(c): c for c in checkpoints}  # forward node id -> what backward reads
        self.made: set[int] = set()       # ids of the recomputed copies
        self.rewritten: set[int] = set()  # ids of backward tensors already pointed at the copies

    def kept(self, t: Tensor) -> bool:
        """Whether t's bytes outlive the forward pass without recomputation."""
        if OPS[t.op].kind is OpKind.LEAF or t.flags & _KEPT_FLAGS:
            return True
        if t.view_src is not None:
            return self.copy(t.view_src) is t.view_src
        return t.has_data or id(t) in self.kept_bases  # memory of its own, outside the arena, or pinned

    def copy(self, t: Tensor) -> Tensor:
        """What the backward pass reads for tensor t (t itself unless it is recomputed)."""
        if id(t) in self.copies or id(t) not in self.forward:
            return self.copies.get(id(t), t)
        stack = [t]
        while stack:  # sources first, without recursion (a graph may be thousands of nodes deep)
            u = stack[-1]
            if id(u) in self.copies:
                stack.pop()
                continue
            pending = [s for s in (*u.src, *((u.view_src,) if u.view_src is not None else ()))
                       if id(s) in self.forward and id(s) not in self.copies]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            self.copies[id(u)] = u if self.kept(u) else self._clone(u)
        return self.copies[id(t)]

    def _clone(self, t: Tensor) -> Tensor:
        if t.view_src is not None and OPS[t.op].kind is OpKind.COMPUTE:
            raise ValueError(f"gradient checkpointing: cannot recompute {t.op.name} node {t.name!r}: it writes "
                             "into another tensor's bytes (make that tensor a checkpoint)")
        view_src = self.copies.get(id(t.view_src), t.view_src) if t.view_src is not None else None
        clone = Tensor(t.type, t.ne, t.nb, op=t.op, src=tuple(self.copies.get(id(s), s) for s in t.src),
                       op_params=t.op_params, view_src=view_src, view_offs=t.view_offs,
                       name=f"{t.name} (recomputed)" if t.name else "recomputed")
        self.made.add(id(clone))
        return self.ctx.add(clone)

    def rewrite(self, t: Tensor) -> None:
        """Point the backward tensors t is built from at what the backward pass reads."""
        stack = [t]
        while stack:
            u = stack.pop()
            if id(u) in self.forward or id(u) in self.made or id(u) in self.rewritten:
                continue
            self.rewritten.add(id(u))
            u.src = tuple(self.copy(s) for s in u.src)
            if u.view_src is not None:
                u.view_src = self.copy(u.view_src)
            stack.extend(u.src)


def checkpoint_stride(graph: Graph, boundaries: Sequence[Tensor]) -> int:
    """The k for which keeping every k-th of `boundaries` (forward nodes of `graph` in
    computation order, e.g. a network's activations between blocks; the first is always
    kept) gives the smallest `estimated_peak`; the smallest such k on ties."""
    if not boundaries:
        raise ValueError("gradient checkpointing: no boundary to keep")
    sizes = _segment_bytes(graph, boundaries)
    return min(range(1, len(boundaries) + 1), key=lambda k: _peak(boundaries, *sizes, k))


def estimated_peak(graph: Graph, boundaries: Sequence[Tensor], k: int) -> int:
    """The arena bytes the backward pass holds at its fullest when every k-th boundary is
    kept, as a timeline of forward intermediates: first the tail (what follows the last
    boundary, a network's head and loss, whose gradient the backward pass takes first)
    with every kept boundary; then, group by group backwards, the k segments between
    kept boundaries recomputed at once, with the kept boundaries up to the group's first.
    Segments are the nodes between consecutive boundaries in computation order."""
    return _peak(boundaries, *_segment_bytes(graph, boundaries), k)


def _segment_bytes(graph: Graph, boundaries: Sequence[Tensor]) -> tuple[list[int], int]:
    """The arena bytes of the forward nodes between consecutive boundaries, and after the last."""
    position = {id(t): i for i, t in enumerate(graph.nodes)}
    missing = [b.name or repr(b) for b in boundaries if id(b) not in position]
    if missing:
        raise ValueError(f"gradient checkpointing: boundary {missing[0]} is not a node of the graph")
    at = [position[id(b)] for b in boundaries]
    segments = [sum(_arena_bytes(n) for n in graph.nodes[lo + 1:hi]) for lo, hi in zip(at, at[1:])]
    return segments, sum(_arena_bytes(n) for n in graph.nodes[at[-1] + 1:])


def _peak(boundaries: Sequence[Tensor], segments: list[int], tail: int, k: int) -> int:
    kept = [b.nbytes() if i % k == 0 else 0 for i, b in enumerate(boundaries)]
    peak = sum(kept) + tail
    for first in range(0, len(segments), k):
        peak = max(peak, sum(kept[:first + 1]) + sum(segments[first:first + k]))
    return peak


def _arena_bytes(t: Tensor) -> int:
    """Bytes the allocator would place for t (views and tensors with memory take none)."""
    return 0 if t.view_src is not None or t.has_data or OPS[t.op].kind is not OpKind.COMPUTE else t.nbytes()
