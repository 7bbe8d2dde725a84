"""The Hugging Face architectures llamapy-convert knows: for each, its GGUF architecture, the
hyper-parameter keys convert_hf_to_gguf.py writes (in its order), how checkpoint tensors are
named in GGUF and what is done to them on the way (llama's Q/K row permutation, gemma3's +1 on
its norm weights and the embedding rows past the vocabulary cut off).

convert_hf_to_gguf.py reads config.json through transformers, which fills in each config
class's defaults; `DEFAULTS` holds those for the keys read here, so a config.json that leaves
one out converts the same.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llamapy.errors import CheckpointError

from . import config as C
from .config import Gemma3Config, TextConfig, rope_parameters
from .metadata import Meta

_COMMON = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
           "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
           "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_QK_NORM = {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


@dataclass(frozen=True)
class Architecture:
    gguf: str
    hf: tuple[str, ...]  # config.json "architectures" names
    layer: dict[str, str]  # module inside model.layers.N -> GGUF name inside blk.N
    defaults: dict = field(default_factory=dict)
    permute_qk: bool = False  # llama: Q and K rows from HF's rotate-half order to GGUF's interleaved pairs
    norm_shift: bool = False  # gemma3: RMSNorm weights stored minus 1
    record: type[TextConfig] = TextConfig  # config.json's keys, checked


ARCHITECTURES = (
    Architecture("llama", ("LlamaForCausalLM", "LLaMAForCausalLM", "MistralForCausalLM"),
                 {**_COMMON, "post_attention_layernorm": "ffn_norm"},
                 dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0),
                 permute_qk=True),
    Architecture("qwen2", ("Qwen2ForCausalLM",), {**_COMMON, "post_attention_layernorm": "ffn_norm"},
                 dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=32768,
                      rms_norm_eps=1e-6, rope_theta=10000.0)),
    Architecture("qwen3", ("Qwen3ForCausalLM",), {**_COMMON, **_QK_NORM, "post_attention_layernorm": "ffn_norm"},
                 dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, head_dim=128, max_position_embeddings=32768,
                      rms_norm_eps=1e-6, rope_theta=10000.0)),
    Architecture("gemma3", ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
                 {**_COMMON, **_QK_NORM, "post_attention_layernorm": "post_attention_norm",
                  "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"},
                 dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131072,
                      rms_norm_eps=1e-6, rope_theta=1_000_000.0, rope_local_base_freq=10000.0, sliding_window=4096),
                 norm_shift=True, record=Gemma3Config),
)


def architecture_of(config: dict, path: Path = Path("config.json")) -> Architecture:
    """The architecture config.json (read from `path`) names (text_config's name first, as
    llama.cpp does); CheckpointError with one line for a config.json of another shape."""
    C.check_layout(config, path)
    names = (config.get("text_config") or {}).get("architectures") or config.get("architectures") or []
    if not names:
        raise CheckpointError(f"{path} names no architecture (\"architectures\")")
    for arch in ARCHITECTURES:
        if names[0] in arch.hf:
            return arch
    known = ", ".join(n for a in ARCHITECTURES for n in a.hf)
    raise CheckpointError(f"architecture {names[0]} is not supported (llamapy-convert converts {known})")


def read_config(arch: Architecture, config: dict, path: Path) -> TextConfig:
    """config.json (read from `path`) as the architecture's checked record, the config
    class's defaults filled in; CheckpointError with one line naming a bad key."""
    return C.read_config(arch.record, arch.defaults, config, path)


def hyperparameters(arch: Architecture, cfg: TextConfig) -> dict:
    """The checked config.json as the dict the writer reads (text_config's keys on top,
    defaults filled in, llama's derived head counts and size added as its converter adds them)."""
    hp = cfg.values()
    if arch.gguf == "llama":
        hp["num_key_value_heads"], hp["head_dim"] = cfg.n_kv_heads, cfg.head_size
    return hp


def _find(hp: dict, *keys: str):
    return next((hp[k] for k in keys if k in hp), None)


def _require(hp: dict, key: str):
    if hp.get(key) is None:
        raise CheckpointError(f"config.json has no {key}")
    return hp[key]


def write_hyperparameters(meta: Meta, arch: Architecture, hp: dict, file_type: int) -> None:
    """The {arch}.* keys and general.file_type, in convert_hf_to_gguf.py's order."""
    a = arch.gguf
    rope = rope_parameters(hp)
    meta.u32(f"{a}.block_count", _require(hp, "num_hidden_layers"))
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
    if a == "llama":
        meta.u32("llama.vocab_size", _require(hp, "vocab_size"))
        meta.u32("llama.rope.dimension_count", hp["head_dim"])
    elif a == "gemma3":
        _gemma3_hyperparameters(meta, hp, rope)


