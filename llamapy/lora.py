"""LoRA adapters: low-rank deltas W x + (alpha / r) * scale * B (A x) on chosen matrices.

Shapes and the file format are llama.cpp's: for a base matrix W (ne = [n_in, n_out]),
`<W name>.lora_a` has ne = [n_in, r] and `.lora_b` ne = [r, n_out]; a GGUF adapter has
general.type = adapter, adapter.type = lora and adapter.lora.alpha. The base stays frozen
and may be any type, quantized included: gradients reach A and B through the quantized
products without a dequantized copy of the model.
"""
from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import numpy as np

from ggmlpy import GGMLType, Tensor

from .errors import InputError, ModelLoadError
from .gguf_file import GGUFFile, MetaValue, ValueType
from .gguf_writer import array_out
from .model import Model
from .save import write_atomically

# every projection the graph applies adapters to (GraphBuilder.mm); new adapters adapt all of them by default
DEFAULT_MODULES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")

# The largest |scale| an adapter may be applied or merged at. llama.cpp sets no bound, but a
# scale of 1e38 turns every logit into NaN (on a server: every client's text is empty), and
# the scales people use are within [-2, 2]; 100 leaves room for experiments while
# scale * alpha / r * B A stays far from float32's overflow. One bound for the command lines
# (--lora-scaled), the server (POST /lora-adapters, a request's `lora`) and export-lora.
LORA_SCALE_LIMIT = 100.0
LORA_SCALE_RULE = f"a LoRA scale must be a finite number from {-LORA_SCALE_LIMIT:g} to {LORA_SCALE_LIMIT:g}"


def check_lora_scale(scale: float, where: str = "LoRA scale") -> float:
    """`scale` as a float if it is a finite number within +-LORA_SCALE_LIMIT, else InputError
    naming `where` (see LORA_SCALE_LIMIT for why there is a bound)."""
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) \
            or not -LORA_SCALE_LIMIT <= scale <= LORA_SCALE_LIMIT:  # NaN fails the comparison too
        raise InputError(f"{where}: {LORA_SCALE_RULE}, not {scale!r}")
    return float(scale)


class LoraAdapter:
    """A and B (F32) per adapted base tensor, with the adapter's alpha."""

    def __init__(self, alpha: float, tensors: dict[str, tuple[Tensor, Tensor]], arch: str = "") -> None:
        self.alpha = float(alpha)
        self.tensors = tensors  # base tensor name -> (lora_a, lora_b)
        self.arch = arch

    @property
    def rank(self) -> int:
        a, _ = next(iter(self.tensors.values()))
        return a.ne[1]

    def scale_for(self, base: str) -> float:
        """alpha / r for one tensor (ranks may differ per tensor in files from elsewhere)."""
        a, _ = self.tensors[base]
        return self.alpha / a.ne[1] if self.alpha else 1.0

    def named_tensors(self) -> dict[str, Tensor]:
        out = {}
        for base, (a, b) in self.tensors.items():
            out[f"{base}.lora_a"], out[f"{base}.lora_b"] = a, b
        return out

    # -- creation ---------------------------------------------------------------------------
    @classmethod
    def new(cls, model: Model, rank: int, alpha: float | None = None, modules: Iterable[str] = DEFAULT_MODULES,
            seed: int = 0) -> "LoraAdapter":
        """A fresh adapter: A Kaiming-uniform (bound 1/sqrt(n_in), as PyTorch's LoRA), B zero,
        so the adapted model starts out equal to the base."""
        if rank < 1:
            raise InputError(f"LoRA rank must be at least 1, got {rank}")
        modules = list(modules)
        rng = np.random.default_rng(seed)
        tensors = {}
        for name, w in model.tensors.items():
            if layer_module(name) not in modules:
                continue
            n_in, n_out = w.ne[0], w.ne[1]
            bound = 1.0 / math.sqrt(n_in)
            a = _tensor(rng.uniform(-bound, bound, (rank, n_in)).astype(np.float32), f"{name}.lora_a")
            b = _tensor(np.zeros((n_out, rank), np.float32), f"{name}.lora_b")
            tensors[name] = (a, b)
        if not tensors:
            raise InputError(f"no tensor of the model matches the LoRA modules {modules}")
        return cls(float(rank) if alpha is None else alpha, tensors, model.hparams.arch)

    @classmethod
    def load(cls, path: str | os.PathLike, model: Model) -> "LoraAdapter":
        """Read a llama.cpp GGUF LoRA adapter and check it against the model's tensors."""
        f = GGUFFile(path)
        if f.get_str("general.type", None) != "adapter" or f.get_str("adapter.type", None) != "lora":
            raise ModelLoadError(f"{f.path}: not a LoRA adapter (general.type/adapter.type)")
        arch = f.get_str("general.architecture", None)
        if arch and arch != model.hparams.arch:
            raise ModelLoadError(f"{f.path}: adapter for {arch!r}, model is {model.hparams.arch!r}")
        alpha = f.get_float("adapter.lora.alpha", 0.0)
        pairs: dict[str, dict[str, Tensor]] = {}
        for name, t in f.tensors.items():
            base, _, kind = name.rpartition(".")
            if kind not in ("lora_a", "lora_b"):
                raise ModelLoadError(f"{f.path}: unexpected tensor {name!r} in a LoRA adapter")
            pairs.setdefault(base, {})[kind] = t
        tensors = {}
        for base, ab in pairs.items():
            if set(ab) != {"lora_a", "lora_b"} or base not in model.tensors:
                raise ModelLoadError(f"{f.path}: {base!r} needs lora_a and lora_b and a matching model tensor")
            if layer_module(base) not in DEFAULT_MODULES:  # it would be loaded and never applied
                raise ModelLoadError(f"{f.path}: {base!r} is not a matrix llamapy applies adapters to (each layer's "
                                     f"{', '.join(DEFAULT_MODULES)})")
            a, b, w = ab["lora_a"], ab["lora_b"], model.tensors[base]
            rank = a.ne[1]
            if a.ne != (w.ne[0], rank, 1, 1) or b.ne != (rank, w.ne[1], 1, 1) or rank < 1 or w.ne[2:] != (1, 1):
                raise ModelLoadError(f"{f.path}: {base}: shapes a {a.ne[:2]}, b {b.ne[:2]} do not fit {w.ne[:2]}")
            tensors[base] = (_f32_copy(a, f"{base}.lora_a"), _f32_copy(b, f"{base}.lora_b"))
        return cls(alpha, tensors, arch or model.hparams.arch)

    def save(self, path: str | os.PathLike, metadata: dict[str, MetaValue] | None = None) -> Path:
        """Write the adapter in llama.cpp's GGUF LoRA format, atomically; `metadata`: keys to add
        (a best adapter's validation loss)."""
        meta = {"general.architecture": MetaValue(ValueType.STRING, None, self.arch),
                "general.type": MetaValue(ValueType.STRING, None, "adapter"),
                "adapter.type": MetaValue(ValueType.STRING, None, "lora"),
                "adapter.lora.alpha": MetaValue(ValueType.FLOAT32, None, float(self.alpha)),
                **(metadata or {})}
        tensors = [array_out(name, t.array()[0, 0]) for name, t in self.named_tensors().items()]
        return write_atomically(meta, tensors, Path(path), "LoRA adapter")


