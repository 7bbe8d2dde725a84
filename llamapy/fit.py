"""Context.opt_fit: ggmlpy's fit loop with a language model's progress lines, checkpoints,
resume and a Ctrl-C that stops cleanly.

The loop itself is ggmlpy's `fit_epochs`; it reports the position after every optimizer
step and at every epoch's end, and this module decides when that position is written
as a checkpoint (every `save_every` steps, each epoch's end, a requested stop). A first
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
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ggmlpy.opt import (
    EpochResult,
    FitPosition,
    ProgressBar,
    Result,
    evaluate_batches,
    fit_epochs,
    loss_and_accuracy,
    train_batches,
)

from .checkpoint import (
    Checkpoint,
    compare_params,
    load_checkpoint,
    model_fingerprint,
    save_checkpoint,
)
from .dataset import join_windows
from .distributed import (RanksFailed, Setting, abort_job, any_rank, check_ranks_agree, check_same_weights,
                          describe_error, weights_digest)
from .errors import InputError, TrainingInterrupted


def fit(lctx, dataset, **kwargs) -> list[EpochResult]:
    """See Context.opt_fit."""
    comm = lctx.trainer.comm
    if comm.size == 1:
        return _fit(lctx, dataset, **kwargs)
    try:
        return _fit(lctx, dataset, **kwargs)
    except BaseException as e:  # noqa: BLE001 - any failure of one rank must end all of them
        if not getattr(e, "on_every_rank", False):  # a shared stop or check ends every rank by itself
            abort_job(comm, describe_error(e))
        raise


def _fit(lctx, dataset, *, epochs: int | None, val_split: float, silent: bool, stream, on_epoch, seed: int | None,
         checkpoint, save_every: int | None, resume, force_resume: bool, val_data=None,
         eval_every: int | None = None, progress_interval: float | None = None) -> list[EpochResult]:
    from .context import validation_windows
    trainer = lctx.trainer
    comm = trainer.comm
    silent = silent or comm.rank != 0
    epochs = epochs or trainer.params.schedule.epochs
    error = None  # a rank's failure while setting up: said at the check below, where every rank stops
    try:
        if not 0.0 <= val_split < 1.0:
            raise InputError(f"val_split must be in [0, 1), got {val_split}")
        if save_every is not None and (save_every <= 0 or checkpoint is None):
            raise InputError(f"save_every must be a positive number of optimizer steps, with a checkpoint file "
                             f"(got {save_every}, checkpoint {checkpoint})")
        n_windows = dataset.ndata
        if val_data is not None:  # validation windows given apart: they follow the training windows
            dataset, idata_split = join_windows(dataset, val_data)
            held_out = ""
        else:
            idata_split = dataset.ndata - validation_windows(dataset.ndata, val_split)
            held_out = f" after holding out {val_split:.0%} for validation"
        if idata_split < trainer.windows_per_step:
            raise InputError(f"the text gives {n_windows} windows; {trainer.windows_per_step} are needed for one "
                             f"optimizer step{held_out}")
        if eval_every is not None and (eval_every <= 0 or idata_split == dataset.ndata):
            raise InputError(f"eval_every must be a positive number of optimizer steps, with validation data "
                             f"(got {eval_every}, {dataset.ndata - idata_split} validation windows)")
        trainer.set_split(dataset, idata_split)
        run = trainer.run
        run.rng, run.shuffle_seed = (np.random.default_rng(seed) if seed is not None else None), seed
        stream = stream or sys.stderr
        tty = hasattr(stream, "isatty") and stream.isatty()
        say = (lambda line: None) if silent else (lambda line: _write_line(stream, line, tty))
        if resume is not None:
            for note in load_checkpoint_into(trainer, resume, force_resume):
                say(f"resume: {note}")
        start, start_result = FitPosition(), None
        if run.pending is not None:
            start, start_result = _apply_resume(trainer, run.pending, force_resume)
            run.pending = None
            say(f"resume: epoch {start.epoch + 1}, window {start.ibatch} of the epoch, after {trainer.n_steps} "
                f"optimizer steps")
    except Exception as e:
        if comm.size == 1:
            raise
        error = e
    if comm.size > 1:
        try:
            check_ranks_agree(comm, _run_settings(trainer, epochs, start, checkpoint, save_every, eval_every)
                              if error is None else {}, error=(describe_error(error), 1) if error else None)
        except RanksFailed as shared:
            raise shared from error

    def prefix(is_train: bool) -> str:
        text = f"epoch {trainer.epoch + 1}: "
        return text if is_train else " " * len(text)
    # a ubatch evaluation is the progress counter's unit: n_ubatch tokens
    bar = None if silent else ProgressBar(stream, interval=progress_interval, prefix=prefix, unit="tokens",
                                          per_datapoint=trainer.n_ubatch, tty=tty)

    def start_epoch(epoch: int) -> None:
        trainer.epoch = epoch

    evals: list[tuple[int, Result]] = []  # this epoch's validations every eval_every steps

    def end_epoch(result: EpochResult) -> None:
        check_same_weights(comm, trainer.trained.values(), f"after epoch {result.epoch + 1}")
        result.evals[:] = evals
        evals.clear()
        if on_epoch is not None:
            on_epoch(result)

    stop = _StopRequest()

    def evaluate_now(position: FitPosition) -> None:
        """A validation pass between optimizer steps (the epoch's last step has its own)."""
        if position.ibatch == run.n_train_batches:
            return
        result = Result()
        evaluate_batches(trainer.opt, dataset, range(idata_split, dataset.ndata), result)
        evals.append((trainer.n_steps, result))
        say(f"step {trainer.n_steps}: val {loss_and_accuracy(result)}")

    def on_position(position: FitPosition, train: Result) -> None:
        run.position, run.epoch_result = position, train
        if eval_every and position.shuffled and trainer.n_steps % eval_every == 0:
            evaluate_now(position)
        if checkpoint is None:
            return
        stopping = any_rank(comm, stop.requested)
        epoch_end = not position.shuffled and position.ibatch == 0
        due = save_every and trainer.n_steps % save_every == 0 and position.ibatch != run.n_train_batches
        if (epoch_end or due or stopping) and comm.rank == 0:
            t0 = time.perf_counter()
            save_checkpoint_of(trainer, checkpoint)
            say(f"checkpoint: {checkpoint} after {trainer.n_steps} steps ({time.perf_counter() - t0:.2f} s)")
        if stopping:
            raise TrainingInterrupted(f"interrupted after {trainer.n_steps} optimizer steps; resume from the "
                                      f"checkpoint with --checkpoint-in {checkpoint} (Python: opt_fit(resume=...))")

    with stop.armed(checkpoint is not None, say):
        return fit_epochs(trainer.opt, dataset, epochs, idata_split, shuffle=run.rng, callback_train=bar,
                          callback_eval=bar, before_epoch=start_epoch, on_epoch=end_epoch, start=start,
                          start_result=start_result, on_position=on_position)


def _run_settings(trainer, epochs: int, start: FitPosition, checkpoint, save_every: int | None,
                  eval_every: int | None) -> dict[str, Setting]:
    """What every rank of a data-parallel fit must share, in the order a difference is
    reported: the model, the data and its split, the training parameters, the fit's
    arguments that decide its steps and collectives, and where a resumed run starts."""
    run = trainer.run
    settings = {
        "model": Setting("model", model_fingerprint(trainer.model, set(trainer.trained)), hidden=True),
        "data": Setting("training data", run.data_fingerprint(),
                        hidden=True),
    }
    for key, value in _flat(trainer.describe_params(run.shuffle_seed).summary()):
        settings[f"params.{key}"] = Setting(f"training parameter {key}", value, text=json.dumps(value, sort_keys=True),
                                            hidden=key == "trained")
    settings.update({
        "epochs": Setting("epochs", epochs),
        "checkpoint": Setting("checkpoint", checkpoint is not None, text="a file" if checkpoint is not None else "none"),
        "save_every": Setting("save_every", save_every),
        "eval_every": Setting("eval_every", eval_every),
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


def save_checkpoint_of(trainer, path) -> Path:
    """Write `trainer`'s state at its last position (see checkpoint.Checkpoint)."""
    run = trainer.run
    dataset = run.dataset
    return save_checkpoint(Checkpoint(
        tensors={n: t.numpy() for n, t in trainer.trained.items()},
        optimizer=trainer.opt.optimizer.state.to_arrays(),
        position=run.position,
        rng_state=run.rng.bit_generator.state if run.rng is not None else None,
        permutation=dataset.permutation if dataset is not None else np.zeros(0, np.int64),
        epoch_result=run.epoch_result,
        params=trainer.describe_params(run.shuffle_seed),
        model_fingerprint=model_fingerprint(trainer.model, set(trainer.trained)),
        data_fingerprint=run.data_fingerprint()), path)


def load_checkpoint_into(trainer, path, force: bool) -> list[str]:
    """Restore the trained tensors and optimizer state of checkpoint `path` into `trainer`;
    the position, RNG and window order wait in `trainer.run.pending` for the next fit."""
    path = Path(path)
    ckpt = load_checkpoint(path)
    if ckpt.model_fingerprint != model_fingerprint(trainer.model, set(trainer.trained)) and not force:
        name = Path(str(trainer.model.path)).name if trainer.model.path is not None else "this one"
        raise InputError(f"{path} is a checkpoint of another model than {name} "
                         "(--force-resume to use it anyway)")
    notes = compare_params(ckpt.params, trainer.describe_params(ckpt.params.shuffle_seed), path)
    for name, t in trainer.trained.items():
        values = ckpt.tensors[name]
        if values.size != t.nelements():
            raise InputError(f"{path}: tensor {name} has {values.size} values, the model's has {t.nelements()}")
        t.array()[...] = values.reshape(t.array().shape)
    try:
        trainer.opt.optimizer.state.load_arrays(ckpt.optimizer)
    except ValueError as e:
        raise InputError(f"{path}: {e}") from None
    trainer.run.pending = (path, ckpt)
    return notes


def _apply_resume(trainer, pending, force: bool) -> tuple[FitPosition, Result]:
    """Put the data order, RNG and position of a loaded checkpoint into the run, once all
    three are known to fit it (the checkpoint checked them against themselves)."""
    path, ckpt = pending
    run = trainer.run
    if ckpt.data_fingerprint != run.data_fingerprint() and not force:
        raise InputError(f"{path} is a checkpoint of a run on another text (or another -c / -val-split) "
                         "(--force-resume to use it anyway)")
    if (ckpt.rng_state is None) != (run.rng is None):
        raise InputError(f"{path}: the checkpointed run {'did not shuffle' if ckpt.rng_state is None else 'shuffled'} "
                         "its windows; resume it with the same --seed")
    position = ckpt.position
    per_step = train_batches(trainer.opt, run.dataset, run.idata_split)[1]
    if position.ibatch > run.n_train_batches or position.ibatch % per_step:
        raise InputError(f"{path}: the checkpoint's position (batch {position.ibatch} of the epoch) is not a step of "
                         f"this run's epoch ({run.n_train_batches} batches, {per_step} per optimizer step)")
    perm = run.dataset.permutation
    if ckpt.permutation.shape != perm.shape and not force:
        raise InputError(f"{path}: the checkpoint's window order ({ckpt.permutation.size} windows) does not fit this "
                         f"text ({perm.size})")
    if ckpt.permutation.shape == perm.shape:
        perm[...] = ckpt.permutation
    if run.rng is not None:
        run.rng.bit_generator.state = ckpt.rng_state
    return position, ckpt.epoch_result


class _StopRequest:
    """A first Ctrl-C during a checkpointed fit: stop after the current optimizer step."""

    def __init__(self) -> None:
        self.requested = False

    @contextmanager
    def armed(self, enabled: bool, say):
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


def _write_line(stream, line: str, tty: bool) -> None:
    """A whole line; on a terminal it first clears the progress bar drawn there."""
    stream.write(("\r\033[K" if tty else "") + line + "\n")
    stream.flush()
