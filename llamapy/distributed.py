"""Data-parallel training over MPI: finding the communicator, and the checks a run needs.

`mpirun -n N llamapy-finetune ...` starts N copies; each finds the others here (`world`)
and passes the communicator to `Context.opt_fit(comm=...)`, where ggmlpy's engine deals
the windows of every optimizer step to the ranks and sums their gradients (ggmlpy.opt,
ggmlpy.distributed). Everything else about a run — printing, saving, checkpoints — is
rank 0's; what every rank must agree on is checked here: before the first step, that
every rank runs the same configuration on the same data (`check_ranks_agree`: otherwise
one rank would enter a collective the others never reach, and the job would hang), then
stop requests and, after each epoch, the weights.

How a rank that fails ends the job: an error met by one rank alone prints one line naming
the rank and calls MPI_Abort (`abort_job`); an error every rank meets at the same point
(a collective check) is rank 0's line, and the ranks exit by themselves; a rank killed by
a signal is named by the small process that started it (`watch_rank`, under MPICH's Hydra).

mpi4py and an MPI library come with the `mpi` extra (`pip install -e '.[mpi]'`): without
it, and outside an MPI launcher, everything is one process as before.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ggmlpy.distributed import Communicator, MPIComm, Solo, as_communicator

from .errors import InputError, LlamapyError, install_hint
from .rank_watch import JOB_SIGNALS, wait_until_read, watch

__all__ = ["Communicator", "DistributedError", "RanksDiffer", "RanksFailed", "Setting", "Solo", "WeightsDiffer",
           "abort_job", "any_rank", "as_communicator", "check_ranks_agree", "check_same_weights", "describe_error",
           "launched_ranks", "oversubscription_warning", "watch_rank", "world"]

# what MPI launchers put in every rank's environment: MPICH/Hydra (PMI), Open MPI, PMIx
_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")


class DistributedError(LlamapyError):
    """The ranks of a run disagree (different weights), or MPI is missing."""


class WeightsDiffer(DistributedError):
    """Some rank's weights differ from rank 0's (found by a collective check on every rank)."""

    on_every_rank = True


class RanksDiffer(DistributedError):
    """Some rank was started with another configuration or other data than rank 0 (found by
    a collective check on every rank, before the first step)."""

    on_every_rank = True


class RanksFailed(DistributedError):
    """Some rank failed while the ranks set up a run; it said so at the next collective check,
    where every rank stops with this error (its message names the rank) and `code`."""

    on_every_rank = True

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


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
        raise InputError(f"started by an MPI launcher, but mpi4py is missing: {install_hint('mpi')}") from None
    return MPIComm(MPI.COMM_WORLD)


def any_rank(comm: Communicator, flag: bool) -> bool:
    """Whether `flag` is true on some rank (a collective call: every rank must make it)."""
    return flag if comm.size == 1 else any(comm.allgather(bool(flag)))


@dataclass(frozen=True)
class Setting:
    """One thing every rank must agree on: how a message names it (`label`: a flag as the
    user typed it, "the training windows"), its value (compared as canonical JSON), and how
    a message shows the value (`text`, default str(value); `hidden`: not at all, a digest)."""

    label: str
    value: Any
    text: str | None = None
    hidden: bool = False

    def shown(self) -> str | None:
        return None if self.hidden else self.text if self.text is not None else str(self.value)


def check_ranks_agree(comm: Communicator, settings: Mapping[str, Setting], payload: Any = None,
                      error: tuple[str, int] | None = None) -> list[Any]:
    """Stop the run (RanksDiffer, raised on every rank: each exits by itself, rank 0 says why)
    when some rank's `settings` differ from rank 0's: the first differing setting, in rank
    0's order, of the lowest such rank, with both values: "rank 1's --epochs (3) differs from
    rank 0's (2)". One collective (an allgather of a few hundred bytes), to be made by every
    rank at the same point, before any collective whose shape depends on these settings.
    Returns every rank's `payload` (e.g. a random seed of which rank 0's is used).

    A rank that failed on its way here comes with its `error` (message, exit code) instead
    of settings: every rank then raises RanksFailed naming it ("rank 1: text file not found:
    ..."; "every rank: ..." when all failed alike), so that a rank's failure before training
    ends every rank at the same point, with one line and no abort."""
    if comm.size == 1:
        if error is not None:
            raise RanksFailed(error[0], error[1])
        return [payload]
    mine = {key: (s.label, _canonical(s.value), s.shown()) for key, s in settings.items()}
    gathered = comm.allgather((mine, payload, error))
    failed = [(rank, err) for rank, (_, _, err) in enumerate(gathered) if err is not None]
    if failed:
        rank, (message, code) = failed[0]
        if len(failed) == comm.size and all(err[0] == message for _, err in failed):
            raise RanksFailed(f"every rank: {message}", code)
        others = [str(r) for r, _ in failed[1:]]
        also = f" (rank{'s' if len(others) > 1 else ''} {', '.join(others)} failed too)" if others else ""
        raise RanksFailed(f"rank {rank}: {message}{also}", code)
    first = gathered[0][0]
    for rank in range(1, comm.size):
        theirs = gathered[rank][0]
        for key in list(first) + [k for k in theirs if k not in first]:
            label0, value0, shown0 = first.get(key, (None, None, "not given"))
            label, value, shown = theirs.get(key, (label0, None, "not given"))
            if value != value0:
                label = label or label0
                if shown is None or shown0 is None:
                    raise RanksDiffer(f"rank {rank}'s {label} differs from rank 0's")
                raise RanksDiffer(f"rank {rank}'s {label} ({_short(shown)}) differs from rank 0's ({_short(shown0)})")
    return [p for _, p, _ in gathered]


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _short(text: str, limit: int = 100) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def describe_error(e: BaseException) -> str:
    """An exception as one line: llamapy's own errors by their message (it says what is
    wrong with which input), a failing file operation by its reason and file, anything else
    — a bug, or a library's error llamapy did not expect — by its type and message."""
    if isinstance(e, LlamapyError):
        return str(e)
    if isinstance(e, KeyboardInterrupt):
        return str(e) or "interrupted"
    if isinstance(e, MemoryError):
        return "out of memory"
    if isinstance(e, OSError):
        return f"{e.strerror or e}: {e.filename}" if e.filename else str(e.strerror or e)
    message = " ".join(str(e).split())
    return f"{type(e).__name__}: {message}" if message else type(e).__name__


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
    write_line(f"error: rank {comm.rank}: {message}")
    wait_until_read(sys.stderr)
    comm.abort(code)


