"""LoRA adapters between Hugging Face PEFT and llama.cpp's GGUF format, without PyTorch.

A PEFT LoRA adapter is a folder: adapter_config.json (peft_type LORA, r, lora_alpha,
target_modules, ...) and adapter_model.safetensors, whose tensors are named after the modules
of the transformers model: `base_model.model.<module>.lora_A.weight` ([r, n_in] in torch's
order) and `.lora_B.weight` ([n_out, r]). llama.cpp's `<gguf tensor>.lora_a` has ne [n_in, r]
and `.lora_b` ne [r, n_out]: the same values in the same memory order, so A and B are copied as
they are. The one change is llama's: convert permutes the rows of q_proj and k_proj (to
llama.cpp's interleaved RoPE pairs), so B of those, whose rows are W's rows, is permuted the
same way into GGUF and back out of it. Both adapters compute W x + (alpha / r) B A x.

`peft_to_gguf` writes what llama.cpp's convert_lora_to_gguf.py writes for the adapter (the same
tensors, types and metadata); `adapter_to_peft` writes a llamapy/llama.cpp adapter as a PEFT
folder that `peft.PeftModel.from_pretrained(model, folder)` loads onto the transformers model
of the checkpoint the GGUF base was converted from. Module names come from architectures.py's
one table, read in one direction or the other.
"""
from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ggmlpy.convert import bf16_to_f32
from llamapy.arch import Architecture
from llamapy.atomic import replace_atomically
from llamapy.errors import CheckpointError
from llamapy.lora import DEFAULT_MODULES, LoraAdapter, layer_module
from llamapy.model import Model
from llamapy.save import write_atomically

from . import OUTTYPES, QUANTIZATION_VERSION, tensor_out
from . import architectures as A
from .checkpoint import open_checkpoint
from .json_file import read_json
from .metadata import Meta, add_general, generation_config, model_title
from .safetensors import StTensor, read_safetensors, write_safetensors
from .tensor_check import text_tensors

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel's prefix of the transformers model's module names
_PARTS = {".lora_A.weight": "lora_a", ".lora_B.weight": "lora_b"}
# adapter_config.json settings that change what the adapter computes and that a GGUF adapter
# cannot hold (llama.cpp's converter ignores them, writing an adapter that computes otherwise)
_UNSUPPORTED = {"use_dora": "DoRA (use_dora)", "use_rslora": "rank-stabilized scaling (use_rslora)",
                "alpha_pattern": "per-module alphas (alpha_pattern)", "fan_in_fan_out": "fan_in_fan_out",
                "lora_bias": "LoRA biases (lora_bias)", "modules_to_save": "fully trained modules (modules_to_save)",
                "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
                "layer_replication": "layer_replication", "trainable_token_indices": "trainable_token_indices"}


# ---- PEFT -> GGUF ------------------------------------------------------------------------------

def read_peft_config(folder: Path) -> dict:
    """adapter_config.json of a PEFT LoRA adapter; CheckpointError with one line for anything
    else (no config, another PEFT method, a setting a GGUF adapter cannot hold)."""
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder: give the folder of a PEFT adapter")
    if not (folder / CONFIG).is_file():
        raise CheckpointError(f"{folder} has no {CONFIG}: not a PEFT adapter")
    config = read_json(folder / CONFIG)
    if not isinstance(config, dict):
        raise CheckpointError(f"{folder / CONFIG} is not a JSON object")
    kind = config.get("peft_type")
    if kind != "LORA":
        raise CheckpointError(f"{folder / CONFIG}: peft_type {kind!r}: only LoRA adapters (LORA) convert")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise CheckpointError(f"{folder / CONFIG}: {what} is not supported by GGUF LoRA adapters")
    alpha = config.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not np.isfinite(alpha):
        raise CheckpointError(f"{folder / CONFIG}: lora_alpha must be a number, got {alpha!r}")
    return config


