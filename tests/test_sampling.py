"""Sampling: each sampler against a plain numpy rendering of llama.cpp's semantics, chains,
backend sampling (the same tokens as the CPU chain, only tokens leaving the graph),
multi-sequence batches and state save/restore, and llama.cpp's greedy golden output."""
from __future__ import annotations

import numpy as np
import pytest

from llamapy import Batch, Context, load_model
from llamapy.errors import InputError
from llamapy.generate import Generator
from llamapy.sampling import (Candidates, Dist, Greedy, LogitBias, MinP, Penalties, SamplerChain, StdRng, Temp,
                              TempExt, TopK, TopP, Typical, default_chain)

from conftest import shared_path


# ---- references: llama.cpp's samplers in plain numpy (float64) ------------------------------------
def softmax64(x):
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def ref_top_k(x, k):
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))
    return order[:k]


def ref_top_p(x, p, min_keep=1):
    order = ref_top_k(x, len(x))
    probs = softmax64(np.asarray(x)[order])
    cum = np.cumsum(probs)
    for i in range(len(order)):
        if cum[i] >= p and i + 1 >= min_keep:
            return order[:i + 1]
    return order


def ref_min_p(x, p):
    probs = softmax64(x)
    return [i for i in range(len(x)) if probs[i] >= p * probs.max()]


def ref_typical(x, p, min_keep=1):
    order = ref_top_k(x, len(x))
    probs = softmax64(np.asarray(x)[order])
    ent = -(probs * np.log(probs)).sum()
    shifted = np.abs(-np.log(probs) - ent)
    idx = np.argsort(shifted, kind="stable")
    cum = 0.0
    for i, j in enumerate(idx):
        cum += probs[j]
        if cum > p and i >= min_keep - 1:
            return [order[j] for j in idx[:i + 1]]
    return [order[j] for j in idx]


def random_logits(seed, n=200, scale=3.0):
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


def apply(sampler, x):
    cur = Candidates.from_logits(x)
    sampler.apply(cur)
    return cur


SEEDS = range(5)


# ---- single samplers ----------------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
def test_greedy(seed):
    x = random_logits(seed)
    assert apply(Greedy(), x).token == int(np.argmax(x))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("k", [1, 5, 40, 1000, 0])
def test_top_k(seed, k):
    x = random_logits(seed)
    cur = apply(TopK(k), x)
    if k <= 0:
        assert list(cur.ids) == list(range(len(x))) and not cur.sorted
    else:
        assert list(cur.ids) == ref_top_k(x, min(k, len(x))) and cur.sorted


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("p,min_keep", [(0.5, 1), (0.9, 1), (0.95, 3), (0.01, 5), (1.0, 1)])
def test_top_p(seed, p, min_keep):
    x = random_logits(seed)
    cur = apply(TopP(p, min_keep), x)
    if p >= 1.0:
        assert len(cur) == len(x)
    else:
        assert list(cur.ids) == ref_top_p(x, p, min_keep)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("p", [0.05, 0.2, 0.9])
def test_min_p(seed, p):
    x = random_logits(seed)
    assert sorted(apply(MinP(p), x).ids) == ref_min_p(x, p)
    cur = Candidates.from_logits(x)
    TopK(50).apply(cur)  # the sorted path keeps the same set, in order
    MinP(p).apply(cur)
    assert list(cur.ids) == [i for i in ref_top_k(x, 50) if i in ref_min_p(x, p)]


def test_min_p_min_keep_falls_back_to_sorted():
    x = np.array([5.0, 0.0, 4.0, -1.0], dtype=np.float32)
    assert list(apply(MinP(0.9, min_keep=3), x).ids) == [0, 2, 1]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("p", [0.3, 0.9])
def test_typical(seed, p):
    x = random_logits(seed, scale=1.5)
    assert list(apply(Typical(p), x).ids) == ref_typical(x, p)


@pytest.mark.parametrize("seed", SEEDS)
def test_temp(seed):
    x = random_logits(seed)
    np.testing.assert_array_equal(apply(Temp(0.7), x).logits, x / np.float32(0.7))
    cold = apply(Temp(0.0), x).logits
    assert np.isfinite(cold).sum() == 1 and np.argmax(cold) == np.argmax(x)


