"""Hugging Face checkpoints of the architectures llamapy runs, as llamapy-convert writes them:
what every family shares (the hyper-parameter keys convert_hf_to_gguf.py writes, in its order;
the global tensors' names; the checkpoint tensors of image and audio towers left out). What a
family adds (its config.json class names, its layer's tensor names, its defaults, llama's Q/K
row permutation, gemma3's +1 on its norm weights and its embedding rows past the vocabulary
cut off, its own keys and tensors) is its record's `hf` (llamapy/arch/hf.py), in the one
architecture registry the runtime reads.

convert_hf_to_gguf.py reads config.json through transformers, which fills in each config
class's defaults; `HFConversion.defaults` holds those for the keys read here, so a config.json
that leaves one out converts the same.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from llamapy.arch import ARCHITECTURES, Architecture
from llamapy.arch.hf import require
from llamapy.errors import CheckpointError

from . import config as C
from .config import TextConfig, rope_parameters
from .metadata import Meta

_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def convertible() -> list[Architecture]:
    """The registered architectures llamapy-convert converts, in the registry's order."""
    return [cls() for cls in ARCHITECTURES.values() if cls.hf is not None]


def architecture_of(config: dict, path: Path = Path("config.json")) -> Architecture:
    """The architecture config.json (read from `path`) names (text_config's name first, as
    llama.cpp does); CheckpointError with one line for a config.json of another shape."""
    C.check_layout(config, path)
    names = (config.get("text_config") or {}).get("architectures") or config.get("architectures") or []
    if not names:
        raise CheckpointError(f"{path} names no architecture (\"architectures\")")
    known = convertible()
    for arch in known:
        if names[0] in arch.hf.names:
            return arch
    listed = ", ".join(n for a in known for n in a.hf.names)
    raise CheckpointError(f"architecture {names[0]} is not supported (llamapy-convert converts {listed})")


def read_config(arch: Architecture, config: dict, path: Path) -> TextConfig:
    """config.json (read from `path`) as the architecture's checked record, the config
    class's defaults filled in; CheckpointError with one line naming a bad key."""
    return C.read_config(getattr(C, arch.hf.config_record), arch.hf.defaults, config, path)


def hyperparameters(arch: Architecture, cfg: TextConfig) -> dict:
    """The checked config.json as the dict the writer reads (text_config's keys on top,
    defaults filled in, llama's derived head counts and size added as its converter adds them)."""
    hp = cfg.values()
    if arch.hf.derived_heads:
        hp["num_key_value_heads"], hp["head_dim"] = cfg.n_kv_heads, cfg.head_size
    return hp


def _find(hp: dict, *keys: str):
    return next((hp[k] for k in keys if k in hp), None)


