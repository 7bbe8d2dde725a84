"""A streamed reply split as it comes: words go to the client at once, a call is held from
the word that opens it until the reply ends (then parsed whole), and so is a tail of text
that may be the start of that word."""
from __future__ import annotations

from .syntax import ParsedReply, ToolSyntax


class CallStream:
    def __init__(self, syntax: ToolSyntax) -> None:
        self.syntax = syntax
        self.text = ""     # the whole reply so far
        self.sent = 0      # characters of it already given out as content
        self.held = False  # a call has begun: nothing more is given out before the end

    def feed(self, piece: str) -> str:
        """The content that can go out now, with `piece` added to the reply."""
        self.text += piece
        if self.held:
            return ""
        at = self.syntax.call_start(self.text, self.sent)
        if at >= 0:
            self.held = True
            return self._send(at)
        return self._send(len(self.text) - self.syntax.undecided(self.text, self.sent))

    def finish(self) -> ParsedReply:
        """The rest of the content (what was held and is not a call) and the calls."""
        whole = self.syntax.parse(self.text)
        if not whole.calls:
            return ParsedReply(self.text[self.sent:], [])
        rest = whole.content[self.sent:]  # the content starts with all the text before the calls
        return ParsedReply(rest if rest.strip() else "", whole.calls)

    def _send(self, end: int) -> str:
        out = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return out
