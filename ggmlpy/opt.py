"""Optimization (the twin of ggml-opt): datasets, optimizers, training graphs, epochs, fit.

One mechanism serves any model, from a linear regression to a language model:

- `Optimizer` owns what training keeps for a set of parameter tensors: a gradient
  accumulator per param, the optimizer state (AdamW's m and v, the step count) as an
  explicit object that can be saved and loaded, and the update step as a graph of
  `opt_step_*` ops whose hyper-parameters are a host-filled tensor (so schedules change
  values without rebuilding anything).
- `TrainGraph` is one model graph prepared for training: the forward graph (the loss
  and what is recorded), the backward graph that adds the param gradients into the
  optimizer's accumulators, and one planned allocation for both (the forward graph is a
  prefix of the backward one).
- `OptContext` evaluates training graphs and takes optimizer steps: one static graph
  built from `inputs`/`outputs` and a loss type (ggml_opt_fit's case), or graphs the
  caller builds per evaluation (a language model's ubatches). A `BatchFeeder` says how a
  physical batch of the dataset is evaluated; `OptContext` itself feeds its static graph.
- `train_step` is one optimizer step: gradients are zeroed, accumulated over `opt_period`
  evaluations and applied by `OptContext.step`, which refuses a step whose losses are not
  finite. `opt_epoch` (ggml_opt_epoch) is those steps then `evaluate_batches`, and
  `opt_fit` (ggml_opt_fit) a plain loop of epochs; a fit with more to do between steps
  (llamapy's checkpoints) writes its own loop of `train_step`s.

Optimizer hyper-parameters are checked records (`AdamW`, `SGD`: pydantic models, records.py), defined once, here.
"""
from __future__ import annotations

import io
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from functools import partial
from typing import Annotated, Any, Literal, Protocol, TextIO

import numpy as np
from pydantic import Field

from . import ops as O
from . import ops_train as OT
from .alloc import GraphAllocator
from .backend.cpu import CpuBackend
from .backward import build_backward_expand
from .context import Context
from .distributed import as_communicator
from .graph import new_graph
from .records import Float, Record
from .tensor import Flag, Tensor
from .types import GGMLType, traits


# ---- dataset ------------------------------------------------------------------------------------
class Dataset:
    """`ndata` datapoints of `ne_datapoint` values (and labels of `ne_label` values), grouped
    in shards of `ndata_shard` consecutive datapoints; shuffling permutes whole shards.

    The datapoints live in `data` and `labels`, unless a subclass reads them from elsewhere
    (files larger than memory): it is made with `in_memory=False` and overrides `rows`."""

    def __init__(self, ne_datapoint: int, ne_label: int, ndata: int, ndata_shard: int = 1,
                 type_data: GGMLType = GGMLType.F32, type_label: GGMLType = GGMLType.F32,
                 in_memory: bool = True) -> None:
        if ne_datapoint <= 0 or ne_label < 0 or ndata <= 0 or ndata_shard <= 0 or ndata % ndata_shard:
            raise ValueError(f"dataset: bad geometry (ne_datapoint={ne_datapoint}, ne_label={ne_label}, "
                             f"ndata={ndata}, ndata_shard={ndata_shard})")
        self.ndata, self.ndata_shard = ndata, ndata_shard
        self.ne_datapoint, self.ne_label = ne_datapoint, ne_label
        self.type_data, self.type_label = GGMLType(type_data), GGMLType(type_label)
        self.data = np.zeros((ndata, ne_datapoint), dtype=traits(type_data).np_dtype) if in_memory else None
        self.labels = (np.zeros((ndata, ne_label), dtype=traits(type_label).np_dtype)
                       if ne_label and in_memory else None)
        n_shards = ndata // ndata_shard  # int32 while it fits: a corpus's windows number tens of millions
        self.permutation = np.arange(n_shards, dtype=np.int32 if n_shards < 2**31 else np.int64)

    def rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Data and labels of the stored datapoints `rows` (indices in storage order)."""
        return self.data[rows], None if self.labels is None else self.labels[rows]

    def shuffle(self, rng: np.random.Generator, idata: int = -1) -> None:
        """Shuffle the shards of the first `idata` datapoints (all when negative)."""
        if idata < 0:
            rng.shuffle(self.permutation)
            return
        if idata > self.ndata or idata % self.ndata_shard:
            raise ValueError(f"dataset: cannot shuffle the first {idata} of {self.ndata} datapoints in shards of {self.ndata_shard}")
        rng.shuffle(self.permutation[: idata // self.ndata_shard])

    def get_batch(self, data_batch: Tensor, labels_batch: Tensor | None, ibatch: int) -> None:
        """Copy batch `ibatch` (in shuffled shard order) into the batch tensors."""
        data = np.reshape(data_batch.array(), (-1, self.ne_datapoint), copy=False)
        rows_data, rows_labels = self.rows(self._shards(data.shape[0], ibatch))
        data[...] = rows_data
        if labels_batch is not None:
            labels = np.reshape(labels_batch.array(), (-1, self.ne_label), copy=False)
            labels[...] = rows_labels

    def index(self, i: int) -> int:
        """The row of the i-th datapoint in the current (shuffled) order."""
        return int(self.permutation[i // self.ndata_shard]) * self.ndata_shard + i % self.ndata_shard

    def datapoint(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Data and labels of the i-th datapoint in the current (shuffled) order."""
        data, labels = self.rows(np.array([self.index(i)]))
        return data[0], None if labels is None else labels[0]

    def _shards(self, n_batch: int, ibatch: int) -> np.ndarray:
        per_batch = n_batch // self.ndata_shard
        if n_batch % self.ndata_shard or (ibatch + 1) * per_batch > len(self.permutation):
            raise ValueError(f"dataset: batch {ibatch} of {n_batch} datapoints is out of range")
        shards = self.permutation[ibatch * per_batch:(ibatch + 1) * per_batch]
        return (shards[:, None] * self.ndata_shard + np.arange(self.ndata_shard)).reshape(-1)


