"""llamapy-convert against llama.cpp's convert_hf_to_gguf.py and transformers, on small random
Hugging Face checkpoints of each supported architecture (tests/hf_checkpoints.py rebuilds
them from seeds; tests/record_hf_checkpoints.py recorded what transformers, convert_hf_to_gguf.py
and llama-perplexity do with them, in tests/data/hf/NAME/reference.json and logits.npz).

- llama: Llama 2's layout, F32 weights in 3 shards with model.safetensors.index.json, untied
  output, a SentencePiece tokenizer.model (llama's settings) and Llama 2's chat template;
- llama3: Llama 3.2's layout, BF16, tied, RoPE scaling "llama3" (convert adds rope_freqs.weight),
  Llama 3's real 128,256-token BPE tokenizer.json (pre-tokenizer "llama-bpe" found by its hash,
  BOS from its TemplateProcessing), a list of EOS ids in config.json;
- qwen2: BF16, one file, tied embeddings, Q/K/V biases, a transformers-4 config.json, Qwen1.5's
  real 151,646-token BPE tokenizer.json (pre-tokenizer "qwen2" found by its hash);
- qwen3: F16, tied, head_dim 32 with hidden size 64 (Q is 128 wide), Q/K norms, the same tokenizer
  with Qwen3's chat template and EOS;
- gemma3: BF16, tied, norms stored minus 1, sliding window 4 (shorter than the prompt), a
  SentencePiece tokenizer with gemma's settings, config.json's vocab_size 8 past the tokenizer's,
  the chat template in chat_template.jinja.
"""
from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

import hf_checkpoints as H
import llamapy
from ggmlpy import GGMLType
from llamapy.cli.convert import tool
from llamapy.convert.safetensors import read_safetensors
from llamapy.perplexity import perplexity

OUTTYPES = ("f32", "f16", "bf16", "q8_0")


def reference(name: str) -> dict:
    return json.loads((H.DATA / name / "reference.json").read_text())


@pytest.mark.parametrize("outtype", OUTTYPES)
@pytest.mark.parametrize("name", H.NAMES)
def test_the_file_is_convert_hf_to_gguf_s(name, outtype, converted):
    """Every metadata key (in order, with its GGUF value type and value; arrays by item type,
    length and the sha256 of their bytes) and every tensor (in order: name, ne, type, the
    sha256 of its bytes) equals what convert_hf_to_gguf.py wrote. Nothing is allowed to differ.
    general.name comes from the folder's name, kept as the recording's (the checkpoint's name).
    What llamapy-convert leaves out never occurs in these checkpoints: authorship keys that
    llama.cpp derives from a model card (README.md: license, tags, base models, ...) or from
    a folder named like Qwen2.5-0.5B-Instruct (general.basename, .finetune, .version)."""
    mine = H.gguf_listing(converted(name, outtype))
    theirs = reference(name)["convert_hf_to_gguf"][outtype]
    assert list(mine["metadata"]) == list(theirs["metadata"])
    for key, value in theirs["metadata"].items():
        assert mine["metadata"][key] == value, key
    assert [t[:3] for t in mine["tensors"]] == [t[:3] for t in theirs["tensors"]]
    assert mine["tensors"] == theirs["tensors"]  # and their bytes


@pytest.mark.parametrize("name", H.NAMES)
def test_logits_are_transformers_s(name, converted):
    """llamapy on the F32 file gives transformers' logits (float64) for the prompt, within 1e-4
    of each position's largest logit, computed as the file says in float32: KV cache in F32,
    attention without flash attention (whose F16 rounding of Q is llama.cpp's, not the model's).
    gemma3 within 1e-3: ggml's GELU reads an F16 table (GGML_GELU_FP16), llama.cpp's and so
    llamapy's, where transformers computes the tanh form exactly. Its tokens are transformers'."""
    ref, recorded = reference(name), np.load(H.DATA / name / "logits.npz")
    model = llamapy.load_model(converted(name, "f32"))
    assert list(model.vocab.tokenize(ref["prompt"], add_special=True)) == ref["prompt_ids"]
    ctx = llamapy.Context(model, n_ctx=64, n_threads=2, type_k=GGMLType.F32, type_v=GGMLType.F32, flash_attn=False)
    ctx.decode(llamapy.Batch.from_tokens(ref["prompt_ids"], all_outputs=True))
    logits = ctx.get_logits().astype(np.float64)
    H.assert_logits_match(logits, recorded, 1e-3 if name == "gemma3" else 1e-4)


