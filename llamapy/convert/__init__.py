"""Hugging Face checkpoints to GGUF without PyTorch: `convert_checkpoint(folder, out, outtype)`.

The file written holds what llama.cpp's convert_hf_to_gguf.py writes for the same checkpoint:
the same tensors (names, shapes, types, bytes) in the same order and the same metadata keys,
values and value types in the same order (architectures.py, vocab.py, special_tokens.py), with
llamapy's own GGUF writer. Weights are read memory-mapped and each tensor is converted while
it is written, so a conversion needs little more memory than its largest tensor.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ggmlpy import GGMLType
from ggmlpy.convert import bf16_to_f32, f32_to_bf16
from ggmlpy.quants import quantize
from ggmlpy.types import TYPE_TRAITS
from llamapy.arch import Architecture
from llamapy.errors import CheckpointError
from llamapy.gguf_writer import TensorOut
from llamapy.save import write_atomically

from . import architectures as A
from .checkpoint import Checkpoint, open_checkpoint
from .json_file import optional_json
from .metadata import Meta, add_general, generation_config, model_title
from .safetensors import StTensor
from .special_tokens import gather
from .tensor_check import check_vocabulary, text_tensors
from .vocab import add_bpe_vocab, add_spm_vocab, bpe_token_count

# --outtype: the type of the matrices, and general.file_type (llama_ftype)
OUTTYPES = {"f32": (GGMLType.F32, 0), "f16": (GGMLType.F16, 1), "bf16": (GGMLType.BF16, 32),
            "q8_0": (GGMLType.Q8_0, 7)}
QUANTIZATION_VERSION = 2


def outtype_of(folder: str | os.PathLike) -> str:
    """llama.cpp's --outtype auto: bf16 when the first matrix of the checkpoint is BF16, else f16."""
    for st in open_checkpoint(Path(folder)).tensors.values():
        if len(st.shape) >= 2 and st.dtype in ("BF16", "F16"):
            return st.dtype.lower()
    return "f16"


def convert_checkpoint(folder: str | os.PathLike, out: str | os.PathLike, outtype: str = "f16",
                       log: Callable[[str], None] | None = None, name: str | None = None) -> Path:
    """Convert the Hugging Face checkpoint in `folder` to a GGUF file at `out` (written
    atomically); `outtype` is f32, f16, bf16 or q8_0 (norms, biases and 1-d tensors stay F32);
    `name`: general.name (default: the model id or the folder's name, as llama.cpp's).
    Raises CheckpointError with one line for anything it cannot convert."""
    if outtype not in OUTTYPES:
        raise CheckpointError(f"unknown outtype {outtype!r}: use one of {', '.join(OUTTYPES)}")
    ckpt = open_checkpoint(Path(folder))
    arch = A.architecture_of(ckpt.config, ckpt.path / "config.json")
    cfg = A.read_config(arch, ckpt.config, ckpt.path / "config.json")
    named = text_tensors(arch, ckpt, cfg)  # headers against config.json, before any data or vocabulary
    hp = A.hyperparameters(arch, cfg)
    generation = generation_config(ckpt.path / "generation_config.json")
    matrix_type, file_type = OUTTYPES[outtype]
    meta = Meta()
    meta.string("general.architecture", arch.name)
    meta.string("general.type", "model")
    vocab = Meta()  # written last, but the gemma3 embedding needs the token count first
    n_vocab = _vocabulary(vocab, arch, ckpt, hp)
    check_vocabulary(arch, cfg, named, n_vocab, ckpt.path / "config.json")
    tensors = _tensors(arch, named, hp, n_vocab, matrix_type)
    n_params = sum(int(np.prod(t.ne)) for t in tensors)
    add_general(meta, generation, name or _model_name(ckpt), n_params)
    A.write_hyperparameters(meta, arch, hp, file_type)
    meta.u32("general.quantization_version", QUANTIZATION_VERSION)
    meta.update(vocab)
    if log:
        log(f"convert: {ckpt.path.name}: {arch.name}, {len(tensors)} tensors, {n_params:,} parameters, "
            f"{len(meta)} metadata keys -> {outtype.upper()}")
    return write_atomically(meta, tensors, Path(out), "the converted model")


def _model_name(ckpt: Checkpoint) -> str:
    """general.name: config.json's _name_or_path when it is a model id, else the folder's name."""
    given = ckpt.config.get("_name_or_path")
    model_id = given if isinstance(given, str) and given.count("/") <= 1 else ckpt.path.resolve().name
    return model_title(model_id if " " in model_id else model_id.split("/")[-1])


