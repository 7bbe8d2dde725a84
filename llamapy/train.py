"""Training a model on token windows: the engine behind Context.opt_init / opt_epoch / opt_fit.

One optimizer step covers n_batch tokens (whole windows of n_ctx_train tokens); each
window is computed in ubatches of n_ubatch tokens. The gradient of a window does not
depend on n_ubatch: a later ubatch attends to the keys and values of earlier ones, so
its loss has a gradient with respect to them, and that gradient is carried back.

For a window cut into ubatches u = 0..U-1:
1. forward u = 0..U-2, keeping each one's K and V (F32, every layer) in a window store;
2. backward u = U-1..0: ubatch u's graph recomputes its forward from its tokens and the
   stored K/V of the ubatches before it (graph inputs that receive gradients), adds
   sum(K_u * dK_u) + sum(V_u * dV_u) to its loss, where dK_u/dV_u are the gradients
   later ubatches sent to u's keys and values, and backpropagates. Param gradients add
   up in per-param accumulators; the K/V-input gradients add into dK/dV of the earlier
   cells. By the chain rule the accumulators then hold the exact gradient of the
   window's mean cross-entropy (llama.cpp instead drops those gradients and warns).
With n_ubatch = n_ctx_train a window is one graph and step 1 is empty.
"""
from __future__ import annotations

import math
import time

import numpy as np

import ggmlpy as gg
from ggmlpy import GGMLType, GraphAllocator, Tensor
from ggmlpy.opt import (
    Dataset,
    EpochCallback,
    OptimizerParams,
    OptimizerType,
    Result,
    write_step_params,
)

from .errors import InputError, LlamapyError
from .graph_builder import GraphBuilder, GraphShape
from .opt import AdamW, TrainParams


class TrainingDivergedError(LlamapyError):
    """The loss became NaN or infinite; the weights are those of the last good step."""


class TrainGraphBuilder(GraphBuilder):
    """A ubatch graph for training: attention over the window's earlier K/V (graph inputs
    with gradients) and this ubatch's own, with no KV cache; logits for every token."""

    def __init__(self, model, n_prev: int, n_tokens: int, adapters=()) -> None:
        self.model, self.hp = model, model.hparams
        self.adapters = tuple(adapters)
        self.flash_attn = False
        self.kv = None
        self.shape = GraphShape(n_tokens, n_tokens, 1, 0, (n_prev + n_tokens,), n_tokens)
        self.n_prev = n_prev
        self.ctx = gg.Context()
        self.graph = gg.Graph()
        c, hp = self.ctx, self.hp
        self.inp_tokens = c.new_tensor_1d(GGMLType.I32, n_tokens, "inp_tokens").set_input()
        self.inp_pos = c.new_tensor_1d(GGMLType.I32, n_tokens, "inp_pos").set_input()
        self.inp_out_ids = None
        self.inp_masks = {}
        self.k_prev: list[Tensor] = []
        self.v_prev: list[Tensor] = []
        self.k_cur: list[Tensor] = []
        self.v_cur: list[Tensor] = []
        for il in range(hp.n_layer):
            for name, store, dim in (("k", self.k_prev, hp.n_embd_head_k), ("v", self.v_prev, hp.n_embd_head_v)):
                if n_prev:
                    t = c.new_tensor_3d(GGMLType.F32, dim, hp.n_head_kv, n_prev, f"{name}_prev.{il}")
                    store.append(t.set_input().set_param())

    def attention(self, il: int, q: Tensor, k: Tensor, v: Tensor, kq_scale: float | None = None,
                  n_swa: int = 0) -> Tensor:
        c, hp, s = self.ctx, self.hp, self.shape
        self.k_cur.append(k)
        self.v_cur.append(v)
        if self.n_prev:
            k = gg.concat(c, self.k_prev[il], k, 2)
            v = gg.concat(c, self.v_prev[il], v, 2)
        hk, hv = hp.n_embd_head_k, hp.n_embd_head_v
        kview = gg.permute(c, k, 0, 2, 1, 3)                  # [head_dim, n_kv, n_head_kv]
        vview = gg.permute(c, v, 1, 2, 0, 3)                  # [n_kv, head_dim, n_head_kv]
        qv = gg.permute(c, q, 0, 2, 1, 3)                     # [head_dim, n_tokens, n_head]
        scale = 1.0 / math.sqrt(hk) if kq_scale is None else kq_scale
        kq = gg.soft_max_ext(c, gg.mul_mat(c, kview, qv), self.kq_mask(0, n_swa), scale, 0.0)
        kqv = gg.mul_mat(c, vview, kq)                        # [head_dim, n_tokens, n_head]
        return gg.cont(c, gg.permute(c, kqv, 0, 2, 1, 3), hv * hp.n_head, s.n_tokens)

    def fill_inputs(self, tokens: np.ndarray, pos0: int) -> None:
        n = self.shape.n_tokens
        self.inp_tokens.array().reshape(-1)[:] = tokens
        self.inp_pos.array().reshape(-1)[:] = pos0 + np.arange(n)
        kv_pos = pos0 - self.n_prev + np.arange(self.shape.n_kv[0])
        tok_pos = pos0 + np.arange(n)
        for (_, n_swa), mask in self.inp_masks.items():
            visible = kv_pos[None, :] <= tok_pos[:, None]
            if n_swa > 0:
                visible &= tok_pos[:, None] - kv_pos[None, :] < n_swa
            mask.array()[0, 0] = np.where(visible, np.float32(0), np.float32(-np.inf))

    def finish(self, logits: Tensor) -> Tensor:
        return logits.set_name("result_output")


