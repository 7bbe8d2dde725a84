"""Quantization against llama-quantize: the same bytes (sha256 of the whole file), the same
tensor types in the same order, the same perplexity; the command line and its bad inputs.
llama-quantize's results are recorded by tests/record_llama_cpp_quantize.py."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import llamapy
import llamapy.quantize
from ggmlpy import GGMLType
from llamapy.errors import InputError, ModelLoadError
from llamapy.gguf_writer import TensorOut, write_gguf
from llamapy.perplexity import perplexity
from llamapy.quantize import KvOverride, QuantizeParams, quantize_model
from llamapy.quantize.rows import _first_bad_row
from llamapy.quantize.ftypes import find_option
from llamapy.quantize.rules import ModelFacts, TypeChooser, tensor_order

from conftest import file_sha256, shared_path
from test_cli_flags import one_error_line, run_tool

RECORD = json.loads((Path(__file__).parent / "data" / "llama_cpp_quantize.json").read_text())
CASES = RECORD["cases"]
SHARED_CASES = sorted(k for k in CASES if not k.startswith(("gemma3", "llama-2")) and "--allow-requantize" not in k)


def listing(path: Path) -> list[list[str]]:
    """[name, type] of each tensor in file order (the recording read them with the gguf package)."""
    f = llamapy.gguf_file.GGUFFile(path)
    return [[name, t.type.name.lower()] for name, t in f.tensors.items()]


def params_of(flags: list[str]) -> QuantizeParams:
    """llama-quantize's flags of a recorded case as QuantizeParams (the CLI is tested apart)."""
    from llamapy.cli.quantize import _layers, _tensor_type
    from llamapy.quantize import parse_tensor_type
    kw: dict = {"tensor_types": [], "kv_overrides": []}
    i = 0
    while i < len(flags):
        flag = flags[i]
        value = flags[i + 1] if i + 1 < len(flags) else None
        i += 1
        if flag == "--pure":
            kw["pure"] = True
        elif flag == "--leave-output-tensor":
            kw["quantize_output_tensor"] = False
        elif flag == "--allow-requantize":
            kw["allow_requantize"] = True
        else:
            i += 1
            if flag == "--output-tensor-type":
                kw["output_tensor_type"] = parse_tensor_type(value, flag)
            elif flag == "--token-embedding-type":
                kw["token_embedding_type"] = parse_tensor_type(value, flag)
            elif flag == "--tensor-type":
                kw["tensor_types"].append(_tensor_type(value))
            elif flag == "--override-kv":
                kw["kv_overrides"].append(KvOverride.parse(value))
            elif flag == "--prune-layers":
                kw["prune_layers"] = _layers(value)
            else:
                raise AssertionError(flag)
    return QuantizeParams(**{k: tuple(v) if isinstance(v, list) else v for k, v in kw.items()})


def check_case(key: str, source: Path, out: Path) -> None:
    case = CASES[key]
    quantize_model(source, out, case["type"], params_of(case["flags"]))
    assert listing(out) == case["tensors"]
    assert file_sha256(out) == case["sha256"]


@pytest.mark.parametrize("key", SHARED_CASES)
def test_the_file_is_llama_quantizes_byte_for_byte(key, tmp_path):
    """Q8_0, Q4_0 and Q4_K_M on the four shared F32 models, every other mix (and numbers for
    names) on stories260K, and llama-quantize's flags: the tensors, their order and types,
    and every byte of the file."""
    check_case(key, shared_path("models", f"{CASES[key]['model']}.gguf"), tmp_path / "out.gguf")


def test_requantizing_is_llama_quantizes(tmp_path):
    """A quantized model quantized again with allow_requantize: dequantized, then quantized."""
    first = tmp_path / "first.gguf"
    quantize_model(shared_path("models", "stories260K.gguf"), first, "Q4_K_M")
    with pytest.raises(InputError, match="requantizing from type q5_0 is disabled"):
        quantize_model(first, tmp_path / "second.gguf", "Q8_0")
    check_case("stories260K Q4_K_M --allow-requantize Q8_0", first, tmp_path / "second.gguf")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K_M"])
def test_an_f16_model(qtype, tmp_path):
    check_case(f"llama-2-tiny-random {qtype}", shared_path("models", "llama-2-tiny-random.gguf"), tmp_path / "o.gguf")


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K_M", "Q6_K"])
def test_gemma3_requantized_is_llama_quantizes(qtype, gemma3_path, tmp_path):
    """Real K-quant blocks (256-wide rows), tied embeddings and 18 layers of use_more_bits."""
    key = f"gemma3-270m --allow-requantize {qtype}"
    if key not in CASES:
        pytest.skip("the recording was made without the gemma3 package")
    check_case(key, gemma3_path, tmp_path / "g.gguf")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K_M"])
