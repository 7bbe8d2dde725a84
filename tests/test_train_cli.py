"""llamapy-train end to end (a new model from a text: parameter count, per-epoch lines, a
sample, a saved model that reloads), its one-line errors, and the training flags in the
--help of both training tools."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

import llamapy

from conftest import REPO_ROOT, tool_process

SHAPE = ["--embd", "32", "--head", "4", "--head-kv", "2", "--layer", "2", "--ff", "96", "-c", "32"]


def run_app(module: str, *args: str) -> subprocess.CompletedProcess:
    """The tool as a child process (the end-to-end run); the other tests run it in this process."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=env,
                          cwd=REPO_ROOT, timeout=600)


def test_train_from_scratch_end_to_end(stories_path, wiki_path, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(wiki_path.read_text()[:5000])
    out = tmp_path / "new.gguf"
    run = run_app("llamapy.cli.train", "--vocab-model", str(stories_path), "-f", str(text), *SHAPE, "--epochs", "2",
                  "--seed", "4", "--warmup", "3", "--lr-schedule", "cosine", "--grad-clip", "1", "-o", str(out),
                  "--predict", "12", "-p", "The game")
    assert run.returncode == 0, run.stderr
    model = llamapy.load_model(out)
    n_params = sum(t.nelements() for t in model.tensors.values())
    assert f"({n_params:,} parameters)" in run.stderr
    epochs = re.findall(r"val:.*loss=([0-9.]+)", run.stderr)
    assert len(epochs) == 2 and float(epochs[1]) < float(epochs[0]) < np.log(model.hparams.n_vocab) + 0.5
    assert run.stdout.startswith("The game") and len(model.vocab.tokenize(run.stdout)) > 4
    hp = model.hparams
    assert (hp.arch, hp.n_embd, hp.n_head, hp.n_head_kv, hp.n_layer, hp.n_ff, hp.n_ctx_train) == ("llama", 32, 4, 2, 2, 96, 32)
    assert model.vocab.tokenize("Robert Boulter") == llamapy.load_model(stories_path).vocab.tokenize("Robert Boulter")


@pytest.mark.parametrize("shape, message", [
    (["--embd", "30", "--head", "4"], "n_embd 30 is not divisible by n_head 4"),
    (["--head", "4", "--head-kv", "3"], "n_head 4 is not a multiple of n_head_kv 3"),
    (["--layer", "0"], "--layer must be >= 1"),
])
def test_shapes_that_cannot_be_built_fail_in_one_line(stories_path, wiki_path, tmp_path, shape, message):
    out = tmp_path / "new.gguf"
    run = tool_process("train", "--vocab-model", str(stories_path), "-f", str(wiki_path), "--embd", "32", "--ff", "64",
                  "-c", "32", *shape, "-o", str(out))
    assert run.returncode == 1 and not out.exists()
    assert run.stderr.strip().splitlines() == [f"error: {message}" + run.stderr.strip().split(message, 1)[1]]


@pytest.mark.parametrize("module", ["finetune", "train"])
def test_help_lists_the_training_flags_with_defaults(module, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # as run_app's child has it
    run = tool_process(module, "--help")
    assert run.returncode == 0
    text = run.stdout
    for flag in ("--warmup", "--lr-schedule", "--cos-restart", "--grad-clip", "--grad-checkpoint", "--checkpoint-out",
                 "--save-every", "--checkpoint-in", "--force-resume", "-lr-min", "-lr-half", "--seed"):
        assert flag in text, flag
    assert re.search(r"--lr-schedule.*?\[default: exp\]", text, re.S)
    assert re.search(r"--save-every.*?default: at\s+epoch\s+ends", text, re.S)
    assert re.search(r"^Checkpoints:$", text, re.M)
