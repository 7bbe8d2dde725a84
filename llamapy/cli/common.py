"""What every command-line front end shares: one-line errors, threads, reading text."""
from __future__ import annotations

import gc
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from llamapy.atomic import append_failure, open_to_append
from llamapy.errors import InputError, LlamapyError

_COMM = None  # the job's communicator once a tool asked for it (several ranks under mpirun)
# the command's flags as parsed: parameter name -> (the flag as the user gave it, its value)
parsed_flags: dict[str, tuple[str, object]] = {}


_PATHS = None  # the run's paths (paths.Paths), made by the argument layer before the command runs


def freeze_startup_objects() -> None:
    """Keep what the tool has made so far (numba's kernels, the model, warmed-up graphs) out of
    the garbage collector's full passes: over the ~170k objects of a loaded model a full pass
    takes ~90 ms, and the first graph of a new shape (the first token after a long prompt, a
    new ubatch size) set one off. A tool keeps these objects to its end, so none is lost."""
    gc.collect()
    gc.freeze()


def new_paths():
    """A fresh record of the run's inputs and outputs (llamapy/cli/paths.py)."""
    global _PATHS
    from .paths import Paths
    _PATHS = Paths()
    return _PATHS


def paths():
    """The run's inputs and outputs: a command adds what only it knows (a default output)."""
    return _PATHS if _PATHS is not None else new_paths()


def lora_paths(items: list[str] | None) -> list[str]:
    """The files named by --lora / --lora-scaled values (comma lists, FNAME or FNAME:SCALE)."""
    return [entry.rpartition(":")[0] if ":" in entry and not os.path.exists(entry) else entry
            for item in items or [] for entry in _csv(item)]


def job():
    """This run's communicator (llamapy.distributed.world, found once)."""
    global _COMM
    if _COMM is None:
        from llamapy.distributed import world
        _COMM = world()
    return _COMM


class _Setup:
    """Under MPI, the ranks of a training tool meet at fixed points before training starts
    (`meet`: the flags right after parsing, then the inputs just before the first step).
    Until the last, a rank that fails goes to its next meeting with its error instead of
    aborting: every rank stops there, with one line ("rank 1: ..." or "every rank: ...")."""

    open = False  # a training tool under MPI, before its last meeting


def begin_setup() -> None:
    """A training tool starts: its ranks will meet (module docstring of _Setup)."""
    _Setup.open = True


def meet(settings, payload=None, *, last: bool = False, error: tuple[str, int] | None = None) -> list:
    """One of the setup's meetings: llamapy.distributed.check_ranks_agree over the job
    (RanksDiffer or RanksFailed on every rank when they differ or one failed); `last`: the
    one before the first step, after which a failing rank aborts the job."""
    from llamapy.distributed import check_ranks_agree
    try:
        return check_ranks_agree(job(), settings, payload, error)
    finally:
        if last or error is not None:
            _Setup.open = False


_STOPPED_EARLY = "stopped before training (it was given -h or --version)"


def _stopped_early() -> None:
    """A training tool that ended without training (-h, --version) goes to the ranks' next
    meeting: every rank ended so: all exit; else the others stop there with one line."""
    from llamapy.distributed import RanksFailed
    try:
        meet({}, error=(_STOPPED_EARLY, 1))
    except RanksFailed as e:
        if str(e) != f"every rank: {_STOPPED_EARLY}":
            fail(str(e), e.code, every_rank=True)


def fail(message: str, code: int = 1, *, every_rank: bool = False) -> None:
    """One line and a non-zero exit. Under MPI, an error of one rank names the rank and ends
    every rank: before training, at the ranks' next meeting (`meet`), once training runs,
    by aborting the job; one that every rank meets at the same point (`every_rank`) is rank
    0's line, and each rank exits by itself."""
    if _COMM is not None and _COMM.size > 1 and not every_rank:
        if _Setup.open:
            from llamapy.distributed import RanksFailed
            try:
                meet({}, error=(message, code))
            except RanksFailed as shared:
                message, code, every_rank = str(shared), shared.code, True
    if _COMM is not None and _COMM.size > 1 and not every_rank:
        from llamapy.distributed import abort_job
        abort_job(_COMM, message, code)
    if _COMM is None or _COMM.rank == 0:
        _line(sys.stderr, f"error: {message}")
        _error_to_log_file(f"error: {message}")
    raise SystemExit(code)


