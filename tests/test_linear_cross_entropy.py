"""ggmlpy's linear_cross_entropy (a linear layer fused with cross-entropy on label ids, a
chunk of classes at a time) against float64 numpy references and against the unfused
graph cross_entropy_loss(mul_mat(w, x), ids, weights) it replaces.

Small chunks and quantization tiles (monkeypatched) make every case cross several chunks
and end on a partial one; inputs come through non-contiguous views (test_ggml_ops' `make`);
weights are F32, F16, BF16 or quantized (used from their packed rows).
"""
from __future__ import annotations

import numpy as np
import pytest
from reference_graph import linear_cross_entropy_ref
from test_ggml_ops import decode, encode, make
from test_quants import quantized_weights, ref_round_activations

import ggmlpy as gg
from ggmlpy import GGMLType as T
from ggmlpy.backend.cpu.train import linear_ce
from ggmlpy.backend.cpu.products import qmatmul

TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_K, T.Q6_K]
RTOL = 2e-6


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of one tile: 32 classes (float weights) or 16 (quantized tiles of 16 rows)."""
    monkeypatch.setattr(linear_ce, "CHUNK_BYTES", 1)
    monkeypatch.setattr(qmatmul, "TILE_BYTES", 1)


def weight(ctx: gg.Context, rng, type: T, n_classes: int, k: int, layout: str = "contig") -> tuple[gg.Tensor, np.ndarray]:
    """(w [k, n_classes] of `type`, its float64 values (n_classes, k))."""
    if gg.traits(type).is_quantized:
        q, values = quantized_weights(rng, type, (n_classes, k))
        return ctx.from_numpy(q, type), values
    x = (rng.standard_normal((1, 1, n_classes, k)) * 0.3).astype(np.float32)
    return make(ctx, x, layout, type), decode(encode(x, type), type)[0, 0]


def rounded(x: np.ndarray, type: T) -> np.ndarray:
    """x (float32, rows of K) as the product with a `type` weight sees it, in float64."""
    if gg.traits(type).is_quantized:
        return ref_round_activations(x.reshape(-1, x.shape[-1]), type).reshape(x.shape).astype(np.float64)
    return decode(encode(x, type), type) if type in (T.F16, T.BF16) else x.astype(np.float64)


def labels(ctx: gg.Context, rng, rows: tuple[int, ...], n_classes: int):
    """ids (one ignored, -1) and weights (one zero) for x rows of numpy shape `rows`."""
    n = int(np.prod(rows))
    ids = rng.integers(0, n_classes, n).astype(np.int32)
    wts = rng.uniform(0.2, 2.5, n).astype(np.float32)
    ids[1], wts[2] = -1, 0.0
    ne = (1,) + rows  # numpy shape of ne = x.ne[1:] + (1,)
    return ctx.from_numpy(ids.reshape(ne), T.I32), ctx.from_numpy(wts.reshape(ne)), ids, wts


def k_for(type: T) -> int:
    return 2 * gg.traits(type).blck_size if gg.traits(type).blck_size == 256 else 96


@pytest.mark.parametrize("x_layout", ["contig", "perm", "trans", "pad"])
@pytest.mark.parametrize("type", TYPES, ids=lambda t: t.name)
def test_rows_against_float64_reference(small_chunks, type, x_layout):
    """Each row's loss, log-sum-exp and argmax, from 100 classes in chunks (the last partial)."""
    rng = np.random.default_rng(int(type) + 17)
    k, n_classes, rows = k_for(type), 100, (2, 3, 5)
    ctx = gg.Context()
    w, wv = weight(ctx, rng, type, n_classes, k, "pad" if type == T.F16 else "contig")
    x = (rng.standard_normal(rows + (k,)) * 2.0).astype(np.float32)
    ids, wts, idv, wtv = labels(ctx, rng, rows, n_classes)
    out = gg.linear_cross_entropy(ctx, w, make(ctx, x, x_layout), ids, wts)
    assert out.ne == (3, 5, 3, 2)
    gg.compute(gg.new_graph(out))
    got = np.ascontiguousarray(out.array()).reshape(-1, 3).astype(np.float64)
    xr = rounded(x, type).reshape(1, 1, -1, k)
    ref = linear_cross_entropy_ref(wv[None, None], xr, idv, wtv).reshape(-1, 3)
    logits = xr[0, 0] @ wv.T
    # float32 logits carry eps * (|x| . |w|) each; the row sums a float32 exp per class
    err = RTOL * (np.abs(ref[:, 1]) + (np.abs(xr[0, 0]) @ np.abs(wv).T).max(axis=1) + 1.0)
    np.testing.assert_array_less(np.abs(got[:, 1] - ref[:, 1]), err)
    np.testing.assert_array_less(np.abs(got[:, 0] - ref[:, 0]), 2 * err * np.maximum(wtv, 1.0))
    assert got[1, 0] == 0.0 and got[2, 0] == 0.0  # an ignored id and a zero weight count nothing
    top2 = np.sort(logits, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-4  # the argmax is exact where the best logit is clearly the best
    assert clear.sum() >= len(clear) - 1
    np.testing.assert_array_equal(got[clear, 2], ref[clear, 2])


def test_argmax_takes_the_first_of_equal_maxima_across_chunks(small_chunks):
    """Classes 5, 6, 40 and 77 (three chunks) have one weight row: the first wins, as np.argmax."""
    rng = np.random.default_rng(3)
    wv = (rng.standard_normal((100, 64)) * 0.1).astype(np.float32)
    wv[[6, 40, 77]] = wv[5] = np.abs(wv[5]) + 1.0
    x = np.abs(rng.standard_normal((4, 64))).astype(np.float32)
    ctx = gg.Context()
    ids, wts, _, _ = labels(ctx, rng, (4,), 100)
    out = gg.linear_cross_entropy(ctx, ctx.from_numpy(wv), ctx.from_numpy(x), ids, wts)
    gg.compute(gg.new_graph(out))
    np.testing.assert_array_equal(out.array()[0, 0, :, 2], [5, 5, 5, 5])


def test_a_label_beyond_the_classes_is_refused():
    ctx = gg.Context()
    w = ctx.from_numpy(np.ones((10, 32), np.float32))
    out = gg.linear_cross_entropy(ctx, w, ctx.from_numpy(np.ones((2, 32), np.float32)),
                                  ctx.from_numpy(np.array([[3, 10]], np.int32), T.I32),
                                  ctx.from_numpy(np.ones((1, 2), np.float32)))
    with pytest.raises(ValueError, match="label id 10 is not below 10 classes"):
        gg.compute(gg.new_graph(out))


def test_shapes_are_checked():
    ctx = gg.Context()
    w, x = ctx.new_tensor_2d(T.F32, 32, 10), ctx.new_tensor_2d(T.F32, 32, 4)
    ids, wts = ctx.new_tensor_1d(T.I32, 4), ctx.new_tensor_1d(T.F32, 4)
    with pytest.raises(ValueError, match="one \\[K, classes\\] matrix"):
        gg.linear_cross_entropy(ctx, ctx.new_tensor_2d(T.F32, 16, 10), x, ids, wts)
    with pytest.raises(ValueError, match="must have shape"):
        gg.linear_cross_entropy(ctx, w, x, ctx.new_tensor_1d(T.I32, 3), wts)
    with pytest.raises(ValueError, match="must have shape"):
        gg.linear_cross_entropy(ctx, w, x, wts, wts)


# ---- gradients ------------------------------------------------------------------------------------
def graph_with_gradients(ctx, w, x, ids, wts, fused: bool, field_weights: np.ndarray | None = None):
    """(loss, predictions, graph with the gradients of `w` and `x` where they are params):
    the mean loss of linear_cross_entropy_loss or of its unfused twin; with `field_weights`,
    the loss is sum(rows * field_weights) over every field of the rows instead."""
    if field_weights is not None:
        rows = gg.linear_cross_entropy(ctx, w, x, ids, wts)
        loss, pred = gg.sum(ctx, gg.mul(ctx, rows, ctx.from_numpy(field_weights))), None
    elif fused:
        loss, pred = gg.linear_cross_entropy_loss(ctx, w, x, ids, wts)
    else:
        logits = gg.mul_mat(ctx, w, x)
        loss, pred = gg.cross_entropy_loss(ctx, logits, ids, wts), gg.argmax(ctx, logits)
    loss = gg.scale(ctx, loss, -0.75).set_loss()  # a loss gradient that is not 1
    graph = gg.new_graph(loss, *([pred] if pred is not None else []))
    gg.build_backward_expand(ctx, graph)
    return loss, pred, graph


def logits_gradient(x, wv, type: T, field_weights, idv, wtv) -> tuple[np.ndarray, np.ndarray]:
    """(dz, its softmax part) in float64 for graph_with_gradients' loss with `field_weights`:
    dz = (g_lse + weights g_loss) softmax(z) - weights g_loss onehot(ids)."""
    z = rounded(x, type) @ wv.T
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    g = field_weights.astype(np.float64) * -0.75
    counted = (idv >= 0) & (wtv != 0)
    b = np.where(idv >= 0, wtv * g[:, 0], 0.0)
    soft = (g[:, 1] + b)[:, None] * p
    dz = soft.copy()
    dz[np.flatnonzero(counted), idv[counted]] -= b[counted]
    return dz, soft


@pytest.mark.parametrize("type", [T.F32, T.F16, T.Q8_0, T.Q4_K], ids=lambda t: t.name)
def test_gradients_against_float64_reference(small_chunks, type):
    """dz = (g_lse + weights g_loss) softmax(z) - weights g_loss onehot(ids) for any gradient
    of the rows' fields; dx = dz W (through the activation rounding) and dW = dz^T x."""
    rng = np.random.default_rng(int(type) + 5)
    k, n_classes, n = k_for(type), 70, 20  # 20 rows: more than the gemv kernels take (Q8_0: block sums)
    ctx = gg.Context()
    w, wv = weight(ctx, rng, type, n_classes, k)
    if type == T.F32:
        w.set_param()
    x = (rng.standard_normal((n, k)) * 2.0).astype(np.float32)
    xt = ctx.from_numpy(x).set_param()
    ids, wts, idv, wtv = labels(ctx, rng, (n,), n_classes)
    fw = rng.standard_normal((n, 3)).astype(np.float32)
    _, _, graph = graph_with_gradients(ctx, w, xt, ids, wts, True, fw)
    gg.compute(graph)
    dz, _ = logits_gradient(x, wv, type, fw, idv, wtv)
    got = graph.get_grad(xt).numpy().reshape(n, k)
    scale = (np.abs(dz) @ np.abs(wv)).max()
    np.testing.assert_allclose(got, dz @ wv, rtol=0, atol=4e-6 * scale)
    if type == T.F32:
        got_w = graph.get_grad(w).numpy().reshape(n_classes, k)
        np.testing.assert_allclose(got_w, dz.T @ x, rtol=0, atol=4e-6 * (np.abs(dz.T) @ np.abs(x)).max())


@pytest.mark.parametrize("chunked", [True, False], ids=["small_chunks", "default_chunks"])
@pytest.mark.parametrize("type", [T.F32, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
def test_equals_the_unfused_graph(monkeypatch, type, chunked):
    """Loss, predictions and gradients of linear_cross_entropy_loss against
    cross_entropy_loss(mul_mat(w, x)) + argmax, in a graph whose F32 products go through BLAS
    as training graphs' do: the same to float rounding (the logits are the same tile
    products; sums and exps differ in order only)."""
    if chunked:
        monkeypatch.setattr(linear_ce, "CHUNK_BYTES", 1)
        monkeypatch.setattr(qmatmul, "TILE_BYTES", 1)
    rng = np.random.default_rng(11)
    k, n_classes, n = k_for(type), 300, 12
    q_or_w = weight(gg.Context(), np.random.default_rng(2), type, n_classes, k)[0].array().copy()
    x = (rng.standard_normal((n, k)) * 3.0).astype(np.float32)
    results = []
    for fused in (True, False):
        ctx = gg.Context()
        w = ctx.from_numpy(q_or_w.reshape(q_or_w.shape[-2:]), type)
        if type == T.F32:
            w.set_param()
        xt = ctx.from_numpy(x).set_param()
        ids, wts, _, _ = labels(ctx, np.random.default_rng(8), (n,), n_classes)
        loss, pred, graph = graph_with_gradients(ctx, w, xt, ids, wts, fused)
        gg.set_blas_products(graph.nodes)  # F32 logits through BLAS, as in training graphs (opt.TrainGraph)
        gg.compute(graph)
        results.append((loss.numpy().item(), pred.numpy().reshape(-1).copy(), graph.get_grad(xt).numpy().copy(),
                        graph.get_grad(w).numpy().copy() if type == T.F32 else None))
    (lf, pf, dxf, dwf), (lu, pu, dxu, dwu) = results
    assert lf == pytest.approx(lu, rel=1e-6)
    np.testing.assert_array_equal(pf, pu)
    np.testing.assert_allclose(dxf, dxu, rtol=0, atol=1e-6 * np.abs(dxu).max())
    if dwf is not None:
        np.testing.assert_allclose(dwf, dwu, rtol=0, atol=1e-6 * np.abs(dwu).max())


def test_forward_alone_gives_the_training_graphs_rows(small_chunks):
    """The forward step also accumulates softmax(z) W when its graph takes the gradient in x:
    the rows it writes are the same to the bit either way."""
    rng = np.random.default_rng(6)
    ctx = gg.Context()
    w, _ = weight(ctx, rng, T.Q8_0, 90, 64)
    x = ctx.from_numpy((rng.standard_normal((7, 64))).astype(np.float32)).set_param()
    ids, wts, _, _ = labels(ctx, rng, (7,), 90)
    rows = gg.linear_cross_entropy(ctx, w, x, ids, wts)
    loss = gg.sum(ctx, gg.linear_cross_entropy_field(ctx, rows, gg.LCE_LOSS)).set_loss()
    forward = gg.new_graph(loss)
    training = forward.copy()
    gg.build_backward_expand(ctx, training)
    gg.compute(training)
    with_grad = rows.numpy().copy()
    rows.array()[...] = np.nan
    gg.compute(forward)
    assert rows.numpy().tobytes() == with_grad.tobytes()


def test_memory_is_a_chunk_not_the_logits(monkeypatch):
    """50,000 classes x 64 rows: the graph holds no tensor of classes x rows (forward and
    backward), and no scratch buffer of the backend is larger than a chunk's block."""
    monkeypatch.setattr(linear_ce, "CHUNK_BYTES", 1 << 18)
    rng = np.random.default_rng(1)
    n_classes, k, n = 50000, 64, 64
    ctx = gg.Context()
    w = ctx.from_numpy(gg.quants.quantize((rng.standard_normal((n_classes, k)) * 0.1).astype(np.float32), T.Q8_0),
                       T.Q8_0)
    x = ctx.from_numpy(rng.standard_normal((n, k)).astype(np.float32)).set_param()
    ids, wts, _, _ = labels(ctx, rng, (n,), n_classes)
    loss, pred, graph = graph_with_gradients(ctx, w, x, ids, wts, True)
    backend = gg.CpuBackend(1)
    gg.compute(graph, backend)
    assert max(t.nelements() for t in graph.nodes if t.op != gg.Op.NONE) < n_classes
    chunk = linear_ce.WeightRows(w).chunk(n)
    assert max(b.nbytes for b in backend.scratch._buffers.values()) <= 4 * chunk * max(n, k) < n_classes * n / 2


def test_a_small_output_layer_plans_no_more_than_its_classes():
    """512 classes (stories260K's vocabulary) x 128 rows, forward only (a validation pass):
    one chunk of the classes, and no scratch block sized for a larger vocabulary (it was
    8 MB here, made resident by numpy's huge pages)."""
    rng = np.random.default_rng(2)
    n_classes, k, n = 512, 64, 128
    ctx = gg.Context()
    w = ctx.from_numpy((rng.standard_normal((n_classes, k)) * 0.1).astype(np.float32))
    x = ctx.from_numpy(rng.standard_normal((n, k)).astype(np.float32))
    ids, wts, _, _ = labels(ctx, rng, (n,), n_classes)
    loss, pred = gg.linear_cross_entropy_loss(ctx, w, x, ids, wts)
    backend = gg.CpuBackend(1)
    gg.compute(gg.new_graph(loss, pred), backend)
    assert linear_ce.WeightRows(w).chunk(n) == n_classes  # whole tiles of 32, no more
    assert max(b.nbytes for b in backend.scratch._buffers.values()) <= 4 * n_classes * n


@pytest.mark.parametrize("type", [T.F32, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("n_ignored", [0, 5, 70, 100])
def test_skipping_ignored_rows_changes_nothing_else(small_chunks, type, n_ignored):
    """skip_ignored (a chat's masked prompt): the rows with a negative id are left out (the
    rest moved to a block of 32 rows or more), theirs are 0 and pass no gradient; the loss,
    the other rows' fields and predictions and the gradients in x and W are the plain node's:
    rows of the same bits for quantized weights (their products round each row alone), float
    rounding for F32 ones and for the gradient in x (BLAS sums a block of another row count
    in another order)."""
    rng = np.random.default_rng(int(type) + n_ignored)
    k, n_classes, n = k_for(type), 90, 100
    q_or_w = weight(gg.Context(), np.random.default_rng(3), type, n_classes, k)[0].array().copy()
    x = (rng.standard_normal((n, k)) * 2.0).astype(np.float32)
    idv = rng.integers(0, n_classes, n).astype(np.int32)
    idv[rng.permutation(n)[:n_ignored]] = -1
    wtv = np.where(idv >= 0, rng.uniform(0.2, 2.5, n), 0.0).astype(np.float32)
    runs = []
    for skip in (False, True):
        ctx = gg.Context()
        w = ctx.from_numpy(q_or_w.reshape(q_or_w.shape[-2:]), type)
        if type == T.F32:
            w.set_param()
        xt = ctx.from_numpy(x).set_param()
        ids, wts = ctx.from_numpy(idv.reshape(1, n), T.I32), ctx.from_numpy(wtv.reshape(1, n))
        rows = gg.linear_cross_entropy(ctx, w, xt, ids, wts, skip_ignored=skip)
        loss, pred = gg.linear_cross_entropy_loss(ctx, w, xt, ids, wts, skip_ignored=skip)
        loss = gg.scale(ctx, loss, -0.75).set_loss()
        graph = gg.new_graph(loss, pred, rows)
        gg.build_backward_expand(ctx, graph)
        gg.compute(graph)
        runs.append((loss.numpy().item(), pred.numpy().reshape(-1).copy(), rows.numpy().reshape(n, 3).copy(),
                     graph.get_grad(xt).numpy().reshape(n, k).copy(),
                     graph.get_grad(w).numpy().copy() if type == T.F32 else None))
    (l0, p0, r0, dx0, dw0), (l1, p1, r1, dx1, dw1) = runs
    live = idv >= 0
    assert l1 == pytest.approx(l0, rel=1e-6)
    np.testing.assert_array_equal(p1[live], p0[live])
    assert not p1[~live].any() and not r1[~live].any() and not dx1[~live].any()
    if type != T.F32:
        np.testing.assert_array_equal(r1[live], r0[live])
    np.testing.assert_allclose(r1[live], r0[live], rtol=3e-6, atol=1e-6)
    np.testing.assert_allclose(dx1, dx0, rtol=0, atol=3e-6 * np.abs(dx0).max())
    if dw0 is not None:
        np.testing.assert_allclose(dw1, dw0, rtol=0, atol=3e-6 * np.abs(dw0).max())
