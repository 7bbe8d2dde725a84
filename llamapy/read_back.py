"""Reading back what llamapy writes, before it replaces anything (llamapy.atomic's `validate`
step): the written temp file goes through the reader that loads such a file, so no tool ends
with an output that llamapy cannot load, and a refusal leaves the previous file intact.

The checks read headers, never tensor data, so they cost milliseconds even on a large file:
the GGUF reader (header, metadata, every tensor's type, size and place in the file) and, for a
model, what the model loader checks of the structure (architecture, hyper-parameters, each
tensor's shape and type). The vocabulary is only counted: rebuilding a 262,144-token
tokenizer takes seconds, and its metadata is copied from a model that loaded.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from .arch import ARCHITECTURES
from .errors import ModelLoadError
from .gguf_file import GGUFFile, GGUFMetadata, MetaValue, ValueType
from .model import check_tensors


def read_back_gguf(path: str | os.PathLike) -> GGUFFile:
    """`path` through the GGUF reader (adapters and checkpoints: their own checks need the
    model they belong to)."""
    return GGUFFile(path)


def read_back_model(path: str | os.PathLike) -> None:
    """`path` through the GGUF reader and the model loader's structural checks."""
    check_model_structure(GGUFFile(path))


def read_back_written(path: str | os.PathLike) -> None:
    """`path` through the GGUF reader, and the model loader's checks when it is a model of an
    architecture llamapy runs (`is_runnable_model`)."""
    f = GGUFFile(path)
    if is_runnable_model(f.metadata):
        check_model_structure(f)


def is_runnable_model(metadata: Mapping[str, MetaValue]) -> bool:
    """A model (general.type "model" or none: llama.cpp's converters wrote none before) of an
    architecture llamapy has; another architecture is passed on by quantize as it is."""
    arch, kind = metadata.get("general.architecture"), metadata.get("general.type")
    return (arch is not None and arch.type == ValueType.STRING and arch.value in ARCHITECTURES
            and (kind is None or kind.type == ValueType.STRING and kind.value == "model"))


def check_model_structure(source: GGUFMetadata) -> None:
    """What llamapy.model.model_from checks, the tokenizer aside (module docstring):
    ModelLoadError or UnsupportedModelError with one line naming the file."""
    arch_name = source.get_str("general.architecture")
    if arch_name not in ARCHITECTURES:
        raise ModelLoadError(f"{source.path}: architecture {arch_name!r} is not one llamapy runs")
    arch = ARCHITECTURES[arch_name]()
    hp = arch.read_hparams(source, _n_vocab(source))
    hp.check_finite(source.path)
    check_tensors(source, arch_name, arch.tensor_specs(hp))


def _n_vocab(source: GGUFMetadata) -> int:
    tokens = source.metadata.get("tokenizer.ggml.tokens")
    if tokens is None or tokens.type != ValueType.ARRAY or tokens.sub_type != ValueType.STRING or not tokens.value:
        raise ModelLoadError(f"{source.path}: no tokenizer.ggml.tokens list (no vocabulary)")
    return len(tokens.value)
