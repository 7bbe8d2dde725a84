"""Llama 3.x's calls: the whole reply one JSON object {"name": ..., "parameters": {...}} (its
templates take one call per message)."""
from __future__ import annotations

from .syntax import ParsedReply, ToolSyntax, call_from, read_json


class Llama3Json(ToolSyntax):
    name = "llama3-json"
    opener = '{"name"'
    markers = ('"parameters": ', "<|start_header_id|>", "tools")
    parallel = False
    arguments_key = "parameters"

    def call_start(self, text: str, since: int = 0) -> int:
        """A call is the whole reply: it begins at the first character that is not a space,
        when that is a brace."""
        at = len(text) - len(text.lstrip())
        return at if text[at:at + 1] == "{" and at >= since else -1

    def undecided(self, text: str, since: int = 0) -> int:
        return len(text) - since if not text.strip() else 0

    def trigger(self) -> dict:
        return {"type": "pattern_full", "value": r"\s*(\{[\s\S]*)"}

    def calls_rule(self, call: str, parallel: bool) -> str:
        return call

    def parse(self, text: str) -> ParsedReply:
        at = text.find("{")
        found = read_json(text, at) if at >= 0 and not text[:at].strip() else None
        call = found and (call_from(found[0], self.arguments_key) or call_from(found[0], "arguments"))
        if call is None:
            return ParsedReply(text, [])
        return ParsedReply(text[:at] + text[found[1]:], [call])
