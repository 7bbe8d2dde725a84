"""Training a real model: exact gradients whatever n_ubatch, agreement with the inference
path, finite differences, warmup, the README example and llamapy-finetune end to end."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

import llamapy
from ggmlpy import GGMLType
from llamapy.dataset import token_windows
from llamapy.errors import InputError
from llamapy.train_params import SGD, LRSchedule, TrainParams, param_filter_pattern
from llamapy.perplexity import perplexity

from conftest import REPO_ROOT, SHARED, shared_path, tool_process

N_CTX = 128


@pytest.fixture(scope="module")
def stories(stories_path):
    return stories_path


@pytest.fixture(scope="module")
def wiki_tokens(stories, wiki_path):
    model = llamapy.load_model(stories)
    return model.vocab.tokenize(wiki_path.read_text()[:12000])


def trainer_for(stories, n_ubatch: int, params: TrainParams | None = None):
    model = llamapy.load_model(stories)
    ctx = llamapy.Context(model, n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=n_ubatch, n_threads=1)
    ctx.opt_init(params or TrainParams())
    return ctx


def grads(ctx) -> dict[str, np.ndarray]:
    tr = ctx.trainer
    return {name: tr.grad(name).copy() for name in tr.trained}


@pytest.mark.parametrize("n_ubatch", [16, 32, 64])
def test_first_step_loss_and_gradients_do_not_depend_on_n_ubatch(stories, wiki_tokens, n_ubatch):
    ds = token_windows(wiki_tokens, N_CTX)
    whole, split = trainer_for(stories, N_CTX), trainer_for(stories, n_ubatch)
    loss_whole = np.mean(whole.trainer.window(ds.data[0], ds.labels[0], True, None))
    loss_split = np.mean(split.trainer.window(ds.data[0], ds.labels[0], True, None))
    assert loss_split == pytest.approx(loss_whole, rel=1e-6)
    g_whole, g_split = grads(whole), grads(split)
    for name in g_whole:
        scale = np.abs(g_whole[name]).max()
        assert scale > 0, name
        np.testing.assert_allclose(g_split[name], g_whole[name], atol=2e-5 * scale, rtol=0, err_msg=name)
    # the K and V projections of the first layer learn from every later query of the window
    assert np.abs(g_split["blk.0.attn_k.weight"]).max() > 0 and np.abs(g_split["blk.0.attn_v.weight"]).max() > 0


def test_training_loss_equals_inference_cross_entropy(stories, wiki_tokens):
    ds = token_windows(wiki_tokens, N_CTX)
    ctx = trainer_for(stories, 32)
    model = ctx.model
    inf = llamapy.Context(model, n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, type_k=GGMLType.F32,
                          type_v=GGMLType.F32, flash_attn=False, n_threads=1)
    for i in range(3):
        loss = np.mean(ctx.trainer.window(ds.data[i], ds.labels[i], False, None))
        inf.memory_clear()
        inf.decode(llamapy.Batch.from_tokens(ds.data[i], all_outputs=True))
        logits = inf.get_logits().astype(np.float64)
        mx = logits.max(axis=1, keepdims=True)
        lse = np.log(np.exp(logits - mx).sum(axis=1)) + mx[:, 0]
        nll = lse - logits[np.arange(N_CTX), ds.labels[i]]
        assert loss == pytest.approx(nll.mean(), rel=2e-6)


def test_output_layer_fused_with_the_loss_equals_the_logits_graph(stories, wiki_tokens, monkeypatch):
    """The training graph's output layer and loss a chunk of the vocabulary at a time give
    the loss, accuracy and gradients (the trained output matrix's too) of the graph that
    makes the whole logits (what an architecture with softcapped logits trains with), with
    prompt-like positions ignored; and no tensor of the graph is [n_vocab x n_tokens]."""
    import ggmlpy as gg
    from llamapy.graph_builder import GraphBuilder
    from ggmlpy.backend.cpu.train import linear_ce
    monkeypatch.setattr(linear_ce, "CHUNK_BYTES", 1)  # 16 chunks of 32 tokens of the vocabulary
    ds = token_windows(wiki_tokens, N_CTX)
    labels = ds.labels[0].copy()
    labels[:20] = -1  # IGNORE
    runs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(GraphBuilder, "output", lambda g, w, cur: g.finish(gg.mul_mat(g.ctx, w, cur)))
        ctx = trainer_for(stories, 64)
        tr = ctx.trainer
        result = gg.opt.Result()
        losses = tr.window(ds.data[0], labels, True, result)
        graph = tr._graph(0, True).train.backward
        n_vocab = ctx.model.hparams.n_vocab
        assert any(t.ne[:2] == (n_vocab, 64) for t in graph.nodes) != fused  # logits or their gradient
        runs.append((losses, result.ncorrect, grads(ctx), tr.window(ds.data[1], labels, False, None)))
    (lf, cf, gf, vf), (lu, cu, gu, vu) = runs
    np.testing.assert_allclose(lf, lu, rtol=1e-6)
    np.testing.assert_allclose(vf, vu, rtol=1e-6)
    assert cf == cu
    assert "output.weight" in gf
    for name in gf:
        np.testing.assert_allclose(gf[name], gu[name], rtol=0, atol=1e-5 * np.abs(gu[name]).max(), err_msg=name)


def test_gradient_matches_finite_differences_through_split_windows(stories, wiki_tokens):
    """Directional derivative of the window loss along a random direction, for the K
    projection of layer 0 (whose gradient crosses ubatch boundaries) and a norm weight."""
    ds = token_windows(wiki_tokens, N_CTX)
    ctx = trainer_for(stories, 32)
    tr = ctx.trainer
    tr.window(ds.data[1], ds.labels[1], True, None)
    rng = np.random.default_rng(0)
    for name in ("blk.0.attn_k.weight", "blk.2.ffn_norm.weight"):
        t = tr.trained[name]
        g = tr.grad(name).astype(np.float64).reshape(t.array().shape)
        d = rng.standard_normal(g.shape)
        w0 = np.array(t.array())
        h = 1e-2 * np.abs(w0).mean() / np.abs(d).mean()
        vals = []
        for sign in (1, -1):
            t.array()[...] = (w0 + sign * h * d).astype(np.float32)
            vals.append(np.mean(tr.window(ds.data[1], ds.labels[1], False, None)))
        t.array()[...] = w0
        fd = (vals[0] - vals[1]) / (2 * h)
        assert fd == pytest.approx(float((g * d).sum()), rel=2e-2), name


def test_sgd_step_is_identical_for_split_ubatches(stories, wiki_tokens):
    ds = token_windows(wiki_tokens, N_CTX)
    params = TrainParams(optimizer=SGD(), schedule=LRSchedule(lr0=0.1))
    after = []
    for n_ubatch in (N_CTX, 32):
        ctx = trainer_for(stories, n_ubatch, params)
        ctx.opt_epoch(ds, None, None, idata_split=1)
        after.append({n: t.numpy().copy() for n, t in ctx.trainer.trained.items()})
    for name in after[0]:
        np.testing.assert_allclose(after[1][name], after[0][name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_param_filter_and_optimizer_memory(stories):
    ctx = trainer_for(stories, N_CTX, TrainParams(param_filter=param_filter_pattern(r"attn_(q|k)\.")))
    tr = ctx.trainer
    assert sorted(tr.trained) == sorted(f"blk.{i}.attn_{w}.weight" for i in range(5) for w in "qk")
    assert len(tr.optimizer_state) == 2 * len(tr.trained)
    sgd = trainer_for(stories, N_CTX, TrainParams(optimizer=SGD()))
    assert sgd.trainer.optimizer_state == []


def test_memory_plan_counts_what_the_run_holds(stories):
    """Reported before the first step: trained tensors with gradients of their size, AdamW's
    two moments, and the arenas of a window's graphs (built then, reused by the window)."""
    ctx = trainer_for(stories, N_CTX, TrainParams(param_filter=param_filter_pattern(r"attn_(q|k)\.")))
    tr = ctx.trainer
    plan = tr.memory_plan()
    trained = sum(t.nbytes() for t in tr.trained.values())
    assert plan["trained"] == plan["gradients"] == trained
    assert plan["optimizer state"] == 2 * trained
    assert plan["weights"] + trained == sum(t.nbytes() for t in ctx.model.tensors.values())  # each byte once
    n_graphs = len(tr._graphs)
    assert n_graphs == N_CTX // tr.n_ubatch and plan["graph arenas"] > 0
    tokens = np.arange(N_CTX + 1, dtype=np.int32) % 500
    tr.window(tokens[:-1], tokens[1:], True)
    assert len(tr._graphs) == n_graphs  # the first window used the planned graphs


def test_text_too_short_for_a_window(wiki_tokens):
    with pytest.raises(InputError, match="needs at least 129"):
        token_windows(wiki_tokens[:100], N_CTX)


def test_warmup_leaves_no_trace_and_is_refused_while_training(stories):
    model = llamapy.load_model(stories)
    ctx = llamapy.Context(model, n_ctx=N_CTX, n_threads=1)
    ctx.set_warmup(True)
    assert ctx.memory_seq_pos_max(0) == -1
    ctx.opt_init(TrainParams())
    with pytest.raises(InputError, match="trainable"):
        ctx.set_warmup(True)


def test_docs_python_training_example_runs(tmp_path, monkeypatch, stories_path):
    shared_path("data", "tinyshakespeare.txt")  # the example's text (skips where shared/ is absent)
    text = (REPO_ROOT / "docs" / "python.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    example = next(b for b in blocks if "opt_fit" in b)
    out = tmp_path / "stories-shakespeare.gguf"
    monkeypatch.chdir(REPO_ROOT)
    namespace: dict = {}
    example = example.replace('"stories-shakespeare.gguf"', repr(str(out))).replace('"../shared/', f'"{SHARED}/')
    exec(compile(example, "README", "exec"), namespace)
    history = namespace["history"]
    assert len(history) == 2 and history[1].val.loss()[0] < history[0].val.loss()[0]
    assert llamapy.load_model(out).hparams.n_layer == 5


# ---- the command line ------------------------------------------------------------------------
def finetune(*args: str) -> subprocess.CompletedProcess:
    """llamapy-finetune in this process, a child's start-up saved (test_checkpoint.py runs it as
    a child process, killed and resumed)."""
    return tool_process("finetune", *args)


@pytest.fixture(scope="module")
def slice_path(tmp_path_factory, wiki_path) -> Path:
    path = tmp_path_factory.mktemp("text") / "wiki-slice.txt"
    path.write_text(wiki_path.read_text()[:12000])
    return path


def slice_ppl(model_path: Path, text_path: Path) -> float:
    m = llamapy.load_model(model_path)
    return perplexity(m, m.vocab.tokenize(text_path.read_text()), 64, 2048, 512, -1, 1).ppl


@pytest.mark.parametrize("opt,lr", [("adamw", "1e-3"), ("sgd", "0.05")])
def test_finetune_cli_lowers_perplexity_on_its_text(stories, slice_path, tmp_path, opt, lr):
    out = tmp_path / "trained.gguf"
    plot = tmp_path / "loss.png"
    r = finetune("-m", str(stories), "-f", str(slice_path), "-c", "64", "-ub", "32", "--epochs", "2", "-opt", opt,
                 "-lr", lr, "-lr-half", "-o", str(out), "-t", "1", "--plot", str(plot))
    assert r.returncode == 0, r.stderr
    for epoch in (1, 2):
        assert re.search(rf"^epoch {epoch}: train: \[███████▉\] data=\d+/\d+ loss=[\d.]+±[\d.]+ acc=", r.stderr, re.M)
    assert len(re.findall(r"^ +val: +\[███████▉\]", r.stderr, re.M)) == 2
    assert f"saved the trained model to {out}" in r.stderr
    assert plot.stat().st_size > 1000
    assert slice_ppl(out, slice_path) < 0.5 * slice_ppl(stories, slice_path)


def _one_error_line(r: subprocess.CompletedProcess, pattern: str) -> None:
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert re.search(pattern, r.stderr.strip().splitlines()[-1]), r.stderr


def test_finetune_cli_bad_input(stories, slice_path, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Too short.")
    out = tmp_path / "out.gguf"
    _one_error_line(finetune("-m", str(stories), "-f", str(short), "-o", str(out)), r"^error: the text has \d+ tokens")
    _one_error_line(finetune("-m", str(stories), "-f", str(slice_path), "-o", str(tmp_path / "no" / "out.gguf")),
                    r"^error: cannot write .*does not exist or is not writable")
    _one_error_line(finetune("-m", str(stories), "-f", str(slice_path), "-opt", "lion", "-o", str(out)),
                    r"^error: unknown optimizer 'lion'")
    for flags, message in ((("-lr", "-1"), "-lr must be > 0, not -1.0"), (("-wd", "2"), "-wd must be <= 1, not 2.0"),
                           (("--grad-clip", "0"), "--grad-clip must be > 0")):  # the flag the user gave, named
        _one_error_line(finetune("-m", str(stories), "-f", str(slice_path), *flags, "-o", str(out)),
                        "^error: " + re.escape(message))
    assert not out.exists()


def test_finetune_cli_nan_loss_keeps_last_good_weights(stories, slice_path, tmp_path):
    out = tmp_path / "out.gguf"
    r = finetune("-m", str(stories), "-f", str(slice_path), "-c", "64", "-opt", "sgd", "-lr", "1e30", "-o", str(out), "-t", "1")
    _one_error_line(r, r"^error: training: the loss became nan")
    base, saved = llamapy.load_model(stories), llamapy.load_model(out)
    for name, t in base.tensors.items():
        assert np.array_equal(saved.tensors[name].array(), t.array()), name
