"""Graph-building op functions, with ggml's names, shapes and broadcasting rules.

Nothing is computed here: each function checks its operands and records a node
(`op`, `src`, `op_params`). Backends compute nodes later, in graph order.
"""
from __future__ import annotations

import math
from enum import IntEnum

from .context import Context
from .tensor import MAX_DIMS, Op, Tensor
from .types import GGMLType, row_size, traits

# rope modes (ggml's GGML_ROPE_TYPE_*)
ROPE_TYPE_NORM = 0
ROPE_TYPE_NEOX = 2


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def can_repeat(b: Tensor, a: Tensor) -> bool:
    """True when `b` can be tiled to `a`'s shape (ggml_can_repeat)."""
    return all(a.ne[i] % b.ne[i] == 0 if b.ne[i] else a.ne[i] == 0 for i in range(MAX_DIMS))


def _node(ctx: Context, op: Op, type: GGMLType, ne, src, params=()) -> Tensor:
    return ctx.add(Tensor(type, tuple(ne), op=op, src=tuple(src), op_params=tuple(params)))


def _unary(ctx: Context, op: Op, a: Tensor, params=()) -> Tensor:
    return _node(ctx, op, a.type, a.ne, (a,), params)


def _binary(ctx: Context, op: Op, a: Tensor, b: Tensor) -> Tensor:
    _check(can_repeat(b, a), f"{op.name}: {b.ne} cannot be broadcast to {a.ne}")
    return _node(ctx, op, a.type, a.ne, (a, b))


# ---- element-wise ------------------------------------------------------------------
def add(ctx: Context, a: Tensor, b: Tensor) -> Tensor:
    return _binary(ctx, Op.ADD, a, b)


def sub(ctx: Context, a: Tensor, b: Tensor) -> Tensor:
    return _binary(ctx, Op.SUB, a, b)


def mul(ctx: Context, a: Tensor, b: Tensor) -> Tensor:
    return _binary(ctx, Op.MUL, a, b)


def div(ctx: Context, a: Tensor, b: Tensor) -> Tensor:
    return _binary(ctx, Op.DIV, a, b)


def scale(ctx: Context, a: Tensor, s: float, b: float = 0.0) -> Tensor:
    """a * s + b (ggml_scale / ggml_scale_bias)."""
    return _unary(ctx, Op.SCALE, a, (float(s), float(b)))


def sqr(ctx: Context, a: Tensor) -> Tensor:
    return _unary(ctx, Op.SQR, a)


def sqrt(ctx: Context, a: Tensor) -> Tensor:
    return _unary(ctx, Op.SQRT, a)


def log(ctx: Context, a: Tensor) -> Tensor:
    return _unary(ctx, Op.LOG, a)


def exp(ctx: Context, a: Tensor) -> Tensor:
    return _unary(ctx, Op.EXP, a)


def silu(ctx: Context, a: Tensor) -> Tensor:
    return _unary(ctx, Op.SILU, a)


def gelu(ctx: Context, a: Tensor) -> Tensor:
    """tanh-approximated GELU, as ggml_gelu."""
    return _unary(ctx, Op.GELU, a)


def _glu(ctx: Context, op: Op, a: Tensor, b: Tensor) -> Tensor:
    _check(a.ne == b.ne, f"{op.name}: shapes differ {a.ne} vs {b.ne}")
    return _node(ctx, op, GGMLType.F32, a.ne, (a, b))


def swiglu_split(ctx: Context, a: Tensor, b: Tensor) -> Tensor:
    """silu(a) * b, fused (ggml_swiglu_split)."""
    return _glu(ctx, Op.SWIGLU, a, b)


def geglu_split(ctx: Context, a: Tensor, b: Tensor) -> Tensor:
    """gelu(a) * b, fused (ggml_geglu_split)."""
    return _glu(ctx, Op.GEGLU, a, b)


