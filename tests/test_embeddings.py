"""Embeddings in Python: `Context(..., embeddings=True)`'s per-token and pooled embeddings and
llama-cpp-python's `Llama.embed` / `create_embedding`, against llama-server's answers for the
same texts (tests/data/llama_server_answers.json, recorded by tests/record_llama_server.py
with flash attention off, as these contexts run: record_llama_server.py's RUNS say why)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import llamapy
from llamapy.errors import InputError
from llamapy.pooling import Pooling, normalize

ANSWERS = json.loads((Path(__file__).parent / "data" / "llama_server_answers.json").read_text())
TEXT = "Lily had a cat."


def recorded(run: str, name: str) -> np.ndarray:
    """A recorded /embedding answer's vectors: [n_tokens or 1, n_embd]."""
    return np.array(ANSWERS[run][name]["answer"][0]["embedding"], dtype=np.float32)


def embeddings(model, text: str, pooling: str | None = None, n_ubatch: int = 512,
               flash_attn: bool = False) -> tuple[np.ndarray, object]:
    ctx = llamapy.Context(model, n_ctx=128, n_ubatch=n_ubatch, embeddings=True, pooling_type=pooling,
                          flash_attn=flash_attn)
    ctx.decode(llamapy.Batch.from_tokens(model.vocab.tokenize(text, add_special=True)))
    return ctx.get_embeddings(), ctx


@pytest.fixture(scope="module")
def stories(stories_path):
    return llamapy.load_model(stories_path)


def test_token_embeddings_are_llama_cpps(stories):
    """Pooling none (a generative model's own): every token's normed last hidden state."""
    ours, ctx = embeddings(stories, TEXT)
    theirs = recorded("none", "embedding")
    assert ctx.pooling_type is Pooling.NONE and ours.shape == theirs.shape == (len(theirs), 64)
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
    np.testing.assert_array_equal(ctx.get_embeddings_ith(-1), ours[-1])


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_pooled_embeddings_pool_the_token_embeddings(stories, pooling):
    """A sequence's pooled embedding is llama.cpp's pooling of its tokens' (mean; the first
    position's; the last position's), and llama-server's answer is its mean, normalized."""
    ours, ctx = embeddings(stories, TEXT, pooling)
    theirs = recorded("none", "embedding")
    want = {"mean": theirs.mean(axis=0), "cls": theirs[0], "last": theirs[-1]}[pooling]
    np.testing.assert_allclose(ctx.get_embeddings_seq(0), want, atol=1e-4)
    if pooling == "mean":
        np.testing.assert_allclose(normalize(ctx.get_embeddings_seq(0)), recorded("fim", "embedding")[0], atol=1e-4)
        np.testing.assert_allclose(ctx.get_embeddings_seq(0), recorded("fim", "embedding_raw")[0], atol=1e-4)


def test_small_ubatches_give_the_same_embeddings(stories):
    """Each ubatch's rows land in their batch places, and a sequence's pooled embedding covers
    its tokens of the last ubatch, as llama.cpp's embd_seq (a row out of place would be off by
    units; the products' rounding depends on the rows computed at once: 1e-3)."""
    text = "Lily had a cat. Tom saw a dog and they played all day."
    whole, _ = embeddings(stories, text, flash_attn=True)
    split, ctx = embeddings(stories, text, "mean", n_ubatch=4, flash_attn=True)
    np.testing.assert_allclose(split, whole, atol=1e-3)
    n_last = len(whole) % 4 or 4
    np.testing.assert_allclose(ctx.get_embeddings_seq(0), split[-n_last:].mean(axis=0), atol=1e-6)


def test_embeddings_are_refused_where_there_are_none(stories):
    ctx = llamapy.Context(stories, n_ctx=64)
    ctx.decode(llamapy.Batch.from_tokens([1, 403]))
    with pytest.raises(InputError, match="no embeddings"):
        ctx.get_embeddings_ith(-1)
    ctx.set_embeddings(True)
    ctx.decode(llamapy.Batch.from_tokens([407, 261], pos0=2))
    assert ctx.get_logits().shape == (2, stories.hparams.n_vocab)  # every token is an output
    with pytest.raises(InputError, match="pooling is none"):
        ctx.get_embeddings_seq(0)
    with pytest.raises(InputError, match="rank"):
        llamapy.Context(stories, n_ctx=64, pooling_type="rank")


def test_llama_cpp_python_embed_and_create_embedding(stories_path, stories):
    """llama-cpp-python's shapes over the Context's embeddings (Llama runs with flash attention,
    so the reference here is the Context's, itself checked against llama.cpp above)."""
    def context_embeddings(text: str, pooling: str | None) -> np.ndarray:
        ctx = llamapy.Context(stories, n_ctx=512, embeddings=True, pooling_type=pooling)
        ctx.decode(llamapy.Batch.from_tokens(stories.vocab.tokenize(text, add_special=True)))
        return ctx.get_embeddings() if pooling is None else ctx.get_embeddings_seq(0)

    llm = llamapy.Llama(model_path=str(stories_path), embedding=True, verbose=False)
    assert llm.pooling_type() == 0
    np.testing.assert_allclose(np.array(llm.embed(TEXT)), context_embeddings(TEXT, None), atol=1e-6)
    pooled = llamapy.Llama(model_path=str(stories_path), embedding=True, pooling_type=1, verbose=False)
    response = pooled.create_embedding([TEXT, "Tom saw a dog"])
    assert response["object"] == "list" and [d["index"] for d in response["data"]] == [0, 1]
    assert [d["object"] for d in response["data"]] == ["embedding", "embedding"]
    theirs = ANSWERS["fim"]["v1_embeddings"]["answer"]
    assert response["usage"] == {k: theirs["usage"][k] for k in ("prompt_tokens", "total_tokens")}
    for ours, text in zip(response["data"], [TEXT, "Tom saw a dog"]):
        np.testing.assert_allclose(ours["embedding"], context_embeddings(text, "mean"), atol=1e-6)
    unit = pooled.embed(TEXT, normalize=True)
    np.testing.assert_allclose(unit, normalize(context_embeddings(TEXT, "mean")), atol=1e-6)
    assert np.linalg.norm(unit) == pytest.approx(1.0, abs=1e-6)
    assert pooled("Once upon a time", max_tokens=4, temperature=0)["choices"][0]["text"]  # generation still works
    with pytest.raises(RuntimeError, match="embedding=True"):
        llamapy.Llama(model_path=str(stories_path), verbose=False).embed(TEXT)


@pytest.mark.slow
def test_gemma3_token_embeddings_are_llama_cpps(gemma3_path):
    model = llamapy.load_model(gemma3_path)
    body = ANSWERS["gemma3"]["embedding"]["body"]
    ours, _ = embeddings(model, body["content"])
    theirs = recorded("gemma3", "embedding")
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
