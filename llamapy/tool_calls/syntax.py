"""What every tool-call syntax shares: the calls' records, their grammar's pieces (a call is a
JSON object whose arguments follow the tool's parameter schema) and lenient JSON reading."""
from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..sampling.json_schema import read_schema
from ..sampling.json_schema_grammar import SchemaConverter, format_literal
from ..sampling.grammar_parser import GrammarError
from ..errors import InputError

if TYPE_CHECKING:
    from .tools import Tool

ID_CHARS = string.ascii_letters + string.digits


def new_call_id(length: int = 32) -> str:
    """A call id as llama-server makes one (random letters and digits)."""
    return "".join(secrets.choice(ID_CHARS) for _ in range(length))


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI gives it
    id: str = field(default_factory=new_call_id)

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedReply:
    """A reply split into what the model said (the text before its calls, then any after
    them, as written) and the calls it made."""
    content: str
    calls: list[ToolCall]


def arguments_text(value: Any) -> str:
    """Arguments as OpenAI's JSON text: an object written out, a string kept as the model wrote it."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def read_json(text: str, at: int = 0) -> tuple[Any, int] | None:
    """The JSON value starting at `text[at]` (after whitespace) and where it ends, or None."""
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    try:
        return json.JSONDecoder().raw_decode(text, at)
    except json.JSONDecodeError:
        return None


def call_from(value: Any, arguments_key: str, id_key: str | None = None) -> ToolCall | None:
    """A call from its JSON object ({"name": ..., arguments_key: {...}}), or None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get(arguments_key, {})
    call = ToolCall(value["name"], arguments_text(args))
    if id_key and isinstance(value.get(id_key), str):
        call.id = value[id_key]
    return call


class ToolSyntax:
    """A template's way of writing calls. Subclasses set the names and write `call_rule` and
    `parse`; the grammar around the calls is built here."""
    name: str = ""
    opener: str = ""          # the text that starts the model's calls (the lazy grammar's trigger)
    markers: tuple[str, ...] = ()  # texts in a template's source that show it uses this syntax
    parallel: bool = True     # several calls in one reply

    def matches(self, source: str) -> bool:
        return all(m in source for m in self.markers)

    def call_start(self, text: str, since: int = 0) -> int:
        """Where the reply's calls begin in `text` (searched from `since`), or -1."""
        return text.find(self.opener, since)

    def undecided(self, text: str, since: int = 0) -> int:
        """How many of the last characters of `text` may yet begin a call (held back)."""
        return next((k for k in range(min(len(self.opener) - 1, len(text) - since), 0, -1)
                     if self.opener.startswith(text[-k:])), 0)

    def trigger(self) -> dict:
        """What starts the calls' grammar when a call may come but need not (a lazy grammar)."""
        return {"type": "word", "value": self.opener}

    arguments_key: str = "arguments"  # the call object's key of the arguments
    call_tail: str = ""       # GBNF of the call object's keys after the arguments (with their commas)

    def call_object(self, tool: Tool, args_rule: str) -> str:
        """The GBNF of one call's JSON object: {"name": ..., arguments_key: ARGS, then call_tail}."""
        return (f'"{{" space {json_key("name")} {json_string_literal(tool.name)} space "," space '
                f'{json_key(self.arguments_key)} {args_rule}{self.call_tail} space "}}"')

    def calls_rule(self, call: str, parallel: bool) -> str:
        """The GBNF of the reply's calls (one, or one or more), given the rule of one call."""
        raise NotImplementedError

    def parse(self, text: str) -> ParsedReply:
        raise NotImplementedError

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        """The calls' grammar: each tool's call object, its arguments by its parameter schema."""
        conv = SchemaConverter()
        alternatives = []
        for tool in tools:
            try:
                args = conv.visit(read_schema(tool.schema()), f"tool-{tool.name}-args")
            except GrammarError as e:
                raise InputError(f"tools: {tool.name}'s parameters: {e}") from None
            alternatives.append(conv.add_rule(f"tool-{tool.name}", self.call_object(tool, args)))
        call = conv.add_rule("tool-call", " | ".join(alternatives))
        conv.add_rule("root", self.calls_rule(call, parallel))
        return conv.grammar()


def json_key(name: str) -> str:
    """GBNF of a JSON object's key and its colon."""
    return f'{format_literal(json.dumps(name))} space ":" space'


def json_string_literal(value: str) -> str:
    return format_literal(json.dumps(value, ensure_ascii=False))
