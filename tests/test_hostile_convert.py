"""llamapy-convert against hostile checkpoints: shard paths out of the folder, malformed
config.json files, safetensors headers that lie. Each is one `error:` line naming the key or
the file and a non-zero exit, before any tensor data is read and without memory that grows
with a config number; no output file; every input byte for byte as it was. What converts
loads (test_fuzz_convert.py throws 500 mutations at the same rules).

The checkpoints are tests/hf_checkpoints.py's small llama (F32, three shards with an index)
and gemma3 (BF16, one file), and qwen2 / qwen3 ones made from the llama one here (`variant`).
"""
from __future__ import annotations

import hashlib
import json
import math
import shutil
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import hf_checkpoints as H
import llamapy
from llamapy.convert import architectures as A
from llamapy.convert import convert_checkpoint
from llamapy.convert.checkpoint import open_checkpoint
from llamapy.convert.safetensors import read_safetensors
from llamapy.convert.tensor_check import check_vocabulary, text_tensors
from llamapy.errors import CheckpointError
from test_hostile_cli import one_error, run_tool

INDEX = "model.safetensors.index.json"
SHARD1 = "model-00001-of-00003.safetensors"


# ---- building and changing checkpoints (test_fuzz_convert uses these too) ----------------------

def variant(llama: Path, dest: Path, arch: str) -> Path:
    """The llama checkpoint as a qwen2 (with its Q, K and V biases) or qwen3 (with its Q and K
    norms) one, in `dest`: llama's SentencePiece tokenizer converts for both."""
    shutil.copytree(llama, dest)
    config = json.loads((dest / "config.json").read_text())
    config["architectures"] = {"qwen2": ["Qwen2ForCausalLM"], "qwen3": ["Qwen3ForCausalLM"]}[arch]
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    head, n_q, n_kv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    extra = {"qwen2": {"q_proj.bias": n_q * head, "k_proj.bias": n_kv * head, "v_proj.bias": n_kv * head},
             "qwen3": {"q_norm.weight": head, "k_norm.weight": head}}[arch]
    shard = dest / SHARD1
    tensors = [(t.name, t.dtype, np.array(t.array())) for t in read_safetensors(shard)]
    index = json.loads((dest / INDEX).read_text())
    for layer in range(config["num_hidden_layers"]):
        for part, size in extra.items():
            name = f"model.layers.{layer}.self_attn.{part}"
            tensors.append((name, "F32", H.tensor_values(arch, name, (size,))))
            index["weight_map"][name] = SHARD1
    H.write_safetensors(shard, sorted(tensors), {"format": "pt"})
    (dest / INDEX).write_text(json.dumps(index, indent=2))
    return dest


def edit_json(path: Path, change) -> None:
    """Rewrite the JSON file `path` after `change(content)` changed its content in place."""
    content = json.loads(path.read_text())
    change(content)
    path.write_text(json.dumps(content))


def set_config(folder: Path, **values) -> None:
    edit_json(folder / "config.json", lambda c: c.update(values))


def read_header(path: Path) -> tuple[dict, bytes]:
    """A safetensors file's header (as JSON) and its data bytes."""
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_header(path: Path, header: dict, data: bytes, length: int | None = None) -> None:
    """A safetensors file of `header` and `data`; `length`: the header length field to write
    instead of the true one."""
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


def digests(*roots: Path) -> dict[Path, str]:
    """The sha256 of every file under `roots` (links followed, dangling ones left out)."""
    out = {}
    for root in roots:
        for p in sorted(root.rglob("*")) if root.is_dir() else [root]:
            if p.is_file():
                out[p] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def convert(folder: Path, out: Path, capsys, *args: str) -> tuple[int, str]:
    """llamapy-convert in this process; the inputs are checked to be unchanged."""
    before = digests(folder)
    code, err = run_tool("convert", folder, "-o", out, *args, capsys=capsys)
    assert digests(folder) == before, "an input was modified"
    return code, err


def refused(folder: Path, tmp_path: Path, capsys) -> str:
    """The one error line converting `folder` gives (no output file may be left)."""
    out = tmp_path / "out.gguf"
    code, err = convert(folder, out, capsys, "--outtype", "f32")
    assert code != 0
    assert not out.exists()
    return one_error(err)


@pytest.fixture
def llama(checkpoints, tmp_path) -> Path:
    """A copy of the llama checkpoint to spoil."""
    return Path(shutil.copytree(checkpoints("llama"), tmp_path / "llama"))


# ---- the checkpoints that are fine convert into files that load ---------------------------------

