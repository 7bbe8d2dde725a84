"""Atomic file writes: the one way llamapy replaces a file a user owns (models, adapters,
checkpoints, plots, the assembled default model).

The content goes to a temp file beside the destination (`.NAME.<pid>.<random>.tmp`), is
fsynced and renamed over it, so a reader never sees half a file and a failed or interrupted
write leaves the previous file intact. The temp file is removed on any exit Python sees (an
error, Ctrl-C); a SIGKILL or a power cut leaves it behind, so the next write of the same
destination first removes the temp files whose writing process is gone (the pid in the name).
"""
from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from .errors import SaveError


def replace_atomically(dest: str | os.PathLike, write: Callable[[BinaryIO], None], what: str) -> Path:
    """Write `dest` through `write(file)` atomically (module docstring); returns `dest`.
    A failure is a SaveError naming `what` and the reason."""
    dest = Path(dest)
    if dest.is_dir():
        raise SaveError(f"cannot save {what} to {dest}: it is a directory")
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
