"""Hostile MPI launches (issue 33): ranks started with different flags or data, a rank that
raises something llamapy did not expect, a rank killed by a signal. Each ends under a
timeout (never a hang) with one `error:` line naming the rank (and the flag) and a
non-zero exit. The first tests need no MPI; the launches skip without mpirun.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import REPO_ROOT, shared_path
from llamapy.distributed import RanksDiffer, RanksFailed, Setting, check_ranks_agree, describe_error
from llamapy.errors import InputError
from llamapy.rank_watch import death_line

MPIRUN = shutil.which("mpirun") or shutil.which("mpiexec")
ENV = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
TIMEOUT = 90  # s: a hang fails the test instead of the suite


# ---- without MPI ---------------------------------------------------------------------------------
class Gathered:
    """A communicator whose allgather returns what the ranks would have sent."""

    def __init__(self, rank: int, others: list) -> None:
        self.rank, self.size, self.others = rank, 1 + len(others), others

    def allgather(self, obj):
        return [obj if r == self.rank else self.others[r - (r > self.rank)] for r in range(self.size)]


def settings(**values) -> dict[str, Setting]:
    return {k: Setting(f"--{k.replace('_', '-')}", v) for k, v in values.items()}


def sent(mine: dict[str, Setting], payload=None, error=None) -> tuple:
    """What a rank sends to the check: its settings as compared and shown, payload, error."""
    return {k: (v.label, json.dumps(v.value, sort_keys=True, default=str), v.shown()) for k, v in mine.items()}, \
        payload, error


def test_the_first_differing_setting_of_the_lowest_rank_is_named_with_both_values():
    mine = settings(ctx_size=32, epochs=2, seed=3)
    same = sent(mine)
    other = sent({**mine, "epochs": Setting("-epochs", 3), "seed": Setting("--seed", 4)})
    with pytest.raises(RanksDiffer, match=r"^rank 2's -epochs \(3\) differs from rank 0's \(2\)$") as e:
        check_ranks_agree(Gathered(0, [same, other]), mine)
    assert e.value.on_every_rank  # every rank raises it: rank 0's line, no abort
    with pytest.raises(RanksDiffer, match=r"^rank 2's -epochs \(3\)"):  # the same verdict on every rank
        check_ranks_agree(Gathered(1, [same, other]), mine)
    assert check_ranks_agree(Gathered(0, [same, same]), mine) == [None, None, None]


def test_a_digest_is_not_shown_and_a_missing_setting_counts_as_different():
    mine = {"data": Setting("training data", "abc", hidden=True)}
    with pytest.raises(RanksDiffer, match=r"^rank 1's training data differs from rank 0's$"):
        check_ranks_agree(Gathered(0, [sent({"data": Setting("training data", "abd", hidden=True)})]), mine)
    with pytest.raises(RanksDiffer, match=r"^rank 1's --seed \(not given\) differs from rank 0's \(3\)$"):
        check_ranks_agree(Gathered(0, [sent({})]), settings(seed=3))
    assert check_ranks_agree(Gathered(0, [sent(mine, payload=7)]), mine, payload=5) == [5, 7]


def test_a_rank_that_failed_is_named_at_the_check():
    mine = settings(seed=3)
    with pytest.raises(RanksFailed, match=r"^rank 1: text file not found: x$") as e:
        check_ranks_agree(Gathered(0, [sent({}, error=("text file not found: x", 2)), sent(mine)]), mine)
    assert e.value.code == 2 and e.value.on_every_rank
    with pytest.raises(RanksFailed, match=r"^rank 0: boom \(ranks 1, 2 failed too\)$"):
        check_ranks_agree(Gathered(0, [sent({}, error=("x", 1)), sent({}, error=("y", 1))]), {}, error=("boom", 1))
    with pytest.raises(RanksFailed, match=r"^every rank: boom$"):
        check_ranks_agree(Gathered(1, [sent({}, error=("boom", 1))]), {}, error=("boom", 1))


def test_an_unexpected_exception_is_named_by_its_type():
    try:
        _a, _b = (1, 2, 3)
    except ValueError as e:
        assert describe_error(e) == "ValueError: too many values to unpack (expected 2)"
    assert describe_error(KeyError("n_layer")) == "KeyError: 'n_layer'"
    assert describe_error(InputError("text file not found: x")) == "text file not found: x"
    assert describe_error(OSError(28, "No space left on device")) == "No space left on device"
    assert describe_error(OSError("No space left on device")) == "No space left on device"
    assert describe_error(FileNotFoundError(2, "No such file or directory", "x.txt")) == "No such file or directory: x.txt"
    assert describe_error(RuntimeError()) == "RuntimeError"
    assert death_line("1", 9) == "error: rank 1: killed by signal 9 (SIGKILL: sent by a user, or by the kernel when memory runs out)"


def test_the_watcher_names_a_rank_killed_alone_and_ends_as_it_did():
    """llamapy.rank_watch without a launcher: a child killed by SIGKILL is named and the
    watcher dies of SIGKILL too; one that exits passes its exit code on."""
    watcher = REPO_ROOT / "llamapy" / "rank_watch.py"
    script = textwrap.dedent(f"""
        import os, signal, sys
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT, signal.SIGTERM])
        pid = os.posix_spawn(sys.executable, [sys.executable, "-c", sys.argv[1]], dict(os.environ))
        print(pid, flush=True)
        os.execv(sys.executable, [sys.executable, "-I", "-S", {str(watcher)!r}, str(pid), "3"])
    """)
    job = subprocess.Popen([sys.executable, "-c", script, "import time; time.sleep(30)"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    child = int(job.stdout.readline())
    os.kill(child, signal.SIGKILL)
    _, err = job.communicate(timeout=10)
    assert job.returncode == -signal.SIGKILL
    assert err == "error: rank 3: killed by signal 9 (SIGKILL: sent by a user, or by the kernel when memory runs out)\n"
    r = subprocess.run([sys.executable, "-c", script, "raise SystemExit(7)"], capture_output=True, text=True, timeout=10)
    assert r.returncode == 7 and r.stderr == ""


# ---- under mpirun ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    pytest.importorskip("mpi4py", reason="the mpi extra: pip install -e '.[mpi]'")
    if MPIRUN is None:
        pytest.skip("no mpirun")
    d = tmp_path_factory.mktemp("hostile-mpi")
    story = shared_path("data", "tinystories_sample.txt").read_text(encoding="utf-8")
    (d / "a.txt").write_text(story[:3000])
    (d / "b.txt").write_text(story[3000:6000])
    return d


def base(texts, text: str = "a.txt", *extra: str) -> list[str]:
    return ["-m", str(shared_path("models", "stories260K.gguf")), "-f", str(texts / text), "-c", "32", "--epochs", "1",
            "-t", "1", "--seed", "3", "-o", str(texts / "out.gguf"), *extra]


def launch(*ranks: list[str], python: list[str] | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """mpirun with one command line per rank (MPMD: `-n 1 A : -n 1 B`)."""
    python = python or [sys.executable, "-m", "llamapy.cli.finetune"]
    cmd = [MPIRUN]
    for i, args in enumerate(ranks):
        cmd += ([":"] if i else []) + ["-n", "1", *python, *args]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, env=ENV, timeout=TIMEOUT)
    return r, time.monotonic() - t0


def one_error_line(r: subprocess.CompletedProcess) -> str:
    """The job's one `error:` line (it failed, without a traceback)."""
    assert r.returncode != 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    return lines[0]


