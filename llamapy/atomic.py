"""Atomic file writes: the one way llamapy replaces a file a user owns (models, adapters,
checkpoints, plots, the assembled default model).

The content goes to a temp file beside the destination (`.NAME.<pid>.<random>.tmp`), is
fsynced, read back by the caller's validator (the reader that loads such a file: no tool
ends with a file llamapy cannot load), and renamed over it, so a reader never sees half a
file and a failed, interrupted or unreadable write leaves the previous file intact. The temp
file is removed on any exit Python sees (an error, Ctrl-C); a SIGKILL or a power cut leaves
it behind, so the next write of the same destination first removes the temp files whose
writing process is gone (the pid in the name).

Only a regular file or a new path is replaced: a rename over a device node, a FIFO or a
socket would put a file where the system had something else (run as root, `/dev/full`
became a regular file), so those are refused, before the write and again right before the
rename. A symbolic link is judged by what it points to; the rename replaces the link itself.
"""
from __future__ import annotations

import errno
import os
import re
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from .errors import LlamapyError, SaveError

# what stands at a path, by stat's file type, as a refusal names it
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))


def special_kind(path: str | os.PathLike) -> str | None:
    """What stands at `path` when it is neither a regular file nor nothing ("a directory", "a
    character device", ...); None for a regular file, a new path or a dangling link. A link is
    judged by its target (os.stat follows it)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):  # nothing there (or no way to look: the write will say why)
        return None
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def open_to_append(path: str | os.PathLike) -> int:
    """A descriptor appending to `path` (created when new, never truncated or renamed over: a
    log, a metrics file, a FIFO or /dev/stdout alike). The open does not block, so a FIFO
    that no process reads is an OSError (ENXIO: `append_failure` words it), not a hang; the
    writes then block as usual, and the reader sees the end only when this descriptor closes."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o644)
    os.set_blocking(fd, True)
    return fd


def append_failure(e: OSError) -> str:
    """Why a path could not be opened or written to append, in a user's words."""
    if e.errno == errno.ENXIO:
        return "no process reads it (a FIFO or socket needs a reader)"
    return e.strerror or str(e)


def refuse_special(dest: Path, what: str) -> None:
    """SaveError when `dest` is something a rename must not replace (module docstring)."""
    kind = special_kind(dest)
    if kind is not None:
        raise SaveError(f"cannot save {what} to {dest}: it is {kind}; llamapy replaces only regular files "
                        "(give a new path or a regular file)")


def replace_atomically(dest: str | os.PathLike, write: Callable[[BinaryIO], None], what: str,
                       validate: Callable[[Path], object] | None = None) -> Path:
    """Write `dest` through `write(file)` atomically (module docstring); returns `dest`.
    `validate(tmp_path)` reads the fsynced temp file back and raises (a LlamapyError, OSError
    or ValueError) when it is not what it must be: the target is then left untouched. A
    failure is a SaveError naming `what` and the reason."""
    dest = Path(dest)
    refuse_special(dest, what)
    remove_stale_temp_files(dest)
    tmp: Path | None = None
    try:
        fd, name = tempfile.mkstemp(prefix=f".{dest.name}.{os.getpid()}.", suffix=".tmp", dir=dest.parent)
        tmp = Path(name)
        with os.fdopen(fd, "wb") as out:
            os.fchmod(out.fileno(), 0o644)
            write(out)
            out.flush()
            os.fsync(out.fileno())
        if validate is not None:
            _read_back(tmp, dest, what, validate)
        refuse_special(dest, what)  # again: the write may have taken hours
        os.replace(tmp, dest)
        tmp = None
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise SaveError(f"cannot save {what} to {dest}: {reason}") from None
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
    _fsync_dir(dest.parent)
    return dest


def _read_back(tmp: Path, dest: Path, what: str, validate: Callable[[Path], object]) -> None:
    """The caller's validator on the written temp file; its refusal names the destination."""
    try:
        validate(tmp)
    except (LlamapyError, OSError, ValueError) as e:
        reason = str(e).replace(str(tmp), str(dest))
        raise SaveError(f"cannot save {what} to {dest}: what was written does not read back: {reason}") from None


def remove_stale_temp_files(dest: Path) -> list[Path]:
    """Remove the temp files of earlier writes of `dest` whose process no longer runs (a
    killed run's); returns them."""
    pattern = re.compile(rf"\.{re.escape(dest.name)}\.(\d+)\.[^.]+\.tmp")
    removed = []
    try:
        siblings = list(dest.parent.iterdir())
    except OSError:
        return removed
    for path in siblings:
        m = pattern.fullmatch(path.name)
        if m and not _running(int(m.group(1))):
            try:
                path.unlink()
                removed.append(path)
            except OSError:
                pass
    return removed


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable (best effort: not every platform can open a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
