"""LoRA adapters: llama.cpp's file format, application in the graph, training through the
parameter filter, --lora / --lora-scaled at inference, and export-lora merging."""
from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest

import llamapy
from ggmlpy import GGMLType
from llamapy.dataset import token_windows
from llamapy.errors import ModelLoadError
from llamapy.lora import DEFAULT_MODULES, LoraAdapter, merge_adapters
from llamapy.train_params import LRSchedule, TrainParams, param_filter_lora

from conftest import REPO_ROOT, tool_process


def logits_of(model, tokens, adapters=()):
    ctx = llamapy.Context(model, n_ctx=64, n_threads=1)
    for adapter, scale in adapters:
        ctx.attach_lora(adapter, scale)
    ctx.decode(llamapy.Batch.from_tokens(tokens, all_outputs=True))
    return ctx.get_logits().copy()


@pytest.fixture(scope="module")
def model(stories_path):
    return llamapy.load_model(stories_path)


@pytest.fixture(scope="module")
def tokens(model, wiki_path):
    return model.vocab.tokenize(wiki_path.read_text()[:6000])


def test_new_adapter_shapes_and_identity(model, tokens):
    ad = LoraAdapter.new(model, rank=4, seed=3)
    assert len(ad.tensors) == 5 * len(DEFAULT_MODULES)
    a, b = ad.tensors["blk.1.ffn_down.weight"]
    w = model.tensors["blk.1.ffn_down.weight"]
    assert a.ne[:2] == (w.ne[0], 4) and b.ne[:2] == (4, w.ne[1])  # llama.cpp's lora_a / lora_b shapes
    assert np.abs(a.numpy()).max() <= 1 / np.sqrt(w.ne[0]) and not b.numpy().any()
    np.testing.assert_array_equal(logits_of(model, tokens[:32], [(ad, 1.0)]), logits_of(model, tokens[:32]))


def test_adapter_file_round_trip_and_format(model, tmp_path):
    ad = LoraAdapter.new(model, rank=2, alpha=8.0, modules=["attn_q", "ffn_up"], seed=1)
    rng = np.random.default_rng(0)
    for _, b in ad.tensors.values():
        b.array()[...] = rng.standard_normal(b.array().shape)
    path = ad.save(tmp_path / "ad.gguf")
    r = gguf.GGUFReader(path)
    field = lambda k: r.fields[k].contents()  # noqa: E731
    assert field("general.type") == "adapter" and field("adapter.type") == "lora"
    assert field("adapter.lora.alpha") == 8.0 and field("general.architecture") == "llama"
    names = {t.name for t in r.tensors}
    assert "blk.0.attn_q.weight.lora_a" in names and "blk.4.ffn_up.weight.lora_b" in names and len(names) == 20
    back = LoraAdapter.load(path, model)
    assert back.alpha == 8.0 and back.rank == 2
    for name, (a, b) in ad.tensors.items():
        np.testing.assert_array_equal(back.tensors[name][0].numpy(), a.numpy())
        np.testing.assert_array_equal(back.tensors[name][1].numpy(), b.numpy())


def test_scale_zero_is_the_base_and_merge_equals_applying(model, tokens, stories_path):
    ad = LoraAdapter.new(model, rank=3, seed=2)
    rng = np.random.default_rng(1)
    for _, b in ad.tensors.values():
        b.array()[...] = rng.standard_normal(b.array().shape) * 0.05
    base = logits_of(model, tokens[:32])
    np.testing.assert_array_equal(logits_of(model, tokens[:32], [(ad, 0.0)]), base)
    applied = logits_of(model, tokens[:32], [(ad, 0.7)])
    assert np.abs(applied - base).max() > 1e-2
    fresh = llamapy.load_model(stories_path)
    merge_adapters(fresh, [(ad, 0.7)], None)
    np.testing.assert_allclose(logits_of(fresh, tokens[:32]), applied, atol=2e-4 * np.abs(applied).max())


def test_lora_training_trains_only_the_adapter(model, tokens):
    ds = token_windows(tokens, 64)
    ad = LoraAdapter.new(model, rank=4, seed=0)
    before = {n: t.numpy().copy() for n, t in model.tensors.items()}
    ctx = llamapy.Context(model, n_ctx=64, n_batch=64, n_ubatch=32, n_threads=1)
    ctx.attach_lora(ad)
    ctx.opt_init(TrainParams(param_filter=param_filter_lora, schedule=LRSchedule(lr0=1e-3)))
    assert set(ctx.trainer.trained) == set(ad.named_tensors())
    history = ctx.opt_fit(ds, epochs=2, val_split=0.1, silent=True)
    assert history[1].val.loss()[0] < history[0].val.loss()[0]
    for n, t in model.tensors.items():
        np.testing.assert_array_equal(t.numpy(), before[n], err_msg=n)
    assert any(b.numpy().any() for _, b in ad.tensors.values())


