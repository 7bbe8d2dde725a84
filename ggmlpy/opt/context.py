"""The optimization context (ggml_opt_context): evaluates training graphs and takes
optimizer steps -- one static graph built from `inputs`/`outputs` and a loss type
(ggml_opt_fit's case), or graphs the caller builds per evaluation (a language model's
ubatches). A `BatchFeeder` says how a physical batch of the dataset is evaluated;
`OptContext` itself feeds its static graph. Over several ranks a step first sums the
gradients of every rank."""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Any, Protocol

import numpy as np

from .. import ops as O
from .. import ops_train as OT
from ..backend import Backend, default_backend
from ..context import Context
from ..distributed import as_communicator
from ..graph import new_graph
from ..tensor import Flag, Tensor
from ..types import GGMLType
from .dataset import Dataset
from .optimizer import SGD, AdamW, Optimizer
from .result import Result, weighted_mean
from .train_graph import TrainGraph


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
    backend: Backend | None = None
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
        self.backend = params.backend or default_backend(params.n_threads)
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
            result.steps.append(weighted_mean(*zip(*losses)))
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