# ---- optimizer hyper-parameters (the one definition) ------------------------------------------------
class AdamW(Record):
    """AdamW with decoupled weight decay (`wd`, a fraction of alpha per step)."""

    kind: Literal["adamw"] = "adamw"
    alpha: Float = Field(1e-3, ge=0)  # 0 where a schedule ends at lr_min 0
    beta1: Float = Field(0.9, ge=0, le=1)
    beta2: Float = Field(0.999, ge=0, le=1)
    eps: Float = Field(1e-8, ge=0)
    wd: Float = Field(0.0, ge=0, le=1)


class SGD(Record):
    """Plain SGD with decoupled weight decay; keeps no state."""

    kind: Literal["sgd"] = "sgd"
    alpha: Float = Field(1e-3, ge=0)  # 0 where a schedule ends at lr_min 0
    wd: Float = Field(0.0, ge=0, le=1)


# a field that holds either optimizer's parameters (a dict picks its class by "kind")
OptimizerParams = Annotated[AdamW | SGD, Field(discriminator="kind")]


def with_alpha(pars: AdamW | SGD, alpha: float) -> AdamW | SGD:
    """The same optimizer with another learning rate."""
    return pars.replace(alpha=alpha)


class LossType(Enum):
    MEAN = "mean"
    SUM = "sum"
    CROSS_ENTROPY = "cross_entropy"
    MEAN_SQUARED_ERROR = "mean_squared_error"


class BuildType(IntEnum):
    FORWARD = 1  # evaluation only
    GRAD = 2     # gradients, no optimizer state
    OPT = 3      # gradients and optimizer steps


class TrainingDivergedError(ArithmeticError):
    """A loss was NaN or infinite: the step was refused (and the weights put back to the
    last ones that gave a finite loss when the context keeps them)."""


# ---- results ---------------------------------------------------------------------------------------
def _weighted_mean(values: Sequence[float], counts: Sequence[int]) -> float:
    """The mean of per-batch mean losses over all their datapoints (batch i counting
    counts[i]). Equal counts give the plain mean bit for bit: the weights are then 1.0."""
    w = np.asarray(counts, dtype=np.float64)
    w /= w.max()
    return float((w * np.asarray(values, dtype=np.float64)).sum() / w.sum())


