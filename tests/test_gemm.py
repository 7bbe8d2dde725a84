"""gemm.py: float32 products on numba's threads against float64 numpy.

Every layout BLAS can read in place (row-major, transposed, permuted with a row stride)
and the ones it cannot (strided columns, negative strides: copied first), broadcasting
over leading dims as numpy.matmul, a transposed output, accumulation, empty dims, and
the promises that matter for reproducibility: the result depends neither on the thread
count nor on how many rows (tokens) share a product. Each test runs on the BLAS sgemm found
and on the numpy.matmul fallback used where there is none (test_portable_blas.py).
"""
from __future__ import annotations

import numba
import numpy as np
import pytest

from ggmlpy.backend.cpu.products import gemm
from ggmlpy.backend.cpu.products.gemm import SLICE_ROWS, Matmul, matmul


@pytest.fixture(autouse=True, params=["sgemm", "numpy.matmul"])
def blas(request, monkeypatch):
    """Every test on both paths: numba-threaded sgemm and the numpy.matmul fallback."""
    if request.param == "numpy.matmul":
        monkeypatch.setattr(gemm, "_found", None)
    elif gemm._found is None:
        pytest.skip("no 64-bit-integer BLAS in this process")
    return request.param


def _f(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _check(lhs, rhs, out):
    ref = np.matmul(lhs.astype(np.float64), rhs.astype(np.float64))
    matmul(lhs, rhs, out)
    bound = 4e-7 * np.matmul(np.abs(lhs).astype(np.float64), np.abs(rhs).astype(np.float64)) * lhs.shape[-1]
    assert np.all(np.abs(out - ref) <= bound + 1e-30)


LAYOUTS = {
    "contiguous": lambda r: (_f(r, 128, 64), _f(r, 64, 96)),
    "rhs transposed": lambda r: (_f(r, 128, 64), _f(r, 96, 64).T),
    "lhs transposed": lambda r: (_f(r, 64, 128).T, _f(r, 64, 96)),
    "row stride": lambda r: (_f(r, 128, 3, 64)[:, 1], _f(r, 64, 2, 96)[:, 0]),
    "strided columns (copied)": lambda r: (_f(r, 128, 128)[:, ::2], _f(r, 64, 96)),
    "negative strides (copied)": lambda r: (_f(r, 128, 64)[::-1], _f(r, 64, 96)[:, ::-1]),
    "one row": lambda r: (_f(r, 1, 64), _f(r, 64, 300)),
    "one column": lambda r: (_f(r, 300, 1), _f(r, 1, 5)),
    "tiny": lambda r: (_f(r, 3, 2), _f(r, 2, 4)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts(layout):
    lhs, rhs = LAYOUTS[layout](np.random.default_rng(1))
    _check(lhs, rhs, np.empty((lhs.shape[0], rhs.shape[1]), np.float32))


def test_transposed_output():
    rng = np.random.default_rng(2)
    lhs, rhs = _f(rng, 100, 48), _f(rng, 48, 70)
    _check(lhs, rhs, np.empty((70, 100), np.float32).T)


def test_broadcast_batches_and_permuted_heads():
    rng = np.random.default_rng(3)
    _check(_f(rng, 2, 4, 1, 16, 8), _f(rng, 2, 1, 3, 8, 16), np.empty((2, 4, 3, 16, 16), np.float32))
    q = _f(rng, 128, 8, 32).transpose(1, 0, 2)[:, :, :8]  # heads of a [tokens, heads, dim] tensor
    _check(q, _f(rng, 8, 8, 64), np.empty((8, 128, 64), np.float32))
    _check(q, _f(rng, 8, 64), np.empty((128, 8, 64), np.float32).transpose(1, 0, 2))  # heads interleaved


def test_accumulate_and_empty():
    rng = np.random.default_rng(4)
    lhs, rhs, out = _f(rng, 50, 20), _f(rng, 20, 30), _f(rng, 50, 30)
    ref = out.astype(np.float64) + lhs.astype(np.float64) @ rhs.astype(np.float64)
    matmul(lhs, rhs, out, accumulate=True)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    out = _f(rng, 3, 4)
    matmul(_f(rng, 3, 0), _f(rng, 0, 4), out)
    assert (out == 0).all()
    kept = out.copy() + 1
    matmul(_f(rng, 3, 0), _f(rng, 0, 4), kept, accumulate=True)
    assert (kept == 1).all()


def test_plan_sees_new_values():
    rng = np.random.default_rng(5)
    lhs, rhs = _f(rng, 64, 64)[:, ::2], _f(rng, 32, 40)  # lhs is copied on every call
    out = np.empty((64, 40), np.float32)
    plan = Matmul(lhs, rhs, out)
    for _ in range(2):
        lhs[...] = _f(rng, 64, 32)
        rhs[...] = _f(rng, 32, 40)
        plan()
        np.testing.assert_allclose(out, lhs.astype(np.float64) @ rhs, rtol=1e-5, atol=1e-5)


def test_shape_errors():
    with pytest.raises(ValueError):
        matmul(np.zeros((3, 4), np.float32), np.zeros((5, 6), np.float32), np.zeros((3, 6), np.float32))


def test_results_do_not_depend_on_threads():
    """Products are sliced by rows, never by thread count: -t changes no bit."""
    rng = np.random.default_rng(6)
    cases = [(_f(rng, 128, 172), _f(rng, 172, 64)), (_f(rng, 8, 128, 8), _f(rng, 8, 8, 128)),
             (_f(rng, 512, 64), _f(rng, 64, 128)), (_f(rng, 96, 64), _f(rng, 100, 64).T)]  # the last in tiles
    assert cases[0][0].shape[0] > SLICE_ROWS  # the first one is sliced
    before = numba.get_num_threads()
    try:
        results = []
        for n in (1, numba.config.NUMBA_NUM_THREADS):
            numba.set_num_threads(n)
            results.append([matmul(a, b, np.empty(a.shape[:-1] + b.shape[-1:], np.float32)) for a, b in cases])
    finally:
        numba.set_num_threads(before)
    for x, y in zip(*results):
        assert np.array_equal(x, y)


def test_rows_do_not_depend_on_their_company():
    """A ubatch of 512 tokens and sixteen of 32 give every token the same bits (n_ubatch
    invariance): each row's dot products are computed in a call of the same shape."""
    rng = np.random.default_rng(7)
    x, w = _f(rng, 512, 64), _f(rng, 172, 64)
    whole = matmul(x, w.T, np.empty((512, 172), np.float32))
    for n in (SLICE_ROWS, 4 * SLICE_ROWS):
        parts = np.concatenate([matmul(x[i:i + n], w.T, np.empty((n, 172), np.float32)) for i in range(0, 512, n)])
        assert np.array_equal(parts, whole)



@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("accumulate", [False, True])
def test_serial_plan_gives_the_parallel_bits(layout, accumulate):
    """Products planned for one thread (parallel=False: a decode step's) make the same BLAS
    calls from a serial loop: every bit equals the parallel plan's, copied operands, new
    values between calls and accumulation included, and the plan keeps its arrays alive."""
    rng = np.random.default_rng(8)
    lhs, rhs = LAYOUTS[layout](rng)
    start = _f(rng, lhs.shape[0], rhs.shape[1])
    outs = []
    for parallel in (True, False):
        out = start.copy()
        run = Matmul(lhs, rhs, out, accumulate=accumulate, parallel=parallel).run  # the plan object is dropped
        for _ in range(2):
            run()
        outs.append(out)
    assert np.array_equal(outs[0], outs[1])
    product = lhs.astype(np.float64) @ rhs
    ref = start + 2 * product if accumulate else product  # two runs
    np.testing.assert_allclose(outs[1], ref, rtol=1e-4, atol=1e-4)
