"""Request bodies of llamapy-server, as OpenAI's API and llama-server define them.

Fields a client may send that change nothing here (`user`, `n: 1`, `stream_options` without
usage, ...) are accepted and ignored, as llama-server does; a known field of the wrong type
or out of its range is a 400 naming it; features this server does not have (several
choices, tools, grammars) are refused by name rather than silently ignored.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator


class LoraScale(BaseModel):
    id: int = Field(ge=0)
    scale: float = Field(allow_inf_nan=False)


class Sampling(BaseModel):
    """What both completion endpoints share: llama-server's sampling and stopping fields."""
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=-1)
    max_completion_tokens: Optional[int] = Field(None, ge=-1)
    n_predict: Optional[int] = Field(None, ge=-1)
    temperature: float = Field(0.8, allow_inf_nan=False)
    top_p: float = Field(0.95, ge=0, le=1)
    top_k: int = Field(40, ge=0)
    min_p: float = Field(0.05, ge=0, le=1)
    typical_p: float = Field(1.0, ge=0, le=1)
    repeat_penalty: float = Field(1.0, gt=0, allow_inf_nan=False)
    repeat_last_n: int = Field(64, ge=-1)
    presence_penalty: float = Field(0.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, allow_inf_nan=False)
    dynatemp_range: float = Field(0.0, ge=0, allow_inf_nan=False)
    dynatemp_exponent: float = Field(1.0, allow_inf_nan=False)
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None
    n: int = Field(1, ge=1, le=1, description="one choice per request (as llama-server)")
    n_probs: int = Field(0, ge=0, le=100)
    logit_bias: Union[dict[str, float], list[list[Any]], None] = None
    ignore_eos: bool = False
    lora: Optional[list[LoraScale]] = None
    tools: Optional[list[Any]] = None
    grammar: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = None
    response_format: Optional[dict[str, Any]] = None

    @field_validator("tools", "grammar", "json_schema")
    @classmethod
    def _unsupported(cls, value, info):
        if value:
            raise ValueError(f"{info.field_name} is not supported by llamapy-server")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value):
        if value and value.get("type", "text") != "text":
            raise ValueError("only response_format {\"type\": \"text\"} is supported by llamapy-server")
        return value

    def limit(self) -> int | None:
        """max_tokens, max_completion_tokens or n_predict (-1: until the end or a full slot;
        None: not given, the server's -n)."""
        for value in (self.max_completion_tokens, self.max_tokens, self.n_predict):
            if value is not None:
                return value
        return None

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)


class CompletionRequest(Sampling):
    prompt: Union[str, list[int], list[str]]
    logprobs: Optional[int] = Field(None, ge=0, le=5)
    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value):
        if value:
            raise ValueError("echo is not supported by llamapy-server")
        return value

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and value and isinstance(value[0], str):
            if len(value) != 1:
                raise ValueError("one prompt per request (as llama-server's OpenAI endpoint)")
            return value[0]
        return value


class TokenizeRequest(BaseModel):
    content: str
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(BaseModel):
    tokens: list[int]


class LoadLora(BaseModel):
    path: str
    scale: float = Field(0.0, allow_inf_nan=False)
