"""The gemma3 architecture.

Fast: a tiny random gemma3-shaped model (written as GGUF here) against an independent
float64 numpy forward pass: embedding scale, QK-norm, NEOX RoPE with per-layer bases,
sandwich norms, GeGLU, and sliding-window masking on five layers of six (the window is
smaller than the sequence, so the mask matters).

Slow (real model, still run in CI): Gemma 3 270M Q4_K_M. The tokenizer against a
transcription of llama.cpp's SPM algorithm; perplexity equal to llama.cpp's golden values
at every chunk, with flash attention (llama.cpp's default, ppl_gemma3_wiki_c512_ch20.txt)
and without (..._fa_off.txt); peak RSS of the perplexity CLI under 1 GB (weights used in
place from the memory map); greedy continuations identical to llama-completion's
(tests/data/llama_cpp_gemma3_greedy.json, recorded by tests/record_gemma3_greedy.py).

The model is chaotic to rounding: a change of one float32 ulp in the embeddings moves a
20-chunk perplexity by about 0.1 % and greedy text apart within tens of tokens, so these
checks pass only with ggml's own rounding everywhere (ggmlpy/backend/cpu/simd.py).
"""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from spm_reference import SpmReference

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from peak_rss import peak_rss_mb  # noqa: E402  (bench/: the same measure as the bench scripts')

import llamapy
from conftest import REPO_ROOT, shared_path, tool_process
from ggmlpy import GGMLType
from llamapy.gguf_file import GGUFFile
from llamapy.vocab import Vocab

N_EMBD, N_HEAD, N_HEAD_KV, HEAD_DIM, N_FF, N_LAYER, N_SWA = 16, 2, 1, 8, 24, 6, 4
VOCAB = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"t{i}" for i in range(28)]


