"""Make the PEFT LoRA adapters of test_peft and record what transformers + peft and llama.cpp do
with them. Runs in the venv of record_hf_checkpoints.py, with peft installed too:

    /work/scratch/hfvenv/bin/pip install peft
    /work/scratch/hfvenv/bin/python tests/record_peft_adapters.py LLAMA_CPP_SRC LLAMA_CPP_BIN LLAMAPY_PYTHON

LLAMAPY_PYTHON is the project's Python (llamapy's tools run through it, from this worktree).

1. For each checkpoint of hf_checkpoints.PEFT_NAMES (llama: F32, Q/K rows that convert
   permutes; qwen2: BF16 with Q/K/V biases), a PEFT LoRA adapter (r 4, lora_alpha 8, the seven
   projections of every layer), its A and B drawn from seeds (B non-zero, so the adapter
   changes the logits), saved by peft's save_pretrained into tests/data/hf/NAME-lora
   (adapter_config.json, adapter_model.safetensors; the model card README.md it also writes is
   left out, as llamapy-convert leaves out model-card keys). Then, into its reference.json and
   logits.npz: transformers + peft's logits (float64) for the prompt of record_hf_checkpoints;
   convert_lora_to_gguf.py's output for each --outtype (every metadata key and tensor, as
   hf_checkpoints.gguf_listing lists them); llama-perplexity with --lora llamapy-convert's F32
   adapter on convert_hf_to_gguf.py's F32 base (running values and final estimate).
2. The LoRA of test_peft's export check: llamapy-finetune trains it on llamapy-convert's F32
   GGUF of the llama checkpoint (hf_checkpoints.FINETUNE_ARGS), llamapy-export-lora --to-peft
   writes it as a PEFT adapter, peft loads that onto transformers' model: its config, tensor
   names and shapes, transformers + peft's logits and how far llamapy's logits with the GGUF
   adapter are from them go to tests/data/hf/llama-finetuned/.

`record_peft_adapters.py logits BASE_DIR PEFT_DIR OUT.npz`: transformers + peft's logits of
one adapter (test_peft runs it when this venv exists).
"""
from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import peft
import torch
import transformers

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import hf_checkpoints as H  # noqa: E402
import record_hf_checkpoints as R  # noqa: E402

REPO = HERE.parent
RANK, ALPHA = 4, 8
B_SCALE = 0.1  # B drawn as a matrix (1/sqrt(r)) and scaled down: the adapter moves each weight by about 20%

LLAMAPY_LOGITS = """
import sys
import numpy as np
import llamapy
from ggmlpy import GGMLType
from llamapy.lora import LoraAdapter
model = llamapy.load_model(sys.argv[1])
ctx = llamapy.Context(model, n_ctx=64, n_threads=2, type_k=GGMLType.F32, type_v=GGMLType.F32, flash_attn=False)
ctx.attach_lora(LoraAdapter.load(sys.argv[2], model), 1.0)
ctx.decode(llamapy.Batch.from_tokens([int(x) for x in sys.argv[3].split(",")], all_outputs=True))
np.save(sys.argv[4], ctx.get_logits().astype(np.float64))
"""


def llamapy(python: str, *args: str) -> None:
    run = subprocess.run([python, *args], capture_output=True, text=True, cwd=REPO)
    if run.returncode:
        raise SystemExit(f"llamapy {' '.join(args[:2])} failed:\n{run.stderr[-3000:]}")


def peft_logits(base: Path, adapter: Path) -> tuple[list[int], np.ndarray]:
    """transformers + peft's prompt tokens and logits (float64) for `adapter` on `base`."""
    model = peft.PeftModel.from_pretrained(R.load_model(base), adapter)
    return R.prompt_logits(model.eval(), base)


def make_adapter(name: str, ckpt: Path, dest: Path) -> None:
    """The PEFT adapter of checkpoint `name`, its values from seeds, saved by peft into `dest`."""
    model = R.load_model(ckpt, torch.float32)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(H.PEFT_TARGETS), task_type="CAUSAL_LM")
    adapted = peft.get_peft_model(model, config)
    adapted.peft_config["default"].base_model_name_or_path = name
    for key, param in adapted.named_parameters():
        if ".lora_" in key:
            values = H.tensor_values(f"{name}-lora", key, tuple(param.shape))
            with torch.no_grad():
                param.copy_(torch.from_numpy(values * np.float32(B_SCALE if ".lora_B." in key else 1.0)))
    with tempfile.TemporaryDirectory() as tmp:
        adapted.save_pretrained(tmp)
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            shutil.copyfile(Path(tmp) / f, dest / f)