def run_app(module: str, *args: str) -> subprocess.CompletedProcess:
    """The tool `module` as a child process: llamapy-export-lora's one run as its users run it
    (the other runs here are in this process, tool_process: a child's start-up saved each)."""
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})


def final_ppl(stderr: str) -> float:
    line = next(x for x in stderr.splitlines() if x.startswith("Final estimate"))
    return float(line.split("=")[1].split("+/-")[0])


def test_cli_lora_finetune_perplexity_and_export(stories_path, wiki_path, tmp_path):
    text = tmp_path / "slice.txt"
    text.write_text(wiki_path.read_text()[:12000])
    adapter, merged = tmp_path / "ad.gguf", tmp_path / "merged.gguf"
    r = tool_process("finetune", "-m", str(stories_path), "-f", str(text), "-c", "64", "--epochs", "2", "-lr", "1e-3",
                "--lora-rank", "4", "--lora-out", str(adapter), "-t", "1")
    assert r.returncode == 0, r.stderr
    assert f"try it: llamapy-perplexity -m {stories_path} --lora {adapter}" in r.stderr
    ppl = lambda *extra: final_ppl(tool_process("perplexity", "-m", *extra, "-f", str(text), "-c", "64", "-t", "1").stderr)  # noqa: E731
    base = ppl(str(stories_path))
    with_lora = ppl(str(stories_path), "--lora", str(adapter))
    assert with_lora < 0.5 * base
    assert ppl(str(stories_path), "--lora-scaled", f"{adapter}:0") == base
    r = run_app("llamapy.cli.export_lora", "-m", str(stories_path), "--lora", str(adapter), "-o", str(merged))
    assert r.returncode == 0, r.stderr
    assert ppl(str(merged)) == pytest.approx(with_lora, rel=1e-3)
    bad = tool_process("perplexity", "-m", str(stories_path), "--lora", str(stories_path), "-f", str(text), "-c", "64")
    assert bad.returncode != 0 and "not a LoRA adapter" in bad.stderr and "Traceback" not in bad.stderr


def test_merge_to_q8_0(model, tokens, stories_path):
    ad = LoraAdapter.new(model, rank=2, modules=["ffn_up"], seed=5)
    fresh = llamapy.load_model(stories_path)
    names = merge_adapters(fresh, [(ad, 1.0)], GGMLType.Q8_0)
    assert names and all(fresh.tensors[n].type == GGMLType.Q8_0 for n in names)
    # B is zero: only Q8_0 rounding (about 0.4% of each weight) separates the two models
    np.testing.assert_allclose(logits_of(fresh, tokens[:16]), logits_of(model, tokens[:16]), atol=0.3)


def test_loading_an_adapter_for_other_shapes_fails_clearly(model, tmp_path):
    ad = LoraAdapter.new(model, rank=2, modules=["attn_q"], seed=0)
    a, b = ad.tensors["blk.0.attn_q.weight"]
    ad.tensors["blk.0.attn_k.weight"] = (a, b)  # attn_k is 64 -> 32: b's 64 outputs do not fit
    path = ad.save(tmp_path / "bad.gguf")
    with pytest.raises(ModelLoadError, match="do not fit"):
        LoraAdapter.load(path, model)


@pytest.mark.slow
def test_gemma3_lora_finetune_lowers_loss_and_perplexity(gemma3_path, wiki_path, tmp_path):
    """The headline: LoRA on the quantized Gemma 3 270M. Validation loss falls from the first
    epoch to the last; the adapter lowers the text's perplexity; scale 0 is exactly the base."""
    text = tmp_path / "slice.txt"
    text.write_text(wiki_path.read_text()[:1100])  # 265 tokens: 5 training windows of 64, 2 for validation
    adapter = tmp_path / "gemma-ad.gguf"
    r = tool_process("finetune", "-m", str(gemma3_path), "-f", str(text), "-c", "64", "--epochs", "2",
                "-val-split", "0.2", "--lora-out", str(adapter))
    assert r.returncode == 0, r.stderr
    assert "training a LoRA adapter of rank 8" in r.stderr  # LoRA is the default on quantized weights
    val = [float(x) for x in __import__("re").findall(r"val: +\[███████▉\] data=\S+ loss=([\d.]+)", r.stderr)]
    assert len(val) == 2 and val[1] < val[0], r.stderr
    ppl = lambda *extra: final_ppl(tool_process("perplexity", "-m", str(gemma3_path), *extra, "-f", str(text),  # noqa: E731
                                           "-c", "64", "-b", "64").stderr)
    base = ppl()
    assert ppl("--lora", str(adapter)) < base
    assert ppl("--lora-scaled", f"{adapter}:0") == base


