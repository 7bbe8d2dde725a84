"""Float32 matrix products on numba's threads: the sgemm of the BLAS numpy loaded, called
from a parallel numba loop over (matrix, slice) tasks.

Why not numpy.matmul with BLAS threads: a graph is hundreds of small products between
numba kernels, and two thread pools on two cores either sleep between ops (waking costs
~80 us an op) or spin against each other. Here BLAS runs on one thread inside each of
numba's workers, so a single pool serves every op.

A product is cut into tiles of SLICE_ROWS rows of its left operand (tokens, for a layer's
products) by a fixed number of columns, one BLAS call each. BLAS rounds a row's dot
products according to the shape of the call it is in, so fixed tiles make a token's result
independent of how many tokens share its ubatch (n_ubatch changes no bit when it is a
multiple of SLICE_ROWS) and of the thread count. Tiles are whole rows, except when the
right operand is transposed (x @ W.T, a layer's forward product on ggml's row-major
weights): OpenBLAS packs that layout slowly for a whole row, and SLICE_COLS-wide tiles,
which its small-matrix kernels take, are 1.3-3x faster on the shapes training meets
(bench/RESULTS.md, "gemm tiles").

The BLAS is found, not assumed: any library threadpoolctl sees in the process (numpy's
OpenBLAS from PyPI, MKL, BLIS, FlexiBLAS) that exports a 64-bit-integer cblas_sgemm. With
none (a numpy on 32-bit-integer MKL or Accelerate, or GGMLPY_BLAS=numpy) the same slices
go through numpy.matmul on numpy's own BLAS threads: same results to rounding, slower for
many small products. `BLAS` says which is in use.

`Matmul(lhs, rhs, out)` plans `out = lhs @ rhs` (numpy.matmul's broadcasting over leading
dims) once for fixed arrays; calling it computes. `matmul(lhs, rhs, out)` plans and runs.
A product too small to be worth a second thread (`parallel=False`: a decode step's
products on a small model) makes the same BLAS calls, tile for tile, from a plain loop:
calling a parallel=True kernel costs about a microsecond more than its work on such
shapes, even on one thread, and a numba call pays for every argument it is passed, so
the serial kernel takes its arguments packed in two arrays (bench/RESULTS.md, "decode").
"""
from __future__ import annotations

import ctypes
import os

import llvmlite.binding as llvm
import numpy as np
from numba import njit, prange, types
from threadpoolctl import ThreadpoolController

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
SLICE_ROWS = 16
SLICE_COLS = 32  # tile width when the right operand is transposed
GRAIN = 1 << 17  # multiply-adds worth a thread: ~5 us of work, more than waking it costs
# cblas_sgemm with 64-bit integers, as OpenBLAS (numpy's wheels: "scipy_" prefix), MKL and BLIS name it.
ILP64_SGEMM_NAMES = ("scipy_cblas_sgemm64_", "cblas_sgemm64_", "cblas_sgemm_64")


def find_sgemm(controller: ThreadpoolController | None = None) -> tuple[int, str] | None:
    """(address, "library:symbol") of a 64-bit-integer cblas_sgemm in a BLAS this process
    has loaded, set to one thread (it runs inside numba's threads); None if there is none."""
    controller = controller or ThreadpoolController()
    for lib in controller.select(user_api="blas").lib_controllers:
        try:
            handle = ctypes.CDLL(lib.filepath)
        except OSError:
            continue
        for name in ILP64_SGEMM_NAMES:
            if hasattr(handle, name):
                lib.set_num_threads(1)
                return ctypes.cast(getattr(handle, name), ctypes.c_void_p).value, f"{lib.internal_api}:{name}"
    return None


_found = None if os.environ.get("GGMLPY_BLAS", "").lower() == "numpy" else find_sgemm()
BLAS = _found[1] if _found else "numpy.matmul"
if _found:  # a named symbol, not a baked-in address, so numba can cache the kernel across processes
    llvm.add_symbol("ggmlpy_cblas_sgemm", _found[0])
_i64, _f32, _ptr = types.int64, types.float32, types.intp
_sgemm = types.ExternalFunction("ggmlpy_cblas_sgemm", types.void(
    types.int32, types.int32, types.int32, _i64, _i64, _i64, _f32, _ptr, _i64, _ptr, _i64, _f32, _ptr, _i64))


