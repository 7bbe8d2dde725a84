"""The README and the docs say what the code does: their examples run as written, and every
result they state is checked here, so a stale number fails.

A page's examples are its ```bash and ```python blocks. Which run, and how:
- every block of README.md runs (its quick starts), and every block of a docs page that
  states a result;
- an HTML comment on the line before a block marks it: `<!-- test: slow -->` (a long
  example: the slow suite), `<!-- test: skip REASON -->` (not run: a clone, an install, a
  tool llamapy does not ship);
- a stated result is a comment `# → TEXT` at the end of a line: the output of the commands
  since the previous stated result (stdout and stderr) contains TEXT; or
  `# → NAME ≈ VALUE ± TOLERANCE`: it contains `NAME = x` (or `NAME: x`) with x within
  TOLERANCE of VALUE (a training result, which differs between CPUs by rounding).

The blocks of one page run in order in one folder (a later block uses an earlier one's
files), beside a `../shared` link to the shared models and texts and links to the
repository's bench/ and tests/, with the tools on PATH.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import REPO_ROOT, SHARED

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
CLAIM = re.compile(r"#\s*→\s*(.+?)\s*$")
APPROX = re.compile(r"^(.+?)\s*≈\s*(-?[\d.]+)\s*±\s*([\d.]+)$")
MARK = re.compile(r"<!--\s*test:\s*(slow|skip)\b\s*(.*?)\s*-->")
TIMEOUT = 1800


@dataclass
class Block:
    page: Path
    line: int            # where the block starts, 1-based
    lang: str
    code: str
    mark: str | None     # "slow", "skip" or None
    claims: list[tuple[int, str]] = field(default_factory=list)  # (line in the block, expected)

    @property
    def name(self) -> str:
        return f"{self.page.name}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    """The page's bash and python blocks, with their marks and stated results."""
    lines = page.read_text(encoding="utf-8").split("\n")
    out, i = [], 0
    while i < len(lines):
        fence = re.match(r"^```(bash|python)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        start, i = i, i + 1
        body = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        mark = MARK.search(lines[start - 1]) if start > 0 else None
        block = Block(page, start + 1, fence.group(1), "\n".join(body), mark.group(1) if mark else None)
        block.claims = [(k, m.group(1)) for k, text in enumerate(body) if (m := CLAIM.search(text))]
        out.append(block)
        i += 1
    return out


def runs(block: Block) -> bool:
    return block.mark != "skip" and (block.page.name == "README.md" or bool(block.claims))


def _param(block: Block):
    marks = [pytest.mark.slow] if block.mark == "slow" else []
    return pytest.param(block, id=block.name, marks=marks)


ALL_BLOCKS = [b for page in PAGES for b in blocks_of(page)]


def check(expected: str, output: str, where: str) -> None:
    approx = APPROX.match(expected)
    if approx:
        name, value, tolerance = approx.group(1), float(approx.group(2)), float(approx.group(3))
        found = re.findall(rf"{re.escape(name)}\s*[=:]\s*(-?[\d.]+)", output)
        assert found, f"{where}: the output has no '{name} = ...' (expected {expected})\n{output[-3000:]}"
        assert abs(float(found[-1]) - value) <= tolerance, f"{where}: {name} = {found[-1]}, stated {expected}"
    else:
        assert expected in output, f"{where}: the output does not contain {expected!r}\n{output[-3000:]}"


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
    """One working folder per page, beside a link to the shared folder."""
    made: dict[Path, Path] = {}

    def folder(page: Path) -> Path:
        if page not in made:
            root = tmp_path_factory.mktemp(page.stem)
            (root / "shared").symlink_to(SHARED)
            work = root / "llamapy"
            work.mkdir()
            for name in ("bench", "tests"):
                (work / name).symlink_to(REPO_ROOT / name)
            made[page] = work
        return made[page]
    return folder


def _environment() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(REPO_ROOT), "COLUMNS": "200"}


def run_bash(block: Block, cwd: Path) -> list[str]:
    """Run the block in bash; the output between stated results, one part per result (and
    the rest)."""
    script = ["set -euo pipefail", "exec 2>&1", "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT"]
    marks = {k for k, _ in block.claims}
    for k, text in enumerate(block.code.split("\n")):
        script.append(text)
        if k in marks:
            script.append(f"echo '@@result {k}@@'")
    r = subprocess.run(["bash", "-c", "\n".join(script)], cwd=cwd, env=_environment(), capture_output=True,
                       text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"{block.name} failed (exit {r.returncode}):\n{r.stdout[-4000:]}{r.stderr[-2000:]}"
    return re.split(r"@@result \d+@@\n", r.stdout)


def run_python(block: Block, cwd: Path) -> list[str]:
    path = cwd / f"example_{block.line}.py"
    path.write_text(block.code + "\n", encoding="utf-8")
    r = subprocess.run([sys.executable, str(path)], cwd=cwd, env=_environment(), capture_output=True, text=True,
                       timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"{block.name} failed (exit {r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
    return [r.stdout + r.stderr] * max(1, len(block.claims))  # a script's results are checked on its whole output


def page_blocks_before(block: Block) -> list[Block]:
    """The blocks of the page that run before this one (their files are its inputs); a quick
    example never needs a slow one's."""
    same = [b for b in ALL_BLOCKS if b.page == block.page and runs(b)]
    return [b for b in same[:same.index(block)] if block.mark == "slow" or b.mark != "slow"]


_done: set[str] = set()


def run_block(block: Block, workdirs) -> list[str]:
    cwd = workdirs(block.page)
    for earlier in page_blocks_before(block):  # a block selected alone still gets its inputs
        if earlier.name not in _done:
            run_block(earlier, workdirs)
    parts = run_bash(block, cwd) if block.lang == "bash" else run_python(block, cwd)
    _done.add(block.name)
    return parts


@pytest.mark.parametrize("block", [_param(b) for b in ALL_BLOCKS if runs(b)])
def test_example_runs_and_states_its_results(block: Block, workdirs) -> None:
    parts = run_block(block, workdirs) if block.name not in _done else None
    if parts is None:
        pytest.skip("already run as the input of a later example")
    for (k, expected), part in zip(block.claims, parts):
        check(expected, part, f"{block.name} (line {block.line + k + 1})")


def test_the_claim_checker_fails_on_a_stale_number() -> None:
    check("PPL = 118.4123", "Final estimate: PPL = 118.4123 +/- 1.49973", "ok")
    check("PPL ≈ 19.80 ± 0.06", "Final estimate: PPL = 19.7572 +/- 0.13", "ok")
    with pytest.raises(AssertionError):
        check("PPL = 118.4124", "Final estimate: PPL = 118.4123 +/- 1.49973", "stale")
    with pytest.raises(AssertionError):
        check("PPL ≈ 19.80 ± 0.01", "Final estimate: PPL = 19.7572 +/- 0.13", "stale")


def test_every_stated_result_is_checked() -> None:
    """A `# →` result in a block that does not run would never be checked: each one must be
    in a block that runs (or the block says why not)."""
    for block in ALL_BLOCKS:
        if block.claims:
            assert runs(block), f"{block.name} states a result in an example the tests do not run"


def test_the_pages_link_to_pages_that_exist() -> None:
    for page in PAGES:
        for target in re.findall(r"\]\((?!https?:|#)([^)#\s]+)", page.read_text(encoding="utf-8")):
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"