class Result:
    """One pass over data: the loss of each evaluated batch, the datapoints it counted,
    predictions, the correct count, and the mean loss of each optimizer step taken (for
    loss curves). A batch's datapoints whose labels are ignored are not counted: they are
    in neither its loss, nor ndata, nor the predictions."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.ndata = 0
        self.losses: list[float] = []
        self.counts: list[int] = []  # datapoints counted in each batch's loss
        self.steps: list[float] = []
        self._preds: list[np.ndarray] = []  # each batch's, as int32 (a run predicts millions of tokens)
        self.ncorrect = 0
        self.loss_per_datapoint = False

    def loss(self) -> tuple[float, float]:
        """(loss, uncertainty): for per-datapoint losses the mean over every counted datapoint
        (batches weighted by their counts), else the sum over batches."""
        n = len(self.losses)
        if n == 0:
            return 0.0, math.nan
        values = np.asarray(self.losses, dtype=np.float32).astype(np.float64)
        if not self.loss_per_datapoint:
            total = values.sum()
            if n < 2:
                return float(total), math.nan
            mean = total / n
            sample_var = max((values ** 2).sum() / n - mean * mean, 0.0) * n / (n - 1)
            # (ggml reports the sample standard deviation for sums, without the sqrt(n).)
            return float(total), math.sqrt(sample_var * n)
        w = np.asarray(self.counts, dtype=np.float64)
        w /= w.max()  # 1.0 each when the batches count alike: the unweighted statistics bit for bit
        total = w.sum()
        mean = (w * values).sum() / total
        if n < 2:
            return float(mean), math.nan
        n_eff = total * total / (w * w).sum()  # Kish's effective number of batches (n for equal weights)
        sample_var = max((w * values ** 2).sum() / total - mean * mean, 0.0) * n_eff / (n_eff - 1)
        return float(mean), math.sqrt(sample_var / n_eff)  # the standard error of the mean

    def add_batch(self, ndata: int, loss: float, preds, ncorrect: int | None, loss_per_datapoint: bool) -> None:
        """Record one evaluated batch of `ndata` counted datapoints (ncorrect None: no accuracy
        for this loss)."""
        if self.ndata == 0:
            self.loss_per_datapoint = loss_per_datapoint
        self.ndata += ndata
        self.losses.append(loss)
        self.counts.append(ndata)
        if ncorrect is None:
            self.ncorrect = -1
            return
        self._preds.append(np.array(preds, dtype=np.int32).reshape(-1))
        if self.ncorrect >= 0:
            self.ncorrect += ncorrect

    def extend(self, other: "Result") -> None:
        """Append `other`'s batches (another rank's share of a step or of a validation pass)."""
        if other.ndata == 0:
            return
        if self.ndata == 0:
            self.loss_per_datapoint = other.loss_per_datapoint
        self.ndata += other.ndata
        self.losses.extend(other.losses)
        self.counts.extend(other.counts)
        self._preds.extend(other._preds)
        self.ncorrect = -1 if min(self.ncorrect, other.ncorrect) < 0 else self.ncorrect + other.ncorrect

    @property
    def preds(self) -> np.ndarray:
        """The prediction (argmax class) of every counted datapoint, in order (ggml_opt_result_pred)."""
        return np.concatenate(self._preds) if self._preds else np.zeros(0, dtype=np.int32)

    def to_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of a pass in progress (per-datapoint predictions are not kept)."""
        return {"ndata": self.ndata, "losses": list(self.losses), "counts": list(self.counts),
                "steps": list(self.steps), "ncorrect": self.ncorrect, "loss_per_datapoint": self.loss_per_datapoint}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Result":
        r = cls()
        r.ndata, r.ncorrect, r.loss_per_datapoint = int(d["ndata"]), int(d["ncorrect"]), bool(d["loss_per_datapoint"])
        r.losses, r.steps = [float(x) for x in d["losses"]], [float(x) for x in d["steps"]]
        # a pass saved before counts were kept counted every batch alike
        r.counts = [int(x) for x in d.get("counts", [1] * len(r.losses))]
        return r

    def accuracy(self) -> tuple[float, float]:
        """(fraction correct, its binomial standard error); NaN when there are no predictions."""
        if self.ncorrect < 0 or self.ndata == 0:
            return math.nan, math.nan
        acc = self.ncorrect / self.ndata
        unc = math.sqrt(acc * (1.0 - acc) / (self.ndata - 1)) if self.ndata >= 2 else math.nan
        return acc, unc


