"""PEFT LoRA adapters both ways, against llama.cpp's convert_lora_to_gguf.py, transformers + peft
and llama-perplexity (recorded by tests/record_peft_adapters.py in the venv with PyTorch):

- tests/data/hf/{llama,qwen2}-lora: PEFT adapters (r 4, alpha 8, the seven projections, B
  non-zero) of the llama checkpoint (whose Q/K rows convert permutes) and the qwen2 one (BF16,
  Q/K/V biases), as peft's save_pretrained wrote them;
- tests/data/hf/llama-finetuned: what peft made of the LoRA llamapy-finetune trains on the llama
  checkpoint, exported by llamapy-export-lora --to-peft (and how close llamapy's logits were).
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import hf_checkpoints as H
import llamapy
import conftest
from conftest import shared_path
from ggmlpy import GGMLType
from llamapy.convert.peft import PREFIX, adapter_to_peft, peft_to_gguf
from llamapy.convert.safetensors import read_safetensors
from llamapy.lora import LoraAdapter
from llamapy.perplexity import perplexity

OUTTYPES = ("f32", "f16", "bf16", "q8_0")
HF_VENV = Path("/work/scratch/hfvenv/bin/python")


def adapter_dir(name: str) -> Path:
    return H.DATA / f"{name}-lora"


def reference(folder: str) -> dict:
    return json.loads((H.DATA / folder / "reference.json").read_text())


@pytest.fixture(scope="session")
def gguf_adapters(checkpoints, tmp_path_factory):
    """(name, outtype) -> llamapy-convert's GGUF of the recorded PEFT adapter, converted on first use."""
    root = tmp_path_factory.mktemp("adapters")
    done: dict = {}

    def get(name: str, outtype: str):
        if (name, outtype) not in done:
            done[name, outtype] = peft_to_gguf(adapter_dir(name), checkpoints(name), root / f"{name}-{outtype}.gguf",
                                               outtype)
        return done[name, outtype]
    return get


def logits_with(model_path: Path, adapter_path: Path, ids: list[int]) -> np.ndarray:
    """llamapy's logits (float64) of every position of `ids` with the adapter, in float32 as
    the files say (KV cache F32, no flash attention: test_convert's settings)."""
    model = llamapy.load_model(model_path)
    ctx = llamapy.Context(model, n_ctx=64, n_threads=2, type_k=GGMLType.F32, type_v=GGMLType.F32, flash_attn=False)
    ctx.attach_lora(LoraAdapter.load(adapter_path, model), 1.0)
    ctx.decode(llamapy.Batch.from_tokens(ids, all_outputs=True))
    return ctx.get_logits().astype(np.float64)


# ---- PEFT -> GGUF -----------------------------------------------------------------------------

@pytest.mark.parametrize("outtype", OUTTYPES)
@pytest.mark.parametrize("name", H.PEFT_NAMES)
def test_the_adapter_is_convert_lora_to_gguf_s(name, outtype, gguf_adapters):
    """Every metadata key (order, type, value) and every tensor (order, name, ne, type, sha256
    of its bytes) equals convert_lora_to_gguf.py's output for the same adapter and --outtype:
    llama's B of q_proj/k_proj with permuted rows, Q8_0 falling back to F16 for B (rows of r = 4)."""
    mine = H.gguf_listing(gguf_adapters(name, outtype))
    theirs = reference(f"{name}-lora")["convert_lora_to_gguf"][outtype]
    assert mine["metadata"] == theirs["metadata"] and list(mine["metadata"]) == list(theirs["metadata"])
    assert [t[:3] for t in mine["tensors"]] == [t[:3] for t in theirs["tensors"]]
    assert mine["tensors"] == theirs["tensors"]


@pytest.mark.parametrize("name", H.PEFT_NAMES)
def test_logits_with_the_adapter_are_transformers_peft_s(name, converted, gguf_adapters):
    """llamapy with the converted adapter on the converted F32 base gives transformers + peft's
    logits (float64) within 1e-4 of each position's largest logit."""
    ref = reference(f"{name}-lora")
    logits = logits_with(converted(name, "f32"), gguf_adapters(name, "f32"), ref["prompt_ids"])
    recorded = np.load(adapter_dir(name) / "logits.npz")
    H.assert_logits_match(logits, recorded, 1e-4)
    base = np.load(H.DATA / name / "logits.npz")  # the same ids without the adapter: it moves every position's
    moved = np.abs(recorded["logits"] - base["logits"]).max(axis=1) / np.abs(base["logits"]).max(axis=1)
    assert moved.min() > 1000 * 1e-4  # logits by far more than the tolerance (by 0.24 of the largest, and more)


