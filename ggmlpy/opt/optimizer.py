"""Optimizers: their hyper-parameters as checked records (`AdamW`, `SGD`: defined once,
here), their state as an explicit object that checkpoints save and load, and `Optimizer`,
which keeps a set of params' gradient accumulators and applies the step as a graph of
`opt_step_*` ops whose hyper-parameters are a host-filled tensor (so schedules change
values without rebuilding anything). It computes on any `Backend`."""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Literal

import numpy as np
from pydantic import Field

from .. import ops_train as OT
from ..backend import Backend
from ..context import Context
from ..graph import new_graph
from ..records import Float, Record
from ..tensor import Tensor
from ..types import GGMLType


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

    def __init__(self, params: Sequence[Tensor], hparams: AdamW | SGD, backend: Backend,
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