@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_the_variants_convert_and_load(checkpoints, tmp_path, capsys, arch):
    folder = variant(checkpoints("llama"), tmp_path / arch, arch)
    code, err = convert(folder, tmp_path / "out.gguf", capsys, "--outtype", "f32")
    assert code == 0, err
    assert llamapy.load_model(tmp_path / "out.gguf").hparams.arch == arch


# ---- shard paths stay inside the checkpoint's folder --------------------------------------------

@pytest.mark.parametrize("name", ["{tmp}/elsewhere/" + SHARD1, "../elsewhere/" + SHARD1,
                                  "sub/../../elsewhere/" + SHARD1, "C:\\elsewhere\\" + SHARD1])
def test_an_index_naming_a_file_out_of_the_folder_is_refused(llama, tmp_path, capsys, name):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copyfile(llama / SHARD1, elsewhere / SHARD1)  # a readable shard where the index points
    name = name.format(tmp=tmp_path)
    edit_json(llama / INDEX, lambda c: c["weight_map"].update({k: name for k, v in c["weight_map"].items()
                                                              if v == SHARD1}))
    line = refused(llama, tmp_path, capsys)
    assert f"shard {name!r} is not a file name inside the checkpoint's folder" in line
    assert str(llama / INDEX) in line


def test_a_shard_linking_out_of_the_folder_is_refused(llama, tmp_path, capsys):
    secret = tmp_path / "secret.safetensors"
    shutil.move(llama / SHARD1, secret)
    (llama / SHARD1).symlink_to(secret)
    line = refused(llama, tmp_path, capsys)
    assert f"shard {SHARD1} leads out of the checkpoint's folder (to {secret})" in line


def test_a_single_file_linking_out_of_the_folder_is_refused(checkpoints, tmp_path, capsys):
    folder = Path(shutil.copytree(checkpoints("gemma3"), tmp_path / "gemma3"))
    outside = tmp_path / "weights.bin"
    shutil.move(folder / "model.safetensors", outside)
    (folder / "model.safetensors").symlink_to(outside)
    assert "leads out of the checkpoint's folder" in refused(folder, tmp_path, capsys)


def test_a_hugging_face_cache_snapshot_converts(checkpoints, tmp_path, capsys):
    """The hub's cache keeps each file once in blobs/ and links to it from snapshots/REV/:
    links into the repository's own blobs are the checkpoint's files."""
    repo = tmp_path / "models--tiny--llama"
    snapshot, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for f in checkpoints("llama").iterdir():
        blob = blobs / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(Path("../../blobs") / blob.name)
    code, err = convert(snapshot, tmp_path / "out.gguf", capsys, "--outtype", "f32")
    assert code == 0, err
    llamapy.load_model(tmp_path / "out.gguf")


@pytest.mark.parametrize("index, expected", [
    ('{"weight_map": {"lm_head.weight": "model-00003-of-00003.safetensors", '
     '"lm_head.weight": "model-00001-of-00003.safetensors"}}', "the key 'lm_head.weight' is given twice"),
    ('[1, 2]', "has no weight_map of tensor names to files"),
    ('{"weight_map": ["a"]}', "has no weight_map of tensor names to files"),
    ('{"weight_map": {"lm_head.weight": 3}}', "has no weight_map of tensor names to files"),
    ('{"weight_map": {"lm_head.weight": ""}}', "shard '' is not a file name inside"),
    ('{"weight_map": {"lm_head.weight": "a\\nb"}}', "shard 'a\\nb' is not a file name inside"),
    ('{"weight_map": ' + "[" * 5000 + "]" * 5000 + "}", "JSON nested too deeply"),
    ('{"weight_map": {', "is not valid JSON"),
])
def test_a_malformed_index_is_one_line(llama, tmp_path, capsys, index, expected):
    (llama / INDEX).write_text(index)
    line = refused(llama, tmp_path, capsys)
    assert expected in line and str(llama / INDEX) in line


def test_a_shard_named_twice_is_read_once(llama, tmp_path, capsys):
    """./shard and shard are one file: its tensors are not "in two shards"."""
    edit_json(llama / INDEX, lambda c: c["weight_map"].update({"lm_head.weight": "./model-00003-of-00003.safetensors"}))
    code, err = convert(llama, tmp_path / "out.gguf", capsys, "--outtype", "f32")
    assert code == 0, err


# ---- config.json: each bad key is one line naming it, before any tensor data is read ---------

