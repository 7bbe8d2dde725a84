"""ggml-opt's progress lines (ggmlpy.opt.ProgressBar): redrawn in place and fitted to the
width on a terminal; in a log, a line every few seconds and each pass's last line. Fake
streams and a fake clock: nothing sleeps."""
import io
import os
import re
import shutil

import pytest

from ggmlpy import opt

GGML_LINE = re.compile(r"^(epoch 1: )?train: \[[ ▏▎▍▌▋▊▉█]{8}\] data=\d{7}/\d{7} loss=\d+\.\d{5}±\d+\.\d{5} "
                       r"acc=\d+\.\d{2}±\d+\.\d{2}% t=\d\d:\d\d:\d\d ETA=\d\d:\d\d:\d\d$")


class FakeOptContext:
    batch_size = 4  # datapoints per evaluation


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def result_of(n_batches: int) -> opt.Result:
    r = opt.Result()
    for i in range(n_batches):
        r.add_batch(4, 2.0 + 0.1 * (i % 3), [0, 1, 1, 0], 3, True)
    return r


def run_pass(bar, clock, n: int = 40, seconds_each: float = 1.0, train: bool = True):
    """A pass of `n` evaluations taking `seconds_each`, as opt_epoch reports it."""
    t_start = clock.now
    for i in range(1, n + 1):
        clock.now += seconds_each
        bar(train, FakeOptContext(), None, result_of(i), i, n, t_start)


def test_a_log_gets_a_line_every_interval_and_the_last_line():
    stream, clock = io.StringIO(), Clock()
    bar = opt.ProgressBar(stream, interval=10, clock=clock, prefix=lambda train: "epoch 1: " if train else " " * 9,
                          unit="tokens", per_datapoint=32)
    run_pass(bar, clock, n=35)
    text = stream.getvalue()
    assert "\r" not in text and "\033" not in text
    lines = text.splitlines()
    assert len(lines) == 4  # after 10, 20 and 30 s, and the last
    for line, done in zip(lines, (10, 20, 30)):
        assert line.startswith(f"epoch 1: train: data={4 * done:07d}/0000140 loss=")
        assert re.search(r"loss=\d\.\d{5}±\d\.\d{5} acc=75\.00±\d\.\d\d% 128 tokens/s t=00:00:\d\d ETA=00:00:\d\d$", line)
    assert lines[0].endswith("t=00:00:10 ETA=00:00:25")  # 10 of 35 evaluations took 10 s
    assert GGML_LINE.match(lines[-1]) and "data=0000140/0000140" in lines[-1]
    # the validation pass that follows starts its own interval
    run_pass(bar, clock, n=15, train=False)
    val = stream.getvalue().splitlines()[4:]
    assert len(val) == 2 and val[0].startswith("         val:   data=0000040/0000060") and "[" in val[1]


def test_the_interval_comes_from_the_argument_or_the_environment(monkeypatch):
    for interval, env, lines in ((0, None, 12), (None, "5", 3), (None, None, 2)):
        if env is None:
            monkeypatch.delenv(opt.PROGRESS_INTERVAL_ENV, raising=False)
        else:
            monkeypatch.setenv(opt.PROGRESS_INTERVAL_ENV, env)
        stream, clock = io.StringIO(), Clock()
        run_pass(opt.ProgressBar(stream, interval=interval, clock=clock), clock, n=12)
        assert len(stream.getvalue().splitlines()) == lines, (interval, env)
    with pytest.raises(ValueError, match="seconds"):
        opt.ProgressBar(interval=-1)
    monkeypatch.setenv(opt.PROGRESS_INTERVAL_ENV, "soon")
    with pytest.raises(ValueError, match=opt.PROGRESS_INTERVAL_ENV):
        opt.ProgressBar()


def drawn(stream: io.StringIO) -> list[str]:
    """The lines a terminal shows in turn (each redraw ends with an erase and a carriage return)."""
    return [line.replace("\033[K", "") for line in re.split(r"[\r\n]", stream.getvalue()) if line]


def test_on_a_wide_terminal_the_line_is_ggmls_redrawn_in_place(monkeypatch):
    monkeypatch.setattr(shutil, "get_terminal_size", lambda *a, **k: os.terminal_size((200, 50)))
    monkeypatch.delenv("COLUMNS", raising=False)
    stream, clock = Terminal(), Clock()
    run_pass(opt.ProgressBar(stream, clock=clock, prefix=lambda train: "epoch 1: "), clock, n=20)
    assert stream.getvalue().count("\r") == 19 and stream.getvalue().endswith("\033[K\n")
    lines = drawn(stream)
    assert len(lines) == 20 and all(GGML_LINE.match(line) for line in lines[1:])  # the first has one batch: no spread
    assert lines[-1].startswith("epoch 1: train: [███████▉] data=0000080/0000080")


@pytest.mark.parametrize("columns", [100, 80, 60, 40, 20])
def test_on_a_narrow_terminal_the_line_fits(monkeypatch, columns):
    monkeypatch.setattr(shutil, "get_terminal_size", lambda *a, **k: os.terminal_size((columns, 50)))
    monkeypatch.delenv("COLUMNS", raising=False)
    stream, clock = Terminal(), Clock()
    run_pass(opt.ProgressBar(stream, clock=clock, prefix=lambda train: "epoch 12: "), clock, n=20, seconds_each=400)
    lines = drawn(stream)
    assert len(lines) == 20 and all(len(line) < columns for line in lines)
    if columns >= 80:  # what matters most stays: the position, the loss and the ETA
        assert all(re.search(r"data=\d+/0*80 loss=\d\.\d{5}.* ETA=\d\d:\d\d:\d\d$", line) for line in lines)
        assert all("[" in line for line in lines)  # a bar, perhaps narrower


def test_one_batch_has_no_spread():
    r = result_of(1)
    assert r.loss()[1] != r.loss()[1]  # nan: one value has no spread
    line = opt.format_progress(False, r, 4, 4, 1.0)
    assert "±" not in line.split("acc=")[0] and "nan" not in line
    assert re.search(r"loss=2\.00000 acc=75\.00±\d+\.\d\d%", line)  # four datapoints: the accuracy has one
    assert opt.loss_and_accuracy(result_of(3)).startswith("loss=2.10000±0.05774 acc=75.00±")


def test_the_full_line_is_ggmls_format():
    line = opt.format_progress(True, result_of(5), 12, 20, 30.0)
    assert GGML_LINE.match(line) and line.endswith("t=00:00:30 ETA=00:00:20")
    assert opt.format_progress(True, result_of(5), 20, 20, 30.0).startswith("train: [███████▉] data=0000020/0000020")