def _gemma3_hyperparameters(meta: Meta, hp: dict, rope: dict) -> None:
    """What convert_hf_to_gguf.py's Gemma3Model adds (keys set again keep their place; the
    soft-caps Gemma 3 has not are refused by config.Gemma3Config)."""
    meta.u32("gemma3.context_length", hp.get("max_position_embeddings", 131072))
    meta.u32("gemma3.attention.head_count", hp.get("num_attention_heads", 8))
    meta.f32("gemma3.attention.layer_norm_rms_epsilon", hp.get("rms_norm_eps", 1e-6))
    meta.u32("gemma3.attention.key_length", hp.get("head_dim", 256))
    meta.u32("gemma3.attention.value_length", hp.get("head_dim", 256))
    meta.f32("gemma3.rope.freq_base", rope.get("full_attention", rope).get("rope_theta", 1_000_000.0))
    if softcap := hp.get("final_logit_softcapping"):
        meta.f32("gemma3.final_logit_softcapping", softcap)
    if hp.get("sliding_window_pattern") != 1:
        meta.u32("gemma3.attention.sliding_window", _require(hp, "sliding_window"))
    meta.u32("gemma3.attention.head_count_kv", hp.get("num_key_value_heads", 4))


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
            if int(parts[2]) < n_layers and parts[3] in arch.layer:
                return f"blk.{int(parts[2])}.{arch.layer[parts[3]]}.{suffix}"
    raise CheckpointError(f"cannot map tensor {name!r} to a {arch.gguf} GGUF tensor")


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
            for hf, name in arch.layer.items():
                if name == parts[2]:
                    return f"model.layers.{int(parts[1])}.{hf}.{suffix}"
    raise CheckpointError(f"{arch.gguf} GGUF tensor {gguf!r} has no Hugging Face name")


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Q or K rows from HF's per-head halves (rotate_half) to llama.cpp's interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """permute_rows' inverse: Q or K rows from llama.cpp's interleaved pairs back to HF's halves."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permuted_heads(arch: Architecture, name: str, n_head: int, n_head_kv: int) -> int | None:
    """The number of heads whose rows convert permutes in this checkpoint tensor (llama's
    q_proj and k_proj), None for a tensor kept in its order."""
    if arch.permute_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
        return n_head
    if arch.permute_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
        return n_head_kv
    return None


def transform(arch: Architecture, hp: dict, name: str, values: np.ndarray, n_vocab: int) -> np.ndarray:
    """A tensor's values as they go into GGUF (float16 or float32, as convert keeps them)."""
    if heads := permuted_heads(arch, name, hp["num_attention_heads"], hp["num_key_value_heads"]):
        values = permute_rows(values, heads)
    if arch.norm_shift:
        if "embed_tokens.weight" in name:
            values = values[:n_vocab]
        if name.endswith("norm.weight"):  # Gemma3RMSNorm computes x * (1 + w)
            values = values + values.dtype.type(1)
    return values


def extra_tensors(arch: Architecture, hp: dict) -> Iterator[tuple[str, Callable[[], np.ndarray]]]:
    """Tensors convert adds that the checkpoint has not: llama's rope_freqs for Llama 3's RoPE
    scaling (one factor per frequency pair, computed in float32 as convert does)."""
    rope = rope_parameters(hp)
    full = rope.get("full_attention", rope)
    if arch.gguf != "llama" or str(full.get("rope_type", "")).lower() != "llama3":
        return

    def factors() -> np.ndarray:
        f32 = np.float32
        dim = hp["head_dim"]
        freqs = f32(full.get("rope_theta", 10000.0)) ** (np.arange(0, dim, 2, dtype=f32) / f32(dim))
        freqs = f32(1.0) / freqs
        factor = full.get("factor", 8.0)
        low, high = full.get("low_freq_factor", 1.0), full.get("high_freq_factor", 4.0)
        old = full.get("original_max_position_embeddings", 8192)
        out = []
        for freq in freqs:
            wavelen = f32(2 * math.pi) / freq
            if wavelen < old / high:
                out.append(1.0)
            elif wavelen > old / low:
                out.append(factor)
            else:
                smooth = (f32(old) / wavelen - f32(low)) / f32(high - low)
                out.append(f32(1) / ((f32(1) - smooth) / f32(factor) + smooth))
        return np.asarray(out, dtype=np.float32)

    yield "rope_freqs.weight", factors
