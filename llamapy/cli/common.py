"""What every command-line front end shares: one-line errors, threads, reading text."""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Optional

import typer

from llamapy.errors import InputError, LlamapyError


# the flag that chooses a chat template (llamapy-cli's chats, the training commands' samples)
ChatTemplateOption = Annotated[Optional[str], typer.Option(
    "--chat-template", help="built-in template name or Jinja file (default: the model's)")]

_COMM = None  # the job's communicator once a tool asked for it (several ranks under mpirun)


def job():
    """This run's communicator (llamapy.distributed.world, found once)."""
    global _COMM
    if _COMM is None:
        from llamapy.distributed import world
        _COMM = world()
    return _COMM


def fail(message: str, code: int = 1, *, every_rank: bool = False) -> None:
    """One line and a non-zero exit. Under MPI, an error of one rank names the rank and ends
    every rank; one that every rank meets at the same point (`every_rank`) is rank 0's line,
    and each rank exits by itself."""
    if _COMM is not None and _COMM.size > 1 and not every_rank:
        from llamapy.distributed import abort_job
        abort_job(_COMM, message, code)
    log(f"error: {message}")
    raise SystemExit(code)


def guarded(main: Callable[[], None]) -> Callable[[], None]:
    """Run a CLI so that user errors print one clear line and exit non-zero, never a traceback."""
    def run() -> None:
        try:
            job()  # under an MPI launcher: find the other ranks before anything is printed
            main()
        except LlamapyError as e:
            fail(str(e), every_rank=e.on_every_rank)
        except KeyboardInterrupt as e:
            fail(str(e) or "interrupted", 130)
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


def note_first_run() -> None:
    """On the first run after installing, say why the first graphs take long."""
    from ggmlpy.backend.cpu import kernels_cached
    if not kernels_cached():
        log("first run after install: compiling the numba kernels (tens of seconds, once: they are cached)")


def chat_template_for(model, choice: str | None):
    """llamapy.chat.ChatTemplate.for_model, with a line saying which template is used."""
    from llamapy.chat import ChatTemplate
    template, note = ChatTemplate.for_model(model, choice)
    log(note or f"chat template: {template.name.removeprefix('chat template ')}")
    return template


def log(message: str) -> None:
    """A progress line (rank 0's only, under MPI)."""
    if _COMM is None or _COMM.rank == 0:
        print(message, file=sys.stderr, flush=True)


PAIR_SEP = "\x1f"


def join_pairs(argv: list[str], flag: str) -> list[str]:
    """`FLAG A B` -> `FLAG A<sep>B`, for llama.cpp options that take two values
    (`--lora-scaled FILE SCALE`); split them back with `split_pair`."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == flag and i + 2 < len(argv) + 0 and not argv[i + 2].startswith("--"):
            out += [flag, argv[i + 1] + PAIR_SEP + argv[i + 2]]
            i += 3
        else:
            out.append(argv[i])
            i += 1
    return out


def split_pair(value: str, flag: str) -> tuple[str, str]:
    if PAIR_SEP not in value:
        raise InputError(f"{flag} needs two values, e.g. {flag} adapter.gguf 0.5")
    a, b = value.split(PAIR_SEP, 1)
    return a, b


def load_adapters(model, paths=(), scaled=()) -> list:
    """(LoraAdapter, scale) pairs from `--lora FILE` and `--lora-scaled FILE SCALE` options,
    each announced on stderr."""
    from llamapy.lora import LoraAdapter
    pairs = [(str(p), "1") for p in paths or []] + [split_pair(item, "--lora-scaled") for item in scaled or []]
    out = []
    for path, scale in pairs:
        try:
            value = float(scale)
        except ValueError:
            raise InputError(f"--lora-scaled {path}: scale {scale!r} is not a number") from None
        adapter = LoraAdapter.load(path, model)
        log(f"lora: {path} (rank {adapter.rank}, alpha {adapter.alpha:g}, {len(adapter.tensors)} matrices) x {value:g}")
        out.append((adapter, value))
    return out