# ---- the optimizer ------------------------------------------------------------------------------------
class OptimizerState:
    """What an optimizer keeps between steps: how many steps it took and, for AdamW, the
    first and second moments of every param. `to_arrays`/`load_arrays` give and take it
    as named arrays (for checkpoints)."""

    def __init__(self, kind: str, names: list[str], moments: list[tuple[Tensor, Tensor]]) -> None:
        self.kind = kind
        self.names = names
        self.moments = moments
        self.n_steps = 0

    def tensors(self) -> list[Tensor]:
        return [t for pair in self.moments for t in pair]

    def to_arrays(self) -> dict[str, np.ndarray]:
        out = {"opt.n_steps": np.array([self.n_steps], dtype=np.int64)}
        for name, (m, v) in zip(self.names, self.moments):
            out[f"opt.m.{name}"], out[f"opt.v.{name}"] = m.numpy(), v.numpy()
        return out

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore a state saved by `to_arrays` for the same params (shapes checked)."""
        expected = set(self.to_arrays())
        if set(arrays) != expected:
            missing, extra = sorted(expected - set(arrays)), sorted(set(arrays) - expected)
            raise ValueError(f"optimizer state does not match the params (missing {missing[:3]}, unexpected {extra[:3]})")
        for name, (m, v) in zip(self.names, self.moments):
            for t, key in ((m, f"opt.m.{name}"), (v, f"opt.v.{name}")):
                if arrays[key].size != t.nelements():
                    raise ValueError(f"optimizer state {key}: {arrays[key].size} values, the param has {t.nelements()}")
                t.set(arrays[key])
        self.n_steps = int(np.asarray(arrays["opt.n_steps"]).reshape(-1)[0])

    def reset(self) -> None:
        for t in self.tensors():
            t.array()[...] = 0
        self.n_steps = 0


class Optimizer:
    """Gradient accumulators, optimizer state and the update step of a set of F32 params."""

    def __init__(self, params: Sequence[Tensor], hparams: AdamW | SGD, backend: CpuBackend,
                 with_steps: bool = True) -> None:
        if not params:
            raise ValueError("opt: no parameter to optimize")
        self.params = list(params)
        self.hparams = hparams
        self.backend = backend
        names = [p.name or f"param{i}" for i, p in enumerate(self.params)]
        if len(set(names)) != len(names):
            raise ValueError("opt: parameter names must be unique (they key the optimizer state)")
        mem = self.memory = Context(no_alloc=False)  # zeroed memory of their own, outside every arena
        self.grad_accs = {id(p): mem.new_tensor(GGMLType.F32, p.ne, f"{n} grad") for p, n in zip(self.params, names)}
        # every accumulator in one flat buffer: zeroing, norms and clipping are one call each
        self.grad_flat = np.zeros(sum(p.nelements() for p in self.params), np.float32)
        offset = 0
        for acc in self.grad_accs.values():
            acc.bind(self.grad_flat.view(np.uint8), offset)
            offset += acc.nbytes()
        adamw = isinstance(hparams, AdamW) and with_steps
        self.step_params = mem.new_tensor_1d(GGMLType.F32, OT.ADAMW_PARAMS if adamw else OT.SGD_PARAMS,
                                             f"{hparams.kind} params")
        moments, steps = [], []
        for p, n in zip(self.params, names):
            grad = self.grad_accs[id(p)]
            if adamw:
                m = mem.new_tensor(GGMLType.F32, p.ne, f"AdamW m for {n}")
                v = mem.new_tensor(GGMLType.F32, p.ne, f"AdamW v for {n}")
                moments.append((m, v))
                steps.append(OT.opt_step_adamw(mem, p, grad, m, v, self.step_params))
            else:
                steps.append(OT.opt_step_sgd(mem, p, grad, self.step_params))
        self.state = OptimizerState(hparams.kind, names, moments)
        self.step_graph = new_graph(*steps) if with_steps else None

    def grad(self, param: Tensor) -> Tensor:
        """The accumulated gradient of `param` (sum over the evaluations since zero_grad)."""
        return self.grad_accs[id(param)]

    def zero_grad(self) -> None:
        self.grad_flat.fill(0.0)

    def grad_norm(self) -> float:
        """The global L2 norm of the accumulated gradients (all params, float64)."""
        return math.sqrt(self.backend.sum_squares(self.grad_flat))

    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale the accumulated gradients so their global L2 norm is at most `max_norm`
        (PyTorch's clip_grad_norm_: factor max_norm / (norm + 1e-6) when it is below 1);
        returns the norm before clipping."""
        norm = self.grad_norm()
        factor = max_norm / (norm + 1e-6)
        if factor < 1.0:
            self.backend.scale(self.grad_flat, factor)
        return norm

    def step(self, hparams: AdamW | SGD | None = None) -> None:
        """Apply the accumulated gradients with `hparams` (the optimizer's own when None)."""
        if self.step_graph is None:
            raise ValueError("opt: this optimizer computes gradients only")
        pars = hparams or self.hparams
        if pars.kind != self.hparams.kind:
            raise ValueError(f"opt: {pars.kind} parameters for an {self.hparams.kind} optimizer")
        values = self.step_params.array().reshape(-1)
        if isinstance(pars, AdamW):
            t = self.state.n_steps + 1  # AdamW's bias correction counts from 1
            beta1h = 1.0 / (1.0 - np.float32(pars.beta1) ** t)
            beta2h = 1.0 / (1.0 - np.float32(pars.beta2) ** t)
            values[:] = (pars.alpha, pars.beta1, pars.beta2, pars.eps, pars.wd, beta1h, beta2h)
        else:
            values[:] = (pars.alpha, pars.wd)
        self.backend.compute(self.step_graph)
        self.state.n_steps += 1


