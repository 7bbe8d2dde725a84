"""Reverse-mode autodiff: `build_backward_expand` appends the gradient graph (ggml's twin).

Gradients flow from the tensor flagged `loss` (seeded with ones) back to every tensor
flagged `param`. Only nodes that both depend on a param and feed the loss get a
gradient, so nothing is computed for the rest. A tensor feeding several nodes sums
their contributions. Each differentiable op's rule lives in `RULES`; the op registry
(registry.py) says which ops and inputs (indices, masks, positions) have no gradient, and
why, so a graph asking for one is refused by name.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from . import ops as O
from . import ops_train as OT
from .context import Context
from .graph import Graph
from .recompute import Recomputer
from .registry import OPS
from .tensor import Flag, Op, Tensor
from .types import GGMLType, traits

Contribs = list[Tensor | None]
Rule = Callable[[Context, Tensor, Tensor, tuple[bool, ...]], Contribs]
RULES: dict[Op, Rule] = {}  # exactly the registry's differentiable ops (tests check)


class NotDifferentiableError(ValueError):
    pass


def rule(*ops: Op):
    def register(fn: Rule) -> Rule:
        for op in ops:
            RULES[op] = fn
        return fn
    return register


def _constant(ctx: Context, ne: tuple[int, ...], value: float, name: str) -> Tensor:
    """A leaf holding `value` everywhere, with its own memory (never planned or overwritten)."""
    t = Tensor(GGMLType.F32, ne, name=name)
    t.bind(np.full(max(t.nelements(), 1), value, dtype=np.float32).view(np.uint8))
    return ctx.add(t)


def build_backward_expand(ctx: Context, graph: Graph, grad_accs: dict[int, Tensor] | None = None,
                          checkpoints: Sequence[Tensor] | None = None) -> Graph:
    """Append to `graph` the gradients of its loss with respect to its params.

    `grad_accs` (param id -> F32 tensor of the param's shape with memory of its own)
    makes each param's gradient accumulate into that tensor across computes, for
    gradient accumulation; without it each compute produces a fresh gradient. Either
    way `graph.grads[id(param)]` is the tensor to read, and it survives the compute.

    As in ggml, each gradient joins the graph as soon as it is built, walking the forward
    nodes backwards, so a forward intermediate's last use (and a param's gradient, added
    into its accumulator once complete) comes as early as the chain rule allows, which
    is what lets the planned allocator reuse their memory.

    `checkpoints` (forward nodes) turns on gradient checkpointing (see recompute.py):
    the backward nodes then read the checkpoints and recomputed copies of every other
    forward intermediate they need, made right before their first consumer, so the
    forward pass keeps only the checkpoints alive for the backward pass.
    """
    losses = [t for t in graph.nodes if t.flags & Flag.LOSS]
    if not losses:
        raise ValueError("build_backward_expand: no tensor in the graph is flagged loss")
    needs = _depends_on_params(graph)
    feeds = _feeds(graph, losses)
    grads: dict[int, Tensor] = {id(t): _constant(ctx, t.ne, 1.0, f"{t.name or 'loss'} grad seed") for t in losses}
    recompute = Recomputer(ctx, graph, checkpoints) if checkpoints is not None else None

    def expand(t: Tensor) -> None:
        if recompute is not None:
            recompute.rewrite(t)
        graph.visit(t)

    graph.grads, graph.grad_accs = {}, {}
    for node in reversed(list(graph.nodes)):
        g = grads.get(id(node))
        if g is None:
            continue
        if node.flags & Flag.PARAM:  # every consumer of a param comes after it: its gradient is complete
            _param_grad(ctx, graph, node, g, (grad_accs or {}).get(id(node)), expand)
            continue
        wants = tuple(id(s) in needs and id(s) in feeds for s in node.src)
        if not any(wants):  # leafs (no sources) included
            continue
        _check_differentiable(node.op, wants)
        for src, want, contrib in zip(node.src, wants, RULES[node.op](ctx, node, g, wants)):
            if not want or contrib is None:
                continue
            prev = grads.get(id(src))
            grads[id(src)] = contrib if prev is None else O.add(ctx, prev, contrib)
            expand(grads[id(src)])
    return graph


def _param_grad(ctx: Context, graph: Graph, p: Tensor, g: Tensor, acc: Tensor | None,
                expand: Callable[[Tensor], None]) -> None:
    """Make `g` the gradient output of param `p` (added into `acc` when given)."""
    if not g.is_contiguous():
        g = O.cont(ctx, g)
    if acc is not None:
        g = O.add_inplace(ctx, acc, g)
        graph.grad_accs[id(p)] = acc
    g.set_output()
    g.set_name(f"{p.name} grad")
    graph.grads[id(p)] = g
    expand(g)


def _check_differentiable(op: Op, wants: tuple[bool, ...]) -> None:
    info = OPS[op]
    if not info.differentiable:
        raise NotDifferentiableError(f"{op.name} is not differentiable: {info.forward_only}")
    for i, want in enumerate(wants):
        if want and i in info.no_grad:
            raise NotDifferentiableError(f"{op.name} is not differentiable with respect to {info.no_grad[i]}")


def _depends_on_params(graph: Graph) -> set[int]:
    out = set()
    for node in graph.nodes:
        if node.flags & Flag.PARAM or any(id(s) in out for s in node.src):
            out.add(id(node))
    return out


def _feeds(graph: Graph, losses: list[Tensor]) -> set[int]:
    """Ids of the tensors the losses are computed from (themselves included)."""
    out = {id(t) for t in losses}
    for node in reversed(graph.nodes):
        if id(node) in out:
            out.update(id(s) for s in node.src)
    return out


# ---- helpers --------------------------------------------------------------------------------
def _to_shape(ctx: Context, g: Tensor, like: Tensor) -> Tensor:
    """g (same element count as `like`) given `like`'s shape."""
    if g.ne == like.ne:
        return g
    if not g.is_contiguous():
        g = O.cont(ctx, g)
    return O.reshape(ctx, g, *like.ne)