def _vocabulary(meta: Meta, arch: Architecture, ckpt: Checkpoint, hp: dict) -> int:
    """The tokenizer keys (module vocab), in the path convert_hf_to_gguf.py takes for the
    architecture; returns the number of tokens."""
    folder, vocab_size = ckpt.path, hp.get("vocab_size")
    has_spm, has_json = (folder / "tokenizer.model").is_file(), (folder / "tokenizer.json").is_file()
    if not has_spm and not has_json:
        raise CheckpointError(f"{folder} has neither tokenizer.model nor tokenizer.json")
    if arch.hf.tokenizer == "llama":
        tconf = optional_json(folder / "tokenizer_config.json") or {}
        if tconf.get("add_prefix_space") is not None:
            meta.bool("tokenizer.ggml.add_space_prefix", tconf["add_prefix_space"])
        if has_spm:
            n = add_spm_vocab(meta, folder, ckpt.config, vocab_size)
        elif _is_llama_hf_json(folder):
            raise CheckpointError(f"{folder}: a SentencePiece-style tokenizer.json without tokenizer.model is not "
                                  "supported")
        else:
            n = add_bpe_vocab(meta, folder, ckpt.config, vocab_size)
        if vocab_size == 32016:  # CodeLlama: its infill tokens (only EOT has a GGUF key)
            extra = gather(folder, ckpt.config, types=("prefix", "suffix", "middle", "eot"))
            extra.ids.setdefault("eot", 32010)
            extra.write(meta)
        if vocab_size == 49152:  # granite small models: no BOS
            meta.bool("tokenizer.ggml.add_bos_token", False)
        return n
    gemma = arch.hf.tokenizer == "gemma"
    if has_spm:
        n = add_spm_vocab(meta, folder, ckpt.config, vocab_size)
        if gemma:
            meta.bool("tokenizer.ggml.add_space_prefix", False)
        return n
    n = add_bpe_vocab(meta, folder, ckpt.config, vocab_size)
    return bpe_token_count(folder) if gemma else n


def _is_llama_hf_json(folder: Path) -> bool:
    """tokenizer.json of a SentencePiece-style BPE (byte fallback), which llama.cpp converts
    through its LlamaHfVocab path, not as byte-level BPE."""
    model = (optional_json(folder / "tokenizer.json") or {}).get("model", {})
    return model.get("type") == "BPE" and bool(model.get("byte_fallback"))


def _tensors(arch: Architecture, named: dict[str, tuple[str, StTensor]], hp: dict, n_vocab: int,
             matrix_type: GGMLType) -> list[TensorOut]:
    """Every tensor to write (`named`: GGUF name -> checkpoint tensor, checked), in convert's
    order (its extra tensors first), each converted lazily."""
    out = [tensor_out(name, make, matrix_type) for name, make in A.extra_tensors(arch, hp)]
    for gguf, (hf_name, st) in named.items():
        name = A.text_tensor_name(hf_name)

        def values(st=st, name=name) -> np.ndarray:
            x = st.array()
            x = bf16_to_f32(x) if st.dtype == "BF16" else x  # convert keeps F16 and F32, makes the rest F32
            return A.transform(arch, hp, name, x, n_vocab)
        out.append(tensor_out(gguf, values, matrix_type, _shape_after(arch, name, st.shape, n_vocab)))
    return out


def _shape_after(arch: Architecture, name: str, shape: tuple[int, ...], n_vocab: int) -> tuple[int, ...]:
    if arch.hf.norm_shift and "embed_tokens.weight" in name:
        return (min(shape[0], n_vocab), *shape[1:])
    return shape


def tensor_out(name: str, values: Callable[[], np.ndarray], matrix_type: GGMLType,
                shape: tuple[int, ...] | None = None) -> TensorOut:
    """A tensor of the output: its type chosen as convert chooses it (1-d tensors, norms and
    biases F32; matrices, LoRA A and B included, the outtype; Q8_0 rows that are not whole
    blocks F16), its bytes made when the writer asks for them."""
    if shape is None:
        shape = values().shape
    kind = matrix_type
    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith((".weight", ".lora_a", ".lora_b")):
        kind = GGMLType.F32
    elif kind == GGMLType.Q8_0 and shape[-1] % TYPE_TRAITS[GGMLType.Q8_0].blck_size:
        kind = GGMLType.F16

    def data() -> np.ndarray:
        x = values()
        if kind == GGMLType.F32:
            x = x.astype(np.float32)
        elif kind == GGMLType.F16:
            x = x.astype(np.float16)
        elif kind == GGMLType.BF16:
            x = f32_to_bf16(x.astype(np.float32))
        else:
            x = quantize(x.astype(np.float32), kind)
        return np.ascontiguousarray(x).reshape(-1).view(np.uint8)
    return TensorOut(name, kind, tuple(reversed(shape)), lambda: [data()])