# ---- training graphs -----------------------------------------------------------------------------------
class TrainGraph:
    """A model graph prepared for training (ggml_opt_build for one graph).

    `objective` is the tensor differentiated (flagged loss); `loss` is what is recorded per
    evaluation, `loss_scale` what the objective's loss was multiplied by (1 / opt_period
    for per-datapoint losses, so that accumulated gradients are the step's mean gradient),
    so recorded losses are unscaled. `pred`/`ncorrect` give accuracy when present.
    `checkpoints` (forward nodes) makes the backward pass recompute the other forward
    intermediates it needs instead of keeping them (gradient checkpointing, recompute.py).
    `allocator`: one shared with other graphs computed in turn (one arena for all of them;
    see GraphAllocator.alloc_graph); a new one when None.
    """

    def __init__(self, ctx: Context, objective: Tensor, loss: Tensor, *, grad_accs: dict[int, Tensor] | None,
                 inputs: Tensor | None = None, pred: Tensor | None = None, ncorrect: Tensor | None = None,
                 outputs: Sequence[Tensor] = (), loss_scale: float = 1.0, loss_per_datapoint: bool = True,
                 checkpoints: Sequence[Tensor] | None = None, allocator: GraphAllocator | None = None) -> None:
        self.inputs, self.loss, self.pred, self.ncorrect = inputs, loss, pred, ncorrect
        # predictions per evaluation (ggml counts the outputs' rows)
        self.ndata = pred.nelements() if pred is not None else (outputs[0].ne[1] if outputs else 1)
        self.loss_scale, self.loss_per_datapoint = loss_scale, loss_per_datapoint
        recorded = [t for t in (loss, pred, ncorrect) if t is not None]
        for t in (*recorded, *outputs):
            t.set_output()
        objective.set_loss()
        self.forward = new_graph(objective, *recorded, *outputs)
        self.backward = None
        if grad_accs is not None:
            self.backward = self.forward.copy()
            build_backward_expand(ctx, self.backward, grad_accs, checkpoints)
        O.set_blas_products((self.backward or self.forward).nodes)  # speed over llama.cpp's summation order
        self.allocator = allocator or GraphAllocator()
        self.allocator.alloc_graph(self.backward or self.forward)

    def record(self, result: Result | None, counted: np.ndarray | None = None,
               label_weight: float = 1.0) -> tuple[float, int]:
        """The evaluation's unscaled loss and how many datapoints it counts; added to `result`
        with its predictions.

        `counted` (bool per datapoint) marks the datapoints whose labels count, the others'
        label rows being all zero, and `label_weight` is the sum of a counted datapoint's
        label row (the loss is linear in it): the loss is then the mean over the counted
        datapoints alone (NaN when none is, and nothing is recorded), and only their
        predictions are kept. The graph's `ncorrect` must not count them either (compare
        the predictions with labels an ignored datapoint never equals)."""
        loss = float(self.loss.array().reshape(-1)[0]) / self.loss_scale
        ndata = self.ndata
        if counted is not None:
            ndata = int(np.count_nonzero(counted))
            loss = loss * (self.ndata / (ndata * label_weight)) if ndata else math.nan
        if result is not None and ndata:
            has_acc = self.pred is not None
            preds = self.pred.array().reshape(-1) if has_acc else ()
            result.add_batch(ndata, loss, preds if counted is None or not has_acc else preds[counted],
                             int(self.ncorrect.array().reshape(-1)[0]) if has_acc else None, self.loss_per_datapoint)
        return loss, ndata


# ---- the optimization context -----------------------------------------------------------------------------
class BatchFeeder(Protocol):
    """How one physical batch of a dataset is evaluated: `run_batch` evaluates (train: with
    gradients) the datapoints of batch `ibatch`, records into `result` and calls `tick()`
    after each of its `evals_per_batch` evaluations (the progress counter). `begin_step`
    sees the batches of every rank before an optimizer step (where a feeder whose labels
    may be ignored counts the datapoints the step's loss is the mean over)."""

    datapoints_per_batch: int
    evals_per_batch: int

    def begin_step(self, dataset: Dataset, batches: range) -> None: ...

    def run_batch(self, dataset: Dataset, ibatch: int, train: bool, result: Result | None,
                  tick: Callable[[], None]) -> None: ...


GetOptPars = Callable[[], AdamW | SGD]


