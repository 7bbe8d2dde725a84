"""ggmlpy.opt, mirroring ggml's test-opt: regression fits, gradient accumulation, shuffling,
result statistics, an MLP trained with opt_fit, and the optimizer's memory."""
from __future__ import annotations

import io
import math

import numpy as np
import pytest

import ggmlpy as gg
from ggmlpy import opt

A_TRUE, B_TRUE = 1.2, 3.4


def regression_dataset(ndata: int = 256, seed: int = 0) -> tuple[opt.Dataset, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1.0, 1.0, ndata).astype(np.float32)
    y = (A_TRUE * x + B_TRUE + rng.normal(0.0, 0.05, ndata)).astype(np.float32)
    ds = opt.Dataset(1, 1, ndata)
    ds.data[:, 0], ds.labels[:, 0] = x, y
    return ds, x, y


def regression_model(batch: int):
    ctx = gg.Context()
    a = ctx.from_numpy(np.array([0.0], np.float32), name="a").set_param()
    b = ctx.from_numpy(np.array([0.0], np.float32), name="b").set_param()
    x = ctx.new_tensor_2d(gg.GGMLType.F32, 1, batch, "x")
    f = gg.add(ctx, gg.mul(ctx, x, a), b)
    return ctx, x, f, a, b


@pytest.mark.parametrize("optimizer,alpha", [(opt.AdamW, 0.05), (opt.SGD, 0.2)])
def test_linear_regression_reaches_least_squares_solution(optimizer, alpha):
    ds, x, y = regression_dataset()
    slope, intercept = np.polyfit(x.astype(np.float64), y.astype(np.float64), 1)
    ctx, inputs, outputs, a, b = regression_model(batch=32)
    opt.opt_fit(ctx, inputs, outputs, ds, opt.LossType.MEAN_SQUARED_ERROR, optimizer(alpha=alpha), nepoch=60,
                silent=True, seed=1)
    assert abs(a.numpy()[0] - slope) < 5e-3 and abs(b.numpy()[0] - intercept) < 5e-3, (a.numpy(), b.numpy(), slope, intercept)


