"""The CPU backend's table of tensor types: one record per type with everything the backend
does differently for it (ggml-cpu's type_traits_cpu, beside ggml's type_traits: the block
geometry in types.py and the to/from float32 row kernels in ggmlpy/quants).

A record says what a product with a matrix of the type rounds its activations to
(vec_dot_type, and the kernel that rounds them so), and which kernel multiplies by the
matrix straight from its packed rows for a given shape. MUL_MAT and OUT_PROD (matmul.py,
qmatmul.py), the fused output layer and loss (linear_ce.py) and the model loader read these
records; none of them branches on a type. Adding a type is a row here, its row kernels in
ggmlpy/quants and, for a product in ggml's order, its planner in qexact.py.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

from .... import convert
from ....ops import Prec
from ....quants import iquants, kquants, simple
from ....types import TYPE_TRAITS, GGMLType
from . import qdot, qexact
from .qexact import Product

# (n columns, m rows, k, block_sums) -> the kernel for that shape (qexact.plan_q0's contract)
Planner = Callable[[int, int, int, bool], Product]
RoundActivations = Callable[[np.ndarray], None]  # in place, on C-contiguous float32 rows


@dataclass(frozen=True)
class PackedProducts:
    """Products that read the matrix's packed rows: `plan` for every column count, summed in
    llama.cpp's x86 order (qexact.py), or with `max_columns` only up to that many columns
    (qdot.py's integer dots), larger products then taking dequantized tiles (qmatmul.py)."""

    plan: Planner
    max_columns: int = 0  # 0: any
    block_sums: bool = False  # whether block_sums plans sum each block of 32 whole (faster logits)


@dataclass(frozen=True)
class FloatProducts:
    """How a product with a matrix stored as plain values sums: in ggml-cpu's order
    (floatdot.py: llama.cpp's bits on any CPU), unless the node's precision is one of
    `blas_precs`: then through BLAS (gemm.py), the values converted to float32 first."""

    blas_precs: frozenset[Prec] = frozenset(Prec)
    halves: bool = False  # ggml's order is that of its dot products of halves (vec_dot_f16)


@dataclass(frozen=True)
class CpuType:
    """What the CPU backend does with one tensor type."""

    type: GGMLType
    vec_dot_type: GGMLType | None = None  # what a product rounds its activations to; None: not a matrix type
    round_activations: RoundActivations | None = None  # that rounding, in place; None: used as they are
    packed: PackedProducts | None = None  # block types: products that read the packed rows
    floats: FloatProducts = FloatProducts()  # element types: products of the values

    @property
    def ggml_order(self) -> bool:
        """Whether every product from the packed rows sums as llama.cpp's x86 build does."""
        return self.packed is not None and not self.packed.max_columns

    def plan_product(self, n: int, m: int, k: int, block_sums: bool = False) -> Product | None:
        """The kernel for out (n, m) = x~ (n, k) @ W^T from W's m packed rows (x~: x rounded as
        ggml rounds it; the kernel quantizes x itself), chosen once; None when this shape
        takes dequantized tiles through BLAS (qmatmul.py). block_sums: the caller wants logits
        (the fused loss), not llama.cpp's bits: a faster per-block order where there is one."""
        p = self.packed
        if p is None or (p.max_columns and not (0 < n <= p.max_columns and not block_sums)):
            return None
        return p.plan(n, m, k, block_sums)


def _rounded_through(type: GGMLType) -> RoundActivations:
    def round_in_place(x: np.ndarray) -> None:
        np.copyto(x, convert.round_to(x, type))
    return round_in_place


def _q0(rows: qexact.Q0Rows) -> PackedProducts:
    return PackedProducts(partial(qexact.plan_q0, rows), block_sums=True)


_Q8_0 = dict(vec_dot_type=GGMLType.Q8_0, round_activations=simple.round_rows_q8_0)
_Q8_1 = dict(vec_dot_type=GGMLType.Q8_1, round_activations=simple.round_rows_q8_0)  # x86 rounds Q8_1 as Q8_0
_Q8_K = dict(vec_dot_type=GGMLType.Q8_K, round_activations=kquants.round_rows_q8_k)

CPU_TYPES: dict[GGMLType, CpuType] = {t: CpuType(t) for t in TYPE_TRAITS}  # no products unless below
CPU_TYPES.update({r.type: r for r in (
    CpuType(GGMLType.F32, GGMLType.F32, floats=FloatProducts(frozenset({Prec.BLAS}))),
    CpuType(GGMLType.F16, GGMLType.F16, _rounded_through(GGMLType.F16), floats=FloatProducts(frozenset(), halves=True)),
    CpuType(GGMLType.BF16, GGMLType.BF16, _rounded_through(GGMLType.BF16)),
    CpuType(GGMLType.Q4_0, **_Q8_0, packed=_q0(qexact.Q0Rows(qexact.Q4_0_BYTES, bias=8, repack_rows=8))),
    CpuType(GGMLType.Q5_0, **_Q8_0, packed=_q0(qexact.Q0Rows(qexact.Q5_0_BYTES, bias=16,
                                                             vnni_gemv=qexact.plan_q5_0_gemv_vnni))),
    CpuType(GGMLType.Q8_0, **_Q8_0, packed=_q0(qexact.Q0Rows(qexact.Q8_0_BYTES, bias=128,
                                                             vnni_gemv=qexact.plan_q8_0_gemv_vnni))),
    CpuType(GGMLType.IQ4_NL, **_Q8_0, packed=_q0(qexact.Q0Rows(iquants.BLOCK_BYTES, bias=128, repack_rows=8,
                                                               values=iquants.KVALUES_IQ4NL, pairs_vec_dot=True))),
    CpuType(GGMLType.Q4_1, **_Q8_1),
    CpuType(GGMLType.Q5_1, **_Q8_1),
    CpuType(GGMLType.Q2_K, **_Q8_K),
    CpuType(GGMLType.Q3_K, **_Q8_K),
    CpuType(GGMLType.Q4_K, **_Q8_K, packed=PackedProducts(qexact.plan_q4_k)),
    CpuType(GGMLType.Q5_K, **_Q8_K, packed=PackedProducts(qdot.plan_q5_k, max_columns=qdot.MAX_COLUMNS)),
    CpuType(GGMLType.Q6_K, **_Q8_K, packed=PackedProducts(qexact.plan_q6_k)),
)})

MATRIX_TYPES = frozenset(t for t, r in CPU_TYPES.items() if r.vec_dot_type is not None)


def cpu_type(type: GGMLType) -> CpuType:
    """The record of `type` (every ggml type this project knows has one)."""
    return CPU_TYPES[GGMLType(type)]


def round_activations(x: np.ndarray, type: GGMLType) -> np.ndarray:
    """A float32 copy of x (..., ne0) rounded as ggml rounds the activations of a product with
    a `type` matrix: quantized to its vec_dot_type as the x86 quantizers do it, then the exact
    values d * q (or through F16 / BF16)."""
    out = np.array(x, dtype=np.float32, order="C", copy=True)
    f = cpu_type(type).round_activations
    if f is not None and out.size:
        f(out.reshape(-1, out.shape[-1]))
    return out


def plan_mul_mat(type: GGMLType, n: int, m: int, k: int, block_sums: bool = False) -> Product:
    """The packed-row kernel of a product (CpuType.plan_product) where the type has one for
    this shape; for benches and tests that call a kernel by type."""
    product = cpu_type(type).plan_product(n, m, k, block_sums)
    if product is None:
        raise NotImplementedError(f"no packed-row product for {GGMLType(type).name} with {n} columns")
    return product


def mul_mat(type: GGMLType, buf: np.ndarray, offs: np.ndarray, x: np.ndarray, out: np.ndarray, scratch,
            block_sums: bool = False) -> None:
    """plan_mul_mat's product for these operands, planned and run at once."""
    plan_mul_mat(type, x.shape[0], offs.shape[0], x.shape[1], block_sums)(buf, offs, x, out, scratch)