def guarded(main: Callable[[], None]) -> Callable[[], None]:
    """Run a CLI so that user errors print one clear line and exit non-zero, never a traceback.
    Under MPI every exception ends the job that way, the unexpected ones too (a bug, a
    library's error): a rank that raised and exited would leave the others waiting in a
    collective for ever (its MPI_Finalize waits for them too); its line names the exception's
    type, and -v adds the traceback."""
    def run() -> None:
        from llamapy.distributed import describe_error, watch_rank
        try:
            watch_rank()  # under mpirun: a watcher that names this rank if a signal kills it
            job()  # under an MPI launcher: find the other ranks before anything is printed
            main()
            if _Setup.open and _COMM.size > 1:  # -h or --version: the other ranks may be waiting
                _stopped_early()
        except LlamapyError as e:
            if LOG_FILE_FLAG in getattr(e, "flags", ()):  # paths.PathClash: the log file was refused
                forget_log_file()
            fail(str(e), getattr(e, "code", 1), every_rank=e.on_every_rank)
        except KeyboardInterrupt as e:
            # every rank has the signal, some maybe inside a meeting: meeting again could pair
            # different meetings; each says so and the job is aborted
            _Setup.open = False
            fail(str(e) or "interrupted", 130)
        except MemoryError:
            fail("out of memory")
        except OSError as e:
            fail(describe_error(e))
        except Exception as e:
            if _COMM is None or _COMM.size == 1:
                raise
            if _Log.level >= DEBUG:
                traceback.print_exc()
            fail(describe_error(e))
        finally:
            gc.unfreeze()  # a tool run inside a longer process (tests, Python) gives its objects back
    return run


def read_text(path: Path, what: str = "text file") -> str:
    """A text file's UTF-8 text, or one line saying why it is not text (llamapy.text_input)."""
    from llamapy.text_input import read_text_file
    return read_text_file(path, what, warn)


def random_seed(seed: int | None = None) -> int:
    """llama.cpp's `--seed -1`: a random seed (`seed`, when already drawn: rank 0's under
    MPI), printed so that the run can be repeated."""
    if seed is None:
        seed = draw_seed()
    log(f"seed: {seed} (random: --seed {seed} repeats this run)")
    return seed


def thread_count(requested: int | None) -> int:
    """-t, or the default (the cores, at most 4); more threads than cores is allowed but said."""
    cores = os.cpu_count() or 1
    if requested is None:
        return max(1, min(cores, 4))
    if requested > cores:
        warn(f"-t {requested} is more threads than the {cores} cores: they will wait on each other")
    return requested


def draw_seed() -> int:
    import secrets
    return secrets.randbelow(2**31)


def prepare_numba() -> None:
    """Before a command runs: say why the run is slow when numba really compiles (the first run
    after installing), and load numba's registries without the packages it probes for unused features (numba_compat)."""
    from ggmlpy.numba_compat import on_first_compile, start_numba_registries
    on_first_compile(lambda: log("compiling numba kernels this run has not used before (tens of seconds after "
                                 "installing; once: they are cached)"))
    start_numba_registries()


KV_TYPES = ("f16", "f32")


def kv_cache_types(type_k: str, type_v: str) -> tuple:
    """-ctk / -ctv: the KV cache types llamapy has (llama.cpp also quantizes the cache)."""
    from ggmlpy import GGMLType
    for flag, value in (("-ctk", type_k), ("-ctv", type_v)):
        if value.lower() not in KV_TYPES:
            raise InputError(f"{flag} {value}: the KV cache can be {' or '.join(KV_TYPES)}")
    return GGMLType[type_k.upper()], GGMLType[type_v.upper()]


def chat_template_for(model, choice: str | None):
    """llamapy.chat.ChatTemplate.for_model, with a line saying which template is used."""
    from llamapy.chat import ChatTemplate
    template, note = ChatTemplate.for_model(model, choice)
    log(note or f"chat template: {template.name.removeprefix('chat template ')}")
    return template


class _Log:
    """Where log lines go (the logging flags of every tool: -v, -lv, --log-disable, --log-file).

    The log file is one of the run's outputs (paths.py), appended to and never replaced (a
    character device such as /dev/stderr or a FIFO is written to as it is). It opens with
    the first line the command itself logs: a command declares its inputs and outputs before
    that line, so a log file that is one of them is refused before a byte goes into it; the
    lines logged before (notes on flags, -v's flags) wait in `held`. An error goes into it
    only once it is open, and never the refusal of the log file itself."""

    level = INFO = 3
    path: Path | None = None  # --log-file
    file = None               # open from the command's first log line
    held: list[str] = []      # lines logged before that
    began = False             # the command's own code runs (it has declared its paths)


ERROR, WARNING, INFO, DEBUG = 1, 2, 3, 4
LOG_FILE_FLAG = "--log-file"


def configure_logging(verbose: bool = False, verbosity: int | None = None, log_disable: bool = False,
                      log_file: Path | None = None) -> None:
    """llama.cpp's logging flags: -lv N shows lines up to level N, -v everything,
    --log-disable nothing (errors still print), --log-file a copy of every line shown
    (opened later: _Log). Called with no arguments: the defaults, no log file."""
    close_log()
    _Log.level = 0 if log_disable else DEBUG if verbose else verbosity if verbosity is not None else INFO
    _Log.path, _Log.held, _Log.began = log_file, [], False


