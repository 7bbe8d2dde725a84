"""Learning-rate schedules against their closed forms, and gradient clipping against a
float64 numpy norm and PyTorch's clip_grad_norm_ (reference values in tests/data)."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import ggmlpy as gg
from ggmlpy import CpuBackend, GGMLType
from ggmlpy.opt import SGD, Optimizer
from llamapy.train_params import LRSchedule, TrainParams

DATA = Path(__file__).parent / "data"


def test_constant_and_warmup():
    s = LRSchedule(lr0=1e-3, kind="constant", warmup=4)
    assert [s.lr_at(i, 10) for i in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert LRSchedule(lr0=2e-4, kind="constant").lr_at(999, 3) == 2e-4


def test_cosine_to_lr_min_over_the_run():
    lr0, lr_min, spe, epochs, warmup = 1e-3, 1e-5, 7, 3, 5
    s = LRSchedule(lr0=lr0, lr_min=lr_min, kind="cosine", epochs=epochs, warmup=warmup)
    total = spe * epochs
    for step in range(total + 3):
        if step < warmup:
            expect = lr0 * (step + 1) / warmup
        else:
            t = min(step - warmup, total - warmup)
            expect = lr_min + 0.5 * (lr0 - lr_min) * (1 + math.cos(math.pi * t / (total - warmup)))
        assert s.lr_at(step, spe) == pytest.approx(expect, rel=1e-12), step
    assert s.lr_at(warmup, spe) == pytest.approx(lr0)
    assert s.lr_at(total, spe) == pytest.approx(lr_min)


def test_cosine_restarts_every_n_epochs():
    lr0, spe, n = 1e-3, 4, 2
    s = LRSchedule(lr0=lr0, kind="cosine", epochs=6, cos_restart=n, warmup=2)
    period = n * spe
    for step in range(6 * spe):
        cycle, t = divmod(step, period)
        if step < 2:
            expect = lr0 * (step + 1) / 2
        elif cycle == 0:
            expect = 0.5 * lr0 * (1 + math.cos(math.pi * (t - 2) / (period - 2)))
        else:
            expect = 0.5 * lr0 * (1 + math.cos(math.pi * t / period))
        assert s.lr_at(step, spe) == pytest.approx(expect, rel=1e-12, abs=1e-18), step
    assert s.lr_at(period, spe) == pytest.approx(lr0)  # a restart begins at the top again


def test_existing_decays_are_per_epoch_closed_forms():
    spe = 5
    decay = LRSchedule(lr0=1e-3, lr_min=1e-5, epochs=4)
    for step in range(30):
        e = step // spe
        expect = 1e-5 if e >= 4 else 1e-3 * (1e-5 / 1e-3) ** (e / 4)
        assert decay.lr_at(step, spe) == pytest.approx(expect, rel=1e-12)
    halving = LRSchedule(lr0=1e-3, half_life=2, halvings=2, epochs=10)
    assert [halving.lr_at(e * spe, spe) for e in range(8)] == pytest.approx(
        [1e-3, 1e-3, 5e-4, 5e-4, 2.5e-4, 2.5e-4, 2.5e-4, 2.5e-4])
    warm = LRSchedule(lr0=1e-3, half_life=1, warmup=3, epochs=3)
    assert warm.lr_at(0, spe) == pytest.approx(1e-3 / 3) and warm.lr_at(spe, spe) == pytest.approx(5e-4)


@pytest.mark.parametrize("bad", [dict(kind="cosine", half_life=1.0), dict(kind="constant", cos_restart=2),
                                 dict(lr0=1e-4, lr_min=1e-3), dict(warmup=-1), dict(kind="linear")])
def test_contradictory_schedules_are_refused(bad):
    with pytest.raises(ValueError):
        LRSchedule(**bad)


def test_train_params_give_the_step_rate():
    p = TrainParams(schedule=LRSchedule(lr0=1e-3, kind="cosine", epochs=2, warmup=1), grad_clip=1.0)
    assert p.optimizer_params(0, 10).alpha == pytest.approx(1e-3)
    assert p.optimizer_params(20, 10).alpha < 1e-9 + 1e-18
    with pytest.raises(ValueError):
        TrainParams(grad_clip=0.0)


# ---- gradient clipping --------------------------------------------------------------------------
def _optimizer_with_grads(grads: list[np.ndarray], n_threads: int = 2) -> Optimizer:
    mem = gg.Context(no_alloc=False)
    params = []
    for i, g in enumerate(grads):
        p = mem.new_tensor(GGMLType.F32, tuple(reversed(g.shape)), f"p{i}")
        params.append(p)
    opt = Optimizer(params, SGD(), CpuBackend(n_threads))
    for p, g in zip(params, grads):
        opt.grad(p).set(g)
    return opt


def _grads(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((64, 33)).astype(np.float32) * 3,
            rng.standard_normal(70_001).astype(np.float32),  # more than one fixed-size chunk
            rng.standard_normal((5,)).astype(np.float32) * 100]


def test_grad_norm_is_float64_and_thread_independent():
    grads = _grads(0)
    expect = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads))
    norms = [_optimizer_with_grads(grads, n).grad_norm() for n in (1, 2)]
    assert norms[0] == norms[1]
    assert norms[0] == pytest.approx(expect, rel=1e-12)


@pytest.mark.parametrize("max_norm", [1.0, 50.0, 1e6])
def test_clip_grad_norm_scales_as_numpy(max_norm):
    grads = _grads(1)
    opt = _optimizer_with_grads(grads)
    norm = opt.clip_grad_norm(max_norm)
    factor = max_norm / (norm + 1e-6)
    for p, g in zip(opt.params, grads):
        expect = g * np.float32(factor) if factor < 1 else g
        np.testing.assert_array_equal(opt.grad(p).numpy().reshape(g.shape), expect)
    if factor < 1:
        assert opt.grad_norm() == pytest.approx(max_norm, rel=1e-5)


def test_clip_grad_norm_matches_pytorch():
    """tests/data/clip_grad_norm_torch.npz: gradients and what torch 2.13's
    torch.nn.utils.clip_grad_norm_ made of them (bench/torch_clip_reference.py)."""
    ref = np.load(DATA / "clip_grad_norm_torch.npz")
    n = int(ref["n"])
    grads = [ref[f"grad{i}"] for i in range(n)]
    for max_norm, total in zip(ref["max_norms"], ref["total_norms"]):
        opt = _optimizer_with_grads(grads)
        norm = opt.clip_grad_norm(float(max_norm))
        assert norm == pytest.approx(float(total), rel=1e-6)
        for i, p in enumerate(opt.params):
            np.testing.assert_allclose(opt.grad(p).numpy().reshape(grads[i].shape), ref[f"clipped{i}_{max_norm:g}"],
                                       rtol=2e-6, atol=0)
