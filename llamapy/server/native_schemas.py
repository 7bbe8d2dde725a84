"""Request bodies of llama-server's own endpoints: /completion (and /completions), /infill,
/embedding(s) and /v1/embeddings, with their fields and llama-server's names.

On top of the sampling fields both APIs share (schemas.Sampling): `prompt` in every shape
llama-server takes (prompts.py), `cache_prompt`, `id_slot`, `samplers` (the chain's order),
`return_tokens`, `n_probs` (or `logprobs`), `min_keep`, `response_fields`. The fields of
samplers llamapy does not have (mirostat, DRY, XTC, top-n-sigma, adaptive-p) and of features
it does not do (n_indent, t_max_predict_ms, post_sampling_probs, timings_per_token,
return_progress, several completions per prompt) are accepted at the values that turn them
off, which is what llama-server does by default, and refused by name otherwise. `n_keep`,
`n_discard` and `n_cache_reuse` only steer llama-server's context shifting and cache reuse,
which change how fast, never what, it answers: accepted, with no effect.
"""
from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .sampler_order import sampler_order
from .schemas import INT32_MAX, Sampling

# field -> (the value that turns it off, the test that it is off)
OFF_VALUES = {
    "mirostat": (0, lambda v: v == 0),
    "dry_multiplier": (0.0, lambda v: v == 0),
    "xtc_probability": (0.0, lambda v: v == 0),
    "top_n_sigma": (-1.0, lambda v: v < 0),
    "adaptive_target": (-1.0, lambda v: v < 0),
    "n_indent": (0, lambda v: v == 0),
    "t_max_predict_ms": (0, lambda v: v <= 0),
    "post_sampling_probs": (False, lambda v: not v),
    "timings_per_token": (False, lambda v: not v),
    "return_progress": (False, lambda v: not v),
    "verbose": (False, lambda v: not v),
    "n_cmpl": (1, lambda v: v == 1),
}


class NativeCompletionRequest(Sampling):
    """POST /completion: llama-server's native completion."""
    prompt: Any = Field(description="a text, token ids, texts and ids mixed, or a list of prompts")
    logprobs: Optional[int] = Field(None, ge=0, le=100, description="n_probs, when n_probs is not given")
    cache_prompt: bool = True
    id_slot: int = Field(-1, ge=-1, le=INT32_MAX)
    samplers: Union[list[str], str, None] = None
    return_tokens: bool = False
    response_fields: Optional[list[str]] = None
    min_keep: int = Field(0, ge=0, le=INT32_MAX)
    n_keep: int = Field(0, ge=-1, le=INT32_MAX)
    n_discard: int = Field(0, ge=0, le=INT32_MAX)
    n_cache_reuse: int = Field(0, ge=0, le=INT32_MAX)
    backend_sampling: bool = False
    mirostat: int = Field(0, ge=0, le=2)
    dry_multiplier: float = Field(0.0, allow_inf_nan=False)
    xtc_probability: float = Field(0.0, ge=0, le=1)
    top_n_sigma: float = Field(-1.0, allow_inf_nan=False)
    adaptive_target: float = Field(-1.0, allow_inf_nan=False)
    n_indent: int = Field(0, ge=0, le=INT32_MAX)
    t_max_predict_ms: int = Field(0, ge=-1)
    post_sampling_probs: bool = False
    timings_per_token: bool = False
    return_progress: bool = False
    verbose: bool = False
    n_cmpl: int = Field(1, ge=1, le=INT32_MAX)

    @field_validator("samplers")
    @classmethod
    def _known_samplers(cls, value):
        if value is not None:
            sampler_order(value)  # ValueError naming an unknown or refused one
        return value

    @model_validator(mode="after")
    def _off_or_refused(self):
        for name, (off, is_off) in OFF_VALUES.items():
            if not is_off(getattr(self, name)):
                raise ValueError(f"{name} is not supported by llamapy-server (leave it out, or at {off!r})")
        if "n_probs" not in self.model_fields_set and self.logprobs is not None:
            self.n_probs = self.logprobs
        return self

    def order(self) -> tuple[str, ...] | None:
        """The sampler chain's order the request asks for (None: llama.cpp's default chain)."""
        return None if self.samplers is None else sampler_order(self.samplers)


class ExtraChunk(BaseModel):
    """A file of context for fill-in-the-middle (llama-server's input_extra entry)."""
    model_config = ConfigDict(extra="ignore")
    text: str
    filename: str = "tmp"


class InfillRequest(NativeCompletionRequest):
    """POST /infill: the text between `input_prefix` and `input_suffix` (after `prompt`)."""
    prompt: str = ""
    input_prefix: Union[str, list[Union[int, str]]]
    input_suffix: Union[str, list[Union[int, str]]]
    input_extra: list[ExtraChunk] = Field(default_factory=list)


class EmbeddingRequest(BaseModel):
    """POST /embedding, /embeddings (`content`, llama-server's) and /v1/embeddings (`input`,
    OpenAI's)."""
    model_config = ConfigDict(extra="ignore")
    input: Any = None
    content: Any = None
    model: Optional[str] = Field(None, max_length=1024)
    encoding_format: Optional[str] = None
    embd_normalize: Optional[int] = Field(None, ge=-1, le=64)

    @field_validator("encoding_format")
    @classmethod
    def _format(cls, value):
        if value not in (None, "float", "base64"):
            raise ValueError("The format to return the embeddings in. Can be either float or base64")
        return value

    @model_validator(mode="after")
    def _has_text(self):
        if "input" not in self.model_fields_set and "content" not in self.model_fields_set:
            raise ValueError('"input" or "content" must be provided')
        return self
