"""qwen2, qwen3 and Llama 3's RoPE frequency factors against llama.cpp, and training on each.

The models are stories260K re-packed into each layout (../shared/models, SOURCES.md);
llama.cpp's perplexities and greedy texts on them are in ../shared/golden.
"""
from __future__ import annotations

import filecmp

import numpy as np
import pytest

import llamapy
from ggmlpy import GGMLType, Tensor
from llamapy.dataset import token_windows
from llamapy.errors import UnsupportedModelError
from llamapy.gguf_file import GGUFFile
from llamapy.lora import LoraAdapter
from llamapy.model import model_from
from llamapy.perplexity import perplexity
from llamapy.train_params import LRSchedule, TrainParams, param_filter_all, param_filter_lora

from conftest import shared_path, tool_process
from golden import running_ppl

MODELS = ["qwen2", "qwen3", "rope-freqs"]
REL = 1e-4  # acceptance: llama.cpp's running values [1], [10], [100] and the final one to 1e-4


def model_path(name: str):
    return shared_path("models", f"stories260K-{name}.gguf")


@pytest.fixture(scope="module")
def wiki_tokens(wiki_path):
    # the three files share stories260K's vocabulary
    vocab = llamapy.load_model(model_path("qwen3")).vocab
    return vocab.tokenize(wiki_path.read_text(encoding="utf-8")[:400_000], add_special=True)


@pytest.fixture(scope="module")
def stories():
    """TinyStories tokens: a training slice and a held-out slice after it (with BOS)."""
    vocab = llamapy.load_model(model_path("qwen3")).vocab
    tokens = vocab.tokenize(shared_path("data", "tinystories_sample.txt").read_text(encoding="utf-8")[:30_000])
    return tokens[:5000], [vocab.bos_id] + tokens[5000:7000]


@pytest.mark.parametrize("n_ubatch", [128, 32])
@pytest.mark.parametrize("name", MODELS)
def test_perplexity_matches_llama_cpp(name, n_ubatch, wiki_tokens):
    assert len(wiki_tokens) >= 100 * 128
    golden = running_ppl(shared_path("golden", f"ppl_stories260K-{name}_wiki_c128_ch100.txt"))
    result = perplexity(llamapy.load_model(model_path(name)), wiki_tokens, n_ctx=128, n_batch=128, n_ubatch=n_ubatch,
                        n_chunks=100)
    if n_ubatch == 128:  # llama.cpp's own ubatch: every running value as it prints them
        assert [f"{v:.4f}" for v in result.running] == [f"{golden[c]:.4f}" for c in range(1, 101)]
    for chunk in (1, 10, 100):
        assert result.running[chunk - 1] == pytest.approx(golden[chunk], rel=REL), f"[{chunk}]"
    assert result.ppl == pytest.approx(golden[100], rel=REL)  # llama.cpp's final estimate is its last running value


@pytest.mark.parametrize("name", MODELS)
def test_greedy_text_matches_llama_cpp(name):
    r = tool_process("cli", "-m", str(model_path(name)), "-p", "Once upon a time", "-n", "32", "--temp", "0", "-s", "1",
                     "-t", "2")  # in this process: a start-up saved
    assert r.returncode == 0, r.stderr
    expected = shared_path("golden", f"greedy_stories260K-{name}.txt").read_text(encoding="utf-8")
    assert r.stdout.strip() == expected.strip()


@pytest.mark.parametrize("name", MODELS)
def test_saving_an_unchanged_model_writes_the_same_file(name, tmp_path):
    out = llamapy.save_model_to_file(llamapy.load_model(model_path(name)), tmp_path / "same.gguf")
    assert filecmp.cmp(model_path(name), out, shallow=False)


def test_frequency_factors_are_used():
    """Without its rope_freqs.weight the file is another model (llama.cpp: PPL 95.99 vs 120.85)."""
    model = llamapy.load_model(model_path("rope-freqs"))
    tokens = model.vocab.tokenize("Once upon a time, there was a little girl named Lily.", add_special=True)

    def logits():
        ctx = llamapy.Context(model, n_ctx=64, n_threads=1)
        ctx.decode(llamapy.Batch.from_tokens(tokens, all_outputs=True))
        return ctx.get_logits().copy()

    with_factors = logits()
    ones = Tensor(GGMLType.F32, model.tensors["rope_freqs.weight"].ne)
    ones.bind(np.ones(ones.nelements(), np.float32).view(np.uint8))
    model.set_tensor("rope_freqs.weight", ones)
    assert np.abs(logits() - with_factors).max() > 1e-2


