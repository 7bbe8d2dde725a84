"""Context.opt_fit: a language model's training run on ggmlpy's one TrainingLoop.

`fit` sets a run up (`FitRun`: the windows and their split, a resumed checkpoint's
position, the ranks' agreement), then runs `TrainingLoop.run` (ggmlpy/opt/loop.py: epoch
-> optimizer step -> validation) with the FitRun as the loop's hooks: they print the
progress lines, record every step and validation in the run's FitWatch (the metrics
file, the caller's hooks, the plot, the best model so far: fit_watch.py), validate every
`eval_every` steps and write the checkpoints.

A checkpoint is written every `save_every` optimizer steps, at each epoch's end and on a
requested stop, so an interrupted run loses at most the work since the last one. A first
Ctrl-C while checkpointing asks the run to stop after the step in progress (the weights
are never saved half-updated); a second one stops at once.

Over several ranks (a trainer made with a communicator) only rank 0 prints and writes
checkpoints; before the first step every rank checks that it runs what rank 0 runs (model,
data, parameters, epochs, checkpointing, resumed position and weights); a stop request on
any rank stops every rank after the same step; every epoch ends with a check that all
ranks hold the same weights; and an error on one rank ends the whole job with one line
(naming the rank, and the exception's type when it is not llamapy's) instead of leaving
the others waiting.
"""
from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

from ggmlpy.opt import (
    Dataset,
    EpochResult,
    FitPosition,
    Hooks,
    OptContext,
    ProgressBar,
    Result,
    TrainingLoop,
    loss_and_accuracy,
)

from .checkpoint import model_fingerprint
from .dataset import join_windows, validation_windows
from .distributed import (RanksFailed, Setting, abort_job, any_rank, check_ranks_agree, check_same_weights,
                          describe_error, weights_digest)
from .errors import InputError, TrainingInterrupted
from .fit_watch import FitWatch, WatchOptions, check_watch, fractional_epoch
from .resume import load_checkpoint_into, resume_position, save_checkpoint_of


@dataclass(kw_only=True)
class FitOptions:
    """Context.opt_fit's options (its defaults and meanings are there)."""

    epochs: int | None                 # None: the schedule's
    val_split: float
    seed: int | None                   # shuffles the training windows every epoch
    val_data: Dataset | None           # instead of splitting val_split off the data
    eval_every: int | None             # optimizer steps between validations within an epoch
    checkpoint: str | Path | None
    save_every: int | None             # optimizer steps between checkpoints within an epoch
    resume: str | Path | None
    force_resume: bool
    silent: bool
    stream: TextIO | None              # progress and notes; stderr when None
    progress_interval: float | None
    on_epoch: Callable[[EpochResult], None] | None
    watch: WatchOptions                # metrics records, their hooks, the plot, the best model


def fit(trainer, dataset: Dataset, options: FitOptions) -> list[EpochResult]:
    """See Context.opt_fit: the run set up and checked by every rank (FitRun), then ggmlpy's
    TrainingLoop from the run's start with the run as its hooks, the stop request armed and
    rank 0's records open. Over several ranks, a failure of one ends every rank."""
    try:
        run = FitRun(trainer, dataset, options)
        loop = TrainingLoop(trainer.opt, run.dataset, run.idata_split, run, epochs=run.epochs, shuffle=trainer.run.rng,
                            start=run.start, start_result=run.start_result)
        redo_epoch_end = run.resumed and run.start.ibatch >= loop.n_train  # its training done, not validated
        with run.stop.armed(options.checkpoint is not None, run.say), run.watching(redo_epoch_end):
            return loop.run()
    except BaseException as e:  # noqa: BLE001 - any failure of one rank must end all of them
        if trainer.comm.size > 1 and not getattr(e, "on_every_rank", False):  # a shared stop ends every rank by itself
            abort_job(trainer.comm, describe_error(e))
        raise


