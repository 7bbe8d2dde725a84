"""Gradient checkpointing in ggmlpy (recompute.py, build_backward_expand(checkpoints=)):
the same gradients, bit for bit, from a graph that keeps only the checkpoints and
recomputes the rest segment by segment; a smaller planned arena; the stride choice; the
refusals; and one arena shared by graphs computed in turn (GraphAllocator)."""
from __future__ import annotations

import numpy as np
import pytest

import ggmlpy as gg
from ggmlpy import GGMLType
from ggmlpy.recompute import estimated_peak

N_EMBD, N_HIDDEN, N_TOKENS, N_BLOCKS, N_CLASSES = 16, 64, 64, 6, 10


def residual_net(seed: int = 0, n_blocks: int = N_BLOCKS, n_classes: int = N_CLASSES):
    """A small network of the shape checkpointing is for: residual blocks (norm, attention
    by mul_mat and soft_max, a SiLU MLP, views), a head and a cross-entropy loss. Returns
    (ctx, loss, params, block inputs, logits)."""
    rng = np.random.default_rng(seed)
    ctx = gg.Context()

    def param(*shape, s=0.3):
        return ctx.from_numpy((rng.standard_normal(shape) * s).astype(np.float32)).set_param()
    x = ctx.from_numpy(rng.standard_normal((N_TOKENS, N_EMBD)).astype(np.float32)).set_input()
    params, boundaries, h = [], [], gg.scale(ctx, x, 1.0)
    for _ in range(n_blocks):
        boundaries.append(h)
        norm_w, wq, w1, w2 = param(N_EMBD), param(N_EMBD, N_EMBD), param(N_HIDDEN, N_EMBD), param(N_EMBD, N_HIDDEN)
        params += [norm_w, wq, w1, w2]
        a = gg.mul(ctx, gg.rms_norm(ctx, h, 1e-5), norm_w)
        q = gg.mul_mat(ctx, wq, a)                                  # [N_EMBD, N_TOKENS]
        att = gg.soft_max_ext(ctx, gg.mul_mat(ctx, a, q), None, 0.25)  # [N_TOKENS, N_TOKENS]
        mixed = gg.cont(ctx, gg.transpose(ctx, gg.mul_mat(ctx, gg.cont(ctx, gg.transpose(ctx, a)), att)))
        h = gg.add(ctx, h, gg.reshape(ctx, mixed, N_EMBD, N_TOKENS))
        up = gg.silu(ctx, gg.mul_mat(ctx, w1, h))
        h = gg.add(ctx, h, gg.mul_mat(ctx, w2, up))
    boundaries.append(h)
    head = param(n_classes, N_EMBD)
    params.append(head)
    logits = gg.mul_mat(ctx, head, gg.rms_norm(ctx, h, 1e-5))
    ids = ctx.from_numpy(rng.integers(0, n_classes, N_TOKENS).astype(np.int32)[None, :], GGMLType.I32).set_input()
    weights = ctx.from_numpy(np.ones((1, N_TOKENS), np.float32)).set_input()
    loss = gg.cross_entropy_loss(ctx, logits, ids, weights).set_loss()
    return ctx, loss, params, boundaries, logits


def gradients(checkpoints: str | None, every: int = 1) -> tuple[dict[int, np.ndarray], gg.Graph, gg.GraphAllocator]:
    """The param gradients of residual_net (by param index), its backward graph and allocator;
    `checkpoints` None (plain), "blocks" (every `every`-th block input) or "blocks+logits"."""
    ctx, loss, params, boundaries, logits = residual_net()
    graph = gg.new_graph(loss)
    chosen = None
    if checkpoints is not None:
        chosen = boundaries[::every] + ([logits] if checkpoints == "blocks+logits" else [])
    gg.build_backward_expand(ctx, graph, checkpoints=chosen)
    alloc = gg.GraphAllocator()
    alloc.alloc_graph(graph)
    gg.compute(graph)
    return {i: graph.get_grad(p).numpy().copy() for i, p in enumerate(params)}, graph, alloc


def recomputed(graph: gg.Graph) -> list[gg.Tensor]:
    return [n for n in graph.nodes if n.name.endswith("recomputed")]


@pytest.mark.parametrize("checkpoints, every", [("blocks", 1), ("blocks", 2), ("blocks", 4), ("blocks+logits", 1),
                                                 ("blocks+logits", 3)])
def test_checkpointed_gradients_equal_the_plain_ones_bit_for_bit(checkpoints, every):
    plain, plain_graph, plain_alloc = gradients(None)
    got, graph, alloc = gradients(checkpoints, every)
    assert not recomputed(plain_graph) and len(recomputed(graph)) > 10 * N_BLOCKS // every
    for i in plain:
        assert np.abs(plain[i]).max() > 0, i
        np.testing.assert_array_equal(got[i], plain[i], err_msg=f"param {i}")
    assert alloc.peak_bytes < plain_alloc.peak_bytes


def test_checkpoints_shrink_the_plan_to_about_one_segment():
    """Plain, every block's activations live until its backward; checkpointed, a block's
    are freed after the forward pass and recomputed (and held) one block at a time."""
    _, _, plain = gradients(None)
    _, _, every_block = gradients("blocks+logits", 1)
    attention = N_TOKENS * N_TOKENS * 4
    assert plain.peak_bytes > N_BLOCKS * 2 * attention  # scores and softmax of every block
    assert every_block.peak_bytes < plain.peak_bytes / 2