@pytest.mark.parametrize("name", H.PEFT_NAMES)
def test_perplexity_with_the_adapter_is_llama_perplexity_s(name, converted, gguf_adapters, wiki_path):
    """llama-perplexity --lora took the converted adapter (on convert_hf_to_gguf.py's F32 base,
    the file test_convert shows equal to llamapy-convert's): llamapy's perplexity with it equals
    llama.cpp's, running values included, to the 4 decimals it prints."""
    ppl = reference(f"{name}-lora")["llama_perplexity"]
    text = wiki_path.read_bytes()[:ppl["text_bytes"]].decode("utf-8")
    model = llamapy.load_model(converted(name, "f32"))
    adapter = LoraAdapter.load(gguf_adapters(name, "f32"), model)
    result = perplexity(model, model.vocab.tokenize(text, add_special=True), n_ctx=ppl["ctx"], n_batch=ppl["batch"],
                        n_threads=2, adapters=[(adapter, 1.0)])
    running = [float(v) for v in re.findall(r"\[\d+\]([0-9.]+)", ppl["running"])]
    assert [f"{v:.4f}" for v in result.running] == [f"{v:.4f}" for v in running]
    assert result.ppl == pytest.approx(ppl["ppl"], rel=1e-4)
    base = reference(name)["llama_perplexity"]["ppl"]
    assert abs(result.ppl - base) > 1e-3 * base


# ---- GGUF -> PEFT -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", H.PEFT_NAMES)
def test_a_gguf_adapter_goes_back_to_the_same_peft_adapter(name, checkpoints, converted, gguf_adapters, tmp_path):
    """PEFT -> GGUF -> PEFT: the same tensors under the same names with the same bytes (llama's
    B of q_proj/k_proj un-permuted), and the config's r, lora_alpha and target_modules."""
    model = llamapy.load_model(converted(name, "f32"))
    adapter = LoraAdapter.load(gguf_adapters(name, "f32"), model)
    out = adapter_to_peft(model, adapter, tmp_path / "peft", str(checkpoints(name)))
    original = {t.name: t for t in read_safetensors(adapter_dir(name) / "adapter_model.safetensors")}
    mine = read_safetensors(out / "adapter_model.safetensors")
    assert [t.name for t in mine] == sorted(original)
    for t in mine:
        assert (t.dtype, t.shape) == (original[t.name].dtype, original[t.name].shape)
        assert t.array().tobytes() == original[t.name].array().tobytes(), t.name
    config, theirs = (json.loads((d / "adapter_config.json").read_text()) for d in (out, adapter_dir(name)))
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (theirs["r"], theirs["lora_alpha"], "LORA")
    assert sorted(config["target_modules"]) == sorted(theirs["target_modules"])
    assert config["base_model_name_or_path"] == str(checkpoints(name))


@pytest.fixture(scope="session")
def finetuned(checkpoints, converted, tmp_path_factory):
    """llamapy-finetune's LoRA on the llama checkpoint's F32 GGUF (hf_checkpoints.FINETUNE_ARGS,
    as recorded) and llamapy-export-lora --to-peft's folder of it: (base, adapter, peft folder)."""
    root = tmp_path_factory.mktemp("finetuned")
    text = root / "text.txt"
    text.write_text(shared_path("data", "tinystories_sample.txt").read_text()[:H.FINETUNE_CHARS])
    base, adapter, folder = converted("llama", "f32"), root / "adapter.gguf", root / "peft"
    for argv in (["finetune", "-m", str(base), "-f", str(text), *H.FINETUNE_ARGS, "-o", str(adapter)],
                 ["export-lora", "-m", str(base), "--lora", str(adapter), "--to-peft", str(folder),
                  "--base", str(checkpoints("llama"))]):
        code, _, err = conftest.run_tool(*argv)  # in this process: a child's start-up saved
        assert code == 0, err
    return base, adapter, folder


