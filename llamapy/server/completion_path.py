"""The one completion path every completion endpoint answers through: its jobs' events
become either a stream of server-sent events or one JSON answer, in the endpoint's shape.

A shape (OpenAI's chat, OpenAI's completion, llama-server's native completion) says what a
client sees of each event; this module does the rest the same way for all of them: the
stream's framing (`data: {...}` lines, `data: [DONE]` where the shape has one, an error as
`data: {"error": ...}`), a client that leaves (its jobs cancelled; a 499 for a whole answer),
a job that fails (its error, or the stream's last event).
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from .engine import Done, TokenOut

DONE_LINE = "data: [DONE]\n\n"


@dataclass
class Result:
    """One job's whole answer: the tokens it sampled (as events) and how it ended."""
    outs: list[TokenOut] = field(default_factory=list)
    done: Done | None = None


class Shape(Protocol):
    """What the client of one endpoint sees (a new shape per request: it may keep state)."""
    done_line: str  # what ends the stream ("" for none)

    def head(self) -> list[dict]:
        """Stream chunks before any token."""

    def chunk(self, index: int, out: TokenOut) -> dict | None:
        """The stream chunk of one token of prompt `index` (None: nothing to send)."""

    def tail(self, index: int, done: Done) -> list[dict]:
        """Stream chunks at the end of prompt `index`."""

    def whole(self, results: list[Result]) -> Any:
        """The whole (not streamed) answer."""


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def error_event(message: str, code: int = 500) -> dict:
    kind = "server_error" if code >= 500 else "invalid_request_error"
    return {"error": {"code": code, "message": message, "type": kind}}


def stream_answer(events: AsyncIterator, shape: Shape) -> StreamingResponse:
    """The jobs' events as server-sent events in `shape` (events: (prompt index, event))."""
    async def lines() -> AsyncIterator[str]:
        for chunk in shape.head():
            yield sse(chunk)
        async for index, event in events:
            if isinstance(event, TokenOut):
                chunk = shape.chunk(index, event)
                if chunk is not None:
                    yield sse(chunk)
            elif isinstance(event, Done):
                for chunk in shape.tail(index, event):
                    yield sse(chunk)
            else:
                yield sse(error_event(event.message, event.code))
                return
        if shape.done_line:
            yield shape.done_line
    return StreamingResponse(lines(), media_type="text/event-stream")


def whole_answer(results: list[Result] | None, shape: Shape) -> Response:
    """The jobs' whole answer in `shape`; 499 (nobody reads it) when the client left."""
    if results is None:
        return PlainTextResponse("", status_code=499)
    return JSONResponse(shape.whole(results))
