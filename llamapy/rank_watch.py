"""How a rank's end reaches the launcher: a line that the launcher reads before MPI_Abort
overtakes it (`wait_until_read`), and the watcher that names a rank killed by a signal.

Why a watcher. Under MPICH's Hydra launcher, when a rank dies of a signal (SIGKILL from a
user or the kernel's out-of-memory killer, SIGSEGV), Hydra ends every other rank at once
with a signal it cannot catch and prints the dead process's pid and signal, not its rank.
No surviving rank can name the dead one (measured: two ranks looping on allgather, the
second one SIGKILLed; the first, with handlers for SIGINT, SIGTERM and SIGHUP, printed
nothing, and neither did the idle Python parent of a rank), and rank 0's collective never
gets to time out. Hydra's `mpirun -disable-auto-cleanup` would keep the survivors alive
for a fault-tolerant MPI to report the dead rank, but it is not the default, and a
launcher's default is what users run.

So the process Hydra launches for a rank runs the same command again as its child, the
rank (llamapy.distributed.watch_rank), and becomes this module's `watch`: a small Python of
~10 MB that imports only the standard library. The watcher waits for the rank; when it
exits, the watcher exits with its code; when a signal kills it that the watcher did not
also receive (Hydra signals a rank's whole process group: a Ctrl-C, a job ended by the
launcher), it writes `error: rank R: killed by signal 9 (SIGKILL: ...)`, waits until the
launcher has read the line, and dies of the same signal, so that Hydra reports and ends
the job exactly as it did before. The rank dies with the watcher (PR_SET_PDEATHSIG), so a
watcher that is itself killed leaves no rank behind; Hydra then reports the watcher's pid
and signal only. A machine that is lost (power, network) ends with Hydra's message alone.

This file is also run as a script (`python -I -S rank_watch.py PID RANK`): it must import
nothing but the standard library.
"""
from __future__ import annotations

import array
import fcntl
import os
import resource
import signal
import stat
import sys
import termios
import time

# what Hydra sends to a rank's whole process group (killpg), the watcher included: the rank
# died of one of these with the job, not alone, when the watcher got it too
JOB_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
               signal.SIGALRM)

_WHY = {signal.SIGKILL: "sent by a user, or by the kernel when memory runs out",
        signal.SIGSEGV: "a crash", signal.SIGBUS: "a crash", signal.SIGILL: "a crash", signal.SIGFPE: "a crash",
        signal.SIGABRT: "aborted"}


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


def death_line(rank: str, sig: int) -> str:
    """The line naming a rank that signal `sig` killed."""
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    why = _WHY.get(sig)
    return f"error: rank {rank}: killed by signal {sig} ({name}{f': {why}' if why else ''})"


def watch(pid: int, rank: str) -> None:
    """Wait for the rank (child `pid`) and end as it ended (module docstring). Never returns.
    The signals of JOB_SIGNALS must be blocked on entry (watch_rank blocks them before it
    forks, so that none is lost or kills the watcher before it listens)."""
    received: set[int] = set()
    for sig in JOB_SIGNALS:
        signal.signal(sig, lambda sig, frame: received.add(sig))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, JOB_SIGNALS)
    try:
        _, status = os.waitpid(pid, 0)  # retried by Python when a handler interrupts it
    except ChildProcessError:
        os._exit(1)
    if not os.WIFSIGNALED(status):
        os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)
    sig = os.WTERMSIG(status)
    if sig not in received:
        line = (death_line(rank, sig) + "\n").encode()
        try:
            while line:
                line = line[os.write(2, line):]
        except OSError:
            pass
        wait_until_read(sys.stderr)
    die_of(sig)


def die_of(sig: int) -> None:
    """End this process by signal `sig` (no core file), as the rank ended."""
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        time.sleep(1.0)
    except (OSError, ValueError):
        pass
    os._exit(128 + sig)


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.argv[2])