def write_hyperparameters(meta: Meta, arch: Architecture, hp: dict, file_type: int) -> None:
    """The {arch}.* keys and general.file_type, in convert_hf_to_gguf.py's order (the
    family's own keys last)."""
    a = arch.name
    rope = rope_parameters(hp)
    meta.u32(f"{a}.block_count", require(hp, "num_hidden_layers"))
    for key, names in (("context_length", ("max_position_embeddings", "n_ctx", "n_positions", "max_length",
                                           "max_sequence_length", "model_max_length")),
                       ("embedding_length", ("hidden_size", "n_embd", "dim")),
                       ("feed_forward_length", ("intermediate_size", "n_inner", "hidden_dim")),
                       ("attention.head_count", ("num_attention_heads", "n_head", "n_heads")),
                       ("attention.head_count_kv", ("num_key_value_heads", "n_kv_heads"))):
        if (value := _find(hp, *names)) is not None:
            meta.u32(f"{a}.{key}", value)
    if hp.get("is_causal") is False:
        meta.bool(f"{a}.attention.causal", False)
    full = rope.get("full_attention", rope)
    kind, factor = full.get("rope_type"), full.get("factor")
    if kind == "linear" and factor is not None:
        meta.string(f"{a}.rope.scaling.type", "linear")
        meta.f32(f"{a}.rope.scaling.factor", factor)
    elif kind == "yarn" and factor is not None:
        meta.string(f"{a}.rope.scaling.type", "yarn")
        meta.f32(f"{a}.rope.scaling.factor", factor)
        meta.u32(f"{a}.rope.scaling.original_context_length", full["original_max_position_embeddings"])
        for key, names in (("yarn_ext_factor", ("extrapolation_factor",)),
                           ("yarn_attn_factor", ("attention_factor", "attn_factor")),
                           ("yarn_beta_fast", ("beta_fast",)), ("yarn_beta_slow", ("beta_slow",))):
            if (value := _find(full, *names)) is not None:
                meta.f32(f"{a}.rope.scaling.{key}", value)
    elif kind in ("su", "longrope"):
        meta.string(f"{a}.rope.scaling.type", "longrope")
    if (theta := full.get("rope_theta")) is not None:
        meta.f32(f"{a}.rope.freq_base", theta)
    if (theta := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        meta.f32(f"{a}.rope.freq_base_swa", theta)
    if (eps := _find(hp, "rms_norm_eps", "norm_eps")) is not None:
        meta.f32(f"{a}.attention.layer_norm_rms_epsilon", eps)
    if (eps := _find(hp, "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon")) is not None:
        meta.f32(f"{a}.attention.layer_norm_epsilon", eps)
    if hp.get("head_dim") is not None:
        meta.u32(f"{a}.attention.key_length", hp["head_dim"])
        meta.u32(f"{a}.attention.value_length", hp["head_dim"])
    meta.u32("general.file_type", file_type)
    if arch.hf.write_hparams is not None:
        arch.hf.write_hparams(meta, hp, rope)


# ---- tensors ---------------------------------------------------------------------------------

_MULTIMODAL_PREFIXES = ("mlp", "vit.", "vpm.", "siglip2.", "conformer.", "merger.", "resampler.", "sound_encoder.",
                        "sound_projection.", "speech_embeddings.")
_MULTIMODAL_PARTS = ("visual.", "vision.", "audio.", "talker.", "vision_", "audio_", "token2wav.", "code2wav.",
                     "projector.", "pre_mm_projector_norm", "image_newline", "view_seperator", "patch_embed",
                     "patch_embedding", "patch_merger.", "patch_merge_mlp.", "model.connector.")
UNUSED_SUFFIXES = (".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")


def text_tensor_name(name: str) -> str | None:
    """A checkpoint tensor's name as the text model knows it, None for a tensor of an image
    or audio tower (convert_hf_to_gguf.py's filter: multimodal checkpoints convert their text part)."""
    if name.startswith(_MULTIMODAL_PREFIXES) or any(p in name for p in _MULTIMODAL_PARTS):
        return None
    return name.replace("language_model.", "").replace("text_model.", "")


def gguf_name(arch: Architecture, name: str, n_layers: int) -> str:
    """The GGUF name of a checkpoint tensor; CheckpointError for one the architecture has not."""
    module, dot, suffix = name.rpartition(".")
    if dot and suffix in ("weight", "bias"):
        if module in _GLOBAL:
            return f"{_GLOBAL[module]}.{suffix}"
        parts = module.split(".", 3)
        if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdecimal():
            if int(parts[2]) < n_layers and parts[3] in arch.hf.layer:
                return f"blk.{int(parts[2])}.{arch.hf.layer[parts[3]]}.{suffix}"
    raise CheckpointError(f"cannot map tensor {name!r} to a {arch.name} GGUF tensor")


def hf_name(arch: Architecture, gguf: str) -> str:
    """gguf_name's inverse: the checkpoint tensor a GGUF tensor was converted from
    ("blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight"); CheckpointError for
    one the architecture's table has not."""
    module, dot, suffix = gguf.rpartition(".")
    if dot and suffix in ("weight", "bias"):
        for hf, name in _GLOBAL.items():
            if name == module:
                return f"{hf}.{suffix}"
        parts = module.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdecimal():
            for hf, name in arch.hf.layer.items():
                if name == parts[2]:
                    return f"model.layers.{int(parts[1])}.{hf}.{suffix}"
    raise CheckpointError(f"{arch.name} GGUF tensor {gguf!r} has no Hugging Face name")


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Q or K rows from HF's per-head halves (rotate_half) to llama.cpp's interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """permute_rows' inverse: Q or K rows from llama.cpp's interleaved pairs back to HF's halves."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permuted_heads(arch: Architecture, name: str, n_head: int, n_head_kv: int) -> int | None:
    """The number of heads whose rows convert permutes in this checkpoint tensor (llama's
    q_proj and k_proj), None for a tensor kept in its order."""
    if arch.hf.permute_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
        return n_head
    if arch.hf.permute_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
        return n_head_kv
    return None


def transform(arch: Architecture, hp: dict, name: str, values: np.ndarray, n_vocab: int) -> np.ndarray:
    """A tensor's values as they go into GGUF (float16 or float32, as convert keeps them)."""
    if heads := permuted_heads(arch, name, hp["num_attention_heads"], hp["num_key_value_heads"]):
        values = permute_rows(values, heads)
    if arch.hf.norm_shift:
        if "embed_tokens.weight" in name:
            values = values[:n_vocab]
        if name.endswith("norm.weight"):  # Gemma3RMSNorm computes x * (1 + w)
            values = values + values.dtype.type(1)
    return values


def extra_tensors(arch: Architecture, hp: dict) -> Iterator[tuple[str, Callable[[], np.ndarray]]]:
    """Tensors convert adds that the checkpoint has not (llama's rope_freqs for Llama 3's RoPE
    scaling): the family's own, from its record."""
    if arch.hf.extra_tensors is not None:
        yield from arch.hf.extra_tensors(hp, rope_parameters(hp))