def write_line(line: str, stream=None) -> None:
    """`line` on stderr in one write: the launcher merges the ranks' output as it reads it,
    and a line written in pieces can be cut by another rank's."""
    stream = stream or sys.stderr
    stream.flush()
    try:
        data = (line.rstrip("\n") + "\n").encode(getattr(stream, "encoding", None) or "utf-8", "replace")
        fd = stream.fileno()
        while data:
            data = data[os.write(fd, data):]
    except (OSError, ValueError, AttributeError):  # not a file (a caller's StringIO), or closed
        print(line, file=stream, flush=True)


def watch_rank() -> None:
    """Under MPICH's Hydra launcher (more than one rank, Linux), put a watcher between Hydra
    and this rank, which names the rank when a signal kills it (llamapy.rank_watch says why
    nothing else can under Hydra). The process Hydra started starts the same command again
    as its child (a new process: ggmlpy's OpenMP threads, running since import, make a fork
    unsafe), then becomes the watcher, a small Python of ~10 MB; the child is the rank. The
    command-line tools call this first thing, before MPI starts; in the child it returns at
    once. Does nothing elsewhere, and with LLAMAPY_RANK_WATCH=0."""
    watcher = os.environ.pop(_WATCHER, None)  # (not for the processes this rank starts)
    if watcher is not None:  # the rank, started by its watcher: dies with it
        _die_with_parent()
        if str(os.getppid()) != watcher:  # the watcher died before that: the job is ending
            os._exit(1)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, JOB_SIGNALS)
        return
    if (not _hydra_rank() or launched_ranks() <= 1 or os.environ.get("LLAMAPY_RANK_WATCH", "1") == "0"
            or not sys.platform.startswith("linux") or "mpi4py.MPI" in sys.modules):
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    # until each listens: the watcher from its first line, the rank once it has its handlers
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)
    try:  # the same command line, every file descriptor (Hydra's PMI socket) inherited
        pid = os.posix_spawn(sys.executable, [sys.executable, *sys.orig_argv[1:]],
                             {**os.environ, _WATCHER: str(os.getpid())})
    except OSError:  # no room for a process: run unwatched
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        return
    rank = os.environ["PMI_RANK"]
    try:
        os.execv(sys.executable, [sys.executable, "-I", "-S", str(Path(__file__).with_name("rank_watch.py")),
                                  str(pid), rank])
    except OSError:
        watch(pid, rank)  # could not start it: watch from this interpreter


_WATCHER = "LLAMAPY_RANK_WATCHER"  # in a rank's environment: its watcher's pid


def _die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent dies (PR_SET_PDEATHSIG), so that a
    rank never outlives its watcher (Hydra ends a job by killing the processes it started)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _hydra_rank() -> bool:
    """Whether MPICH's Hydra started this process as a rank (its PMI variables)."""
    return "PMI_RANK" in os.environ and "MPI_LOCALNRANKS" in os.environ and (
        "PMI_FD" in os.environ or "PMI_PORT" in os.environ)
