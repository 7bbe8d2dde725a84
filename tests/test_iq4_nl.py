"""IQ4_NL (ggml's non-linear 4-bit type) against llama.cpp and independent references:

- the file llama-quantize writes (stories260K IQ4_NL): every byte, by sha256;
- the quantizer against quantize_row_iq4_nl_impl transcribed in numpy here (edge blocks);
- dequantization against gguf-py's;
- products against ggml's own MUL_MAT outputs recorded from llama.cpp's build (repacked
  matrices, rows % 8 == 0, and plain ones, 1 to 17 columns) and against ggml's orders
  transcribed in numpy (ggml_reference.py), bit for bit, with strided activations, results
  in a view and rows addressed by offsets;
- perplexity against llama-perplexity's recorded lines.
tests/record_llama_cpp_iq4_nl.py records the llama.cpp side.
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from ggml_reference import KVALUES_IQ4NL, decode_iq4_nl, mul_mat_q0, mul_mat_q0_blocks, mul_mat_q0_pairs

import llamapy
from ggmlpy import GGMLType as T
from ggmlpy import quants
from ggmlpy.backend.cpu.plan import Scratch
from ggmlpy.backend.cpu.products import qexact
from ggmlpy.backend.cpu.products.qmatmul import QuantMatrix, mul_mat_q
from ggmlpy.backend.cpu.products.type_table import cpu_type
from llamapy.perplexity import perplexity
from llamapy.quantize import quantize_model
from llamapy.quantize.ftypes import FileType
from llamapy.quantize.rules import ModelFacts, TypeChooser

from conftest import file_sha256

DATA = Path(__file__).parent / "data"
RECORD = json.loads((DATA / "llama_cpp_iq4_nl.json").read_text())
PRODUCTS = np.load(DATA / "llama_cpp_iq4_nl_products.npz")
AVX512_RECORD = json.loads((DATA / "llama_cpp_quantize.json").read_text())  # llamapy's reference build
F32 = np.float32
VALUES = [F32(v) for v in (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)]


def listing(path: Path) -> list[list[str]]:
    f = llamapy.gguf_file.GGUFFile(path)
    return [[name, t.type.name.lower()] for name, t in f.tensors.items()]


def test_the_file_is_llama_quantizes_byte_for_byte(stories_path, tmp_path):
    out = tmp_path / "iq4_nl.gguf"
    quantize_model(stories_path, out, "IQ4_NL")
    assert listing(out) == RECORD["quantize"]["tensors"]
    assert file_sha256(out) == RECORD["quantize"]["sha256"]


# ---- quantize_row_iq4_nl_impl (super block 32, no importance matrix, ntry 7) in numpy float32 -------
def _best_index(x):
    if x <= VALUES[0]:
        return 0
    if x >= VALUES[15]:
        return 15
    ml, mu = 0, 15
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if x < VALUES[mav]:
            mu = mav
        else:
            ml = mav
    return mu - 1 if x - VALUES[mu - 1] < VALUES[mu] - x else mu


def _sums(xb, id):
    sumqx = sumq2 = F32(0)
    for v in xb:
        q, w = VALUES[_best_index(F32(id * v))], F32(v * v)
        sumqx = F32(sumqx + F32(F32(w * q) * v))
        sumq2 = F32(sumq2 + F32(F32(w * q) * q))
    return sumqx, sumq2


def ref_quantize_block(xb: np.ndarray) -> bytes:
    xb = [F32(v) for v in xb]
    amax, mx = F32(0), F32(0)
    for v in xb:
        if abs(v) > amax:
            amax, mx = abs(v), v
    d = F32(0)
    if amax >= F32(1e-15):
        sumqx, sumq2 = _sums(xb, F32(F32(1) / F32(-mx / VALUES[0])))
        d = F32(sumqx / sumq2) if sumq2 > 0 else F32(0)
        best = F32(d * sumqx)
        for itry in range(-7, 8):
            sumqx, sumq2 = _sums(xb, F32(F32(itry - 127) / mx))
            if sumq2 > 0 and F32(sumqx * sumqx) > F32(best * sumq2):
                d = F32(sumqx / sumq2)
                best = F32(d * sumqx)
    id = F32(F32(1) / d) if d else F32(0)
    L = [_best_index(F32(id * v)) for v in xb]
    return np.float16(d).tobytes() + bytes(L[j] | (L[j + 16] << 4) for j in range(16))


def test_quantizer_is_quantize_row_iq4_nl_impl():
    """Gaussian blocks of many scales, an all-zero block, one below GROUP_MAX_EPS, a single
    spike, a constant block, halves of equal magnitude and opposite sign."""
    rng = np.random.default_rng(20)
    blocks = [rng.standard_normal(32) * 10.0 ** rng.uniform(-6, 3) for _ in range(40)]
    blocks += [np.zeros(32), np.full(32, 1e-16), np.eye(32)[5] * -3.0, np.full(32, 0.25),
               np.r_[np.full(16, 2.0), np.full(16, -2.0)], rng.uniform(-1, 1, 32) * 65000]
    x = np.array(blocks, dtype=F32).reshape(2, -1)
    got = quants.quantize(x, T.IQ4_NL).reshape(-1, 18)
    want = np.frombuffer(b"".join(ref_quantize_block(b) for b in x.reshape(-1, 32)), dtype=np.uint8).reshape(-1, 18)
    np.testing.assert_array_equal(got, want)


def test_dequantize_is_gguf_pys():
    rng = np.random.default_rng(4)
    data = rng.integers(0, 256, (7, 9, 18), dtype=np.uint8)
    d = (rng.choice([-1.0, 1.0], (7, 9, 1)) * 10.0 ** rng.uniform(-7, 2, (7, 9, 1))).astype(np.float16)
    d[0, 0] = 0
    data[..., :2] = d.view(np.uint8)
    data = data.reshape(7, -1)
    got = quants.dequantize(data, T.IQ4_NL)
    want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.IQ4_NL)
    np.testing.assert_array_equal(got.view(np.uint32), want.astype(F32).view(np.uint32))


# ---- products ---------------------------------------------------------------------------------
RECORDED = sorted({tuple(int(v) for v in key.split("_")[1:]) for key in PRODUCTS.files if key.startswith("out_")})


def reference(rows: np.ndarray, x: np.ndarray) -> np.ndarray:
    """ggml's order for the shape: repacked (rows % 8 == 0) block sums, else one column through
    ggml_vec_dot_iq4_nl_q8_0, more through tinyBLAS's lanes."""
    if len(rows) % 8 == 0:
        return mul_mat_q0_blocks(*decode_iq4_nl(rows), x)
    return (mul_mat_q0_pairs if len(x) == 1 else mul_mat_q0)(*decode_iq4_nl(rows), x)


