"""The cores other processes leave free (ggmlpy/cores.py): what the executor and the
quantizer run on, so a busy machine slows them in proportion."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ggmlpy import cores
from ggmlpy.cores import FreeCores


class Counters:
    """A machine of 4 cores whose busy seconds (others' and ours) the test advances."""

    def __init__(self) -> None:
        self.now = self.others = self.ours = 0.0
        self.readable = True

    def run(self, seconds: float, others_cores: float, own_cores: float) -> None:
        self.now += seconds
        self.others += seconds * others_cores
        self.ours += seconds * own_cores

    def free_cores(self) -> FreeCores:
        return FreeCores(4, machine_busy=lambda: self.others + self.ours if self.readable else None,
                         own_busy=lambda: self.ours, clock=lambda: self.now)


def test_other_processes_take_threads_away_and_give_them_back():
    c = Counters()
    fc = c.free_cores()
    assert fc.threads(4) == 4  # nothing measured yet: every core
    c.run(0.05, others_cores=2.0, own_cores=2.0)
    assert fc.threads(4) == 4  # too soon to measure
    c.run(0.05, others_cores=2.0, own_cores=2.0)  # the first measurement comes after 0.1 s
    assert fc.threads(4) == 2
    c.run(1.0, others_cores=0.1, own_cores=4.0)  # our own threads never count against us
    assert fc.threads(4) == 4 and fc.threads(2) == 2
    c.run(1.0, others_cores=1.0, own_cores=3.0)  # one busy program: 3 threads
    assert fc.threads(4) == 3 and fc.threads(2) == 2
    c.run(1.0, others_cores=3.8, own_cores=0.2)  # all but a fraction of a core busy: still one
    assert fc.threads(4) == 1
    c.run(0.1, others_cores=0.0, own_cores=1.0)  # within the sampling interval: not measured yet
    assert fc.threads(4) == 1
    c.run(1.0, others_cores=0.0, own_cores=1.0)  # the others are done
    assert fc.threads(4) == 4


def test_without_the_kernels_counters_every_core_counts_as_free():
    c = Counters()
    c.readable = False
    fc = c.free_cores()
    c.run(1.0, others_cores=4.0, own_cores=0.0)
    assert fc.threads(4) == 4
    assert cores._machine_busy_seconds("/nonexistent/stat") is None


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="the machine's counters are Linux's /proc/stat")
def test_busy_processes_are_seen_on_this_machine():
    n = os.cpu_count() or 1
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        fc = FreeCores()
        time.sleep(cores.FIRST_SAMPLE_SECONDS + 0.5)
        assert fc.threads(n) < n or n == 1
        assert fc.free < n - 0.5
    finally:
        for h in hogs:
            h.kill()
            h.wait()


def test_the_backend_runs_on_the_free_cores_unless_told_not_to(monkeypatch):
    from ggmlpy.backend.cpu import CpuBackend
    backend = CpuBackend(2)
    assert backend.free_cores is not None
    backend.free_cores.free = 1.0
    backend.free_cores._next = float("inf")
    assert backend.threads_now() == 1
    monkeypatch.setenv("GGMLPY_FIXED_THREADS", "1")
    assert CpuBackend(2).free_cores is None and CpuBackend(2).threads_now() == min(2, CpuBackend(2).n_threads)


def test_a_training_run_is_the_same_on_one_thread_and_two(stories_path, tmp_path):
    """The executor may change its thread count between steps (a busy machine): that is
    sound because no kernel's result depends on it, checked here on a whole finetune run."""
    text = tmp_path / "text.txt"
    text.write_text(Path(stories_path).parent.parent.joinpath("data", "tinystories_sample.txt")
                    .read_text(encoding="utf-8")[:4000], encoding="utf-8")
    outs = []
    for t in ("1", "2"):
        out = tmp_path / f"t{t}.gguf"
        r = subprocess.run([sys.executable, "-m", "llamapy", "finetune", "-m", str(stories_path), "-f", str(text),
                            "-c", "64", "-t", t, "--epochs", "1", "-o", str(out)], capture_output=True, text=True,
                           env={**os.environ, "GGMLPY_FIXED_THREADS": "1"})
        assert r.returncode == 0, r.stderr
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