def _adapter_weights(folder: Path) -> list[StTensor]:
    if not (folder / WEIGHTS).is_file():
        bins = (folder / "adapter_model.bin").is_file()
        raise CheckpointError(f"{folder} has PyTorch weights (adapter_model.bin) only: save the adapter as "
                              f"safetensors first" if bins else f"{folder} has no {WEIGHTS}")
    return sorted(read_safetensors(folder / WEIGHTS), key=lambda t: t.name)  # in safetensors' key order, as read


def _base_of(name: str, where: Path) -> tuple[str, str]:
    """(the checkpoint tensor adapted, "lora_a" or "lora_b") of an adapter tensor."""
    for suffix, part in _PARTS.items():
        if name.startswith(PREFIX) and name.endswith(suffix):
            return name[len(PREFIX):-len(suffix)] + ".weight", part
    if "lora_embedding_" in name:
        raise CheckpointError(f"{where}: {name} adapts the token embeddings, which GGUF LoRA adapters in llamapy "
                              f"do not (each layer's {', '.join(DEFAULT_MODULES)})")
    raise CheckpointError(f"{where}: tensor {name!r} is not a LoRA A or B ({PREFIX}MODULE.lora_A.weight or "
                          ".lora_B.weight)")


def _float32(t: StTensor) -> np.ndarray:
    """F32 and F16 values as they are (the outtype converts them), BF16 ones as float32."""
    x = t.array()
    return bf16_to_f32(x) if t.dtype == "BF16" else x


def adapter_outtype(folder: str | os.PathLike) -> str:
    """convert_lora_to_gguf.py's --outtype auto: bf16 for a BF16 adapter, else f16 (the type
    of its first A, in safetensors' key order)."""
    first = next((t for t in _adapter_weights(Path(folder)) if t.name.endswith(".lora_A.weight")), None)
    return {"BF16": "bf16", "F16": "f16"}.get(first.dtype if first else "", "f16")


def peft_to_gguf(folder: str | os.PathLike, base: str | os.PathLike, out: str | os.PathLike,
                 outtype: str = "f32", log: Callable[[str], None] | None = None) -> Path:
    """Convert the PEFT LoRA adapter in `folder`, trained on the Hugging Face checkpoint in
    `base`, to llama.cpp's GGUF adapter at `out` (atomically), as convert_lora_to_gguf.py
    writes it: A and B as the outtype (f32, its default, f16, bf16 or q8_0), adapter.lora.alpha,
    general.name from the adapter folder's name. The base's config.json and the shapes of its
    weights (headers only) check the adapter. Raises CheckpointError with one line for
    anything it cannot convert."""
    folder, where = Path(folder), Path(folder) / WEIGHTS
    config = read_peft_config(folder)
    ckpt = open_checkpoint(Path(base))
    arch = A.architecture_of(ckpt.config, ckpt.path / "config.json")
    cfg = A.read_config(arch, ckpt.config, ckpt.path / "config.json")
    text_tensors(arch, ckpt, cfg)  # the base's weights are the ones its config.json describes
    hp = A.hyperparameters(arch, cfg)
    pairs: dict[str, dict[str, StTensor]] = {}
    for t in _adapter_weights(folder):
        hf, part = _base_of(t.name, where)
        pairs.setdefault(hf, {})[part] = t
    if not pairs:
        raise CheckpointError(f"{where} holds no tensors")
    for hf, ab in pairs.items():
        if set(ab) != {"lora_a", "lora_b"}:
            raise CheckpointError(f"{where}: {hf[:-len('.weight')]} has lora_{'A' if 'lora_a' in ab else 'B'} "
                                  "but not the other")
    matrix_type, _ = OUTTYPES[outtype]
    text_names = {A.text_tensor_name(n): n for n in ckpt.tensors}
    tensors = []
    for hf, ab in pairs.items():
        gguf = A.gguf_name(arch, A.text_tensor_name(hf) or hf, hp["num_hidden_layers"])
        if layer_module(gguf) not in DEFAULT_MODULES:
            raise CheckpointError(f"{where}: the adapter adapts {hf[:-len('.weight')]} ({gguf}); GGUF adapters in "
                                  f"llamapy adapt each layer's {', '.join(DEFAULT_MODULES)}")
        weight = ckpt.tensors.get(text_names.get(hf, hf))
        a, b = ab["lora_a"], ab["lora_b"]
        if weight is None:
            raise CheckpointError(f"{where}: the base {ckpt.path} has no {hf}")
        if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != b.shape[1] or a.shape[0] < 1 \
                or (b.shape[0], a.shape[1]) != weight.shape:
            raise CheckpointError(f"{where}: {hf[:-len('.weight')]}: lora_A {list(a.shape)} and lora_B "
                                  f"{list(b.shape)} do not fit the base's {list(weight.shape)}")
        heads = A.permuted_heads(arch, hf, hp["num_attention_heads"], hp["num_key_value_heads"])

        def values_b(b=b, heads=heads) -> np.ndarray:
            return A.permute_rows(_float32(b), heads) if heads else _float32(b)
        tensors += [tensor_out(f"{gguf}.lora_a", lambda a=a: _float32(a), matrix_type, a.shape),
                    tensor_out(f"{gguf}.lora_b", values_b, matrix_type, b.shape)]
    meta = Meta()
    meta.string("general.architecture", arch.name)
    meta.string("general.type", "adapter")
    meta.string("adapter.type", "lora")
    add_general(meta, generation_config(folder / "generation_config.json"), model_title(folder.resolve().name), 0)
    meta.f32("adapter.lora.alpha", float(config["lora_alpha"]))
    meta.u32("general.quantization_version", QUANTIZATION_VERSION)
    if log:
        log(f"convert: {folder.name}: a LoRA adapter of {len(pairs)} {arch.name} matrices (r {config.get('r')}, "
            f"alpha {config['lora_alpha']}) -> {outtype.upper()}")
    return write_atomically(meta, tensors, Path(out), "the converted adapter")


