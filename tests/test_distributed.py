"""Data-parallel training under mpirun (the `mpi` extra; .ci/run installs it).

Two ranks with -b 64 each take the same steps as one process with -b 128 (the same two
windows per step, accumulated): the weights agree to float rounding. Checkpoints move
between rank counts; a rank that dies or fails ends the whole job quickly, in one line.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import llamapy

from conftest import REPO_ROOT, shared_path, tool_process

pytest.importorskip("mpi4py", reason="the mpi extra: pip install -e '.[mpi]'")
MPIRUN = shutil.which("mpirun") or shutil.which("mpiexec")
pytestmark = pytest.mark.skipif(MPIRUN is None, reason="no mpirun")
ENV = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("mpi") / "stories.txt"
    path.write_text(shared_path("data", "tinystories_sample.txt").read_text(encoding="utf-8")[:16_000])
    return path


def finetune(ranks: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """llamapy-finetune under mpirun with `ranks` ranks, or (ranks 1) as one process: this one,
    the test's (no launcher, no MPI: a child's start-up saved)."""
    if ranks == 1:
        return tool_process("finetune", *args)
    cmd = [MPIRUN, "-n", str(ranks), sys.executable, "-m", "llamapy.cli.finetune", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, env=ENV, timeout=timeout)


def max_relative_difference(a, b) -> float:
    worst = 0.0
    for name, t in a.tensors.items():
        x, y = t.numpy().astype(np.float64), b.tensors[name].numpy().astype(np.float64)
        worst = max(worst, float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-30)))
    return worst


def common_args(text, tmp_path, *extra: str) -> list[str]:
    return ["-m", str(shared_path("models", "stories260K.gguf")), "-f", str(text), "-c", "64", "--epochs", "2",
            "-t", "1", "--seed", "3", "-lr", "1e-3", *extra]


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_two_ranks_equal_one_process_with_both_windows_per_step(kind, text, tmp_path):
    lora = ["--lora-rank", "4"] if kind == "lora" else []
    outs = {}
    for ranks, batch in ((2, "64"), (1, "128")):
        out = tmp_path / f"{kind}-{ranks}.gguf"
        target = ["--lora-out", str(out)] if lora else ["-o", str(out)]
        r = finetune(ranks, *common_args(text, tmp_path, "-b", batch, *lora, *target))
        assert r.returncode == 0, r.stderr
        outs[ranks] = (out, r.stderr)
    assert "distributed: 2 ranks, 64 tokens per step each (128 per step in all)" in outs[2][1]
    assert outs[2][1].count("epoch 1: train:") == 1  # rank 0 alone prints
    base = llamapy.load_model(shared_path("models", "stories260K.gguf"))
    if lora:
        from llamapy.lora import LoraAdapter
        a, b = (LoraAdapter.load(outs[r][0], base) for r in (2, 1))
        assert a.tensors.keys() == b.tensors.keys()
        worst = max(float(np.abs(x.numpy() - y.numpy()).max() / np.abs(y.numpy()).max())
                    for name in a.tensors for x, y in zip(a.tensors[name], b.tensors[name]) if y.numpy().any())
    else:
        worst = max_relative_difference(llamapy.load_model(outs[2][0]), llamapy.load_model(outs[1][0]))
    assert worst <= 1e-6


def test_a_two_rank_checkpoint_resumes_in_one_process(text, tmp_path):
    ckpt = tmp_path / "run.ckpt"
    r = finetune(2, *common_args(text, tmp_path, "-b", "64", "--epochs", "1", "--checkpoint-out", str(ckpt),
                                 "-o", str(tmp_path / "half.gguf")))
    assert r.returncode == 0, r.stderr
    resumed, whole = tmp_path / "resumed.gguf", tmp_path / "whole.gguf"
    r = finetune(1, *common_args(text, tmp_path, "-b", "128", "--checkpoint-in", str(ckpt), "-o", str(resumed)))
    assert r.returncode == 0, r.stderr
    assert "resume: epoch 2" in r.stderr
    r = finetune(1, *common_args(text, tmp_path, "-b", "128", "-o", str(whole)))
    assert r.returncode == 0, r.stderr
    assert max_relative_difference(llamapy.load_model(resumed), llamapy.load_model(whole)) <= 1e-6
    # the same checkpoint with the per-rank -b in one process is another run: refused in one line
    r = finetune(1, *common_args(text, tmp_path, "-b", "64", "--checkpoint-in", str(ckpt), "-o", str(whole)))
    assert r.returncode != 0 and "n_batch is 128, this run's is 64" in r.stderr and "Traceback" not in r.stderr


def python_processes_of(pids: set[int]) -> set[int]:
    """Those of `pids` still running. A zombie is dead: a rank whose watcher the launcher
    killed with it is reparented to init until init reaps it."""
    alive = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            try:
                os.kill(pid, 0)  # no /proc: assume running while it exists
                state = "R"
            except ProcessLookupError:
                continue
        if state != "Z":
            alive.add(pid)
    return alive


def rank_pids(root: int) -> set[int]:
    """The python processes under the launcher `root`: the ranks and their watchers."""
    return set(python_tree(root))


def python_tree(root: int) -> dict[int, int]:
    """The python processes under `root`, each with its parent's pid."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,comm="], capture_output=True, text=True).stdout.split("\n")
    children: dict[int, list[tuple[int, str]]] = {}
    for line in out:
        parts = line.split(None, 2)
        if len(parts) == 3:
            children.setdefault(int(parts[1]), []).append((int(parts[0]), parts[2]))
    found, todo = {}, [root]
    while todo:
        parent = todo.pop()
        for pid, comm in children.get(parent, []):
            todo.append(pid)
            if comm.startswith("python"):
                found[pid] = parent
    return found


