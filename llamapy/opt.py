"""Training parameters (pydantic models) and parameter filters: what trains, and how.

A parameter filter decides, per model tensor, whether it trains. Built-ins: every F32
tensor, tensors whose names match a pattern, and LoRA adapter tensors (the hook the LoRA
trainer uses). Learning-rate schedules follow llama.cpp's flags (-lr, -lr-min,
-decay-epochs) plus halving (-lr-half, -lr-halvings).
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ggmlpy import GGMLType, Tensor
from ggmlpy.opt import AdamWParams, OptimizerParams, SGDParams

ParamFilter = Callable[[str, Tensor], bool]


def param_filter_all(name: str, tensor: Tensor) -> bool:
    """Every F32 tensor of the model trains (norms, projections, embeddings)."""
    return tensor.type == GGMLType.F32


def param_filter_pattern(pattern: str) -> ParamFilter:
    """F32 tensors whose name matches the regular expression `pattern` (re.search)."""
    regex = re.compile(pattern)
    return lambda name, tensor: tensor.type == GGMLType.F32 and regex.search(name) is not None


def param_filter_lora(name: str, tensor: Tensor) -> bool:
    """Only LoRA adapter tensors (`<base tensor>.lora_a` / `.lora_b`) train."""
    return name.endswith((".lora_a", ".lora_b"))


class AdamW(BaseModel):
    kind: Literal["adamw"] = "adamw"
    beta1: float = Field(0.9, ge=0, le=1)
    beta2: float = Field(0.999, ge=0, le=1)
    eps: float = Field(1e-8, ge=0)
    wd: float = Field(0.0, ge=0, le=1)


class SGD(BaseModel):
    kind: Literal["sgd"] = "sgd"
    wd: float = Field(0.0, ge=0, le=1)


class LRSchedule(BaseModel):
    """Learning rate per epoch (0-based).

    lr_min > 0: exponential decay from lr0 to lr_min over decay_epochs (all epochs when
    unset), then lr_min (llama.cpp's -lr-min / -decay-epochs). half_life: halve every
    half_life epochs, at most `halvings` times (-lr-half / -lr-halvings).
    """

    lr0: float = Field(1e-5, gt=0)
    lr_min: float = Field(0.0, ge=0)
    decay_epochs: float = -1.0
    half_life: float | None = Field(None, gt=0)
    halvings: int | None = Field(None, ge=0)
    epochs: int = Field(2, ge=1)

    @model_validator(mode="after")
    def _one_kind_of_decay(self) -> "LRSchedule":
        if self.half_life is not None and self.lr_min > 0:
            raise ValueError("choose either halving (-lr-half) or decay to a minimum (-lr-min), not both")
        return self

    def lr(self, epoch: int) -> float:
        if self.half_life is not None:
            n = epoch / self.half_life
            if self.halvings is not None:
                n = min(n, self.halvings)
            return self.lr0 * 0.5 ** math.floor(n)
        if 0 < self.lr_min < self.lr0:
            span = self.decay_epochs if 0 < self.decay_epochs < self.epochs else self.epochs
            if epoch >= span:
                return self.lr_min
            return self.lr0 * 0.5 ** (epoch * math.log2(self.lr0 / self.lr_min) / span)
        return self.lr0


class TrainParams(BaseModel):
    """What Context.opt_init needs. n_ctx_train 0 means the context's n_ctx."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    n_ctx_train: int = Field(0, ge=0)
    optimizer: Annotated[AdamW | SGD, Field(discriminator="kind")] = Field(default_factory=AdamW)
    schedule: LRSchedule = Field(default_factory=LRSchedule)
    param_filter: ParamFilter = param_filter_all

    def optimizer_params(self, epoch: int) -> OptimizerParams:
        """The ggmlpy optimizer parameters for one epoch of this schedule."""
        lr = self.schedule.lr(epoch)
        o = self.optimizer
        if isinstance(o, AdamW):
            return OptimizerParams(adamw=AdamWParams(lr, o.beta1, o.beta2, o.eps, o.wd))
        return OptimizerParams(sgd=SGDParams(lr, o.wd))