def add_inplace(ctx: Context, a: Tensor, b: Tensor) -> Tensor:
    """a += b, written into a's memory; returns a view of a (ggml_add_inplace)."""
    _check(can_repeat(b, a), f"ADD: {b.ne} cannot be broadcast to {a.ne}")
    out = view_tensor(ctx, a)
    out.op, out.src = Op.ADD, (a, b)
    return out


# ---- reductions and tiling -------------------------------------------------------------
def sum(ctx: Context, a: Tensor) -> Tensor:
    """The sum of all elements, as a 1-element tensor."""
    return _node(ctx, Op.SUM, GGMLType.F32, (1, 1, 1, 1), (a,))


def sum_rows(ctx: Context, a: Tensor) -> Tensor:
    """Each row summed: shape [1, ne1, ne2, ne3]."""
    return _node(ctx, Op.SUM_ROWS, GGMLType.F32, (1,) + a.ne[1:], (a,))


def mean(ctx: Context, a: Tensor) -> Tensor:
    """Each row's mean: shape [1, ne1, ne2, ne3]."""
    return _node(ctx, Op.MEAN, GGMLType.F32, (1,) + a.ne[1:], (a,))


def repeat(ctx: Context, a: Tensor, b: Tensor) -> Tensor:
    """a tiled to b's shape (b's data is not used)."""
    _check(can_repeat(a, b), f"REPEAT: {a.ne} cannot be tiled to {b.ne}")
    return _node(ctx, Op.REPEAT, GGMLType.F32, b.ne, (a,))


def repeat_back(ctx: Context, a: Tensor, b: Tensor) -> Tensor:
    """The tiles of a summed into b's shape: the adjoint of repeat."""
    _check(can_repeat(b, a), f"REPEAT_BACK: {a.ne} is not a tiling of {b.ne}")
    return _node(ctx, Op.REPEAT_BACK, GGMLType.F32, b.ne, (a,))


def acc(ctx: Context, a: Tensor, b: Tensor, nb1: int, nb2: int, nb3: int, offset: int) -> Tensor:
    """A copy of contiguous a with b added into the window (b.ne, strides nb1..3, byte offset) of it."""
    _check(a.is_contiguous() and a.type == GGMLType.F32, "ACC: the destination must be contiguous F32")
    window = Tensor(a.type, b.ne, (a.nb[0], nb1, nb2, nb3))
    _check(offset + window.nbytes() <= a.nbytes(), f"ACC: window {b.ne} at {offset} exceeds {a.ne}")
    return _node(ctx, Op.ACC, GGMLType.F32, a.ne, (a, b), (nb1, nb2, nb3, offset))


def out_prod(ctx: Context, a: Tensor, b: Tensor) -> Tensor:
    """result[i1, i0] = sum_j a[j, i0] * b[j, i1]: shape [a.ne0, b.ne0, b.ne2, b.ne3].

    a broadcasts over dims 2 and 3 as in mul_mat.
    """
    _check(a.ne[1] == b.ne[1], f"OUT_PROD: column counts differ ({a.ne[1]} vs {b.ne[1]})")
    _check(b.ne[2] % a.ne[2] == 0 and b.ne[3] % a.ne[3] == 0, f"OUT_PROD: {a.ne} cannot broadcast over {b.ne}")
    return _node(ctx, Op.OUT_PROD, GGMLType.F32, (a.ne[0], b.ne[0], b.ne[2], b.ne[3]), (a, b))


class Prec(IntEnum):
    """The arithmetic of a product node (ggml_prec, ggml_mul_mat_set_prec).

    DEFAULT: float32; a MUL_MAT sums in ggml-cpu's order (llama.cpp's bits, on any CPU).
    BLAS: a MUL_MAT with an F32 first operand sums in the BLAS library's order (several
    times faster on big products; training graphs use it, see opt.TrainGraph).
    BF16: an OUT_PROD (LINEAR_CROSS_ENTROPY: its backward product) through a quantized
    matrix rounds both operands to bfloat16 and sums float32 (AVX512-BF16: twice float32's
    speed; each product within 2^-8 of its value)."""

    DEFAULT = 0
    BF16 = 1
    BLAS = 2


