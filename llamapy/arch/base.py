"""What an architecture provides: its hyper-parameters, its weights, its graph.

Adding an architecture is one module in this package that subclasses `Architecture`,
decorates it with `@register` and is imported in `__init__.py`. Its class is the family's one
record, read by the runtime (model.py), the converter (its `hf`: hf.py), `new_model`
(from_scratch.py), the tensor validator and the command lines' help texts (`listing`). It
reads its hyper-parameters (most through `hparams.read_common`), names the tensors it needs
and those it uses when present (their shapes from `Architecture.shapes`), and builds one
ubatch's graph from the shared pieces of `GraphBuilder` (whose `mm` adds a projection's bias
whenever the model has one).

A file's tensors must all be known to its architecture: a tensor llamapy would not read
changes the model llama.cpp computes (Llama 3's `rope_freqs.weight`, a bias), so loading
refuses it with one line instead of computing another model. So does a tensor whose
shape is not the one the hyper-parameters imply, or whose type the graph cannot use for its
role (model.model_from checks both before any graph is built).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..gguf_file import GGUFMetadata
from ..hparams import HParams
from .hf import HFConversion

ARCHITECTURES: dict[str, type["Architecture"]] = {}

# Tensors that are fixed by the model's design, not learned: never trained.
FIXED_TENSORS = frozenset({"rope_freqs.weight"})


@dataclass(frozen=True)
class TensorSpec:
    """A tensor an architecture reads: its shape (ggml order, ne0 first) and whether every
    file must carry it."""

    ne: tuple[int, ...]
    required: bool


def register(cls: type["Architecture"]) -> type["Architecture"]:
    if "hf" not in vars(cls):  # config.json class names belong to one family: a subclass converts only its own
        cls.hf = None
    ARCHITECTURES[cls.name] = cls
    return cls


def listing(last: str = ", ", converted: bool = False) -> str:
    """The registered architectures' GGUF names in registration order, for help texts and
    messages: "llama, qwen2, qwen3, gemma3"; `last` " and " gives "llama, qwen2, qwen3 and
    gemma3". `converted`: only those llamapy-convert converts (their `hf` set)."""
    known = [name for name, cls in ARCHITECTURES.items() if cls.hf is not None or not converted]
    return last.join([", ".join(known[:-1]), known[-1]]) if len(known) > 1 else "".join(known)


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
    # converting Hugging Face checkpoints of this family (None: llamapy-convert does not)
    hf: HFConversion | None = None
    # new_model: the head size written as attention.key_length / value_length even when it is
    # n_embd / n_head (as the family's converter writes it); the output projection tied to the
    # embeddings; the sliding window of the local-attention layers (None: the family has none)
    head_dim_in_metadata = False
    ties_output = False
    default_sliding_window: int | None = None

    def read_hparams(self, f: GGUFMetadata, n_vocab: int) -> HParams:
        raise NotImplementedError

    def shapes(self, hp: HParams) -> dict[str, tuple[int, ...]]:
        """The shape of each weight (by name without "blk.{il}." and ".weight") that the
        hyper-parameters imply, in ggml's order (a matrix's ne0 is its inputs): llama.cpp's
        create_tensor shapes. A bias has one value per output of its matrix."""
        n_embd, n_ff, n_q, head_k = hp.n_embd, hp.n_ff, hp.n_embd_head_k * hp.n_head, hp.n_embd_head_k
        return {
            "token_embd": (n_embd, hp.n_vocab), "output": (n_embd, hp.n_vocab), "output_norm": (n_embd,),
            "rope_freqs": (hp.n_rot // 2,),
            "attn_norm": (n_embd,), "attn_q": (n_embd, n_q), "attn_k": (n_embd, hp.n_embd_k_gqa),
            "attn_v": (n_embd, hp.n_embd_v_gqa), "attn_output": (n_q, n_embd),
            "attn_q_norm": (head_k,), "attn_k_norm": (head_k,), "post_attention_norm": (n_embd,),
            "ffn_norm": (n_embd,), "ffn_gate": (n_embd, n_ff), "ffn_up": (n_embd, n_ff), "ffn_down": (n_ff, n_embd),
            "post_ffw_norm": (n_embd,),
        }

    def tensor_specs(self, hp: HParams) -> dict[str, TensorSpec]:
        """Every tensor a model of this architecture may carry, by GGUF name, with its shape
        and whether it is required (the others are used when present)."""
        shapes = self.shapes(hp)
        specs: dict[str, TensorSpec] = {}

        def add(prefix: str, kind: str, required: bool, suffix: str = "weight") -> None:
            specs[f"{prefix}{kind}.{suffix}"] = TensorSpec(shapes[kind] if suffix == "weight" else shapes[kind][1:],
                                                           required)

        for t in self.global_tensors:
            add("", t, True)
        for il in range(hp.n_layer):
            blk = f"blk.{il}."
            for t in self.layer_tensors:
                add(blk, t, True)
            for t in self.layer_biases:
                add(blk, t, True, "bias")
            for t in self.optional_layer_biases:
                add(blk, t, False, "bias")
        for name in self.optional_global_tensors:
            add("", name.removesuffix(".weight"), False)
        return specs

    def build(self, g, model):
        """Add the forward graph of one ubatch to GraphBuilder `g`, ending with
        `g.output(output weight, last hidden state)`; return what that returns (the logits,
        or None in a training window's graph, whose loss takes the output layer)."""
        raise NotImplementedError
