"""A trainer's state to and from a checkpoint file (checkpoint.py is the file itself):
what Context.opt_save_checkpoint writes, what opt_load_checkpoint and opt_fit(resume=...)
restore, and where the resumed run starts.

Loading is in two parts because they are checked against different things: the tensors
and optimizer state need only the trainer (opt_load_checkpoint, before any data is
known); the window order, shuffle RNG and position need the run's data and split, so
they wait in `trainer.run.pending` until the next fit has them (`resume_position`).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ggmlpy.opt import FitPosition, Result, train_batches

from .checkpoint import Checkpoint, compare_params, load_checkpoint, model_fingerprint, save_checkpoint
from .errors import InputError


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
    the position, RNG and window order wait in `trainer.run.pending` for the next fit.
    Returns the hyper-parameters that differ from the checkpoint's."""
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


def resume_position(trainer, force: bool) -> tuple[FitPosition, Result]:
    """Put the data order, RNG and position of the checkpoint waiting in `trainer.run.pending`
    into the run, once all three are known to fit it (the checkpoint checked them against
    themselves); returns where the run starts and its epoch's training result so far."""
    path, ckpt = trainer.run.pending
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
    _check_steps(path, ckpt, per_step, run.n_train_batches // per_step,
                 same_data=ckpt.data_fingerprint == run.data_fingerprint())
    perm = run.dataset.permutation
    if ckpt.permutation.shape != perm.shape and not force:
        raise InputError(f"{path}: the checkpoint's window order ({ckpt.permutation.size} windows) does not fit this "
                         f"text ({perm.size})")
    if ckpt.permutation.shape == perm.shape:
        perm[...] = ckpt.permutation
    if run.rng is not None:
        run.rng.bit_generator.state = ckpt.rng_state
    run.pending = None
    return position, ckpt.epoch_result


def _check_steps(path: Path, ckpt: Checkpoint, per_step: int, steps_per_epoch: int, same_data: bool) -> None:
    """The step counts a checkpoint records agree with its position, in this run's steps of
    `per_step` windows: its epoch's result one entry per step of the epoch so far, and (on
    the data it was written for, whose epochs take `steps_per_epoch` steps) its optimizer at
    least the steps of the epochs before and of this one (more when the trainer had trained
    before the run began). InputError with one line when they do not."""
    position = ckpt.position
    in_epoch, recorded = position.ibatch // per_step, len(ckpt.epoch_result.steps)
    if recorded != in_epoch:
        raise InputError(f"{path}: the checkpoint is invalid: its epoch_result records {recorded} steps of this epoch, "
                         f"but its position (window {position.ibatch}, {per_step} window{'s' * (per_step != 1)} a "
                         f"step) is after {in_epoch} steps")
    n_steps, needed = int(ckpt.optimizer["opt.n_steps"][0]), position.epoch * steps_per_epoch + in_epoch
    if same_data and n_steps < needed:
        raise InputError(f"{path}: the checkpoint is invalid: its step count {n_steps} is fewer than its position "
                         f"takes (epoch {position.epoch + 1}, window {position.ibatch}: at least {needed} steps, "
                         f"{steps_per_epoch} an epoch)")
