"""What a training run reports while it runs: after every optimizer step a `StepRecord`, after
every validation an `EvalRecord` (with task scores when a scorer is given), each written to
the metrics file and passed to the caller's hooks; at every validation the loss plot redrawn
and the best model so far kept. fit.py's loop calls `FitWatch` at those points; only rank 0
of a data-parallel run watches (the records are the same on every rank).

`--save-best` keeps the model, or the adapter when a LoRA trains (what `-o` gets, ready to
use), with the lowest validation loss so far; the file records that loss and its step in its
metadata (`training.best.val_loss`, `training.best.step`), which a resumed run (or a further
opt_fit of the same trainer) reads back as the loss to beat.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ggmlpy.opt import FitPosition, Result

from .errors import InputError, LlamapyError
from .gguf_file import GGUFFile, MetaValue, ValueType
from .loss_plot import draw_loss_curves, require_matplotlib
from .metrics import EvalRecord, MetricsFile, Record, StepRecord

BEST_LOSS_KEY = "training.best.val_loss"
BEST_STEP_KEY = "training.best.step"

# a Context -> its scores (name -> value), e.g. a multiple-choice task's accuracy (task_scores.TaskScores)
TaskScorer = Callable[[Any], dict[str, float]]


@dataclass(kw_only=True)
class WatchOptions:
    """Context.opt_fit's reporting options (their meanings are there)."""

    metrics: str | Path | None = None
    plot: str | Path | None = None
    save_best: str | Path | None = None
    eval_tasks: TaskScorer | str | Path | None = None  # a scorer, or a task file (or TaskSet) to score
    on_step: Callable[[StepRecord], None] | None = None
    on_eval: Callable[[EvalRecord], None] | None = None

    @property
    def needs_validation(self) -> str | None:
        """The option that is pointless without validation data (None: none is)."""
        return "save_best" if self.save_best is not None else "eval_tasks" if self.eval_tasks is not None else None

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.metrics, self.plot, self.save_best, self.eval_tasks, self.on_step,
                                           self.on_eval))


@dataclass(frozen=True)
class StepMark:
    """The training result's counts and the clock just before an optimizer step."""

    ndata: int
    ncorrect: int
    t: float


