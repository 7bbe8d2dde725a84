"""Large answers (the millions of tokens of a 16 MB /tokenize) rendered as JSON in pieces.

json.dumps of a long list is one C call that keeps the GIL for seconds: even in a worker
thread it would stall the event loop (and /health) that long. Rendered a slice at a time,
the loop gets its turn between slices.
"""
from __future__ import annotations

import json
from typing import Any

from starlette.responses import Response

SLICE = 16384  # items per json.dumps call: a few milliseconds each


def json_list_response(key: str, items: list[Any]) -> Response:
    """{"key": [items...]} as an application/json response (call it in a worker thread)."""
    parts = [json.dumps(items[i:i + SLICE], ensure_ascii=True, allow_nan=False, separators=(",", ":"))[1:-1]
             for i in range(0, len(items), SLICE)]
    body = '{"' + key + '":[' + ",".join(p for p in parts if p) + "]}"
    return Response(body.encode("ascii"), media_type="application/json")
