"""Compute plans cannot go stale: rebinding a tensor, replacing a model weight, attaching or
detaching an adapter or training the weights after a decode gives the logits a fresh
context computes, with nothing cleared by hand."""
from __future__ import annotations

import numpy as np
import pytest

import ggmlpy as gg
import llamapy
from llamapy.dataset import token_windows
from llamapy.lora import LoraAdapter
from llamapy.train_params import SGD, LRSchedule, TrainParams

N_CTX = 64


@pytest.fixture()
def model(stories_path):
    return llamapy.load_model(stories_path)


@pytest.fixture(scope="module")
def tokens(stories_path, wiki_path):
    return llamapy.load_model(stories_path).vocab.tokenize(wiki_path.read_text()[:3000])


def logits(ctx, tokens) -> np.ndarray:
    ctx.memory_clear()
    ctx.decode(llamapy.Batch.from_tokens(tokens[:16], all_outputs=True))
    return ctx.get_logits().copy()


def fresh(model, tokens, adapters=()) -> np.ndarray:
    ctx = llamapy.Context(model, n_ctx=N_CTX, n_threads=1)
    for adapter, scale in adapters:
        ctx.attach_lora(adapter, scale)
    return logits(ctx, tokens)


def test_rebinding_a_graph_input_after_compute():
    ctx = gg.Context()
    x = ctx.from_numpy(np.arange(4, dtype=np.float32))
    y = gg.scale(ctx, x, 2.0).set_output()
    graph = gg.new_graph(y)
    backend = gg.CpuBackend()
    gg.compute(graph, backend)
    plan = backend.plan(graph)
    x.bind(np.full(4, 5, np.float32).view(np.uint8))
    backend.compute(graph)
    assert y.numpy().tolist() == [10.0] * 4
    assert backend.plan(graph) is not plan
    assert backend.plan(graph) is backend.plan(graph)  # and is reused from then on


def test_ropes_sharing_input_positions_follow_them_from_run_to_run():
    """Two ropes read one positions input, whose table the plan compares once per run: new
    positions written between runs give the rotation of a fresh graph, in both ropes."""
    rng = np.random.default_rng(0)
    values = rng.standard_normal((3, 2, 8)).astype(np.float32)  # [n_tokens, n_head, head_dim]

    def build():
        ctx = gg.Context()
        pos = ctx.new_tensor_1d(gg.GGMLType.I32, 3, "pos").set_input()
        a, b = ctx.from_numpy(values), ctx.from_numpy(values * 2)
        outs = [gg.rope_ext(ctx, t, pos, None, 8, 0, 128, 10000.0, 1.0).set_output() for t in (a, b)]
        graph = gg.Graph()
        for o in outs:
            graph.visit(o)
        return graph, pos, outs

    graph, pos, outs = build()
    backend = gg.CpuBackend(1)
    gg.GraphAllocator().alloc_graph(graph)
    for positions in ([0, 1, 2], [7, 9, 30], [7, 9, 31]):
        pos.array().reshape(-1)[:] = positions
        backend.compute(graph)
        fresh_graph, fresh_pos, fresh_outs = build()
        gg.GraphAllocator().alloc_graph(fresh_graph)
        fresh_pos.array().reshape(-1)[:] = positions
        gg.CpuBackend(1).compute(fresh_graph)
        for got, want in zip(outs, fresh_outs):
            np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_rebound_and_replaced_weights_after_a_decode(model, tokens):
    ctx = llamapy.Context(model, n_ctx=N_CTX, n_threads=1)
    before = logits(ctx, tokens)
    w = model.tensors["blk.1.ffn_up.weight"]
    values = np.array(w.array()) * np.float32(1.5)
    w.bind(values.reshape(-1).view(np.uint8))  # the same tensor on new memory
    rebound = logits(ctx, tokens)
    assert not np.allclose(rebound, before)
    np.testing.assert_array_equal(rebound, fresh(model, tokens))
    replacement = gg.Context().from_numpy(values[0, 0] * np.float32(2.0))
    model.set_tensor("blk.1.ffn_up.weight", replacement)  # another tensor in its place
    replaced = logits(ctx, tokens)
    assert not np.allclose(replaced, rebound)
    np.testing.assert_array_equal(replaced, fresh(model, tokens))