def command_begins() -> None:
    """The command's own code starts: its first log line may open the log file."""
    _Log.began = True


def command_ends() -> None:
    """The command succeeded: lines still held (it logged nothing itself) go to the log file."""
    if _Log.began and _Log.held:
        _to_log_file(None)


def close_log() -> None:
    """Close the log file (lines are flushed as they are written: nothing is lost)."""
    if _Log.file is not None:
        try:
            _Log.file.close()
        except OSError:
            pass
    _Log.file = None


def forget_log_file() -> None:
    """The log file was refused (an input, another output, a full device): nothing more goes to it."""
    close_log()
    _Log.path, _Log.held = None, []


def _to_log_file(line: str | None) -> None:
    """`line` (and the lines held before it) into the log file, opening it on first use; a
    file that cannot be opened or written is one InputError line, and is given up."""
    if _Log.path is None:
        return
    if not _Log.began:
        _Log.held.append(line)
        return
    lines = [*_Log.held, *([] if line is None else [line])]
    try:
        if _Log.file is None:
            _Log.file = _open_log_file(_Log.path)
        _Log.held = []
        _Log.file.write("".join(text + "\n" for text in lines))
        _Log.file.flush()
    except OSError as e:
        path = _Log.path
        forget_log_file()
        raise InputError(f"{LOG_FILE_FLAG} {path}: cannot write to it: {append_failure(e)}") from None


def _open_log_file(path: Path):
    """`path` opened to append (atomic.open_to_append: a FIFO nobody reads is an error)."""
    return open(open_to_append(path), "a", encoding="utf-8", errors="backslashreplace")  # noqa: SIM115 -- kept open


def _error_to_log_file(line: str) -> None:
    """An error line into the log file when it is open (after the command declared its paths)."""
    if _Log.file is not None:
        try:
            _to_log_file(line)
        except InputError:
            pass  # the error itself is on stderr; the log file is given up


def log(message: str, level: int = INFO) -> None:
    """A progress line on stderr (rank 0's only, under MPI), if the log level shows it, and
    into the log file."""
    if level > _Log.level or (_COMM is not None and _COMM.rank != 0):
        return
    _line(sys.stderr, message)
    _to_log_file(message)


def _line(stream, text: str) -> None:
    """A line in one write: under MPI the launcher merges the ranks' stderr as written, and
    print's two writes (text, newline) let another rank's line in between."""
    stream.write(text + "\n")
    stream.flush()


def warn(message: str) -> None:
    log(f"warning: {message}", WARNING)


def debug(message: str) -> None:
    log(message, DEBUG)


def progress_stream():
    """Where progress bars go: stderr, or nowhere when log lines are off."""
    return sys.stderr if _Log.level >= INFO else None


def adapter_list(lora: list[str] | None, lora_scaled: list[str] | None) -> list[tuple[str, float]]:
    """(path, scale) pairs from llama.cpp's `--lora FNAME[,FNAME...]` and
    `--lora-scaled FNAME:SCALE[,FNAME:SCALE...]` (each repeatable); a SCALE outside
    llamapy.lora.LORA_SCALE_LIMIT is refused here, before any file is read."""
    from llamapy.lora import check_lora_scale
    pairs = [(path, 1.0) for item in lora or [] for path in _csv(item)]
    for item in lora_scaled or []:
        for entry in _csv(item):
            path, sep, scale = entry.rpartition(":")
            try:
                value = check_lora_scale(float(scale))
            except (ValueError, InputError):
                _bad_scaled(entry)
            if not sep or not path:
                _bad_scaled(entry)
            pairs.append((path, value))
    return pairs


def _bad_scaled(entry: str):
    from llamapy.lora import LORA_SCALE_LIMIT
    raise InputError(f"--lora-scaled {entry}: expected FNAME:SCALE with a finite SCALE from {-LORA_SCALE_LIMIT:g} to "
                     f"{LORA_SCALE_LIMIT:g}, e.g. --lora-scaled adapter.gguf:0.5")


def _csv(item: str) -> list[str]:
    return [part.strip() for part in item.split(",") if part.strip()]


def load_adapters(model, lora: list[str] | None = None, lora_scaled: list[str] | None = None) -> list:
    """(LoraAdapter, scale) pairs from the --lora and --lora-scaled flags, each announced on stderr."""
    from llamapy.lora import LoraAdapter
    out = []
    for path, scale in adapter_list(lora, lora_scaled):
        adapter = LoraAdapter.load(path, model)
        log(f"lora: {path} (rank {adapter.rank}, alpha {adapter.alpha:g}, {len(adapter.tensors)} matrices) x {scale:g}")
        out.append((adapter, scale))
    return out