def write_tiny_gemma3(path: Path, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(128)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_sliding_window(N_SWA)
    w.add_tokenizer_model("llama")
    w.add_token_list(VOCAB)
    w.add_token_scores([0.0] * len(VOCAB))
    w.add_token_types([3, 3, 3, 2] + [1] * (len(VOCAB) - 4))
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)

    def t(name, *shape, scale=0.3, offset=0.0):
        w.add_tensor(name, (offset + scale * rng.standard_normal(shape[::-1])).astype(np.float32))

    t("token_embd.weight", N_EMBD, len(VOCAB))
    t("output_norm.weight", N_EMBD, offset=1.0)
    for il in range(N_LAYER):
        p = f"blk.{il}."
        t(p + "attn_norm.weight", N_EMBD, offset=1.0)
        t(p + "attn_q.weight", N_EMBD, N_HEAD * HEAD_DIM)
        t(p + "attn_k.weight", N_EMBD, N_HEAD_KV * HEAD_DIM)
        t(p + "attn_v.weight", N_EMBD, N_HEAD_KV * HEAD_DIM)
        t(p + "attn_q_norm.weight", HEAD_DIM, offset=1.0)
        t(p + "attn_k_norm.weight", HEAD_DIM, offset=1.0)
        t(p + "attn_output.weight", N_HEAD * HEAD_DIM, N_EMBD)
        t(p + "post_attention_norm.weight", N_EMBD, offset=1.0)
        t(p + "ffn_norm.weight", N_EMBD, offset=1.0)
        t(p + "ffn_gate.weight", N_EMBD, N_FF)
        t(p + "ffn_up.weight", N_EMBD, N_FF)
        t(p + "ffn_down.weight", N_FF, N_EMBD)
        t(p + "post_ffw_norm.weight", N_EMBD, offset=1.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def rms_norm(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope_neox(x, pos, base):
    """Rotate pairs (i, i + d/2) by pos * base^(-2i/d) (GPT-NeoX layout)."""
    d = x.shape[-1]
    theta = pos[:, None] * base ** (-2.0 * np.arange(d // 2) / d)
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    a, b = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


def gelu_tanh(x):
    """tanh GELU as ggml-cpu computes it (GGML_GELU_FP16): between -10 and 10, from a table
    of halves (x rounded to half, the result rounded to half)."""
    h = x.astype(np.float16).astype(np.float64)
    table = (0.5 * h * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (h + 0.044715 * h ** 3)))).astype(np.float16)
    return np.where(x <= -10.0, 0.0, np.where(x >= 10.0, x, table.astype(np.float64)))


def reference_logits(model, tokens):
    """Gemma 3 as the Hugging Face / gemma_pytorch papers describe it, in float64 (GELU
    rounded to halves, as ggml computes it)."""
    W = {name: t.numpy().astype(np.float64) for name, t in model.tensors.items()}
    n = len(tokens)
    pos = np.arange(n, dtype=np.float64)
    x = W["token_embd.weight"][tokens] * np.sqrt(N_EMBD)
    for il in range(N_LAYER):
        p = f"blk.{il}."
        local = il % 6 != 5
        base = 10000.0 if local else 1e6
        visible = np.tril(np.ones((n, n), dtype=bool))
        if local:
            visible &= (pos[:, None] - pos[None, :]) < N_SWA
        h = rms_norm(x, W[p + "attn_norm.weight"])
        q = (h @ W[p + "attn_q.weight"].T).reshape(n, N_HEAD, HEAD_DIM)
        k = (h @ W[p + "attn_k.weight"].T).reshape(n, N_HEAD_KV, HEAD_DIM)
        v = (h @ W[p + "attn_v.weight"].T).reshape(n, N_HEAD_KV, HEAD_DIM)
        q = rope_neox(rms_norm(q, W[p + "attn_q_norm.weight"]), pos, base)
        k = rope_neox(rms_norm(k, W[p + "attn_k_norm.weight"]), pos, base)
        out = np.empty((n, N_HEAD, HEAD_DIM))
        for head in range(N_HEAD):
            kvh = head // (N_HEAD // N_HEAD_KV)
            s = np.where(visible, q[:, head] @ k[:, kvh].T / np.sqrt(HEAD_DIM), -np.inf)
            pr = np.exp(s - s.max(-1, keepdims=True))
            out[:, head] = (pr / pr.sum(-1, keepdims=True)) @ v[:, kvh]
        a = rms_norm(out.reshape(n, -1) @ W[p + "attn_output.weight"].T, W[p + "post_attention_norm.weight"])
        x = x + a
        h = rms_norm(x, W[p + "ffn_norm.weight"])
        f = (gelu_tanh(h @ W[p + "ffn_gate.weight"].T) * (h @ W[p + "ffn_up.weight"].T)) @ W[p + "ffn_down.weight"].T
        x = x + rms_norm(f, W[p + "post_ffw_norm.weight"])
    return rms_norm(x, W["output_norm.weight"]) @ W["token_embd.weight"].T


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    return llamapy.load_model(write_tiny_gemma3(tmp_path_factory.mktemp("gemma3") / "tiny-gemma3.gguf"))


def test_tiny_gemma3_hparams(tiny_gemma3):
    hp = tiny_gemma3.hparams
    assert hp.arch == "gemma3" and hp.n_embd_head_k == HEAD_DIM and hp.n_swa == N_SWA
    assert hp.swa_layers == [True] * 5 + [False]
    assert hp.rope_base_of(0) == 10000.0 and hp.rope_base_of(5) == 1e6
    assert hp.f_attention_scale == pytest.approx(1 / np.sqrt(HEAD_DIM))
    assert tiny_gemma3.output_weight is tiny_gemma3.tensors["token_embd.weight"]


@pytest.mark.parametrize("flash_attn, rel", [(True, 2e-3), (False, 2e-4)])
@pytest.mark.parametrize("n_ubatch", [16, 5])
def test_tiny_gemma3_matches_reference(tiny_gemma3, flash_attn, rel, n_ubatch):
    """16 tokens with a window of 4, in one ubatch or several (the window cache then
    reuses cells whose positions fell out of every window). Flash attention reads the F32
    cache as F16, as llama.cpp's does (about 2^-11 relative per key and value)."""
    tokens = list(np.random.default_rng(1).integers(4, len(VOCAB), 16))
    ref = reference_logits(tiny_gemma3, tokens)
    ctx = llamapy.Context(tiny_gemma3, n_ctx=64, n_batch=64, n_ubatch=n_ubatch, type_k=GGMLType.F32,
                          type_v=GGMLType.F32, flash_attn=flash_attn)
    swa_cache = ctx.kv.caches[1]
    assert swa_cache.n_swa == N_SWA and swa_cache.layers == [0, 1, 2, 3, 4]
    ctx.decode(llamapy.Batch.from_tokens(tokens, all_outputs=True))
    ours = ctx.get_logits().astype(np.float64)
    np.testing.assert_allclose(ours, ref, atol=rel * np.abs(ref).max())


def test_tiny_gemma3_token_by_token_in_a_small_window_cache(tiny_gemma3):
    """Decoding one token at a time through a window cache of few cells gives the same logits."""
    tokens = list(np.random.default_rng(2).integers(4, len(VOCAB), 40))
    ref = reference_logits(tiny_gemma3, tokens)
    ctx = llamapy.Context(tiny_gemma3, n_ctx=64, n_batch=64, n_ubatch=1, type_k=GGMLType.F32, type_v=GGMLType.F32,
                          flash_attn=False)
    for i, tok in enumerate(tokens):
        ctx.decode(llamapy.Batch.from_tokens([tok], pos0=i))
        np.testing.assert_allclose(ctx.get_logits()[0], ref[i], atol=2e-4 * np.abs(ref).max())
    assert ctx.kv.caches[1].seq_pos_min(0) <= len(tokens) - N_SWA  # the window is still there


# ---- the real model (slow) --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma3_file(gemma3_path):
    t0 = time.perf_counter()
    f = GGUFFile(gemma3_path)
    vocab = Vocab.from_gguf(f)
    return f, vocab, time.perf_counter() - t0


@pytest.mark.slow
def test_gemma3_loads_quickly(gemma3_file):
    f, vocab, seconds = gemma3_file
    assert vocab.n_tokens == 262144 and f.get("general.architecture") == "gemma3"
    assert seconds < 10, f"metadata and vocabulary took {seconds:.1f} s"


@pytest.mark.slow
def test_gemma3_tokenizer_matches_llama_cpp_algorithm(gemma3_file):
    """sentencepiece (as llamapy.vocab uses it) against llama.cpp's SPM merge loop, around
    the same partition of user-defined tokens (newlines, runs of spaces and tabs), on the
    first 10,000 characters of wiki.test.raw and llama.cpp's SPM vocab test texts."""
    f, vocab, _ = gemma3_file
    ref = SpmReference(f.metadata["tokenizer.ggml.tokens"].value, f.metadata["tokenizer.ggml.scores"].value.tolist())
    texts = [shared_path("data", "wiki.test.raw").read_text(encoding="utf-8")[:10000]]
    raw = shared_path("data", "vocab", "ggml-vocab-llama-spm.gguf.inp").read_text(encoding="utf-8")
    texts += raw.split("\n__ggml_vocab_test__\n")
    texts += ["> </", "\t\tx  y\n\n\nz", "日本語のテキスト 🦙", "<start_of_turn>user\nhi<end_of_turn>"]
    ours = [vocab.tokenize(t, add_special=False) for t in texts]
    encode = vocab._encode
    try:
        vocab._encode = ref.encode_fragment
        theirs = [vocab.tokenize(t, add_special=False) for t in texts]
    finally:
        vocab._encode = encode
    for text, a, b in zip(texts, ours, theirs):
        assert a == b, f"{text[:40]!r}: {a[:20]} != {b[:20]}"
    assert vocab.tokenize("Hello")[0] == vocab.bos_id == 2 and vocab.add_bos
    assert vocab.tokenize(" \n = Robert", add_special=False) == [236743, 107, 578, 9877]


def golden_running(path: Path) -> list[float]:
    return [float(v) for v in re.findall(r"\[\d+\]([0-9.]+)", path.read_text())]


CHUNKS = 2


@pytest.mark.slow
@pytest.mark.parametrize("flash_attn, golden_file", [("on", "ppl_gemma3_wiki_c512_ch20.txt"),
                                                     ("off", "ppl_gemma3_wiki_c512_ch20_fa_off.txt")])
def test_gemma3_perplexity_matches_llama_cpp(gemma3_path, flash_attn, golden_file):
    """The CLI's running values as llama.cpp prints them (4 decimals), peak RSS under 1 GB: the
    first 2 of llama.cpp's 20 chunks (each chunk's estimate depends only on the chunks before it)."""
    golden = golden_running(shared_path("golden", golden_file))[:CHUNKS]
    wiki = shared_path("data", "wiki.test.raw")
    t0 = time.perf_counter()
    # the peak of the command's own processes (this test process's RUSAGE_CHILDREN would
    # also hold every earlier child's, e.g. compile-ahead forks of a large test process)
    run, peak_mb = peak_rss_mb([sys.executable, "-m", "llamapy.cli.perplexity", "-m", str(gemma3_path), "-f", str(wiki),
                                "-c", "512", "-b", "512", "--chunks", str(CHUNKS), "-fa", flash_attn, "-t", "2"], REPO_ROOT)
    seconds = time.perf_counter() - t0
    assert run.returncode == 0, run.stderr
    ours = [float(v) for v in re.findall(r"\[\d+\]([0-9.]+)", run.stdout)]
    assert len(ours) == len(golden) == CHUNKS
    print(f"\ngemma3 ppl -fa {flash_attn}: {seconds:.0f} s, final {ours[-1]:.4f} vs {golden[-1]:.4f}, "
          f"peak RSS {peak_mb:.0f} MB")
    assert ours == golden, list(zip(ours, golden))
    assert 0 < peak_mb < 1024, f"peak RSS {peak_mb:.0f} MB"


GREEDY = json.loads((REPO_ROOT / "tests" / "data" / "llama_cpp_gemma3_greedy.json").read_text(encoding="utf-8"))


@pytest.mark.slow
@pytest.mark.parametrize("run", GREEDY["runs"][:1], ids=lambda r: r["prompt"][:16])
def test_gemma3_greedy_matches_llama_cpp(gemma3_path, run):
    """llamapy-cli's greedy text (prompt and its first 24 tokens) starts llama-completion's
    (flash attention, F16 cache: both tools' defaults). The CLI's own path on one prompt: all
    64 tokens of every recorded prompt are generate()'s (test_generate.py) and the server's
    (test_server.py, two slots, streamed and not)."""
    proc = tool_process("cli", "-m", str(gemma3_path), "-p", run["prompt"], "-n", "24", "--temp", "0", "-s", "1",
                        "-t", "2")  # in this process: a start-up saved
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout.rstrip("\n")
    assert len(text) > len(run["prompt"]) + 40 and run["text"].startswith(text)


@pytest.mark.slow
def test_gemma3_lora_window_loss_does_not_depend_on_n_ubatch(gemma3_path):
    """The first window's training loss (LoRA rank 4, -c 64) at n_ubatch 16, 32 and 64: the
    products, softmax and norms round every token the same whatever ubatch it is in (main
    before the ggml-order kernels: 3.6832 at 16 against 3.6969 at 32 and 64; with BLAS tiles
    of 32 rows, on an AVX2 host's OpenBLAS: 3.6756 at 16 against 3.6716)."""
    from llamapy.dataset import token_windows
    from llamapy.defaults import demo_corpus
    from llamapy.train_params import TrainParams
    model = llamapy.load_model(gemma3_path)
    ds = token_windows(model.vocab.tokenize(demo_corpus()[:16000]), 64)
    losses = {}
    for n_ubatch in (16, 32, 64):
        ctx = llamapy.Context(model, n_ctx=64, n_batch=64, n_ubatch=n_ubatch, n_threads=2)
        ctx.opt_init(TrainParams.for_model(model, lora_rank=4))
        losses[n_ubatch] = float(np.mean(ctx.trainer.window(ds.data[0], ds.labels[0], True, None)))
    assert losses[16] == pytest.approx(losses[64], rel=1e-6) and losses[32] == pytest.approx(losses[64], rel=1e-6), losses