def rank_processes(root: int) -> list[int]:
    """The ranks themselves, in rank order when their watchers are in pid order: the python
    processes whose parent is a python process (llamapy.rank_watch)."""
    tree = python_tree(root)
    return [pid for parent, pid in sorted((parent, pid) for pid, parent in tree.items() if parent in tree)]


def start_long_run(tmp_path, *extra: str) -> tuple[subprocess.Popen, set[int]]:
    """A two-rank finetune long enough to interrupt (5 epochs of 400 KB), some seconds into
    training: the launcher, and the pids of its two ranks and their watchers."""
    big = tmp_path / "long.txt"
    big.write_text(shared_path("data", "tinystories_sample.txt").read_text(encoding="utf-8")[:400_000])
    cmd = [MPIRUN, "-n", "2", sys.executable, "-m", "llamapy.cli.finetune",
           *common_args(big, tmp_path, "-b", "64", "--epochs", "5", "-o", str(tmp_path / "never.gguf"), *extra)]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT, env=ENV)
    ranks: set[int] = set()
    deadline = time.time() + 60
    while len(rank_processes(job.pid)) < 2 and time.time() < deadline:
        time.sleep(0.5)
    ranks = rank_pids(job.pid)
    if len(rank_processes(job.pid)) < 2:
        job.kill()
        pytest.fail("the two ranks did not start")
    time.sleep(5)  # well into training
    assert job.poll() is None
    return job, ranks


@pytest.mark.parametrize("victim", ["rank", "watcher"])
def test_killing_one_rank_ends_the_job(tmp_path, victim):
    """A rank killed by SIGKILL (the kernel's out-of-memory killer sends it too): its watcher
    names it in one line, and the launcher ends the others. A watcher killed takes its rank
    with it: the launcher ends the job with its own message."""
    job, ranks = start_long_run(tmp_path)
    try:
        rank = rank_processes(job.pid)[1]
        os.kill(rank if victim == "rank" else python_tree(job.pid)[rank], signal.SIGKILL)
        t0 = time.time()
        out, err = job.communicate(timeout=30)
        assert time.time() - t0 < 10
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    assert "signal 9" in out + err  # the launcher names the dead process's signal
    if victim == "rank":
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert lines == ["error: rank 1: killed by signal 9 (SIGKILL: sent by a user, or by the kernel when memory "
                         "runs out)"], err
    time.sleep(1)
    left = python_processes_of(ranks)
    assert left == set(), subprocess.run(["ps", "-o", "pid,ppid,stat,etime,args", "-p", ",".join(map(str, left))],
                                         capture_output=True, text=True).stdout  # no rank left behind
    assert not (tmp_path / "never.gguf").exists()


def test_ctrl_c_stops_every_rank_after_the_same_step_in_one_line(tmp_path):
    """The launcher passes Ctrl-C to the ranks; they share the request, stop after the same
    step and exit by themselves: rank 0 writes the checkpoint and says where, once."""
    ckpt = tmp_path / "run.ckpt"
    job, _ = start_long_run(tmp_path, "--checkpoint-out", str(ckpt))
    try:
        job.send_signal(signal.SIGINT)
        out, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 130, err
    assert err.count("error: interrupted after") == 1 and "rank 1" not in err and "Traceback" not in err
    assert f"resume from the checkpoint with --checkpoint-in {ckpt}" in err
    assert ckpt.exists() and not (tmp_path / "never.gguf").exists()


def run_script(tmp_path, body: str, ranks: int = 2) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(f"""
        import numpy as np, llamapy
        from llamapy.dataset import text_windows
        from llamapy.distributed import world
        from llamapy.train_params import TrainParams, LRSchedule
        comm = world()
        model = llamapy.load_model({str(shared_path("models", "stories260K.gguf"))!r})
        text = open({str(shared_path("data", "tinystories_sample.txt"))!r}).read()[:8000]
        ds = text_windows(model.vocab, text, 64)
        ctx = llamapy.Context(model, n_ctx=64, n_batch=64, n_ubatch=64, n_threads=1)
        ctx.opt_init(TrainParams(schedule=LRSchedule(lr0=1e-3)), comm)
    """) + textwrap.dedent(body))
    return subprocess.run([MPIRUN, "-n", str(ranks), sys.executable, str(script)], capture_output=True, text=True,
                          cwd=REPO_ROOT, env=ENV, timeout=120)


