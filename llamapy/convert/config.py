"""config.json as a checked record, before anything is built from it.

convert_hf_to_gguf.py trusts config.json: a missing hidden_size, 0 heads, a NaN rope_theta or
1e9 layers go into a GGUF file that no loader accepts. Here the keys the converter reads are
parsed into a pydantic record per architecture (types, ranges, and the relations the graph
relies on: KV heads dividing heads, an even head size for RoPE, heads dividing the hidden
size when no head_dim is given), so a bad value is one line naming the key and the file.
Every number the converter writes is checked against what llamapy's loader (and llama.cpp's)
accepts: sizes and counts up to int32, floats finite in float32, epsilons above 0 once
rounded to float32, RoPE bases at least 1. Their consistency with the weights' shapes is
tensor_check.py's.

Keys are checked after transformers' way of reading them: the config class's defaults under
config.json's keys, a multimodal config's text_config on top (`merged`).
"""
from __future__ import annotations

import reprlib
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from pydantic import AfterValidator, AllowInfNan, BaseModel, ConfigDict, Field, Strict, ValidationError, model_validator

from llamapy.errors import CheckpointError
from llamapy.gguf_file import FLOAT32_MAX, INT32_MAX


def _positive_in_float32(value: float) -> float:
    if not np.float32(value) > 0:
        raise ValueError(f"must be > 0 as a float32 (ggml computes with float32), not {value!r}")
    return value


# a size or count: written as a GGUF u32, read back as an int32
Count = Annotated[int, Strict(), Field(ge=1, le=INT32_MAX)]
# a float written as a GGUF f32
F32 = Annotated[float, Strict(), AllowInfNan(False), Field(ge=-FLOAT32_MAX, le=FLOAT32_MAX)]
Positive = Annotated[F32, AfterValidator(_positive_in_float32)]
RopeBase = Annotated[F32, Field(ge=1)]  # angles are pos * base^(-2i/n_rot): below 1 they grow without bound
Text = Annotated[str, Strict()]


class ConfigRecord(BaseModel):
    """A part of config.json: the keys read are fields, checked; the many others are kept as
    they are (`values()` gives them all back)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    def values(self) -> dict:
        """The keys given (defaults included, not the fields' own), as checked."""
        return self.model_dump(exclude_unset=True)


class RopeParameters(ConfigRecord):
    """rope_parameters (transformers 5) or rope_scaling (4): one attention type's RoPE, or
    one per attention type (full_attention, sliding_attention)."""

    rope_type: Text | None = None
    type: Text | None = None
    rope_theta: RopeBase | None = None
    factor: Positive | None = None
    original_max_position_embeddings: Count | None = None
    low_freq_factor: Positive | None = None
    high_freq_factor: Positive | None = None
    extrapolation_factor: F32 | None = None
    attention_factor: F32 | None = None
    attn_factor: F32 | None = None
    beta_fast: F32 | None = None
    beta_slow: F32 | None = None
    full_attention: RopeParameters | None = None
    sliding_attention: RopeParameters | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        """A key set to null reads as a key left out (the converter's defaults apply)."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


# the keys rope_parameters() reads a RoPE base from, besides rope_parameters / rope_scaling
GLOBAL_THETA_KEYS = ("global_rope_theta", "rope_global_theta", "rope_theta_global", "rope_theta", "rotary_emb_base")
LOCAL_THETA_KEYS = ("local_rope_theta", "rope_local_theta", "rope_theta_local", "swa_rope_theta",
                    "rope_local_base_freq")


class TextConfig(ConfigRecord):
    """The keys every architecture reads (llama, qwen2 and qwen3 read no others): a missing
    num_key_value_heads is num_attention_heads, a missing head_dim hidden_size /
    num_attention_heads (as transformers computes them)."""

    vocab_size: Count
    hidden_size: Count
    intermediate_size: Count
    num_hidden_layers: Count
    num_attention_heads: Count
    num_key_value_heads: Count | None = None
    head_dim: Count | None = None
    max_position_embeddings: Count
    rms_norm_eps: Positive
    norm_eps: F32 | None = None
    layer_norm_eps: F32 | None = None
    layer_norm_epsilon: F32 | None = None
    norm_epsilon: F32 | None = None
    rope_parameters: RopeParameters | None = None
    rope_scaling: RopeParameters | None = None
    original_max_position_embeddings: Count | None = None
    global_rope_theta: RopeBase | None = None
    rope_global_theta: RopeBase | None = None
    rope_theta_global: RopeBase | None = None
    rope_theta: RopeBase | None = None
    rotary_emb_base: RopeBase | None = None
    local_rope_theta: RopeBase | None = None
    rope_local_theta: RopeBase | None = None
    rope_theta_local: RopeBase | None = None
    swa_rope_theta: RopeBase | None = None
    rope_local_base_freq: RopeBase | None = None

    @property
    def n_kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @model_validator(mode="after")
    def _heads(self) -> TextConfig:
        """The head layout the graph needs."""
        heads, kv = self.num_attention_heads, self.n_kv_heads
        if heads % kv:
            raise ValueError(f"num_key_value_heads {kv} does not divide num_attention_heads {heads}")
        if self.head_dim is None and self.hidden_size % heads:
            raise ValueError(f"num_attention_heads {heads} does not divide hidden_size {self.hidden_size} "
                             "(and there is no head_dim)")
        if self.head_size % 2:
            raise ValueError(f"the head size {self.head_size} (head_dim, or hidden_size / num_attention_heads) is "
                             "odd: RoPE rotates pairs of dimensions")
        return self

    @model_validator(mode="after")
    def _rope(self) -> TextConfig:
        """The RoPE settings the converter reads (rope_parameters() of the keys given) are complete."""
        rope = rope_parameters(self.values())
        full = rope.get("full_attention", rope)
        kind = str(full.get("rope_type", "")).lower()
        if kind == "yarn" and full.get("factor") is not None and full.get("original_max_position_embeddings") is None:
            raise ValueError("yarn RoPE scaling needs original_max_position_embeddings")
        if kind == "llama3" and not full.get("high_freq_factor", 4.0) > full.get("low_freq_factor", 1.0):
            raise ValueError("llama3 RoPE scaling needs high_freq_factor above low_freq_factor")
        return self


class Gemma3Config(TextConfig):
    """Gemma 3's keys: head_dim and num_key_value_heads always (its config class has defaults
    for both, an explicit null has none), the sliding window, no soft-capping (llamapy runs
    Gemma 3 without it, as the models are published)."""

    num_key_value_heads: Count
    head_dim: Count
    sliding_window: Count | None = None
    sliding_window_pattern: Any = None
    attn_logit_softcapping: F32 | None = None
    final_logit_softcapping: F32 | None = None

    @model_validator(mode="after")
    def _gemma3(self) -> Gemma3Config:
        if self.attn_logit_softcapping is not None:
            raise ValueError("attn_logit_softcapping is set, which Gemma 3 does not have")
        if self.final_logit_softcapping:
            raise ValueError(f"final_logit_softcapping is {self.final_logit_softcapping!r}: llamapy runs Gemma 3 "
                             "without a final logit soft-cap")
        if self.sliding_window_pattern != 1 and self.sliding_window is None:
            raise ValueError("sliding_window is missing (Gemma 3 attends through a sliding window)")
        return self


def merged(defaults: dict, config: dict) -> dict:
    """config.json as transformers reads it: the config class's defaults, config.json's
    keys over them, text_config's keys over those."""
    return {**defaults, **config, **(config.get("text_config") or {})}


