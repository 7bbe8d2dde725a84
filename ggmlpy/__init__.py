"""ggmlpy: a Python twin of ggml: typed strided tensors, lazy graphs, planned memory,
and a CPU backend of numba kernels and BLAS."""
from . import opt, rowops
from .alloc import GraphAllocator
from .backend.cpu import CpuBackend
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

__all__ = [
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


def compute(graph: Graph, backend: CpuBackend | None = None, allocator: GraphAllocator | None = None) -> Graph:
    """Allocate what the graph still lacks and compute it on the CPU: the one-call path for tests and scripts."""
    if any(t.buffer is None for t in graph.nodes + graph.leafs):
        (allocator or GraphAllocator()).alloc_graph(graph)
    (backend or CpuBackend()).compute(graph)
    return graph