# the precisions each product op takes besides DEFAULT (LINEAR_CROSS_ENTROPY: its softmax(z) W for dx)
PREC_OPS = {Op.OUT_PROD: (Prec.BF16,), Op.LINEAR_CROSS_ENTROPY: (Prec.BF16,), Op.MUL_MAT: (Prec.BLAS,)}


def set_prec(node: Tensor, prec: Prec) -> Tensor:
    """Choose the arithmetic of a product node (Prec says which op takes which)."""
    _check(node.op in PREC_OPS, f"set_prec: {node.op.name} has no precision to set")
    _check(prec == Prec.DEFAULT or prec in PREC_OPS[node.op], f"set_prec: {node.op.name} has no {Prec(prec).name}")
    node.op_params = (Prec(prec),) + tuple(node.op_params[1:])  # the op's own parameters after it stay
    return node


def prec_of(node: Tensor) -> Prec:
    """The precision set_prec chose for a node (DEFAULT when none)."""
    return Prec(node.op_params[0]) if node.op in PREC_OPS and node.op_params else Prec.DEFAULT


def set_backward_prec(nodes, prec: Prec) -> None:
    """set_prec on every node among `nodes` (a graph's) whose product runs through a quantized
    first operand: the backward passes through frozen quantized weights of a training graph."""
    for n in nodes:
        takes = prec == Prec.DEFAULT or prec in PREC_OPS.get(n.op, ())
        if takes and n.op in PREC_OPS and traits(n.src[0].type).is_quantized:
            set_prec(n, prec)


def set_blas_products(nodes) -> None:
    """Prec.BLAS on every MUL_MAT among `nodes` with an F32 first operand (training graphs:
    speed over llama.cpp's summation order)."""
    for n in nodes:
        if n.op == Op.MUL_MAT and n.src[0].type == GGMLType.F32:
            set_prec(n, Prec.BLAS)


def concat(ctx: Context, a: Tensor, b: Tensor, dim: int) -> Tensor:
    """a and b joined along `dim` (the other dimensions must agree)."""
    _check(0 <= dim < MAX_DIMS and all(a.ne[i] == b.ne[i] for i in range(MAX_DIMS) if i != dim),
           f"CONCAT: {a.ne} and {b.ne} cannot be joined along dim {dim}")
    _check(a.type == b.type, f"CONCAT: types differ ({a.type.name} vs {b.type.name})")
    ne = list(a.ne)
    ne[dim] += b.ne[dim]
    return _node(ctx, Op.CONCAT, a.type, ne, (a, b), (dim,))


def argmax(ctx: Context, a: Tensor) -> Tensor:
    """Index of each row's largest value (first on ties): I32 [ne1] of a matrix."""
    _check(a.ne[2] == 1 and a.ne[3] == 1, f"ARGMAX: needs a matrix, got {a.ne}")
    return _node(ctx, Op.ARGMAX, GGMLType.I32, (a.ne[1], 1, 1, 1), (a,))


def count_equal(ctx: Context, a: Tensor, b: Tensor) -> Tensor:
    """How many elements of two I32 tensors are equal: a 1-element I64 tensor."""
    _check(a.ne == b.ne and a.type == b.type == GGMLType.I32, f"COUNT_EQUAL: {a.ne} {a.type.name} vs {b.ne} {b.type.name}")
    return _node(ctx, Op.COUNT_EQUAL, GGMLType.I64, (1, 1, 1, 1), (a, b))


# ---- normalization -------------------------------------------------------------------
def rms_norm(ctx: Context, a: Tensor, eps: float) -> Tensor:
    """Each row divided by its root mean square (plus eps)."""
    return _unary(ctx, Op.RMS_NORM, a, (float(eps),))


def norm(ctx: Context, a: Tensor, eps: float) -> Tensor:
    """Each row centred and divided by its standard deviation (plus eps)."""
    return _unary(ctx, Op.NORM, a, (float(eps),))


def soft_max(ctx: Context, a: Tensor) -> Tensor:
    return soft_max_ext(ctx, a, None, 1.0, 0.0)