@dataclass
class OptParams:
    """What `OptContext` needs. With `inputs` and `outputs` it builds one static graph and
    its loss from `loss_type` (its params: the tensors of that graph flagged param);
    without them the caller passes `params` and prepares graphs with `train_graph`."""

    ctx_compute: Context | None = None
    inputs: Tensor | None = None
    outputs: Tensor | None = None
    loss_type: LossType = LossType.MEAN
    optimizer: AdamW | SGD | None = None  # AdamW() when None
    build_type: BuildType = BuildType.OPT
    opt_period: int = 1                   # evaluations whose gradients make one optimizer step
    # the hyper-parameters of the step about to be taken (a schedule; a bound method or a closure
    # carries what it needs, where ggml passes get_opt_pars_ud); `optimizer`'s own when None
    get_opt_pars: GetOptPars | None = None
    n_threads: int | None = None
    seed: int = 0
    params: Sequence[Tensor] | None = None
    keep_last_good: bool = False          # copy the params before each step, to restore after a NaN loss
    grad_clip: float | None = None        # clip the global gradient L2 norm to this before each step
    backend: CpuBackend | None = None
    feeder: BatchFeeder | None = None     # the static graph's own feeder when None
    comm: Any = None                      # data parallelism: a Communicator or an mpi4py communicator