@pytest.mark.parametrize("rank0, rank1, line", [
    (["--epochs", "1"], ["--epochs", "2"], "error: rank 1's --epochs (2) differs from rank 0's (1)"),
    ([], ["--lora-rank", "4"], "error: rank 1's --lora-rank (4) differs from rank 0's (default)"),
    ([], ["-c", "64"], "error: rank 1's -c (64) differs from rank 0's (32)"),
    ([], ["--seed", "5"], "error: rank 1's --seed (5) differs from rank 0's (3)"),
    ([], ["--no-shuffle"], None),  # finetune's default: the same flags
])
def test_ranks_given_other_flags_stop_before_the_first_step_naming_the_flag(texts, rank0, rank1, line):
    r, seconds = launch(base(texts, "a.txt", *rank0), base(texts, "a.txt", *rank1))
    if line is None:
        assert r.returncode == 0, r.stderr
        return
    assert one_error_line(r) == line
    assert "epoch 1:" not in r.stderr  # nothing trained


def test_ranks_given_other_texts_stop_naming_the_data(texts):
    r, _ = launch(base(texts, "a.txt"), base(texts, "b.txt"))
    assert one_error_line(r) == "error: rank 1's training data differs from rank 0's"
    assert "epoch 1:" not in r.stderr


def test_a_random_seed_is_rank_0s_on_every_rank(texts):
    """`--seed -1` on every rank: one seed, drawn by rank 0 and printed once; a LoRA's
    initial weights come from it, so ranks with their own draws would stop (trained weights)."""
    args = base(texts, "a.txt", "--seed", "-1", "--lora-rank", "2")
    r, _ = launch(args, args)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("seed: ") == 1 and "(random: --seed" in r.stderr


