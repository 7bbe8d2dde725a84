"""Optimization (the twin of ggml-opt): datasets, losses, AdamW/SGD as graph ops, epochs, fit.

The model is a graph from `inputs` to `outputs`. `OptContext` adds the loss, builds
three graphs that share their nodes - forward (gf), forward+backward (gb_grad) and
forward+backward+optimizer step (gb_opt) - and plans memory once for the largest: the
others are prefixes of it, so any of them runs in that one allocation. Gradients
accumulate over `opt_period` physical batches before each optimizer step. Optimizer
hyper-parameters come from a callback on every step, so schedules are user code.
"""
from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import Any, TextIO

import numpy as np

from . import ops as O
from . import ops_train as OT
from .alloc import GraphAllocator
from .backend.cpu import CpuBackend
from .backward import build_backward_expand
from .context import Context
from .graph import Graph, new_graph
from .tensor import Flag, Tensor
from .types import GGMLType, traits


# ---- dataset ------------------------------------------------------------------------------------
class Dataset:
    """`ndata` datapoints of `ne_datapoint` values (and labels of `ne_label` values), grouped
    in shards of `ndata_shard` consecutive datapoints; shuffling permutes whole shards."""

    def __init__(self, ne_datapoint: int, ne_label: int, ndata: int, ndata_shard: int = 1,
                 type_data: GGMLType = GGMLType.F32, type_label: GGMLType = GGMLType.F32) -> None:
        if ne_datapoint <= 0 or ne_label < 0 or ndata <= 0 or ndata_shard <= 0 or ndata % ndata_shard:
            raise ValueError(f"dataset: bad geometry (ne_datapoint={ne_datapoint}, ne_label={ne_label}, "
                             f"ndata={ndata}, ndata_shard={ndata_shard})")
        self.ndata, self.ndata_shard = ndata, ndata_shard
        self.type_data, self.type_label = GGMLType(type_data), GGMLType(type_label)
        self.data = np.zeros((ndata, ne_datapoint), dtype=traits(type_data).np_dtype)
        self.labels = np.zeros((ndata, ne_label), dtype=traits(type_label).np_dtype) if ne_label else None
        self.permutation = np.arange(ndata // ndata_shard)

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
        data = np.reshape(data_batch.array(), (-1, self.data.shape[1]), copy=False)
        shards = self._shards(data.shape[0], ibatch)
        data[...] = self.data[shards]
        if labels_batch is not None:
            labels = np.reshape(labels_batch.array(), (-1, self.labels.shape[1]), copy=False)
            labels[...] = self.labels[shards]

    def datapoint(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Data and labels of the i-th datapoint in the current (shuffled) order."""
        j = self.permutation[i // self.ndata_shard] * self.ndata_shard + i % self.ndata_shard
        return self.data[j], None if self.labels is None else self.labels[j]

    def _shards(self, n_batch: int, ibatch: int) -> np.ndarray:
        per_batch = n_batch // self.ndata_shard
        if n_batch % self.ndata_shard or (ibatch + 1) * per_batch > len(self.permutation):
            raise ValueError(f"dataset: batch {ibatch} of {n_batch} datapoints is out of range")
        shards = self.permutation[ibatch * per_batch:(ibatch + 1) * per_batch]
        return (shards[:, None] * self.ndata_shard + np.arange(self.ndata_shard)).reshape(-1)


# ---- optimizer parameters --------------------------------------------------------------------------
class LossType(Enum):
    MEAN = "mean"
    SUM = "sum"
    CROSS_ENTROPY = "cross_entropy"
    MEAN_SQUARED_ERROR = "mean_squared_error"


class OptimizerType(Enum):
    ADAMW = "adamw"
    SGD = "sgd"


class BuildType(IntEnum):
    FORWARD = 1
    GRAD = 2
    OPT = 3


@dataclass
class AdamWParams:
    alpha: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    wd: float = 0.0  # decoupled weight decay, a fraction of alpha per step


@dataclass
class SGDParams:
    alpha: float = 1e-3
    wd: float = 0.0


@dataclass
class OptimizerParams:
    adamw: AdamWParams = field(default_factory=AdamWParams)
    sgd: SGDParams = field(default_factory=SGDParams)


def default_optimizer_params(userdata: Any = None) -> OptimizerParams:
    return OptimizerParams()


GetOptPars = Callable[[Any], OptimizerParams]


@dataclass
class OptParams:
    """What `OptContext` needs: the model graph's ends and how to train it."""

    ctx_compute: Context
    inputs: Tensor
    outputs: Tensor
    loss_type: LossType = LossType.MEAN
    optimizer: OptimizerType = OptimizerType.ADAMW
    build_type: BuildType = BuildType.OPT
    opt_period: int = 1  # physical batches per optimizer step
    get_opt_pars: GetOptPars = default_optimizer_params
    get_opt_pars_ud: Any = None
    n_threads: int | None = None
    seed: int = 0


# ---- results ---------------------------------------------------------------------------------------
class Result:
    """Loss per physical batch, predictions and correct count of one pass over data."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.ndata = 0
        self.losses: list[float] = []
        self.preds: list[int] = []
        self.ncorrect = 0
        self.opt_period = 1
        self.loss_per_datapoint = False

    def loss(self) -> tuple[float, float]:
        """(loss, uncertainty): the mean over batches for per-datapoint losses, else the sum."""
        n = len(self.losses)
        if n == 0:
            return 0.0, math.nan
        scaled = np.asarray(self.losses, dtype=np.float32).astype(np.float64)
        if self.loss_per_datapoint:
            scaled = scaled * self.opt_period
        mean = scaled.sum() / n
        loss = mean if self.loss_per_datapoint else scaled.sum()
        if n < 2:
            return float(loss), math.nan
        sample_var = max((scaled ** 2).sum() / n - mean * mean, 0.0) * n / (n - 1)
        # standard error of the mean; for a summed loss, of the sum (n times the mean).
        # (ggml reports the sample standard deviation for sums, without the sqrt(n).)
        unc = math.sqrt(sample_var / n) if self.loss_per_datapoint else math.sqrt(sample_var * n)
        return float(loss), unc

    def add_batch(self, ndata: int, loss: float, preds, ncorrect: int | None, opt_period: int,
                  loss_per_datapoint: bool) -> None:
        """Record one physical batch (ncorrect None: no accuracy for this loss)."""
        if self.ndata == 0:
            self.loss_per_datapoint, self.opt_period = loss_per_datapoint, opt_period
        self.ndata += ndata
        self.losses.append(loss)
        if ncorrect is None:
            self.ncorrect = -1
            return
        self.preds.extend(int(i) for i in preds)
        if self.ncorrect >= 0:
            self.ncorrect += ncorrect

    def accuracy(self) -> tuple[float, float]:
        """(fraction correct, its binomial standard error); NaN when there are no predictions."""
        if self.ncorrect < 0 or self.ndata == 0:
            return math.nan, math.nan
        acc = self.ncorrect / self.ndata
        unc = math.sqrt(acc * (1.0 - acc) / (self.ndata - 1)) if self.ndata >= 2 else math.nan
        return acc, unc


# ---- the optimization context ---------------------------------------------------------------------------
def _own_memory(t: Tensor, fill: float = 0.0) -> Tensor:
    """Give `t` zeroed memory of its own: it lives outside the graph arena (state, results)."""
    t.bind(np.full(max(t.nbytes(), 1), 0, dtype=np.uint8))
    if fill:
        t.array()[...] = fill
    return t


class OptContext:
    """ggml_opt_context: one model graph with its loss, gradients and optimizer step."""

    def __init__(self, params: OptParams) -> None:
        if params.opt_period < 1:
            raise ValueError("opt_period must be at least 1")
        self.params = params
        self.ctx = params.ctx_compute
        self.inputs, self.outputs = params.inputs, params.outputs
        self.opt_period = params.opt_period
        self.optimizer = params.optimizer
        self.rng = np.random.default_rng(params.seed)
        self.backend = CpuBackend(params.n_threads)
        self.iter = 1   # optimizer steps taken + 1 (AdamW's bias correction)
        self.opt_i = 0  # physical batch within the current optimizer step
        self.grad_accs: dict[int, Tensor] = {}
        self.momenta: dict[int, tuple[Tensor, Tensor]] = {}
        self.opt_step_params: Tensor | None = None
        self._graph: Graph | None = None
        self._build()

    # -- building ------------------------------------------------------------------------
    def _build(self) -> None:
        ctx, p = self.ctx, self.params
        if not self.inputs.has_data:
            _own_memory(self.inputs)
        self.inputs.set_input()
        self.outputs.set_output()
        self.labels = None
        self.loss_per_datapoint = p.loss_type != LossType.SUM
        n_out = self.outputs.nelements()
        if p.loss_type in (LossType.MEAN, LossType.SUM):
            loss = O.sum(ctx, self.outputs)
            if p.loss_type == LossType.MEAN:
                loss = O.scale(ctx, loss, 1.0 / (self.opt_period * n_out))
        else:
            self.labels = _own_memory(ctx.new_tensor(GGMLType.F32, self.outputs.ne, "labels")).set_input()
            if p.loss_type == LossType.CROSS_ENTROPY:
                loss = OT.cross_entropy_loss(ctx, self.outputs, self.labels)
                if self.opt_period > 1:
                    loss = O.scale(ctx, loss, 1.0 / self.opt_period)
            else:
                diff = O.sub(ctx, self.outputs, self.labels)
                loss = O.scale(ctx, O.sum(ctx, O.sqr(ctx, diff)), 1.0 / (self.opt_period * n_out))
        self.loss = _own_memory(loss).set_output().set_loss().set_name("loss")
        results = [self.loss]
        self.pred = self.ncorrect = None
        if p.loss_type == LossType.CROSS_ENTROPY:
            self.pred = _own_memory(O.argmax(ctx, self.outputs)).set_output().set_name("pred")
            self.ncorrect = _own_memory(O.count_equal(ctx, self.pred, O.argmax(ctx, self.labels))).set_output()
            results += [self.pred, self.ncorrect]

        self.gf = new_graph(*results)
        self.gb_grad = self.gb_opt = None
        if p.build_type == BuildType.FORWARD:
            self._allocate(self.gf)
            return
        self.params_trained = [t for t in self.gf.nodes if t.flags & Flag.PARAM]
        if not self.params_trained:
            raise ValueError("opt: no tensor of the model graph is flagged param")
        accumulate = p.build_type == BuildType.GRAD or self.opt_period > 1
        if accumulate:
            self.grad_accs = {id(t): _own_memory(ctx.new_tensor(GGMLType.F32, t.ne, f"{t.name} grad acc"))
                              for t in self.params_trained}
        self.gb_grad = self.gf.copy()
        build_backward_expand(ctx, self.gb_grad, self.grad_accs)
        if p.build_type == BuildType.GRAD:
            self._allocate(self.gb_grad)
            return

        self.gb_opt = self.gb_grad.copy()
        adamw = self.optimizer == OptimizerType.ADAMW
        n_pars = OT.ADAMW_PARAMS if adamw else OT.SGD_PARAMS
        self.opt_step_params = _own_memory(ctx.new_tensor_1d(GGMLType.F32, n_pars, f"{self.optimizer.value} params"))
        for t in self.params_trained:
            grad = self.gb_opt.get_grad(t)
            if grad is None:
                continue
            if adamw:
                m = _own_memory(ctx.new_tensor(GGMLType.F32, t.ne, f"AdamW m for {t.name}"))
                v = _own_memory(ctx.new_tensor(GGMLType.F32, t.ne, f"AdamW v for {t.name}"))
                self.momenta[id(t)] = (m, v)
                step = OT.opt_step_adamw(ctx, t, grad, m, v, self.opt_step_params)
            else:
                step = OT.opt_step_sgd(ctx, t, grad, self.opt_step_params)
            self.gb_opt.visit(step.set_name(f"{self.optimizer.value} step for {t.name}"))
        self._allocate(self.gb_opt)

    def _allocate(self, largest: Graph) -> None:
        """One plan for the largest graph: the smaller ones are its prefixes."""
        self.allocator = GraphAllocator()
        self.allocator.alloc_graph(largest)

    @property
    def batch_size(self) -> int:
        """Datapoints per physical batch (what the progress counter counts in)."""
        return self.inputs.ne[1]

    # -- state ------------------------------------------------------------------------------
    def optimizer_state(self) -> list[Tensor]:
        """The tensors the optimizer keeps between steps (AdamW: m and v per param; SGD: none)."""
        return [t for pair in self.momenta.values() for t in pair]

    def grad_acc(self, t: Tensor) -> Tensor | None:
        return self.grad_accs.get(id(t))

    def reset(self, optimizer: bool) -> None:
        """Zero accumulated gradients; with `optimizer`, also the momenta and the step count."""
        for acc in self.grad_accs.values():
            acc.array()[...] = 0
        self.opt_i = 0
        if optimizer:
            for m, v in self.momenta.values():
                m.array()[...] = 0
                v.array()[...] = 0
            self.iter = 1

    # -- evaluation ---------------------------------------------------------------------------
    def alloc(self, backward: bool) -> None:
        """Choose the graph for the next eval (ggml_opt_alloc): forward only, or with gradients,
        and with the optimizer step when this physical batch ends an accumulation period."""
        if backward and self.gb_grad is None:
            raise ValueError("opt: this context was built for forward passes only")
        if backward and self.opt_i == 0:
            for acc in self.grad_accs.values():
                acc.array()[...] = 0
        if not backward:
            self._graph = self.gf
        elif (self.opt_i + 1) % self.opt_period == 0 and self.gb_opt is not None:
            self._graph = self.gb_opt
        else:
            self._graph = self.gb_grad

    def eval(self, result: Result | None) -> None:
        """Compute the chosen graph and record loss, predictions and correct count (ggml_opt_eval)."""
        graph = self._graph
        if graph is None:
            raise RuntimeError("opt: call alloc() before eval()")
        if graph is self.gb_opt:
            self._set_step_params()
        self.backend.compute(graph)
        if graph is not self.gf:
            self.iter += graph is self.gb_opt
            self.opt_i = (self.opt_i + 1) % self.opt_period
        self._graph = None
        if result is not None:
            has_acc = self.pred is not None
            result.add_batch(self.outputs.ne[1], float(self.loss.array().reshape(-1)[0]),
                             self.pred.array().reshape(-1) if has_acc else (),
                             int(self.ncorrect.array().reshape(-1)[0]) if has_acc else None,
                             self.opt_period, self.loss_per_datapoint)

    def _set_step_params(self) -> None:
        pars = self.params.get_opt_pars(self.params.get_opt_pars_ud)
        write_step_params(self.opt_step_params, self.optimizer, pars, self.iter)


def write_step_params(params: Tensor, optimizer: OptimizerType, pars: OptimizerParams, iteration: int) -> None:
    """Fill an opt_step_* params tensor for step `iteration` (1-based: AdamW's bias correction)."""
    values = params.array().reshape(-1)
    if optimizer == OptimizerType.ADAMW:
        a = pars.adamw
        if not (a.alpha > 0 and 0 <= a.beta1 <= 1 and 0 <= a.beta2 <= 1 and a.eps >= 0 and 0 <= a.wd <= 1):
            raise ValueError(f"opt: invalid AdamW parameters {a}")
        beta1h = 1.0 / (1.0 - np.float32(a.beta1) ** iteration)
        beta2h = 1.0 / (1.0 - np.float32(a.beta2) ** iteration)
        values[:] = (a.alpha, a.beta1, a.beta2, a.eps, a.wd, beta1h, beta2h)
    else:
        s = pars.sgd
        if not (s.alpha > 0 and 0 <= s.wd <= 1):
            raise ValueError(f"opt: invalid SGD parameters {s}")
        values[:] = (s.alpha, s.wd)


def opt_init(params: OptParams) -> OptContext:
    return OptContext(params)


# ---- epochs and fit ------------------------------------------------------------------------------
EpochCallback = Callable[[bool, OptContext, Dataset, Result, int, int, float], None]


def opt_epoch(opt_ctx: OptContext, dataset: Dataset, result_train: Result | None, result_eval: Result | None,
              idata_split: int, callback_train: EpochCallback | None = None,
              callback_eval: EpochCallback | None = None) -> None:
    """Train on datapoints [0, idata_split), then evaluate on the rest (ggml_opt_epoch)."""
    batch = opt_ctx.inputs.ne[1]
    ndata = dataset.ndata
    if ndata % batch:
        raise ValueError(f"opt: {ndata} datapoints do not divide into batches of {batch}")
    idata_split = ndata if idata_split < 0 else idata_split
    if idata_split % batch:
        raise ValueError(f"opt: the split at {idata_split} is not a multiple of the batch size {batch}")
    nbatches, ibatch_split = ndata // batch, idata_split // batch
    t_start = time.perf_counter()
    for ibatch in range(ibatch_split):
        opt_ctx.alloc(backward=True)
        dataset.get_batch(opt_ctx.inputs, opt_ctx.labels, ibatch)
        opt_ctx.eval(result_train)
        if callback_train:
            callback_train(True, opt_ctx, dataset, result_train, ibatch + 1, ibatch_split, t_start)
    t_start = time.perf_counter()
    for ibatch in range(ibatch_split, nbatches):
        opt_ctx.alloc(backward=False)
        dataset.get_batch(opt_ctx.inputs, opt_ctx.labels, ibatch)
        opt_ctx.eval(result_eval)
        if callback_eval:
            callback_eval(False, opt_ctx, dataset, result_eval, ibatch + 1 - ibatch_split, nbatches - ibatch_split, t_start)


_BLOCKS = " ▏▎▍▌▋▊▉█"


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600:02d}:{s // 60 % 60:02d}:{s % 60:02d}"


def progress_bar(train: bool, opt_ctx: OptContext, dataset: Dataset, result: Result, ibatch: int,
                 ibatch_max: int, t_start: float, stream: TextIO | None = None) -> None:
    """ggml's progress line: 8 cells of eighths, data counter, loss±, accuracy±, time and ETA."""
    stream = stream or sys.stderr
    cells = []
    for j in range(8):
        level = 0
        for eighth in range(8, 0, -1):
            if ibatch_max * (8 * j + eighth) // 8 < 8 * ibatch:
                level = eighth
                break
        cells.append(_BLOCKS[level])
    batch = opt_ctx.batch_size
    loss, loss_unc = result.loss()
    acc, acc_unc = result.accuracy()
    elapsed = time.perf_counter() - t_start
    eta = elapsed * (ibatch_max - ibatch) / ibatch
    stream.write(f"{'train: ' if train else 'val:   '}[{''.join(cells)}] data={ibatch * batch:07d}/{ibatch_max * batch:07d} "
                 f"loss={loss:.5f}±{loss_unc:.5f} acc={100 * acc:.2f}±{100 * acc_unc:.2f}% "
                 f"t={_hms(elapsed)} ETA={_hms(eta)} \r")
    if ibatch == ibatch_max:
        stream.write("\n")
    stream.flush()


@dataclass
class FitState:
    """Passed to `get_opt_pars` by opt_fit, so a schedule can depend on the epoch."""

    epoch: int = 1
    nepoch: int = 1


@dataclass
class EpochResult:
    epoch: int
    train: Result
    val: Result


def opt_fit(ctx_compute: Context, inputs: Tensor, outputs: Tensor, dataset: Dataset,
            loss_type: LossType = LossType.MEAN, optimizer: OptimizerType = OptimizerType.ADAMW,
            get_opt_pars: GetOptPars = default_optimizer_params, nepoch: int = 1, nbatch_logical: int | None = None,
            val_split: float = 0.0, silent: bool = False, seed: int = 0, n_threads: int | None = None,
            callback_train: EpochCallback | None = None, callback_eval: EpochCallback | None = None,
            stream: TextIO | None = None) -> list[EpochResult]:
    """Train for `nepoch` epochs with a validation split (ggml_opt_fit); returns per-epoch results.

    `nbatch_logical` datapoints make one optimizer step; the batch dimension of `inputs`
    is the physical batch, and gradients accumulate over the difference. The data is
    shuffled once (train and validation) and the training part again every epoch.
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
    nbatches_logical = ndata // nbatch_logical
    ibatch_split = int((1.0 - val_split) * nbatches_logical) * opt_period
    idata_split = ibatch_split * nbatch_physical

    state = FitState(1, nepoch)
    opt_ctx = OptContext(OptParams(ctx_compute, inputs, outputs, loss_type, optimizer, BuildType.OPT, opt_period,
                                   get_opt_pars, state, n_threads, seed))
    if nbatch_logical < ndata:
        dataset.shuffle(opt_ctx.rng, -1)
    bar = None if silent else (lambda *a: progress_bar(*a, stream=stream))
    history = []
    for epoch in range(1, nepoch + 1):
        state.epoch = epoch
        if nbatch_logical < idata_split:
            dataset.shuffle(opt_ctx.rng, idata_split)
        train, val = Result(), Result()
        if not silent:
            stream.write(f"opt_fit: epoch {epoch:04d}/{nepoch:04d}:\n")
        opt_epoch(opt_ctx, dataset, train, val, idata_split, callback_train or bar, callback_eval or bar)
        if not silent:
            stream.write("\n")
        history.append(EpochResult(epoch, train, val))
    if not silent:
        stream.write(f"opt_fit: training took {_hms(time.perf_counter() - t0)}\n")
    return history
