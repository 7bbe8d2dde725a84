"""ggml-opt's progress lines: the bar, the loss and accuracy with their spreads, the
times; redrawn in place on a terminal, a line every few seconds elsewhere."""
from __future__ import annotations

import io
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from .result import Result

if TYPE_CHECKING:
    from .context import OptContext
    from .dataset import Dataset


_BLOCKS = " ▏▎▍▌▋▊▉█"
PROGRESS_INTERVAL = 10.0  # seconds between progress lines on a stream that is not a terminal
PROGRESS_INTERVAL_ENV = "GGMLPY_PROGRESS_INTERVAL"  # sets that default (a number of seconds)


def hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600:02d}:{s // 60 % 60:02d}:{s % 60:02d}"


def _bar(done: int, total: int, cells: int) -> str:
    """ggml's bar of `cells` cells of eighths (it never fills the last eighth)."""
    out = []
    for j in range(cells):
        level = 0
        for eighth in range(8, 0, -1):
            if total * (8 * j + eighth) // cells < 8 * done:
                level = eighth
                break
        out.append(_BLOCKS[level])
    return "".join(out)


def _with_spread(value: float, spread: float, digits: int) -> str:
    """`value±spread`; the value alone when there is no spread (one batch, one datapoint)."""
    return f"{value:.{digits}f}" + ("" if math.isnan(spread) else f"±{spread:.{digits}f}")


def loss_and_accuracy(result: Result, *, spreads: bool = True, accuracy: bool = True,
                      accuracy_spread: bool = True) -> str:
    """`loss=X±U acc=Y±V%` for a result, as ggml-opt prints them (a spread only where there is one)."""
    loss, loss_unc = result.loss()
    text = f"loss={_with_spread(loss, loss_unc if spreads else math.nan, 5)}"
    if accuracy:
        acc, acc_unc = result.accuracy()
        text += f" acc={_with_spread(100 * acc, 100 * acc_unc if spreads and accuracy_spread else math.nan, 2)}%"
    return text


# a progress line too wide for the terminal loses these, in turn, until it fits
_NARROWER = ({"acc_spread": False}, {"show_time": False}, {"padded": False}, {"cells": 4}, {"loss_spread": False},
             {"accuracy": False}, {"cells": 0})


def format_progress(train: bool, result: Result, done: int, total: int, elapsed: float, *, prefix: str = "",
                    columns: int | None = None, rate: str | None = None, cells: int = 8) -> str:
    """One progress line of a pass that has counted `done` of `total` datapoints in `elapsed`
    seconds: ggml-opt's `train: [bar] data=done/total loss=X±U acc=Y±V% t=H:M:S ETA=H:M:S`
    after `prefix`, with `rate` (e.g. "1234 tokens/s") before the times when given and
    without the bar when `cells` is 0. With `columns`, fields give way (a narrower bar, then
    the least useful fields) until the line is shorter than that; it is cut if it still is not."""
    eta = elapsed * (total - done) / done if done > 0 else 0.0
    head = prefix + ("train: " if train else "val:   ")

    def line(cells: int, padded: bool = True, loss_spread: bool = True, acc_spread: bool = True,
             accuracy: bool = True, show_time: bool = True) -> str:
        bar = f"[{_bar(done, total, cells)}] " if cells else ""
        data = f"data={done:07d}/{total:07d}" if padded else f"data={done}/{total}"
        stats = loss_and_accuracy(result, spreads=loss_spread, accuracy=accuracy, accuracy_spread=acc_spread)
        times = (f" t={hms(elapsed)}" if show_time else "") + f" ETA={hms(eta)}"
        return f"{head}{bar}{data} {stats}" + (f" {rate}" if rate else "") + times

    options: dict[str, Any] = {"cells": cells}
    text = line(**options)
    for change in _NARROWER if columns is not None else ():
        if len(text) < columns:
            return text
        options.update(change)
        options["cells"] = min(options["cells"], cells)
        text = line(**options)
    return text if columns is None else text[:max(columns - 1, 0)]


def progress_interval(interval: float | None = None) -> float:
    """Seconds between progress lines off a terminal: `interval`, else $GGMLPY_PROGRESS_INTERVAL, else 10."""
    if interval is None:
        env = os.environ.get(PROGRESS_INTERVAL_ENV)
        try:
            interval = float(env) if env else PROGRESS_INTERVAL
        except ValueError:
            raise ValueError(f"${PROGRESS_INTERVAL_ENV} must be a number of seconds, not {env!r}") from None
    if not interval >= 0:
        raise ValueError(f"the progress interval must be a number of seconds >= 0, not {interval!r}")
    return float(interval)


def _terminal_columns(stream: TextIO) -> int:
    """The width of the terminal `stream` writes to ($COLUMNS first, as shutil reads it)."""
    if not os.environ.get("COLUMNS"):
        try:
            columns = os.get_terminal_size(stream.fileno()).columns
            if columns > 0:
                return columns
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            pass
    return shutil.get_terminal_size().columns


class ProgressBar:
    """ggml-opt's progress lines, as an EpochCallback (`callback_train` / `callback_eval`).

    On a terminal the line is redrawn in place after every evaluation, fitted to the
    terminal's width, and each pass ends with its last line. On anything else (a log file,
    a pipe) there are no carriage returns: one line every `interval` seconds (None: see
    `progress_interval`) with the position, the loss so far, the accuracy, the speed and
    the ETA, and each pass's last line in ggml's format. `prefix(train)` starts every line
    (e.g. the epoch); `unit` and `per_datapoint` name the speed (`per_datapoint` units per
    datapoint counted; "data" by default). `clock` must be the clock `t_start` comes from.
    """

    def __init__(self, stream: TextIO | None = None, *, interval: float | None = None,
                 prefix: Callable[[bool], str] | None = None, unit: str = "data", per_datapoint: float = 1.0,
                 tty: bool | None = None, columns: int | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.stream = stream
        self.interval = progress_interval(interval)
        self.prefix, self.unit, self.per_datapoint = prefix, unit, per_datapoint
        self.tty, self.columns, self.clock = tty, columns, clock
        self._pass: tuple[bool, float] | None = None  # the pass being reported and its last line's time
        self._last_line = 0.0

    def __call__(self, train: bool, opt_ctx: OptContext, dataset: Dataset, result: Result, ibatch: int,
                 ibatch_max: int, t_start: float) -> None:
        stream = self.stream or sys.stderr
        tty = self.tty if self.tty is not None else bool(getattr(stream, "isatty", lambda: False)())
        now, batch, final = self.clock(), opt_ctx.batch_size, ibatch >= ibatch_max
        done, total, elapsed = ibatch * batch, ibatch_max * batch, now - t_start
        prefix = self.prefix(train) if self.prefix else ""
        if tty:
            columns = self.columns or _terminal_columns(stream)
            stream.write(format_progress(train, result, done, total, elapsed, prefix=prefix, columns=columns)
                         + "\033[K" + ("\n" if final else "\r"))
        else:
            if self._pass != (train, t_start):
                self._pass, self._last_line = (train, t_start), t_start
            if final:
                line = format_progress(train, result, done, total, elapsed, prefix=prefix)
            elif now - self._last_line >= self.interval:
                rate = done * self.per_datapoint / elapsed if elapsed > 0 else math.nan
                line = format_progress(train, result, done, total, elapsed, prefix=prefix, cells=0,
                                       rate=f"{rate:.0f} {self.unit}/s" if rate >= 100 else f"{rate:.3g} {self.unit}/s")
            else:
                return
            self._last_line = now
            stream.write(line + "\n")
        stream.flush()
