"""A model: hyper-parameters, vocabulary and memory-mapped weights from one GGUF file."""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from ggmlpy import GGMLType, Tensor

from .arch import ARCHITECTURES, Architecture
from .arch.base import TensorSpec
from .errors import ModelLoadError, UnsupportedModelError
from .gguf_file import GGUFFile, GGUFMetadata
from .hparams import HParams
from .vocab import Vocab


class Model:
    def __init__(self, file: GGUFMetadata, arch: Architecture, hparams: HParams, vocab: Vocab) -> None:
        self.file = file
        self.arch = arch
        self.hparams = hparams
        self.vocab = vocab
        self._tensors: dict[str, Tensor] = dict(file.tensors)
        self.revision = 0  # changes whenever a tensor is replaced: graphs built before are stale

    @property
    def tensors(self) -> Mapping[str, Tensor]:
        """The weights by GGUF name (read-only: replace one with `set_tensor`)."""
        return MappingProxyType(self._tensors)

    def set_tensor(self, name: str, tensor: Tensor) -> None:
        """Replace weight `name` (same shape): contexts rebuild their graphs on the new one."""
        old = self._tensors[name]
        if tensor.ne != old.ne:
            raise ValueError(f"set_tensor {name}: shape {tensor.ne} differs from {old.ne}")
        tensor.name = name
        self._tensors[name] = tensor
        self.revision += 1

    @property
    def path(self) -> Path:
        return self.file.path

    def weight(self, name: str) -> Tensor:
        return self._tensors[name]

    @property
    def output_weight(self) -> Tensor:
        """The output projection, or the token embeddings when the model ties them."""
        return self._tensors.get("output.weight") or self._tensors["token_embd.weight"]

    @property
    def rope_factors(self) -> Tensor | None:
        """RoPE frequency factors (Llama 3.1+'s rope_freqs.weight), or None."""
        return self._tensors.get("rope_freqs.weight")

    @property
    def n_params(self) -> int:
        return sum(t.nelements() for t in self.tensors.values())

    def describe(self) -> str:
        hp = self.hparams
        return (f"{hp.arch}: {hp.n_layer} layers, n_embd {hp.n_embd}, n_head {hp.n_head}/{hp.n_head_kv}, "
                f"n_ff {hp.n_ff}, vocab {hp.n_vocab}, {self.n_params / 1e6:.2f} M params")


def load_model(path: str | os.PathLike) -> Model:
    """Open a GGUF model (weights stay memory-mapped); raises a LlamapyError with one clear line."""
    return model_from(GGUFFile(path))


def model_from(source: GGUFMetadata) -> Model:
    """The model a GGUF description holds (a file, or one built in memory): its architecture,
    vocabulary and hyper-parameters read from the metadata, its tensors checked against what
    the architecture reads. One path for both, so a model built in Python behaves exactly
    like a loaded one."""
    arch_name = source.get_str("general.architecture", None)
    if arch_name is None:
        raise UnsupportedModelError(f"{source.path}: no general.architecture key: not a model file")
    if arch_name not in ARCHITECTURES:
        known = ", ".join(sorted(ARCHITECTURES))
        raise UnsupportedModelError(f"{source.path}: architecture {arch_name!r} is not supported (supported: {known})")
    arch = ARCHITECTURES[arch_name]()
    vocab = Vocab.from_gguf(source)
    hp = arch.read_hparams(source, vocab.n_tokens)
    hp.check_finite(source.path)
    check_tensors(source, arch_name, arch.tensor_specs(hp))
    return Model(source, arch, hp, vocab)


# Types the graph computes with: vectors (norms, biases, RoPE factors) in F32, matrices in
# any type ggmlpy has products for (MATRIX_TYPES: the CPU type table's types with a vec_dot_type).
VECTOR_TYPES = frozenset({GGMLType.F32})


def check_tensors(source: GGUFMetadata, arch_name: str, specs: dict[str, TensorSpec]) -> None:
    """Each tensor is one the architecture reads, every required one is there, and each has
    the shape the hyper-parameters imply (llama.cpp's create_tensor check) and a type the
    graph uses for its role: anything else is refused with one line before a graph reads it."""
    unknown = [name for name in source.tensors if name not in specs]
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise UnsupportedModelError(f"{source.path}: tensor {unknown[0]!r}{more} is not part of a {arch_name} model "
                                    "as llamapy builds it; ignoring it would compute a different model")
    for name, spec in specs.items():
        if spec.required:
            source.tensor(name)
    from ggmlpy.backend.cpu.products.type_table import MATRIX_TYPES  # the backend's numba loads after start-up
    for name, t in source.tensors.items():
        ne = specs[name].ne
        if t.ne != ne + (1,) * (4 - len(ne)):
            raise ModelLoadError(f"{source.path}: tensor {name!r} has shape {_shape(t.ne)}, but the hyper-parameters "
                                 f"make it {_shape(ne)}")
        allowed, role = (MATRIX_TYPES, "matrix") if len(ne) == 2 else (VECTOR_TYPES, "vector")
        if t.type not in allowed:
            raise UnsupportedModelError(f"{source.path}: tensor {name!r} is {t.type.name}, which llamapy does not "
                                        f"use for a {role} ({', '.join(sorted(x.name for x in allowed))})")


def _shape(ne: tuple[int, ...]) -> str:
    """A shape as llama.cpp prints it: ne0 first, trailing 1s dropped."""
    while len(ne) > 1 and ne[-1] == 1:
        ne = ne[:-1]
    return "[" + ", ".join(map(str, ne)) + "]"
