"""Models trained from nothing: a new, randomly initialised model with a borrowed tokenizer.

`new_model` writes the GGUF metadata a converted model would carry (architecture,
hyper-parameters, `general.file_type`, and every `tokenizer.*` key of the GGUF file the
vocabulary comes from), creates F32 weights initialised as llama2.c and nanoGPT do, and
hands both to the same code that builds a loaded model (`model.model_from`). The result
decodes, trains and saves like any loaded model; nothing touches the disk until it is saved.

Initialisation (reproducible for a seed): one `numpy.random.default_rng(seed)` draws, in
the order the tensors are stored — `token_embd.weight`, then for each layer `blk.{il}.*`
in the architecture's layer order (`Architecture.layer_tensors`), then `output_norm.weight`
and `output.weight` (unless the family ties it to the embeddings: gemma3) — one
float32 standard-normal matrix per weight matrix, scaled by 0.02; the residual output
projections (`attn_output`, `ffn_down`) by 0.02 / sqrt(2 n_layer) (GPT-2's scaled init, so
the residual stream's variance does not grow with depth). Norm weights are 1 and biases
(qwen2's Q, K and V) 0; neither draws.

Every architecture of the registry (llamapy.arch) can be made; what differs between families
(layer tensors, biases, a tied output, a sliding window, the head size in the metadata) is read
from its record.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from ggmlpy import GGMLType, Tensor

from .arch import ARCHITECTURES
from .errors import InputError, LlamapyError
from .gguf_file import GGUFFile, InMemoryGGUF, MetaValue, ValueType
from .model import Model, model_from

INIT_STD = 0.02
RESIDUAL_PROJECTIONS = ("attn_output", "ffn_down")  # written into the residual stream: scaled init
LLAMA_FTYPE_ALL_F32 = 0  # general.file_type of a model whose tensors are all F32


def new_model(arch: str = "llama", vocab_from: str | os.PathLike | None = None, *, n_embd: int, n_head: int,
              n_layer: int, n_ff: int, n_ctx_train: int, n_head_kv: int | None = None,
              rope_freq_base: float = 10000.0, rms_eps: float = 1e-5, seed: int = 0,
              head_dim: int | None = None, sliding_window: int | None = None, name: str | None = None) -> Model:
    """A new model of architecture `arch` (any of llamapy.arch.ARCHITECTURES) with random F32
    weights (see the module docstring for the initialisation) and the tokenizer of the GGUF file
    `vocab_from`, whose vocabulary size it takes. `n_head_kv` defaults to `n_head` (no
    grouped-query attention); `head_dim` to n_embd / n_head. For a family with sliding-window
    layers (gemma3), `sliding_window` (default: the family's, 512 for gemma3) is their window.
    Raises InputError with one line for bad input.
    """
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise InputError(f"cannot create a model of architecture {arch!r} (supported: "
                         f"{', '.join(sorted(ARCHITECTURES))})")
    family = ARCHITECTURES[arch]
    sizes = {"n_embd": n_embd, "n_head": n_head, "n_layer": n_layer, "n_ff": n_ff, "n_ctx_train": n_ctx_train}
    if n_head_kv is not None:
        sizes["n_head_kv"] = n_head_kv
    if head_dim is not None:
        sizes["head_dim"] = head_dim
    if sliding_window is not None:
        if family.default_sliding_window is None:
            windowed = " and ".join(n for n, a in ARCHITECTURES.items() if a.default_sliding_window is not None)
            raise InputError(f"sliding_window applies to {windowed} models, not {arch}")
        sizes["sliding_window"] = sliding_window
    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise InputError(f"{key} must be a positive integer, got {value!r}")
    n_head_kv = n_head if n_head_kv is None else int(n_head_kv)
    if head_dim is None:
        if n_embd % n_head:
            raise InputError(f"n_embd {n_embd} is not divisible by n_head {n_head}")
        head_dim = n_embd // n_head
    if n_head % n_head_kv:
        raise InputError(f"n_head {n_head} is not a multiple of n_head_kv {n_head_kv}")
    if head_dim % 2:
        raise InputError(f"the head dimension {head_dim} is odd: RoPE rotates pairs of values")
    for key, value in (("rope_freq_base", rope_freq_base), ("rms_eps", rms_eps)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise InputError(f"{key} must be a positive number, got {value!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise InputError(f"seed must be a non-negative integer, got {seed!r}")
    if sliding_window is None:
        sliding_window = family.default_sliding_window

    tokenizer = tokenizer_metadata(vocab_from)
    n_vocab = len(tokenizer["tokenizer.ggml.tokens"].value)
    metadata = _model_metadata(arch, name or f"{arch}-from-scratch", n_ctx_train=n_ctx_train, n_embd=n_embd,
                               n_layer=n_layer, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
                               rope_freq_base=rope_freq_base, rms_eps=rms_eps, sliding_window=sliding_window)
    metadata.update(tokenizer)
    shapes = tensor_shapes(arch, n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_ff=n_ff, n_head=n_head,
                           n_head_kv=n_head_kv, head_dim=head_dim)
    tensors = init_tensors(shapes, n_layer, seed)
    n_dims = {name: len(ne) for name, ne in shapes.items()}
    return model_from(InMemoryGGUF(f"new {arch} model", metadata, tensors, n_dims))


def tokenizer_metadata(path: str | os.PathLike | None) -> dict[str, MetaValue]:
    """Every `tokenizer.*` key of the GGUF file at `path` (vocabulary, merges, special ids,
    flags, chat template), in the file's order: what a new model borrows to tokenize alike."""
    if path is None:
        raise InputError("vocab_from is required: the GGUF file whose tokenizer the new model uses")
    path = Path(path)
    if not path.is_file():
        raise InputError(f"vocab_from: file not found: {path}")
    try:
        f = GGUFFile(path)
    except LlamapyError as e:
        raise InputError(f"vocab_from: {e}") from None
    meta = {k: v for k, v in f.metadata.items() if k.startswith("tokenizer.")}
    if "tokenizer.ggml.model" not in meta or "tokenizer.ggml.tokens" not in meta:
        raise InputError(f"vocab_from: {path} has no tokenizer (no tokenizer.ggml.model and tokens keys)")
    return meta


def _u32(value: int) -> MetaValue:
    return MetaValue(ValueType.UINT32, None, int(value))


def _f32(value: float) -> MetaValue:
    """A FLOAT32 value as a loader reads it back (rounded to float32), so hyper-parameters
    match those of the saved file exactly."""
    return MetaValue(ValueType.FLOAT32, None, float(np.float32(value)))


def _model_metadata(arch: str, name: str, *, n_ctx_train: int, n_embd: int, n_layer: int, n_ff: int, n_head: int,
                    n_head_kv: int, head_dim: int, rope_freq_base: float, rms_eps: float,
                    sliding_window: int | None) -> dict[str, MetaValue]:
    """The general.* and <arch>.* keys llama.cpp's loader reads, typed as its converters write them."""
    meta = {
        "general.architecture": MetaValue(ValueType.STRING, None, arch),
        "general.name": MetaValue(ValueType.STRING, None, name),
        "general.file_type": _u32(LLAMA_FTYPE_ALL_F32),
        f"{arch}.context_length": _u32(n_ctx_train),
        f"{arch}.embedding_length": _u32(n_embd),
        f"{arch}.block_count": _u32(n_layer),
        f"{arch}.feed_forward_length": _u32(n_ff),
        f"{arch}.attention.head_count": _u32(n_head),
        f"{arch}.attention.head_count_kv": _u32(n_head_kv),
        f"{arch}.rope.freq_base": _f32(rope_freq_base),
        f"{arch}.rope.dimension_count": _u32(head_dim),
        f"{arch}.attention.layer_norm_rms_epsilon": _f32(rms_eps),
    }
    if ARCHITECTURES[arch].head_dim_in_metadata or head_dim * n_head != n_embd:
        meta[f"{arch}.attention.key_length"] = _u32(head_dim)
        meta[f"{arch}.attention.value_length"] = _u32(head_dim)
    if sliding_window is not None:
        meta[f"{arch}.attention.sliding_window"] = _u32(sliding_window)
    return meta


def tensor_shapes(arch: str, *, n_vocab: int, n_embd: int, n_layer: int, n_ff: int, n_head: int, n_head_kv: int,
                  head_dim: int) -> dict[str, tuple[int, ...]]:
    """Every weight of a new `arch` model by GGUF name, in storage order, with its shape in
    ggml's order (ne0 = inputs of a matrix, ne1 = outputs)."""
    layer = {  # matrices (ne0 = inputs) and per-head norms; the remaining layer weights are norms over n_embd
        "attn_q": (n_embd, n_head * head_dim), "attn_k": (n_embd, n_head_kv * head_dim),
        "attn_v": (n_embd, n_head_kv * head_dim), "attn_output": (n_head * head_dim, n_embd),
        "attn_q_norm": (head_dim,), "attn_k_norm": (head_dim,),
        "ffn_gate": (n_embd, n_ff), "ffn_up": (n_embd, n_ff), "ffn_down": (n_ff, n_embd),
    }
    spec = ARCHITECTURES[arch]
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (n_embd, n_vocab)}
    for il in range(n_layer):
        for t in spec.layer_tensors:
            shapes[f"blk.{il}.{t}.weight"] = layer.get(t, (n_embd,))
            if t in spec.layer_biases:
                shapes[f"blk.{il}.{t}.bias"] = layer[t][1:]  # one per output
    shapes["output_norm.weight"] = (n_embd,)
    if not spec.ties_output:
        shapes["output.weight"] = (n_embd, n_vocab)  # untied
    return shapes


def init_tensors(shapes: dict[str, tuple[int, ...]], n_layer: int, seed: int) -> dict[str, Tensor]:
    """F32 tensors for `shapes`: norms are ones, biases zeros; matrices draw, in `shapes` order,
    from default_rng(seed): normal(0, 0.02), the residual projections normal(0, 0.02 / sqrt(2 n_layer))."""
    rng = np.random.default_rng(seed)
    residual_std = INIT_STD / math.sqrt(2 * n_layer)
    tensors = {}
    for name, ne in shapes.items():
        if name.endswith(".bias"):
            values = np.zeros(ne, dtype=np.float32)
        elif len(ne) == 1:
            values = np.ones(ne, dtype=np.float32)
        else:
            std = residual_std if name.split(".")[-2] in RESIDUAL_PROJECTIONS else INIT_STD
            values = rng.standard_normal(ne[::-1], dtype=np.float32) * np.float32(std)
        t = Tensor(GGMLType.F32, ne + (1,) * (4 - len(ne)), name=name)
        t.bind(np.ascontiguousarray(values).reshape(-1).view(np.uint8))
        tensors[name] = t
    return tensors
