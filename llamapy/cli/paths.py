"""Every path a command reads and writes, known in one place, so that nothing a user owns is
overwritten by mistake: a write onto a file the run reads, or two outputs onto one file, is
refused before any work starts.

Flags declare their role (`flag(..., path="read" | "write")`) and the argument layer
registers their values before the command runs; a command adds what only it knows (a default
output, the files of a --data directory) with `read` / `write`. Two paths are the same file
when they resolve to the same place or, if both exist, `os.path.samefile` says so (links).
"""
from __future__ import annotations

import os
from pathlib import Path

from llamapy.errors import InputError


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

    def write(self, flag: str, path: str | os.PathLike | None) -> None:
        """`flag` writes `path`: refused when the run reads it or another flag writes it."""
        if path is None:
            return
        path = Path(path)
        for rflag, rpath in self.reads:
            _refuse_if_same(flag, path, rflag, rpath, self._may_replace.get(rflag))
        for wflag, wpath in self.writes:
            if wflag != flag and _same(path, wpath):
                raise InputError(f"{flag} {path} and {wflag} {wpath} are the same file: one output would "
                                 "overwrite the other")
        self.writes.append((flag, path))


def _refuse_if_same(wflag: str, wpath: Path, rflag: str, rpath: Path, replaced_by: str | None) -> None:
    if wflag != replaced_by and _same(wpath, rpath):
        raise InputError(f"{wflag} {wpath} is the file {rflag} reads: writing it would destroy an input "
                         "(choose another path)")


def _same(a: Path, b: Path) -> bool:
    try:
        if a.resolve() == b.resolve():
            return True
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False
