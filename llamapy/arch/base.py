"""What an architecture provides: its hyper-parameters, its weights, its graph."""
from __future__ import annotations

from ..gguf_file import GGUFFile
from ..hparams import HParams

ARCHITECTURES: dict[str, type["Architecture"]] = {}


def register(cls: type["Architecture"]) -> type["Architecture"]:
    ARCHITECTURES[cls.name] = cls
    return cls


class Architecture:
    name = ""
    bos_in_every_window = False  # training windows start with BOS (models that score badly without it)

    def read_hparams(self, f: GGUFFile, n_vocab: int) -> HParams:
        raise NotImplementedError

    def required_tensors(self, hp: HParams) -> list[str]:
        """Names that must be present in the file (checked at load, for one clear error)."""
        raise NotImplementedError

    def build(self, g, model):
        """Add the forward graph of one ubatch to GraphBuilder `g`; return the logits."""
        raise NotImplementedError
