"""A model: hyper-parameters, vocabulary and memory-mapped weights from one GGUF file."""
from __future__ import annotations

import os
from pathlib import Path

from ggmlpy import Tensor

from .arch import ARCHITECTURES, Architecture
from .errors import UnsupportedModelError
from .gguf_file import GGUFFile
from .hparams import HParams
from .vocab import Vocab


class Model:
    def __init__(self, file: GGUFFile, arch: Architecture, hparams: HParams, vocab: Vocab) -> None:
        self.file = file
        self.arch = arch
        self.hparams = hparams
        self.vocab = vocab
        self.tensors: dict[str, Tensor] = file.tensors

    @property
    def path(self) -> Path:
        return self.file.path

    def weight(self, name: str) -> Tensor:
        return self.tensors[name]

    @property
    def output_weight(self) -> Tensor:
        """The output projection, or the token embeddings when the model ties them."""
        return self.tensors.get("output.weight") or self.tensors["token_embd.weight"]

    @property
    def n_params(self) -> int:
        return sum(t.nelements() for t in self.tensors.values())

    def describe(self) -> str:
        hp = self.hparams
        return (f"{hp.arch}: {hp.n_layer} layers, n_embd {hp.n_embd}, n_head {hp.n_head}/{hp.n_head_kv}, "
                f"n_ff {hp.n_ff}, vocab {hp.n_vocab}, {self.n_params / 1e6:.2f} M params")


def load_model(path: str | os.PathLike) -> Model:
    """Open a GGUF model (weights stay memory-mapped); raises a LlamapyError with one clear line."""
    f = GGUFFile(path)
    arch_name = f.get("general.architecture")
    if arch_name is None:
        raise UnsupportedModelError(f"{f.path}: no general.architecture key: not a model file")
    if arch_name not in ARCHITECTURES:
        known = ", ".join(sorted(ARCHITECTURES))
        raise UnsupportedModelError(f"{f.path}: architecture {arch_name!r} is not supported (supported: {known})")
    arch = ARCHITECTURES[arch_name]()
    vocab = Vocab.from_gguf(f)
    hp = arch.read_hparams(f, vocab.n_tokens)
    for name in arch.required_tensors(hp):
        f.tensor(name)
    return Model(f, arch, hp, vocab)