@pytest.mark.parametrize("name", H.NAMES)
def test_perplexity_is_llama_perplexity_s(name, converted, wiki_path):
    """llamapy's perplexity on the converted F32 file is llama-perplexity's (recorded on
    convert_hf_to_gguf.py's file, which the first test shows is the same file), running
    values included, to the 4 decimals it prints."""
    ppl = reference(name)["llama_perplexity"]
    text = wiki_path.read_bytes()[:ppl["text_bytes"]].decode("utf-8")
    model = llamapy.load_model(converted(name, "f32"))
    result = perplexity(model, model.vocab.tokenize(text, add_special=True), n_ctx=ppl["ctx"], n_batch=ppl["batch"],
                        n_threads=2)
    running = [float(v) for v in re.findall(r"\[\d+\]([0-9.]+)", ppl["running"])]
    assert [f"{v:.4f}" for v in result.running] == [f"{v:.4f}" for v in running]
    assert result.ppl == pytest.approx(ppl["ppl"], rel=1e-4)


def run_convert(*argv: str, capsys) -> tuple[int, str]:
    try:
        tool.main(list(argv))
        code = 0
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    return code, err


def error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_the_command_line_writes_the_file(checkpoints, converted, tmp_path, capsys):
    """llamapy-convert HF_DIR -o FILE --outtype T: the library's file; {ftype} in the name and
    --outtype auto (a BF16 checkpoint: bf16) as llama.cpp's converter."""
    code, _ = run_convert(str(checkpoints("gemma3")), "-o", str(tmp_path / "g-{ftype}.gguf"), capsys=capsys)
    assert code == 0
    assert (tmp_path / "g-bf16.gguf").read_bytes() == converted("gemma3", "bf16").read_bytes()


def _copy(src, dst, skip=()):
    shutil.copytree(src, dst, ignore=lambda d, names: [n for n in names if n in skip])
    return dst


@pytest.mark.parametrize("case, expected", [
    ("architecture", "architecture GPT2LMHeadModel is not supported (llamapy-convert converts LlamaForCausalLM"),
    ("missing shard", "missing shard model-00002-of-00003.safetensors (named by model.safetensors.index.json)"),
    ("index", "model.safetensors.index.json and the shards disagree: model.layers.0.mlp.extra_proj.weight named but "
              "in no shard"),
    ("tokenizer", "the BPE tokenizer is not one llama.cpp knows"),
    ("no tokenizer", "has neither tokenizer.model nor tokenizer.json"),
    ("no config", "has no config.json: not a Hugging Face checkpoint"),
    ("truncated", "do not hold a F32"),
    ("layer", "cannot map tensor 'model.layers.0.self_attn.q_norm.weight' to a llama GGUF tensor"),
    ("outtype", "unknown --outtype 'q4_k'"),
])
def test_bad_checkpoints_are_one_line(case, expected, checkpoints, tmp_path, capsys):
    """Each cannot-convert case: one error line, a non-zero exit, no output file."""
    llama = checkpoints("llama")
    folder, args = tmp_path / "ckpt", []
    if case == "architecture":
        _copy(llama, folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    elif case == "missing shard":
        _copy(llama, folder, skip=("model-00002-of-00003.safetensors",))
    elif case == "index":  # the index names a tensor no shard holds
        _copy(llama, folder)
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        index["weight_map"]["model.layers.0.mlp.extra_proj.weight"] = "model-00001-of-00003.safetensors"
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    elif case == "tokenizer":  # qwen2's layout with a small BPE tokenizer of its own: no known hash
        _copy(checkpoints("qwen2"), folder, skip=("tokenizer.json",))
        from tokenizers import Tokenizer, models, pre_tokenizers
        tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate("abcdefgh")}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel()
        tok.save(str(folder / "tokenizer.json"))
    elif case == "no tokenizer":
        _copy(llama, folder, skip=("tokenizer.model", "tokenizer.json"))
    elif case == "no config":
        _copy(llama, folder, skip=("config.json",))
    elif case == "truncated":
        _copy(llama, folder)
        shard = folder / "model-00003-of-00003.safetensors"
        shard.write_bytes(shard.read_bytes()[:-100])
    elif case == "layer":  # a Q norm, which llama has not
        _copy(checkpoints("llama"), folder)
        shard = folder / "model-00001-of-00003.safetensors"
        tensors = [(t.name, t.dtype, np.array(t.array())) for t in read_safetensors(shard)]
        tensors.append(("model.layers.0.self_attn.q_norm.weight", "F32", np.ones(16, np.float32)))
        H.write_safetensors(shard, tensors, {"format": "pt"})
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        index["weight_map"]["model.layers.0.self_attn.q_norm.weight"] = shard.name
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        _copy(llama, folder)
        args = ["--outtype", "q4_k"]
    code, err = run_convert(str(folder), "-o", str(tmp_path / "out.gguf"), *args, capsys=capsys)
    assert code != 0
    assert expected in error_line(err)
    assert not (tmp_path / "out.gguf").exists()
