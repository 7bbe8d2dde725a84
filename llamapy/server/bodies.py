"""Request bodies to validated records, off the event loop.

Parsing and validating take time in proportion to a body's size (up to --max-body), so they
run in a worker thread: /health and the streams of other clients keep being answered while a
large body is read. pydantic's own JSON parser reads the body (not Python's json module): a
lone surrogate ("\\ud800"), bytes that are not UTF-8, nesting too deep to recurse into and
integers of thousands of digits are each a 400 naming the problem, never a 500.
"""
from __future__ import annotations

import asyncio
from functools import cache
from typing import Any

from fastapi import Request
from pydantic import TypeAdapter, ValidationError

from .errors import ApiError


async def parse_body(request: Request, schema: Any) -> Any:
    """The request's body as `schema` (a pydantic model or type), or ApiError 400 saying why not."""
    body = await request.body()
    return await asyncio.to_thread(validate_body, schema, body)


def validate_body(schema: Any, body: bytes) -> Any:
    if not body.strip():
        raise ApiError(400, "the request has no body: send a JSON object")
    try:
        return _type_adapter(schema).validate_json(body)
    except ValidationError as e:
        raise ApiError(400, validation_message(e.errors())) from None


@cache
def _type_adapter(schema: Any) -> TypeAdapter:
    return TypeAdapter(schema)


def validation_message(errors: list[dict]) -> str:
    """pydantic's errors as one line: `field.path: what is wrong; ...`."""
    parts = []
    for err in errors:
        if err.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON ({err.get('ctx', {}).get('error', 'decode error')})")
            continue
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        message = err.get("msg", "invalid").removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts) or "invalid request"
