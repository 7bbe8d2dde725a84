"""Every path a command reads and writes, known in one place, so that nothing a user owns is
overwritten by mistake: a write onto a file the run reads, two outputs onto one file, or an
output onto something that is not a file is refused before any work starts.

Flags declare their role (`flag(..., path="read" | "write" | "append")`) and the argument
layer registers their values before the command runs; a command adds what only it knows (a
default output, the files of a --data directory, its positional arguments) with `read` /
`write`, at its start, before its first log line (the log file opens there: common.py). Two
paths are the same file when they resolve to the same place or, if both exist, `os.path.samefile`
says so (links).

The output policy: a file replaced whole (a model, adapter, checkpoint, plot, converted file)
goes onto a regular file or a new path, never onto a directory, device node, FIFO or socket
(llamapy.atomic renames over its target, and checks again before the rename). A log is
appended to (`appends`): it may also be a character device or a FIFO (/dev/stderr, /dev/null,
a pipe), which is written to and never replaced.
"""
from __future__ import annotations

import os
from pathlib import Path

from llamapy.atomic import special_kind
from llamapy.errors import InputError

# what a log may be appended to besides a regular file or a new path
_APPENDABLE = ("a character device", "a FIFO (named pipe)")


class PathClash(InputError):
    """A path refused for the run: `flags` are the flags whose paths it concerns (the log
    file's refusal is then not written into the log file)."""

    def __init__(self, message: str, *flags: str) -> None:
        super().__init__(message)
        self.flags = flags


class Paths:
    """The run's inputs and outputs (flag -> path), checked as they are added."""

    def __init__(self) -> None:
        self.reads: list[tuple[str, Path]] = []
        self.writes: list[tuple[str, Path]] = []
        self._may_replace: dict[str, str] = {}  # read flag -> the write flag that may replace it

    def read(self, flag: str, path: str | os.PathLike | None, replaced_by: str | None = None) -> None:
        """`flag` reads `path` (a directory: each file in it). `replaced_by`: the write flag
        allowed to replace it (a checkpoint resumed and written again)."""
        if path is None:
            return
        path = Path(path)
        files = [p for p in path.iterdir() if p.is_file()] if path.is_dir() else [path]
        for f in files:
            for wflag, wpath in self.writes:
                _refuse_if_same(wflag, wpath, flag, f, replaced_by)
            self.reads.append((flag, f))
        if replaced_by:
            self._may_replace[flag] = replaced_by

    def write(self, flag: str, path: str | os.PathLike | None, *, appends: bool = False) -> None:
        """`flag` writes `path`: a file replaced whole, or a log appended to (`appends`; module
        docstring). Refused when it is something else, when the run reads it, or when
        another flag writes it."""
        if path is None:
            return
        path = Path(path)
        _refuse_kind(flag, path, appends)
        for rflag, rpath in self.reads:
            _refuse_if_same(flag, path, rflag, rpath, self._may_replace.get(rflag))
        for wflag, wpath in self.writes:
            if wflag != flag and _same(path, wpath):
                raise PathClash(f"{flag} {path} and {wflag} {wpath} are the same file: one output would "
                                "overwrite the other", flag, wflag)
        self.writes.append((flag, path))


def _refuse_kind(flag: str, path: Path, appends: bool) -> None:
    kind = special_kind(path)
    if kind is None or appends and kind in _APPENDABLE:
        return
    if appends:
        raise PathClash(f"{flag} {path} is {kind}: a log is appended to a regular file, a character device or a "
                        "FIFO", flag)
    raise PathClash(f"{flag} {path} is {kind}: llamapy writes its outputs as regular files (give a new path or a "
                    "regular file)", flag)


def _refuse_if_same(wflag: str, wpath: Path, rflag: str, rpath: Path, replaced_by: str | None) -> None:
    if wflag != replaced_by and _same(wpath, rpath):
        raise PathClash(f"{wflag} {wpath} is the file {rflag} reads: writing it would destroy an input "
                        "(choose another path)", wflag, rflag)


def _same(a: Path, b: Path) -> bool:
    try:
        if a.resolve() == b.resolve():
            return True
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False
