"""One line on the server's log per request, when its answer is complete (a stream's last
byte included): method, path, client, status, the tokens it read and generated, the time.

    request: POST /completion 127.0.0.1 200: 5 prompt tokens (0 cached), 64 generated, 812.4 ms

An endpoint reports its token counts through `note_tokens(request, ...)` (a completion's at
its end, an embedding's when computed); requests without tokens (/health, /props, ...) log
the rest. A client gone before the end is logged with status 499.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from starlette.requests import Request

SCOPE_KEY = "llamapy.access"  # the request's record in its ASGI scope (shared with the endpoint's copy)


def note_tokens(request: Request, prompt: int, generated: int = 0, cached: int = 0) -> None:
    """Add a request's tokens to its log line (several prompts of one request add up)."""
    record = request.scope.get(SCOPE_KEY)
    if record is not None:
        record["prompt"] += prompt
        record["generated"] += generated
        record["cached"] += cached
        record["counted"] = True


class AccessLog:
    """ASGI middleware writing each request's line with `write` (the server's log)."""

    def __init__(self, app, write: Callable[[str], None]) -> None:
        self.app, self.write = app, write

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = {"status": 499, "prompt": 0, "generated": 0, "cached": 0, "counted": False, "finished": False}
        scope[SCOPE_KEY] = record
        t0 = time.perf_counter()

        async def watched(message) -> None:
            if message["type"] == "http.response.start":
                record["status"] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                record["finished"] = True
            await send(message)
        try:
            await self.app(scope, receive, watched)
        finally:
            self.write(self.line(scope, record, (time.perf_counter() - t0) * 1e3))

    @staticmethod
    def line(scope, record: dict, ms: float) -> str:
        client = (scope.get("client") or ("-",))[0]
        status = record["status"] if record["finished"] else 499
        tokens = (f": {record['prompt']} prompt tokens ({record['cached']} cached), {record['generated']} generated"
                  if record["counted"] else "")
        return f"request: {scope['method']} {scope['path']} {client} {status}{tokens}, {ms:.1f} ms"