@pytest.mark.slow
def test_a_finetuned_lora_exports_to_what_peft_loaded(finetuned, checkpoints):
    """The --to-peft folder of a LoRA llamapy-finetune trained: adapter_config.json and the
    tensors' names, types and shapes are those peft loaded when recorded (every layer's seven
    projections, r 4, lora_alpha 8, base_model_name_or_path the --base given), and llamapy's
    logits with the GGUF adapter are the recorded transformers + peft logits of the export
    within 1e-4 of each position's largest (recorded: within 1.7e-7)."""
    base, adapter, folder = finetuned
    ref = reference("llama-finetuned")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(checkpoints("llama"))
    assert {**config, "base_model_name_or_path": "llama"} == ref["adapter_config"]
    assert (config["r"], config["lora_alpha"], len(config["target_modules"])) == (4, 8, 7)
    assert [[t.name, t.dtype, list(t.shape)] for t in read_safetensors(folder / "adapter_model.safetensors")] \
        == ref["tensors"]
    assert all(t[0].startswith(PREFIX + "model.layers.") for t in ref["tensors"]) and len(ref["tensors"]) == 2 * 7 * 2
    assert ref["llamapy_max_deviation"] < 1e-4
    H.assert_logits_match(logits_with(base, adapter, ref["prompt_ids"]), np.load(H.DATA / "llama-finetuned" /
                                                                                   "logits.npz"), 1e-4)


@pytest.mark.slow
@pytest.mark.skipif(not HF_VENV.exists(), reason=f"no {HF_VENV}: transformers, PyTorch and peft are not "
                    "installed (the recorded check is test_a_finetuned_lora_exports_to_what_peft_loaded)")
def test_peft_loads_the_export_now(finetuned, checkpoints, tmp_path):
    """Live, where the recording venv exists: peft.PeftModel.from_pretrained loads the export
    on transformers' model of the checkpoint, and its logits are llamapy's within 1e-4."""
    base, adapter, folder = finetuned
    out = tmp_path / "peft.npz"
    run = subprocess.run([str(HF_VENV), str(Path(__file__).parent / "record_peft_adapters.py"), "logits",
                          str(checkpoints("llama")), str(folder), str(out)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    ids = reference("llama-finetuned")["prompt_ids"]
    H.assert_logits_match(logits_with(base, adapter, ids), np.load(out), 1e-4)


# ---- bad input --------------------------------------------------------------------------------

def run_tool(name: str, *argv: str, capsys) -> tuple[int, str]:
    """The tool in this process (conftest.run_tool): exit code and stderr."""
    code, _, err = conftest.run_tool(name, *argv, capsys=capsys)
    return code, err


def error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _rewrite(folder: Path, change) -> None:
    """Rewrite the adapter's weights: `change(list of (name, dtype, values))` edits the list."""
    path = folder / "adapter_model.safetensors"
    tensors = [(t.name, t.dtype, np.array(t.array())) for t in read_safetensors(path)]
    change(tensors)
    H.write_safetensors(path, tensors, {"format": "pt"})


def _config(folder: Path, **changes) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


Q0 = PREFIX + "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("case, expected", [
    ("embeddings", "adapts the token embeddings"),
    ("lm_head", "the adapter adapts lm_head (output.weight)"),
    ("layer", "cannot map tensor 'model.layers.5.self_attn.q_proj.weight' to a llama GGUF tensor"),
    ("module", "cannot map tensor 'model.layers.0.self_attn.q_norm.weight'"),
    ("not lora", "tensor 'base_model.model.model.layers.0.self_attn.q_proj.weight' is not a LoRA A or B"),
    ("ia3", "peft_type 'IA3': only LoRA adapters (LORA) convert"),
    ("dora", "DoRA (use_dora) is not supported"),
    ("no config", "has no adapter_config.json: not a PEFT adapter"),
    ("shapes", "model.layers.0.self_attn.q_proj: lora_A [4, 32] and lora_B [64, 4] do not fit the base's [64, 64]"),
    ("half", "model.layers.0.self_attn.q_proj has lora_A but not the other"),
    ("no base", "--lora needs the checkpoint the adapter was trained on: --base HF_DIR"),
])
def test_bad_peft_adapters_are_one_line(case, expected, checkpoints, tmp_path, capsys):
    """Each adapter llamapy-convert --lora cannot convert: one error line, a non-zero exit, no file."""
    folder = shutil.copytree(adapter_dir("llama"), tmp_path / "llama-lora")
    def pair(module: str, n_out: int) -> list:  # a LoRA A and B of one more module (inputs of 64)
        return [(f"{PREFIX}{module}.lora_A.weight", "F32", np.zeros((4, 64), np.float32)),
                (f"{PREFIX}{module}.lora_B.weight", "F32", np.zeros((n_out, 4), np.float32))]
    if case == "embeddings":
        _rewrite(folder, lambda ts: ts.append((PREFIX + "model.embed_tokens.lora_embedding_A", "F32",
                                               np.zeros((4, 1000), np.float32))))
    elif case == "lm_head":
        _rewrite(folder, lambda ts: ts.extend(pair("lm_head", 1000)))
    elif case == "layer":
        _rewrite(folder, lambda ts: ts.extend(pair("model.layers.5.self_attn.q_proj", 64)))
    elif case == "module":
        _rewrite(folder, lambda ts: ts.extend(pair("model.layers.0.self_attn.q_norm", 64)))
    elif case == "not lora":
        _rewrite(folder, lambda ts: ts.append((Q0 + ".weight", "F32", np.zeros((64, 64), np.float32))))
    elif case == "ia3":
        _config(folder, peft_type="IA3")
    elif case == "dora":
        _config(folder, use_dora=True)
    elif case == "no config":
        (folder / "adapter_config.json").unlink()
    elif case == "shapes":
        _rewrite(folder, lambda ts: ts.__setitem__(
            next(i for i, t in enumerate(ts) if t[0] == Q0 + ".lora_A.weight"),
            (Q0 + ".lora_A.weight", "F32", np.zeros((4, 32), np.float32))))
    elif case == "half":
        _rewrite(folder, lambda ts: ts.remove(next(t for t in ts if t[0] == Q0 + ".lora_B.weight")))
    base = [] if case == "no base" else ["--base", str(checkpoints("llama"))]
    code, err = run_tool("convert", "--lora", str(folder), *base, "-o", str(tmp_path / "out.gguf"), capsys=capsys)
    assert code != 0
    assert expected in error_line(err)
    assert not (tmp_path / "out.gguf").exists()