def _reduce_to(ctx: Context, g: Tensor, like: Tensor) -> Tensor:
    """The gradient of a broadcast operand: g's tiles summed into `like`'s shape."""
    return g if g.ne == like.ne else O.repeat_back(ctx, g, like)


def _sum_groups(ctx: Context, t: Tensor, like: Tensor) -> Tensor:
    """Sum contiguous `t` [n0, n1, n12, n13] over the blocks of dims 2/3 that mul_mat's
    broadcasting maps to one matrix of `like` (i12 = i02 * r2 + j: consecutive blocks)."""
    n0, n1, n12, n13 = t.ne
    n02, n03 = like.ne[2], like.ne[3]
    if n13 != n03:
        t = O.repeat_back(ctx, O.reshape(ctx, t, n0 * n1 * n12, n13 // n03, n03),
                          _shape_only(ctx, (n0 * n1 * n12, 1, n03, 1)))
        t = O.reshape(ctx, t, n0, n1, n12, n03)
    if n12 != n02:
        t = O.repeat_back(ctx, O.reshape(ctx, t, n0 * n1, n12 // n02, n02, n03),
                          _shape_only(ctx, (n0 * n1, 1, n02, n03)))
        t = O.reshape(ctx, t, n0, n1, n02, n03)
    return t


def _shape_only(ctx: Context, ne: tuple[int, int, int, int]) -> Tensor:
    """A shape for ops that take one from a tensor (repeat/repeat_back); never computed."""
    return Tensor(GGMLType.F32, ne)


# ---- rules: element-wise algebra ------------------------------------------------------------
@rule(Op.ADD)
def _add(ctx, node, g, wants):
    a, b = node.src
    return [g, _reduce_to(ctx, g, b)]


@rule(Op.SUB)
def _sub(ctx, node, g, wants):
    a, b = node.src
    return [g, _reduce_to(ctx, O.scale(ctx, g, -1.0), b) if wants[1] else None]


@rule(Op.MUL)
def _mul(ctx, node, g, wants):
    a, b = node.src
    return [O.mul(ctx, g, b) if wants[0] else None,
            _reduce_to(ctx, O.mul(ctx, g, a), b) if wants[1] else None]


@rule(Op.DIV)
def _div(ctx, node, g, wants):
    a, b = node.src
    da = O.div(ctx, g, b) if wants[0] else None
    db = None
    if wants[1]:  # d(a/b)/db = -(a/b)/b
        db = _reduce_to(ctx, O.scale(ctx, O.mul(ctx, g, O.div(ctx, node, b)), -1.0), b)
    return [da, db]


@rule(Op.SCALE)
def _scale(ctx, node, g, wants):
    return [O.scale(ctx, g, node.op_params[0])]


@rule(Op.SQR)
def _sqr(ctx, node, g, wants):
    return [O.mul(ctx, O.scale(ctx, node.src[0], 2.0), g)]


@rule(Op.SQRT)
def _sqrt(ctx, node, g, wants):
    return [O.div(ctx, O.scale(ctx, g, 0.5), node)]


@rule(Op.LOG)
def _log(ctx, node, g, wants):
    return [O.div(ctx, g, node.src[0])]


@rule(Op.EXP)
def _exp(ctx, node, g, wants):
    return [O.mul(ctx, g, node)]


# ---- rules: reductions and tiling ----------------------------------------------------------
@rule(Op.SUM, Op.SUM_ROWS)
def _sum(ctx, node, g, wants):
    return [O.repeat(ctx, g, node.src[0])]


@rule(Op.MEAN)
def _mean(ctx, node, g, wants):
    a = node.src[0]
    return [O.scale(ctx, O.repeat(ctx, g, a), 1.0 / a.ne[0])]


@rule(Op.REPEAT)
def _repeat(ctx, node, g, wants):
    return [O.repeat_back(ctx, g, node.src[0])]


@rule(Op.REPEAT_BACK)
def _repeat_back(ctx, node, g, wants):
    return [O.repeat(ctx, g, node.src[0])]


@rule(Op.ACC)
def _acc(ctx, node, g, wants):
    a, b = node.src
    nb1, nb2, nb3, offset = node.op_params
    db = O.view(ctx, g, b.ne, (nb1, nb2, nb3), offset) if wants[1] else None
    return [g, db]


@rule(Op.CONCAT)
def _concat(ctx, node, g, wants):
    a, b = node.src
    dim = node.op_params[0]
    return [O.view(ctx, g, a.ne, g.nb[1:], 0) if wants[0] else None,
            O.view(ctx, g, b.ne, g.nb[1:], a.ne[dim] * g.nb[dim]) if wants[1] else None]


# ---- rules: normalization, activations, attention pieces --------------------------------------
@rule(Op.RMS_NORM)
def _rms_norm(ctx, node, g, wants):
    return [OT.rms_norm_back(ctx, g, node.src[0], node.op_params[0])]


@rule(Op.NORM)
def _norm(ctx, node, g, wants):
    """dx = (g - mean(g) - y * mean(g * y)) / sigma, sigma = sqrt(var(x) + eps)."""
    x, y, eps = node.src[0], node, node.op_params[0]
    centred = O.sub(ctx, x, O.mean(ctx, x))
    sigma = O.sqrt(ctx, O.scale(ctx, O.mean(ctx, O.sqr(ctx, centred)), 1.0, eps))
    t = O.sub(ctx, O.sub(ctx, g, O.mean(ctx, g)), O.mul(ctx, y, O.mean(ctx, O.mul(ctx, g, y))))
    return [O.div(ctx, t, sigma)]


@rule(Op.SILU)
def _silu(ctx, node, g, wants):
    return [OT.silu_back(ctx, g, node.src[0])]


@rule(Op.GELU)
def _gelu(ctx, node, g, wants):
    return [OT.gelu_back(ctx, g, node.src[0])]


@rule(Op.SWIGLU, Op.GEGLU)
def _glu(ctx, node, g, wants):
    a, b = node.src
    act, act_back = (O.silu, OT.silu_back) if node.op == Op.SWIGLU else (O.gelu, OT.gelu_back)
    return [act_back(ctx, O.mul(ctx, g, b), a) if wants[0] else None,
            O.mul(ctx, g, act(ctx, a)) if wants[1] else None]


@rule(Op.SOFT_MAX)
def _soft_max(ctx, node, g, wants):
    scale, max_bias = node.op_params
    return [OT.soft_max_ext_back(ctx, g, node, scale, max_bias), None]


@rule(Op.ROPE)
def _rope(ctx, node, g, wants):
    return [OT.rope_back(ctx, g, node)] + [None] * (len(node.src) - 1)


@rule(Op.CROSS_ENTROPY_LOSS)
def _cross_entropy_loss(ctx, node, g, wants):
    logits, labels, *weights = node.src
    return [OT.cross_entropy_loss_back(ctx, g, logits, labels, *weights), None] + [None] * len(weights)


@rule(Op.LINEAR_CROSS_ENTROPY)
def _linear_cross_entropy(ctx, node, g, wants):
    return [OT.linear_cross_entropy_back(ctx, g, node, 0) if wants[0] else None,
            OT.linear_cross_entropy_back(ctx, g, node, 1) if wants[1] else None, None, None]


# ---- rules: matrix products and rows -----------------------------------------------------------
@rule(Op.MUL_MAT)
def _mul_mat(ctx, node, g, wants):
    """node = b a^T per matrix: da = g^T b (summed over broadcast copies), db = g a."""
    a, b = node.src
    da = _sum_groups(ctx, O.out_prod(ctx, b, g), a) if wants[0] else None
    db = None
    if wants[1]:
        # a quantized (frozen) a is read from its packed rows, never transposed or expanded
        db = O.out_prod(ctx, a, O.transpose(ctx, g)) if traits(a.type).is_quantized else \
            O.mul_mat(ctx, O.transpose(ctx, a), g)
    return [da, db]


@rule(Op.OUT_PROD)
def _out_prod(ctx, node, g, wants):
    a, b = node.src
    da = _sum_groups(ctx, O.cont(ctx, O.mul_mat(ctx, O.transpose(ctx, g), b)), a) if wants[0] else None
    db = O.transpose(ctx, O.mul_mat(ctx, a, g)) if wants[1] else None  # a broadcasts over g's batch
    return [da, db]


@rule(Op.GET_ROWS)
def _get_rows(ctx, node, g, wants):
    a, rows = node.src
    return [OT.get_rows_back(ctx, g, rows, a), None]


# ---- rules: copies and views -------------------------------------------------------------------
@rule(Op.CPY)
def _cpy(ctx, node, g, wants):
    return [_to_shape(ctx, g, node.src[0]), None]


@rule(Op.CONT, Op.DUP, Op.RESHAPE)
def _same_elements(ctx, node, g, wants):
    return [_to_shape(ctx, g, node.src[0])]


@rule(Op.PERMUTE)
def _permute(ctx, node, g, wants):
    axes = node.op_params
    inverse = [0] * 4
    for i, ax in enumerate(axes):
        inverse[ax] = i
    return [O.permute(ctx, g, *inverse)]


@rule(Op.TRANSPOSE)
def _transpose(ctx, node, g, wants):
    return [O.transpose(ctx, g)]


@rule(Op.VIEW)
def _view(ctx, node, g, wants):
    """The view's gradient added into zeros shaped like its source, at the view's place."""
    src = node.src[0]
    if not src.is_contiguous():
        raise NotDifferentiableError(f"VIEW of a non-contiguous tensor {src.name!r}: take the view of cont() of it")
    offset = node.view_offs - (src.view_offs if src.view_src is not None else 0)
    zeros = _constant(ctx, src.ne, 0.0, f"zeros like {src.name}")
    return [O.acc(ctx, zeros, g, node.nb[1], node.nb[2], node.nb[3], offset)]