@pytest.mark.parametrize("seed", SEEDS)
def test_temp_ext(seed):
    x = random_logits(seed, n=50, scale=1.0)
    np.testing.assert_array_equal(apply(TempExt(0.7, 0.0), x).logits, x / np.float32(0.7))
    t, delta, expo = 1.0, 0.5, 1.3
    probs = softmax64(x)
    ent = -(probs * np.log(probs)).sum()
    dyn = (t - delta) + 2 * delta * (ent / np.log(len(x))) ** expo
    cur = apply(TempExt(t, delta, expo), x)
    np.testing.assert_allclose(cur.logits, np.sort(x)[::-1] / dyn, rtol=1e-5)
    np.testing.assert_allclose(cur.p, softmax64(np.sort(x)[::-1] / dyn), rtol=1e-5, atol=1e-7)


def test_penalties_window_and_formula():
    x = np.array([2.0, -1.0, 0.5, 3.0, 1.0], dtype=np.float32)
    pen = Penalties(last_n=3, repeat=1.5, freq=0.25, present=0.5)
    for t in (0, 3, 1, 1):  # the window keeps the last 3: 3, 1, 1 (token 0 has left it)
        pen.accept(t)
    got = apply(pen, x).logits
    counts = np.array([0, 2, 0, 1, 0])
    x64 = x.astype(np.float64)
    ref = np.where(counts > 0, np.where(x64 <= 0, x64 * 1.5, x64 / 1.5) - counts * 0.25 - (counts > 0) * 0.5, x64)
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    pen.reset()
    np.testing.assert_array_equal(apply(pen, x).logits, x)
    assert np.array_equal(apply(Penalties(0, 2.0), x).logits, x)  # last_n 0: disabled


def test_logit_bias():
    x = random_logits(0, n=10)
    cur = apply(LogitBias(10, {3: 5.0, 7: -np.inf}), x)
    ref = x.copy()
    ref[3] += 5
    ref[7] = -np.inf
    np.testing.assert_array_equal(cur.logits, ref)


def test_std_mt19937_and_uniform():
    r = StdRng(5489)  # std::mt19937's default seed: its first outputs are well known
    assert (r.next_u32(), r.next_u32()) == (3499211612, 581869302)
    r1, r2 = StdRng(42), StdRng(42)
    lo, hi = r2.next_u32(), r2.next_u32()
    assert r1.uniform() == (lo + hi * 2.0 ** 32) / 2.0 ** 64  # generate_canonical<double, 53>


@pytest.mark.parametrize("seed", SEEDS)
def test_dist_draw(seed):
    x = random_logits(seed, n=30, scale=1.0)
    d = Dist(seed)
    u = StdRng(seed).uniform()
    cur = apply(d, x)
    cdf = np.cumsum(softmax64(x))
    assert cur.token == int(np.searchsorted(cdf, u))
    np.testing.assert_allclose(cur.p, softmax64(x), rtol=1e-5)


def test_dist_frequencies():
    x = np.log(np.array([0.1, 0.6, 0.3], dtype=np.float32))
    d = Dist(3)
    counts = np.bincount([apply(d, x).token for _ in range(3000)], minlength=3) / 3000
    np.testing.assert_allclose(counts, [0.1, 0.6, 0.3], atol=0.03)


# ---- chains -----------------------------------------------------------------------------------------
def test_chain_composition_and_reset():
    x = random_logits(11, scale=1.0)
    chain = SamplerChain([TopK(20), TopP(0.8), Temp(0.5), Dist(7)])
    cur = Candidates.from_logits(x)
    chain.apply(cur)
    manual = Candidates.from_logits(x)
    for s in (TopK(20), TopP(0.8), Temp(0.5), Dist(7)):
        s.apply(manual)
    assert cur.token == manual.token and list(cur.ids) == list(manual.ids)
    chain.reset()  # the draw above is forgotten: the RNG starts again from its seed
    tokens = [chain.sample_logits(x) for _ in range(20)]
    assert tokens[0] == cur.token
    chain.reset()
    assert [chain.sample_logits(x) for _ in range(20)] == tokens
    assert chain.n_sample == 40


def test_chain_accept_feeds_penalties():
    x = np.zeros(5, dtype=np.float32)
    x[2] = 1.0
    chain = SamplerChain([Penalties(64, repeat=1.0, present=2.0), Greedy()])
    assert [chain.sample_logits(x) for _ in range(3)] == [2, 0, 1]


