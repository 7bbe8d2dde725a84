"""Training a language model on token windows, on ggmlpy's optimizer (the engine behind
Context.opt_init / opt_epoch / opt_fit).

ggmlpy's `OptContext` owns the optimizer (accumulators, state, steps) and evaluation, and
its `TrainingLoop` the epochs and optimizer steps, which run each window through
`Trainer.run_batch` (this trainer is the context's BatchFeeder); fit.py is the loop's hooks. What is specific to a language model is
here: a window of n_ctx_train tokens is one datapoint, computed in ubatches of n_ubatch
tokens, and the gradient of a window does not depend on n_ubatch: a later ubatch attends
to the keys and values of earlier ones, so its loss has a gradient with respect to them,
and that gradient is carried back. One optimizer step covers n_batch tokens (whole windows).

For a window cut into ubatches u = 0..U-1:
1. forward u = 0..U-2, keeping each one's K and V (F32, every layer) in a window store;
2. backward u = U-1..0: ubatch u's graph recomputes its forward from its tokens and the
   stored K/V of the ubatches before it (graph inputs that receive gradients), adds
   sum(K_u * dK_u) + sum(V_u * dV_u) to its loss, where dK_u/dV_u are the gradients
   later ubatches sent to u's keys and values, and backpropagates. Param gradients add
   up in the optimizer's accumulators; the K/V-input gradients add into dK/dV of the
   earlier cells. By the chain rule the accumulators then hold the exact gradient of
   the window's mean cross-entropy (llama.cpp instead drops those gradients and warns).
With n_ubatch = n_ctx_train a window is one graph and step 1 is empty.

Labels are token ids, IGNORE (-1) where a prediction does not count (prompts, padding);
the graph's cross-entropy takes them as ids with a weight per position (0 where ignored),
never as [n_vocab x n_tokens] one-hot rows, so those positions add no loss and get no
gradient. The output layer is part of the loss (ggmlpy's linear_cross_entropy): logits and
their gradient are made a chunk of the vocabulary at a time, never [n_vocab x n_tokens]. The loss of an optimizer step is the mean over the positions
that count in all its windows (every rank's): the graph's constant loss scale makes it
the mean over all positions, and each counted row is weighted by positions / counted
(exactly 1 when every position counts, as in plain text).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

import ggmlpy as gg
from ggmlpy import GGMLType, Tensor
from ggmlpy.opt import (
    Dataset,
    FitPosition,
    OptContext,
    OptParams,
    Result,
    TrainingDivergedError,
    train_batches,
)

from .arch.base import FIXED_TENSORS
from .batch import UBatch
from .checkpoint import RunParams, data_fingerprint
from .dataset import IGNORE, counted_labels, one_sequence, window_layout
from .errors import InputError
from .graph_builder import GraphBuilder, WindowCells
from .train_params import TrainParams

__all__ = ["Trainer", "TrainingDivergedError"]


class UbatchGraph:
    """The training graph of one ubatch position in a window (n_prev tokens before it):
    the model's forward over a WindowInput, the loss, and its ggmlpy TrainGraph."""

    def __init__(self, opt: OptContext, model, n_prev: int, n_tokens: int, inject: bool, loss_scale: float,
                 adapters=(), grad_checkpoint: bool = False, checkpoint_every: int | None = None,
                 allocator: gg.GraphAllocator | None = None, backward_bf16: bool = False) -> None:
        b = self.builder = GraphBuilder.for_window(model, n_prev, n_tokens, adapters)
        c, attn = b.ctx, b.attn
        logits = model.arch.build(b, model)
        # the next-token ids (IGNORE: no loss, and equal to no prediction in the accuracy)
        # and each position's weight in the step's mean (0 where ignored)
        self.label_ids = c.new_tensor_1d(GGMLType.I32, n_tokens, "label_ids").set_input()
        self.label_weights = c.new_tensor_1d(GGMLType.F32, n_tokens, "label_weights").set_input()
        if b.head is not None:  # the output layer, loss and predictions a chunk of the vocabulary at a time
            loss, pred = gg.linear_cross_entropy_loss(c, *b.head, self.label_ids, self.label_weights,
                                                      skip_ignored=True)  # masked positions cost nothing
        else:  # logits the architecture built itself
            loss, pred = gg.cross_entropy_loss(c, logits, self.label_ids, self.label_weights), gg.argmax(c, logits)
        loss = gg.scale(c, loss, loss_scale)
        ncorrect = gg.count_equal(c, pred, self.label_ids)
        objective = loss
        self.grad_k: list[Tensor] = []
        self.grad_v: list[Tensor] = []
        if inject:  # the gradients later ubatches sent to this one's K and V
            for cur, grads in ((attn.k_cur, self.grad_k), (attn.v_cur, self.grad_v)):
                for il, t in enumerate(cur):
                    g = c.new_tensor(GGMLType.F32, t.ne[:3], f"grad_in.{il}").set_input()
                    grads.append(g)
                    objective = gg.add(c, objective, gg.sum(c, gg.mul(c, t, g)))
        checkpoints = None
        self.checkpoint_every = 0  # keep every k-th layer boundary (0: no gradient checkpointing)
        if grad_checkpoint:
            if not b.boundaries:
                raise InputError(f"gradient checkpointing: the {model.arch.name} graph marks no layer boundaries")
            k = self.checkpoint_every = checkpoint_every or gg.checkpoint_stride(gg.new_graph(objective), b.boundaries)
            # the residual stream at every k-th layer boundary; and what the loss reads first in
            # the backward pass: the output layer's input (the fused head recomputes its logits
            # a chunk at a time) or, for logits an architecture builds itself, the logits
            checkpoints = b.boundaries[::k] + [b.head[1] if b.head is not None else logits]
        self.train = opt.train_graph(c, objective, loss, inputs=b.inp_tokens, pred=pred, ncorrect=ncorrect,
                                     outputs=attn.k_cur + attn.v_cur, loss_scale=loss_scale, checkpoints=checkpoints,
                                     allocator=allocator)
        if backward_bf16 and self.train.backward is not None:  # TrainParams.backward_bf16
            gg.set_backward_prec(self.train.backward.nodes, gg.Prec.BF16)

    def kv_prev_grads(self, il: int) -> tuple[np.ndarray, np.ndarray]:
        """The gradients this ubatch's backward sent to the earlier K and V of layer il."""
        g, attn = self.train.backward, self.builder.attn
        return g.get_grad(attn.k_prev[il]).array()[0], g.get_grad(attn.v_prev[il]).array()[0]


