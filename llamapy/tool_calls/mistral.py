"""Mistral's calls (Mistral Nemo, Small, 7B v0.3): [TOOL_CALLS] and a JSON list of
{"name": ..., "arguments": {...}, "id": 9 letters or digits}; its templates refuse other ids."""
from __future__ import annotations

from .syntax import ParsedReply, ToolSyntax, call_from, json_key, read_json

OPEN = "[TOOL_CALLS]"


class Mistral(ToolSyntax):
    name = "mistral"
    opener = OPEN
    markers = (OPEN, "[AVAILABLE_TOOLS]")
    call_tail = f' space "," space {json_key("id")} "\\"" [a-zA-Z0-9]{{9}} "\\""'

    def calls_rule(self, call: str, parallel: bool) -> str:
        more = f' (space "," space {call})*' if parallel else ""
        return f'"{OPEN}[" space {call}{more} space "]"'

    def parse(self, text: str) -> ParsedReply:
        at = text.find(OPEN)
        found = read_json(text, at + len(OPEN)) if at >= 0 else None
        if found is None or not isinstance(found[0], list):
            return ParsedReply(text, [])
        calls = [call_from(item, self.arguments_key, "id") for item in found[0]]
        if not calls or any(c is None for c in calls):
            return ParsedReply(text, [])
        return ParsedReply(text[:at] + text[found[1]:], calls)