def soft_max_ext(ctx: Context, a: Tensor, mask: Tensor | None, scale: float, max_bias: float = 0.0) -> Tensor:
    """softmax(a * scale + mask) over rows; mask broadcasts over dims 2 and 3 (ALiBi if max_bias > 0)."""
    if mask is not None:
        _check(mask.ne[0] == a.ne[0] and mask.ne[1] >= a.ne[1], f"SOFT_MAX: mask {mask.ne} does not cover {a.ne}")
        _check(a.ne[2] % mask.ne[2] == 0 and a.ne[3] % mask.ne[3] == 0, f"SOFT_MAX: mask {mask.ne} cannot broadcast to {a.ne}")
    src = (a,) if mask is None else (a, mask)
    return _node(ctx, Op.SOFT_MAX, GGMLType.F32, a.ne, src, (float(scale), float(max_bias)))


def flash_attn_ext(ctx: Context, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
                   max_bias: float = 0.0, logit_softcap: float = 0.0) -> Tensor:
    """Fused softmax(q k^T * scale + mask) v, never materialising the scores.

    q: [DK, n_q, n_head, n3], k: [DK, n_kv, n_head_kv, n3], v: [DV, n_kv, n_head_kv, n3],
    mask: [n_kv, >= n_q, ...]; result: [DV, n_head, n_q, n3] (ready to reshape to rows).
    """
    _check(q.ne[0] == k.ne[0] and k.ne[1] == v.ne[1] and k.ne[2] == v.ne[2], f"FLASH_ATTN_EXT: q {q.ne} k {k.ne} v {v.ne}")
    _check(q.ne[2] % k.ne[2] == 0 and q.ne[3] == k.ne[3], f"FLASH_ATTN_EXT: heads of q {q.ne} and k {k.ne} do not match")
    if mask is not None:
        _check(mask.ne[0] == k.ne[1] and mask.ne[1] >= q.ne[1], f"FLASH_ATTN_EXT: mask {mask.ne} does not cover q {q.ne}, k {k.ne}")
    src = (q, k, v) if mask is None else (q, k, v, mask)
    return _node(ctx, Op.FLASH_ATTN_EXT, GGMLType.F32, (v.ne[0], q.ne[2], q.ne[1], q.ne[3]), src,
                 (float(scale), float(max_bias), float(logit_softcap)))


# ---- matrix products and rows ---------------------------------------------------------
def mul_mat(ctx: Context, a: Tensor, b: Tensor) -> Tensor:
    """result[i1, i0] = dot(a row i0, b row i1): shape [a.ne1, b.ne1, b.ne2, b.ne3].

    a broadcasts over dims 2 and 3 (b.ne2 a multiple of a.ne2, as GQA needs).
    """
    _check(a.ne[0] == b.ne[0], f"MUL_MAT: row lengths differ ({a.ne[0]} vs {b.ne[0]})")
    _check(b.ne[2] % a.ne[2] == 0 and b.ne[3] % a.ne[3] == 0, f"MUL_MAT: {a.ne} cannot broadcast over {b.ne}")
    _check(not (a.is_transposed() and traits(a.type).is_quantized), "MUL_MAT: a quantized first operand must not be transposed")
    return _node(ctx, Op.MUL_MAT, GGMLType.F32, (a.ne[1], b.ne[1], b.ne[2], b.ne[3]), (a, b))


def get_rows(ctx: Context, a: Tensor, b: Tensor) -> Tensor:
    """Rows of `a` picked by the I32 indices in `b`: shape [a.ne0, b.ne0, b.ne1, b.ne2]."""
    _check(b.type == GGMLType.I32, "GET_ROWS: indices must be I32")
    _check(a.ne[2] == b.ne[1] and b.ne[3] == 1, f"GET_ROWS: indices {b.ne} do not match {a.ne}")
    out_type = GGMLType.I32 if a.type == GGMLType.I32 else GGMLType.F32
    return _node(ctx, Op.GET_ROWS, out_type, (a.ne[0], b.ne[0], b.ne[1], b.ne[2]), (a, b))


