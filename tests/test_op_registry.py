"""The op registry (ggmlpy/registry.py) against what must agree with it: every op has an
entry, the CPU backend has a kernel for exactly the computed ops, autodiff has a rule for
exactly the differentiable ones and refuses the rest with the registry's reason.
(Every differentiable op's gradient is checked by a case: test_grad_check.py.)"""
from __future__ import annotations

import re

import numpy as np
import pytest

import ggmlpy as gg
from ggmlpy.backend.cpu.plan.dispatch import KERNELS
from ggmlpy.backward import RULES

COMPUTED = {op for op, info in gg.OPS.items() if info.kind is gg.OpKind.COMPUTE}


def test_every_op_has_an_entry():
    assert sorted(op.name for op in set(gg.Op) - set(gg.OPS)) == []


def test_cpu_kernels_are_the_computed_ops():
    """Computed ops need a kernel; leafs and views must not have one (they are never run)."""
    assert sorted(op.name for op in COMPUTED - set(KERNELS)) == [], "computed ops without a CPU kernel"
    assert sorted(op.name for op in set(KERNELS) - COMPUTED) == [], "CPU kernels for ops that are never computed"


def test_gradient_rules_are_the_differentiable_ops():
    differentiable = {op for op, info in gg.OPS.items() if info.differentiable}
    assert sorted(op.name for op in differentiable - set(RULES)) == [], "differentiable ops without a rule"
    assert sorted(op.name for op in set(RULES) - differentiable) == [], "rules for ops the registry calls forward-only"


def _loss_through(op: gg.Op, n_src: int, param_at: int) -> tuple[gg.Context, gg.Graph]:
    """sum(op(src...)) with a param as src `param_at` and constants elsewhere; the node is
    never computed, only differentiated."""
    ctx = gg.Context()
    srcs = [ctx.from_numpy(np.ones(4, np.float32)) for _ in range(n_src)]
    srcs[param_at].set_param()
    node = ctx.add(gg.Tensor(gg.GGMLType.F32, (4, 1, 1, 1), op=op, src=tuple(srcs)))
    return ctx, gg.new_graph(gg.sum(ctx, node).set_loss())


@pytest.mark.parametrize("op", sorted(op for op in COMPUTED if not gg.OPS[op].differentiable), ids=lambda op: op.name)
def test_forward_only_ops_refuse_gradients(op):
    ctx, graph = _loss_through(op, 1, 0)
    with pytest.raises(gg.NotDifferentiableError, match=re.escape(f"{op.name} is not differentiable: {gg.OPS[op].forward_only}")):
        gg.build_backward_expand(ctx, graph)


@pytest.mark.parametrize("op,i", sorted((op, i) for op, info in gg.OPS.items() for i in info.no_grad),
                         ids=lambda x: x.name if isinstance(x, gg.Op) else str(x))
def test_inputs_without_gradient_are_refused(op, i):
    ctx, graph = _loss_through(op, i + 1, i)
    with pytest.raises(gg.NotDifferentiableError, match=re.escape(f"with respect to {gg.OPS[op].no_grad[i]}")):
        gg.build_backward_expand(ctx, graph)


@pytest.mark.parametrize("fields, why", [
    ({"forward_only": "an index result", "no_grad": {1: "the mask"}}, "forward-only"),
    ({"kind": gg.OpKind.VIEW, "inplace": True}, "only computed ops"),
])
def test_contradictory_entries_are_refused(fields, why):
    with pytest.raises(ValueError, match=why):
        gg.OpInfo(**fields)
