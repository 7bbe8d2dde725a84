"""Conversations with tool calls as templates read them, normalised as llama.cpp normalises
them before rendering: a call's arguments (OpenAI's JSON text) as the object they encode when
the template writes objects (most do: `arguments | tojson`), an assistant message that only
calls tools with "" for content."""
from __future__ import annotations

import json
import weakref
from typing import TYPE_CHECKING, Any

from ..errors import InputError

if TYPE_CHECKING:
    from ..chat import ChatTemplate

NEEDLE = {"needle_argument": "needle value"}
_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # template -> its answer, probed once


def writes_object_arguments(template: ChatTemplate) -> bool:
    """Whether the template renders a call's arguments given as an object as that object's
    JSON (llama.cpp's supports_object_arguments, found by rendering a probe conversation once
    per template)."""
    if template not in _PROBED:
        _PROBED[template] = _probe(template)
    return _PROBED[template]


def _probe(template: ChatTemplate) -> bool:
    probe = [{"role": "user", "content": "probe"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"id": "call00001", "type": "function", "function": {"name": "probe", "arguments": NEEDLE}}]}]
    try:
        text = template.render(probe, tools=[{"type": "function", "function": {"name": "probe", "parameters": {}}}])
    except InputError:
        return False
    return '"needle_argument"' in text and '\\"needle_argument\\"' not in text


def template_messages(messages: list[dict[str, Any]], object_arguments: bool) -> list[dict[str, Any]]:
    """Copies of `messages` ready for the template (see the module docstring)."""
    out = []
    for message in messages:
        message = dict(message)
        calls = message.get("tool_calls")
        if calls:
            if message.get("content") is None:
                message["content"] = ""
            message["tool_calls"] = [_call(c, object_arguments) for c in calls]
        out.append(message)
    return out


def _call(call: dict[str, Any], object_arguments: bool) -> dict[str, Any]:
    call = {**call, "function": dict(call.get("function") or {})}
    args = call["function"].get("arguments")
    if object_arguments and isinstance(args, str):
        try:
            call["function"]["arguments"] = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise InputError(f"tool call {call['function'].get('name')!r}: its arguments are not JSON ({e.msg})") from None
    return call
