"""What an architecture provides: its hyper-parameters, its weights, its graph.

Adding an architecture is one module in this package that subclasses `Architecture`,
decorates it with `@register` and is imported in `__init__.py`: it reads its
hyper-parameters (most through `hparams.read_common`), names the tensors it needs, and
builds one ubatch's graph from the shared pieces of `GraphBuilder`.
"""
from __future__ import annotations

from ..gguf_file import GGUFMetadata
from ..hparams import HParams

ARCHITECTURES: dict[str, type["Architecture"]] = {}


def register(cls: type["Architecture"]) -> type["Architecture"]:
    ARCHITECTURES[cls.name] = cls
    return cls


class Architecture:
    name = ""
    bos_in_every_window = False  # training windows start with BOS (models that score badly without it)
    # tensors every model of this architecture has: once, and once per layer ("blk.{il}." + name + ".weight")
    global_tensors: tuple[str, ...] = ("token_embd", "output_norm")
    layer_tensors: tuple[str, ...] = ()

    def read_hparams(self, f: GGUFMetadata, n_vocab: int) -> HParams:
        raise NotImplementedError

    def required_tensors(self, hp: HParams) -> list[str]:
        """Names that must be present in the file (checked at load, for one clear error)."""
        names = [f"{t}.weight" for t in self.global_tensors]
        for il in range(hp.n_layer):
            names += [f"blk.{il}.{t}.weight" for t in self.layer_tensors]
        return names

    def build(self, g, model):
        """Add the forward graph of one ubatch to GraphBuilder `g`; return the logits."""
        raise NotImplementedError
