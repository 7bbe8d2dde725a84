"""What the graph machinery knows about each op, in one table, one entry per `Op`.

The allocator reads whether an op computes anything and whether it may write over an
operand; autodiff reads which inputs have no gradient, and why. The gradient rules
themselves live in backward.py and each backend keeps its own kernels; the tests derive
their coverage from this table (every computed op has a CPU kernel, every differentiable
op a rule and a gradient case), so a new op cannot be half-added.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType

from .tensor import Op


class OpKind(Enum):
    LEAF = "leaf"        # no op: data set from outside (weights, inputs, params)
    VIEW = "view"        # a window on its source's bytes: nothing to compute or allocate
    COMPUTE = "compute"  # a backend kernel writes the result


@dataclass(frozen=True)
class OpInfo:
    """One op's entry. An op is differentiable unless `forward_only` says why not; a
    differentiable op has a rule in backward.py for every input not in `no_grad`."""

    kind: OpKind = OpKind.COMPUTE
    inplace: bool = False  # the allocator may place the result over a dying same-shaped operand
    no_grad: Mapping[int, str] = field(default_factory=dict)  # src index -> what it is (why no gradient)
    forward_only: str = ""  # why the op has no gradient at all

    def __post_init__(self) -> None:
        if self.forward_only and self.no_grad:
            raise ValueError("a forward-only op has no per-input gradient reasons")
        if self.inplace and self.kind is not OpKind.COMPUTE:
            raise ValueError("only computed ops can be placed over an operand")

    @property
    def differentiable(self) -> bool:
        return not self.forward_only


_BACK = "a backward op (second derivatives are not implemented)"
_SAMPLING = "a sampling op (it picks tokens; no training graph goes through it)"
_STEP = "an optimizer step (it updates a param in place)"

OPS: Mapping[Op, OpInfo] = MappingProxyType({
    Op.NONE: OpInfo(OpKind.LEAF, forward_only="a leaf (gradients end there)"),
    Op.DUP: OpInfo(),
    Op.ADD: OpInfo(inplace=True),
    Op.SUB: OpInfo(inplace=True),
    Op.MUL: OpInfo(inplace=True),
    Op.DIV: OpInfo(inplace=True),
    Op.SCALE: OpInfo(inplace=True),
    Op.SQR: OpInfo(inplace=True),
    Op.SQRT: OpInfo(inplace=True),
    Op.LOG: OpInfo(inplace=True),
    Op.EXP: OpInfo(inplace=True),
    Op.SUM: OpInfo(),
    Op.SUM_ROWS: OpInfo(),
    Op.MEAN: OpInfo(),
    Op.REPEAT: OpInfo(),
    Op.REPEAT_BACK: OpInfo(),  # the adjoint of REPEAT, itself differentiable (by REPEAT)
    Op.NORM: OpInfo(),
    Op.RMS_NORM: OpInfo(inplace=True),
    Op.RMS_NORM_BACK: OpInfo(forward_only=_BACK),
    Op.MUL_MAT: OpInfo(),
    Op.OUT_PROD: OpInfo(),
    Op.SET_ROWS: OpInfo(forward_only="it writes rows into a destination in place (the KV cache)"),
    Op.GET_ROWS: OpInfo(no_grad={1: "row indices"}),
    Op.GET_ROWS_BACK: OpInfo(forward_only=_BACK),
    Op.CPY: OpInfo(no_grad={1: "the destination (it is overwritten)"}),
    Op.CONT: OpInfo(),
    Op.RESHAPE: OpInfo(OpKind.VIEW),
    Op.VIEW: OpInfo(OpKind.VIEW),
    Op.PERMUTE: OpInfo(OpKind.VIEW),
    Op.TRANSPOSE: OpInfo(OpKind.VIEW),
    Op.SOFT_MAX: OpInfo(inplace=True, no_grad={1: "the mask"}),
    Op.FLASH_ATTN_EXT: OpInfo(forward_only="inference only (training graphs use mul_mat and soft_max)"),
    Op.SOFT_MAX_BACK: OpInfo(forward_only=_BACK),
    Op.ROPE: OpInfo(inplace=True, no_grad={1: "positions", 2: "frequency factors"}),
    Op.ROPE_BACK: OpInfo(forward_only=_BACK),
    Op.SILU: OpInfo(inplace=True),
    Op.SILU_BACK: OpInfo(forward_only=_BACK),
    Op.GELU: OpInfo(inplace=True),
    Op.SWIGLU: OpInfo(inplace=True),
    Op.GEGLU: OpInfo(inplace=True),
    Op.CROSS_ENTROPY_LOSS: OpInfo(no_grad={1: "the labels", 2: "the label weights"}),
    Op.CROSS_ENTROPY_LOSS_BACK: OpInfo(inplace=True, forward_only=_BACK),  # row by row: read, then written
    Op.LINEAR_CROSS_ENTROPY: OpInfo(no_grad={2: "the label ids", 3: "the label weights"}),
    Op.LINEAR_CROSS_ENTROPY_BACK: OpInfo(forward_only=_BACK),
    Op.OPT_STEP_ADAMW: OpInfo(forward_only=_STEP),
    Op.OPT_STEP_SGD: OpInfo(forward_only=_STEP),
    Op.ACC: OpInfo(),
    Op.ARGMAX: OpInfo(forward_only="an index result"),
    Op.COUNT_EQUAL: OpInfo(forward_only="an integer result"),
    Op.GELU_BACK: OpInfo(forward_only=_BACK),
    Op.CONCAT: OpInfo(),
    Op.TOP_K: OpInfo(forward_only=_SAMPLING),
    Op.CUMSUM: OpInfo(forward_only=_SAMPLING),
    Op.TOP_P_CUT: OpInfo(forward_only=_SAMPLING),
    Op.MIN_P_CUT: OpInfo(forward_only=_SAMPLING),
    Op.PENALTIES: OpInfo(forward_only=_SAMPLING),
    Op.SAMPLE_DIST: OpInfo(forward_only=_SAMPLING),
})
