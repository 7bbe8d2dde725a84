"""Request bodies of llamapy-server, as OpenAI's API and llama-server define them.

Fields a client may send that change nothing here (`user`, `n: 1`, `stream_options` without
usage, ...) are accepted and ignored, as llama-server does; a known field of the wrong type
or out of its range is a 400 naming it; features this server does not have (several
choices) are refused by name rather than silently ignored. A grammar (`grammar`, GBNF)
or a JSON schema (`json_schema`, `response_format` json_object / json_schema) constrains the
text as in llama-server, a lazy one (`grammar_lazy`) from one of its `grammar_triggers` on.
A chat's `tools` (with `tool_choice`, `parallel_tool_calls`) are llamapy/tool_calls' to render,
constrain and parse; the messages carry OpenAI's `tool_calls` and `tool_call_id`.

Every number has a range, so that no request can make the sampler overflow or hold the decode
loop (which serves every client) for long; where OpenAI documents one it is OpenAI's:

- temperature any finite number (<= 0: greedy, as llama.cpp); top_p, min_p, typical_p in [0, 1]
- dynatemp_range and dynatemp_exponent in [0, 100] (the temperature moves within +-range by the
  entropy's share ** exponent: past ~10 it is pinned to an end already; a huge range or
  exponent only makes it overflow)
- presence_penalty, frequency_penalty in [-2, 2] (OpenAI's); repeat_penalty in (0, 100]
  (past ~10 a seen token is already as good as banned)
- logit_bias values in [-100, 100] (OpenAI's) or `false` (llama-server's ban)
- a LoRA scale within llamapy.lora.LORA_SCALE_LIMIT (shared with the command lines)
- max_tokens (max_completion_tokens, n_predict) -1 or up to 2**31 - 1 (llama-server's int32),
  and the server refuses more than a slot's context (app.py); n_probs <= 100, logprobs <= 5,
  top_logprobs <= 20 (OpenAI's); at most 64 stop strings of at most 1024 characters
- seed: a 64-bit integer (OpenAI's; as llama.cpp, its low 32 bits seed the sampler)
Strings are valid Unicode by the time they get here: the body's parser refuses lone surrogates.
"""
from __future__ import annotations

import os
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, field_validator

from llamapy.errors import InputError
from llamapy.lora import LORA_SCALE_RULE, check_lora_scale
from llamapy.sampling.grammar_parser import GrammarError
from llamapy.sampling.grammar_sampler import GrammarTrigger
from llamapy.sampling.json_schema_grammar import json_schema_to_grammar
from llamapy.tool_calls import ToolChoice, ToolUse

INT32_MAX = 2**31 - 1
LOGIT_BIAS_LIMIT = 100.0
MAX_STOPS, MAX_STOP_CHARS = 64, 1024
MAX_GRAMMAR_CHARS = 1 << 20
NAME_MAX, PATH_MAX = 255, 4096  # POSIX's limits on a file name's bytes and a path's
MAX_TOOLS = 128  # OpenAI's limit on a request's tools (and here on a message's calls)


def _lora_scale(value: float) -> float:
    try:
        return check_lora_scale(value)
    except InputError:
        raise ValueError(LORA_SCALE_RULE) from None


LoraScaleValue = Annotated[float, Field(allow_inf_nan=False), AfterValidator(_lora_scale)]


class LoraScale(BaseModel):
    id: int = Field(ge=0, le=INT32_MAX)
    scale: LoraScaleValue


Stop = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
TRIGGER_TYPES = {0: "token", 1: "word", 2: "pattern", 3: "pattern_full"}  # llama-server's numbers


def _trigger(value: Any) -> Any:
    """llama-server's {"type": 0..3, "value": ..., "token": ...}, or the type by its name."""
    if isinstance(value, dict) and isinstance(value.get("type"), int) and not isinstance(value["type"], bool):
        value = {**value, "type": TRIGGER_TYPES.get(value["type"], value["type"])}
    return value


GrammarTriggerField = Annotated[GrammarTrigger, BeforeValidator(_trigger)]