@njit(cache=True, inline="always")
def _tile_counts(m, n, slice_rows, slice_cols):
    """(tiles per matrix, tiles per row of tiles) of an m x n result cut into slices."""
    col_tiles = (n + slice_cols - 1) // slice_cols
    return ((m + slice_rows - 1) // slice_rows) * col_tiles, col_tiles


@njit(cache=True, inline="always")
def _sgemm_tile(s, col_tiles, trans_a, trans_b, m, n, k, a0, lda, b0, ldb, c0_ptr, ldc, beta, slice_rows, slice_cols):
    """Tile s of one matrix product (addresses a0, b0, c0_ptr): one BLAS call."""
    lo = (s // col_tiles) * slice_rows
    hi = min(m, lo + slice_rows)
    c0 = (s % col_tiles) * slice_cols
    c1 = min(n, c0 + slice_cols)
    a = a0 + 4 * lo * (1 if trans_a == _TRANS else lda)
    b = b0 + 4 * c0 * (ldb if trans_b == _TRANS else 1)
    c = c0_ptr + 4 * (lo * ldc + c0)
    _sgemm(_ROW_MAJOR, trans_a, trans_b, hi - lo, c1 - c0, k, np.float32(1.0), a, lda, b, ldb, beta, c, ldc)


@njit(parallel=True, cache=True)
def _sgemm_tasks(trans_a, trans_b, m, n, k, a_ptrs, lda, b_ptrs, ldb, c_ptrs, ldc, beta, slice_rows, slice_cols):
    """C_i = op(A_i) op(B_i) + beta C_i for each matrix i (row-major C, m x n), one task per
    tile of slice_rows x slice_cols."""
    tiles, col_tiles = _tile_counts(m, n, slice_rows, slice_cols)
    for t in prange(a_ptrs.shape[0] * tiles):
        i = t // tiles
        _sgemm_tile(t % tiles, col_tiles, trans_a, trans_b, m, n, k, a_ptrs[i], lda, b_ptrs[i], ldb, c_ptrs[i], ldc,
                    beta, slice_rows, slice_cols)


@njit(cache=True)
def _sgemm_tasks_serial(dims, ptrs):
    """_sgemm_tasks on the calling thread, the same calls: dims = (trans_a, trans_b, m, n, k,
    lda, ldb, ldc, slice_rows, slice_cols, accumulate), ptrs = (a, b, c) addresses [3, matrices]."""
    trans_a, trans_b, m, n, k = np.int32(dims[0]), np.int32(dims[1]), dims[2], dims[3], dims[4]
    lda, ldb, ldc, slice_rows, slice_cols = dims[5], dims[6], dims[7], dims[8], dims[9]
    beta = np.float32(dims[10])
    tiles, col_tiles = _tile_counts(m, n, slice_rows, slice_cols)
    for t in range(ptrs.shape[1] * tiles):
        i = t // tiles
        _sgemm_tile(t % tiles, col_tiles, trans_a, trans_b, m, n, k, ptrs[0, i], lda, ptrs[1, i], ldb, ptrs[2, i], ldc,
                    beta, slice_rows, slice_cols)


def _operand(x: np.ndarray) -> tuple[int, int] | None:
    """(trans, ld) of a 2-D float32 layout BLAS reads as is, else None."""
    rows, cols = x.shape[-2:]
    s_row, s_col = (s // 4 for s in x.strides[-2:])
    if s_col == 1 or cols == 1:
        ld = s_row if rows > 1 else cols
        return (_NO_TRANS, ld) if ld >= max(1, cols) else None
    if s_row == 1 or rows == 1:
        ld = s_col if cols > 1 else rows
        return (_TRANS, ld) if ld >= max(1, rows) else None
    return None


def _batch_addresses(x: np.ndarray, batch: tuple[int, ...]) -> np.ndarray:
    """Address of each matrix of x (leading dims broadcast to `batch`), in C order."""
    lead = x.shape[:-2]
    strides = (0,) * (len(batch) - len(lead)) + tuple(s if n > 1 else 0 for n, s in zip(lead, x.strides[:-2]))
    offs = np.zeros(batch, dtype=np.int64)
    for axis, (size, stride) in enumerate(zip(batch, strides)):
        shape = [1] * len(batch)
        shape[axis] = size
        offs += (np.arange(size, dtype=np.int64) * stride).reshape(shape)
    return (x.ctypes.data + offs).reshape(-1)


class Matmul:
    """out = lhs @ rhs (+ out when accumulate), float32, planned once for these arrays.

    slice_rows=None computes each matrix in one BLAS call. parallel=False runs the same
    BLAS calls on the calling thread (for products not worth a second one); `run` is the
    cheapest zero-argument call that computes."""

    def __init__(self, lhs: np.ndarray, rhs: np.ndarray, out: np.ndarray, accumulate: bool = False,
                 slice_rows: int | None = SLICE_ROWS, parallel: bool = True) -> None:
        for x in (lhs, rhs, out):
            if x.dtype != np.float32 or x.ndim < 2:
                raise TypeError("Matmul takes float32 arrays of at least 2 dims")
        self._keep = (lhs, rhs, out)
        self._copies: list[tuple[np.ndarray, np.ndarray]] = []  # operands BLAS cannot read in place
        batch = out.shape[:-2]
        if np.broadcast_shapes(lhs.shape[:-2], rhs.shape[:-2], batch) != batch or lhs.shape[-1] != rhs.shape[-2] \
                or out.shape[-2:] != (lhs.shape[-2], rhs.shape[-1]):
            raise ValueError(f"Matmul shapes {lhs.shape} @ {rhs.shape} -> {out.shape}")
        self.out, self.accumulate = out, accumulate
        self.args = None
        self.run = self.__call__
        self._serial = None  # the serial call, when the product is planned for one thread
        self._numpy_tasks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        if out.size == 0 or lhs.shape[-1] == 0:
            return  # nothing to multiply: __call__ zeroes (or keeps) out
        if not _found:
            self._plan_numpy(lhs, rhs, out, slice_rows)
            return
        if _operand(out) is not None and _operand(out)[0] == _TRANS:
            lhs, rhs, out = rhs.swapaxes(-1, -2), lhs.swapaxes(-1, -2), out.swapaxes(-1, -2)
        if _operand(out) is None:
            raise ValueError("Matmul: the output needs one unit stride")
        lhs, rhs = self._readable(lhs), self._readable(rhs)
        (m, k), n = lhs.shape[-2:], rhs.shape[-1]
        (ta, lda), (tb, ldb), (_, ldc) = _operand(lhs), _operand(rhs), _operand(out)
        ptrs = [_batch_addresses(x, batch) for x in (lhs, rhs, out)]
        narrow = slice_rows and tb == _TRANS and k >= SLICE_COLS  # below that, whole rows measure faster
        slice_cols = SLICE_COLS if narrow else max(n, 1)
        self.args = (np.int32(ta), np.int32(tb), m, n, k, ptrs[0], lda, ptrs[1], ldb, ptrs[2], ldc,
                     np.float32(1.0 if accumulate else 0.0), slice_rows or max(m, 1), slice_cols)
        if not parallel:
            self._dims = np.array([ta, tb, m, n, k, lda, ldb, ldc, slice_rows or max(m, 1), slice_cols,
                                   int(accumulate)], dtype=np.int64)
            self._ptrs = np.ascontiguousarray(np.stack(ptrs), dtype=np.int64)
            # the calls hold self, so the arrays whose addresses they pass stay alive with them
            if self._copies:
                def serial() -> None:
                    for copy, src in self._copies:
                        np.copyto(copy, src)
                    _sgemm_tasks_serial(self._dims, self._ptrs)
                self._serial = serial
            else:
                self._serial = lambda: _sgemm_tasks_serial(self._dims, self._ptrs)
            self.run = self._serial

    def _plan_numpy(self, lhs: np.ndarray, rhs: np.ndarray, out: np.ndarray, slice_rows: int | None) -> None:
        """The same (matrix, slice) tasks as views, for numpy.matmul."""
        batch, m = out.shape[:-2], out.shape[-2]
        lhs = np.broadcast_to(lhs, batch + lhs.shape[-2:])
        rhs = np.broadcast_to(rhs, batch + rhs.shape[-2:])
        step = slice_rows or m
        self._numpy_tasks = [(lhs[i][lo:lo + step], rhs[i], out[i][lo:lo + step])
                             for i in np.ndindex(batch) for lo in range(0, m, step)]

    def _readable(self, x: np.ndarray) -> np.ndarray:
        if _operand(x) is not None:
            return x
        copy = np.empty(x.shape, dtype=np.float32)
        self._copies.append((copy, x))
        return copy

    def __call__(self) -> None:
        if self._numpy_tasks:
            for lhs, rhs, out in self._numpy_tasks:
                if self.accumulate:
                    out += lhs @ rhs
                else:
                    np.matmul(lhs, rhs, out=out)
        elif self._serial is not None:
            self._serial()
        elif self.args is None:
            if not self.accumulate:
                self.out[...] = 0
        else:
            for copy, src in self._copies:
                np.copyto(copy, src)
            _sgemm_tasks(*self.args)


def matmul(lhs: np.ndarray, rhs: np.ndarray, out: np.ndarray, accumulate: bool = False,
           slice_rows: int | None = SLICE_ROWS) -> np.ndarray:
    """out = lhs @ rhs (+ out when accumulate) for arrays made at run time."""
    Matmul(lhs, rhs, out, accumulate, slice_rows)()
    return out
