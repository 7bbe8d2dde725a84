"""Per-op preparation: each node becomes a closure over fixed numpy views of its operands.

Preparing once per graph keeps Python out of the repeated work: computing a graph is
a loop of calls, each straight into numpy/BLAS or a numba kernel.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from .... import convert
from ....ops import ROPE_TYPE_NEOX
from ....tensor import Op, Tensor
from ....types import GGMLType, traits
from ..attention import attention as ATT
from ..attention import small_head_attention as SHA
from ..plan import Plan
from ..plan.kernel_table import KernelTable, Prepared, read_only, require_f32
from ..products.matmul import PARALLEL_MIN_MACS
from ..products.type_table import cpu_type
from . import kernels as K

KERNELS = KernelTable()
_EMPTY_F32 = np.zeros((1, 1, 1, 1), dtype=np.float32)
MASK_TYPES = (GGMLType.F32, GGMLType.F16)  # what masks (and the tiled attention's K and V) may be


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
_BINARY_CODE = {Op.ADD: K.OP_ADD, Op.SUB: K.OP_SUB, Op.MUL: K.OP_MUL, Op.DIV: K.OP_DIV}


@KERNELS.register(Op.ADD, Op.SUB, Op.MUL, Op.DIV)
def _binary(node: Tensor, plan: Plan) -> Prepared:
    """Rows of a with rows of b repeated over them (the layers' adds and norm weights) go
    through a numba kernel; other broadcasts through numpy."""
    a, b = node.src
    require_f32(node, a, b, node)
    av, bv, dv = a.array(), b.array(), node.array()
    n0 = av.shape[-1]
    if all(x.flags.c_contiguous for x in (av, bv, dv)) and av.shape == dv.shape and bv.shape[-1] == n0 \
            and _rows_repeat(av.shape, bv.shape):
        a2, b2, d2 = read_only(av.reshape(-1, n0)), read_only(bv.reshape(-1, n0)), dv.reshape(-1, n0)
        code = _BINARY_CODE[node.op]
        return lambda: K.binary_rows_f32(a2, b2, d2, code)
    ufunc = _BINARY[node.op]
    av, bv, shape = broadcast_views(av, bv)
    dv = dv.reshape(shape)
    return lambda: ufunc(av, bv, out=dv)


def _rows_repeat(a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> bool:
    """Whether ggml's repeat of b over a is row r of a meeting row r % rows(b) of b: b is
    one row, or b's leading dims equal a's except for size-1 dims in front."""
    lead_a, lead_b = a_shape[:-1], b_shape[:-1]
    k = next((i for i, n in enumerate(lead_b) if n != 1), len(lead_b))
    return lead_b[k:] == lead_a[k:]


@KERNELS.register(Op.SCALE)
def _scale(node: Tensor, plan: Plan) -> Prepared:
    (a,) = node.src
    require_f32(node, a)
    av, dv = a.array(), node.array()
    s, b = np.float32(node.op_params[0]), np.float32(node.op_params[1])
    if b == 0:
        return lambda: np.multiply(av, s, out=dv)

    def run() -> None:
        np.multiply(av, s, out=dv)
        np.add(dv, b, out=dv)
    return run


_UNARY_NUMPY = {Op.SQR: np.square, Op.SQRT: np.sqrt, Op.LOG: np.log, Op.EXP: np.exp}


@KERNELS.register(Op.SQR, Op.SQRT, Op.LOG, Op.EXP)
def _unary_numpy(node: Tensor, plan: Plan) -> Prepared:
    (a,) = node.src
    require_f32(node, a)
    ufunc = _UNARY_NUMPY[node.op]
    av, dv = a.array(), node.array()
    return lambda: ufunc(av, out=dv)


# kernel, then the constant arguments it takes after the operands (GELU's half table, as ggml)
_UNARY_NUMBA = {Op.SILU: (K.silu_f32,), Op.GELU: (K.gelu_f32, K.GELU_TABLE)}


@KERNELS.register(Op.SILU, Op.GELU)
def _unary_numba(node: Tensor, plan: Plan) -> Prepared:
    (a,) = node.src
    require_f32(node, a)
    kernel, *consts = _UNARY_NUMBA[node.op]
    av, dv = a.array(), node.array()
    return lambda: kernel(av, dv, *consts)


_GLU = {Op.SWIGLU: (K.swiglu_f32,), Op.GEGLU: (K.geglu_f32, K.GELU_TABLE)}


@KERNELS.register(Op.SWIGLU, Op.GEGLU)
def _glu(node: Tensor, plan: Plan) -> Prepared:
    a, b = node.src
    require_f32(node, a, b)
    kernel, *consts = _GLU[node.op]
    av, bv, dv = a.array(), b.array(), node.array()
    return lambda: kernel(av, bv, dv, *consts)


@KERNELS.register(Op.RMS_NORM, Op.NORM)
def _norm(node: Tensor, plan: Plan) -> Prepared:
    (a,) = node.src
    require_f32(node, a)
    kernel = K.rms_norm_f32 if node.op == Op.RMS_NORM else K.norm_f32
    av, dv, eps = a.array(), node.array(), np.float32(node.op_params[0])
    return lambda: kernel(av, dv, eps)


@KERNELS.register(Op.SOFT_MAX)
def _soft_max(node: Tensor, plan: Plan) -> Prepared:
    a = node.src[0]
    require_f32(node, a)
    scale, max_bias = node.op_params
    av, dv = a.array(), node.array()
    if len(node.src) > 1:
        mask = node.src[1]
        mv = mask.array()
        if mask.type not in MASK_TYPES:
            raise NotImplementedError(f"SOFT_MAX mask of type {mask.type.name}")
        if mv.dtype == np.float32:  # read in place: nothing to convert per call
            return lambda: K.soft_max_f32(av, mv, dv, scale, max_bias, True, np.nan)
        mask_type = mask.type
        return lambda: K.soft_max_f32(av, convert.to_f32(mv, mask_type), dv, scale, max_bias, True, np.nan)
    return lambda: K.soft_max_f32(av, _EMPTY_F32, dv, scale, max_bias, False, np.nan)


def _attention_parallel(node: Tensor) -> bool:
    """By multiply-adds, as a product: a decode step's result is one row a head, yet the
    step reads every cell of the cache."""
    q, k, v = node.src[:3]
    return q.ne[1] * q.ne[2] * q.ne[3] * k.ne[1] * (q.ne[0] + v.ne[0]) >= PARALLEL_MIN_MACS


@KERNELS.register(Op.FLASH_ATTN_EXT, parallel=_attention_parallel)
def _flash_attn_ext(node: Tensor, plan: Plan) -> Prepared:
    """Wide heads: ggml-cpu's flash attention, rounding for rounding (attention.py): the tiled
    kernel from 64 query rows up with F16/F32 K and V of one type, the one-chunk kernel
    otherwise. Heads up to 32 values: small_head_attention.py, queries as vector lanes."""
    q, k, v = node.src[:3]
    require_f32(node, q)
    scale, max_bias, softcap = (float(p) for p in node.op_params[:3])
    qv, dv = q.array(), node.array()
    has_mask, mv, mask_type = _attn_mask(node)
    k_f32, v_f32 = _cells_f32(k), _cells_f32(v)
    if max(q.ne[0], node.ne[0]) <= SHA.MAX_HEAD_DIM:
        return _flash_attn_small_heads(qv, dv, has_mask, mv, mask_type, k_f32, v_f32, k.ne[1], (scale, max_bias, softcap))
    if q.ne[1] >= ATT.Q_TILE and k.type == v.type and k.type in MASK_TYPES:  # F16 or F32 cells
        n_kv = k.ne[1]  # the tiled kernel reads every cell of a tile some row sees: all converted

        def run() -> None:
            ATT.flash_attn_tiled(qv, k_f32(n_kv), v_f32(n_kv), convert.to_f32(mv, mask_type), dv, scale, max_bias,
                                 softcap, has_mask)
        return run
    half_k, half_v = cpu_type(k.type).floats.halves, cpu_type(v.type).floats.halves
    n_kv = k.ne[1]
    # an F16 cache is read in place, a cell at a time (its bits); others as float32 cells
    k_cells, v_cells = _cells_f16_bits(k) or k_f32, _cells_f16_bits(v) or v_f32

    def run_one_chunk() -> None:
        mask = convert.to_f32(mv, mask_type)
        # the one-chunk kernel never reads a masked cell: a decode step converts the cache only
        # up to the last cell some query sees, not the whole padded length
        used = K.attn_cells_seen(mask) if has_mask else n_kv
        ATT.flash_attn_one_chunk(qv, k_cells(used), v_cells(used), mask, dv, scale, max_bias,
                                 softcap, has_mask, half_k, half_v)
    return run_one_chunk


def _cells_f16_bits(t: Tensor) -> Callable[[int], np.ndarray] | None:
    """For an F16 K or V: a reader of its cells' bits ([n3, n_kv, n_head_kv, d] uint16, in
    place: nothing converted or copied); None for other types."""
    if not cpu_type(t.type).floats.halves:
        return None
    bits = t.array().transpose(0, 2, 1, 3).view(np.uint16)
    return lambda used: bits


def _flash_attn_small_heads(qv: np.ndarray, dv: np.ndarray, has_mask: bool, mv: np.ndarray, mask_type: GGMLType,
                            k_f32: Callable[[int], np.ndarray], v_f32: Callable[[int], np.ndarray], n_kv: int,
                            params: tuple[float, float, float]) -> Prepared:
    scale, max_bias, softcap = params
    dk_dims, dv_dims = (0,) * qv.shape[3], (0,) * dv.shape[3]  # head sizes as compile-time constants

    def run() -> None:
        mask = convert.to_f32(mv, mask_type)
        # cells past the last one any query sees are never read: a decode step converts the
        # cache only up to its position, not the whole padded length
        used = K.attn_cells_seen(mask) if has_mask else n_kv
        SHA.flash_attn_f32(qv, k_f32(used), v_f32(used), mask,
                           dv, scale, max_bias, softcap, has_mask, dk_dims, dv_dims)
    return run


def _attn_mask(node: Tensor) -> tuple[bool, np.ndarray, GGMLType]:
    """(has a mask, its array, its type) of a FLASH_ATTN_EXT node."""
    if len(node.src) > 3:
        return True, node.src[3].array(), node.src[3].type
    return False, _EMPTY_F32, GGMLType.F32  # (an empty float32 array: no conversion)


def _cells_f32(t: Tensor) -> Callable[[int], np.ndarray]:
    """A reader of K or V as the cache stores them, cells first ([n3, n_kv, n_head_kv, d]),
    contiguous float32: the array itself when it is one, else a buffer of its own filled
    on each call (F16 through numba, several times faster than numpy's cast) with at
    least the first `used` cells of each sequence."""
    cells = t.array().transpose(0, 2, 1, 3)
    if cells.dtype == np.float32 and cells.flags.c_contiguous:
        return lambda used: cells
    buf = np.empty(cells.shape, dtype=np.float32)
    halves = cpu_type(t.type).floats.halves  # read as bits by numba, which has no float16 arrays
    if halves and cells.flags.c_contiguous:
        bits, flat = cells.reshape(-1).view(np.uint16), buf.reshape(-1)
        per_cell = math.prod(cells.shape[2:])

        def read_f16(used: int) -> np.ndarray:
            n = used * per_cell if cells.shape[0] == 1 else bits.shape[0]  # one sequence: a prefix
            K.f16_to_f32(bits[:n], flat[:n])
            return buf
        return read_f16
    if halves:  # several sequences' streams: each a view of the first cells of its own
        strided_bits = cells.view(np.uint16)

        def read_streams_f16(used: int) -> np.ndarray:
            K.f16_cells_to_f32(strided_bits, buf, min(used, cells.shape[1]))
            return buf
        return read_streams_f16
    src_type = t.type

    def read(used: int) -> np.ndarray:
        np.copyto(buf, convert.to_f32(cells, src_type))
        return buf
    return read


_NO_FREQ_FACTORS = np.ones(1, dtype=np.float32)


@KERNELS.register(Op.ROPE, Op.ROPE_BACK)
def _rope(node: Tensor, plan: Plan) -> Prepared:
    a, pos = node.src[0], node.src[1]
    require_f32(node, a)
    ffv = node.src[2].array().reshape(-1) if len(node.src) > 2 else _NO_FREQ_FACTORS
    has_ff = len(node.src) > 2
    av, pv, dv = a.array(), pos.array().reshape(-1), node.array()
    n_dims, mode, n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow = node.op_params
    corr0, corr1 = K.rope_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow)
    table = plan.rope_table(pos, node.src[2] if has_ff else None,
                            (n_dims, freq_base, freq_scale, ext_factor, attn_factor, corr0, corr1))
    neox, sign = mode == ROPE_TYPE_NEOX, 1.0 if node.op == Op.ROPE else -1.0

    def run() -> None:
        table.refresh(pv, ffv, has_ff)
        K.rope_f32(av, table.cos, table.sin, dv, n_dims, neox, sign)
    return run


@KERNELS.register(Op.GET_ROWS)
def _get_rows(node: Tensor, plan: Plan) -> Prepared:
    a, b = node.src
    idx = b.array()[0]  # (ne12, ne11, ne10)
    dv = node.array()
    tr = traits(a.type)
    if tr.is_quantized:
        return _get_rows_quantized(a, idx, dv)
    av = a.array()
    if av.dtype != dv.dtype:
        # stored values to convert (F16, BF16; numba has no float16 arrays): gather the picked
        # rows in numpy and convert only those
        i12 = np.arange(idx.shape[0])[:, None, None]
        i11 = np.arange(idx.shape[1])[None, :, None]
        return lambda: np.copyto(dv, convert.to_f32(av[i12, i11, idx], a.type))
    av, idx = read_only(av), read_only(idx)
    return lambda: K.get_rows(av, idx, dv)


def _get_rows_quantized(a: Tensor, idx: np.ndarray, dv: np.ndarray) -> Prepared:
    """Only the picked rows are dequantized, straight into the result when it is contiguous."""
    from ..products.qmatmul import QuantMatrix, get_rows_q, row_offsets
    offs = row_offsets(a)  # (ne03, ne02, ne01)
    w = QuantMatrix(a.type, a.buffer, offs.reshape(-1), a.ne[0])
    n3, n2, n1 = offs.shape
    i12 = np.arange(idx.shape[0])[:, None, None]
    i11 = np.arange(idx.shape[1])[None, :, None]
    base = (i12 * n2 + i11) * n1  # flat row index of row 0 of each (i12, i11) matrix
    d2 = dv.reshape(-1, dv.shape[3]) if dv.flags.c_contiguous else None
    tmp = np.empty((idx.size, dv.shape[3]), dtype=np.float32) if d2 is None else None

    def run() -> None:
        rows = (base + idx).reshape(-1)
        if d2 is not None:
            get_rows_q(w, rows, d2)
        else:
            np.copyto(dv, get_rows_q(w, rows, tmp).reshape(dv.shape))
    return run


def _never_parallel(node: Tensor) -> bool:
    return False


# SET_ROWS's result is the whole destination (a KV cache: every cell), but it writes only the
# source's rows, on one thread: judged by its result it woke every thread twice per layer
# of a decode step for nothing.
@KERNELS.register(Op.SET_ROWS, parallel=_never_parallel)
def _set_rows(node: Tensor, plan: Plan) -> Prepared:
    dst_t, src_t, idx_t = node.src
    require_f32(node, src_t)
    dv, sv, iv = node.array(), src_t.array(), idx_t.array()[0]
    n3, n2 = sv.shape[0], sv.shape[1]
    c2, c1 = iv.shape[0], iv.shape[1]
    if traits(dst_t.type).is_quantized:
        from .... import quants
        q_type = dst_t.type
        if quants.kernels(q_type).quantize is None:
            raise NotImplementedError(f"SET_ROWS into {q_type.name}")

        def run() -> None:  # rows quantized as ggml's from_float does (the reference quantizer)
            for i3 in range(n3):
                for i2 in range(n2):
                    dv[i3, i2][iv[i3 % c2, i2 % c1]] = quants.quantize(sv[i3, i2], q_type)
        return run
    if cpu_type(dst_t.type).floats.halves:  # the KV cache's writes: numba rounds as numpy does, faster
        bits = dv.view(np.uint16)
        return lambda: K.set_rows_f16(sv, iv, bits)
    encode = convert.codec(dst_t.type).encode

    def run() -> None:
        for i3 in range(n3):
            for i2 in range(n2):
                dv[i3, i2][iv[i3 % c2, i2 % c1]] = encode(sv[i3, i2])
    return run


@KERNELS.register(Op.CPY, Op.CONT, Op.DUP)
def _copy(node: Tensor, plan: Plan) -> Prepared:
    src = node.src[0]
    if (traits(src.type).is_quantized or traits(node.type).is_quantized) and src.type != node.type:
        return _convert_quantized(node, src)
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



def _convert_quantized(node: Tensor, src: Tensor) -> Prepared:
    """CPY/CONT/DUP between a block-quantized type and F32, element order kept (as ggml's
    dup: rows of the destination are filled in order, whatever the shapes)."""
    from .... import quants
    sv, dv = src.array(), node.array()
    if traits(src.type).is_quantized and node.type == GGMLType.F32:
        s_type = src.type

        def run() -> None:
            np.copyto(dv, quants.dequantize(np.ascontiguousarray(sv), s_type).reshape(dv.shape))
        return run
    if traits(node.type).is_quantized and src.type == GGMLType.F32 and quants.kernels(node.type).quantize is not None:
        d_type, ne0 = node.type, node.ne[0]

        def run() -> None:
            rows = np.ascontiguousarray(sv).reshape(-1, ne0)
            np.copyto(dv, quants.quantize(rows, d_type).reshape(dv.shape))
        return run
    raise NotImplementedError(f"{node.op.name} from {src.type.name} to {node.type.name}")