def test_chain_without_selection_fails_clearly():
    with pytest.raises(InputError, match="selected no token"):
        SamplerChain([TopK(3)]).sample_logits(random_logits(0))


def test_backend_prefix_rule():
    assert SamplerChain([TopK(40), TopP(0.9), Temp(0.8), Dist(1)]).backend_prefix() == 4
    assert SamplerChain([TopK(40), Typical(0.9), Dist(1)]).backend_prefix() == 1  # typical: CPU only
    assert SamplerChain([TopK(40), Penalties(64, 1.1), Greedy()]).backend_prefix() == 1  # needs every token
    assert SamplerChain([Penalties(64, 1.1), TopK(40), Greedy()]).backend_prefix() == 3
    assert SamplerChain([Temp(0.0), Dist(1)]).backend_prefix() == 0
    assert SamplerChain([TempExt(1.0, 0.5), Dist(1)]).backend_prefix() == 0
    assert SamplerChain([Greedy(), Dist(1)]).backend_prefix() == 1  # nothing after a selection


def test_default_chain_order():
    assert repr(default_chain(100, seed=1)) == "top-k -> top-p -> min-p -> temp -> dist"
    assert repr(default_chain(100, temp=0, repeat_penalty=1.1)) == "penalties -> greedy"


# ---- with the model ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(stories_path):
    return load_model(stories_path)


def generate(model, chain, n, prompt="Once upon a time", backend=False, ctx=None):
    """The prompt's tokens, n tokens sampled with `chain` (llamapy's generation loop: the
    last one sampled, not decoded), and the context."""
    gen = Generator(ctx or Context(model, n_ctx=256, n_threads=1), chain, backend_sampling=backend)
    toks = gen.tokenize(prompt)
    gen.feed(toks)
    for _ in gen.stream(n):
        pass
    assert len(gen.tokens) == n, gen.finish_reason  # no end of text in these short runs
    return toks, gen.tokens, gen.ctx


@pytest.mark.parametrize("backend", [False, True])
def test_greedy_golden(model, backend):
    golden = shared_path("golden", "greedy_stories260K.txt").read_text(encoding="utf-8").rstrip("\n")
    toks, out, _ = generate(model, SamplerChain([Greedy()]), 64, backend=backend)
    assert model.vocab.detokenize(toks + out) == golden


CHAINS = {
    "topk-topp-temp-dist": lambda seed: SamplerChain([TopK(40), TopP(0.9), Temp(0.8), Dist(seed)]),
    "minp-temp-dist": lambda seed: SamplerChain([MinP(0.05), Temp(1.2), Dist(seed)]),
    "penalties-greedy": lambda seed: SamplerChain([Penalties(64, 1.3, 0.1, 0.1), Greedy()]),
}


def graph_outputs(ctx):
    """The tensors flagged as outputs in the graphs that sampled."""
    outs = []
    for builder, _ in ctx._graphs.values():
        if builder.shape.samplers:
            outs += [t for t in builder.graph.nodes + builder.graph.leafs if t.flags & 2]
    return outs


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("name", list(CHAINS))
def test_backend_equals_cpu(model, name, seed):
    _, cpu, _ = generate(model, CHAINS[name](seed), 16, "Once upon a time there was a dog", backend=False)
    chain = CHAINS[name](seed)
    assert chain.backend_prefix() == len(chain)
    _, gpu, ctx = generate(model, chain, 16, "Once upon a time there was a dog", backend=True)
    assert gpu == cpu
    outs = graph_outputs(ctx)
    assert outs and all(t.nelements() == 1 and t.type.name == "I32" for t in outs), outs
    with pytest.raises(InputError, match="sampled in the graph"):
        ctx.get_logits_ith(-1)


def test_backend_candidates_then_cpu(model):
    """A prefix that does not select: a short candidate list leaves the graph, the CPU finishes."""
    mk = lambda: SamplerChain([TopK(8), Typical(0.95), Temp(1.5), Dist(5)])  # noqa: E731
    _, cpu, _ = generate(model, mk(), 12, backend=False)
    chain = mk()
    _, gpu, ctx = generate(model, chain, 12, backend=True)
    assert gpu == cpu
    for shape, (builder, _) in ctx._graphs.items():
        outs = [t for t in builder.graph.nodes + builder.graph.leafs if t.flags & 2]
        assert sorted(t.name.split(".")[-1] for t in outs) == ["ids", "logits", "probs"]
        assert all(t.nelements() == 8 for t in outs)
    got = ctx.get_sampled_ith(-1)
    np.testing.assert_allclose(got.probs.sum(), 1.0, rtol=1e-5)