@pytest.mark.parametrize("m, k, n", RECORDED, ids=lambda v: str(v))
def test_products_are_ggmls_recorded_outputs(kernels, m, k, n):
    """ggml's MUL_MAT as llama.cpp's build computed it, bit for bit; the activations strided,
    the result a view inside a larger array."""
    rows = PRODUCTS[f"rows_{m}_{k}"]
    x = np.repeat(PRODUCTS[f"x_{k}"][:n].astype(F32), 2, axis=1)[:, ::2]
    big = np.full((n, m + 3), np.nan, F32)
    out = big[:, 2:m + 2]
    mul_mat_q(QuantMatrix.from_bytes(T.IQ4_NL, rows, k), x, out, Scratch())
    np.testing.assert_array_equal(out, PRODUCTS[f"out_{m}_{k}_{n}"])
    np.testing.assert_array_equal(out, reference(rows, x))  # the numpy transcription agrees
    assert np.isnan(big[:, :2]).all() and np.isnan(big[:, m + 2:]).all()


@pytest.mark.parametrize("m", [16, 13])
@pytest.mark.parametrize("n", [1, 4, 20])
def test_rows_addressed_by_offset_in_a_shared_buffer(kernels, m, n):
    rng = np.random.default_rng(m * 10 + n)
    k = 96
    rows = quants.quantize(rng.standard_normal((m, k)).astype(F32), T.IQ4_NL).reshape(m, -1)
    buf = np.zeros(5 + m * rows.shape[1], dtype=np.uint8)
    order = rng.permutation(m)
    for slot, r in enumerate(order):
        buf[5 + slot * rows.shape[1]:5 + (slot + 1) * rows.shape[1]] = rows[r]
    offs = np.empty(m, dtype=np.int64)
    offs[order] = 5 + np.arange(m) * rows.shape[1]
    x = (rng.standard_normal((n, k)) * 4).astype(F32)
    out = np.empty((n, m), F32)
    mul_mat_q(QuantMatrix(T.IQ4_NL, buf, offs, k), x, out, Scratch())
    np.testing.assert_array_equal(out, reference(rows, x))


@pytest.mark.parametrize("m", [16, 13])
def test_block_sums_for_the_fused_loss(m):
    """The fused output layer's order (block_sums: one fma per block of 32 and column), for
    repacked and plain matrices alike."""
    rng = np.random.default_rng(m)
    k, n = 160, 20
    rows = quants.quantize(rng.standard_normal((m, k)).astype(F32), T.IQ4_NL).reshape(m, -1)
    x = (rng.standard_normal((n, k)) * 3).astype(F32)
    out = np.empty((n, m), F32)
    w = QuantMatrix.from_bytes(T.IQ4_NL, rows, k)
    cpu_type(T.IQ4_NL).plan_product(n, m, k, block_sums=True)(w.buf, w.offs, x, out, Scratch())
    np.testing.assert_array_equal(out, mul_mat_q0_blocks(*decode_iq4_nl(rows), x))