class Sampling(BaseModel):
    """What both completion endpoints share: llama-server's sampling and stopping fields."""
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = Field(None, max_length=1024)
    max_tokens: Optional[int] = Field(None, ge=-1, le=INT32_MAX)
    max_completion_tokens: Optional[int] = Field(None, ge=-1, le=INT32_MAX)
    n_predict: Optional[int] = Field(None, ge=-1, le=INT32_MAX)
    temperature: float = Field(0.8, allow_inf_nan=False)
    top_p: float = Field(0.95, ge=0, le=1, allow_inf_nan=False)
    top_k: int = Field(40, ge=0, le=INT32_MAX)
    min_p: float = Field(0.05, ge=0, le=1, allow_inf_nan=False)
    typical_p: float = Field(1.0, ge=0, le=1, allow_inf_nan=False)
    repeat_penalty: float = Field(1.0, gt=0, le=100, allow_inf_nan=False)
    repeat_last_n: int = Field(64, ge=-1, le=INT32_MAX)
    presence_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    dynatemp_range: float = Field(0.0, ge=0, le=100, allow_inf_nan=False)
    dynatemp_exponent: float = Field(1.0, ge=0, le=100, allow_inf_nan=False)
    seed: Optional[int] = Field(None, ge=-2**63, le=2**64 - 1)
    stop: Union[Stop, list[Stop], None] = Field(None)
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None
    n: int = Field(1, ge=1, le=1, description="one choice per request (as llama-server)")
    n_probs: int = Field(0, ge=0, le=100)
    logit_bias: Optional[list[tuple[Union[int, str], float]]] = None
    ignore_eos: bool = False
    lora: Optional[list[LoraScale]] = None
    grammar: Optional[str] = Field(None, max_length=MAX_GRAMMAR_CHARS)
    json_schema: Optional[dict[str, Any]] = None
    response_format: Optional[dict[str, Any]] = None
    grammar_lazy: bool = False
    grammar_triggers: Optional[list[Union[str, GrammarTriggerField]]] = Field(None, max_length=MAX_STOPS)

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, value):
        if isinstance(value, list) and len(value) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings, not {len(value)}")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_entries(cls, value):
        """llama-server's forms, as (token id or text, bias) pairs: {"15043": 1.0},
        {"15043": false} (false bans: -inf), {"Hello": -1} (every token of the text),
        [[15043, 1.0]], [[15043, false]], [["Hello", -1]]."""
        if value is None:
            return None
        if isinstance(value, dict):
            pairs = [(_token_key(key), bias) for key, bias in value.items()]
        elif isinstance(value, list):
            if not all(isinstance(item, list) and len(item) == 2 for item in value):
                raise ValueError(BIAS_FORMS)
            pairs = [(key, bias) for key, bias in value]
            if not all(isinstance(key, str) or (isinstance(key, int) and not isinstance(key, bool))
                       for key, _ in pairs):
                raise ValueError(f"each entry's first item is a token id or a text: {BIAS_FORMS}")
        else:
            raise ValueError(BIAS_FORMS)
        return [(key, _bias_value(bias)) for key, bias in pairs]

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, value):
        kind = (value or {}).get("type") or "text"
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(f'type must be one of "text", "json_object" or "json_schema", not {kind!r}')
        return value

    def constraint(self) -> dict:
        """The request's grammar as sampler_chain's options: `grammar` (GBNF), or the grammar of
        its JSON schema (`json_schema`, or response_format json_object / json_schema), as
        llama-server reads them; an empty schema is any object. A bad schema is a 400."""
        schema = self.json_schema
        fmt = self.response_format or {}
        if fmt.get("type") == "json_object":
            if "schema" in fmt or not schema:
                schema = fmt.get("schema") or {}
        elif fmt.get("type") == "json_schema":
            wrapper = fmt.get("json_schema")
            schema = wrapper.get("schema") if isinstance(wrapper, dict) else None
            schema = {} if schema is None else schema
        if schema is not None and self.grammar:
            raise InputError("give a grammar or a JSON schema (json_schema, response_format), not both")
        options: dict = {}
        if schema is not None:
            if schema == {}:
                schema = {"type": "object"}
            try:
                options["grammar"] = json_schema_to_grammar(schema)
            except GrammarError as e:
                raise InputError(f"json_schema: {e}") from None
        elif self.grammar:
            options["grammar"] = self.grammar
        if self.grammar_lazy or self.grammar_triggers:
            options.update(grammar_lazy=self.grammar_lazy, grammar_triggers=self.grammar_triggers or [])
        return options

    def limit(self) -> int | None:
        """max_tokens, max_completion_tokens or n_predict (-1: until the end or a full slot;
        None: not given, the server's -n)."""
        for value in (self.max_completion_tokens, self.max_tokens, self.n_predict):
            if value is not None:
                return value
        return None

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


