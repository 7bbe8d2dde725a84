"""Tool calling: OpenAI's `tools` given to a chat template, the model's calls constrained by a
grammar and parsed back into OpenAI's `tool_calls`.

A template that declares tools writes them into the prompt and shows the model a syntax for
its calls; each syntax this package knows is one small module (hermes.py: Qwen 2.5/3's
`<tool_call>` blocks; llama3.py: Llama 3.x's bare JSON object; mistral.py: Mistral's
`[TOOL_CALLS]` list), found from the template's own text (registry.py). A syntax gives the
grammar of its calls over the tools' parameter schemas, the word that opens a call (a lazy
grammar's trigger when the model may answer in words instead) and the parser of a reply.
"""
from .messages import template_messages
from .registry import SYNTAXES, syntax_for
from .stream import CallStream
from .syntax import ParsedReply, ToolCall, ToolSyntax
from .tools import Tool, ToolChoice, ToolUse

__all__ = ["SYNTAXES", "CallStream", "ParsedReply", "Tool", "ToolCall", "ToolChoice", "ToolSyntax", "ToolUse",
           "syntax_for", "template_messages"]