class UbatchGraph:
    """Forward + backward graph of one ubatch position in the window, planned once.

    `forward` is the prefix of `full` that computes loss, predictions and this ubatch's
    K/V; both run in one allocation.
    """

    def __init__(self, model, n_prev: int, n_tokens: int, inject: bool, loss_scale: float,
                 grad_accs: dict[int, Tensor], adapters=()) -> None:
        b = self.builder = TrainGraphBuilder(model, n_prev, n_tokens, adapters)
        c = b.ctx
        logits = model.arch.build(b, model)
        n_vocab = model.hparams.n_vocab
        self.labels = c.new_tensor_2d(GGMLType.F32, n_vocab, n_tokens, "labels").set_input()
        self.loss = gg.scale(c, gg.cross_entropy_loss(c, logits, self.labels), loss_scale).set_output()
        self.pred = gg.argmax(c, logits).set_output()
        self.ncorrect = gg.count_equal(c, self.pred, gg.argmax(c, self.labels)).set_output()
        total = self.loss
        self.grad_k: list[Tensor] = []
        self.grad_v: list[Tensor] = []
        if inject:
            for cur, grads in ((b.k_cur, self.grad_k), (b.v_cur, self.grad_v)):
                for il, t in enumerate(cur):
                    g = c.new_tensor(GGMLType.F32, t.ne[:3], f"grad_in.{il}").set_input()
                    grads.append(g)
                    total = gg.add(c, total, gg.sum(c, gg.mul(c, t, g)))
        for t in b.k_cur + b.v_cur:
            t.set_output()
        total.set_loss()
        outputs = [total, self.pred, self.ncorrect] + b.k_cur + b.v_cur
        self.forward = gg.new_graph(*outputs)
        self.full = self.forward.copy()
        gg.build_backward_expand(c, self.full, grad_accs)
        self.allocator = GraphAllocator()
        self.allocator.alloc_graph(self.full)


