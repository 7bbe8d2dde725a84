"""Hermes-style calls (Qwen 2.5, Qwen 3, and the templates that copy them): each call a JSON
object {"name": ..., "arguments": {...}} between <tool_call> and </tool_call>, after any
words of the answer."""
from __future__ import annotations

from .syntax import ParsedReply, ToolSyntax, call_from, read_json

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class Hermes(ToolSyntax):
    name = "hermes"
    opener = OPEN
    markers = (OPEN, "tools")

    def calls_rule(self, call: str, parallel: bool) -> str:
        block = f'"{OPEN}\\n" space {call} space "{CLOSE}"'
        return f"{block} (space {block})*" if parallel else block

    def parse(self, text: str) -> ParsedReply:
        at = text.find(OPEN)
        if at < 0:
            return ParsedReply(text, [])
        calls, pos = [], at
        while text.startswith(OPEN, pos):
            found = read_json(text, pos + len(OPEN))
            call = found and call_from(found[0], self.arguments_key)
            if call is None:
                return ParsedReply(text, [])  # not a call after all: the words stand
            calls.append(call)
            pos = found[1]
            while pos < len(text) and text[pos] in " \t\r\n":
                pos += 1
            if text.startswith(CLOSE, pos):
                pos += len(CLOSE)
            while pos < len(text) and text[pos] in " \t\r\n":
                pos += 1
        return ParsedReply(text[:at] + text[pos:], calls)
