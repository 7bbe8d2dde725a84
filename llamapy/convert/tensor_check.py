"""The checkpoint's weights against its config.json, from the safetensors headers alone,
before a byte of tensor data is read or anything is sized by a config number.

The shapes a GGUF file's tensors must have are the ones llamapy's loader checks
(`llamapy.arch`'s tensor_specs, llama.cpp's create_tensor shapes): the check here asks the
same registry, with the hyper-parameters config.json gives, so a checkpoint that passes
converts into a file that loads. A mismatch is one line naming the config keys that set the
tensor's shape. The layer count is checked against the layers the weights hold before any
per-layer list is made, so num_hidden_layers 1e9 costs nothing.
"""
from __future__ import annotations

from pathlib import Path

from llamapy.arch import Architecture
from llamapy.errors import CheckpointError
from llamapy.hparams import HParams

from . import architectures as A
from .checkpoint import Checkpoint
from .config import TextConfig
from .safetensors import StTensor

# the config.json keys that set the shape of each kind of GGUF tensor (the others: hidden_size)
_SHAPE_KEYS = {
    "token_embd": ("vocab_size", "hidden_size"), "output": ("vocab_size", "hidden_size"),
    "attn_q": ("num_attention_heads", "head_dim", "hidden_size"),
    "attn_k": ("num_key_value_heads", "head_dim", "hidden_size"),
    "attn_v": ("num_key_value_heads", "head_dim", "hidden_size"),
    "attn_output": ("hidden_size", "num_attention_heads", "head_dim"),
    "attn_q_norm": ("head_dim",), "attn_k_norm": ("head_dim",),
    "ffn_gate": ("intermediate_size", "hidden_size"), "ffn_up": ("intermediate_size", "hidden_size"),
    "ffn_down": ("hidden_size", "intermediate_size"),
}


def text_tensors(arch: Architecture, ckpt: Checkpoint, cfg: TextConfig) -> dict[str, tuple[str, StTensor]]:
    """GGUF name -> (checkpoint name, tensor) of every tensor converted, each one the
    architecture reads with the shape config.json implies, none missing; CheckpointError with
    one line (naming the config key where one is at fault) otherwise."""
    config = ckpt.path / "config.json"
    text = {hf: name for hf in ckpt.tensors if (name := A.text_tensor_name(hf)) is not None
            and not name.endswith(A.UNUSED_SUFFIXES)}
    _check_layer_count(config, cfg.num_hidden_layers, text.values())
    named: dict[str, tuple[str, StTensor]] = {}
    for hf, name in text.items():
        gguf = A.gguf_name(arch, name, cfg.num_hidden_layers)
        if gguf in named:
            raise CheckpointError(f"{ckpt.path}: {named[gguf][0]} and {hf} are both {gguf}")
        named[gguf] = hf, ckpt.tensors[hf]
    specs = arch.tensor_specs(runtime_hparams(arch, cfg))
    for gguf, (hf, st) in named.items():
        spec = specs.get(gguf)
        if spec is None:
            raise CheckpointError(f"{st.path}: {hf} ({gguf}) is not part of a {arch.name} model as llamapy runs it")
        expected = tuple(reversed(spec.ne))
        if st.shape != expected:
            raise CheckpointError(f"{config}: {_keys(cfg, ckpt.config, gguf)} make {hf} {list(expected)}, but "
                                  f"{st.path.name} has it as {list(st.shape)}")
    missing = [gguf for gguf, spec in specs.items() if spec.required and gguf not in named]
    if missing:
        raise CheckpointError(f"{ckpt.path}: the weights have no {A.hf_name(arch, missing[0])}"
                              + (f" (and {len(missing) - 1} more tensors a {arch.name} model needs)"
                                 if len(missing) > 1 else ""))
    return named


def check_vocabulary(arch: Architecture, cfg: TextConfig, named: dict[str, tuple[str, StTensor]],
                     n_vocab: int, config: Path) -> None:
    """The token count the tokenizer gave is the rows of the embeddings as converted (gemma3's
    embedding is cut to the tokenizer's tokens, its other tensors are not)."""
    for gguf, (hf, st) in named.items():
        if gguf in ("token_embd.weight", "output.weight"):
            rows = min(st.shape[0], n_vocab) if arch.hf.norm_shift and gguf == "token_embd.weight" else st.shape[0]
            if rows != n_vocab:
                raise CheckpointError(f"{config}: the tokenizer has {n_vocab} tokens, but vocab_size is "
                                      f"{cfg.vocab_size}: {hf} has {st.shape[0]} rows, one per token")


def runtime_hparams(arch: Architecture, cfg: TextConfig) -> HParams:
    """The hyper-parameters llamapy's loader reads from the converted file (those that set
    tensor shapes), with config.json's vocab_size as the token count."""
    head = cfg.head_size
    return HParams(arch=arch.name, n_vocab=cfg.vocab_size, n_ctx_train=cfg.max_position_embeddings,
                   n_embd=cfg.hidden_size, n_layer=cfg.num_hidden_layers, n_head=cfg.num_attention_heads,
                   n_head_kv=cfg.n_kv_heads, n_ff=cfg.intermediate_size, n_embd_head_k=head, n_embd_head_v=head,
                   n_rot=head, norm_rms_eps=cfg.rms_norm_eps, rope_freq_base=10000.0, rope_freq_scale=1.0,
                   rope_type=0)


def _check_layer_count(config: Path, n_layers: int, names) -> None:
    """num_hidden_layers is the number of layers the weights hold, 0 to n - 1 each present."""
    layers = set()
    for name in names:
        parts = name.split(".", 3)
        if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdecimal():
            layers.add(int(parts[2]))
    if n_layers != len(layers) or (layers and max(layers) != n_layers - 1):
        held = (f"the weights hold {len(layers)} (model.layers.{min(layers)} to model.layers.{max(layers)})"
                if layers else "the weights hold none (no model.layers.N tensors)")
        raise CheckpointError(f"{config}: num_hidden_layers is {n_layers}, but {held}")


def _keys(cfg: TextConfig, config: dict, gguf: str) -> str:
    """"vocab_size 1000 and hidden_size 64": the keys setting a tensor's shape, with their values."""
    kind = gguf.split(".")[-2]
    values = {"num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_size}
    text = config.get("text_config") or {}
    parts = []
    for key in _SHAPE_KEYS.get(kind, ("hidden_size",)):
        name = f"text_config.{key}" if key in text else key
        if key == "head_dim" and cfg.head_dim is None:
            name = "the head size (hidden_size / num_attention_heads)"
        if key == "num_key_value_heads" and cfg.num_key_value_heads is None:
            name = "num_key_value_heads (num_attention_heads)"
        parts.append(f"{name} {values.get(key, getattr(cfg, key))}")
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