def test_an_error_on_one_rank_ends_every_rank_in_one_line(tmp_path):
    t0 = time.time()
    r = run_script(tmp_path, """
        def on_epoch(result):
            if comm.rank == 1:
                raise OSError("No space left on device")
        ctx.opt_fit(ds, epochs=3, silent=True, on_epoch=on_epoch)
        print("finished", comm.rank)
    """)
    assert time.time() - t0 < 60
    assert r.returncode != 0 and "finished" not in r.stdout
    assert "error: rank 1: No space left on device" in r.stderr and "Traceback" not in r.stderr


def test_a_failing_rank_aborts_only_once_its_line_is_read():
    """MPI_Abort must not overtake the rank's error line in the launcher: abort_job waits
    until the launcher has read the pipe (here a thread that reads after 0.3 s), and gives
    up after its timeout when nobody reads."""
    from llamapy.distributed import wait_until_read
    r, w = os.pipe()
    with os.fdopen(r, "rb") as pipe_out, os.fdopen(w, "w") as err:
        err.write("error: rank 1: boom\n")
        err.flush()
        got = []
        reader = threading.Timer(0.3, lambda: got.append(os.read(pipe_out.fileno(), 100)))
        reader.start()
        t0 = time.monotonic()
        wait_until_read(err)
        waited = time.monotonic() - t0
        reader.join()
        assert got == [b"error: rank 1: boom\n"] and 0.25 <= waited < 1.5
        err.write("unread\n")
        err.flush()
        t0 = time.monotonic()
        wait_until_read(err, timeout=0.2)
        assert 0.15 <= time.monotonic() - t0 < 1.0


def test_ranks_with_different_weights_are_stopped(tmp_path):
    r = run_script(tmp_path, """
        def on_epoch(result):
            if comm.rank == 1 and result.epoch == 0:
                w = ctx.trainer.trained["blk.0.attn_q.weight"]
                w.array()[0, 0] += 1.0
        ctx.opt_fit(ds, epochs=2, silent=True, on_epoch=on_epoch)
    """)
    assert r.returncode != 0
    assert "the weights of rank 1 differ from rank 0's after epoch 2: the run cannot continue" in r.stderr


def test_python_api_takes_mpi4py_communicator(tmp_path):
    r = run_script(tmp_path, """
        from mpi4py import MPI
        ctx2 = llamapy.Context(model, n_ctx=64, n_batch=64, n_ubatch=64, n_threads=1)
        history = ctx2.opt_fit(ds, epochs=1, silent=True, comm=MPI.COMM_WORLD, seed=1)
        digest = np.concatenate([t.numpy().reshape(-1) for t in ctx2.trainer.trained.values()]).sum()
        with open(OUT + f"/rank{comm.rank}.txt", "w") as f:  # a file per rank: stdout lines interleave
            f.write(f"steps {len(history[0].train.steps)} val {history[0].val.loss()[0]!r} sum {float(digest)!r}")
    """.replace("OUT", repr(str(tmp_path))))
    assert r.returncode == 0, r.stderr
    ranks = [(tmp_path / f"rank{i}.txt").read_text() for i in (0, 1)]
    assert ranks[0] == ranks[1] and ranks[0].startswith("steps ")  # the same steps, validation and weights


def test_samples_with_validation_steps_and_test_set_equal_one_process(tmp_path):
    """Packed chat samples, a validation file every 2 steps and a test set: two ranks print
    the validations and the test result one process with both ranks' windows per step prints."""
    import json
    d = tmp_path / "data"
    d.mkdir()
    for name, n in (("train", 16), ("valid", 3), ("test", 3)):
        lines = [json.dumps({"prompt": f"What is {i} plus {i}?", "completion": f"It is {2 * i}."}) for i in range(n)]
        (d / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    args = ["-m", str(shared_path("models", "stories260K.gguf")), "--data", str(d), "-c", "256", "--epochs", "2",
            "-t", "1", "--seed", "3", "-lr", "1e-3", "--steps-per-eval", "2"]
    two = finetune(2, *args, "-b", "256", "-o", str(tmp_path / "two.gguf"))
    one = finetune(1, *args, "-b", "512", "-o", str(tmp_path / "one.gguf"))
    assert two.returncode == 0 and one.returncode == 0, two.stderr + one.stderr

    def results(stderr: str) -> list[str]:
        return [line.split("t=")[0] for line in stderr.splitlines() if line.startswith(("step ", "test:", "         val:"))]
    assert results(two.stderr) == results(one.stderr)
    assert any(r.startswith("step 2:") for r in results(one.stderr)) and results(one.stderr)[-1].startswith("test:")