def test_the_table_row():
    """vec_dot_type Q8_0, llama.cpp's order for every shape (no BLAS tiles), block sums for the
    fused loss."""
    row = cpu_type(T.IQ4_NL)
    assert row.vec_dot_type == T.Q8_0 and row.ggml_order and row.packed.block_sums


def test_vnni_operand_is_the_table_plus_128():
    """The unsigned bytes the VNNI kernels multiply (the CPU here may lack them, the unpacking
    does not): table + 128, with 128 times the activations' sums taken off (Q0Rows.bias)."""
    rng = np.random.default_rng(1)
    rows = quants.quantize(rng.standard_normal((3, 64)).astype(F32), T.IQ4_NL).reshape(3, -1)
    layout = cpu_type(T.IQ4_NL).packed.plan.args[0]  # the row's Q0Rows
    assert layout.values == tuple(KVALUES_IQ4NL)
    wu = np.empty((3, 64), np.uint8)
    wd = np.empty((3, 2), F32)
    qexact._unpack_q0_rows_u8(rows.reshape(-1), np.arange(3) * rows.shape[1], 0, layout.block_bytes,
                              (KVALUES_IQ4NL + layout.bias).astype(np.uint8), wu, wd)
    ints, d = decode_iq4_nl(rows)
    np.testing.assert_array_equal(wu.astype(np.int64) - layout.bias, ints)
    np.testing.assert_array_equal(wd, d)


# ---- llama-quantize's IQ4_NL file type ---------------------------------------------------------
def test_the_file_types_mix():
    """llama_tensor_get_type for IQ4_NL without an importance matrix: attn_v in Q5_K with 4 or
    more query heads per K/V head, ffn_down of the first eighth of the layers in Q5_K, the
    output in Q6_K; the rest IQ4_NL."""
    names = [f"blk.{i}.{t}.weight" for i in range(16) for t in ("attn_v", "ffn_down", "attn_q")] + ["output.weight"]
    chooser = TypeChooser(ModelFacts("llama", 16, n_gqa=4), FileType.MOSTLY_IQ4_NL, T.IQ4_NL, names)
    got = {name: chooser.choose(name, (256, 256), T.F32) for name in names}
    assert got["blk.0.attn_v.weight"] == got["blk.1.ffn_down.weight"] == T.Q5_K
    assert got["blk.2.ffn_down.weight"] == got["blk.0.attn_q.weight"] == T.IQ4_NL
    assert got["output.weight"] == T.Q6_K
    plain = TypeChooser(ModelFacts("llama", 16, n_gqa=2), FileType.MOSTLY_IQ4_NL, T.IQ4_NL, names)
    assert plain.choose("blk.0.attn_v.weight", (256, 256), T.F32) == T.IQ4_NL


# ---- perplexity ---------------------------------------------------------------------------------
def test_perplexity_is_llama_perplexitys(stories_path, wiki_path, tmp_path):
    """llama-perplexity's running values on llama-quantize's file. llamapy follows llama.cpp's
    AVX-512 build; a recording made by another build (an AVX2 one sums softmax and F16 dot
    products over 8 lanes) parts from it after a few chunks on any model. The Q8_0 control,
    recorded by the same build, says how many chunks the two builds share (all of them when
    the recording is an AVX-512 build's): there the values must be equal to the last digit,
    after it within the builds' own difference."""
    out = tmp_path / "iq4_nl.gguf"
    quantize_model(stories_path, out, "IQ4_NL")
    model = llamapy.load_model(out)
    text = wiki_path.read_text(encoding="utf-8")[:RECORD["slice_chars"]]
    expected = RECORD["perplexity"]["IQ4_NL"]["running"]
    result = perplexity(model, model.vocab.tokenize(text, add_special=True), n_ctx=128, n_batch=128,
                        n_chunks=len(expected))
    got = [f"{v:.4f}" for v in result.running]
    control, reference = RECORD["perplexity"]["Q8_0"]["running"], AVX512_RECORD["perplexity"]["Q8_0"]["running"]
    shared = next((i for i, (a, b) in enumerate(zip(control, reference)) if a != b), len(control))
    assert shared >= 2
    assert got[:shared] == expected[:shared]
    builds_apart = max(abs(float(a) / float(b) - 1) for a, b in zip(control, reference))
    assert all(abs(float(a) / float(b) - 1) <= 2 * builds_apart for a, b in zip(got, expected))