class OptContext:
    """ggml_opt_context: the optimizer, the training graphs, evaluation and steps."""

    def __init__(self, params: OptParams) -> None:
        if params.opt_period < 1:
            raise ValueError("opt_period must be at least 1")
        if params.grad_clip is not None and not params.grad_clip > 0:
            raise ValueError(f"grad_clip must be positive, got {params.grad_clip}")
        self.params = params
        self.opt_period = params.opt_period
        self.comm = as_communicator(params.comm)
        # per-datapoint losses are scaled so the gradients summed over a step's evaluations on
        # every rank are the step's mean gradient
        self.loss_scale = 1.0 / (self.opt_period * self.comm.size)
        self.rng = np.random.default_rng(params.seed)
        self.backend = params.backend or CpuBackend(params.n_threads)
        self.labels: Tensor | None = None
        self.static: TrainGraph | None = None
        self.inputs, self.outputs = params.inputs, params.outputs
        trained = list(params.params or [])
        if self.inputs is not None and self.outputs is not None and params.params is None:
            trained = self._static_params()
        self.optimizer = None
        if params.build_type != BuildType.FORWARD:
            self.optimizer = Optimizer(trained, params.optimizer or AdamW(), self.backend,
                                       with_steps=params.build_type == BuildType.OPT)
        if self.inputs is not None and self.outputs is not None:
            self.static = self._build_static()
        self.feeder: BatchFeeder = params.feeder or _StaticFeeder(self)
        self._graph: TrainGraph | None = None
        self._backward = False
        self._last_graph = self.static
        self._step_losses: list[tuple[float, int]] = []  # (loss, datapoints counted) per evaluation
        self._last_good: list[np.ndarray] | None = None
        self.last_grad_norm = math.nan  # before clipping, of the last step (with grad_clip or track_grad_norm)
        self.track_grad_norm = False  # compute last_grad_norm at every step, clipping or not (a watched run)
        self.last_step_params: AdamW | SGD | None = None  # the hyper-parameters the last step used
        self.reduce_seconds = 0.0  # time spent summing gradients over the ranks

    # -- the static graph (ggml_opt_fit's model) --------------------------------------------------
    def _static_params(self) -> list[Tensor]:
        trained = [t for t in new_graph(self.outputs).nodes if t.flags & Flag.PARAM]
        if not trained and self.params.build_type != BuildType.FORWARD:
            raise ValueError("opt: no tensor of the model graph is flagged param")
        return trained

    def _build_static(self) -> TrainGraph:
        ctx, p, outputs = self.params.ctx_compute, self.params, self.outputs
        if not self.inputs.has_data:
            _own_memory(self.inputs)
        self.inputs.set_input()
        per_datapoint = p.loss_type != LossType.SUM
        scale = self.loss_scale if per_datapoint else 1.0
        n_out = outputs.nelements()
        pred = ncorrect = None
        if p.loss_type in (LossType.MEAN, LossType.SUM):
            loss = O.sum(ctx, outputs)
            if p.loss_type == LossType.MEAN:
                loss = O.scale(ctx, loss, scale / n_out)
        else:
            self.labels = _own_memory(ctx.new_tensor(GGMLType.F32, outputs.ne, "labels")).set_input()
            if p.loss_type == LossType.CROSS_ENTROPY:
                loss = OT.cross_entropy_loss(ctx, outputs, self.labels)
                if scale != 1.0:
                    loss = O.scale(ctx, loss, scale)
                pred = _own_memory(O.argmax(ctx, outputs)).set_name("pred")
                ncorrect = _own_memory(O.count_equal(ctx, pred, O.argmax(ctx, self.labels)))
            else:
                diff = O.sub(ctx, outputs, self.labels)
                loss = O.scale(ctx, O.sum(ctx, O.sqr(ctx, diff)), scale / n_out)
        loss = _own_memory(loss).set_name("loss")
        return self.train_graph(ctx, loss, inputs=self.inputs, pred=pred, ncorrect=ncorrect, outputs=(outputs,),
                                loss_scale=scale, loss_per_datapoint=per_datapoint)

    def train_graph(self, ctx: Context, objective: Tensor, loss: Tensor | None = None, **kwargs) -> TrainGraph:
        """A graph prepared for training with this context's optimizer (see TrainGraph)."""
        accs = self.optimizer.grad_accs if self.optimizer is not None else None
        return TrainGraph(ctx, objective, objective if loss is None else loss, grad_accs=accs, **kwargs)

    @property
    def batch_size(self) -> int:
        """Datapoints per evaluation (what the progress counter counts in): ggml_opt_inputs' ne[1]."""
        g = self._last_graph
        return g.inputs.ne[1] if g is not None and g.inputs is not None else 1

    @property
    def iter(self) -> int:
        """Optimizer steps taken + 1 (ggml's count, AdamW's bias-correction step)."""
        return (self.optimizer.state.n_steps if self.optimizer else 0) + 1

    def grad_acc(self, t: Tensor) -> Tensor | None:
        return self.optimizer.grad_accs.get(id(t)) if self.optimizer else None

    def optimizer_state(self) -> list[Tensor]:
        """The tensors the optimizer keeps between steps (AdamW: m and v per param; SGD: none)."""
        return self.optimizer.state.tensors() if self.optimizer else []

    def reset(self, optimizer: bool) -> None:
        """Zero accumulated gradients; with `optimizer`, also the moments and the step count."""
        if self.optimizer is None:
            return
        self.zero_grad()
        if optimizer:
            self.optimizer.state.reset()

    # -- evaluation --------------------------------------------------------------------------------
    def alloc(self, backward: bool, graph: TrainGraph | None = None) -> None:
        """Choose the graph for the next eval (ggml_opt_alloc): `graph` or the static one,
        forward only or with gradients (added into the accumulators)."""
        graph = graph or self.static
        if graph is None:
            raise ValueError("opt: no graph to evaluate (this context has no static graph)")
        if backward and graph.backward is None:
            raise ValueError("opt: this graph was built for forward passes only")
        self._graph, self._backward = graph, backward

    def eval(self, result: Result | None, counted: np.ndarray | None = None, label_weight: float = 1.0) -> float:
        """Compute the chosen graph and record its loss (ggml_opt_eval); returns the loss.
        `counted` and `label_weight`: the datapoints whose labels count (TrainGraph.record)."""
        graph = self._graph
        if graph is None:
            raise RuntimeError("opt: call alloc() before eval()")
        self.backend.compute(graph.backward if self._backward else graph.forward)
        self._graph, self._last_graph = None, graph
        loss, ndata = graph.record(result, counted, label_weight)
        if self._backward and ndata:
            self._step_losses.append((loss, ndata))
        return loss

    # -- optimizer steps ---------------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Start an optimizer step: zero the accumulators and the step's losses."""
        self.optimizer.zero_grad()
        self._step_losses = []

    def step(self, result: Result | None = None, shard: Result | None = None) -> None:
        """Apply the gradients accumulated since zero_grad, with the hyper-parameters of
        `get_opt_pars` (or the optimizer's own); records the step's mean loss in `result`.

        With several ranks, the gradients are first summed over all of them (one in-place
        reduction of the flat buffer), the step's losses gathered, and `shard` (this rank's
        evaluations of the step) appended to `result` for every rank in rank order, so every
        rank holds the same result and takes the same step.

        A step whose losses are not all finite is refused with TrainingDivergedError; with
        `keep_last_good` the params are first put back to the copy taken before the last
        step (the last weights that gave finite losses)."""
        if self.optimizer is None or self.params.build_type != BuildType.OPT:
            raise ValueError("opt: this context was built without an optimizer step")
        losses = self._step_losses
        if self.comm.size > 1:
            parts = self.comm.allgather((losses, shard))
            losses = [x for part, _ in parts for x in part]
            if result is not None:
                for _, other in parts:
                    result.extend(other)
        if not all(math.isfinite(x) for x, _ in losses):
            step = self.optimizer.state.n_steps + 1
            if self._last_good is not None:
                for p, saved in zip(self.optimizer.params, self._last_good):
                    np.copyto(p.array(), saved)
            raise TrainingDivergedError(
                f"training: the loss became {sum(x for x, _ in losses)} at optimizer step {step}"
                + ("; the weights are back to the last ones that gave a finite loss" if self.params.keep_last_good else ""))
        if self.params.keep_last_good:
            self._keep_last_good()
        p = self.params
        if self.comm.size > 1:
            t0 = time.perf_counter()
            self.comm.allreduce_sum(self.optimizer.grad_flat)
            self.reduce_seconds += time.perf_counter() - t0
        if p.grad_clip is not None:
            self.last_grad_norm = self.optimizer.clip_grad_norm(p.grad_clip)
        elif self.track_grad_norm:
            self.last_grad_norm = self.optimizer.grad_norm()
        pars = p.get_opt_pars() if p.get_opt_pars else None
        self.optimizer.step(pars)
        self.last_step_params = pars or self.optimizer.hparams
        if result is not None and losses:
            result.steps.append(_weighted_mean(*zip(*losses)))
        self._step_losses = []

    def _keep_last_good(self) -> None:
        if self._last_good is None:
            self._last_good = [np.array(p.array()) for p in self.optimizer.params]
        else:
            for p, saved in zip(self.optimizer.params, self._last_good):
                np.copyto(saved, p.array())