def layer_module(name: str) -> str | None:
    """"attn_q" for "blk.3.attn_q.weight"; None for a tensor outside the layers or not a weight."""
    parts = name.split(".")
    return parts[2] if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" else None


def _tensor(values: np.ndarray, name: str) -> Tensor:
    """An F32 tensor with its own writable memory (numpy shape = ne reversed)."""
    ne = values.shape[::-1] + (1,) * (4 - values.ndim)
    t = Tensor(GGMLType.F32, ne, name=name)
    t.bind(np.ascontiguousarray(values, dtype=np.float32).reshape(-1).view(np.uint8).copy())
    return t


def _f32_copy(t: Tensor, name: str) -> Tensor:
    if t.type not in (GGMLType.F32, GGMLType.F16):
        raise ModelLoadError(f"LoRA tensor {name} is {t.type.name}; F32 or F16 expected")
    return _tensor(np.asarray(t.array()[0, 0], dtype=np.float32), name)



# k-quants need rows of 256 values; llama.cpp falls back to these for other row lengths
_ROW_FALLBACK = {GGMLType.Q2_K: GGMLType.Q4_0, GGMLType.Q3_K: GGMLType.Q4_0, GGMLType.Q4_K: GGMLType.Q5_0,
                 GGMLType.Q5_K: GGMLType.Q5_1, GGMLType.Q6_K: GGMLType.Q8_0}


def merge_adapters(model: Model, adapters: list[tuple[LoraAdapter, float]],
                   outtype: GGMLType | Literal["auto"] | None = None) -> list[str]:
    """Add each adapter's scaled B A into the model's weights, in memory (llama.cpp's
    export-lora). Merged tensors are stored as `outtype`: their own type when None
    (quantized ones are dequantized, merged in float32 and quantized again), llama.cpp's
    choice with "auto" (F32 stays F32, any other type becomes F16). Returns the names of
    the merged tensors."""
    from ggmlpy import convert, quants, traits
    for _, scale in adapters:
        check_lora_scale(scale)
    names = list(dict.fromkeys(n for adapter, _ in adapters for n in adapter.tensors))
    for name in names:
        w = model.tensors[name]
        if traits(w.type).is_quantized:
            values = quants.dequantize(np.ascontiguousarray(w.array()[0, 0]), w.type)
        else:
            values = convert.to_f32(np.asarray(w.array()[0, 0]), w.type).astype(np.float32)
        for adapter, scale in adapters:
            if name in adapter.tensors:
                a, b = adapter.tensors[name]
                values = values + np.float32(scale * adapter.scale_for(name)) * (b.array()[0, 0] @ a.array()[0, 0])
        if outtype == "auto":
            target = GGMLType.F32 if w.type == GGMLType.F32 else GGMLType.F16
        else:
            target = GGMLType(outtype if outtype is not None else w.type)
        while traits(target).is_quantized and w.ne[0] % traits(target).blck_size:  # as llama-quantize falls back
            target = _ROW_FALLBACK.get(target, GGMLType.F16)
        if traits(target).is_quantized:
            data = quants.quantize(values, target)
        elif target == GGMLType.F16:
            data = values.astype(np.float16)
        elif target == GGMLType.F32:
            data = values.astype(np.float32)
        else:
            raise InputError(f"cannot store merged {name} as {target.name}")
        merged = Tensor(target, w.ne, name=name)
        merged.bind(np.ascontiguousarray(data).reshape(-1).view(np.uint8).copy())
        model.set_tensor(name, merged)
    return names