class FitRun(Hooks):
    """One opt_fit of a Trainer: the windows and their split, where the run starts (a
    resumed checkpoint's position), and, as the TrainingLoop's hooks, what it prints and
    when it validates and checkpoints. Made, it has been checked by every rank (`fit` runs it)."""

    def __init__(self, trainer, dataset: Dataset, options: FitOptions) -> None:
        self.trainer, self.opt, self.comm, self.options = trainer, trainer.opt, trainer.comm, options
        self.epochs = options.epochs or trainer.params.schedule.epochs
        self.silent = options.silent or self.comm.rank != 0
        self.stream = options.stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.epoch = 0                                 # the epoch being trained (progress lines)
        self.start, self.start_result = FitPosition(), None
        self.resumed = False                           # from a checkpoint's position
        self.stop = _StopRequest()
        self.watch: FitWatch | None = None             # rank 0's records (fit_watch.py)
        self._mark = None                              # the watch's mark before the step in progress
        error = None  # a rank's failure while setting up: said at the check below, where every rank stops
        try:
            self._set_up(dataset)
        except Exception as e:
            if self.comm.size == 1:
                raise
            error = e
        if self.comm.size > 1:
            try:
                check_ranks_agree(self.comm, self._settings() if error is None else {},
                                  error=(describe_error(error), 1) if error else None)
            except RanksFailed as shared:
                raise shared from error
        # a ubatch evaluation is the progress counter's unit: n_ubatch tokens
        self.bar = None if self.silent else ProgressBar(
            self.stream, interval=options.progress_interval, prefix=self._progress_prefix, unit="tokens",
            per_datapoint=trainer.n_ubatch, tty=self.tty)

    def _set_up(self, dataset: Dataset) -> None:
        """Check the options, split the windows, and restore a checkpoint to resume from."""
        o, trainer = self.options, self.trainer
        if not 0.0 <= o.val_split < 1.0:
            raise InputError(f"val_split must be in [0, 1), got {o.val_split}")
        if o.save_every is not None and (o.save_every <= 0 or o.checkpoint is None):
            raise InputError(f"save_every must be a positive number of optimizer steps, with a checkpoint file "
                             f"(got {o.save_every}, checkpoint {o.checkpoint})")
        n_windows = dataset.ndata
        if o.val_data is not None:  # validation windows given apart: they follow the training windows
            dataset, idata_split = join_windows(dataset, o.val_data)
            held_out = ""
        else:
            idata_split = dataset.ndata - validation_windows(dataset.ndata, o.val_split)
            held_out = f" after holding out {o.val_split:.0%} for validation"
        if idata_split < trainer.windows_per_step:
            raise InputError(f"the text gives {n_windows} windows; {trainer.windows_per_step} are needed for one "
                             f"optimizer step{held_out}")
        if o.eval_every is not None and (o.eval_every <= 0 or idata_split == dataset.ndata):
            raise InputError(f"eval_every must be a positive number of optimizer steps, with validation data "
                             f"(got {o.eval_every}, {dataset.ndata - idata_split} validation windows)")
        check_watch(o.watch, dataset.ndata - idata_split)
        if self.comm.rank == 0:
            self.watch = FitWatch(trainer, o.watch, self.say)
        self.dataset, self.idata_split = dataset, idata_split
        trainer.set_split(dataset, idata_split)
        run = trainer.run
        run.rng, run.shuffle_seed = (np.random.default_rng(o.seed) if o.seed is not None else None), o.seed
        if o.resume is not None:
            for note in load_checkpoint_into(trainer, o.resume, o.force_resume):
                self.say(f"resume: {note}")
        if run.pending is not None:
            self.start, self.start_result = resume_position(trainer, o.force_resume)
            self.resumed = True
            if self.start.epoch >= self.epochs:
                raise InputError(f"{o.resume}: the checkpoint's run finished its {self.start.epoch} epoch(s): nothing "
                                 f"is left to train for {self.epochs} (more epochs train further)")
            self.say(f"resume: epoch {self.start.epoch + 1}, window {self.start.ibatch} of the epoch, after "
                     f"{trainer.n_steps} optimizer steps")

    @contextmanager
    def watching(self, redo_epoch_end: bool):
        """Rank 0's FitWatch around the loop (FitWatch.running); nothing elsewhere."""
        if self.watch is None:
            yield
            return
        with self.watch.running(redo_epoch_end):
            yield

    # -- the loop's hooks ------------------------------------------------------------------------
    def on_epoch_start(self, loop: TrainingLoop, epoch: int) -> None:
        self.epoch = epoch

    def on_progress(self, train: bool, opt_ctx: OptContext, dataset: Dataset, result: Result | None, ibatch: int,
                    ibatch_max: int, t_start: float) -> None:
        if self.bar is not None:
            self.bar(train, opt_ctx, dataset, result, ibatch, ibatch_max, t_start)

    def on_step_start(self, loop: TrainingLoop, train: Result) -> None:
        if self.watch:
            self._mark = self.watch.before_step(train)

    def on_step(self, loop: TrainingLoop, train: Result) -> None:
        """Between two optimizer steps: record the position (a checkpoint's) and the step,
        validate every eval_every steps and checkpoint every save_every steps (the epoch's
        last step leaves both to the epoch's end)."""
        run, n_steps, o, position = self.trainer.run, self.trainer.n_steps, self.options, loop.position
        run.position, run.epoch_result = position, train
        if self.watch:
            self.watch.stepped(self._mark, train, fractional_epoch(position, run.n_train_batches))
        last_step = position.ibatch == run.n_train_batches
        if o.eval_every and n_steps % o.eval_every == 0 and not last_step:
            loop.validate()
        self._checkpoint(due=bool(o.save_every) and n_steps % o.save_every == 0 and not last_step)

    def on_eval(self, loop: TrainingLoop, result: Result, end_of_epoch: bool) -> None:
        """An epoch's validation goes to the records; one between steps also gets its line."""
        if end_of_epoch:
            if self.watch:
                validated = self.watch.validated(result, float(loop.epoch + 1), end_of_epoch=True)
                self.watch.epoch_ended(validated is not None)
            return
        self.say(f"step {self.trainer.n_steps}: val {loss_and_accuracy(result)}")
        if self.watch:
            run = self.trainer.run
            self.watch.validated(result, fractional_epoch(run.position, run.n_train_batches), end_of_epoch=False)

    def on_epoch_end(self, loop: TrainingLoop, epoch: EpochResult) -> None:
        """Every rank holds the same weights, the caller's on_epoch, the epoch's checkpoint."""
        check_same_weights(self.comm, self.trainer.trained.values(), f"after epoch {epoch.epoch + 1}")
        if self.options.on_epoch is not None:
            self.options.on_epoch(epoch)
        self.trainer.run.position, self.trainer.run.epoch_result = FitPosition(epoch.epoch + 1, 0, False), Result()
        self._checkpoint(due=True)

    def _checkpoint(self, due: bool) -> None:
        """Write the checkpoint (rank 0) when `due` or when any rank was asked to stop;
        then stop every rank after the same step."""
        path = self.options.checkpoint
        if path is None:
            return
        stopping = any_rank(self.comm, self.stop.requested)
        if (due or stopping) and self.comm.rank == 0:
            self.watch.sync()  # the records up to this checkpoint are on disk before it is
            t0 = time.perf_counter()
            save_checkpoint_of(self.trainer, path)
            self.say(f"checkpoint: {path} after {self.trainer.n_steps} steps ({time.perf_counter() - t0:.2f} s)")
        if stopping:
            raise TrainingInterrupted(f"interrupted after {self.trainer.n_steps} optimizer steps; resume from the "
                                      f"checkpoint with --checkpoint-in {path} (Python: opt_fit(resume=...))")

    # -- output ----------------------------------------------------------------------------------
    def say(self, line: str) -> None:
        """A whole line (rank 0, unless silent); on a terminal it first clears the progress bar drawn there."""
        if not self.silent:
            self.stream.write(("\r\033[K" if self.tty else "") + line + "\n")
            self.stream.flush()

    def _progress_prefix(self, train: bool) -> str:
        text = f"epoch {self.epoch + 1}: "
        return text if train else " " * len(text)

    # -- the ranks' agreement --------------------------------------------------------------------
    def _settings(self) -> dict[str, Setting]:
        """What every rank of a data-parallel fit must share, in the order a difference is
        reported: the model, the data and its split, the training parameters, the fit's
        arguments that decide its steps and collectives, and where a resumed run starts."""
        trainer, o, start = self.trainer, self.options, self.start
        run = trainer.run
        settings = {
            "model": Setting("model", model_fingerprint(trainer.model, set(trainer.trained)), hidden=True),
            "data": Setting("training data", run.data_fingerprint(), hidden=True),
        }
        for key, value in _flat(trainer.describe_params(run.shuffle_seed).summary()):
            settings[f"params.{key}"] = Setting(f"training parameter {key}", value,
                                                text=json.dumps(value, sort_keys=True), hidden=key == "trained")
        settings.update({
            "epochs": Setting("epochs", self.epochs),
            "checkpoint": Setting("checkpoint", o.checkpoint is not None,
                                  text="a file" if o.checkpoint is not None else "none"),
            "save_every": Setting("save_every", o.save_every),
            "eval_every": Setting("eval_every", o.eval_every),
            "start": Setting("resumed position (epoch, window, optimizer steps)",
                             [start.epoch + 1, start.ibatch, trainer.n_steps],
                             text=f"epoch {start.epoch + 1}, window {start.ibatch}, {trainer.n_steps} steps"),
            "weights": Setting("trained weights", weights_digest(trainer.trained.values()), hidden=True),
        })
        return settings


def _flat(record: dict, prefix: str = ""):
    """(dotted key, value) of a nested dict's leaves: `schedule.lr0`, not the whole schedule."""
    for key, value in record.items():
        if isinstance(value, dict) and value:
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


class _StopRequest:
    """A first Ctrl-C during a checkpointed fit: stop after the current optimizer step."""

    def __init__(self) -> None:
        self.requested = False

    @contextmanager
    def armed(self, enabled: bool, say: Callable[[str], None]):
        if not enabled or threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            if self.requested:
                raise KeyboardInterrupt
            self.requested = True
            say("stopping after this optimizer step to write the checkpoint (Ctrl-C again to stop at once)")
        previous = signal.signal(signal.SIGINT, handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)
