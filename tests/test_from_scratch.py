"""new_model: models trained from nothing — initialisation, decoding, saving, the borrowed
tokenizer, shape checks, and a short training run that lowers the loss."""
from __future__ import annotations

import math

import numpy as np
import pytest

import llamapy
from ggmlpy import GGMLType
from llamapy.dataset import text_windows
from llamapy.errors import InputError
from llamapy.gguf_file import GGUFFile, ValueType
from llamapy.train_params import LRSchedule, TrainParams

from conftest import shared_path

SHAPE = dict(n_embd=64, n_head=4, n_layer=2, n_ff=192, n_ctx_train=128)
TEXTS = ["Once upon a time, there was a little dog.", "  Lily said: \"Hello!\"\n\nThe end.", "über 42 ☃ x"]


@pytest.fixture(scope="module")
def model(stories_path) -> llamapy.Model:
    return llamapy.new_model("llama", stories_path, **SHAPE, seed=1)


def weights(m: llamapy.Model) -> dict[str, np.ndarray]:
    return {name: t.numpy() for name, t in m.tensors.items()}


def logits(m: llamapy.Model, tokens: list[int]) -> np.ndarray:
    ctx = llamapy.Context(m, n_ctx=64, n_batch=64, n_ubatch=64, n_threads=1)
    ctx.decode(llamapy.Batch.from_tokens(tokens, all_outputs=True))
    return ctx.get_logits().copy()


def test_initialisation_statistics(model):
    w = weights(model)
    assert all(a.dtype == np.float32 for a in w.values())
    for name in ("token_embd.weight", "output.weight", "blk.0.attn_q.weight", "blk.1.ffn_up.weight"):
        assert w[name].std() == pytest.approx(0.02, rel=0.05), name
        assert abs(w[name].mean()) < 0.002, name
    residual = 0.02 / math.sqrt(2 * SHAPE["n_layer"])
    for name in ("blk.0.attn_output.weight", "blk.1.ffn_down.weight"):
        assert w[name].std() == pytest.approx(residual, rel=0.05), name
    norms = [n for n in w if n.endswith("norm.weight")]
    assert len(norms) == 2 * SHAPE["n_layer"] + 1
    assert all(np.array_equal(w[n], np.ones(SHAPE["n_embd"], np.float32)) for n in norms)
    # untied output, and no two matrices drawn alike
    assert not np.array_equal(w["token_embd.weight"], w["output.weight"])
    assert not np.array_equal(w["blk.0.attn_q.weight"], w["blk.0.attn_k.weight"])


def test_shapes_hparams_and_parameter_count(model):
    hp, e, ff, v = model.hparams, SHAPE["n_embd"], SHAPE["n_ff"], model.vocab.n_tokens
    assert (hp.arch, hp.n_vocab, hp.n_embd, hp.n_head, hp.n_head_kv, hp.n_layer, hp.n_ff, hp.n_ctx_train) == \
        ("llama", 512, e, 4, 4, 2, ff, 128)
    assert (hp.n_rot, hp.rope_freq_base, hp.norm_rms_eps) == (16, 10000.0, np.float32(1e-5))
    assert model.tensors["token_embd.weight"].ne == (e, v, 1, 1)
    assert model.tensors["blk.1.ffn_down.weight"].ne == (ff, e, 1, 1)
    per_layer = 4 * e * e + 3 * e * ff + 2 * e
    assert model.n_params == 2 * e * v + e + SHAPE["n_layer"] * per_layer
    assert "2 layers" in model.describe() and f"{model.n_params / 1e6:.2f} M params" in model.describe()


def test_same_seed_same_weights_other_seed_other_weights(stories_path, model):
    again = weights(llamapy.new_model("llama", stories_path, **SHAPE, seed=1))
    other = weights(llamapy.new_model("llama", stories_path, **SHAPE, seed=2))
    for name, a in weights(model).items():
        assert np.array_equal(again[name], a), name
        assert np.array_equal(other[name], a) == name.endswith("norm.weight"), name


def test_decode_gives_finite_logits(model):
    tokens = model.vocab.tokenize(TEXTS[0])
    out = logits(model, tokens)
    assert out.shape == (len(tokens), 512) and np.isfinite(out).all()
    # near-uniform at initialisation: small logits, every token plausible
    assert np.abs(out).max() < 5.0