@pytest.mark.parametrize("case, expected", [
    ("two adapters", "--to-peft writes one adapter as it is: give it with --lora FNAME (no scale)"),
    ("scaled", "--to-peft writes one adapter as it is"),
    ("and -o", "-o names a merged model, --to-peft a PEFT adapter's folder: give one"),
    ("base without", "--base names the Hugging Face checkpoint of a PEFT adapter: use it with --to-peft DIR"),
    ("other base", "is a qwen2 checkpoint, the model llama"),
])
def test_bad_exports_to_peft_are_one_line(case, expected, checkpoints, converted, gguf_adapters, tmp_path, capsys):
    """Each --to-peft that cannot be written: one error line, a non-zero exit, no folder."""
    model, adapter, out = str(converted("llama", "f32")), str(gguf_adapters("llama", "f32")), str(tmp_path / "peft")
    argv = {"two adapters": ["-m", model, "--lora", f"{adapter},{adapter}", "--to-peft", out],
            "scaled": ["-m", model, "--lora-scaled", f"{adapter}:0.5", "--to-peft", out],
            "and -o": ["-m", model, "--lora", adapter, "--to-peft", out, "-o", str(tmp_path / "m.gguf")],
            "base without": ["-m", model, "--lora", adapter, "--base", str(checkpoints("llama"))],
            "other base": ["-m", model, "--lora", adapter, "--to-peft", out, "--base", str(checkpoints("qwen2"))],
            }[case]
    code, err = run_tool("export-lora", *argv, capsys=capsys)
    assert code != 0
    assert expected in error_line(err)
    assert not (tmp_path / "peft").exists()


@pytest.mark.parametrize("alpha, expected_alpha, expected_alpha_pattern",
                         [(16.0, 16, {}), (0.0, 4, {"m.layers.1.x": 2})])
def test_ranks_that_differ_and_alpha_zero_keep_llama_cpp_s_scale(alpha, expected_alpha, expected_alpha_pattern):
    """Each module's lora_alpha / r (PEFT's scale, patterns applied) is llama.cpp's: alpha / its
    rank, or 1 for alpha 0; a module missing from a layer makes target_modules the full names."""
    from llamapy.convert.peft import peft_config
    modules = {f"m.layers.{i}.x": (np.zeros((r, 8)), np.zeros((8, r))) for i, r in ((0, 4), (1, 2), (2, 4))}
    config = peft_config(LoraAdapter(alpha, {}), modules, 3, None)
    assert (config["r"], config["rank_pattern"]) == (4, {"m.layers.1.x": 2})
    assert (config["lora_alpha"], config["alpha_pattern"]) == (expected_alpha, expected_alpha_pattern)
    for module, (a, _) in modules.items():
        scale = config["alpha_pattern"].get(module, config["lora_alpha"]) / config["rank_pattern"].get(module, 4)
        assert scale == (alpha / a.shape[0] if alpha else 1.0)
    assert config["target_modules"] == ["x"]
    assert peft_config(LoraAdapter(alpha, {}), dict(list(modules.items())[:2]), 3, None)["target_modules"] \
        == ["m.layers.0.x", "m.layers.1.x"]