class Trainer:
    """The trainable tensors and a ggmlpy OptContext fed with token windows (its BatchFeeder)."""

    datapoints_per_batch = 1  # a physical batch is one window

    def __init__(self, lctx, params: TrainParams, adapter=None, comm=None) -> None:
        self.lctx, self.params = lctx, params
        self.adapter = adapter  # the LoRA adapter opt_init made for params.lora, if any
        model = self.model = lctx.model
        self.n_ctx = params.n_ctx_train or lctx.n_ctx
        self.n_ubatch = min(lctx.n_ubatch, self.n_ctx)
        self.n_batch = lctx.n_batch
        if self.n_ctx % self.n_ubatch:
            raise InputError(f"training: n_ubatch {self.n_ubatch} must divide the window n_ctx {self.n_ctx}")
        if self.n_batch % self.n_ctx:
            raise InputError(f"training: n_batch {self.n_batch} (tokens per optimizer step) must be a multiple "
                             f"of the window n_ctx {self.n_ctx}")
        self.windows_per_step = self.n_batch // self.n_ctx
        self.evals_per_batch = self.n_ctx // self.n_ubatch
        self.trained = self._select_params(params.param_filter)
        bf16 = params.backward_bf16
        self.backward_bf16 = lctx.backend.bf16_dot_products if bf16 is None else bf16
        self.steps_per_epoch = 1  # set from the dataset's split by Context.opt_epoch / opt_fit (schedules)
        self.opt = OptContext(OptParams(
            optimizer=params.optimizer_params(0, 1), opt_period=self.n_batch // self.n_ubatch,
            get_opt_pars=self._step_params, grad_clip=params.grad_clip,
            params=list(self.trained.values()), keep_last_good=True, backend=lctx.backend, feeder=self, comm=comm))
        self.comm = self.opt.comm
        self.run = RunState()
        self.timing = TrainTiming()
        self.label_weight = 1.0  # of a counted position in the step being trained (begin_step)
        self._t_last: float | None = None  # when the last training window ended (None: none yet in this run)
        self._graphs: dict[tuple[int, bool], UbatchGraph] = {}
        # a window's ubatch graphs run one after another and their results are copied out
        # at once (K/V stores, losses): they share one arena, as large as the largest plan
        self._allocator = gg.GraphAllocator()
        hp = model.hparams
        self._kv_shape = (hp.n_layer, self.n_ctx, hp.n_head_kv, hp.n_embd_head_k)
        self._vv_shape = (hp.n_layer, self.n_ctx, hp.n_head_kv, hp.n_embd_head_v)

    def _select_params(self, param_filter) -> dict[str, Tensor]:
        """The model's tensors and those of attached LoRA adapters that the filter picks."""
        candidates = dict(self.model.tensors)
        for adapter, _ in self.lctx.adapters:
            candidates.update(adapter.named_tensors())
        chosen = {}
        for name, t in candidates.items():
            if name in FIXED_TENSORS or not param_filter(name, t):
                continue
            if t.type != GGMLType.F32:
                raise InputError(f"training: tensor {name} is {t.type.name}; only F32 tensors train directly")
            if not t.array().flags.writeable:
                t.bind(np.array(t.array()).reshape(-1).view(np.uint8))  # a writable copy of the mapped weights
            chosen[name] = t.set_param()
        if not chosen:
            raise InputError("training: the parameter filter selected no tensor")
        return chosen

    def _step_params(self):
        """The optimizer's hyper-parameters for the step about to be taken (the schedule's)."""
        return self.params.optimizer_params(self.opt.optimizer.state.n_steps, self.steps_per_epoch)

    @property
    def n_steps(self) -> int:
        """Optimizer steps taken (restored from a checkpoint on resume)."""
        return self.opt.optimizer.state.n_steps

    def set_split(self, dataset: Dataset, idata_split: int) -> None:
        """Train on `dataset`'s windows [0, idata_split): fixes the steps per epoch (schedules)."""
        self.check_dataset(dataset)
        n_train, per_step, _, _ = train_batches(self.opt, dataset, idata_split)
        self.steps_per_epoch = max(1, n_train // per_step)
        self.run = RunState(dataset, idata_split, n_train, pending=self.run.pending)  # a new run; a loaded checkpoint waits

    def describe_params(self, shuffle_seed: int | None) -> RunParams:
        """The run's training parameters as a checkpoint records them."""
        return RunParams(train=self.params, n_ctx=self.n_ctx, n_batch=self.n_batch * self.comm.size,  # all ranks
                         n_ubatch=self.n_ubatch, trained=[(n, tuple(t.ne)) for n, t in self.trained.items()],
                         shuffle_seed=shuffle_seed)

    @property
    def optimizer_state(self) -> list[Tensor]:
        return self.opt.optimizer_state()

    def grad(self, name: str) -> np.ndarray:
        """The accumulated gradient of trained tensor `name` (numpy shape of the tensor)."""
        return self.opt.optimizer.grad(self.trained[name]).numpy()

    def begin_step(self, dataset: Dataset, batches: range) -> None:
        """Weigh the counted positions of the optimizer step over `batches` (every rank's
        windows) so that its loss is their mean (ggmlpy's BatchFeeder)."""
        n_counted = sum(counted_labels(dataset, i) for i in batches)
        self.label_weight = len(batches) * self.n_ctx / n_counted if n_counted else 1.0

    def check_dataset(self, dataset: Dataset) -> None:
        if dataset.ne_datapoint != self.n_ctx:
            raise InputError(f"training: dataset windows have {dataset.ne_datapoint} tokens, the trainer uses {self.n_ctx}")

    def memory_plan(self) -> dict[str, int]:
        """Bytes the run will hold, known before the first step, each counted once: the
        model's frozen weights (mapped from the file), the trained tensors, their gradients
        and optimizer state, the arena a window's ubatch graphs share (built here, as
        the first window would build them) and the window's K/V stores and their gradients."""
        U = self.n_ctx // self.n_ubatch
        graphs = [self._graph(u * self.n_ubatch, u < U - 1) for u in range(U)]
        trained = {id(t) for t in self.trained.values()}
        optimizer = self.opt.optimizer
        return {
            "weights": sum(t.nbytes() for t in self.model.tensors.values() if id(t) not in trained),
            "trained": sum(t.nbytes() for t in self.trained.values()),
            "gradients": optimizer.grad_flat.nbytes,
            "optimizer state": sum(t.nbytes() for t in optimizer.state.tensors()),
            "graph arenas": sum({id(a): a.arena.nbytes for a in (g.train.allocator for g in graphs)}.values()),
            # stores written only when a window spans several ubatches
            "window K/V": 4 * 2 * (int(np.prod(self._kv_shape)) + int(np.prod(self._vv_shape))) if U > 1 else 0,
        }

    def checkpoint_strides(self) -> list[int]:
        """With gradient checkpointing, the strides k (every k-th layer boundary kept) the
        ubatch graphs built so far chose (memory_plan builds a window's graphs)."""
        return sorted({g.checkpoint_every for g in self._graphs.values() if g.checkpoint_every})

    # -- graphs ------------------------------------------------------------------------------
    def _graph(self, n_prev: int, inject: bool) -> UbatchGraph:
        key = (n_prev, inject)
        if key not in self._graphs:
            self._graphs[key] = UbatchGraph(self.opt, self.model, n_prev, self.n_ubatch, inject,
                                            self.opt.loss_scale, self.lctx.adapters, self.params.grad_checkpoint,
                                            self.params.grad_checkpoint_every, self._allocator,
                                            self.backward_bf16)
        return self._graphs[key]

    def _eval(self, g: UbatchGraph, backward: bool, window: tuple[np.ndarray, ...], u: int, label_weight: float,
              k_store: np.ndarray, v_store: np.ndarray, result: Result | None) -> float:
        """Evaluate ubatch u of `window` (tokens, labels, positions, sequences), the earlier
        ubatches' K/V read from the stores; counted positions' one-hot rows weigh label_weight."""
        tokens, labels, pos, seq = window
        n = self.n_ubatch
        rows = slice(u * n, (u + 1) * n)
        ub = UBatch(tokens[rows], pos[rows], seq[rows], np.ones(n, bool), np.arange(n), n, 1, 0)
        g.builder.set_inputs(ub, WindowCells(pos[:(u + 1) * n], seq[:(u + 1) * n]))
        ids = labels[rows]
        counted = ids != IGNORE
        g.label_ids.array().reshape(-1)[:] = ids
        np.copyto(g.label_weights.array().reshape(-1), np.where(counted, np.float32(label_weight), np.float32(0.0)))
        attn = g.builder.attn
        for il in range(len(attn.k_prev)):
            attn.k_prev[il].array()[0] = k_store[il, :u * n]
            attn.v_prev[il].array()[0] = v_store[il, :u * n]
        self.opt.alloc(backward, g.train)
        return self.opt.eval(result, counted, label_weight)

    # -- one window ----------------------------------------------------------------------------
    def window(self, tokens: np.ndarray, labels: np.ndarray, train: bool, result: Result | None = None,
               tick: Callable[[], None] | None = None,
               layout: tuple[np.ndarray, np.ndarray] | None = None) -> list[float]:
        """Forward one window (with `train`, backward too: its gradients add into the
        optimizer's accumulators, its counted positions weighted as begin_step set for the
        step); returns the ubatch losses (means over their counted positions, NaN where
        none counts), in evaluation order. `layout`: each token's position and sequence
        (packed samples); one sequence from position 0 when None."""
        U, n = self.n_ctx // self.n_ubatch, self.n_ubatch
        pos, seq = layout if layout is not None else one_sequence(self.n_ctx)
        win = (tokens, labels, pos, seq)
        label_weight = self.label_weight if train else 1.0
        k_store = np.zeros(self._kv_shape, np.float32)
        v_store = np.zeros(self._vv_shape, np.float32)
        losses = []
        for u in range(U - 1 if train else U):
            g = self._graph(u * n, u < U - 1)
            loss = self._eval(g, False, win, u, label_weight, k_store, v_store, None if train else result)
            for il, (k, v) in enumerate(zip(g.builder.attn.k_cur, g.builder.attn.v_cur)):
                k_store[il, u * n:(u + 1) * n] = k.array()[0]
                v_store[il, u * n:(u + 1) * n] = v.array()[0]
            if not train:
                losses.append(loss)
                if tick:
                    tick()
        if not train:
            return losses
        dk = np.zeros_like(k_store)
        dv = np.zeros_like(v_store)
        for u in reversed(range(U)):
            g = self._graph(u * n, u < U - 1)
            for il, t in enumerate(g.grad_k):
                t.array()[0] = dk[il, u * n:(u + 1) * n]
                g.grad_v[il].array()[0] = dv[il, u * n:(u + 1) * n]
            losses.append(self._eval(g, True, win, u, label_weight, k_store, v_store, result))
            for il in range(len(g.builder.attn.k_prev)):
                gk, gv = g.kv_prev_grads(il)
                dk[il, :u * n] += gk
                dv[il, :u * n] += gv
            if tick:
                tick()
        return losses

    # -- ggmlpy's BatchFeeder ------------------------------------------------------------------
    def run_batch(self, dataset: Dataset, ibatch: int, train: bool, result: Result | None,
                  tick: Callable[[], None]) -> None:
        tokens, labels = dataset.datapoint(ibatch)
        if train and (ibatch == 0 or self._t_last is None):  # an epoch's start, or a run resumed mid-epoch
            self._t_last = time.perf_counter()
        self.window(tokens, labels, train, result, tick, window_layout(dataset, ibatch))
        if train:  # the time since the last window ended: this window and the step before it
            now = time.perf_counter()
            self.timing.add_window(self.n_ctx, now - self._t_last)
            self._t_last = now


@dataclass
class RunState:
    """Where a fit stands, for checkpoints: the data and split it trains on, the shuffle RNG,
    the position after the last optimizer step and the epoch's training result so far."""

    dataset: Dataset | None = None
    idata_split: int = -1
    n_train_batches: int = 0      # training batches of an epoch (whole optimizer steps)
    rng: np.random.Generator | None = None
    shuffle_seed: int | None = None
    position: FitPosition = field(default_factory=FitPosition)
    epoch_result: Result = field(default_factory=Result)
    pending: tuple | None = None  # (path, Checkpoint) loaded by opt_load_checkpoint, applied by the next fit
    _data_fingerprint: str | None = None

    def data_fingerprint(self) -> str:
        """The checkpoints' fingerprint of the windows and split (hashed once per split)."""
        if self._data_fingerprint is None:
            self._data_fingerprint = data_fingerprint(self.dataset, self.idata_split) if self.dataset is not None else ""
        return self._data_fingerprint


class TrainTiming:
    """Where training time goes: the first window (building and planning its graphs, loading
    their kernels) apart from the rest, whose tokens/s is the trainer's speed."""

    def __init__(self) -> None:
        self.startup_seconds = 0.0
        self.tokens = 0
        self.seconds = 0.0
        self._first = True

    def add_window(self, tokens: int, seconds: float) -> None:
        if self._first:
            self.startup_seconds, self._first = seconds, False
        else:
            self.tokens += tokens
            self.seconds += seconds

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")