@pytest.mark.parametrize("values, expected", [
    ({"hidden_size": None}, "hidden_size must be a whole number, not null"),
    ({"hidden_size": 96}, "vocab_size 1000 and hidden_size 96 make model.embed_tokens.weight [1000, 96], but "
                          f"{SHARD1} has it as [1000, 64]"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers is 1000000000, but the weights hold 2 (model.layers.0 to "
                                   "model.layers.1)"),
    ({"num_hidden_layers": 1}, "num_hidden_layers is 1, but the weights hold 2"),
    ({"num_attention_heads": 0}, "num_attention_heads must be >= 1, not 0"),
    ({"num_attention_heads": 8}, "num_attention_heads 8, head_dim 16 and hidden_size 64 make "
                                 "model.layers.0.self_attn.q_proj.weight [128, 64]"),
    ({"num_key_value_heads": 3}, "num_key_value_heads 3 does not divide num_attention_heads 4"),
    ({"head_dim": None, "num_attention_heads": 6, "num_key_value_heads": 6},
     "num_attention_heads 6 does not divide hidden_size 64 (and there is no head_dim)"),
    ({"head_dim": 15}, "the head size 15 (head_dim, or hidden_size / num_attention_heads) is odd"),
    ({"rope_parameters": {"rope_theta": math.nan}}, "rope_parameters.rope_theta must be a finite number, not nan"),
    ({"rope_parameters": {"rope_theta": 0.5}}, "rope_parameters.rope_theta must be >= 1, not 0.5"),
    ({"rope_parameters": [10000.0]}, "rope_parameters must be a JSON object, not [10000.0]"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0}},
     "llama3 RoPE scaling needs high_freq_factor above low_freq_factor"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
     "yarn RoPE scaling needs original_max_position_embeddings"),
    ({"rms_norm_eps": "1e-5"}, "rms_norm_eps must be a number, not '1e-5'"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps must be > 0 as a float32"),
    ({"rms_norm_eps": 1e-50}, "rms_norm_eps must be > 0 as a float32"),
    ({"rms_norm_eps": math.inf}, "rms_norm_eps must be a finite number, not inf"),
    ({"vocab_size": 999}, "vocab_size 999 and hidden_size 64 make model.embed_tokens.weight [999, 64]"),
    ({"vocab_size": 1e12}, "vocab_size must be a whole number, not 1000000000000.0"),
    ({"vocab_size": 2**40}, "vocab_size must be <= 2147483647, not 1099511627776"),
    ({"intermediate_size": -128}, "intermediate_size must be >= 1, not -128"),
    ({"max_position_embeddings": 0}, "max_position_embeddings must be >= 1, not 0"),
    ({"max_position_embeddings": True}, "max_position_embeddings must be a whole number, not true"),
    ({"text_config": {"hidden_size": 32}}, "text_config.hidden_size 32 make model.embed_tokens.weight"),
    ({"text_config": {"num_attention_heads": "4"}}, "text_config.num_attention_heads must be a whole number"),
    ({"text_config": [1]}, "text_config must be a JSON object, not [1]"),
    ({"architectures": "LlamaForCausalLM"}, "architectures must be a list of class names"),
    ({"architectures": [["LlamaForCausalLM"]]}, "architectures must be a list of class names"),
])
def test_a_bad_config_value_is_one_line_naming_the_key(llama, tmp_path, capsys, values, expected):
    set_config(llama, **values)
    line = refused(llama, tmp_path, capsys)
    assert f"{llama / 'config.json'}: " in line and expected in line


@pytest.mark.parametrize("text, expected", [
    ('{"a": ' + "[" * 10_000 + "]" * 10_000 + "}", "JSON nested too deeply"),
    ("[1, 2]", "is not a JSON object"),
    ('"LlamaForCausalLM"', "is not a JSON object"),
    ('{"vocab_size": ' + "1" * 5000 + "}", "is not valid JSON"),
    ('{"vocab_size": 1000', "is not valid JSON"),
    ("", "is not valid JSON"),
])
def test_a_config_that_is_not_an_object_is_one_line(llama, tmp_path, capsys, text, expected):
    (llama / "config.json").write_text(text)
    line = refused(llama, tmp_path, capsys)
    assert str(llama / "config.json") in line and expected in line


def test_a_missing_key_is_the_config_class_default_checked_against_the_weights(llama, tmp_path, capsys):
    """transformers' default for a key left out (hidden_size 4096) does not fit the weights."""
    edit_json(llama / "config.json", lambda c: c.pop("hidden_size"))
    assert "hidden_size 4096 make model.embed_tokens.weight [1000, 4096]" in refused(llama, tmp_path, capsys)


