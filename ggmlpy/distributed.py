"""Data parallelism: what the training engine needs from a communicator, and two of them.

The engine (`ggmlpy.opt`) reduces through a `Communicator`: the world size and this
process's rank, an in-place sum of a float buffer across processes (the optimizer's one
flat gradient buffer, sent in buckets), gathering small Python objects (a step's losses,
results, checksums) and aborting the whole job. `Solo` is the single process; `MPIComm`
wraps an mpi4py communicator. ggmlpy never imports mpi4py itself: whoever has one wraps it.
"""
from __future__ import annotations

from typing import Any, NoReturn, Protocol

import numpy as np


class Communicator(Protocol):
    rank: int
    size: int

    def allreduce_sum(self, buffer: np.ndarray) -> None:
        """Replace `buffer` (contiguous) on every process by its sum over all processes."""

    def allgather(self, obj: Any) -> list[Any]:
        """Every process's `obj`, in rank order, on every process."""

    def abort(self, code: int) -> NoReturn:
        """End every process of the job (a failing rank must not leave the others waiting)."""


class Solo:
    """One process: reductions are the identity."""

    rank, size = 0, 1

    def allreduce_sum(self, buffer: np.ndarray) -> None:
        pass

    def allgather(self, obj: Any) -> list[Any]:
        return [obj]

    def abort(self, code: int) -> NoReturn:
        raise SystemExit(code)


class MPIComm:
    """An mpi4py communicator. Sums go through MPI_Allreduce in place, in buckets of
    BUCKET values (bounded temporary memory inside MPI, one call per bucket, never one per
    tensor)."""

    BUCKET = 1 << 22  # float32 values per Allreduce call: 16 MiB

    def __init__(self, comm) -> None:
        from mpi4py import MPI
        self._mpi = MPI
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def allreduce_sum(self, buffer: np.ndarray) -> None:
        flat = buffer.reshape(-1)
        for lo in range(0, flat.size, self.BUCKET):
            self.comm.Allreduce(self._mpi.IN_PLACE, flat[lo:lo + self.BUCKET], op=self._mpi.SUM)

    def allgather(self, obj: Any) -> list[Any]:
        return self.comm.allgather(obj)

    def abort(self, code: int) -> NoReturn:
        self.comm.Abort(code)
        raise SystemExit(code)  # not reached


def as_communicator(comm: Any) -> Communicator:
    """`comm` as a Communicator: None is the single process; an mpi4py communicator is wrapped."""
    if comm is None:
        return Solo()
    if hasattr(comm, "allreduce_sum"):
        return comm
    if hasattr(comm, "Allreduce") and hasattr(comm, "Get_rank"):
        return MPIComm(comm)
    raise TypeError(f"not a communicator: {comm!r}")
