"""The server's one error shape, OpenAI's {"error": {"code", "message", "type"}}, for every
status it answers with (the ASGI gate's 401 and 413 as much as the endpoints' 400s)."""
from __future__ import annotations

import json

from starlette.responses import JSONResponse

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error",
               501: "not_supported_error", 503: "unavailable_error"}


class ApiError(Exception):
    """A request the server refuses (or cannot serve): its status and the message for the client."""

    def __init__(self, code: int, message: str, kind: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message = code, message
        self.kind = kind or ERROR_TYPES.get(code, "server_error")


class AsciiJSONResponse(JSONResponse):
    """JSON in ASCII: an error message quoting what a client sent can always be encoded (a
    lone surrogate would make Starlette's UTF-8 rendering fail, turning a 400 into a 500)."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(code: int, message: str, kind: str | None = None) -> JSONResponse:
    kind = kind or ERROR_TYPES.get(code, "server_error")
    return AsciiJSONResponse({"error": {"code": code, "message": message, "type": kind}}, status_code=code)
