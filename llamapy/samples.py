"""Training examples from files: JSONL in MLX-LM's three formats, or a text cut into samples.

A `.jsonl` file holds one sample per line, all in one format (detected from the first
sample, or named):
- "text":        {"text": "..."}                                   (all of it trains)
- "completions": {"prompt": "...", "completion": "..."}            (a user turn and its answer)
- "chat":        {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "..."}, ...]}

Plain text becomes one sample, or several when `sample_start` is given: llama.cpp's old
finetune started a new sample at every occurrence of that string. Every problem is one
InputError naming the file and line.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from .errors import InputError
from .text_input import check_text

Format = Literal["text", "completions", "chat"]
FORMATS: dict[Format, tuple[str, ...]] = {"text": ("text",), "completions": ("prompt", "completion"),
                                         "chat": ("messages",)}
ROLES = ("system", "user", "assistant", "tool")


@dataclass
class Sample:
    """One example: plain text, or a conversation (a prompt/completion pair is a user turn
    and an assistant turn). `where` says where it came from, for error messages."""

    text: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    where: str = ""

    @property
    def is_chat(self) -> bool:
        return self.text is None


def detect_format(record: dict, where: str) -> Format:
    """The format whose keys `record` has (exactly one must match)."""
    found = [name for name, keys in FORMATS.items() if all(k in record for k in keys)]
    if len(found) != 1:
        expected = " or ".join("{" + ", ".join(f'"{k}"' for k in keys) + "}" for keys in FORMATS.values())
        raise InputError(f"{where}: a sample needs {expected}; this one has keys {sorted(record)}")
    return found[0]


def _string(record: dict, key: str, where: str) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        raise InputError(f"{where}: \"{key}\" must be a string, got {type(value).__name__}")
    return check_text(value, f"{where}: \"{key}\"")


def _messages(record: dict, where: str) -> list[dict[str, str]]:
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise InputError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise InputError(f"{where}: message {i} needs \"role\" and \"content\"")
        if m["role"] not in ROLES:
            raise InputError(f"{where}: message {i} has an unknown role {m['role']!r} (known: {', '.join(ROLES)})")
        if not isinstance(m["content"], str):
            raise InputError(f"{where}: message {i}: \"content\" must be a string")
        check_text(m["content"], f"{where}: message {i}")
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "assistant" for m in out):
        raise InputError(f"{where}: the conversation has no assistant turn: nothing to learn")
    return out


def parse_record(record: dict, fmt: Format, where: str) -> Sample:
    if fmt == "text":
        return Sample(text=_string(record, "text", where), where=where)
    if fmt == "completions":
        return Sample(messages=[{"role": "user", "content": _string(record, "prompt", where)},
                                {"role": "assistant", "content": _string(record, "completion", where)}], where=where)
    return Sample(messages=_messages(record, where), where=where)


def is_jsonl(path: str | os.PathLike) -> bool:
    """A JSONL file by its extension, in any case (`train.JSONL`)."""
    return Path(path).suffix.lower() == ".jsonl"


def parse_jsonl_line(line: str, where: str, fmt: Format | None) -> tuple[Sample, Format]:
    """The sample of one JSONL line and its format, which must be `fmt` when that is known
    (one format per file); every problem one InputError naming `where`."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise InputError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from None
    except RecursionError:
        raise InputError(f"{where}: JSON nested too deeply") from None
    if not isinstance(record, dict):
        raise InputError(f"{where}: a sample must be a JSON object, got {type(record).__name__}")
    found = detect_format(record, where)
    if fmt is not None and found != fmt:
        raise InputError(f"{where}: a {found!r} sample in a file of {fmt!r} samples (one format per file)")
    return parse_record(record, found, where), found


def read_jsonl(path: str | os.PathLike, fmt: Format | None = None) -> tuple[list[Sample], Format]:
    """The samples of a JSONL file and their format (detected from the first line unless
    given; every line must then be in it). Lines end at "\n" only (JSON strings may hold
    U+2028 or U+0085 unescaped); blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"dataset file not found: {path}")
    if fmt is not None and fmt not in FORMATS:
        raise InputError(f"unknown data format {fmt!r} (known: {', '.join(FORMATS)})")
    samples: list[Sample] = []
    try:
        lines = path.read_bytes().decode("utf-8").split("\n")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        sample, fmt = parse_jsonl_line(line, f"{path}:{number}", fmt)
        samples.append(sample)
    if not samples:
        raise InputError(f"{path}: no samples (the file is empty)")
    return samples, fmt


def split_text(text: str, sample_start: str | None, where: str, include_sample_start: bool = False) -> list[Sample]:
    """Plain text as one sample, or, as llama.cpp's old finetune did, one sample after each
    occurrence of `sample_start` up to the next (the pattern itself only with
    `include_sample_start`; text before the first occurrence is not a sample)."""
    if not sample_start:
        return [Sample(text=text, where=where)]
    parts = text.split(sample_start)[1:]
    if not parts:
        raise InputError(f"{where}: the sample start {sample_start!r} does not occur in the text")
    lead = sample_start if include_sample_start else ""
    return [Sample(text=lead + part, where=f"{where} (sample {i + 1})") for i, part in enumerate(parts)]


def unescape(text: str) -> str:
    """llama.cpp's --escape: \\n, \\r, \\t, \\', \\" and \\\\ in a command-line string (read left to
    right, one regex pass: a long text is not turned into a list of its characters)."""
    return _ESCAPE.sub(lambda m: _UNESCAPED[m.group(1)], text)


_UNESCAPED = {"n": "\n", "r": "\r", "t": "\t", "'": "'", '"': '"', "\\": "\\"}
_ESCAPE = re.compile(r"""\\([nrt'"\\])""")
