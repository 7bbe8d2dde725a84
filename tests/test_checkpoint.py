"""Checkpoints: a run stopped at any optimizer step and resumed from its last checkpoint
ends with tensors bit-identical to an uninterrupted run (full finetune, LoRA on a
quantized base, AdamW and SGD, shuffled, across epoch boundaries; a real SIGKILL and a
Ctrl-C through llamapy-finetune), and bad checkpoints are refused in one line."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import llamapy
from ggmlpy import GGMLType
from llamapy import checkpoint
from llamapy.checkpoint import load_checkpoint
from llamapy.dataset import token_windows
from llamapy.errors import InputError, SaveError
from llamapy.gguf_file import GGUFFile, MetaValue, ValueType
from llamapy.gguf_writer import array_out
from llamapy.lora import LoraAdapter, merge_adapters
from llamapy.save import save_model_to_file, write_atomically
from llamapy.train_params import SGD, AdamW, LoraParams, LRSchedule, TrainParams

from conftest import REPO_ROOT, Killed, kill_after, tool_process

N_CTX = 32
EPOCHS = 3


@pytest.fixture(scope="module")
def text(wiki_path) -> str:
    return wiki_path.read_text()[:2500]


@pytest.fixture(scope="module")
def q4_model_path(stories_path, tmp_path_factory) -> Path:
    """stories260K with its layer matrices in Q4_0 (a quantized base for LoRA)."""
    model = llamapy.load_model(stories_path)
    merge_adapters(model, [(LoraAdapter.new(model, rank=1), 0.0)], GGMLType.Q4_0)
    path = tmp_path_factory.mktemp("q4") / "stories-q4_0.gguf"
    save_model_to_file(model, path)
    return path


def params_for(kind: str) -> TrainParams:
    schedule = LRSchedule(lr0=2e-3, kind="cosine", warmup=3, epochs=EPOCHS, lr_min=1e-4)
    if kind == "sgd":
        return TrainParams(optimizer=SGD(wd=0.01), schedule=LRSchedule(lr0=0.05, half_life=1, epochs=EPOCHS))
    if kind == "lora":
        return TrainParams(lora=LoraParams(rank=4, seed=3), schedule=schedule, grad_clip=0.5)
    if kind == "scratch":
        return TrainParams(schedule=LRSchedule(lr0=3e-3, kind="cosine", warmup=2, cos_restart=1, epochs=EPOCHS))
    return TrainParams(optimizer=AdamW(wd=0.1), schedule=schedule, grad_clip=1.0)


def fresh_context(path: Path, kind: str):
    if kind == "scratch":  # a new model, all of it trained; the same seed gives the same start
        model = llamapy.new_model("llama", path, n_embd=32, n_head=4, n_head_kv=2, n_layer=2, n_ff=96,
                                  n_ctx_train=N_CTX, seed=9)
    else:
        model = llamapy.load_model(path)
    ctx = llamapy.Context(model, n_ctx=N_CTX, n_batch=2 * N_CTX, n_ubatch=16, n_threads=2)
    ctx.opt_init(params_for(kind))
    return ctx


def trained(ctx) -> dict[str, np.ndarray]:
    return {n: t.numpy().copy() for n, t in ctx.trainer.trained.items()}


def fit(ctx, text, **kw):
    ds = token_windows(ctx.model.vocab.tokenize(text), N_CTX)
    return ctx.opt_fit(ds, epochs=EPOCHS, val_split=0.2, seed=11, silent=True, **kw)


@pytest.mark.parametrize("kind", ["adamw", "sgd", "lora", "scratch"])
def test_resume_is_bit_identical(kind, stories_path, q4_model_path, text, tmp_path):
    path = q4_model_path if kind == "lora" else stories_path
    reference = fresh_context(path, kind)
    fit(reference, text)
    expect = trained(reference)
    steps_per_epoch = reference.trainer.steps_per_epoch
    total = reference.trainer.n_steps
    assert total == EPOCHS * steps_per_epoch >= 9
    rng = np.random.default_rng(abs(hash(kind)) % 1000)
    ckpt = tmp_path / "run.ckpt.gguf"
    # die in the second epoch at a random step, with checkpoints every 3 steps and at epoch ends:
    # the resumed run crosses the epoch boundary after its last checkpoint or repeats part of an epoch
    die_at = int(rng.integers(steps_per_epoch + 1, 2 * steps_per_epoch + 2))
    run = fresh_context(path, kind)
    kill_after(run, die_at)
    with pytest.raises(Killed):
        fit(run, text, checkpoint=ckpt, save_every=3)
    del run
    saved = load_checkpoint(ckpt)
    assert 0 < int(saved.optimizer["opt.n_steps"][0]) <= die_at
    resumed = fresh_context(path, kind)
    t0 = time.perf_counter()
    history = fit(resumed, text, checkpoint=ckpt, save_every=3, resume=ckpt)
    assert resumed.trainer.n_steps == total and history[-1].epoch == EPOCHS - 1
    # the resumed run's first window is timed from its own start, not from the epoch's
    assert 0 < resumed.trainer.timing.startup_seconds <= time.perf_counter() - t0
    got = trained(resumed)
    assert got.keys() == expect.keys()
    for name in expect:
        assert np.array_equal(got[name], expect[name]), name
    if kind == "lora":
        assert all(n.endswith((".lora_a", ".lora_b")) for n in got)


def test_resume_from_an_epoch_end_and_python_api(stories_path, text, tmp_path):
    reference = fresh_context(stories_path, "adamw")
    fit(reference, text)
    ckpt = tmp_path / "epoch.gguf"
    run = fresh_context(stories_path, "adamw")
    ds = token_windows(run.model.vocab.tokenize(text), N_CTX)
    run.opt_fit(ds, epochs=1, val_split=0.2, seed=11, silent=True, checkpoint=ckpt)  # one epoch, saved at its end
    saved = load_checkpoint(ckpt)
    assert (saved.position.epoch, saved.position.ibatch, saved.position.shuffled) == (1, 0, False)
    resumed = fresh_context(stories_path, "adamw")
    assert resumed.opt_load_checkpoint(ckpt) == []
    fit(resumed, text)
    for name, values in trained(reference).items():
        assert np.array_equal(resumed.trainer.trained[name].numpy(), values), name
    again = tmp_path / "again.gguf"
    resumed.opt_save_checkpoint(again)
    assert int(load_checkpoint(again).optimizer["opt.n_steps"][0]) == reference.trainer.n_steps


def test_an_older_checkpoint_is_refused_in_one_line(stories_path, text, tmp_path):
    """Versions 1 and 2 checksummed the tensors only: their step count, position and RNG
    state cannot be verified, so they are not resumed."""
    ckpt = tmp_path / "c.gguf"
    run = fresh_context(stories_path, "adamw")
    run.opt_fit(token_windows(run.model.vocab.tokenize(text), N_CTX), epochs=1, val_split=0.2, seed=11, silent=True,
                checkpoint=ckpt)
    f = GGUFFile(ckpt)
    metadata = {k: v for k, v in f.metadata.items() if k != checkpoint.CHECKSUM_KEY}  # as version 2 laid it out
    metadata["llamapy.checkpoint.version"] = MetaValue(ValueType.STRING, None, "2")
    old = tmp_path / "v2.gguf"
    write_atomically(metadata, [array_out(n, t.numpy()) for n, t in f.tensors.items()], old, "checkpoint")
    with pytest.raises(InputError, match="checkpoint version 2 was written by an older llamapy") as e:
        fresh_context(stories_path, "adamw").opt_load_checkpoint(old)
    assert "\n" not in str(e.value)


def test_changed_hyper_parameters_are_reported_and_structure_refused(stories_path, text, tmp_path):
    ckpt = tmp_path / "c.gguf"
    run = fresh_context(stories_path, "adamw")
    ds = token_windows(run.model.vocab.tokenize(text), N_CTX)
    run.opt_fit(ds, epochs=1, val_split=0.2, seed=11, silent=True, checkpoint=ckpt)
    other = llamapy.Context(llamapy.load_model(stories_path), n_ctx=N_CTX, n_batch=2 * N_CTX, n_ubatch=16, n_threads=2)
    other.opt_init(TrainParams(optimizer=AdamW(wd=0.1), schedule=LRSchedule(lr0=5e-4, epochs=EPOCHS), grad_clip=1.0))
    notes = other.opt_load_checkpoint(ckpt)
    assert any(n.startswith("schedule") for n in notes)
    sgd = llamapy.Context(llamapy.load_model(stories_path), n_ctx=N_CTX, n_batch=2 * N_CTX, n_ubatch=16, n_threads=2)
    sgd.opt_init(params_for("sgd"))
    with pytest.raises(InputError, match="optimizer_kind"):
        sgd.opt_load_checkpoint(ckpt)


def test_bad_checkpoints_are_refused(stories_path, text, tmp_path):
    ckpt = tmp_path / "c.gguf"
    run = fresh_context(stories_path, "adamw")
    ds = token_windows(run.model.vocab.tokenize(text), N_CTX)
    run.opt_fit(ds, epochs=1, val_split=0.2, seed=11, silent=True, checkpoint=ckpt)
    good = ckpt.read_bytes()

    # another model (same shapes, other weights): refused unless forced
    other_model = tmp_path / "other.gguf"
    save_model_to_file(run.model, other_model)
    with pytest.raises(InputError, match="another model"):
        fresh_context(other_model, "adamw").opt_load_checkpoint(ckpt)
    fresh_context(other_model, "adamw").opt_load_checkpoint(ckpt, force=True)

    # another text: refused unless forced
    with pytest.raises(InputError, match="another text"):
        fit(fresh_context(stories_path, "adamw"), text[::-1], resume=ckpt)

    # truncated, corrupt, not a checkpoint, missing
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good[: len(good) // 2])
    corrupt = tmp_path / "corrupt.gguf"
    flipped = bytearray(good)
    flipped[-100] ^= 0x40
    corrupt.write_bytes(bytes(flipped))
    for bad, message in ((truncated, "truncated or corrupt"), (corrupt, "corrupt"),
                         (stories_path, "not a llamapy checkpoint"), (tmp_path / "nope.gguf", "not found")):
        with pytest.raises(InputError, match=message):
            fresh_context(stories_path, "adamw").opt_load_checkpoint(bad)

    # save_every without a checkpoint file, zero or negative
    for kw in (dict(save_every=2), dict(save_every=-1, checkpoint=tmp_path / "x.gguf"),
               dict(save_every=0, checkpoint=tmp_path / "x.gguf")):
        with pytest.raises(InputError, match="save_every"):
            fit(fresh_context(stories_path, "adamw"), text, **kw)


def test_a_full_disk_keeps_the_previous_checkpoint(stories_path, text, tmp_path, disk_full_after):
    ckpt = tmp_path / "c.gguf"
    run = fresh_context(stories_path, "adamw")
    ds = token_windows(run.model.vocab.tokenize(text), N_CTX)
    run.opt_fit(ds, epochs=1, val_split=0.2, seed=11, silent=True, checkpoint=ckpt)
    before = ckpt.read_bytes()
    files = disk_full_after(len(before) // 2)
    with pytest.raises(SaveError, match="No space left on device"):
        run.opt_fit(ds, epochs=1, val_split=0.2, seed=11, silent=True, checkpoint=ckpt)
    assert files and files[-1].writes > 2  # it failed midway through the tensors
    assert ckpt.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["c.gguf"]  # no temp file left behind


# ---- through the command line: a real SIGKILL and a Ctrl-C -------------------------------------
def finetune_cmd(stories_path: Path, text: Path, out: Path, *extra: str) -> list[str]:
    """The child process's command line ([3:]: the tool's arguments, for tool_process)."""
    return [sys.executable, "-m", "llamapy.cli.finetune", "-m", str(stories_path), "-f", str(text), "-c", "32",
            "-b", "64", "--epochs", "3", "-lr", "1e-3", "--lr-schedule", "cosine", "--warmup", "2",
            "--grad-clip", "1", "--seed", "5", "--shuffle", "-t", "2", "-o", str(out), *extra]


def tensors_of(path: Path) -> dict[str, np.ndarray]:
    return {n: t.numpy() for n, t in llamapy.load_model(path).tensors.items()}


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    t0 = time.time()
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.time() - t0 < timeout
        time.sleep(0.05)


def test_cli_run_killed_with_sigkill_resumes_bit_identical(stories_path, wiki_path, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(wiki_path.read_text()[:6000])
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    ref_out, out, ckpt = tmp_path / "ref.gguf", tmp_path / "out.gguf", tmp_path / "run.ckpt"
    done = tool_process("finetune", *finetune_cmd(stories_path, text, ref_out)[3:])  # uninterrupted, in this process
    assert done.returncode == 0, done.stderr
    run = finetune_cmd(stories_path, text, out, "--checkpoint-out", str(ckpt), "--save-every", "1")
    rng = np.random.default_rng()
    kills = 0
    for kill in range(4):  # killed at random moments (3 times), each resumed from its checkpoint
        proc = subprocess.Popen(run + (["--checkpoint-in", str(ckpt)] if kill else []), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env, cwd=REPO_ROOT)
        if kill:
            time.sleep(1.0)  # past the start-up, into training and its checkpoint writes
        else:
            wait_for(ckpt, proc)
        time.sleep(float(rng.uniform(0.0, 0.5)))
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        if proc.returncode == 0 or out.exists():  # this run finished (its model written whole) before the kill
            break
        assert proc.returncode == -signal.SIGKILL
        kills += 1
    assert kills >= 2, "the run ended before it was killed twice"
    resumed = tool_process("finetune", *run[3:], "--checkpoint-in", ckpt)  # the last resume, in this process
    assert resumed.returncode == 0, resumed.stderr
    expect, got = tensors_of(ref_out), tensors_of(out)
    for name in expect:
        assert np.array_equal(got[name], expect[name]), name
    assert not list(tmp_path.glob(".*.tmp")), "a killed write's temp file survived the runs after it"


def test_cli_ctrl_c_writes_a_checkpoint_and_says_so(stories_path, wiki_path, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(wiki_path.read_text()[:6000])
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    out, ckpt = tmp_path / "out.gguf", tmp_path / "run.ckpt"
    proc = subprocess.Popen(finetune_cmd(stories_path, text, out, "--checkpoint-out", str(ckpt), "--save-every", "4"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)
    wait_for(ckpt, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    last = err.strip().splitlines()[-1]
    assert "interrupted after" in last and str(ckpt) in last and "Traceback" not in err
    assert load_checkpoint(ckpt).position.shuffled  # written at a step, not only at an epoch end
    before = ckpt.read_bytes()
    for every in ("-2", "0"):
        bad = tool_process("finetune", *finetune_cmd(stories_path, text, out, "--checkpoint-out", str(ckpt),
                                                     "--save-every", every)[3:])  # in this process
        assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1 and "--save-every" in bad.stderr
    assert ckpt.read_bytes() == before and not out.exists()