class FitWatch:
    """The records of one fit of `trainer` (module docstring); `say` prints a line."""

    def __init__(self, trainer, options: WatchOptions, say: Callable[[str], None]) -> None:
        self.trainer, self.options, self.say = trainer, options, say
        self.steps: list[StepRecord] = []
        self.evals: list[EvalRecord] = []
        self.file: MetricsFile | None = None
        self.best = math.inf
        self._elapsed0 = 0.0
        self._t0 = time.perf_counter()
        if options.plot is not None:
            require_matplotlib()
        self.score_tasks: TaskScorer | None = options.eval_tasks
        if self.score_tasks is not None and not callable(self.score_tasks):
            from .task_scores import TaskScores
            self.score_tasks = TaskScores(trainer.model, self.score_tasks, n_threads=trainer.lctx.backend.n_threads)
        # the records' gradient norm (one pass over the gradients per step) when anything watches
        trainer.opt.track_grad_norm = options.any

    @contextmanager
    def running(self, redo_epoch_end: bool) -> Iterator[None]:
        """Around the fit's loop: open the metrics file (a run that starts after step n, resumed
        from a checkpoint or continuing an earlier opt_fit of this trainer, keeps the records
        up to step n, less the epoch-end validation when `redo_epoch_end`), take the loss to
        beat from the best file of such a run; close the file however the loop ends."""
        n = self.trainer.n_steps
        if self.options.metrics is not None:
            def keep(r: Record) -> bool:
                redone = isinstance(r, EvalRecord) and r.end_of_epoch and redo_epoch_end
                return r.step < n or r.step == n and not redone
            self.file = MetricsFile.create(self.options.metrics, keep if n > 0 else None)
            for r in self.file.kept:
                (self.steps if isinstance(r, StepRecord) else self.evals).append(r)
            if self.file.kept:
                self._elapsed0 = self.file.kept[-1].elapsed
        if n > 0 and self.options.save_best is not None:
            self.best = best_loss_of(self.options.save_best)
        self._t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.file is not None:
                self.file.close()

    def elapsed(self) -> float:
        return self._elapsed0 + time.perf_counter() - self._t0

    # -- optimizer steps -----------------------------------------------------------------------
    def before_step(self, train: Result) -> StepMark:
        return StepMark(train.ndata, train.ncorrect, time.perf_counter())

    def stepped(self, mark: StepMark, train: Result, epoch: float) -> StepRecord:
        """The record of the step just taken (`train`: the epoch's result, which now includes it)."""
        t, trainer, opt = time.perf_counter(), self.trainer, self.trainer.opt
        tokens = trainer.n_batch * trainer.comm.size
        ndata = train.ndata - mark.ndata
        has_accuracy = ndata > 0 and mark.ncorrect >= 0 and train.ncorrect >= 0  # -1: a loss without one
        accuracy = (train.ncorrect - mark.ncorrect) / ndata if has_accuracy else None
        pars = opt.last_step_params
        record = StepRecord(step=trainer.n_steps, epoch=round(epoch, 6), tokens=trainer.n_steps * tokens,
                            loss=train.steps[-1] if train.steps else math.nan, accuracy=accuracy,
                            lr=float(pars.alpha) if pars is not None else math.nan, grad_norm=opt.last_grad_norm,
                            tokens_per_s=tokens / (t - mark.t) if t > mark.t else math.nan, elapsed=self.elapsed())
        self.steps.append(record)
        if self.file is not None:
            self.file.write(record)
        if self.options.on_step is not None:
            self.options.on_step(record)
        return record

    # -- validations ---------------------------------------------------------------------------
    def validated(self, result: Result, epoch: float, end_of_epoch: bool) -> EvalRecord | None:
        """The record of a validation pass (None when there was no validation data): task
        scores added, written, the best model kept, the plot redrawn, then the hook."""
        if not result.losses:
            return None
        loss, loss_unc = result.loss()
        acc, acc_unc = result.accuracy()
        tasks = self.score_tasks(self.trainer.lctx) if self.score_tasks is not None else {}
        record = EvalRecord(step=self.trainer.n_steps, epoch=round(epoch, 6), val_loss=loss, val_loss_unc=loss_unc,
                            val_accuracy=None if math.isnan(acc) else acc,
                            val_accuracy_unc=None if math.isnan(acc_unc) else acc_unc, end_of_epoch=end_of_epoch,
                            elapsed=self.elapsed(), tasks=dict(tasks))
        self.evals.append(record)
        if self.file is not None:
            self.file.write(record)
        if self.options.save_best is not None and loss < self.best:
            self._save_best(record)
        self.redraw()
        if self.options.on_eval is not None:
            self.options.on_eval(record)
        return record

    def epoch_ended(self, validated: bool) -> None:
        """An epoch's end without a validation still redraws the plot (its training steps)."""
        if not validated:
            self.redraw()

    def redraw(self) -> None:
        if self.options.plot is not None:
            draw_loss_curves(self.steps, self.evals, self.options.plot)

    def sync(self) -> None:
        """Before a checkpoint: every record so far on disk."""
        if self.file is not None:
            self.file.sync()

    def _save_best(self, record: EvalRecord) -> None:
        path, trainer = Path(self.options.save_best), self.trainer
        metadata = {BEST_LOSS_KEY: MetaValue(ValueType.FLOAT64, None, float(record.val_loss)),
                    BEST_STEP_KEY: MetaValue(ValueType.UINT64, None, int(record.step))}
        if trainer.adapter is not None:
            trainer.adapter.save(path, metadata)
        else:
            from .save import save_model_to_file
            save_model_to_file(trainer.model, path, metadata)
        self.best = record.val_loss
        self.say(f"best: val loss {record.val_loss:.5f} after step {record.step}: saved "
                 f"{'the adapter' if trainer.adapter is not None else 'the model'} to {path}")


def best_loss_of(path: str | Path) -> float:
    """The validation loss a best file records (inf when there is no such file or key)."""
    try:
        value = GGUFFile(path).get(BEST_LOSS_KEY)
    except (LlamapyError, OSError):
        return math.inf
    return float(value) if isinstance(value, (int, float)) else math.inf


def fractional_epoch(position: FitPosition, n_train_batches: int) -> float:
    """Epochs done at `position` (1.5: half-way through the second), as Hugging Face counts them."""
    return position.epoch + (position.ibatch / n_train_batches if n_train_batches else 0.0)


def check_watch(options: WatchOptions, n_validation: int) -> None:
    """Refuse options that need validation windows when there are none."""
    name = options.needs_validation
    if name is not None and n_validation == 0:
        raise InputError(f"{name} needs validation data: the run has no validation windows (a val_split, or "
                         "validation data of its own)")