def test_perplexity_of_the_quantized_model_is_llama_perplexitys(qtype, tmp_path, stories_path, wiki_path):
    """Same bytes as llama-quantize's file, so llama-perplexity's numbers on it: recorded over a
    slice of wiki.test.raw at -c 128 -b 128, every running value to four decimals."""
    out = tmp_path / "q.gguf"
    quantize_model(stories_path, out, qtype)
    assert file_sha256(out) == CASES[f"stories260K {qtype}"]["sha256"]
    model = llamapy.load_model(out)
    text = wiki_path.read_text(encoding="utf-8")[:RECORD["slice_chars"]]
    expected = RECORD["perplexity"][qtype]
    result = perplexity(model, model.vocab.tokenize(text, add_special=True), n_ctx=128, n_batch=128,
                        n_chunks=len(expected["running"]))
    assert [f"{v:.4f}" for v in result.running] == expected["running"]
    assert f"{result.ppl:.4f}" == expected["final"]


def test_threads_and_slabs_do_not_change_the_bytes(stories_path, tmp_path, monkeypatch):
    monkeypatch.setattr(llamapy.quantize, "_PARALLEL_BYTES", 0)  # every tensor on the threads asked for
    runs = []
    for i, (threads, slab) in enumerate([(1, 64 << 20), (2, 1), (2, 5000)]):
        out = tmp_path / f"{i}.gguf"
        quantize_model(stories_path, out, "Q4_0", QuantizeParams(n_threads=threads, slab_bytes=slab))
        runs.append(file_sha256(out))
    assert runs == [CASES["stories260K Q4_0"]["sha256"]] * 3


def test_dry_run_reports_without_writing(stories_path, tmp_path):
    lines = []
    result = quantize_model(stories_path, tmp_path / "never.gguf", "Q8_0", QuantizeParams(dry_run=True),
                            on_tensor=lambda r: lines.append(str(r)))
    assert not (tmp_path / "never.gguf").exists()
    assert [[t.name, t.type_out.name.lower()] for t in result.tensors] == CASES["stories260K Q8_0"]["tensors"]
    assert lines[0] == ("[   1/  48] output.weight                        - [    64,    512,      1,      1], "
                        "type =    f32, converting to q8_0 .. size =     0.12 MiB ->     0.03 MiB")
    assert lines[1].endswith("type =    f32, size =    0.000 MiB")
    assert result.totals()[0] == "model size  =     1.12 MiB (32.00 BPW)"


def test_use_more_bits_layers_of_q4_k_m():
    """attn_v and ffn_down of a 32-layer model: Q6_K in llama.cpp's use_more_bits layers (the
    first and last eighth, and every third one between), Q4_K elsewhere."""
    names = tensor_order([f"blk.{i}.{t}.weight" for i in range(32) for t in ("attn_v", "ffn_down", "attn_q")])
    chooser = TypeChooser(ModelFacts("llama", 32, n_gqa=1), find_option("Q4_K_M").ftype, GGMLType.Q4_K, names)
    chosen = {name: chooser.choose(name, (4096, 4096, 1, 1), GGMLType.F32) for name in names}
    more = [i for i in range(32) if chosen[f"blk.{i}.attn_v.weight"] == GGMLType.Q6_K]
    assert more == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert more == [i for i in range(32) if chosen[f"blk.{i}.ffn_down.weight"] == GGMLType.Q6_K]
    assert {chosen[f"blk.{i}.attn_q.weight"] for i in range(32)} == {GGMLType.Q4_K}


def test_tensor_order_is_by_layer_then_name():
    assert tensor_order(["blk.10.a", "output.weight", "blk.2.b", "blk.2.a", "token_embd.weight"]) == [
        "output.weight", "token_embd.weight", "blk.2.a", "blk.2.b", "blk.10.a"]


def test_non_finite_rows_are_found_as_numpy_finds_them():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((50, 96)).astype(np.float32)
    assert _first_bad_row(x.view(np.uint32)) == -1
    for value, row in ((np.nan, 7), (np.inf, 3), (-np.inf, 49)):
        y = x.copy()
        y[row, 5] = value
        y[row + 1:, 0] = np.nan
        expected = np.flatnonzero(~np.isfinite(y).all(axis=1))[0]
        assert _first_bad_row(y.view(np.uint32)) == expected == row


def test_a_nan_in_the_input_is_refused_and_nothing_is_written(stories_path, tmp_path):
    bad = tmp_path / "nan.gguf"
    data = bytearray(stories_path.read_bytes())
    src = llamapy.gguf_file.GGUFFile(stories_path)
    t = src.tensors["blk.1.attn_q.weight"]
    data[t.offset + 4 * 70:t.offset + 4 * 71] = np.float32(np.nan).tobytes()
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="'blk.1.attn_q.weight' has invalid data .* row 1"):
        quantize_model(bad, tmp_path / "out.gguf", "Q8_0")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nan.gguf"]


