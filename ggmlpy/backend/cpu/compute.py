"""Per-op preparation: each node becomes a closure over fixed numpy views of its operands.

Preparing once per graph keeps Python out of the repeated work: computing a graph is
a loop of calls, each straight into numpy/BLAS or a numba kernel.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ... import convert
from ...tensor import Op, Tensor
from ...types import GGMLType, traits
from . import kernels as K

Prepared = Callable[[], None]
PREPARE: dict[Op, Callable[[Tensor], Prepared]] = {}
_EMPTY_F32 = np.zeros((1, 1, 1, 1), dtype=np.float32)


def prepares(*ops: Op):
    def register(fn):
        for op in ops:
            PREPARE[op] = fn
        return fn
    return register


def prepare(node: Tensor) -> Prepared:
    try:
        fn = PREPARE[node.op]
    except KeyError:
        raise NotImplementedError(f"CPU backend has no kernel for {node.op.name}") from None
    return fn(node)


def _require_f32(node: Tensor, *tensors: Tensor) -> None:
    for t in tensors:
        if t.type != GGMLType.F32:
            raise NotImplementedError(f"{node.op.name} on {t.type.name} operand {t.name!r} is not supported")


def broadcast_views(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """Views of a and b whose numpy broadcasting equals ggml's repeat of b over a.

    ggml repeats b when a's size is a multiple of b's (not only when b's size is 1);
    such a dimension of size k*m is split into (k, m) so that numpy sees (1, m) for b.
    """
    a_shape, b_shape = [], []
    for na, nb in zip(a.shape, b.shape):
        if na == nb or nb == 1:
            a_shape.append(na)
            b_shape.append(nb)
        else:
            a_shape += [na // nb, nb]
            b_shape += [1, nb]
    return a.reshape(a_shape), b.reshape(b_shape), tuple(a_shape)


_BINARY = {Op.ADD: np.add, Op.SUB: np.subtract, Op.MUL: np.multiply, Op.DIV: np.divide}


@prepares(Op.ADD, Op.SUB, Op.MUL, Op.DIV)
def _binary(node: Tensor) -> Prepared:
    a, b = node.src
    _require_f32(node, a, b, node)
    ufunc = _BINARY[node.op]
    av, bv, shape = broadcast_views(a.array(), b.array())
    dv = node.array().reshape(shape)
    return lambda: ufunc(av, bv, out=dv)


@prepares(Op.SCALE)
def _scale(node: Tensor) -> Prepared:
    (a,) = node.src
    _require_f32(node, a)
    av, dv = a.array(), node.array()
    s, b = np.float32(node.op_params[0]), np.float32(node.op_params[1])
    if b == 0:
        return lambda: np.multiply(av, s, out=dv)

    def run() -> None:
        np.multiply(av, s, out=dv)
        np.add(dv, b, out=dv)
    return run


_UNARY_NUMPY = {Op.SQR: np.square, Op.SQRT: np.sqrt, Op.LOG: np.log, Op.EXP: np.exp}


@prepares(Op.SQR, Op.SQRT, Op.LOG, Op.EXP)
def _unary_numpy(node: Tensor) -> Prepared:
    (a,) = node.src
    _require_f32(node, a)
    ufunc = _UNARY_NUMPY[node.op]
    av, dv = a.array(), node.array()
    return lambda: ufunc(av, out=dv)


_UNARY_NUMBA = {Op.SILU: K.silu_f32, Op.GELU: K.gelu_f32}


@prepares(Op.SILU, Op.GELU)
def _unary_numba(node: Tensor) -> Prepared:
    (a,) = node.src
    _require_f32(node, a)
    kernel = _UNARY_NUMBA[node.op]
    av, dv = a.array(), node.array()
    return lambda: kernel(av, dv)


_GLU = {Op.SWIGLU: K.swiglu_f32, Op.GEGLU: K.geglu_f32}


@prepares(Op.SWIGLU, Op.GEGLU)
def _glu(node: Tensor) -> Prepared:
    a, b = node.src
    _require_f32(node, a, b)
    kernel = _GLU[node.op]
    av, bv, dv = a.array(), b.array(), node.array()
    return lambda: kernel(av, bv, dv)


@prepares(Op.RMS_NORM, Op.NORM)
def _norm(node: Tensor) -> Prepared:
    (a,) = node.src
    _require_f32(node, a)
    kernel = K.rms_norm_f32 if node.op == Op.RMS_NORM else K.norm_f32
    av, dv, eps = a.array(), node.array(), np.float32(node.op_params[0])
    return lambda: kernel(av, dv, eps)


@prepares(Op.SOFT_MAX)
def _soft_max(node: Tensor) -> Prepared:
    a = node.src[0]
    _require_f32(node, a)
    scale, max_bias = node.op_params
    av, dv = a.array(), node.array()
    if len(node.src) > 1:
        mask = node.src[1]
        mv = mask.array()
        if mask.type not in (GGMLType.F32, GGMLType.F16):
            raise NotImplementedError(f"SOFT_MAX mask of type {mask.type.name}")
        if mask.type == GGMLType.F16:
            return lambda: K.soft_max_f32(av, mv.astype(np.float32), dv, scale, max_bias, True)
        return lambda: K.soft_max_f32(av, mv, dv, scale, max_bias, True)
    return lambda: K.soft_max_f32(av, _EMPTY_F32, dv, scale, max_bias, False)


def _rope_args(node: Tensor):
    n_dims, mode, n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow = node.op_params
    corr0, corr1 = K.rope_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow)
    return (n_dims, mode == 2, freq_base, freq_scale, ext_factor, attn_factor, corr0, corr1)


@prepares(Op.ROPE, Op.ROPE_BACK)
def _rope(node: Tensor) -> Prepared:
    a, pos = node.src[0], node.src[1]
    _require_f32(node, a)
    ffv = node.src[2].array().reshape(-1) if len(node.src) > 2 else np.ones(1, dtype=np.float32)
    has_ff = len(node.src) > 2
    av, pv, dv = a.array(), pos.array().reshape(-1), node.array()
    args = _rope_args(node)
    sign = 1.0 if node.op == Op.ROPE else -1.0
    return lambda: K.rope_f32(av, pv, ffv, dv, *args, has_ff, sign)


@prepares(Op.GET_ROWS)
def _get_rows(node: Tensor) -> Prepared:
    a, b = node.src
    idx = b.array()[0]  # (ne12, ne11, ne10)
    dv = node.array()
    tr = traits(a.type)
    if tr.is_quantized:
        raise NotImplementedError(f"GET_ROWS from {a.type.name}")
    av = a.array()
    if a.type == GGMLType.BF16:
        return lambda: K.get_rows(convert.bf16_to_f32(av), idx, dv)
    return lambda: K.get_rows(av, idx, dv)


@prepares(Op.SET_ROWS)
def _set_rows(node: Tensor) -> Prepared:
    dst_t, src_t, idx_t = node.src
    _require_f32(node, src_t)
    dv, sv, iv = node.array(), src_t.array(), idx_t.array()[0]
    n3, n2 = sv.shape[0], sv.shape[1]
    c2, c1 = iv.shape[0], iv.shape[1]
    if dst_t.type == GGMLType.BF16:
        def run() -> None:
            for i3 in range(n3):
                for i2 in range(n2):
                    dv[i3, i2][iv[i3 % c2, i2 % c1]] = convert.f32_to_bf16(sv[i3, i2])
        return run

    def run() -> None:
        for i3 in range(n3):
            for i2 in range(n2):
                dv[i3, i2][iv[i3 % c2, i2 % c1]] = sv[i3, i2]
    return run


@prepares(Op.CPY, Op.CONT, Op.DUP)
def _copy(node: Tensor) -> Prepared:
    src = node.src[0]
    if traits(src.type).is_quantized or traits(node.type).is_quantized:
        if src.type != node.type:
            raise NotImplementedError(f"{node.op.name} from {src.type.name} to {node.type.name}")
    sv, dv = src.array(), node.array()
    same_shape = src.ne == node.ne
    src_type, dst_type = src.type, node.type

    def run() -> None:
        values = sv if same_shape else sv.reshape(dv.shape)
        if src_type == dst_type:
            np.copyto(dv, values)
        else:
            convert.store(dv, convert.to_f32(values, src_type), dst_type)
    return run


@prepares(Op.MUL_MAT)
def _mul_mat(node: Tensor) -> Prepared:
    from .matmul import prepare_mul_mat
    return prepare_mul_mat(node)
