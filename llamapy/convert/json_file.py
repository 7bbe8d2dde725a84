"""The JSON files of a checkpoint or an adapter, read so that whatever they hold is one line
naming the file, never a traceback: not UTF-8, not JSON, nested deeper than Python's reader
goes, a number with more digits than Python converts, a key given twice where that matters."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llamapy.errors import CheckpointError


def read_json(path: Path, *, unique: bool = False) -> Any:
    """A JSON file's content; CheckpointError naming the file when it is not JSON (nested too
    deeply for Python's reader, a number too long to read included); `unique`: a key given
    twice in an object is refused too (the JSON reader would keep the last silently)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    try:
        return json.loads(text, object_pairs_hook=unique_keys if unique else None)
    except RecursionError:
        raise CheckpointError(f"{path}: JSON nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, a too long integer, unique_keys
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """json.loads' object_pairs_hook that refuses a key given twice in an object."""
    out = dict(pairs)
    if len(out) < len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"the key {twice!r} is given twice")
    return out


def optional_json(path: Path) -> Any:
    return read_json(path) if path.is_file() else None