def test_a_transposed_tensor_is_refused(llama, tmp_path, capsys):
    """k_proj's bytes with its shape swapped: a size the header allows, not the one config.json implies."""
    header, data = read_header(llama / SHARD1)
    header["model.layers.0.self_attn.k_proj.weight"]["shape"] = [64, 32]
    write_header(llama / SHARD1, header, data)
    line = refused(llama, tmp_path, capsys)
    assert ("num_key_value_heads 2, head_dim 16 and hidden_size 64 make model.layers.0.self_attn.k_proj.weight "
            f"[32, 64], but {SHARD1} has it as [64, 32]") in line


def test_a_layer_that_is_missing_is_named(llama, tmp_path, capsys):
    shard = llama / "model-00002-of-00003.safetensors"
    header, data = read_header(shard)
    del header["model.layers.1.self_attn.q_proj.weight"]
    write_header(shard, header, data)
    edit_json(llama / INDEX, lambda c: c["weight_map"].pop("model.layers.1.self_attn.q_proj.weight"))
    assert "the weights have no model.layers.1.self_attn.q_proj.weight" in refused(llama, tmp_path, capsys)


def test_a_tensor_the_architecture_has_not_is_named(checkpoints, tmp_path, capsys):
    """qwen2's biases in a qwen3 checkpoint: a GGUF tensor llamapy's qwen3 would not read."""
    folder = variant(checkpoints("llama"), tmp_path / "q", "qwen2")
    set_config(folder, architectures=["Qwen3ForCausalLM"], head_dim=16)
    assert "model.layers.0.self_attn.k_proj.bias (blk.0.attn_k.bias) is not part of a qwen3 model" in refused(
        folder, tmp_path, capsys)


@pytest.mark.parametrize("values, expected", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping is 30.0: llamapy runs Gemma 3 without"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping is set, which Gemma 3 does not have"),
    ({"sliding_window": None}, "sliding_window is missing"),
    ({"head_dim": None}, "head_dim must be a whole number, not null"),
    ({"rope_parameters": {"full_attention": {"rope_theta": -1.0}}},
     "rope_parameters.full_attention.rope_theta must be >= 1, not -1.0"),
    ({"vocab_size": 1016}, "vocab_size 1016 and hidden_size 64 make model.embed_tokens.weight [1016, 64]"),
])
def test_gemma3_keys(checkpoints, tmp_path, capsys, values, expected):
    folder = Path(shutil.copytree(checkpoints("gemma3"), tmp_path / "gemma3"))
    set_config(folder, **values)
    assert expected in refused(folder, tmp_path, capsys)


def test_more_tokenizer_pieces_than_vocab_size_is_refused(checkpoints, tmp_path, capsys):
    """gemma3's tokenizer.model has 1000 pieces; a vocab_size of 992 (and an embedding to
    match) would leave 8 token ids without a row."""
    folder = Path(shutil.copytree(checkpoints("gemma3"), tmp_path / "gemma3"))
    set_config(folder, vocab_size=992)
    header, data = read_header(folder / "model.safetensors")
    header["model.embed_tokens.weight"]["shape"] = [992, 64]
    header["model.embed_tokens.weight"]["data_offsets"][1] -= 16 * 64 * 2  # BF16 rows of 64
    write_header(folder / "model.safetensors", header, data)
    assert "tokenizer.model has 1000 pieces, but config.json's vocab_size is 992" in refused(folder, tmp_path,
                                                                                             capsys)


def test_an_untied_output_needs_a_row_per_token(checkpoints):
    """gemma3's embedding is cut to the tokenizer's tokens, an output projection is not: with
    fewer tokens than vocab_size, an lm_head would not match the vocabulary."""
    ckpt = open_checkpoint(checkpoints("gemma3"))
    arch = A.architecture_of(ckpt.config)
    cfg = A.read_config(arch, ckpt.config, ckpt.path / "config.json")
    named = text_tensors(arch, ckpt, cfg)
    check_vocabulary(arch, cfg, named, 1000, ckpt.path / "config.json")  # tied: the embedding is cut
    named["output.weight"] = ("lm_head.weight", named["token_embd.weight"][1])
    check_vocabulary(arch, cfg, named, 1008, ckpt.path / "config.json")
    with pytest.raises(CheckpointError, match=r"the tokenizer has 1000 tokens, but vocab_size is 1008: "
                                              r"lm_head.weight has 1008 rows"):
        check_vocabulary(arch, cfg, named, 1000, ckpt.path / "config.json")


@pytest.mark.parametrize("values, expected", [
    ({"temperature": "hot"}, "temperature must be a finite number in float32's range, not 'hot'"),
    ({"top_k": 1e300}, "top_k must be a whole number in int32's range"),
    ({"top_p": math.inf}, "top_p must be a finite number in float32's range, not inf"),
])
def test_a_bad_generation_config_is_one_line(llama, tmp_path, capsys, values, expected):
    edit_json(llama / "generation_config.json", lambda c: c.update(values))
    line = refused(llama, tmp_path, capsys)
    assert str(llama / "generation_config.json") in line and expected in line