BIAS_FORMS = ('expected {"TOKEN_ID or text": BIAS or false, ...} or [[TOKEN_ID or text, BIAS or false], ...] '
              f"with BIAS a number from {-LOGIT_BIAS_LIMIT:g} to {LOGIT_BIAS_LIMIT:g}")


def _token_key(key: str) -> int | str:
    """An object key as llama-server reads it: a whole decimal integer is a token id, anything
    else a text whose tokens get the bias."""
    stripped = key.strip()
    digits = stripped[1:] if stripped[:1] in "+-" else stripped
    return int(stripped) if digits.isascii() and digits.isdigit() else key


def _bias_value(bias: Any) -> float:
    if bias is False:
        return float("-inf")
    if isinstance(bias, bool) or not isinstance(bias, (int, float)) \
            or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:  # NaN fails the comparison too
        raise ValueError(f"{bias!r} is not a bias: {BIAS_FORMS}")
    return float(bias)


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    name: str = Field(max_length=1024)
    arguments: Union[str, dict[str, Any]] = ""


class CallIn(BaseModel):
    """An earlier reply's tool call, as OpenAI's API sends it back."""
    model_config = ConfigDict(extra="ignore")

    id: Optional[str] = Field(None, max_length=1024)
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    tool_calls: Optional[list[CallIn]] = Field(None, max_length=MAX_TOOLS)
    tool_call_id: Optional[str] = Field(None, max_length=1024)
    name: Optional[str] = Field(None, max_length=1024)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as a template reads it: role (developer is system), content, and the
        tool fields it has."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[list[dict[str, Any]]] = Field(None, max_length=MAX_TOOLS)  # as given: the template writes them
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Optional[bool] = None
    _tool_use: Optional[ToolUse] = PrivateAttr(None)  # set by the server from the template's call syntax

    def use_tools(self, use: ToolUse | None) -> None:
        self._tool_use = use

    @property
    def tool_use(self) -> ToolUse | None:
        """The request's tools, when a call may or must come (None: plain text)."""
        use = self._tool_use
        return use if use is not None and use.mode != "none" else None

    def constraint(self) -> dict:
        """The tools' grammar when calls may come (with a grammar or JSON schema too: a 400)."""
        given = super().constraint()
        if self.tool_use is None:
            return given
        if given.get("grammar"):
            raise InputError("give tools or a grammar / JSON schema (grammar, json_schema, response_format), not both")
        return self.tool_use.constraint()


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


def _file_path(value: str) -> str:
    """A path the file system can take: not empty, no NUL byte, within POSIX's lengths."""
    if not value.strip():
        raise ValueError("the path is empty")
    if "\0" in value:
        raise ValueError("a path cannot hold a NUL byte")
    if len(os.fsencode(value)) > PATH_MAX:
        raise ValueError(f"the path is longer than {PATH_MAX} bytes")
    if any(len(os.fsencode(part)) > NAME_MAX for part in value.split("/")):
        raise ValueError(f"a name in the path is longer than {NAME_MAX} bytes")
    return value


class LoadLora(BaseModel):
    path: Annotated[str, AfterValidator(_file_path)]
    scale: LoraScaleValue = 0.0