def test_recomputation_is_lazy_segment_by_segment():
    """A block's copies are computed after the gradients of every later block: each
    recomputed node comes after the backward of the blocks above it."""
    _, graph, _ = gradients("blocks", 1)
    order = {id(n): i for i, n in enumerate(graph.nodes)}
    n_forward = min(order[id(n)] for n in recomputed(graph))
    grads = [n for n in graph.nodes if n.name.endswith(" grad")]
    assert all(order[id(g)] > n_forward for g in grads)  # the whole forward pass first
    copies = recomputed(graph)
    # copies are made in runs (one per segment) separated by gradient work, not all at once
    runs = sum(1 for a, b in zip(graph.nodes[n_forward:], graph.nodes[n_forward + 1:])
               if not a.name.endswith("recomputed") and b.name.endswith("recomputed"))
    assert runs >= N_BLOCKS and order[id(copies[-1])] > order[id(grads[0])]


def test_a_checkpoint_must_be_a_node_of_the_graph():
    ctx, loss, params, boundaries, _ = residual_net()
    graph = gg.new_graph(loss)
    stray = gg.scale(ctx, boundaries[0], 2.0)
    with pytest.raises(ValueError, match="is not a node of the graph"):
        gg.build_backward_expand(ctx, graph, checkpoints=[stray.set_name("stray")])


def test_a_node_writing_into_another_tensor_is_not_recomputed():
    """cpy writes into its destination's bytes: recomputing it could clobber them at any
    time; the refusal names the node and says what to do."""
    ctx = gg.Context()
    w = ctx.from_numpy(np.ones((4, 4), np.float32)).set_param()
    x = ctx.from_numpy(np.arange(16, dtype=np.float32).reshape(4, 4)).set_input()
    dst = gg.scale(ctx, x, 0.0)
    copied = gg.cpy(ctx, gg.scale(ctx, x, 2.0), dst).set_name("copied")
    loss = gg.sum(ctx, gg.mul(ctx, gg.mul(ctx, copied, w), w)).set_loss()
    graph = gg.new_graph(loss)
    with pytest.raises(ValueError, match="cannot recompute CPY node 'copied'.*make that tensor a checkpoint"):
        gg.build_backward_expand(ctx, graph, checkpoints=[])


def test_stride_follows_the_sizes():
    """k = 1 when segments dwarf the boundaries; a head much larger than any segment makes
    keeping fewer boundaries free, and the estimate then takes a larger k."""
    _, loss, _, boundaries, _ = residual_net()
    graph = gg.new_graph(loss)
    assert gg.checkpoint_stride(graph, boundaries) == 1
    peaks = [estimated_peak(graph, boundaries, k) for k in range(1, len(boundaries) + 1)]
    assert peaks[0] == min(peaks) and peaks[-1] > peaks[0]
    _, loss, _, boundaries, _ = residual_net(n_classes=20_000)
    assert gg.checkpoint_stride(gg.new_graph(loss), boundaries) > 1
    with pytest.raises(ValueError, match="no boundary"):
        gg.checkpoint_stride(graph, [])


# ---- one arena for graphs computed in turn ---------------------------------------------------------
def test_graphs_sharing_an_allocator_share_one_arena_that_grows():
    """The second, larger graph grows the arena; the first moves into it and still computes."""
    rng = np.random.default_rng(1)
    ctx = gg.Context()
    results = []
    alloc = gg.GraphAllocator()
    for n in (8, 64):
        a = ctx.from_numpy(rng.standard_normal((n, n)).astype(np.float32))
        out = gg.sum(ctx, gg.mul_mat(ctx, gg.silu(ctx, gg.scale(ctx, a, 0.5)), a)).set_output()
        graph = gg.new_graph(out)
        alloc.alloc_graph(graph)
        results.append((graph, out, a.numpy()))
    small_peak = gg.GraphAllocator()
    small_peak.plan(results[0][0])
    assert alloc.arena.nbytes >= alloc.peak_bytes > small_peak.peak_bytes
    for graph, _, _ in results:
        assert all(t.buffer is alloc.arena for t in graph.nodes if t.op != gg.Op.NONE)
    backend = gg.CpuBackend(1)
    for graph, out, a in reversed(results):
        backend.compute(graph)
        h = 0.5 * a.astype(np.float64)
        expected = ((h / (1 + np.exp(-h))) @ a.astype(np.float64).T).sum()
        assert float(out.numpy().reshape(-1)[0]) == pytest.approx(expected, rel=1e-4)


def test_cross_entropy_gradient_is_written_over_the_logits():
    """The logits die at the loss gradient, which has their shape: it takes their bytes
    (the largest tensor of a language model's training graph), row by row correctly."""
    _, loss, _, _, logits = residual_net()
    gg.compute(gg.new_graph(loss))
    y = logits.numpy().astype(np.float64)  # [N_TOKENS, N_CLASSES]
    ids = loss.src[1].numpy().reshape(-1)
    ctx, loss, _, _, logits = residual_net()  # the same network, trained
    graph = gg.new_graph(loss)
    gg.build_backward_expand(ctx, graph)
    (back,) = [n for n in graph.nodes if n.op == gg.Op.CROSS_ENTROPY_LOSS_BACK]
    back.set_output()  # kept to be read after the compute
    alloc = gg.GraphAllocator()
    alloc.alloc_graph(graph)
    assert alloc.offsets[id(back)] == alloc.offsets[id(logits)]
    gg.compute(graph)
    p = np.exp(y - y.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(N_TOKENS), ids] -= 1.0
    np.testing.assert_allclose(back.numpy(), p / N_TOKENS, rtol=1e-5, atol=1e-7)
