"""The sampling ops of ggmlpy against plain numpy references, on contiguous and strided inputs."""
from __future__ import annotations

import numpy as np
import pytest

import ggmlpy as gg
from ggmlpy import GGMLType as T

from test_ggml_ops import LAYOUTS, make, run


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def logits(rng, n_rows=3, n=37):
    x = (rng.standard_normal((1, 1, n_rows, n)) * 2).astype(np.float32)
    x[0, 0, 0, 5] = x[0, 0, 0, 9] = x[0, 0, 0].max() + 1  # a tie at the top
    return x


def softmax_ref(x):
    e = np.exp(x.astype(np.float64) - x.max())
    return e / e.sum()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_top_k(rng, layout):
    x = logits(rng)
    ctx = gg.Context()
    got = run(gg.top_k(ctx, make(ctx, x, layout), 6))
    for r in range(3):
        ref = sorted(range(x.shape[3]), key=lambda i: (-x[0, 0, r, i], i))[:6]
        assert list(got[0, 0, r]) == ref
    assert got.dtype == np.int32


@pytest.mark.parametrize("kind", ["ties", "normal", "nan", "inf", "ascending", "short"])
@pytest.mark.parametrize("strided", [False, True])
def test_top_k_selection_equals_the_stable_sort(rng, kind, strided):
    """rowops.top_k_desc (one pass, no sort) picks what the stable descending sort picks,
    ties and NaNs included, for every k, on contiguous and strided rows."""
    from ggmlpy import rowops
    n = 3 if kind == "short" else 300
    x = (rng.integers(-3, 3, n) if kind == "ties" else rng.standard_normal(n)).astype(np.float32)
    if kind == "nan":
        x[rng.random(n) < 0.3] = np.nan
    if kind == "inf":
        x[rng.random(n) < 0.2] = -np.inf
        x[rng.random(n) < 0.05] = np.inf
    if kind == "ascending":  # the worst case of the insertion
        x.sort()
    row = np.repeat(x, 2)[::2] if strided else x
    for k in (0, 1, 2, 5, 40, n, n + 4):
        ref = sorted(range(n), key=lambda i: (np.isnan(row[i]), -row[i] if not np.isnan(row[i]) else 0, i))[:k]
        assert list(rowops.top_k_desc(row, k)) == ref, k


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cumsum(rng, layout):
    x = logits(rng)
    ctx = gg.Context()
    got = run(gg.cumsum(ctx, make(ctx, x, layout)))
    np.testing.assert_allclose(got, np.cumsum(x.astype(np.float64), axis=3), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("p", [0.3, 0.9])
def test_top_p_cut(rng, layout, p):
    x = -np.sort(-logits(rng), axis=3)
    ctx = gg.Context()
    got = run(gg.top_p_cut(ctx, make(ctx, x, layout), p, 1))
    for r in range(3):
        cum = np.cumsum(softmax_ref(x[0, 0, r]))
        keep = int(np.argmax(cum >= p)) + 1
        np.testing.assert_array_equal(got[0, 0, r, :keep], x[0, 0, r, :keep])
        assert np.all(np.isneginf(got[0, 0, r, keep:]))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_min_p_cut(rng, layout):
    x = logits(rng)
    ctx = gg.Context()
    got = run(gg.min_p_cut(ctx, make(ctx, x, layout), 0.05))
    for r in range(3):
        p = softmax_ref(x[0, 0, r])
        keep = p >= 0.05 * p.max()
        np.testing.assert_array_equal(got[0, 0, r][keep], x[0, 0, r][keep])
        assert np.all(np.isneginf(got[0, 0, r][~keep]))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_penalties(rng, layout):
    x = logits(rng)
    counts = rng.integers(0, 3, x.shape).astype(np.float32)
    ctx = gg.Context()
    got = run(gg.penalties(ctx, make(ctx, x, layout), make(ctx, counts, layout), 1.3, 0.1, 0.2))
    x64 = x.astype(np.float64)
    ref = np.where(counts > 0, np.where(x64 <= 0, x64 * 1.3, x64 / 1.3) - counts * 0.1 - 0.2, x64)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("with_ids", [False, True])
def test_sample_dist(rng, with_ids):
    x = logits(rng, n_rows=4)
    x[0, 0, 1, 3:] = -np.inf  # masked tokens are never drawn
    u = np.array([0.0, 0.5, 0.999, 0.3])
    ctx = gg.Context()
    a = make(ctx, x)
    ut = ctx.from_numpy(u.reshape(1, 4), T.F64)
    ids = ctx.from_numpy((np.arange(x.size).reshape(x.shape[2:]) + 1000).astype(np.int32), T.I32) if with_ids else None
    got = run(gg.sample_dist(ctx, a, ut, ids)).reshape(-1)
    for r in range(4):
        cdf = np.cumsum(softmax_ref(x[0, 0, r]))
        ref = int(np.searchsorted(cdf, u[r] * cdf[-1] - 1e-12))
        ref = max(ref, 0)
        assert got[r] == (ref + 1000 + r * x.shape[3] if with_ids else ref)
