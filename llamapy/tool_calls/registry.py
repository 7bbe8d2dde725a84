"""The tool-call syntaxes, and which one a template uses (read from its source)."""
from __future__ import annotations

from .hermes import Hermes
from .llama3 import Llama3Json
from .mistral import Mistral
from .syntax import ToolSyntax

SYNTAXES: tuple[ToolSyntax, ...] = (Hermes(), Mistral(), Llama3Json())


def syntax_for(source: str) -> ToolSyntax | None:
    """The syntax a template's text shows its model, or None for a template without tools."""
    return next((s for s in SYNTAXES if s.matches(source)), None)
