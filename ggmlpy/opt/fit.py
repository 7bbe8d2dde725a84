"""ggml-opt's entry points over the one TrainingLoop: `opt_epoch` (ggml_opt_epoch) and
`opt_fit` (ggml_opt_fit: a static model graph trained for some epochs with a validation
split, its progress printed). Each is the loop with hooks that call ggml's callbacks."""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TextIO

from ..context import Context
from ..tensor import Tensor
from .context import BuildType, LossType, OptContext, OptParams
from .dataset import Dataset
from .loop import EpochCallback, EpochResult, Hooks, TrainingLoop
from .optimizer import SGD, AdamW
from .progress import ProgressBar, hms
from .result import Result


@dataclass
class FitState:
    """The position in an opt_fit, passed to its `get_opt_pars` so a schedule can use it
    (ggml_opt_fit's get_opt_pars_ud)."""

    epoch: int = 0   # 0-based
    nepoch: int = 1


class CallbackHooks(Hooks):
    """ggml's two epoch callbacks as the loop's progress hook: one for the training pass,
    one for the validation pass (None: no progress)."""

    def __init__(self, callback_train: EpochCallback | None = None, callback_eval: EpochCallback | None = None) -> None:
        self.callback_train, self.callback_eval = callback_train, callback_eval

    def on_progress(self, train: bool, opt_ctx: OptContext, dataset: Dataset, result: Result | None, ibatch: int,
                    ibatch_max: int, t_start: float) -> None:
        callback = self.callback_train if train else self.callback_eval
        if callback is not None:
            callback(train, opt_ctx, dataset, result, ibatch, ibatch_max, t_start)


def opt_epoch(opt_ctx: OptContext, dataset: Dataset, result_train: Result | None, result_eval: Result | None,
              idata_split: int, callback_train: EpochCallback | None = None,
              callback_eval: EpochCallback | None = None) -> None:
    """Train on datapoints [0, idata_split), then evaluate on the rest (ggml_opt_epoch): one
    epoch of the TrainingLoop. With several ranks every rank ends with the same results."""
    hooks = CallbackHooks(callback_train, callback_eval)
    TrainingLoop(opt_ctx, dataset, idata_split, hooks).run_epoch(0, result_train, result_eval)


class _FitHooks(CallbackHooks):
    """opt_fit's lines around each epoch, and the epoch its schedule reads."""

    def __init__(self, state: FitState, stream: TextIO | None, callback_train: EpochCallback | None,
                 callback_eval: EpochCallback | None) -> None:
        super().__init__(callback_train, callback_eval)
        self.state, self.stream = state, stream  # stream None: silent

    def on_epoch_start(self, loop: TrainingLoop, epoch: int) -> None:
        self.state.epoch = epoch
        if self.stream is not None:
            self.stream.write(f"opt_fit: epoch {epoch + 1:04d}/{self.state.nepoch:04d}:\n")

    def on_epoch_end(self, loop: TrainingLoop, epoch: EpochResult) -> None:
        if self.stream is not None:
            self.stream.write("\n")


def opt_fit(ctx_compute: Context, inputs: Tensor, outputs: Tensor, dataset: Dataset,
            loss_type: LossType = LossType.MEAN, optimizer: AdamW | SGD | None = None,
            get_opt_pars: Callable[[FitState], AdamW | SGD] | None = None, nepoch: int = 1,
            nbatch_logical: int | None = None, val_split: float = 0.0, silent: bool = False, seed: int = 0,
            n_threads: int | None = None, callback_train: EpochCallback | None = None,
            callback_eval: EpochCallback | None = None, stream: TextIO | None = None,
            progress_interval: float | None = None) -> list[EpochResult]:
    """Train for `nepoch` epochs with a validation split (ggml_opt_fit); returns per-epoch results.

    `nbatch_logical` datapoints make one optimizer step; the batch dimension of `inputs`
    is the physical batch, and gradients accumulate over the difference. The data is
    shuffled once (train and validation) and the training part again every epoch.
    `get_opt_pars(FitState)` may change the hyper-parameters per step (a schedule).
    Progress goes to `stream` (stderr) unless `silent`: see ProgressBar (`progress_interval`:
    seconds between lines when the stream is not a terminal).
    """
    stream = stream or sys.stderr
    t0 = time.perf_counter()
    ndata, nbatch_physical = dataset.ndata, inputs.ne[1]
    nbatch_logical = nbatch_logical or nbatch_physical
    if ndata % nbatch_logical or nbatch_logical % nbatch_physical:
        raise ValueError(f"opt_fit: {ndata} datapoints, logical batch {nbatch_logical} and physical batch "
                         f"{nbatch_physical} must divide evenly")
    if not 0.0 <= val_split < 1.0:
        raise ValueError(f"opt_fit: val_split must be in [0, 1), got {val_split}")
    opt_period = nbatch_logical // nbatch_physical
    idata_split = int((1.0 - val_split) * (ndata // nbatch_logical)) * nbatch_logical

    state = FitState(0, nepoch)
    opt_ctx = OptContext(OptParams(ctx_compute, inputs, outputs, loss_type, optimizer, BuildType.OPT, opt_period,
                                   get_opt_pars=partial(get_opt_pars, state) if get_opt_pars else None,
                                   n_threads=n_threads, seed=seed))
    if nbatch_logical < ndata:
        dataset.shuffle(opt_ctx.rng, -1)
    bar = None if silent else ProgressBar(stream, interval=progress_interval)
    hooks = _FitHooks(state, None if silent else stream, callback_train or bar, callback_eval or bar)
    history = TrainingLoop(opt_ctx, dataset, idata_split, hooks, epochs=nepoch,
                           shuffle=opt_ctx.rng if nbatch_logical < idata_split else None).run()
    if not silent:
        stream.write(f"opt_fit: training took {hms(time.perf_counter() - t0)}\n")
    return history
