"""Training parameters (checked records: pydantic models, ggmlpy/records.py), parameter filters and llamapy's training policy.

A parameter filter decides, per model tensor, whether it trains. Built-ins: every F32
tensor, tensors whose names match a pattern, and LoRA adapter tensors. Learning-rate
schedules follow llama.cpp's flags (-lr, -lr-min, -decay-epochs) plus halving (-lr-half,
-lr-halvings), cosine with restarts and linear warmup (its old finetune's). The optimizer's
other hyper-parameters are ggmlpy's `AdamW` / `SGD` records; the schedule sets their
learning rate (alpha) for each optimizer step.

`TrainParams.for_model` is the policy a user gets by default, in Python and on the
command line alike: LoRA when the model's matrices are quantized (they cannot train
directly), a learning rate that suits what trains, BOS in every window for the
architectures that need it.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from typing import Literal

from pydantic import ConfigDict, Field, field_serializer, model_validator

from ggmlpy import GGMLType, Tensor, traits
from ggmlpy.opt import SGD, AdamW, OptimizerParams, with_alpha
from ggmlpy.records import Bool, Float, Int, Record, Str

from .lora import DEFAULT_MODULES as DEFAULT_LORA_MODULES

ParamFilter = Callable[[str, Tensor], bool]

DEFAULT_LR = 1e-5         # llama.cpp's finetune
DEFAULT_LORA_LR = 3e-4    # adapters start at zero (B = 0); 1e-3 overfits the demo slice by epoch 2
DEFAULT_QUANTIZED_RANK = 8

__all__ = ["SGD", "AdamW", "LRSchedule", "LoraParams", "TrainParams", "param_filter_all", "param_filter_lora",
           "param_filter_pattern"]


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


class LRSchedule(Record):
    """The learning rate of every optimizer step, as a closed form of the step.

    `kind`:
    - "exp" (default): llama.cpp's per-epoch decays. lr_min > 0: exponential decay from
      lr0 to lr_min over decay_epochs (all epochs when unset), then lr_min (-lr-min /
      -decay-epochs); half_life: halve every half_life epochs, at most `halvings` times
      (-lr-half / -lr-halvings); neither: constant.
    - "constant": lr0 throughout.
    - "cosine": from lr0 down to lr_min along half a cosine over the steps after warmup;
      with cos_restart N, the cosine restarts every N epochs (SGDR).
    `warmup` > 0: the first `warmup` steps ramp linearly, lr0 * (step + 1) / warmup.
    """

    lr0: Float = Field(DEFAULT_LR, gt=0)
    lr_min: Float = Field(0.0, ge=0)
    decay_epochs: Float = -1.0
    half_life: Float | None = Field(None, gt=0)
    halvings: Int | None = Field(None, ge=0)
    epochs: Int = Field(2, ge=1)
    kind: Literal["constant", "exp", "cosine"] = "exp"
    warmup: Int = Field(0, ge=0)
    cos_restart: Int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _one_decay(self) -> "LRSchedule":
        """One kind of decay at a time."""
        if self.half_life is not None and self.lr_min > 0:
            raise ValueError("choose either halving (-lr-half) or decay to a minimum (-lr-min), not both")
        if self.kind != "exp" and (self.half_life is not None or self.decay_epochs > 0):
            raise ValueError(f"-lr-half and -decay-epochs belong to the exp schedule, not {self.kind}")
        if self.cos_restart is not None and self.kind != "cosine":
            raise ValueError("--cos-restart needs --lr-schedule cosine")
        if self.lr_min > self.lr0:
            raise ValueError(f"-lr-min {self.lr_min:g} is above the learning rate {self.lr0:g}")
        return self

    def lr(self, epoch: int) -> float:
        """The exp schedule's rate in `epoch` (0-based)."""
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

    def lr_at(self, step: int, steps_per_epoch: int) -> float:
        """The rate of optimizer step `step` (0-based) when an epoch has `steps_per_epoch` steps."""
        if step < self.warmup:
            return self.lr0 * (step + 1) / self.warmup
        if self.kind == "constant":
            return self.lr0
        if self.kind == "exp":
            return self.lr(step // max(1, steps_per_epoch))
        if self.cos_restart is not None:  # cycles of cos_restart epochs; the first one starts after warmup
            cycle, t = divmod(step, self.cos_restart * steps_per_epoch)
            period = self.cos_restart * steps_per_epoch
            if cycle == 0:
                t, period = t - self.warmup, period - self.warmup
        else:
            t, period = step - self.warmup, self.epochs * steps_per_epoch - self.warmup
        period = max(1, period)
        t = min(t, period)
        return self.lr_min + (self.lr0 - self.lr_min) * 0.5 * (1.0 + math.cos(math.pi * t / period))


class LoraParams(Record):
    """A LoRA adapter to create and train instead of the weights (opt_init attaches it)."""

    rank: Int = Field(ge=1)
    alpha: Float | None = None  # None: the rank (scale 1)
    modules: tuple[Str, ...] = DEFAULT_LORA_MODULES
    seed: Int = 0


class TrainParams(Record):
    """What Context.opt_init needs. n_ctx_train 0 means the context's n_ctx. Not frozen (an
    attribute set later is not checked: make changes with .replace). As JSON
    (model_dump_json), the optimizer's alpha (the schedule's to set) and the parameter
    filter (a function) are left out; model_validate_json makes the record again."""

    model_config = ConfigDict(frozen=False)

    n_ctx_train: Int = Field(0, ge=0)
    optimizer: OptimizerParams = Field(default_factory=AdamW)
    schedule: LRSchedule = Field(default_factory=LRSchedule)
    param_filter: ParamFilter = Field(param_filter_all, exclude=True)
    lora: LoraParams | None = None
    window_bos: Bool = False  # training windows start with BOS (see dataset.text_windows)
    grad_clip: Float | None = Field(None, gt=0)  # global gradient L2 norm limit (PyTorch's clip_grad_norm_)
    # gradient checkpointing: keep the residual stream at layer boundaries and recompute
    # each segment's forward during the backward pass (same gradients, less memory, more time);
    # grad_checkpoint_every k keeps every k-th boundary (None: the k with the smallest planned peak)
    grad_checkpoint: Bool = False
    grad_checkpoint_every: Int | None = Field(None, ge=1)
    # the backward pass's products through frozen quantized weights (and the fused output
    # layer's, when quantized) on bf16-rounded operands with float32 sums (gg.Prec.BF16): about
    # twice float32's speed on AVX512-BF16, each product within 2^-8 of its value, about as
    # close as the forward's activations quantized to 8 bits; False: float32 throughout;
    # None: bf16 where the CPU has AVX512-BF16 (elsewhere it would be no faster)
    backward_bf16: Bool | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "TrainParams":
        """The schedule sets the rate; a checkpoint stride needs checkpointing; an adapter is
        what trains (unless the caller's filter says otherwise)."""
        if "alpha" in self.optimizer.model_fields_set:
            raise ValueError("set the learning rate with schedule=LRSchedule(lr0=...), not the optimizer's alpha")
        if self.grad_checkpoint_every is not None and not self.grad_checkpoint:
            raise ValueError("grad_checkpoint_every needs grad_checkpoint=True")
        if self.lora is not None and self.param_filter is param_filter_all:
            object.__setattr__(self, "param_filter", param_filter_lora)  # not marked as set: a copy without lora trains all
        return self

    @field_serializer("optimizer")
    def _optimizer_without_alpha(self, optimizer: AdamW | SGD, info) -> dict:
        return optimizer.model_dump(mode=info.mode, exclude={"alpha"})

    def optimizer_params(self, step: int, steps_per_epoch: int) -> AdamW | SGD:
        """The optimizer's hyper-parameters at optimizer step `step` (0-based) of this schedule."""
        return with_alpha(self.optimizer, self.schedule.lr_at(step, steps_per_epoch))

    @classmethod
    def for_model(cls, model, *, lora_rank: int | None = None, lora_alpha: float | None = None,
                  lora_modules: Iterable[str] = DEFAULT_LORA_MODULES, seed: int = 0,
                  window_bos: bool | None = None, **fields) -> "TrainParams":
        """llamapy's defaults for `model`: a LoRA adapter of rank DEFAULT_QUANTIZED_RANK when a
        matrix it would adapt is quantized (unless `lora_rank` says otherwise), the learning
        rate for what trains (DEFAULT_LORA_LR or DEFAULT_LR) unless `schedule` sets lr0, BOS
        in every window when the architecture expects it. `fields` are TrainParams fields.
        A rank below 1 is refused (LoraParams), never taken for "no adapter"."""
        modules = tuple(lora_modules)
        if lora_rank is None and has_quantized_matrices(model, modules):
            lora_rank = DEFAULT_QUANTIZED_RANK
        lora = LoraParams(rank=lora_rank, alpha=lora_alpha, modules=modules, seed=seed) if lora_rank is not None else None
        schedule = fields.pop("schedule", None) or LRSchedule()
        if "lr0" not in schedule.model_fields_set:
            schedule = schedule.replace(lr0=DEFAULT_LORA_LR if lora else DEFAULT_LR)
        bos = model.arch.bos_in_every_window if window_bos is None else window_bos
        return cls(schedule=schedule, lora=lora, window_bos=bos, **fields)


def has_quantized_matrices(model, modules: Iterable[str]) -> bool:
    """Whether a layer matrix of one of `modules` is block-quantized (and so cannot train directly)."""
    modules = set(modules)
    return any(traits(t.type).is_quantized for name, t in model.tensors.items()
               if name.startswith("blk.") and name.split(".")[2] in modules)
