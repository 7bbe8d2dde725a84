"""Steps fused when a plan is prepared (ggmlpy/backend/cpu/rows/fused.py): RMS_NORM then the MUL
by its weight in one call. The fused call must give the bits of the two kernels run one
after the other, write the norm's own result too (another graph may read it), and fuse only
what it can: a norm whose next step does not read it, or a layout the kernel does not take,
stays two steps."""
from __future__ import annotations

import numpy as np
import pytest

import ggmlpy as gg
from ggmlpy import GGMLType as T
from ggmlpy.backend.cpu.rows import fused
from ggmlpy.backend.cpu.rows import kernels as K


def norm_then_mul(rows: int, width: int, w_rows: int, weight_first: bool, extra: bool = False):
    rng = np.random.default_rng(rows * 1000 + width)
    c = gg.Context()
    x = c.from_numpy((rng.standard_normal((rows, width)) * 3).astype(np.float32), T.F32)
    w = c.from_numpy(rng.standard_normal((w_rows, width)).astype(np.float32), T.F32)
    nrm = gg.rms_norm(c, x, 1e-5).set_output()  # kept (else the MUL may take its memory)
    out = gg.mul(c, w, nrm) if weight_first else gg.mul(c, nrm, w)
    graph = gg.Graph()
    graph.visit(out.set_output())
    if extra:  # something else reads the norm too
        graph.visit(gg.scale(c, nrm, 2.0).set_output())
    return graph, x, w, nrm, out


@pytest.mark.parametrize("rows,width,w_rows,weight_first", [
    (1, 64, 1, False), (5, 7, 1, False), (3, 640, 1, False), (6, 2048, 1, False),  # a norm's weight row
    (4, 33, 4, False), (4, 33, 4, True)])  # a tensor of the same shape, on either side
def test_fused_norm_and_mul_give_the_two_kernels_bits(rows, width, w_rows, weight_first):
    graph, x, w, nrm, out = norm_then_mul(rows, width, w_rows, weight_first)
    backend = gg.CpuBackend(1)
    gg.compute(graph, backend)
    assert [name for name, _, _ in backend.plan(graph).steps] == ["RMS_NORM+MUL"]
    xv = x.numpy().reshape(1, 1, rows, width)
    want_norm = np.empty_like(xv)
    K.rms_norm_f32(xv, want_norm, np.float32(1e-5))
    wv = w.numpy().reshape(w_rows, width)
    want = np.empty((rows, width), np.float32)
    a, b = (np.tile(wv, (rows // w_rows, 1)), want_norm.reshape(rows, width)) if weight_first else \
        (want_norm.reshape(rows, width), wv)
    K.binary_rows_f32(a, b, want, K.OP_MUL)
    assert np.array_equal(nrm.numpy().reshape(rows, width), want_norm.reshape(rows, width))
    assert np.array_equal(out.numpy().reshape(rows, width), want)


def test_not_fused_when_the_next_step_does_not_read_the_norm_or_the_layout_differs():
    graph, x, w, nrm, out = norm_then_mul(4, 64, 1, False, extra=True)
    backend = gg.CpuBackend(1)
    gg.compute(graph, backend)
    names = [name for name, _, _ in backend.plan(graph).steps]
    assert "RMS_NORM+MUL" in names and "SCALE" in names  # the norm is still written: SCALE reads it
    np.testing.assert_array_equal(graph.nodes[-1].numpy(), 2 * nrm.numpy())
    # a MUL by a weight that is not a repeated row: numpy's broadcast, two steps
    c = gg.Context()
    x = c.from_numpy(np.ones((4, 8), np.float32), T.F32)
    col = c.from_numpy(np.full((4, 1), 2.0, np.float32), T.F32)
    out = gg.mul(c, gg.rms_norm(c, x, 1e-5), col)
    g2 = gg.new_graph(out)
    backend = gg.CpuBackend(1)
    gg.compute(g2, backend)
    assert [name for name, _, _ in backend.plan(g2).steps] == ["RMS_NORM", "MUL"]
    np.testing.assert_allclose(out.numpy(), 2.0, rtol=1e-5)
    assert fused.fuse([g2.nodes[-1], g2.nodes[-1]], 0, backend.plan(g2)) is None  # MUL then MUL: no fusion


@pytest.mark.parametrize("rows,b_rows", [(1, 1), (5, 5), (6, 1)])
def test_residual_add_norm_and_mul_in_one_call(rows, b_rows):
    """ADD, RMS_NORM of the sum, MUL by the weight: one call, every result written (the sum
    is the residual stream the next layer adds to) with the three kernels' bits."""
    rng = np.random.default_rng(rows)
    width = 64
    c = gg.Context()
    a = c.from_numpy(rng.standard_normal((rows, width)).astype(np.float32), T.F32)
    b = c.from_numpy(rng.standard_normal((b_rows, width)).astype(np.float32), T.F32)
    w = c.from_numpy(rng.standard_normal((1, width)).astype(np.float32), T.F32)
    summed = gg.add(c, a, b).set_output()
    nrm = gg.rms_norm(c, summed, 1e-6).set_output()
    out = gg.mul(c, nrm, w).set_output()
    graph = gg.new_graph(out)
    backend = gg.CpuBackend(1)
    gg.compute(graph, backend)
    assert [name for name, _, _ in backend.plan(graph).steps] == ["ADD+RMS_NORM+MUL"]
    av, bv, wv = (t.numpy().reshape(-1, width) for t in (a, b, w))
    want_sum = np.empty((rows, width), np.float32)
    K.binary_rows_f32(av, bv, want_sum, K.OP_ADD)
    want_norm = np.empty((1, 1, rows, width), np.float32)
    K.rms_norm_f32(want_sum.reshape(1, 1, rows, width), want_norm, np.float32(1e-6))
    want = np.empty((rows, width), np.float32)
    K.binary_rows_f32(want_norm.reshape(rows, width), wv, want, K.OP_MUL)
    for got, expect in ((summed, want_sum), (nrm, want_norm), (out, want)):
        assert np.array_equal(got.numpy().reshape(rows, width), expect.reshape(rows, width))


def test_a_decode_step_fuses_every_norm(monkeypatch, stories_path):
    """stories260K's one-token step: the first norm is RMS_NORM+MUL, every later one (after a
    residual ADD) ADD+RMS_NORM+MUL, and the logits are those of plans without fusions."""
    import llamapy
    from ggmlpy.backend.cpu.plan import dispatch
    model = llamapy.load_model(stories_path)
    n_layer = model.hparams.n_layer
    got = []
    for fusing in (True, False):
        if not fusing:
            monkeypatch.setattr(dispatch, "fuse", lambda nodes, i, plan: None)
        ctx = llamapy.Context(model, n_ctx=64, n_threads=1)
        ctx.decode(llamapy.Batch.from_tokens([1, 2, 3]))
        ctx.decode(llamapy.Batch.from_tokens([4], pos0=3))
        got.append(ctx.get_logits()[0].copy())
        (builder, _), = [g for key, g in ctx._graphs.items() if key[0].n_tokens == 1]
        names = [name for name, _, _ in ctx.backend.plan(builder.graph).steps]
        if fusing:
            assert names.count("RMS_NORM+MUL") == 1 and names.count("ADD+RMS_NORM+MUL") == 2 * n_layer
            assert "RMS_NORM" not in names
        else:
            assert names.count("RMS_NORM") == 2 * n_layer + 1
    assert np.array_equal(got[0], got[1])