def test_attach_and_detach_an_adapter_after_a_decode(model, tokens):
    ctx = llamapy.Context(model, n_ctx=N_CTX, n_threads=1)
    base = logits(ctx, tokens)
    adapter = LoraAdapter.new(model, rank=2, modules=["attn_q", "ffn_down"], seed=1)
    for a, b in adapter.tensors.values():
        b.set(np.random.default_rng(2).standard_normal(b.nelements()) * 0.05)
    ctx.attach_lora(adapter, 0.5)
    adapted = logits(ctx, tokens)
    assert not np.allclose(adapted, base)
    np.testing.assert_array_equal(adapted, fresh(model, tokens, [(adapter, 0.5)]))
    ctx.attach_lora(adapter, 1.0)  # a new scale
    np.testing.assert_array_equal(logits(ctx, tokens), fresh(model, tokens, [(adapter, 1.0)]))
    ctx.detach_lora(adapter)
    np.testing.assert_array_equal(logits(ctx, tokens), base)


def test_decode_after_training_the_weights(model, tokens):
    """opt_init moves the memory-mapped weights to writable memory and training changes
    them: the context's inference graphs follow."""
    ctx = llamapy.Context(model, n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, n_threads=1)
    before = logits(ctx, tokens)
    ctx.opt_init(TrainParams(optimizer=SGD(), schedule=LRSchedule(lr0=0.05)))
    ctx.opt_epoch(token_windows(tokens, N_CTX), idata_split=1)
    after = logits(ctx, tokens)
    assert not np.allclose(after, before)
    np.testing.assert_array_equal(after, fresh(model, tokens))


def test_a_decode_step_on_a_long_cache_never_wakes_a_second_thread(model):
    """A one-token step of stories260K is far below a thread's worth of work in every op;
    SET_ROWS into a 4096-cell cache used to be judged by the whole cache it returns and
    switched numba to two threads (and back) twice a layer."""
    from ggmlpy.backend.cpu.plan import dispatch
    ctx = llamapy.Context(model, n_ctx=4096, n_threads=2)
    ctx.decode(llamapy.Batch.from_tokens([1, 2, 3]))
    ctx.decode(llamapy.Batch.from_tokens([4], pos0=3))
    (builder, _), = [g for key, g in ctx._graphs.items() if key[0].n_tokens == 1]
    steps = ctx.backend.plan(builder.graph).steps
    assert sum(name == "SET_ROWS" for name, _, _ in steps) == 2 * model.hparams.n_layer
    assert [name for name, _, parallel in steps if parallel] == []
    c = gg.Context()
    cache = c.new_tensor_2d(gg.GGMLType.F16, 64, 1 << 16)
    rows = gg.set_rows(c, cache, c.new_tensor_2d(gg.GGMLType.F32, 64, 1), c.new_tensor_1d(gg.GGMLType.I64, 1))
    assert not dispatch.parallel(rows)


@pytest.mark.parametrize("n_head, head_dim, n_kv, parallel", [(32, 64, 768, True), (8, 8, 256, False)])
def test_a_decode_steps_attention_is_judged_by_the_cache_it_reads(n_head, head_dim, n_kv, parallel):
    """One query row a head is a small result, but the step reads every cell of the cache:
    a 1.5B model's decode after a long prompt is worth both threads (it ran on one), a
    stories260K step is not."""
    from ggmlpy.backend.cpu.plan import dispatch
    c = gg.Context()
    q = c.new_tensor_4d(gg.GGMLType.F32, head_dim, 1, n_head, 1)
    k = c.new_tensor_4d(gg.GGMLType.F16, head_dim, n_kv, n_head // 4, 1)
    v = c.new_tensor_4d(gg.GGMLType.F16, head_dim, n_kv, n_head // 4, 1)
    mask = c.new_tensor_4d(gg.GGMLType.F32, n_kv, 1, 1, 1)
    assert dispatch.parallel(gg.flash_attn_ext(c, q, k, v, mask, 0.125, 0.0, 0.0)) == parallel