class Trainer:
    """Trainable tensors, their gradient accumulators and optimizer state, and the graphs."""

    batch_size = 1  # the progress counter counts ubatches, as llama.cpp's does

    def __init__(self, lctx, params: TrainParams) -> None:
        self.lctx, self.params = lctx, params
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
        self.opt_period = self.n_batch // self.n_ubatch
        self.trained = self._select_params(params.param_filter)
        state = self._state = gg.Context(no_alloc=False)  # zeroed memory of their own, outside any arena
        self.grad_accs = {id(t): state.new_tensor(GGMLType.F32, t.ne, f"{name} grad") for name, t in self.trained.items()}
        self.momenta = {}
        adamw = isinstance(params.optimizer, AdamW)
        n_pars = gg.ADAMW_PARAMS if adamw else gg.SGD_PARAMS
        self.step_params = state.new_tensor_1d(GGMLType.F32, n_pars, "optimizer params")
        c = gg.Context()
        steps = []
        for name, t in self.trained.items():
            grad = self.grad_accs[id(t)]
            if adamw:
                m = state.new_tensor(GGMLType.F32, t.ne, f"AdamW m for {name}")
                v = state.new_tensor(GGMLType.F32, t.ne, f"AdamW v for {name}")
                self.momenta[id(t)] = (m, v)
                steps.append(gg.opt_step_adamw(c, t, grad, m, v, self.step_params))
            else:
                steps.append(gg.opt_step_sgd(c, t, grad, self.step_params))
        self.step_graph = gg.new_graph(*steps)
        self.iter = 1  # optimizer steps taken + 1 (AdamW bias correction)
        self.epoch = 0
        self.timing = TrainTiming()
        self._last_good: dict[str, np.ndarray] | None = None
        self._graphs: dict[tuple[int, bool], UbatchGraph] = {}
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
            if not param_filter(name, t):
                continue
            if t.type != GGMLType.F32:
                raise InputError(f"training: tensor {name} is {t.type.name}; only F32 tensors train directly")
            if not t.array().flags.writeable:
                t.bind(np.array(t.array()).reshape(-1).view(np.uint8))  # a writable copy of the mapped weights
            chosen[name] = t.set_param()
        if not chosen:
            raise InputError("training: the parameter filter selected no tensor")
        self.lctx._graphs.clear()  # inference graphs captured the old (memory-mapped) weights
        return chosen

    def release(self) -> None:
        """Unflag the params: the context can do inference (and warmup) again."""
        for t in self.trained.values():
            t.flags &= ~gg.Flag.PARAM

    @property
    def optimizer_state(self) -> list[Tensor]:
        return [t for pair in self.momenta.values() for t in pair]

    # -- graphs ------------------------------------------------------------------------------
    def _graph(self, n_prev: int, inject: bool) -> UbatchGraph:
        key = (n_prev, inject)
        if key not in self._graphs:
            self._graphs[key] = UbatchGraph(self.model, n_prev, self.n_ubatch, inject, 1.0 / self.opt_period,
                                            self.grad_accs, self.lctx.adapters)
        return self._graphs[key]

    def _run(self, g: UbatchGraph, graph: gg.Graph, tokens: np.ndarray, labels: np.ndarray, u: int,
             k_store: np.ndarray, v_store: np.ndarray) -> None:
        n = self.n_ubatch
        g.builder.fill_inputs(tokens[u * n:(u + 1) * n], u * n)
        onehot = g.labels.array()[0, 0]
        onehot.fill(0.0)
        onehot[np.arange(n), labels[u * n:(u + 1) * n]] = 1.0
        for il in range(len(g.builder.k_prev)):
            g.builder.k_prev[il].array()[0] = k_store[il, :u * n]
            g.builder.v_prev[il].array()[0] = v_store[il, :u * n]
        self.lctx.backend.compute(graph)

    def _record(self, g: UbatchGraph, result: Result | None) -> float:
        loss = float(g.loss.array().reshape(-1)[0])
        if result is not None:
            result.add_batch(self.n_ubatch, loss, g.pred.array().reshape(-1), int(g.ncorrect.array().reshape(-1)[0]),
                             self.opt_period, True)
        return loss

    # -- one window ----------------------------------------------------------------------------
    def window(self, tokens: np.ndarray, labels: np.ndarray, train: bool, result: Result | None,
               after_ubatch=None) -> list[float]:
        """Forward (and with `train`, backward) one window; returns the ubatch losses."""
        U = self.n_ctx // self.n_ubatch
        k_store = np.zeros(self._kv_shape, np.float32)
        v_store = np.zeros(self._vv_shape, np.float32)
        losses = []
        n = self.n_ubatch
        for u in range(U if not train else U - 1):
            g = self._graph(u * n, u < U - 1)
            self._run(g, g.forward, tokens, labels, u, k_store, v_store)
            for il in range(self.model.hparams.n_layer):
                k_store[il, u * n:(u + 1) * n] = g.builder.k_cur[il].array()[0]
                v_store[il, u * n:(u + 1) * n] = g.builder.v_cur[il].array()[0]
            if not train:
                losses.append(self._record(g, result))
                if after_ubatch:
                    after_ubatch()
        if not train:
            return losses
        dk = np.zeros_like(k_store)
        dv = np.zeros_like(v_store)
        for u in reversed(range(U)):
            g = self._graph(u * n, u < U - 1)
            for il, t in enumerate(g.grad_k):
                t.array()[0] = dk[il, u * n:(u + 1) * n]
                g.grad_v[il].array()[0] = dv[il, u * n:(u + 1) * n]
            self._run(g, g.full, tokens, labels, u, k_store, v_store)
            for il, t in enumerate(g.builder.k_prev):
                dk[il, :u * n] += g.full.get_grad(t).array()[0]
                dv[il, :u * n] += g.full.get_grad(g.builder.v_prev[il]).array()[0]
            losses.append(self._record(g, result))
            if after_ubatch:
                after_ubatch()
        return losses

    # -- optimizer -------------------------------------------------------------------------------
    def _keep_last_good(self) -> None:
        """Copy the weights before a step: if the next loss is not finite, they are the last good ones."""
        if self._last_good is None:
            self._last_good = {name: np.array(t.array()) for name, t in self.trained.items()}
        else:
            for name, t in self.trained.items():
                np.copyto(self._last_good[name], t.array())

    def _restore_last_good(self) -> None:
        if self._last_good is not None:
            for name, t in self.trained.items():
                np.copyto(t.array(), self._last_good[name])

    def zero_grads(self) -> None:
        for acc in self.grad_accs.values():
            acc.array()[...] = 0

    def step(self, pars: OptimizerParams) -> None:
        kind = OptimizerType.ADAMW if isinstance(self.params.optimizer, AdamW) else OptimizerType.SGD
        write_step_params(self.step_params, kind, pars, self.iter)
        self.lctx.backend.compute(self.step_graph)
        self.iter += 1

    def epoch_pass(self, dataset: Dataset, result_train: Result | None, result_eval: Result | None,
                   idata_split: int, callback_train: EpochCallback | None = None,
                   callback_eval: EpochCallback | None = None, get_opt_pars=None) -> None:
        """Train on windows [0, idata_split), evaluate on the rest (llama_opt_epoch)."""
        if dataset.data.shape[1] != self.n_ctx:
            raise InputError(f"training: dataset windows have {dataset.data.shape[1]} tokens, the trainer uses {self.n_ctx}")
        ndata = dataset.ndata
        idata_split = ndata if idata_split < 0 else idata_split
        n_train = idata_split - idata_split % self.windows_per_step
        per_window = self.n_ctx // self.n_ubatch
        get_opt_pars = get_opt_pars or (lambda: self.params.optimizer_params(self.epoch))
        for train, first, last, result, callback in ((True, 0, n_train, result_train, callback_train),
                                                      (False, idata_split, ndata, result_eval, callback_eval)):
            tick = _Progress(callback, train, self, dataset, result, (last - first) * per_window)
            step_losses = []
            for i in range(first, last):
                t0 = time.perf_counter()
                tokens, labels = dataset.datapoint(i)
                if train and not step_losses:
                    self.zero_grads()
                losses = self.window(tokens, labels, train, result, tick)
                if not train:
                    continue
                self.timing.add_window(self.n_ctx, time.perf_counter() - t0)
                step_losses += losses
                if len(step_losses) == self.opt_period:
                    if not all(math.isfinite(x) for x in step_losses):
                        self._restore_last_good()
                        raise TrainingDivergedError(
                            f"training: the loss became {sum(step_losses)} at optimizer step {self.iter}; "
                            "the weights are back to the last ones that gave a finite loss")
                    t0 = time.perf_counter()
                    self._keep_last_good()
                    self.step(get_opt_pars())
                    self.timing.add_step(time.perf_counter() - t0)
                    step_losses = []


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

    def add_step(self, seconds: float) -> None:
        self.seconds += seconds

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


class _Progress:
    """Calls an epoch callback after each ubatch with ggml's (ibatch, ibatch_max, t_start)."""

    def __init__(self, callback, train: bool, trainer, dataset, result, total: int) -> None:
        self.callback, self.train, self.trainer, self.dataset, self.result = callback, train, trainer, dataset, result
        self.total, self.count, self.t_start = total, 0, time.perf_counter()

    def __call__(self) -> None:
        self.count += 1
        if self.callback:
            self.callback(self.train, self.trainer, self.dataset, self.result, self.count, self.total, self.t_start)