def test_backend_multi_sequence_rows(model):
    """Different chains for different sequences in one batch: each row samples its own way."""
    ctx = Context(model, n_ctx=512, n_seq_max=2, n_threads=1)
    chains = [SamplerChain([Greedy()]), SamplerChain([TopK(40), Temp(1.0), Dist(9)])]
    ref = [generate(model, CHAINS_ALONE(), 10)[1] for CHAINS_ALONE in
           (lambda: SamplerChain([Greedy()]), lambda: SamplerChain([TopK(40), Temp(1.0), Dist(9)]))]
    for s, c in enumerate(chains):
        ctx.set_sampler(s, c)
    toks = model.vocab.tokenize("Once upon a time", add_special=True)
    n = len(toks)
    ctx.decode(Batch(np.array(toks * 2), np.tile(np.arange(n), 2), np.repeat([0, 1], n),
                     np.array(([False] * (n - 1) + [True]) * 2)))
    out = [[], []]
    idx = [n - 1, 2 * n - 1]
    for step in range(10):
        nxt = [chains[s].sample(ctx, idx[s]) for s in range(2)]
        for s in range(2):
            out[s].append(nxt[s])
        ctx.decode(Batch(np.array(nxt), np.array([n + step] * 2), np.array([0, 1]), np.array([True, True])))
        idx = [0, 1]
    assert out == ref


PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the", "One day"]


def alone(model, prompt, n):
    return generate(model, SamplerChain([Greedy()]), n, prompt)[1]


@pytest.mark.parametrize("unified", [False, True])
def test_multi_sequence_batch_equals_alone(model, unified):
    n_gen, rm_at, rm_seq = 16, 6, 2
    ref = [alone(model, p, n_gen) for p in PROMPTS]
    ctx = Context(model, n_ctx=1024, n_seq_max=4, kv_unified=unified, n_threads=1)
    toks = [model.vocab.tokenize(p, add_special=True) for p in PROMPTS]
    batch = Batch(np.concatenate(toks), np.concatenate([np.arange(len(t)) for t in toks]),
                  np.concatenate([[s] * len(t) for s, t in enumerate(toks)]),
                  np.concatenate([[False] * (len(t) - 1) + [True] for t in toks]))
    ctx.decode(batch)
    live = [0, 1, 2, 3]
    rows = list(np.cumsum([len(t) for t in toks]) - 1)
    out = [[] for _ in PROMPTS]
    for step in range(n_gen):
        nxt = {s: int(np.argmax(ctx.get_logits_ith(int(r)))) for s, r in zip(live, rows)}
        for s, t in nxt.items():
            out[s].append(t)
        if step == rm_at:
            ctx.memory_seq_rm(rm_seq)  # drop one sequence mid-way: the others must not notice
            assert ctx.memory_seq_pos_max(rm_seq) == -1
            live = [s for s in live if s != rm_seq]
        ctx.decode(Batch(np.array([nxt[s] for s in live]), np.array([len(toks[s]) + step for s in live]),
                         np.array(live), np.ones(len(live), dtype=bool)))
        rows = list(range(len(live)))
    for s in range(4):
        expect = ref[s][:rm_at + 1] if s == rm_seq else ref[s]
        assert out[s] == expect, s


def test_seq_state_restore_continues(model, tmp_path):
    """Save sequence 0 after 20 generated tokens; a fresh context restored from it (bytes or
    file) continues with the same next 20 tokens: a Generator told what the cache holds
    decodes only the 20th token, then samples."""
    chain_a = SamplerChain([TopK(40), Temp(1.0), Dist(4)])
    toks, first, ctx = generate(model, chain_a, 20)  # the 20th sampled, not decoded: KV holds the rest
    held = toks + first[:-1]
    data = ctx.state_seq_get_data(0)
    ctx.state_seq_save_file(tmp_path / "seq.bin", 0, held)
    chain_b, chain_c = chain_a.clone(), chain_a.clone()  # the sampler state (RNG) continues in each

    def cont(ctx, chain, cached):
        assert ctx.memory_seq_pos_max(0) == len(held) - 1
        gen = Generator(ctx, chain)
        gen.cached = list(cached)
        gen.feed(toks + first)
        assert gen.n_prompt == 1
        for _ in gen.stream(20):
            pass
        return gen.tokens

    expect = cont(ctx, chain_a, held)
    fresh = Context(model, n_ctx=256, n_threads=1)
    assert fresh.state_seq_set_data(0, data) == len(data)
    assert cont(fresh, chain_b, held) == expect
    fresh2 = Context(model, n_ctx=256, n_threads=1)
    assert fresh2.state_seq_load_file(tmp_path / "seq.bin", 0) == held
    assert cont(fresh2, chain_c, held) == expect


