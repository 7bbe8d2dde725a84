"""The one training loop (ggml_opt_epoch's steps, as a loop over epochs) and its hooks.

`TrainingLoop.run` reads top to bottom: for each epoch, shuffle the training part, take
its optimizer steps (`train_step`: every rank's share of the step's batches through the
context's BatchFeeder, forward and backward, then `OptContext.step`, which sums the
gradients over the ranks and applies the optimizer), then validate. Everything a caller
adds -- progress lines, metrics, checkpoints, stop requests, schedules' epoch counters --
happens in one `Hooks` object the loop calls at fixed points (plain method calls, nothing
per step beyond them). `opt_epoch` and `opt_fit` (fit.py) and llamapy's `Context.opt_fit`
all drive this loop; a run resumed from a checkpoint starts it at a `FitPosition`.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .context import BuildType, OptContext
from .dataset import Dataset
from .result import Result

EpochCallback = Callable[[bool, OptContext, Dataset, Result, int, int, float], None]


@dataclass
class EpochResult:
    epoch: int
    train: Result
    val: Result
    evals: list[tuple[int, Result]] = field(default_factory=list)  # validations within the epoch: (step, result)


@dataclass(frozen=True)
class FitPosition:
    """Where a fit loop stands between optimizer steps: the epoch, its next training batch,
    and whether that epoch's shuffle is done (a checkpoint's position)."""

    epoch: int = 0
    ibatch: int = 0
    shuffled: bool = False


class Hooks:
    """What a TrainingLoop tells its driver, each a no-op here: override those you need.

    `on_progress` has an EpochCallback's arguments (ggml's), after each evaluation of a
    pass that reports progress; `on_step_start` / `on_step` surround every optimizer step
    (`loop.position` is after it); `on_eval` follows every validation (`end_of_epoch`:
    the epoch's, else one `loop.validate()` made between steps)."""

    def on_epoch_start(self, loop: TrainingLoop, epoch: int) -> None:
        pass

    def on_progress(self, train: bool, opt_ctx: OptContext, dataset: Dataset, result: Result | None, ibatch: int,
                    ibatch_max: int, t_start: float) -> None:
        pass

    def on_step_start(self, loop: TrainingLoop, train: Result | None) -> None:
        pass

    def on_step(self, loop: TrainingLoop, train: Result | None) -> None:
        pass

    def on_eval(self, loop: TrainingLoop, result: Result | None, end_of_epoch: bool) -> None:
        pass

    def on_epoch_end(self, loop: TrainingLoop, epoch: EpochResult) -> None:
        pass


class TrainingLoop:
    """Epochs of optimizer steps over `dataset`'s datapoints [0, idata_split) (all when
    negative), each followed by a validation on the rest, for `opt_ctx`.

    `shuffle`: the generator that permutes the training shards at every epoch's start
    (None: no shuffling). `start` and `start_result`: where a resumed run stands (its
    epoch's shuffle done or not, its next batch, that epoch's training result so far).
    Datapoints of an incomplete last optimizer step are neither trained on nor evaluated."""

    def __init__(self, opt_ctx: OptContext, dataset: Dataset, idata_split: int = -1, hooks: Hooks | None = None, *,
                 epochs: int = 1, shuffle: np.random.Generator | None = None, start: FitPosition = FitPosition(),
                 start_result: Result | None = None) -> None:
        self.opt_ctx, self.dataset, self.hooks = opt_ctx, dataset, hooks or Hooks()
        self.n_train, self.per_step, self.n_batches, self.first_val = train_batches(opt_ctx, dataset, idata_split)
        self.idata_split = dataset.ndata if idata_split < 0 else idata_split
        self.epochs, self.shuffle, self.start, self.start_result = epochs, shuffle, start, start_result
        self.epoch = start.epoch
        self.position = start                           # after the last optimizer step
        self.evals: list[tuple[int, Result]] = []       # this epoch's validations between steps

    @property
    def n_steps(self) -> int:
        """Optimizer steps taken by the context (a resumed one's included)."""
        return self.opt_ctx.optimizer.state.n_steps

    def run(self) -> list[EpochResult]:
        """Every epoch from the start position on; one EpochResult each."""
        history = []
        for epoch in range(self.start.epoch, self.epochs):
            resumed = epoch == self.start.epoch
            if self.shuffle is not None and not (resumed and self.start.shuffled):
                self.dataset.shuffle(self.shuffle, self.idata_split)
            train = self.start_result if resumed and self.start_result is not None else Result()
            history.append(self.run_epoch(epoch, train, Result(), self.start.ibatch if resumed else 0))
        return history

    def run_epoch(self, epoch: int, train: Result | None, val: Result | None, start_batch: int = 0) -> EpochResult:
        """One epoch (ggml_opt_epoch): the optimizer steps from training batch `start_batch`
        on, recorded in `train`, then the validation, in `val` (either may be None)."""
        opt_ctx, dataset, hooks = self.opt_ctx, self.dataset, self.hooks
        self.epoch, self.evals = epoch, []
        hooks.on_epoch_start(self, epoch)
        evals = opt_ctx.feeder.evals_per_batch
        progress = PassProgress(hooks.on_progress, True, opt_ctx, dataset, train, self.n_train * evals,
                                opt_ctx.comm.size, done=start_batch * evals)
        for first in range(start_batch, self.n_train, self.per_step):
            hooks.on_step_start(self, train)
            train_step(opt_ctx, dataset, first, train, progress)
            self.position = FitPosition(epoch, first + self.per_step, True)
            hooks.on_step(self, train)
        progress.finish()
        evaluate_batches(opt_ctx, dataset, range(self.first_val, self.n_batches), val, hooks.on_progress)
        hooks.on_eval(self, val, True)
        result = EpochResult(epoch, train, val, self.evals)
        hooks.on_epoch_end(self, result)
        return result

    def validate(self) -> Result:
        """A validation pass between optimizer steps, without progress lines (EpochResult.evals)."""
        result = Result()
        evaluate_batches(self.opt_ctx, self.dataset, range(self.first_val, self.n_batches), result)
        self.evals.append((self.n_steps, result))
        self.hooks.on_eval(self, result, False)
        return result


class PassProgress:
    """The progress of one pass (an epoch's training or validation): calls an epoch callback
    after each evaluation with ggml's (ibatch, ibatch_max, t_start), counting the evaluations
    of every rank (each of this rank's stands for `stride`) from `done` (a resumed epoch's
    evaluations so far); the last call waits for `finish`, when the pass's result is
    complete on every rank."""

    def __init__(self, callback: EpochCallback | None, train: bool, opt_ctx: OptContext, dataset: Dataset,
                 result: Result | None, total: int, stride: int = 1, done: int = 0) -> None:
        self.callback, self.train, self.opt_ctx, self.dataset, self.result = callback, train, opt_ctx, dataset, result
        self.total, self.count, self.stride, self.t_start = total, done, stride, time.perf_counter()

    def __call__(self) -> None:
        self.count = min(self.count + self.stride, self.total)
        if self.callback and self.count < self.total:
            self.callback(self.train, self.opt_ctx, self.dataset, self.result, self.count, self.total, self.t_start)

    def finish(self) -> None:
        if self.callback and self.total > 0:
            self.callback(self.train, self.opt_ctx, self.dataset, self.result, self.total, self.total, self.t_start)


def train_step(opt_ctx: OptContext, dataset: Dataset, first: int, result: Result | None,
               tick: Callable[[], None]) -> None:
    """One optimizer step over the `batches_per_step` batches from `first`: zero the
    gradients, evaluate this rank's batches forward and backward (their gradients add up
    in the accumulators; `tick` after each evaluation), then step (OptContext.step, which
    sums the gradients over the ranks first). A step covers the next `opt_period` batches
    of every rank, rank r taking the r-th share. A context built for gradients only
    (BuildType.GRAD) accumulates them and takes no step."""
    feeder, comm = opt_ctx.feeder, opt_ctx.comm
    per_step = batches_per_step(opt_ctx)
    share = per_step // comm.size  # this rank's batches of the step
    stepping = opt_ctx.params.build_type == BuildType.OPT
    opt_ctx.zero_grad()
    feeder.begin_step(dataset, range(first, first + per_step))
    shard = Result() if comm.size > 1 and stepping else result  # this rank's part, gathered by the step
    for ibatch in range(first + comm.rank * share, first + (comm.rank + 1) * share):
        feeder.run_batch(dataset, ibatch, True, shard, tick)
    if stepping:
        opt_ctx.step(result, shard if comm.size > 1 else None)


def evaluate_batches(opt_ctx: OptContext, dataset: Dataset, batches: range, result: Result | None,
                     callback: EpochCallback | None = None) -> None:
    """Evaluate `batches` of `dataset` (no gradients, no step) into `result`: the validation
    part of an epoch, a mid-epoch validation or a test set. With several ranks the batches
    are dealt round-robin and every rank ends with all the results, in batch order."""
    feeder, comm = opt_ctx.feeder, opt_ctx.comm
    progress = PassProgress(callback, False, opt_ctx, dataset, result, len(batches) * feeder.evals_per_batch,
                            comm.size)
    mine = batches[comm.rank::comm.size]
    if comm.size == 1:
        for ibatch in mine:
            feeder.run_batch(dataset, ibatch, False, result, progress)
    else:
        shards = {}
        for ibatch in mine:
            shards[ibatch] = Result()
            feeder.run_batch(dataset, ibatch, False, shards[ibatch], progress)
        if result is not None:
            for ibatch, shard in sorted(kv for part in comm.allgather(shards) for kv in part.items()):
                result.extend(shard)
    progress.finish()


def batches_per_step(opt_ctx: OptContext) -> int:
    """The physical batches one optimizer step covers, on all ranks together."""
    return max(1, opt_ctx.opt_period // opt_ctx.feeder.evals_per_batch) * opt_ctx.comm.size


def train_batches(opt_ctx: OptContext, dataset: Dataset, idata_split: int) -> tuple[int, int, int, int]:
    """How an epoch splits `dataset` for `opt_ctx`'s feeder: (training batches, batches per
    optimizer step on all ranks together, batches in all, the first validation batch)."""
    batch = opt_ctx.feeder.datapoints_per_batch
    ndata = dataset.ndata
    if ndata % batch:
        raise ValueError(f"opt: {ndata} datapoints do not divide into batches of {batch}")
    idata_split = ndata if idata_split < 0 else idata_split
    if idata_split % batch:
        raise ValueError(f"opt: the split at {idata_split} is not a multiple of the batch size {batch}")
    nbatches, ibatch_split = ndata // batch, idata_split // batch
    per_step = batches_per_step(opt_ctx)
    n_train = ibatch_split - ibatch_split % per_step if opt_ctx.optimizer is not None else 0
    return n_train, per_step, nbatches, ibatch_split