# ---- GGUF -> PEFT ------------------------------------------------------------------------------

def _architecture(model: Model) -> Architecture:
    convertible = A.convertible()
    for arch in convertible:
        if arch.name == model.hparams.arch:
            return arch
    known = ", ".join(a.name for a in convertible)
    raise CheckpointError(f"{model.path.name} is a {model.hparams.arch} model: PEFT adapters are written for the "
                          f"architectures llamapy-convert knows ({known})")


def peft_tensors(model: Model, adapter: LoraAdapter) -> tuple[Architecture, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """The adapter's A and B per transformers module (float32, in torch's order), B's rows
    of llama's q_proj and k_proj back in the checkpoint's order."""
    arch, hp = _architecture(model), model.hparams
    out = {}
    for gguf, (a, b) in adapter.tensors.items():
        hf = A.hf_name(arch, gguf)
        heads = A.permuted_heads(arch, hf, hp.n_head, hp.n_head_kv)
        lora_b = np.asarray(b.array()[0, 0], np.float32)
        out[hf[:-len(".weight")]] = (np.asarray(a.array()[0, 0], np.float32),
                                     A.unpermute_rows(lora_b, heads) if heads else lora_b)
    return arch, out


def peft_config(adapter: LoraAdapter, modules: dict[str, tuple[np.ndarray, np.ndarray]], n_layers: int,
                base_model: str | None) -> dict:
    """adapter_config.json: r the most common rank (rank_pattern for the others), lora_alpha
    such that each module's alpha / r is llama.cpp's scale (alpha 0 means a scale of 1 in
    llama.cpp: lora_alpha is then each module's rank, through alpha_pattern where it differs),
    target_modules the short module names when every layer has them all, else the full names."""
    ranks = {m: a.shape[0] for m, (a, _) in modules.items()}
    r = Counter(ranks.values()).most_common(1)[0][0]
    rank_pattern = {m: k for m, k in ranks.items() if k != r}
    alpha = adapter.alpha if adapter.alpha else r
    alpha = int(alpha) if float(alpha).is_integer() else alpha  # as PEFT writes a whole one
    alpha_pattern = dict(rank_pattern) if not adapter.alpha else {}
    short = sorted({m.rpartition(".")[2] for m in modules})
    layered = {(m.split(".")[2], m.split(".", 3)[3]) for m in modules}
    sub_modules = {m for _, m in layered}
    every_layer = len(layered) == n_layers * len(sub_modules) and len(sub_modules) == len(short)
    return {"alpha_pattern": alpha_pattern, "base_model_name_or_path": base_model, "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "lora_alpha": alpha,
            "lora_dropout": 0.0, "modules_to_save": None, "peft_type": "LORA", "r": r, "rank_pattern": rank_pattern,
            "target_modules": short if every_layer else sorted(modules), "task_type": "CAUSAL_LM",
            "use_dora": False, "use_rslora": False}


def adapter_to_peft(model: Model, adapter: LoraAdapter, folder: str | os.PathLike, base_model: str | None = None,
                    log: Callable[[str], None] | None = None) -> Path:
    """Write `adapter` (on the GGUF `model`, which llamapy-convert or convert_hf_to_gguf.py
    made from a Hugging Face checkpoint) as a PEFT LoRA adapter in `folder` (created; each
    file written atomically). `base_model`: adapter_config.json's base_model_name_or_path,
    the checkpoint's folder or model id (a folder is checked against the model: architecture
    and the shapes of the adapted weights). A folder that already holds an adapter is refused
    (`check_peft_folder`)."""
    folder = Path(folder)
    check_peft_folder(folder)
    arch, modules = peft_tensors(model, adapter)
    if base_model is not None and (Path(base_model) / "config.json").is_file():
        _check_base(Path(base_model), arch, modules)
    config = peft_config(adapter, modules, model.hparams.n_layer, base_model)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = [(f"{PREFIX}{m}{suffix}", "F32", ab[i]) for m, ab in modules.items()
               for i, suffix in enumerate(_PARTS)]
    tensors.sort(key=lambda t: t[0])
    replace_atomically(folder / WEIGHTS, lambda f: write_safetensors(f, tensors, {"format": "pt"}), "PEFT weights",
                       validate=read_safetensors)
    replace_atomically(folder / CONFIG, lambda f: f.write((json.dumps(config, indent=2) + "\n").encode()),
                       "PEFT config", validate=read_json)
    if log:
        log(f"export-lora: a PEFT LoRA adapter of {len(modules)} modules (r {config['r']}, lora_alpha "
            f"{config['lora_alpha']}) in {folder}")
    return folder


def peft_folder_files(folder: str | os.PathLike) -> list[Path]:
    """The files `adapter_to_peft` writes into `folder`."""
    return [Path(folder) / WEIGHTS, Path(folder) / CONFIG]


def check_peft_folder(folder: str | os.PathLike) -> None:
    """`folder` can take a new PEFT adapter: a new or empty folder, or one without adapter
    files; an adapter already there is not overwritten (CheckpointError naming it)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(f"{folder} is a file: --to-peft names the folder to write the adapter into")
    if folder.is_dir():
        held = [name for name in (CONFIG, WEIGHTS, "adapter_model.bin")
                if (folder / name).exists() or (folder / name).is_symlink()]
        if held:
            raise CheckpointError(f"{folder} already holds a PEFT adapter ({', '.join(held)}): it is not "
                                  "overwritten; give a new or empty folder")


def _check_base(base: Path, arch: Architecture, modules: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """The checkpoint `base` is the model's: its architecture, and its weights of the adapted
    modules exist with the adapter's shapes."""
    ckpt = open_checkpoint(base)
    if (base_arch := A.architecture_of(ckpt.config, ckpt.path / "config.json")).name != arch.name:
        raise CheckpointError(f"{base} is a {base_arch.name} checkpoint, the model {arch.name}")
    for module, (a, b) in modules.items():
        weight = ckpt.tensors.get(f"{module}.weight")
        if weight is None or weight.shape != (b.shape[0], a.shape[1]):
            found = "has no such weight" if weight is None else f"has it as {list(weight.shape)}"
            raise CheckpointError(f"{base}: the adapter's {module} is {[b.shape[0], a.shape[1]]}, the checkpoint "
                                  f"{found}: not the checkpoint the model was converted from")