BROKEN = """
import os, sys
import llamapy.cli.finetune as finetune, llamapy.fit as fit
def broken(*args, **kwargs):
    a, b = (1, 2, 3)
if os.environ.get("PMI_RANK") == "1":
    if sys.argv[1] == "load":    # before any collective: rank 0 waits for it in the first check
        finetune.load_model = broken
    else:                        # in training: rank 0 waits for it in the epoch's weights check
        fit.check_same_weights = broken
finetune.main(sys.argv[2:])
"""


@pytest.mark.parametrize("where", ["load", "epoch"])
def test_an_unexpected_exception_on_one_rank_ends_the_job_in_one_line(texts, where):
    args = [where, *base(texts)]
    r, seconds = launch(args, args, python=[sys.executable, "-c", BROKEN])
    assert one_error_line(r) == "error: rank 1: ValueError: too many values to unpack (expected 2)"
    assert seconds < 60


@pytest.mark.parametrize("rank1, line", [
    (["-f", "/nonexistent/b.txt"], "error: rank 1: training data not found: /nonexistent/b.txt"),
    (["--checkpoint-in", "/nonexistent/run.ckpt"],  # a flag: named before any file is read
     "error: rank 1's --checkpoint-in (given) differs from rank 0's (not given)"),
    (["-h"], "error: rank 1: stopped before training (it was given -h or --version)"),
])
def test_a_rank_that_fails_setting_up_stops_every_rank_at_the_next_check(texts, rank1, line):
    """No abort: rank 0 waits at the ranks' next check, where rank 1 brings its error."""
    r, _ = launch(base(texts), [*base(texts), *rank1])
    assert one_error_line(r) == line
    assert "MPI_Abort" not in r.stderr + r.stdout and "BAD TERMINATION" not in r.stdout


def test_an_error_every_rank_meets_is_one_line(texts):
    """The same mistake on every rank (a missing text; too few windows for a step, found in
    opt_fit): one line, not one per rank."""
    args = [*base(texts), "-f", "/nonexistent/t.txt"]
    r, _ = launch(args, args)
    assert one_error_line(r) == "error: every rank: training data not found: /nonexistent/t.txt"
    args = [*base(texts), "-b", "4096"]
    r, _ = launch(args, args)
    assert one_error_line(r).startswith("error: every rank: the text gives ")
    assert "MPI_Abort" not in r.stderr + r.stdout


API = """
import json, sys
import llamapy
from llamapy.dataset import text_windows
from llamapy.distributed import DistributedError, world
from llamapy.train_params import LRSchedule, TrainParams
comm = world()
model = llamapy.load_model(MODEL)
ds = text_windows(model.vocab, open(TEXT).read(), 32)
ctx = llamapy.Context(model, n_ctx=32, n_batch=32, n_ubatch=32, n_threads=1)
r = comm.rank
cases = {"epochs": dict(epochs=1 + r), "lr": dict(params=TrainParams(schedule=LRSchedule(lr0=1e-3 * (1 + r)))),
         "val_split": dict(val_split=0.05 if r == 0 else 2.0)}
try:
    ctx.opt_fit(ds, silent=True, comm=comm.comm, **{"epochs": 1, **cases[sys.argv[1]]})
    got = [r, "trained"]
except DistributedError as e:
    got = [r, type(e).__name__, str(e)]
with open(f"{sys.argv[2]}/rank{r}.json", "w") as f:  # a file per rank: stdout lines interleave
    json.dump(got, f)
"""


@pytest.mark.parametrize("case, error", [
    ("epochs", ["RanksDiffer", "rank 1's epochs (2) differs from rank 0's (1)"]),
    ("lr", ["RanksDiffer", "rank 1's training parameter schedule.lr0 (0.002) differs from rank 0's (0.001)"]),
    ("val_split", ["RanksFailed", "rank 1: val_split must be in [0, 1), got 2.0"]),
])
def test_python_api_ranks_that_differ_or_fail_get_the_same_exception(texts, case, error):
    """Context.opt_fit over MPI: every rank raises the same exception before the first step
    (no abort, no hang): a Python program decides what to do."""
    script = texts / "api.py"
    script.write_text(API.replace("MODEL", repr(str(shared_path("models", "stories260K.gguf"))))
                      .replace("TEXT", repr(str(texts / "a.txt"))))
    out = texts / case
    out.mkdir()
    r = subprocess.run([MPIRUN, "-n", "2", sys.executable, str(script), case, str(out)], capture_output=True,
                       text=True, cwd=REPO_ROOT, env=ENV, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr
    assert [json.loads((out / f"rank{i}.json").read_text()) for i in (0, 1)] == [[0, *error], [1, *error]]