def mlp(batch: int, n_in: int, n_hidden: int, n_out: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    ctx = gg.Context()
    w1 = ctx.from_numpy(rng.normal(0, 1 / math.sqrt(n_in), (n_hidden, n_in)).astype(np.float32), name="w1").set_param()
    b1 = ctx.from_numpy(np.zeros(n_hidden, np.float32), name="b1").set_param()
    w2 = ctx.from_numpy(rng.normal(0, 1 / math.sqrt(n_hidden), (n_out, n_hidden)).astype(np.float32), name="w2").set_param()
    b2 = ctx.from_numpy(np.zeros(n_out, np.float32), name="b2").set_param()
    x = ctx.new_tensor_2d(gg.GGMLType.F32, n_in, batch, "x")
    h = gg.silu(ctx, gg.add(ctx, gg.mul_mat(ctx, w1, x), b1))
    logits = gg.add(ctx, gg.mul_mat(ctx, w2, h), b2)
    return ctx, x, logits, [w1, b1, w2, b2]


def xor_blobs(ndata: int, seed: int = 0) -> opt.Dataset:
    """4 gaussian blobs at the corners of a square, labelled XOR-wise: not linearly separable."""
    rng = np.random.default_rng(seed)
    corner = rng.integers(0, 4, ndata)
    centres = np.array([[-1, -1], [1, 1], [-1, 1], [1, -1]], np.float32)
    points = centres[corner] + rng.normal(0, 0.25, (ndata, 2))
    ds = opt.Dataset(2, 2, ndata)
    ds.data[:] = points
    ds.labels[np.arange(ndata), (corner >= 2).astype(int)] = 1.0
    return ds


def test_mlp_fit_reaches_95_percent_validation_accuracy_and_prints_progress():
    ds = xor_blobs(2000)
    ctx, inputs, outputs, _ = mlp(batch=50, n_in=2, n_hidden=16, n_out=2)
    stream = io.StringIO()
    history = opt.opt_fit(ctx, inputs, outputs, ds, opt.LossType.CROSS_ENTROPY, opt.AdamW(alpha=0.02),
                          nepoch=6, val_split=0.1, seed=3, stream=stream)
    acc, _ = history[-1].val.accuracy()
    assert acc > 0.95
    assert history[-1].val.loss()[0] < history[0].val.loss()[0]
    text = stream.getvalue()
    assert "opt_fit: epoch 0006/0006:" in text and "opt_fit: training took" in text
    lines = [line for part in text.split("\n") for line in part.split("\r") if line.startswith("train: [")]
    last = lines[-1]
    assert last.startswith("train: [███████▉] data=0001800/0001800 loss=")  # ggml never fills the last eighth
    assert "acc=" in last and " t=00:00:" in last and "ETA=00:00:00" in last


def _fit_steps(batch: int, opt_period: int, ndata: int = 256):
    ds = xor_blobs(ndata, seed=5)
    ctx, inputs, outputs, params = mlp(batch, 2, 8, 2, seed=7)
    opt_ctx = opt.OptContext(opt.OptParams(ctx, inputs, outputs, opt.LossType.CROSS_ENTROPY, opt.AdamW(),
                                           opt_period=opt_period))
    result = opt.Result()
    opt.opt_epoch(opt_ctx, ds, result, None, -1)
    return [p.numpy() for p in params], result, opt_ctx


def test_gradient_accumulation_equals_one_larger_batch():
    big, result_big, ctx_big = _fit_steps(batch=128, opt_period=1)
    small, result_small, ctx_small = _fit_steps(batch=32, opt_period=4)
    assert ctx_big.iter == ctx_small.iter == 3  # two optimizer steps each
    for p_big, p_small in zip(big, small):
        np.testing.assert_allclose(p_small, p_big, rtol=2e-5, atol=1e-6)
    assert result_big.loss()[0] == pytest.approx(result_small.loss()[0], rel=1e-5)


def test_shuffle_is_reproducible_from_the_seed():
    def order(seed, idata=-1):
        ds = opt.Dataset(1, 0, 64, ndata_shard=2)
        ds.shuffle(np.random.default_rng(seed), idata)
        return ds.permutation.copy()
    assert np.array_equal(order(7), order(7))
    assert not np.array_equal(order(7), order(8))
    part = order(7, idata=32)
    assert sorted(part[:16]) == list(range(16)) and list(part[16:]) == list(range(16, 32))


def test_get_batch_copies_whole_shards_in_permuted_order():
    ds = opt.Dataset(3, 1, 8, ndata_shard=2)
    ds.data[:] = np.arange(24).reshape(8, 3)
    ds.labels[:, 0] = np.arange(8)
    ds.permutation[:] = [3, 0, 2, 1]
    ctx = gg.Context(no_alloc=False)
    data, labels = ctx.new_tensor_2d(gg.GGMLType.F32, 3, 4), ctx.new_tensor_2d(gg.GGMLType.F32, 1, 4)
    ds.get_batch(data, labels, 1)
    assert labels.numpy().reshape(-1).tolist() == [4, 5, 2, 3]


def test_result_statistics_match_numpy():
    _, result, _ = _fit_steps(batch=16, opt_period=1)
    losses = np.asarray(result.losses, dtype=np.float64)
    loss, unc = result.loss()
    assert loss == pytest.approx(losses.mean(), rel=1e-12)
    assert unc == pytest.approx(losses.std(ddof=1) / math.sqrt(len(losses)), rel=1e-9)
    acc, acc_unc = result.accuracy()
    assert result.ndata == 256 and len(result.preds) == 256
    assert acc == result.ncorrect / 256
    assert acc_unc == pytest.approx(math.sqrt(acc * (1 - acc) / 255), rel=1e-12)
    summed = opt.Result()
    summed.losses, summed.ndata = [1.0, 2.0, 4.0], 3
    assert summed.loss()[0] == 7.0 and summed.loss()[1] == pytest.approx(np.std([1, 2, 4], ddof=1) * math.sqrt(3))


def test_result_weighs_batches_by_their_counted_datapoints():
    """Batches whose ignored datapoints were left out count what they counted: the loss is
    the mean over all counted datapoints; a pass saved without counts reads as equal ones."""
    r = opt.Result()
    r.add_batch(3, 1.0, [0, 1, 2], 2, True)
    r.add_batch(1, 5.0, [4], 1, True)
    assert r.loss()[0] == 2.0 and r.ndata == 4 and r.accuracy()[0] == 0.75
    other = opt.Result()
    other.add_batch(4, 2.0, [0, 0, 0, 0], 0, True)
    r.extend(other)
    assert r.counts == [3, 1, 4] and r.loss()[0] == 2.0
    back = opt.Result.from_dict(r.to_dict())
    assert back.counts == r.counts and back.loss() == r.loss()
    legacy = {k: v for k, v in r.to_dict().items() if k != "counts"}
    assert opt.Result.from_dict(legacy).loss()[0] == pytest.approx(np.mean([1.0, 5.0, 2.0]))


def _state_tensors(opt_ctx: opt.OptContext) -> list[gg.Tensor]:
    """Tensors with memory of their own that the optimizer created, beside the gradient
    accumulators every optimizer has and its step's hyper-parameters."""
    o = opt_ctx.optimizer
    skip = {id(t) for t in o.grad_accs.values()} | {id(o.step_params)}
    arena = opt_ctx.static.allocator.arena
    return [t for t in o.memory.tensors if t.has_data and t.view_src is None and t.op == gg.Op.NONE
            and id(t) not in skip and t.buffer is not arena]


@pytest.mark.parametrize("optimizer", [opt.SGD(), opt.AdamW()])
def test_optimizer_state_memory(optimizer):
    ctx, inputs, outputs, params = mlp(batch=8, n_in=4, n_hidden=6, n_out=3)
    opt_ctx = opt.OptContext(opt.OptParams(ctx, inputs, outputs, opt.LossType.CROSS_ENTROPY, optimizer))
    state = _state_tensors(opt_ctx)
    if optimizer.kind == "sgd":
        assert state == [] and opt_ctx.optimizer_state() == []
    else:
        assert len(state) == 2 * len(params)
        for p in params:
            shaped = [t for t in state if t.ne == p.ne and p.name in t.name]
            assert len(shaped) == 2 and all(t.nbytes() == p.nbytes() for t in shaped)
    assert opt_ctx.static.allocator.peak_bytes > 0


def test_backward_graph_reuses_memory_and_keeps_param_gradients():
    ctx, inputs, outputs, params = mlp(batch=64, n_in=32, n_hidden=64, n_out=10)
    opt_ctx = opt.OptContext(opt.OptParams(ctx, inputs, outputs, opt.LossType.SUM, build_type=opt.BuildType.GRAD))
    graph = opt_ctx.static.backward
    allocator = opt_ctx.static.allocator
    planned = sum(t.nbytes() for t in graph.nodes if t.view_src is None and t.buffer is allocator.arena)
    assert allocator.peak_bytes < planned  # lifetimes overlap less than everything at once
    inputs.set(np.random.default_rng(0).standard_normal((64, 32)))
    opt_ctx.alloc(backward=True)
    opt_ctx.eval(None)
    grads = {p.name: opt_ctx.grad_acc(p).numpy() for p in params}
    # the gradients of a SUM loss w.r.t. the output bias is the batch size for every class
    np.testing.assert_allclose(grads["b2"], np.full(10, 64.0), rtol=1e-6)
    assert all(np.isfinite(g).all() and np.abs(g).sum() > 0 for g in grads.values())


def test_optimizer_state_saved_and_loaded_continues_exactly():
    """Two steps, save the state, two more; a fresh optimizer loaded with the saved state and
    params takes the same two steps bit for bit (what resuming from a checkpoint needs)."""
    ds = xor_blobs(128, seed=2)

    def context():
        ctx, inputs, outputs, params = mlp(batch=32, n_in=2, n_hidden=8, n_out=2, seed=1)
        oc = opt.OptContext(opt.OptParams(ctx, inputs, outputs, opt.LossType.CROSS_ENTROPY, opt.AdamW(alpha=0.01)))
        return oc, params

    def two_steps(oc, first):
        for ibatch in (first, first + 1):
            oc.zero_grad()
            oc.alloc(backward=True)
            ds.get_batch(oc.inputs, oc.labels, ibatch)
            oc.eval(None)
            oc.step()

    a, params_a = context()
    two_steps(a, 0)
    saved_state = a.optimizer.state.to_arrays()
    saved_params = [p.numpy().copy() for p in params_a]
    two_steps(a, 2)

    b, params_b = context()
    for p, values in zip(params_b, saved_params):
        p.set(values)
    b.optimizer.state.load_arrays(saved_state)
    assert b.iter == 3
    two_steps(b, 2)
    for pa, pb in zip(params_a, params_b):
        assert np.array_equal(pa.numpy(), pb.numpy())
    with pytest.raises(ValueError, match="does not match"):
        b.optimizer.state.load_arrays({k: v for k, v in saved_state.items() if ".m." not in k})


def test_non_finite_loss_refuses_the_step_and_restores_the_last_good_weights():
    ds, _, _ = regression_dataset(96)
    ctx, inputs, outputs, a, b = regression_model(batch=32)
    oc = opt.OptContext(opt.OptParams(ctx, inputs, outputs, opt.LossType.MEAN_SQUARED_ERROR, opt.SGD(alpha=0.1),
                                      keep_last_good=True))
    weights = []
    ds.labels[64:] = np.inf  # the third batch's loss is not finite
    for ibatch in range(3):
        weights.append((a.numpy().copy(), b.numpy().copy()))
        oc.zero_grad()
        oc.alloc(backward=True)
        ds.get_batch(oc.inputs, oc.labels, ibatch)
        oc.eval(None)
        if ibatch < 2:
            oc.step()
    with pytest.raises(opt.TrainingDivergedError, match="loss became inf at optimizer step 3"):
        oc.step()
    assert oc.iter == 3  # the step was refused
    # back to the weights before step 2: step 2 made the weights whose loss was not finite
    assert np.array_equal(a.numpy(), weights[1][0]) and np.array_equal(b.numpy(), weights[1][1])


def test_optimizer_hyper_parameters_are_validated_once():
    with pytest.raises(ValueError):
        opt.AdamW(beta1=1.5)
    with pytest.raises(ValueError):
        opt.SGD(alpha=-1.0)
    assert opt.with_alpha(opt.AdamW(wd=0.1), 0.5) == opt.AdamW(alpha=0.5, wd=0.1)


class CountingBackend:
    """A backend of its own: the CPU's computations, counted (any Backend will do for opt)."""

    name = "counting"
    bf16_dot_products = False

    def __init__(self) -> None:
        self.cpu, self.calls = gg.CpuBackend(1), []
        self.n_threads = self.cpu.n_threads

    def set_n_threads(self, n_threads: int) -> None:
        self.cpu.set_n_threads(n_threads)

    def plan(self, graph):
        return self.cpu.plan(graph)

    def compute(self, graph) -> None:
        self.calls.append("compute")
        self.cpu.compute(graph)

    def sum_squares(self, array) -> float:
        self.calls.append("sum_squares")
        return self.cpu.sum_squares(array)

    def scale(self, array, factor: float) -> None:
        self.calls.append("scale")
        self.cpu.scale(array, factor)


def test_the_optimizer_runs_on_any_backend_and_imports_no_concrete_one():
    import subprocess
    import sys
    from ggmlpy.backend import Backend
    assert isinstance(gg.CpuBackend(1), Backend) and isinstance(CountingBackend(), Backend)
    ds, _, _ = regression_dataset(64)
    ctx, inputs, outputs, a, _ = regression_model(batch=32)
    backend = CountingBackend()
    oc = opt.OptContext(opt.OptParams(ctx, inputs, outputs, opt.LossType.MEAN_SQUARED_ERROR, opt.SGD(alpha=0.1),
                                      grad_clip=1e-3, backend=backend))
    opt.opt_epoch(oc, ds, opt.Result(), None, -1)
    assert oc.iter == 3 and backend.calls.count("sum_squares") == 2 and "scale" in backend.calls
    loaded = subprocess.run([sys.executable, "-c", "import sys, ggmlpy.opt; print('ggmlpy.backend.cpu' in sys.modules)"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "False"
