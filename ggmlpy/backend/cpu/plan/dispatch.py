"""The CPU backend's kernel for every op it computes: its preparer modules' tables, merged here."""
from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from ....tensor import Op, Tensor
from ..products import matmul
from ..rows import compute, compute_sampling, fused
from ..train import compute_train, linear_ce
from . import Plan
from .kernel_table import Kernel, Prepared


def _merge(*tables: Mapping[Op, Kernel]) -> Mapping[Op, Kernel]:
    merged: dict[Op, Kernel] = {}
    for table in tables:
        if twice := merged.keys() & table.keys():
            raise ValueError(f"two CPU kernels for {sorted(op.name for op in twice)}")
        merged.update(table)
    return MappingProxyType(merged)


KERNELS = _merge(compute.KERNELS, matmul.KERNELS, compute_train.KERNELS, linear_ce.KERNELS, compute_sampling.KERNELS)


def _kernel(node: Tensor) -> Kernel:
    try:
        return KERNELS[node.op]
    except KeyError:
        raise NotImplementedError(f"CPU backend has no kernel for {node.op.name}") from None


def prepare(node: Tensor, plan: Plan) -> Prepared:
    """A zero-argument call that computes `node` into its bound memory, as a step of `plan`."""
    return _kernel(node).prepare(node, plan)


def fuse(nodes: list[Tensor], i: int, plan: Plan) -> tuple[Prepared, int] | None:
    """One call computing nodes[i] and the k - 1 after it, and k, when fused.py has a fusion
    for them."""
    return fused.fuse(nodes, i, plan)


def parallel(node: Tensor) -> bool:
    """Whether `node` is worth waking every thread for."""
    return _kernel(node).parallel(node)
