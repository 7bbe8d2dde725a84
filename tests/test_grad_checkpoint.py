"""Gradient checkpointing of a language model (TrainParams.grad_checkpoint, --grad-checkpoint):
the gradients of a window equal the plain run's (full finetune and LoRA, whole windows and
ubatch splits, every layer boundary kept or every other), the planned arena is smaller,
and the flag works from the command line."""
from __future__ import annotations

import re
import subprocess

import numpy as np
import pytest

import llamapy
from llamapy.dataset import token_windows
from llamapy.train_params import LoraParams, TrainParams

from conftest import tool_process

N_CTX = 128
MAX_REL_DIFF = 1e-5  # the acceptance bound; recomputation repeats the same kernels, so it is 0 here


@pytest.fixture(scope="module")
def window(stories_path, wiki_path):
    model = llamapy.load_model(stories_path)
    ds = token_windows(model.vocab.tokenize(wiki_path.read_text()[:6000]), N_CTX)
    return ds.data[1], ds.labels[1]


def window_gradients(path, window, n_ubatch: int, lora: bool, n_ctx: int = N_CTX, n_threads: int = 1,
                     **checkpointing):
    """The loss and the trained tensors' gradients of one window (LoRA's B made non-zero,
    so that A has a gradient too)."""
    ctx = llamapy.Context(llamapy.load_model(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ubatch,
                          n_threads=n_threads)
    ctx.opt_init(TrainParams(lora=LoraParams(rank=4) if lora else None, **checkpointing))
    tr = ctx.trainer
    rng = np.random.default_rng(0)
    for name, t in tr.trained.items():
        if name.endswith(".lora_b"):
            t.set(rng.normal(0.0, 0.05, t.nelements()).astype(np.float32))
    loss = np.mean(tr.window(*window, True))
    return loss, {name: tr.grad(name).copy() for name in tr.trained}, tr


def max_rel_diff(got: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> float:
    """The largest difference of any gradient, relative to that tensor's largest magnitude."""
    assert got.keys() == ref.keys()
    worst = 0.0
    for name in ref:
        scale = np.abs(ref[name]).max()
        assert scale > 0, name
        worst = max(worst, float(np.abs(got[name] - ref[name]).max() / scale))
    return worst


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("n_ubatch", [N_CTX, 64, 32])
def test_gradients_equal_the_plain_run(stories_path, window, lora, n_ubatch):
    loss, plain, _ = window_gradients(stories_path, window, n_ubatch, lora)
    for every in (None, 2):
        got_loss, got, tr = window_gradients(stories_path, window, n_ubatch, lora, grad_checkpoint=True,
                                             grad_checkpoint_every=every)
        assert tr.checkpoint_strides() == [every or 1]  # stories260K: small residual, large layers
        assert got_loss == loss
        assert max_rel_diff(got, plain) <= MAX_REL_DIFF


@pytest.mark.parametrize("arch", ["gemma3", "qwen3"])
def test_other_architectures_equal_the_plain_run(stories_path, window, arch):
    """gemma3's layers (sandwich norms, QK-norm, GeGLU, sliding windows) and qwen3's
    (QK-norm, NEOX RoPE), on small new models: every layer kept and every other."""
    shape = dict(n_embd=32, n_head=4, n_head_kv=2, n_layer=3, n_ff=64, n_ctx_train=N_CTX, seed=3)
    if arch == "gemma3":
        shape["sliding_window"] = 48

    def gradients(**checkpointing):
        model = llamapy.new_model(arch, stories_path, **shape)
        ctx = llamapy.Context(model, n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=64, n_threads=1)
        ctx.opt_init(TrainParams(**checkpointing))
        loss = np.mean(ctx.trainer.window(*window, True))
        return loss, {name: ctx.trainer.grad(name).copy() for name in ctx.trainer.trained}
    loss, plain = gradients()
    for every in (1, 2):
        got_loss, got = gradients(grad_checkpoint=True, grad_checkpoint_every=every)
        assert got_loss == loss
        assert max_rel_diff(got, plain) <= MAX_REL_DIFF


def test_checkpointed_split_window_equals_the_plain_whole_window(stories_path, window):
    """Both properties at once: checkpointed ubatches of 32 against the plain whole window."""
    _, whole, _ = window_gradients(stories_path, window, N_CTX, False)
    _, split, _ = window_gradients(stories_path, window, 32, False, grad_checkpoint=True)
    assert max_rel_diff(split, whole) <= 2e-5  # test_finetune's bound for ubatch splits


@pytest.mark.parametrize("n_ubatch, ratio", [(N_CTX, 0.6), (32, 0.8)])  # small ubatches: the K/V gradients weigh more
def test_memory_plan_shows_a_smaller_arena(stories_path, n_ubatch, ratio):
    plans = {}
    for on in (False, True):
        ctx = llamapy.Context(llamapy.load_model(stories_path), n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=n_ubatch,
                              n_threads=1)
        ctx.opt_init(TrainParams(grad_checkpoint=on))
        plans[on] = ctx.trainer.memory_plan()
    assert plans[True]["graph arenas"] < ratio * plans[False]["graph arenas"]
    assert {k: v for k, v in plans[True].items() if k != "graph arenas"} == \
        {k: v for k, v in plans[False].items() if k != "graph arenas"}


def test_stride_without_checkpointing_is_refused():
    with pytest.raises(ValueError, match="grad_checkpoint_every needs grad_checkpoint=True"):
        TrainParams(grad_checkpoint_every=2)


def test_an_architecture_without_layer_boundaries_is_refused_in_one_line(stories_path, monkeypatch):
    """An architecture module that does not mark its layer boundaries cannot checkpoint."""
    from llamapy.errors import InputError
    from llamapy.graph_builder import GraphBuilder
    monkeypatch.setattr(GraphBuilder, "layer_boundary", lambda self, x: x)
    ctx = llamapy.Context(llamapy.load_model(stories_path), n_ctx=64, n_batch=64, n_ubatch=64, n_threads=1)
    ctx.opt_init(TrainParams(grad_checkpoint=True))
    with pytest.raises(InputError, match="^gradient checkpointing: the llama graph marks no layer boundaries$"):
        ctx.trainer.memory_plan()


def finetune(*args: str) -> subprocess.CompletedProcess:
    """llamapy-finetune in this process (test_finetune.py and test_checkpoint.py run it as a child process)."""
    return tool_process("finetune", *args)


def test_finetune_cli_grad_checkpoint(stories_path, wiki_path, tmp_path):
    """Same losses as without the flag, a smaller planned arena, and a line saying what is kept."""
    text = tmp_path / "text.txt"
    text.write_text(wiki_path.read_text()[:3000])
    runs = {}
    for flag in ([], ["--grad-checkpoint"]):
        r = finetune("-m", str(stories_path), "-f", str(text), "-c", "64", "-ub", "32", "--epochs", "1", "-t", "1",
                     "-o", str(tmp_path / "out.gguf"), *flag)
        assert r.returncode == 0, r.stderr
        runs[bool(flag)] = r.stderr
    arenas = {on: float(re.search(r"graph arenas ([\d.]+) MB", err).group(1)) for on, err in runs.items()}
    assert arenas[True] < arenas[False]
    assert "gradient checkpointing: the residual stream kept at every layer" in runs[True]
    assert "gradient checkpointing" not in runs[False]
    losses = {on: re.findall(r"loss=([\d.]+)", err) for on, err in runs.items()}
    assert losses[True] == losses[False] and losses[True]


@pytest.mark.slow
def test_gemma3_lora_gradients_equal_the_plain_run(gemma3_path, wiki_path):
    """The main job's model (quantized base, LoRA): the same gradients through the
    quantized products, with the head's logits kept and the layers recomputed."""
    model = llamapy.load_model(gemma3_path)
    ds = token_windows(model.vocab.tokenize(wiki_path.read_text()[:3000]), 64)
    window = (ds.data[0], ds.labels[0])
    for n_ubatch in (64, 32):
        loss, plain, _ = window_gradients(gemma3_path, window, n_ubatch, True, n_ctx=64, n_threads=2)
        got_loss, got, _ = window_gradients(gemma3_path, window, n_ubatch, True, n_ctx=64, n_threads=2,
                                            grad_checkpoint=True)
        assert got_loss == loss
        assert max_rel_diff(got, plain) <= MAX_REL_DIFF
