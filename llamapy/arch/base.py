"""What an architecture provides: its hyper-parameters, its weights, its graph.

Adding an architecture is one module in this package that subclasses `Architecture`,
decorates it with `@register` and is imported in `__init__.py`: it reads its
hyper-parameters (most through `hparams.read_common`), names the tensors it needs and
those it uses when present, and builds one ubatch's graph from the shared pieces of
`GraphBuilder` (whose `mm` adds a projection's bias whenever the model has one).

A file's tensors must all be known to its architecture: a tensor llamapy would not read
changes the model llama.cpp computes (Llama 3's `rope_freqs.weight`, a bias), so loading
refuses it with one line instead of computing another model.
"""
from __future__ import annotations

from ..gguf_file import GGUFMetadata
from ..hparams import HParams

ARCHITECTURES: dict[str, type["Architecture"]] = {}

# Tensors that are fixed by the model's design, not learned: never trained.
FIXED_TENSORS = frozenset({"rope_freqs.weight"})


def register(cls: type["Architecture"]) -> type["Architecture"]:
    ARCHITECTURES[cls.name] = cls
    return cls


class Architecture:
    name = ""
    bos_in_every_window = False  # training windows start with BOS (models that score badly without it)
    # ".weight" tensors every model of this architecture has: once, and once per layer ("blk.{il}." + name)
    global_tensors: tuple[str, ...] = ("token_embd", "output_norm")
    layer_tensors: tuple[str, ...] = ()
    # ".bias" tensors every layer has, and those used when the file has them (llama.cpp's TENSOR_NOT_REQUIRED)
    layer_biases: tuple[str, ...] = ()
    optional_layer_biases: tuple[str, ...] = ()
    # whole tensor names used when present: the output projection (else tied to the embeddings), ...
    optional_global_tensors: tuple[str, ...] = ("output.weight",)

    def read_hparams(self, f: GGUFMetadata, n_vocab: int) -> HParams:
        raise NotImplementedError

    def required_tensors(self, hp: HParams) -> list[str]:
        """Names that must be present in the file (checked at load, for one clear error)."""
        names = [f"{t}.weight" for t in self.global_tensors]
        for il in range(hp.n_layer):
            names += [f"blk.{il}.{t}.weight" for t in self.layer_tensors]
            names += [f"blk.{il}.{t}.bias" for t in self.layer_biases]
        return names

    def optional_tensors(self, hp: HParams) -> list[str]:
        """Names the graph uses when the file has them."""
        names = list(self.optional_global_tensors)
        for il in range(hp.n_layer):
            names += [f"blk.{il}.{t}.bias" for t in self.optional_layer_biases]
        return names

    def build(self, g, model):
        """Add the forward graph of one ubatch to GraphBuilder `g`, ending with
        `g.output(output weight, last hidden state)`; return what that returns (the logits,
        or None in a training window's graph, whose loss takes the output layer)."""
        raise NotImplementedError
