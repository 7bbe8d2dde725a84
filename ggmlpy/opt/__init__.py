"""Optimization (the twin of ggml-opt): datasets, optimizers, training graphs, the training
loop, fit. One mechanism serves any model, from a linear regression to a language model.

- dataset.py: `Dataset`, datapoints in shards that shuffling permutes.
- optimizer.py: `AdamW` / `SGD` (checked records, the one definition), `OptimizerState`
  (saved and loaded by checkpoints) and `Optimizer` (accumulators and the step as a graph).
- result.py: `Result`, a pass's losses with their uncertainties, predictions, accuracy.
- train_graph.py: `TrainGraph`, one model graph prepared for training.
- context.py: `OptContext` (ggml_opt_context), evaluating graphs and taking steps that
  refuse non-finite losses and, over several ranks, sum the gradients first.
- loop.py: `TrainingLoop` with its `Hooks`: the one loop of epochs and optimizer steps.
- fit.py: `opt_epoch` and `opt_fit`, ggml's entry points over that loop.
- progress.py: ggml-opt's progress lines (`ProgressBar`).

The optimizer computes on any ggmlpy.backend `Backend`; it names none.
"""
from __future__ import annotations

from .context import BatchFeeder, BuildType, GetOptPars, LossType, OptContext, OptParams, TrainingDivergedError
from .dataset import Dataset
from .fit import CallbackHooks, FitState, opt_epoch, opt_fit
from .loop import (
    EpochCallback,
    EpochResult,
    FitPosition,
    Hooks,
    PassProgress,
    TrainingLoop,
    batches_per_step,
    evaluate_batches,
    train_batches,
    train_step,
)
from .optimizer import SGD, AdamW, Optimizer, OptimizerParams, OptimizerState, with_alpha
from .progress import (
    PROGRESS_INTERVAL,
    PROGRESS_INTERVAL_ENV,
    ProgressBar,
    format_progress,
    loss_and_accuracy,
    progress_interval,
)
from .result import Result
from .train_graph import TrainGraph

__all__ = [
    "PROGRESS_INTERVAL", "PROGRESS_INTERVAL_ENV", "SGD", "AdamW", "BatchFeeder", "BuildType", "CallbackHooks", "Dataset",
    "EpochCallback", "EpochResult", "FitPosition", "FitState", "GetOptPars", "Hooks", "LossType", "OptContext",
    "OptParams", "Optimizer", "OptimizerParams", "OptimizerState", "PassProgress", "ProgressBar", "Result",
    "TrainGraph", "TrainingDivergedError", "TrainingLoop", "batches_per_step", "evaluate_batches", "format_progress",
    "loss_and_accuracy", "opt_epoch", "opt_fit", "progress_interval", "train_batches", "train_step", "with_alpha",
]
