"""What every request passes before an endpoint sees it: the API key, the body's size, and the
body read as JSON whatever its Content-Type says (llama-server's rule: `curl -d '{...}'` sends
a form type).

A plain ASGI middleware: it never buffers a streamed response. The body is read here, counted
as it arrives (a Content-Length past the limit is refused before anything is read, a chunked
body as soon as the count passes it), so a body larger than --max-body is never parsed: 413.
"""
from __future__ import annotations

import secrets

from .errors import error_response
from .limits import DEFAULT_MAX_BODY

OPEN_PATHS = ("/health", "/v1/health", "/", "/index.html")  # the chat page asks for the key itself


class Gate:
    """The ASGI application in front of the endpoints (module docstring)."""

    def __init__(self, app, api_key: str | None, max_body: int = DEFAULT_MAX_BODY) -> None:
        self.app, self.api_key, self.max_body = app, api_key.encode() if api_key else None, max_body

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = [(k, v) for k, v in scope.get("headers") or [] if k != b"content-type"]
        found = dict(headers)
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            given = found.get(b"x-api-key") or found.get(b"authorization", b"").removeprefix(b"Bearer ").strip()
            if not secrets.compare_digest(given, self.api_key):
                await error_response(401, "Invalid API Key")(scope, receive, send)
                return
        declared = found.get(b"content-length", b"").strip()
        if declared.isdigit() and int(declared) > self.max_body:
            await self._too_large(scope, receive, send)
            return
        body, too_large = await self._read_body(receive)
        if too_large:
            await self._too_large(scope, receive, send)
        if body is None:  # too large, or the client left before sending it all
            return
        await self.app({**scope, "headers": headers + [(b"content-type", b"application/json")]},
                       _replay(body, receive), send)

    async def _read_body(self, receive) -> tuple[bytes | None, bool]:
        """(the whole body, False); (None, True) once it passes max_body; (None, False) when
        the client disconnects before sending it all."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, False
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return None, True
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), False

    async def _too_large(self, scope, receive, send) -> None:
        await error_response(413, f"the request body is larger than this server's limit of {self.max_body} bytes "
                                  "(--max-body)")(scope, receive, send)


def _replay(body: bytes, receive):
    """An ASGI receive that gives the body already read, then what the client sends next
    (its disconnect, which is how a streaming answer learns the client left)."""
    given = False

    async def replayed():
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replayed
