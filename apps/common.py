"""What every command-line front end shares: one-line errors, threads, reading text."""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from llamapy.errors import InputError, LlamapyError


def fail(message: str, code: int = 1) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def guarded(main: Callable[[], None]) -> Callable[[], None]:
    """Run a CLI so that user errors print one clear line and exit non-zero, never a traceback."""
    def run() -> None:
        try:
            main()
        except LlamapyError as e:
            fail(str(e))
        except KeyboardInterrupt:
            fail("interrupted", 130)
        except MemoryError:
            fail("out of memory")
        except OSError as e:
            fail(f"{e.strerror or e}: {e.filename}" if getattr(e, "filename", None) else str(e))
    return run


def read_text(path: Path) -> str:
    if not path.is_file():
        raise InputError(f"text file not found: {path}")
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}") from None


def default_threads() -> int:
    return max(1, min(os.cpu_count() or 1, 4))


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