def test_seq_state_into_another_sequence(model):
    toks, first, ctx = generate(model, SamplerChain([Greedy()]), 10)
    data = ctx.state_seq_get_data(0)
    multi = Context(model, n_ctx=512, n_seq_max=2, n_threads=1)
    multi.state_seq_set_data(1, data)
    multi.decode(Batch.from_tokens([7], pos0=len(toks) + 9, seq_id=1))  # after the 9 decoded ones
    ctx.decode(Batch.from_tokens([7], pos0=len(toks) + 9))
    np.testing.assert_array_equal(multi.get_logits_ith(-1), ctx.get_logits_ith(-1))


def test_context_state_roundtrip(model, tmp_path):
    toks, first, ctx = generate(model, SamplerChain([Greedy()]), 10)
    logits = ctx.get_logits_ith(-1).copy()
    ctx.state_save_file(tmp_path / "ctx.bin", toks)
    other = Context(model, n_ctx=256, n_threads=1)
    assert other.state_load_file(tmp_path / "ctx.bin") == toks
    np.testing.assert_array_equal(other.get_logits_ith(-1), logits)
    for c in (ctx, other):
        c.memory_seq_rm(0, len(toks) + 8)  # recompute the last decoded position
    ctx.decode(Batch.from_tokens([5], pos0=len(toks) + 8))
    other.decode(Batch.from_tokens([5], pos0=len(toks) + 8))
    np.testing.assert_array_equal(ctx.get_logits_ith(-1), other.get_logits_ith(-1))


def test_state_errors(model, tiny_random_path):
    ctx = Context(model, n_ctx=256, n_threads=1)
    with pytest.raises(InputError, match="not a state"):
        ctx.state_seq_set_data(0, b"nonsense" * 4)
    other = Context(load_model(tiny_random_path), n_ctx=256, n_threads=1)
    with pytest.raises(InputError, match="different model"):
        ctx.state_seq_set_data(0, other.state_seq_get_data(0))


# ---- the CLI ------------------------------------------------------------------------------------------
def run_cli(*args: str):
    """llamapy-cli in this process (test_chat_cli.py and test_architectures.py run it as a child process)."""
    from conftest import tool_process
    return tool_process("cli", *args)


@pytest.mark.parametrize("bs", [[], ["-bs"]])
def test_cli_greedy_golden(stories_path, bs):
    golden = shared_path("golden", "greedy_stories260K.txt").read_text(encoding="utf-8").rstrip("\n")
    proc = run_cli("-m", str(stories_path), "-p", "Once upon a time", "-n", "64", "--temp", "0", "-s", "1", "-t", "1", *bs)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip("\n") == golden
    for what in ("prompt eval time", "eval time", "total time", "tokens per second"):
        assert what in proc.stderr


def test_cli_sampling_seeded_and_lora(stories_path, tmp_path):
    args = ("-m", str(stories_path), "-p", "Once upon a time", "-n", "24", "-s", "5", "--repeat-penalty", "1.1", "-t", "1")
    cpu, gpu = run_cli(*args), run_cli(*args, "-bs")
    assert cpu.returncode == gpu.returncode == 0
    assert cpu.stdout == gpu.stdout and len(cpu.stdout) > len(" Once upon a time")
    proc = run_cli("-m", str(stories_path), "-p", "x", "--lora", str(tmp_path / "missing.gguf"))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and "missing.gguf" in proc.stderr
    # an adapter with zero B (a fresh one) generates exactly what the base model does
    import llamapy
    from llamapy.lora import LoraAdapter
    adapter = LoraAdapter.new(llamapy.load_model(stories_path), rank=2).save(tmp_path / "zero.gguf")
    with_lora = run_cli(*args, "--lora-scaled", f"{adapter}:0.5")
    assert with_lora.returncode == 0 and with_lora.stdout == cpu.stdout