def read_config(record: type[TextConfig], defaults: dict, config: dict, path: Path) -> TextConfig:
    """config.json (`config`, read from `path`) as `record`; CheckpointError with one line
    naming the key for anything the converter cannot write into a loadable file."""
    try:
        return record.model_validate(merged(defaults, config))
    except ValidationError as e:
        raise CheckpointError(f"{path}: {_one_line(e, config.get('text_config') or {})}") from None


def check_layout(config: Any, path: Path) -> None:
    """config.json is an object, its text_config (when present) too: the shape everything
    else reads it in."""
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    text = config.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise CheckpointError(f"{path}: text_config must be a JSON object, not {shown(text)}")
    names = (text or {}).get("architectures") or config.get("architectures")
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise CheckpointError(f"{path}: architectures must be a list of class names, not {shown(names)}")


def _find(hp: dict, *keys: str):
    return next((hp[k] for k in keys if k in hp), None)


def rope_parameters(hp: dict) -> dict:
    """RoPE settings in transformers 5's form (rope_parameters, maybe per attention type),
    from it or from transformers 4's rope_theta and rope_scaling, as convert_hf_to_gguf.py
    gathers them."""
    rope = dict(hp.get("rope_parameters", hp.get("rope_scaling")) or {})
    if "full_attention" in rope or "sliding_attention" in rope:
        return rope
    theta = _find(hp, *GLOBAL_THETA_KEYS)
    local = _find(hp, *LOCAL_THETA_KEYS)
    if local is not None:
        rope["sliding_attention"] = {"rope_theta": local}
    if "rope_theta" not in rope and theta is not None:
        rope["rope_theta"] = theta
    if "rope_type" not in rope and rope.get("type") is not None:
        rope["rope_type"] = rope["type"]
    for key, names in (("partial_rotary_factor", ("partial_rotary_factor", "rope_pct", "rope_percent")),
                       ("original_max_position_embeddings", ("original_max_position_embeddings",))):
        if key not in rope and (value := _find(hp, *names)) is not None:
            rope[key] = value
    return rope


_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlist, _SHOWN.maxdict = 2, 40, 40, 4, 4


def shown(value: Any) -> str:
    """A JSON value as a message shows it: short, one line, null/true/false as JSON writes them."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return _SHOWN.repr(value)


_EXPECTED = {"int_type": "a whole number", "float_type": "a number", "finite_number": "a finite number",
             "string_type": "a string", "model_type": "a JSON object", "model_attributes_type": "a JSON object",
             "greater_than": "> {gt}", "greater_than_equal": ">= {ge}", "less_than_equal": "<= {le}"}


def _one_line(e: ValidationError, text_config: dict) -> str:
    """The first error as "<key> must be ..., not <value>", the key as config.json spells it
    (text_config.<key> when it came from there); a rule between keys as its own sentence."""
    error = e.errors(include_url=False)[0]
    loc = [str(p) for p in error["loc"]]
    if loc and loc[0] in text_config:
        loc.insert(0, "text_config")
    key, kind, ctx = ".".join(loc), error["type"], error.get("ctx") or {}
    if kind == "value_error":
        message = str(ctx.get("error", error["msg"])).removeprefix("Value error, ")
        return f"{key} {message}" if key else message
    if kind == "missing":
        return f"{key} is missing"
    expected = _EXPECTED.get(kind)
    if expected is None:
        return f"{key}: {error['msg']}, not {shown(error.get('input'))}"
    bounds = {k: f"{v:g}" if isinstance(v, float) else v for k, v in ctx.items()}
    return f"{key} must be {expected.format(**bounds)}, not {shown(error.get('input'))}"