@pytest.mark.parametrize("name, extra", [("qwen2", "rope_freqs.weight"), ("qwen3", "blk.0.attn_q.bias"),
                                         ("rope-freqs", "blk.0.attn_q_norm.weight")])
def test_a_tensor_the_architecture_does_not_use_is_refused(name, extra):
    f = GGUFFile(model_path(name))
    f.tensors[extra] = f.tensors["output_norm.weight"]
    with pytest.raises(UnsupportedModelError, match=f"tensor '{extra}' is not part of a"):
        model_from(f)


def test_refusal_is_one_line_from_the_cli(tmp_path):
    import gguf
    src = gguf.GGUFReader(model_path("qwen2"))
    out = tmp_path / "extra.gguf"
    w = gguf.GGUFWriter(str(out), "qwen2")
    for key, field in src.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(key, value, vtype)
    for t in src.tensors:
        w.add_tensor(t.name, np.array(t.data))
    w.add_tensor("blk.0.ffn_gate_inp.weight", np.ones((4, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = tool_process("perplexity", "-m", str(out), "-f", str(shared_path("data", "wiki.test.raw")), "-c", "128",
                     "--chunks", "2")  # in this process: a start-up saved
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "tensor 'blk.0.ffn_gate_inp.weight' is not part of a qwen2 model" in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_full_finetune_lowers_loss_and_saves(name, stories, tmp_path):
    train, held_out = stories
    model = llamapy.load_model(model_path(name))
    before = {n: t.numpy().copy() for n, t in model.tensors.items()}
    ppl_before = perplexity(model, held_out, n_ctx=128).ppl
    ctx = llamapy.Context(model, n_ctx=64, n_batch=64, n_ubatch=32, n_threads=2)
    ctx.opt_init(TrainParams(param_filter=param_filter_all, schedule=LRSchedule(lr0=3e-4)))
    assert "rope_freqs.weight" not in ctx.trainer.trained  # fixed by the model's design, never trained
    ctx.opt_fit(token_windows(train, 64), epochs=2, val_split=0.1, silent=True)
    changed = {n for n, t in model.tensors.items() if not np.array_equal(t.numpy(), before[n])}
    assert changed == set(model.tensors) - {"rope_freqs.weight"}  # biases and Q/K norms train too
    ppl_after = perplexity(model, held_out, n_ctx=128).ppl
    assert ppl_after < 0.9 * ppl_before
    reloaded = llamapy.load_model(llamapy.save_model_to_file(model, tmp_path / f"{name}.gguf"))
    assert perplexity(reloaded, held_out, n_ctx=128).ppl == pytest.approx(ppl_after, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_lora_lowers_loss_and_the_adapter_reloads(name, stories, tmp_path):
    train, held_out = stories
    model = llamapy.load_model(model_path(name))
    adapter = LoraAdapter.new(model, rank=4, seed=0)
    assert "blk.0.attn_q.weight" in adapter.tensors  # the biased projections take an adapter too
    base = perplexity(model, held_out, n_ctx=128).ppl
    ctx = llamapy.Context(model, n_ctx=64, n_batch=64, n_ubatch=64, n_threads=2)
    ctx.attach_lora(adapter)
    ctx.opt_init(TrainParams(param_filter=param_filter_lora, schedule=LRSchedule(lr0=3e-3)))
    ctx.opt_fit(token_windows(train, 64), epochs=2, val_split=0.1, silent=True)
    trained = perplexity(model, held_out, n_ctx=128, adapters=[(adapter, 1.0)]).ppl
    assert trained < 0.9 * base
    reloaded = LoraAdapter.load(adapter.save(tmp_path / f"{name}-lora.gguf"), model)
    assert perplexity(model, held_out, n_ctx=128, adapters=[(reloaded, 1.0)]).ppl == pytest.approx(trained, rel=1e-6)