@pytest.mark.slow
def test_gemma3_fused_output_layer_equals_the_logits_graph(gemma3_path, wiki_path, monkeypatch):
    """Gemma 3's tied 262,144 x 640 Q8_0 head through the chunked output layer and loss gives
    the window loss and accuracy of the graph that makes the whole logits, and the same
    LoRA gradients to float rounding (carried back through 18 layers), with float32 backward
    products; with bf16 ones (backward_bf16, the default where the CPU has them) the
    gradients stay within 2% of those (relative L2 error of each tensor: 1.3% at worst, in
    layer 1, after 17 layers of bf16 products)."""
    import ggmlpy as gg
    from llamapy.graph_builder import GraphBuilder
    runs = []
    for fused, bf16 in ((True, False), (False, False), (True, True)):
        if not fused:
            monkeypatch.setattr(GraphBuilder, "output", lambda g, w, cur: g.finish(gg.mul_mat(g.ctx, w, cur)))
        else:
            monkeypatch.undo()
        model = llamapy.load_model(gemma3_path)
        ctx = llamapy.Context(model, n_ctx=128, n_batch=128, n_ubatch=128, n_threads=2)
        ctx.opt_init(TrainParams.for_model(model, backward_bf16=bf16))
        ds = token_windows(model.vocab.tokenize(wiki_path.read_text()[:2000]), 128)
        result = gg.opt.Result()
        losses = ctx.trainer.window(ds.data[0], ds.labels[0], True, result)
        runs.append((losses, result.ncorrect, {n: ctx.trainer.grad(n).copy() for n in ctx.trainer.trained}))
    (lf, cf, gf), (lu, cu, gu), (lb, cb, gb) = runs
    np.testing.assert_allclose(lf, lu, rtol=1e-6)
    assert cf == cu
    for name in gf:
        np.testing.assert_allclose(gf[name], gu[name], rtol=0, atol=1e-4 * np.abs(gu[name]).max(), err_msg=name)
    assert lb == lf and cb == cf  # the forward pass is the same
    zero = [name for name in gf if not gf[name].any()]  # lora_a: B starts at 0
    assert zero and all(not gb[name].any() for name in zero)
    errors = {name: np.linalg.norm(gb[name] - gf[name]) / np.linalg.norm(gf[name]) for name in gf if name not in zero}
    assert max(errors.values()) <= 2e-2, errors


@pytest.mark.parametrize("choice", [None, True, False])
def test_backward_bf16_marks_the_products_through_quantized_weights(stories_path, choice):
    """TrainParams.backward_bf16 sets Prec.BF16 on exactly the training graph's OUT_PROD
    nodes through a quantized matrix (None: where the CPU has AVX512-BF16)."""
    import ggmlpy as gg
    quantized = llamapy.load_model(stories_path)
    merge_adapters(quantized, [(LoraAdapter.new(quantized, rank=1, modules=["ffn_up"]), 1.0)], GGMLType.Q8_0)
    ctx = llamapy.Context(quantized, n_ctx=32, n_threads=1)
    ctx.opt_init(TrainParams.for_model(quantized, backward_bf16=choice))
    want = ctx.backend.bf16_dot_products if choice is None else choice
    assert ctx.trainer.backward_bf16 == want
    ctx.trainer.memory_plan()  # builds a window's graphs
    nodes = [n for g in ctx.trainer._graphs.values() for n in g.train.backward.nodes if n.op == gg.Op.OUT_PROD]
    through = [n for n in nodes if gg.traits(n.src[0].type).is_quantized]
    assert through and len(through) < len(nodes)
    assert all(gg.prec_of(n) == (gg.Prec.BF16 if want else gg.Prec.DEFAULT) for n in through)
    assert all(gg.prec_of(n) == gg.Prec.DEFAULT for n in nodes if n not in through)


def test_training_policy_for_a_model(model, stories_path):
    """TrainParams.for_model decides what a user gets by default (the CLI uses it too): full
    finetune at llama.cpp's rate on F32 weights, a rank-8 adapter at 3e-4 on quantized ones."""
    from llamapy.train_params import AdamW, param_filter_all
    full = TrainParams.for_model(model)
    assert full.lora is None and full.schedule.lr0 == 1e-5 and full.param_filter is param_filter_all
    assert not full.window_bos and TrainParams.for_model(model, window_bos=True).window_bos
    quantized = llamapy.load_model(stories_path)
    merge_adapters(quantized, [(LoraAdapter.new(quantized, rank=1, modules=["ffn_up"]), 1.0)], GGMLType.Q8_0)
    params = TrainParams.for_model(quantized)
    assert params.lora.rank == 8 and params.schedule.lr0 == 3e-4 and params.param_filter is param_filter_lora
    mine = TrainParams.for_model(quantized, schedule=LRSchedule(lr0=1e-3, epochs=3))
    assert mine.schedule.lr0 == 1e-3 and mine.schedule.epochs == 3
    with pytest.raises(ValueError, match="lr0"):
        TrainParams(optimizer=AdamW(alpha=1e-3))
    ctx = llamapy.Context(quantized, n_ctx=64, n_threads=1)
    ctx.opt_init(params)
    adapter = ctx.trainer.adapter
    assert [a for a, _ in ctx.adapters] == [adapter]
    assert set(ctx.trainer.trained) == set(adapter.named_tensors())
