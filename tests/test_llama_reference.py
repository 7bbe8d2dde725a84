"""The llama graph against an independent float64 numpy forward pass of the same weights."""
from __future__ import annotations

import numpy as np
import pytest

import llamapy
from ggmlpy import GGMLType


def rms_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope_norm(x, pos, n_rot, base):
    """Rotate adjacent pairs (2i, 2i+1) of the first n_rot values by pos * base^(-2i/n_rot)."""
    x = x.copy()
    i = np.arange(n_rot // 2)
    theta = pos[:, None] * base ** (-2.0 * i / n_rot)  # [n, n_rot/2]
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    a, b = x[..., 0:n_rot:2].copy(), x[..., 1:n_rot:2].copy()
    x[..., 0:n_rot:2] = a * c - b * s
    x[..., 1:n_rot:2] = a * s + b * c
    return x


def reference_logits(model, tokens):
    hp = model.hparams
    W = {name: t.numpy().astype(np.float64) for name, t in model.tensors.items()}
    n = len(tokens)
    pos = np.arange(n, dtype=np.float64)
    hd = hp.n_embd_head_k
    x = W["token_embd.weight"][tokens]
    causal = np.tril(np.ones((n, n), dtype=bool))
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        h = rms_norm(x, W[p + "attn_norm.weight"], hp.norm_rms_eps)
        q = rope_norm((h @ W[p + "attn_q.weight"].T).reshape(n, hp.n_head, hd), pos, hp.n_rot, hp.rope_freq_base)
        k = rope_norm((h @ W[p + "attn_k.weight"].T).reshape(n, hp.n_head_kv, hd), pos, hp.n_rot, hp.rope_freq_base)
        v = (h @ W[p + "attn_v.weight"].T).reshape(n, hp.n_head_kv, hd)
        out = np.empty((n, hp.n_head, hd))
        for head in range(hp.n_head):
            kvh = head // (hp.n_head // hp.n_head_kv)
            s = q[:, head] @ k[:, kvh].T / np.sqrt(hd)
            s = np.where(causal, s, -np.inf)
            pr = np.exp(s - s.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            out[:, head] = pr @ v[:, kvh]
        x = x + out.reshape(n, -1) @ W[p + "attn_output.weight"].T
        h = rms_norm(x, W[p + "ffn_norm.weight"], hp.norm_rms_eps)
        g, u = h @ W[p + "ffn_gate.weight"].T, h @ W[p + "ffn_up.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ W[p + "ffn_down.weight"].T
    x = rms_norm(x, W["output_norm.weight"], hp.norm_rms_eps)
    out_w = W.get("output.weight", W["token_embd.weight"])
    return x @ out_w.T


def our_logits(model, tokens, **ctx_args):
    ctx = llamapy.Context(model, n_ctx=64, n_batch=64, n_ubatch=64, **ctx_args)
    ctx.decode(llamapy.Batch.from_tokens(tokens, all_outputs=True))
    return ctx.get_logits().astype(np.float64)


@pytest.mark.parametrize("flash_attn, rel", [(True, 2e-3), (False, 2e-4)])
def test_f32_model_matches_reference(stories_path, flash_attn, rel):
    """An F32 cache: F32 attention without flash attention; with it, as in llama.cpp, the keys
    and values are read as F16 (about 2^-11 relative each)."""
    model = llamapy.load_model(stories_path)
    tokens = model.vocab.tokenize("Once upon a time, there was a little dog named Max. He liked to run.")
    ref = reference_logits(model, tokens)
    ours = our_logits(model, tokens, type_k=GGMLType.F32, type_v=GGMLType.F32, flash_attn=flash_attn)
    np.testing.assert_allclose(ours, ref, atol=rel * np.abs(ref).max())


def test_f16_model_matches_reference(tiny_random_path):
    """F16 weights: ggml rounds the activations to f16 before each product, so ~1e-3 relative."""
    model = llamapy.load_model(tiny_random_path)
    assert model.tensors["blk.0.attn_q.weight"].type == GGMLType.F16
    tokens = model.vocab.tokenize("The quick brown fox jumps over the lazy dog, again and again.")
    ref = reference_logits(model, tokens)
    ours = our_logits(model, tokens, type_k=GGMLType.F32, type_v=GGMLType.F32)
    scale = np.abs(ref).max()
    np.testing.assert_allclose(ours, ref, atol=1e-2 * scale)
    assert np.abs(ours - ref).max() < 0.1 * np.abs(ref - ref.mean()).max()
