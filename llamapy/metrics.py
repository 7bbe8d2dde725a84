"""Training metrics as records, and the JSONL file they are written to as they happen.

One record per optimizer step (`StepRecord`) and one per validation (`EvalRecord`), the
same for the `--metrics` file, the Python hooks (`opt_fit(on_step=, on_eval=)`) and the
loss plot, so `tail -f`, a notebook and TensorBoard all see the numbers the run saw.

The file is one JSON object per line. Each line is written with one system call as soon as
its record exists (a reader never sees half a line) and the file is forced to disk before
every checkpoint, so a resumed run finds every record up to its checkpoint: it keeps those
(`MetricsFile.resume`) and appends from there, without a duplicate or a missing step.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .atomic import append_failure, open_to_append, replace_atomically, special_kind
from .errors import InputError, SaveError


def _number(x: float | None) -> float | None:
    """A float for JSON: None (null) where there is no value (NaN), as JSON has no NaN."""
    return None if x is None or not math.isfinite(x) else float(x)


@dataclass(kw_only=True)
class StepRecord:
    """One optimizer step. `epoch` counts epochs done (fractional, as Hugging Face's Trainer:
    1.5 is half-way through the second); `tokens` the tokens of the windows trained so far
    (every rank's); `loss`/`accuracy` the step's own (over its counted positions); `lr` the
    rate the step used; `grad_norm` the global L2 norm of its gradient, before clipping;
    `tokens_per_s` the step's own speed; `elapsed` the seconds of training so far (a resumed
    run carries on from its file's last record)."""

    step: int
    epoch: float
    tokens: int
    loss: float
    accuracy: float | None
    lr: float
    grad_norm: float | None
    tokens_per_s: float
    elapsed: float

    def to_dict(self) -> dict[str, Any]:
        d = {k: _number(v) if isinstance(v, float) else v for k, v in asdict(self).items()}
        return {"type": "step", **d}


@dataclass(kw_only=True)
class EvalRecord:
    """One validation, after optimizer step `step`: the mean loss and accuracy over the
    validation windows with their standard errors (None with a single window), whether it is
    an epoch's end, and the scores of `--eval-task` tasks (name -> value) when given."""

    step: int
    epoch: float
    val_loss: float
    val_loss_unc: float | None
    val_accuracy: float | None
    val_accuracy_unc: float | None
    end_of_epoch: bool
    elapsed: float
    tasks: dict[str, float | None] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = {k: _number(v) if isinstance(v, float) else v for k, v in asdict(self).items()}
        d["tasks"] = {k: _number(v) for k, v in self.tasks.items()}
        if not self.tasks:
            del d["tasks"]
        return {"type": "eval", **d}


Record = StepRecord | EvalRecord


def record_from_dict(d: dict[str, Any]) -> Record:
    """The record a line of a metrics file holds (KeyError/TypeError/ValueError when it holds none)."""
    kind = d.get("type")
    values = {k: v for k, v in d.items() if k != "type"}
    if kind == "step":
        return StepRecord(**values)
    if kind == "eval":
        return EvalRecord(**values)
    raise ValueError(f"unknown record type {kind!r}")


def read_records(path: str | os.PathLike) -> list[Record]:
    """Every record of a metrics file, in order. A last line without its newline (a run killed
    while writing it) is left out; any other line that is not a record is an InputError."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read the metrics file {path}: {getattr(e, 'strerror', None) or e}") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    elif lines:
        lines.pop()  # cut off mid-line
    records = []
    for n, line in enumerate(lines, 1):
        try:
            records.append(record_from_dict(json.loads(line)))
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise InputError(f"{path}:{n}: not a llamapy metrics record ({e}): give --metrics a new file "
                             "(Python: metrics=)") from None
    return records


class MetricsFile:
    """The JSONL file of a run's records (module docstring). A path that is not a regular
    file (a FIFO, /dev/stdout) is written to and never truncated or read."""

    def __init__(self, path: str | os.PathLike, kept: list[Record]) -> None:
        self.path = Path(path)
        self.kept = kept
        try:
            self._fd = open_to_append(self.path)
        except OSError as e:
            raise SaveError(f"cannot write the metrics to {self.path}: {append_failure(e)}") from None
        self._regular = special_kind(self.path) is None

    @classmethod
    def create(cls, path: str | os.PathLike, keep: Callable[[Record], bool] | None = None) -> "MetricsFile":
        """Open `path` for a run: a new run starts it empty; a resumed one (`keep`) keeps the
        records it will not write again, in a file replaced atomically, and appends after them."""
        path = Path(path)
        if special_kind(path) is not None:
            return cls(path, [])
        kept = [r for r in read_records(path) if keep(r)] if keep is not None and path.exists() else []
        if kept or path.exists():
            lines = "".join(json.dumps(r.to_dict()) + "\n" for r in kept).encode()
            replace_atomically(path, lambda out: out.write(lines), "the metrics file")
        return cls(path, kept)

    def write(self, record: Record) -> None:
        """Append one record as one line, in one write (a reader following the file sees whole lines)."""
        data = (json.dumps(record.to_dict()) + "\n").encode()
        try:
            while data:
                data = data[os.write(self._fd, data):]
        except OSError as e:
            raise SaveError(f"cannot write the metrics to {self.path}: {e.strerror or e}") from None

    def sync(self) -> None:
        """Force the records written so far to disk (before a checkpoint: module docstring)."""
        if self._regular:
            try:
                os.fsync(self._fd)
            except OSError as e:
                raise SaveError(f"cannot write the metrics to {self.path}: {e.strerror or e}") from None

    def close(self) -> None:
        if self._fd >= 0:
            self.sync()
            os.close(self._fd)
            self._fd = -1