def test_save_and_load_give_the_same_model(model, stories_path, tmp_path):
    path = llamapy.save_model_to_file(model, tmp_path / "scratch.gguf")
    loaded = llamapy.load_model(path)
    assert list(loaded.tensors) == list(model.tensors)
    for name, t in model.tensors.items():
        assert (loaded.tensors[name].type, loaded.tensors[name].ne) == (GGMLType.F32, t.ne), name
        assert loaded.tensors[name].array().tobytes() == t.array().tobytes(), name
    assert loaded.hparams == model.hparams
    tokens = model.vocab.tokenize(TEXTS[1])
    assert np.array_equal(logits(loaded, tokens), logits(model, tokens))

    f = GGUFFile(path)
    arch_keys = {"context_length": 128, "embedding_length": 64, "block_count": 2, "feed_forward_length": 192,
                 "attention.head_count": 4, "attention.head_count_kv": 4, "rope.dimension_count": 16}
    for key, value in arch_keys.items():
        assert f.metadata[f"llama.{key}"].type == ValueType.UINT32 and f.get(f"llama.{key}") == value, key
    assert f.metadata["llama.rope.freq_base"].type == ValueType.FLOAT32 and f.get("llama.rope.freq_base") == 10000.0
    assert f.get("llama.attention.layer_norm_rms_epsilon") == float(np.float32(1e-5))
    assert (f.get("general.architecture"), f.get("general.name"), f.get("general.file_type")) == \
        ("llama", "llama-from-scratch", 0)
    source = GGUFFile(stories_path)
    tok_keys = [k for k in source.metadata if k.startswith("tokenizer.")]
    assert [k for k in f.metadata if k.startswith("tokenizer.")] == tok_keys
    for key in tok_keys:
        a, b = f.metadata[key], source.metadata[key]
        assert (a.type, a.sub_type) == (b.type, b.sub_type), key
        assert np.array_equal(a.value, b.value) if isinstance(b.value, np.ndarray) else a.value == b.value, key


def test_tokenizer_is_the_vocab_sources(model, stories_path):
    source = llamapy.load_model(stories_path).vocab
    for text in TEXTS:
        ids = model.vocab.tokenize(text)
        assert ids == source.tokenize(text)
        assert model.vocab.detokenize(ids) == source.detokenize(ids)
    assert (model.vocab.bos_id, model.vocab.eos_id, model.vocab.n_tokens) == (source.bos_id, source.eos_id, 512)


def test_every_tokenizer_key_is_copied_including_the_chat_template(stories_path, tmp_path):
    template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    vocab_file = tmp_path / "with-template.gguf"
    llamapy.save_model_to_file(llamapy.load_model(stories_path), vocab_file,
                               metadata={"tokenizer.chat_template": template, "tokenizer.ggml.add_bos_token": True})
    m = llamapy.new_model("llama", vocab_file, **SHAPE)
    saved = GGUFFile(llamapy.save_model_to_file(m, tmp_path / "new.gguf"))
    assert saved.get("tokenizer.chat_template") == template
    assert saved.metadata["tokenizer.ggml.add_bos_token"].type == ValueType.BOOL
    assert "general.name" in saved.metadata and saved.get("general.name") == "llama-from-scratch"


def test_gqa_and_gemma3(stories_path, tmp_path):
    gqa = llamapy.new_model("llama", stories_path, **{**SHAPE, "n_head": 8}, n_head_kv=2)
    assert gqa.tensors["blk.0.attn_k.weight"].ne == (64, 16, 1, 1)
    g = llamapy.new_model("gemma3", stories_path, **SHAPE, n_head_kv=2, head_dim=32, rope_freq_base=1e6)
    hp = g.hparams
    assert (hp.n_embd_head_k, hp.n_head_kv, hp.n_swa, hp.rope_freq_base) == (32, 2, 512, 1e6)
    assert "output.weight" not in g.tensors  # gemma3 ties the output to the embeddings
    assert g.tensors["blk.0.attn_q.weight"].ne == (64, 128, 1, 1)
    assert g.tensors["blk.1.attn_k_norm.weight"].ne == (32, 1, 1, 1)
    assert np.array_equal(g.tensors["blk.1.post_ffw_norm.weight"].numpy(), np.ones(64, np.float32))
    tokens = g.vocab.tokenize(TEXTS[0])
    out = logits(g, tokens)
    assert np.isfinite(out).all()
    loaded = llamapy.load_model(llamapy.save_model_to_file(g, tmp_path / "g.gguf"))
    assert loaded.hparams == hp
    assert np.array_equal(logits(loaded, tokens), out)