def record_adapter(name: str, src: Path, bin_dir: Path, python: str) -> None:
    dest = H.DATA / f"{name}-lora"
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt = H.write_checkpoint(name, tmp / name, R.SHARED)
        make_adapter(name, ckpt, dest)
        adapter = shutil.copytree(dest, tmp / dest.name)  # the folder's name is general.name's
        ids, logits = peft_logits(ckpt, adapter)
        R.save_logits(dest / "logits.npz", logits)
        listings = {}
        for outtype in R.OUTTYPES:
            out = tmp / f"{name}-lora-{outtype}.gguf"
            R.convert(src, adapter, outtype, out, "convert_lora_to_gguf.py", "--base", str(ckpt))
            listings[outtype] = H.gguf_listing(out)
        R.convert(src, ckpt, "f32", tmp / "base.gguf")
        llamapy(python, "-m", "llamapy.cli.convert", "--lora", str(adapter), "--base", str(ckpt), "-o",
                str(tmp / "mine.gguf"))
        if H.gguf_listing(tmp / "mine.gguf") != listings["f32"]:
            print(f"{name}: note: llamapy-convert's adapter differs from convert_lora_to_gguf.py's")
        ppl = R.perplexity(bin_dir, tmp / "base.gguf", tmp, "--lora", str(tmp / "mine.gguf"))
    reference = {"transformers": transformers.__version__, "torch": torch.__version__, "peft": peft.__version__,
                 "llama_cpp": R.llama_cpp_version(bin_dir), "prompt": R.PROMPT, "prompt_ids": ids,
                 "convert_lora_to_gguf": listings, "llama_perplexity": ppl}
    (dest / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
    print(f"{name}-lora: PPL with the adapter {ppl['ppl']}, "
          f"{sum(f.stat().st_size for f in dest.iterdir()) // 1024} KB recorded")


def record_finetuned(python: str) -> None:
    dest = H.DATA / "llama-finetuned"
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt = H.write_checkpoint("llama", tmp / "llama", R.SHARED)
        base, adapter, exported = tmp / "base.gguf", tmp / "adapter.gguf", tmp / "peft"
        text = tmp / "text.txt"
        text.write_text((R.SHARED / "data" / "tinystories_sample.txt").read_text()[:H.FINETUNE_CHARS])
        llamapy(python, "-m", "llamapy.cli.convert", str(ckpt), "-o", str(base), "--outtype", "f32")
        llamapy(python, "-m", "llamapy.cli.finetune", "-m", str(base), "-f", str(text), *H.FINETUNE_ARGS,
                "-o", str(adapter))
        llamapy(python, "-m", "llamapy.cli.export_lora", "-m", str(base), "--lora", str(adapter), "--to-peft",
                str(exported), "--base", str(ckpt))
        ids, logits = peft_logits(ckpt, exported)
        R.save_logits(dest / "logits.npz", logits)
        llamapy(python, "-c", LLAMAPY_LOGITS, str(base), str(adapter), ",".join(map(str, ids)), str(tmp / "mine.npy"))
        mine = np.load(tmp / "mine.npy")
        config = json.loads((exported / "adapter_config.json").read_text())
        tensors = safetensors_listing(exported / "adapter_model.safetensors")
    deviation = float((np.abs(mine - logits).max(axis=1) / np.abs(logits).max(axis=1)).max())
    config["base_model_name_or_path"] = "llama"  # the temporary folder it was
    reference = {"transformers": transformers.__version__, "torch": torch.__version__, "peft": peft.__version__,
                 "prompt_ids": ids, "adapter_config": config, "tensors": tensors,
                 "llamapy_max_deviation": deviation}
    (dest / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
    print(f"llama-finetuned: peft loads llamapy's export; llamapy's logits within {deviation:.2e} of each row's "
          "largest transformers + peft logit")


def safetensors_listing(path: Path) -> list:
    """[name, dtype, shape] of each tensor of a safetensors file, in its header's order."""
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    return [[name, entry["dtype"], entry["shape"]] for name, entry in header.items() if name != "__metadata__"]


def main() -> None:
    if sys.argv[1] == "logits":
        base, adapter, out = map(Path, sys.argv[2:5])
        R.save_logits(out, peft_logits(base, adapter)[1])
        return
    src, bin_dir, python = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    for name in H.PEFT_NAMES:
        record_adapter(name, src, bin_dir, python)
    record_finetuned(python)


if __name__ == "__main__":
    main()