def test_a_tensor_made_in_pieces_must_fill_its_size(tmp_path):
    tensor = TensorOut("t", GGMLType.F32, (4, 2), lambda: iter([np.zeros(12, np.uint8)]))
    with open(tmp_path / "x.gguf", "wb") as out, pytest.raises(ValueError, match="12 bytes made, 32 announced"):
        write_gguf(out, {}, [tensor])


# ---- the command line ---------------------------------------------------------------------------
def test_the_command_line_writes_llama_quantizes_file(stories_path, tmp_path, capsys):
    out = tmp_path / "q.gguf"
    code, _, err = run_tool("quantize", str(stories_path), str(out), "q4_k_m", "1", capsys=capsys)
    assert code == 0, err
    assert file_sha256(out) == CASES["stories260K Q4_K_M"]["sha256"]
    assert "using 1 threads" in err
    assert "[  48/  48] blk.4.ffn_up.weight" in err and "converting to q5_0 .. size =" in err
    assert "warning: blk.0.ffn_down.weight                - ncols    172 not divisible by 256" in err
    assert "quant size  =     0.28 MiB (7.92 BPW)" in err and "36 of 48 tensor(s) required fallback" in err


def test_without_out_the_file_goes_beside_the_input(stories_path, tmp_path, capsys):
    source = tmp_path / "model.gguf"
    shutil.copy(stories_path, source)
    code, _, err = run_tool("quantize", str(source), "7", capsys=capsys)  # 7: Q8_0's number
    assert code == 0, err
    assert file_sha256(tmp_path / "ggml-model-Q8_0.gguf") == CASES["stories260K Q8_0"]["sha256"]


@pytest.mark.parametrize("args, expected", [
    (["{tmp}/text.gguf", "{tmp}/o.gguf", "q8_0"], "is not a GGUF file"),
    (["{model}", "{tmp}/o.gguf", "q9_0"], "unknown quantization type 'q9_0'"),
    (["{model}", "{tmp}/o.gguf", "IQ2_XXS"], "IQ2_XXS: llamapy has no quantizer for this type"),
    (["{model}", "{tmp}/o.gguf", "q2_k_s"], "Q2_K_S needs an importance matrix"),
    (["{model}", "{model}", "q8_0"], "is the file IN reads"),
    (["{model}", "{tmp}/no/such/dir/o.gguf", "q8_0"], "cannot save the quantized model to"),
    (["{tmp}/q5.gguf", "{tmp}/o.gguf", "q8_0"], "requantizing from type q5_0 is disabled"),
    (["{model}", "{tmp}/o.gguf", "q8_0", "two"], "invalid NTHREADS 'two'"),
    (["{model}"], "give IN.gguf [OUT.gguf] TYPE [NTHREADS]"),
    (["--imatrix", "i.dat", "{model}", "{tmp}/o.gguf", "q8_0"], "--imatrix: importance matrices are not supported"),
    (["--keep-split", "{model}", "{tmp}/o.gguf", "q8_0"], "--keep-split: split GGUF files are not supported"),
    (["--output-tensor-type", "iq4_xs", "{model}", "{tmp}/o.gguf", "q8_0"], "--output-tensor-type 'iq4_xs': not a"),
    (["--output-tensor-type", "q4_k", "{model}", "{tmp}/o.gguf", "q8_0"],
     "tensor output.weight: rows of 64 values do not fit q4_K's blocks of 256"),
    (["--tensor-type", "attn_q", "{model}", "{tmp}/o.gguf", "q8_0"], "expected NAME=GGML_TYPE"),
    (["--tensor-type", "(=q8_0", "{model}", "{tmp}/o.gguf", "q8_0"], "tensor type pattern '('"),
    (["--override-kv", "general.name=string:x", "{model}", "{tmp}/o.gguf", "q8_0"], "expected KEY=TYPE:VALUE"),
    (["--override-kv", "a.b=int:x", "{model}", "{tmp}/o.gguf", "q8_0"], "'x' is not a int"),
    (["--prune-layers", "1,x", "{model}", "{tmp}/o.gguf", "q8_0"], "--prune-layers: invalid layer id 'x'"),
])
def test_bad_input_is_one_line(args, expected, stories_path, tmp_path, capsys):
    (tmp_path / "text.gguf").write_text("not a model")
    if "{tmp}/q5.gguf" in args:
        quantize_model(stories_path, tmp_path / "q5.gguf", "Q5_0")
    argv = [a.format(tmp=tmp_path, model=stories_path) for a in args]
    code, _, err = run_tool("quantize", *argv, capsys=capsys)
    assert code != 0
    assert expected in one_error_line(err)
    assert not (tmp_path / "o.gguf").exists()


def test_the_tool_runs_as_a_program(stories_path, tmp_path):
    out = tmp_path / "q.gguf"
    proc = subprocess.run([sys.executable, "-m", "llamapy", "quantize", str(stories_path), str(out), "Q4_0"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert file_sha256(out) == CASES["stories260K Q4_0"]["sha256"]
