"""ggmlpy: a Python twin of ggml: typed strided tensors, lazy graphs, planned memory,
and a CPU backend of numba kernels and BLAS."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .alloc import GraphAllocator
from .backend import Backend, default_backend
from .backward import NotDifferentiableError, build_backward_expand
from .context import Context
from .graph import Graph, build_forward_expand, new_graph
from .ops import *  # noqa: F403  (the op functions are the public API, as in ggml.h)
from .ops_train import *  # noqa: F403
from .ops_sampling import *  # noqa: F403
from .recompute import checkpoint_stride
from .registry import OPS, OpInfo, OpKind
from .tensor import Flag, Op, Tensor
from .types import GGMLType, row_size, traits

if TYPE_CHECKING:
    from . import opt, rowops  # noqa: F401 -- public submodules, loaded on first use
    from .backend.cpu import CpuBackend

# The CPU backend and the training engine load numba's compiled kernels (half a second):
# imported when first used, so a tool that only reads, writes or quantizes GGUF files never
# pays for them.
_LAZY = {"CpuBackend": (".backend.cpu", "CpuBackend"), "opt": (".opt", None), "rowops": (".rowops", None)}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'ggmlpy' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name, __name__)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value

__all__ = [
    "Backend",
    "Context",
    "CpuBackend",
    "Flag",
    "GGMLType",
    "Graph",
    "GraphAllocator",
    "NotDifferentiableError",
    "OPS",
    "Op",
    "OpInfo",
    "OpKind",
    "Tensor",
    "build_backward_expand",
    "build_forward_expand",
    "checkpoint_stride",
    "new_graph",
    "row_size",
    "traits",
]


def compute(graph: Graph, backend: Backend | None = None, allocator: GraphAllocator | None = None) -> Graph:
    """Allocate what the graph still lacks and compute it (on the default backend when none
    is given): the one-call path for tests and scripts."""
    if any(t.buffer is None for t in graph.nodes + graph.leafs):
        (allocator or GraphAllocator()).alloc_graph(graph)
    (backend or default_backend()).compute(graph)
    return graph
