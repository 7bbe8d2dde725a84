"""A CPU kernel (how a node is prepared, and whether it is worth every thread) and the
table of them that each preparer module fills with its own `register` decorators.

dispatch.py merges the modules' tables, so the backend's table never depends on who
imported what first.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ....tensor import Op, Tensor
from ....types import GGMLType

if TYPE_CHECKING:
    from . import Plan

Prepared = Callable[[], None]  # computes one node into its bound memory
Preparer = Callable[[Tensor, "Plan"], Prepared]  # the plan owns tables and scratch the call may use

# Below this many result elements an op runs on one thread: waking the other costs more.
PARALLEL_MIN_ELEMENTS = 1 << 13


def by_elements(node: Tensor) -> bool:
    """Whether an op worth about one pass over its result should run on every thread."""
    return node.nelements() >= PARALLEL_MIN_ELEMENTS


@dataclass(frozen=True)
class Kernel:
    prepare: Preparer
    parallel: Callable[[Tensor], bool] = by_elements  # products judge by multiply-adds (matmul.py)


class KernelTable(dict[Op, Kernel]):
    """One preparer module's kernels by op."""

    def register(self, *ops: Op, parallel: Callable[[Tensor], bool] = by_elements) -> Callable[[Preparer], Preparer]:
        def register(prepare: Preparer) -> Preparer:
            for op in ops:
                if op in self:
                    raise ValueError(f"two CPU kernels for {op.name}")
                self[op] = Kernel(prepare, parallel)
            return prepare
        return register


def require_f32(node: Tensor, *tensors: Tensor) -> None:
    for t in tensors:
        if t.type != GGMLType.F32:
            raise NotImplementedError(f"{node.op.name} on {t.type.name} operand {t.name!r} is not supported")


def read_only(a: np.ndarray) -> np.ndarray:
    """a as a read-only view: numba types a read-only array apart from a writable one, so a
    kernel's sources go in read-only whether they are memory-mapped weights or arena tensors,
    and the kernel compiles once on a cold start instead of twice."""
    if not a.flags.writeable:
        return a
    view = a.view()
    view.flags.writeable = False
    return view