@pytest.mark.parametrize("values", [{"vocab_size": 10**9}, {"num_hidden_layers": 10**9},
                                    {"intermediate_size": 2**31 - 1}, {"head_dim": 2**30}])
def test_memory_does_not_grow_with_a_config_number(llama, tmp_path, values):
    """Huge sizes are refused against the weights' headers before anything is sized by them."""
    set_config(llama, **values)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError):
            convert_checkpoint(llama, tmp_path / "out.gguf", "f32")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 * 2**20, f"{peak / 2**20:.0f} MB allocated"


# ---- safetensors headers that lie --------------------------------------------------------------

def _spoil(folder: Path, case: str) -> None:
    path = folder / SHARD1
    header, data = read_header(path)
    k, q = header["model.layers.0.self_attn.k_proj.weight"], header["model.layers.0.self_attn.q_proj.weight"]
    length = None
    if case == "huge header length":
        length = 2**63
    elif case == "header past the end":
        length = len(json.dumps(header)) + len(data) + 64
    elif case == "offsets past the end":
        k["data_offsets"] = [len(data), len(data) + 32 * 64 * 4]
    elif case == "overlap":
        k["data_offsets"] = [q["data_offsets"][0], q["data_offsets"][0] + 32 * 64 * 4]
    elif case == "dtype and length":
        k["dtype"] = "F16"
    elif case == "shape and length":
        k["shape"] = [32, 65]
    elif case == "wrapping shape":
        k["shape"], k["data_offsets"] = [2**32, 2**32, 2**10], [0, 0]  # 2**74 elements: 0 in int64
    elif case == "unknown dtype":
        k["dtype"] = "I64"
    elif case == "dtype not a string":
        k["dtype"] = ["F32"]
    elif case == "long dtype":
        k["dtype"] = "F32\n" + "F32" * 1000
    elif case == "bool shape":
        k["shape"] = [True, 64]
    elif case == "negative offset":
        k["data_offsets"] = [-8, 32 * 64 * 4 - 8]
    write_header(path, header, data, length)


@pytest.mark.parametrize("case, expected", [
    ("huge header length", "not a safetensors file (header of 9223372036854775808 bytes"),
    ("header past the end", "not a safetensors file (header of"),
    ("offsets past the end", "do not hold a F32 [32, 64] tensor inside the file's"),
    ("overlap", "overlap"),
    ("dtype and length", "do not hold a F16 [32, 64] tensor"),
    ("shape and length", "do not hold a F32 [32, 65] tensor"),
    ("wrapping shape", "do not hold a F32 [4294967296, 4294967296, 1024] tensor"),
    ("unknown dtype", "has dtype I64 (a dtype safetensors knows)"),
    ("dtype not a string", "has dtype ['F32'] (not a safetensors dtype)"),
    ("long dtype", "has dtype 'F32\\nF32F32"),
    ("bool shape", "bad shape or data_offsets in the header"),
    ("negative offset", "bad shape or data_offsets in the header"),
])
def test_a_lying_safetensors_header_is_one_line(llama, tmp_path, capsys, case, expected):
    _spoil(llama, case)
    line = refused(llama, tmp_path, capsys)
    assert str(llama / SHARD1) in line and expected in line


@pytest.mark.parametrize("header, expected", [
    (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
     b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', "'a' is given twice"),
    (b"[" * 5000 + b"]" * 5000, "the safetensors header is nested too deeply"),
    (b'{"a": ' + b"9" * 5000 + b"}", "the safetensors header is not JSON"),
    (b"\xff\xfe{}", "the safetensors header is not JSON"),
    (b"[]", "the safetensors header is not a JSON object"),
])
def test_a_header_that_is_not_a_tensor_table_is_one_line(llama, tmp_path, capsys, header, expected):
    path = llama / SHARD1
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    line = refused(llama, tmp_path, capsys)
    assert str(path) in line and expected in line


# ---- a PEFT adapter's base is checked the same way -------------------------------------------------

def test_a_peft_base_with_a_bad_config_is_one_line(llama, tmp_path, capsys):
    set_config(llama, num_key_value_heads=3)
    out = tmp_path / "a.gguf"
    code, err = run_tool("convert", "--lora", H.DATA / "llama-lora", "--base", llama, "-o", out, capsys=capsys)
    assert code != 0 and "num_key_value_heads 3 does not divide num_attention_heads 4" in one_error(err)
    assert not out.exists()
