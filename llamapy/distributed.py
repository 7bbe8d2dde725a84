"""Data-parallel training over MPI: finding the communicator, and the checks a run needs.

`mpirun -n N llamapy-finetune ...` starts N copies; each finds the others here (`world`)
and passes the communicator to `Context.opt_fit(comm=...)`, where ggmlpy's engine deals
the windows of every optimizer step to the ranks and sums their gradients (ggmlpy.opt,
ggmlpy.distributed). Everything else about a run — printing, saving, checkpoints — is
rank 0's; what every rank must agree on (stop requests, the weights) is checked here.

mpi4py and an MPI library come with the `mpi` extra (`pip install -e '.[mpi]'`): without
it, and outside an MPI launcher, everything is one process as before.
"""
from __future__ import annotations

import array
import fcntl
import hashlib
import os
import stat
import sys
import termios
import time

import numpy as np

from ggmlpy.distributed import Communicator, MPIComm, Solo, as_communicator

from .errors import InputError, LlamapyError

__all__ = ["Communicator", "DistributedError", "Solo", "WeightsDiffer", "abort_job", "any_rank",
           "as_communicator", "check_same_weights", "launched_ranks", "oversubscription_warning", "world"]

# what MPI launchers put in every rank's environment: MPICH/Hydra (PMI), Open MPI, PMIx
_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")


class DistributedError(LlamapyError):
    """The ranks of a run disagree (different weights), or MPI is missing."""


class WeightsDiffer(DistributedError):
    """Some rank's weights differ from rank 0's (found by a collective check on every rank)."""

    on_every_rank = True


def launched_ranks() -> int:
    """How many ranks the MPI launcher started (1 outside a launcher)."""
    for name in _SIZE_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 1


def world() -> Communicator:
    """The communicator of every rank of this job: MPI's COMM_WORLD when an MPI launcher
    started more than one rank, else the single process."""
    if launched_ranks() <= 1:
        return Solo()
    try:
        from mpi4py import MPI
    except ImportError:
        raise InputError("started by an MPI launcher, but mpi4py is missing: pip install 'llamapy[mpi]'") from None
    return MPIComm(MPI.COMM_WORLD)


def any_rank(comm: Communicator, flag: bool) -> bool:
    """Whether `flag` is true on some rank (a collective call: every rank must make it)."""
    return flag if comm.size == 1 else any(comm.allgather(bool(flag)))


def weights_digest(tensors) -> str:
    """A digest of the trained tensors' bytes: equal on every rank while the ranks agree."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update(np.ascontiguousarray(t.array()).view(np.uint8))
    return h.hexdigest()


def check_same_weights(comm: Communicator, tensors, when: str) -> None:
    """Stop the run (WeightsDiffer, on every rank) when some rank's weights differ from rank 0's."""
    if comm.size == 1:
        return
    digests = comm.allgather(weights_digest(tensors))
    odd = [r for r, d in enumerate(digests) if d != digests[0]]
    if odd:
        raise WeightsDiffer(f"the weights of rank{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))} "
                            f"differ from rank 0's {when}: the run cannot continue")


def oversubscription_warning(comm: Communicator, n_threads: int) -> str | None:
    """A warning when this machine's ranks together ask for more threads than it has cores."""
    if comm.size == 1 or not isinstance(comm, MPIComm):
        return None
    local = comm.comm.Split_type(comm._mpi.COMM_TYPE_SHARED)
    try:
        threads = sum(local.allgather(n_threads))
        ranks = local.Get_size()
    finally:
        local.Free()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if threads > cores:
        return (f"{ranks} ranks x -t {n_threads} threads on this machine ask for {threads} threads on {cores} cores: "
                f"use -t {max(1, cores // ranks)}")
    return None


def abort_job(comm: Communicator, message: str, code: int = 1) -> None:
    """Print one line (naming the rank) and end every rank of the job: a rank that fails
    alone must not leave the others waiting in a reduction."""
    print(f"error: rank {comm.rank}: {message}", file=sys.stderr, flush=True)
    wait_until_read(sys.stderr)
    comm.abort(code)


def wait_until_read(stream, timeout: float = 2.0) -> None:
    """Wait, at most `timeout` s, until the launcher has read what this rank wrote to
    `stream` when that is a pipe. MPICH's Hydra proxy watches a rank's output pipe and its
    PMI socket together: when the line and the abort are both pending it can pass the abort
    on first, and the launcher then ends the job without the line (seen in CI: an empty
    stderr). Once the pipe is empty the line is ahead of the abort."""
    try:
        fd = stream.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return
        unread = array.array("i", [0])
        deadline = time.monotonic() + timeout
        while True:
            fcntl.ioctl(fd, termios.FIONREAD, unread, True)
            if unread[0] == 0 or time.monotonic() > deadline:
                return
            time.sleep(0.001)
    except (OSError, ValueError, AttributeError):  # not a file (a caller's StringIO), or closed
        return
