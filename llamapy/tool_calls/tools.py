"""OpenAI's `tools` and `tool_choice` as a request gives them, and what they ask of generation."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from ..errors import InputError
from .syntax import ToolSyntax

FUNCTION_NAME = r"^[A-Za-z0-9_.\-]{1,64}$"  # OpenAI's rule for a function's name


class Function(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=FUNCTION_NAME)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None


class Tool(BaseModel):
    """{"type": "function", "function": {"name", "description", "parameters" (a JSON schema)}}."""
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: Function

    @property
    def name(self) -> str:
        return self.function.name

    def schema(self) -> dict:
        """The arguments' JSON schema: an object of anything when the tool gives none."""
        return self.function.parameters or {"type": "object"}


class NamedChoice(BaseModel):
    type: Literal["function"] = "function"
    function: dict[str, str]


ToolChoice = Union[Literal["none", "auto", "required"], NamedChoice]


@dataclass(frozen=True)
class ToolUse:
    """What one chat request asks: its tools, the template's call syntax, and whether a call
    may (auto), must (required, or a named function) or must not (none) come."""
    tools: tuple[Tool, ...]
    syntax: ToolSyntax
    mode: Literal["none", "auto", "required"]
    parallel: bool

    @classmethod
    def of(cls, tools: list[Tool] | None, choice: ToolChoice | dict | None, parallel: bool | None,
           syntax: ToolSyntax | None, template_name: str) -> ToolUse | None:
        """None when the request uses no tools; InputError for a choice the tools cannot meet
        or a template that takes none."""
        if isinstance(choice, dict):
            choice = NamedChoice.model_validate(choice)
        if not tools:
            if choice not in (None, "none", "auto"):
                raise InputError("tool_choice needs tools")
            return None
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise InputError(f"tools: two tools have the same name ({sorted(n for n in names if names.count(n) > 1)[0]})")
        if syntax is None:
            raise InputError(f"{template_name} does not take tools (it has no tool-call syntax llamapy knows: "
                             "Qwen 2.5/3's <tool_call>, Llama 3.x's JSON call, Mistral's [TOOL_CALLS])")
        mode = "auto" if choice is None else choice if isinstance(choice, str) else "required"
        if isinstance(choice, NamedChoice):
            wanted = choice.function.get("name")
            chosen = [t for t in tools if t.name == wanted]
            if not chosen:
                raise InputError(f"tool_choice names {wanted!r}, which is not one of the tools ({', '.join(names)})")
            tools = chosen
        return cls(tuple(tools), syntax, mode, bool(parallel) and syntax.parallel)

    def constraint(self) -> dict:
        """The sampler's grammar options: the calls' grammar, from the first token (a call is
        required) or from the word that opens a call on (auto); nothing for "none"."""
        if self.mode == "none":
            return {}
        grammar = self.syntax.grammar(list(self.tools), self.parallel)
        if self.mode == "required":
            return {"grammar": grammar}
        return {"grammar": grammar, "grammar_lazy": True, "grammar_triggers": [self.syntax.trigger()]}
