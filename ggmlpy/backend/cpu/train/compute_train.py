"""Preparers for reductions, tiling and the training ops (losses, `*_back`, optimizer steps)."""
from __future__ import annotations

import numba
import numpy as np

from ....tensor import Op, Tensor
from ..plan import Plan
from ..plan.kernel_table import PARALLEL_MIN_ELEMENTS, KernelTable, Prepared, require_f32
from . import train_kernels as TK

KERNELS = KernelTable()


def _flat(t: Tensor) -> np.ndarray:
    """The tensor's elements as a 1-d view (never a copy: kernels write through it)."""
    if not t.is_contiguous():
        raise NotImplementedError(f"tensor {t.name!r} must be contiguous here")
    return np.reshape(t.array(), -1, copy=False)


def _tiles(x: np.ndarray, small: tuple[int, ...]) -> np.ndarray:
    """x of shape k*n per dim seen as (k3, n3, k2, n2, k1, n1, k0, n0) for tiles of shape n."""
    shape = []
    for big, n in zip(x.shape, small):
        shape += [big // n, n]
    return x.reshape(shape)


_TILE_AXES = (0, 2, 4, 6)


@KERNELS.register(Op.SUM)
def _sum(node: Tensor, plan: Plan) -> Prepared:
    (a,) = node.src
    require_f32(node, a)
    av, dv = a.array(), node.array()
    return lambda: dv.fill(np.sum(av, dtype=np.float64))


@KERNELS.register(Op.SUM_ROWS, Op.MEAN)
def _sum_rows(node: Tensor, plan: Plan) -> Prepared:
    (a,) = node.src
    require_f32(node, a)
    av, dv = a.array(), node.array()
    div = av.shape[3] if node.op == Op.MEAN else 1

    def run() -> None:
        dv[..., 0] = np.sum(av, axis=3, dtype=np.float64) / div
    return run


@KERNELS.register(Op.REPEAT)
def _repeat(node: Tensor, plan: Plan) -> Prepared:
    (a,) = node.src
    require_f32(node, a)
    av, dv = a.array(), node.array()
    tiled = _tiles(dv, av.shape)
    a8 = av.reshape(tuple(x for n in av.shape for x in (1, n)))
    return lambda: np.copyto(tiled, a8)


@KERNELS.register(Op.REPEAT_BACK)
def _repeat_back(node: Tensor, plan: Plan) -> Prepared:
    (a,) = node.src
    require_f32(node, a)
    av, dv = a.array(), node.array()
    small = dv.shape

    def run() -> None:
        np.sum(_tiles(av, small), axis=_TILE_AXES, dtype=np.float32, out=dv)
    return run


@KERNELS.register(Op.CONCAT)
def _concat(node: Tensor, plan: Plan) -> Prepared:
    a, b = node.src
    av, bv, dv = a.array(), b.array(), node.array()
    axis = 3 - node.op_params[0]
    split = av.shape[axis]
    head = dv[(slice(None),) * axis + (slice(0, split),)]
    tail = dv[(slice(None),) * axis + (slice(split, None),)]

    def run() -> None:
        np.copyto(head, av)
        np.copyto(tail, bv)
    return run


@KERNELS.register(Op.ACC)
def _acc(node: Tensor, plan: Plan) -> Prepared:
    a, b = node.src
    require_f32(node, a, b)
    nb1, nb2, nb3, offset = node.op_params
    av, bv, dv = a.array(), b.array(), node.array()
    window = np.ndarray(bv.shape, dtype=np.float32, buffer=node.buffer, offset=node.offset + offset,
                        strides=(nb3, nb2, nb1, node.nb[0]))

    def run() -> None:
        np.copyto(dv, av)
        np.add(window, bv, out=window)
    return run


@KERNELS.register(Op.ARGMAX)
def _argmax(node: Tensor, plan: Plan) -> Prepared:
    (a,) = node.src
    require_f32(node, a)
    av, dv = a.array()[0, 0], node.array()[0, 0, 0]
    return lambda: np.copyto(dv, np.argmax(av, axis=1), casting="unsafe")


@KERNELS.register(Op.COUNT_EQUAL)
def _count_equal(node: Tensor, plan: Plan) -> Prepared:
    a, b = node.src
    av, bv, dv = a.array(), b.array(), node.array()
    return lambda: dv.fill(np.count_nonzero(av == bv))


def _by_logits(node: Tensor) -> bool:
    """A loss is one number: whether its logits are worth every thread."""
    return node.src[0].nelements() >= PARALLEL_MIN_ELEMENTS


@KERNELS.register(Op.CROSS_ENTROPY_LOSS, parallel=_by_logits)
def _cross_entropy_loss(node: Tensor, plan: Plan) -> Prepared:
    logits, labels, *weights = node.src
    require_f32(node, logits, *(weights or [labels]))
    lv, dv = logits.array(), node.array()
    rows = np.empty(logits.nrows(), dtype=np.float64)
    kernel, args = _ce_labels(TK.cross_entropy_rows, TK.cross_entropy_rows_ids, labels, weights)
    n0, scratch = logits.ne[0], plan.scratch

    def run() -> None:
        threads = numba.get_num_threads()  # one work row per thread, the backend's scratch
        kernel(lv, *args, rows, scratch.get("cross-entropy rows", threads * n0).reshape(threads, n0))
        dv.fill(np.sum(rows) / rows.shape[0])
    return run


@KERNELS.register(Op.CROSS_ENTROPY_LOSS_BACK)
def _cross_entropy_loss_back(node: Tensor, plan: Plan) -> Prepared:
    grad, logits, labels, *weights = node.src
    require_f32(node, grad, logits, *(weights or [labels]))
    gv, lv, dv = grad.array().reshape(-1), logits.array(), node.array()
    kernel, args = _ce_labels(TK.cross_entropy_back_f32, TK.cross_entropy_back_ids_f32, labels, weights)
    return lambda: kernel(np.float64(gv[0]), lv, *args, dv)


def _ce_labels(dense, by_id, labels: Tensor, weights: list[Tensor]):
    """The kernel for the labels' form and its label arguments: label rows (dense), or
    ids and weights, one per row (by_id)."""
    if weights:
        return by_id, (labels.array()[0], weights[0].array()[0])
    return dense, (labels.array(),)


# the gradients computed from the incoming gradient and one saved tensor (the op's input or
# output): kernel(grad, saved, dst, *the first n float op params)
_GRADIENTS = {Op.RMS_NORM_BACK: (TK.rms_norm_back_f32, 1), Op.SOFT_MAX_BACK: (TK.soft_max_back_f32, 1),
              Op.SILU_BACK: (TK.silu_back_f32, 0), Op.GELU_BACK: (TK.gelu_back_f32, 0)}


@KERNELS.register(*_GRADIENTS)
def _gradient(node: Tensor, plan: Plan) -> Prepared:
    g, saved = node.src
    require_f32(node, g, saved)
    kernel, n_params = _GRADIENTS[node.op]
    gv, sv, dv, params = g.array(), saved.array(), node.array(), tuple(float(p) for p in node.op_params[:n_params])
    return lambda: kernel(gv, sv, dv, *params)


@KERNELS.register(Op.GET_ROWS_BACK)
def _get_rows_back(node: Tensor, plan: Plan) -> Prepared:
    g, rows = node.src
    require_f32(node, g)
    gv, iv, dv = g.array(), rows.array()[0], node.array()
    return lambda: TK.get_rows_back_f32(gv, iv, dv)


@KERNELS.register(Op.OPT_STEP_ADAMW)
def _opt_step_adamw(node: Tensor, plan: Plan) -> Prepared:
    w, g, m, v, params = node.src
    require_f32(node, w, g, m, v)
    wv, gv, mv, vv, pv = _flat(w), _flat(g), _flat(m), _flat(v), _flat(params)
    return lambda: TK.adamw_step_f32(wv, gv, mv, vv, pv)


@KERNELS.register(Op.OPT_STEP_SGD)
def _opt_step_sgd(node: Tensor, plan: Plan) -> Prepared:
    w, g, params = node.src
    require_f32(node, w, g)
    wv, gv, pv = _flat(w), _flat(g), _flat(params)
    return lambda: TK.sgd_step_f32(wv, gv, pv)