@pytest.mark.parametrize("changes, message", [
    (dict(n_embd=66), r"^n_embd 66 is not divisible by n_head 4$"),
    (dict(n_head_kv=3), r"^n_head 4 is not a multiple of n_head_kv 3$"),
    (dict(n_embd=12, n_head=4), r"^the head dimension 3 is odd: RoPE rotates pairs of values$"),
    (dict(n_layer=0), r"^n_layer must be a positive integer, got 0$"),
    (dict(n_ff=-5), r"^n_ff must be a positive integer, got -5$"),
    (dict(n_ctx_train=128.0), r"^n_ctx_train must be a positive integer, got 128.0$"),
    (dict(n_head=True), r"^n_head must be a positive integer, got True$"),
    (dict(rope_freq_base=0.0), r"^rope_freq_base must be a positive number, got 0.0$"),
    (dict(rms_eps=float("nan")), r"^rms_eps must be a positive number, got nan$"),
    (dict(seed=-1), r"^seed must be a non-negative integer, got -1$"),
    (dict(arch="gpt2"), r"^cannot create a model of architecture 'gpt2' \(supported: gemma3, llama, qwen2, qwen3\)$"),
    (dict(sliding_window=64), r"^sliding_window applies to gemma3 models, not llama$"),
])
def test_bad_shapes_are_refused_in_one_line(stories_path, changes, message):
    args = {"arch": "llama", **SHAPE, **changes}
    with pytest.raises(InputError, match=message):
        llamapy.new_model(vocab_from=stories_path, **args)


def test_bad_vocab_sources(tmp_path):
    with pytest.raises(InputError, match=r"^vocab_from: file not found: .*missing\.gguf$"):
        llamapy.new_model("llama", tmp_path / "missing.gguf", **SHAPE)
    text = tmp_path / "text.gguf"
    text.write_text("not a model at all")
    with pytest.raises(InputError, match=r"^vocab_from: .*text\.gguf is not a GGUF file"):
        llamapy.new_model("llama", text, **SHAPE)
    with pytest.raises(InputError, match=r"^vocab_from is required"):
        llamapy.new_model("llama", **SHAPE)


def cross_entropy(m: llamapy.Model, tokens: np.ndarray, labels: np.ndarray) -> float:
    """Mean next-token loss of one window, from the inference path."""
    out = logits(m, [int(t) for t in tokens]).astype(np.float64)
    mx = out.max(axis=1, keepdims=True)
    lse = np.log(np.exp(out - mx).sum(axis=1)) + mx[:, 0]
    return float((lse - out[np.arange(len(labels)), labels]).mean())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_short_training_lowers_the_loss(stories_path, arch, tmp_path):
    text = shared_path("data", "tinyshakespeare.txt").read_text()[:6000]
    m = llamapy.new_model(arch, stories_path, **SHAPE, seed=3)
    before = {name: t.numpy() for name, t in m.tensors.items()}
    ds = text_windows(m.vocab, text, 64)
    held_out = ds.data[-1], ds.labels[-1]
    loss0 = cross_entropy(m, *held_out)
    assert loss0 == pytest.approx(math.log(512), abs=0.1)  # near-uniform at initialisation
    ctx = llamapy.Context(m, n_ctx=64, n_batch=64, n_ubatch=64, n_threads=1)
    ctx.opt_init(TrainParams(schedule=LRSchedule(lr0=3e-3)))
    history = ctx.opt_fit(ds, epochs=3, val_split=0.1, silent=True)
    train = [h.train.loss()[0] for h in history]
    assert train[-1] < train[0] < loss0, train
    assert cross_entropy(m, *held_out) < loss0 - 1.0
    # every tensor, norms and biases included, trained in place of the initial weights
    assert all(not np.array_equal(t.numpy(), before[name]) for name, t in m.tensors.items())
    loaded = llamapy.load_model(llamapy.save_model_to_file(m, tmp_path / f"{arch}.gguf"))
    assert loaded.hparams == m.hparams
    tokens = [int(t) for t in held_out[0]]
    assert np.array_equal(logits(loaded, tokens), logits(m, tokens))