def set_rows(ctx: Context, a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """Write the rows of `b` into `a` at the row indices `c` (I64 or I32); returns a view of `a`.

    a: [ne0, rows, ne2, ne3]; b: [ne0, n, ne2, ne3]; c: [n, ne2, ne3].
    """
    _check(a.ne[0] == b.ne[0], f"SET_ROWS: row lengths differ ({a.ne[0]} vs {b.ne[0]})")
    _check(a.ne[2:] == b.ne[2:], f"SET_ROWS: rows {b.ne} and destination {a.ne} differ in dims 2/3")
    _check(c.type in (GGMLType.I64, GGMLType.I32), "SET_ROWS: indices must be I64 or I32")
    _check(c.ne[0] == b.ne[1] and b.ne[2] % c.ne[1] == 0 and b.ne[3] % c.ne[2] == 0,
           f"SET_ROWS: indices {c.ne} do not match rows {b.ne}")
    out = view_tensor(ctx, a)
    out.op, out.src = Op.SET_ROWS, (a, b, c)
    return out


# ---- rotary embeddings -------------------------------------------------------------------
def rope_ext(ctx: Context, a: Tensor, pos: Tensor, freq_factors: Tensor | None, n_dims: int, mode: int,
             n_ctx_orig: int, freq_base: float, freq_scale: float, ext_factor: float = 0.0,
             attn_factor: float = 1.0, beta_fast: float = 32.0, beta_slow: float = 1.0) -> Tensor:
    """Rotate pairs of the first `n_dims` values of each head; a: [head_dim, n_head, n_tokens]."""
    _check(pos.type == GGMLType.I32 and pos.ne[0] == a.ne[2], f"ROPE: need {a.ne[2]} I32 positions, got {pos.ne}")
    _check(n_dims <= a.ne[0] and n_dims % 2 == 0, f"ROPE: n_dims {n_dims} invalid for rows of {a.ne[0]}")
    _check(mode in (ROPE_TYPE_NORM, ROPE_TYPE_NEOX), f"ROPE: mode {mode} not supported")
    src = (a, pos) if freq_factors is None else (a, pos, freq_factors)
    params = (n_dims, mode, n_ctx_orig, float(freq_base), float(freq_scale), float(ext_factor),
              float(attn_factor), float(beta_fast), float(beta_slow))
    return _node(ctx, Op.ROPE, a.type, a.ne, src, params)


# ---- copies -----------------------------------------------------------------------------
def cpy(ctx: Context, a: Tensor, b: Tensor) -> Tensor:
    """Copy a into b (converting type); returns a view of b."""
    _check(a.nelements() == b.nelements(), f"CPY: element counts differ {a.ne} vs {b.ne}")
    out = view_tensor(ctx, b)
    out.op, out.src = Op.CPY, (a, b)
    return out


def cont(ctx: Context, a: Tensor, *ne: int) -> Tensor:
    """A contiguous copy of a, optionally with a new shape of the same element count."""
    shape = _full(ne) if ne else a.ne
    _check(_count(shape) == a.nelements(), f"CONT: {shape} does not hold {a.nelements()} elements")
    return _node(ctx, Op.CONT, a.type, shape, (a,))


def dup(ctx: Context, a: Tensor) -> Tensor:
    return _node(ctx, Op.DUP, a.type, a.ne, (a,))


# ---- views (no computation) -----------------------------------------------------------------
def _full(ne) -> tuple[int, int, int, int]:
    return tuple(int(n) for n in ne) + (1,) * (MAX_DIMS - len(ne))


def _count(ne) -> int:
    return math.prod(ne)


def view_tensor(ctx: Context, a: Tensor) -> Tensor:
    base = a.view_src or a
    return ctx.add(Tensor(a.type, a.ne, a.nb, op=Op.VIEW, src=(a,), view_src=base, view_offs=a.view_offs))


def view(ctx: Context, a: Tensor, ne, nb_upper=(), offset: int = 0) -> Tensor:
    """A strided window on a: `ne` (1..4 dims), byte strides nb1.. in `nb_upper`, byte `offset`."""
    full = _full(ne)
    _check(len(nb_upper) == len(ne) - 1, f"VIEW: a {len(ne)}-d view needs {len(ne) - 1} strides, got {len(nb_upper)}")
    nb = [a.nb[0], 0, 0, 0]
    for i in range(1, MAX_DIMS):
        derived = row_size(a.type, full[0]) if i == 1 else nb[i - 1] * full[i - 1]
        nb[i] = nb_upper[i - 1] if i - 1 < len(nb_upper) else derived
    base = a.view_src or a
    out = Tensor(a.type, full, tuple(nb), op=Op.VIEW, src=(a,), view_src=base, view_offs=a.view_offs + offset)
    _check(out.view_offs + out.nbytes() <= base.nbytes(), f"VIEW: window {full} at {offset} exceeds {base.ne}")
    return ctx.add(out)


def view_1d(ctx: Context, a: Tensor, ne0: int, offset: int = 0) -> Tensor:
    return view(ctx, a, (ne0,), (), offset)


def view_2d(ctx: Context, a: Tensor, ne0: int, ne1: int, nb1: int, offset: int = 0) -> Tensor:
    return view(ctx, a, (ne0, ne1), (nb1,), offset)


def view_3d(ctx: Context, a: Tensor, ne0: int, ne1: int, ne2: int, nb1: int, nb2: int, offset: int = 0) -> Tensor:
    return view(ctx, a, (ne0, ne1, ne2), (nb1, nb2), offset)


def view_4d(ctx: Context, a: Tensor, ne0: int, ne1: int, ne2: int, ne3: int, nb1: int, nb2: int, nb3: int,
            offset: int = 0) -> Tensor:
    return view(ctx, a, (ne0, ne1, ne2, ne3), (nb1, nb2, nb3), offset)


def reshape(ctx: Context, a: Tensor, *ne: int) -> Tensor:
    """Same bytes, new shape (a must be contiguous)."""
    _check(a.is_contiguous(), "RESHAPE: tensor must be contiguous")
    full = _full(ne)
    _check(_count(full) == a.nelements(), f"RESHAPE: {full} does not hold {a.nelements()} elements")
    base = a.view_src or a
    return ctx.add(Tensor(a.type, full, op=Op.RESHAPE, src=(a,), view_src=base, view_offs=a.view_offs))


def reshape_1d(ctx: Context, a: Tensor, ne0: int) -> Tensor:
    return reshape(ctx, a, ne0)


def reshape_2d(ctx: Context, a: Tensor, ne0: int, ne1: int) -> Tensor:
    return reshape(ctx, a, ne0, ne1)


def reshape_3d(ctx: Context, a: Tensor, ne0: int, ne1: int, ne2: int) -> Tensor:
    return reshape(ctx, a, ne0, ne1, ne2)


def reshape_4d(ctx: Context, a: Tensor, ne0: int, ne1: int, ne2: int, ne3: int) -> Tensor:
    return reshape(ctx, a, ne0, ne1, ne2, ne3)


def permute(ctx: Context, a: Tensor, axis0: int, axis1: int, axis2: int, axis3: int) -> Tensor:
    """Dimension i of `a` becomes dimension axis_i of the result (ggml_permute)."""
    axes = (axis0, axis1, axis2, axis3)
    _check(sorted(axes) == [0, 1, 2, 3], f"PERMUTE: {axes} is not a permutation")
    ne = [0] * MAX_DIMS
    nb = [0] * MAX_DIMS
    for i, ax in enumerate(axes):
        ne[ax] = a.ne[i]
        nb[ax] = a.nb[i]
    base = a.view_src or a
    return ctx.add(Tensor(a.type, tuple(ne), tuple(nb), op=Op.PERMUTE, src=(a,), op_params=axes,
                          view_src=base, view_offs=a.view_offs))


def transpose(ctx: Context, a: Tensor) -> Tensor:
    out = permute(ctx, a, 1, 0, 2, 3)
    out.op = Op.TRANSPOSE
    return out