class _StaticFeeder:
    """A physical batch of the static graph: copy it into the inputs, evaluate once."""

    evals_per_batch = 1

    def __init__(self, opt_ctx: OptContext) -> None:
        self.opt_ctx = opt_ctx

    @property
    def datapoints_per_batch(self) -> int:
        return self.opt_ctx.inputs.ne[1]

    def begin_step(self, dataset: Dataset, batches: range) -> None:
        """Every datapoint counts: the constant loss scale is the step's mean."""

    def run_batch(self, dataset: Dataset, ibatch: int, train: bool, result: Result | None,
                  tick: Callable[[], None]) -> None:
        o = self.opt_ctx
        o.alloc(backward=train)
        dataset.get_batch(o.inputs, o.labels, ibatch)
        o.eval(result)
        tick()


def _own_memory(t: Tensor) -> Tensor:
    """Give `t` zeroed memory of its own: it lives outside the graph arena (results, inputs)."""
    t.bind(np.zeros(max(t.nbytes(), 1), dtype=np.uint8))
    return t


# ---- epochs and fit ------------------------------------------------------------------------------
EpochCallback = Callable[[bool, OptContext, Dataset, Result, int, int, float], None]


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


def opt_epoch(opt_ctx: OptContext, dataset: Dataset, result_train: Result | None, result_eval: Result | None,
              idata_split: int, callback_train: EpochCallback | None = None,
              callback_eval: EpochCallback | None = None) -> None:
    """Train on datapoints [0, idata_split), then evaluate on the rest (ggml_opt_epoch):
    one `train_step` after another, then `evaluate_batches`.

    Datapoints of an incomplete last optimizer step are skipped (neither trained on nor
    evaluated). With several ranks every rank ends with the same results.
    """
    n_train, per_step, nbatches, ibatch_split = train_batches(opt_ctx, dataset, idata_split)
    progress = PassProgress(callback_train, True, opt_ctx, dataset, result_train,
                            n_train * opt_ctx.feeder.evals_per_batch, opt_ctx.comm.size)
    for first in range(0, n_train, per_step):
        train_step(opt_ctx, dataset, first, result_train, progress)
    progress.finish()
    evaluate_batches(opt_ctx, dataset, range(ibatch_split, nbatches), result_eval, callback_eval)


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


_BLOCKS = " ▏▎▍▌▋▊▉█"
PROGRESS_INTERVAL = 10.0  # seconds between progress lines on a stream that is not a terminal
PROGRESS_INTERVAL_ENV = "GGMLPY_PROGRESS_INTERVAL"  # sets that default (a number of seconds)


def _hms(seconds: float) -> str:
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
        times = (f" t={_hms(elapsed)}" if show_time else "") + f" ETA={_hms(eta)}"
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


@dataclass
class FitState:
    """The position in an opt_fit, passed to its `get_opt_pars` so a schedule can use it
    (ggml_opt_fit's get_opt_pars_ud)."""

    epoch: int = 0   # 0-based
    nepoch: int = 1


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
    history = []
    for epoch in range(nepoch):
        state.epoch = epoch
        if nbatch_logical < idata_split:
            dataset.shuffle(opt_ctx.rng, idata_split)
        if not silent:
            stream.write(f"opt_fit: epoch {epoch + 1:04d}/{nepoch:04d}:\n")
        train, val = Result(), Result()
        opt_epoch(opt_ctx, dataset, train, val, idata_split, callback_train or bar, callback_eval or bar)
        history.append(EpochResult(epoch, train, val))
        if not silent:
            stream.write("\n")
    if not silent:
        stream.write(f"opt_fit: training took {_hms(time.perf_counter() - t0)}\n")
    return history
