"""How a Hugging Face checkpoint of an architecture becomes GGUF: the part of an
architecture's record that llamapy-convert and the PEFT adapter converter read.

It lives with the architecture (its module sets `Architecture.hf`) so that a family is one
module: the converter (llamapy/convert/architectures.py) holds only what every family shares
and calls the hooks here for the rest. Plain data and callables: nothing here imports the
converter, so loading a model never loads pydantic or the safetensors reader.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import CheckpointError

# transformers' module names inside model.layers.N -> GGUF names inside blk.N, shared by the families
COMMON_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
                "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
QK_NORM_LAYER = {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}

# (meta, config.json's values, their RoPE parameters): metadata keys the family's converter adds
HParamsWriter = Callable[[Any, dict, dict], None]
# (config.json's values, their RoPE parameters) -> (GGUF name, values when asked) of tensors convert adds
ExtraTensors = Callable[[dict, dict], Iterator[tuple[str, Callable[[], np.ndarray]]]]


@dataclass(frozen=True)
class HFConversion:
    """One family's conversion: its data, and hooks for what only it writes."""

    names: tuple[str, ...]  # config.json "architectures" class names converted as this architecture
    layer: Mapping[str, str]  # module inside model.layers.N -> GGUF name inside blk.N
    defaults: Mapping[str, Any] = field(default_factory=dict)  # transformers' config class defaults
    config_record: str = "TextConfig"  # the record in llamapy.convert.config that checks config.json
    permute_qk: bool = False  # llama: Q and K rows from HF's rotate-half order to GGUF's interleaved pairs
    norm_shift: bool = False  # gemma3: RMSNorm weights stored minus 1, embedding rows cut to the tokenizer's
    derived_heads: bool = False  # llama: num_key_value_heads and head_dim written even when config.json omits them
    # the tokenizer path of convert_hf_to_gguf.py's set_vocab: "llama" (LlamaModel's: SentencePiece,
    # else BPE, CodeLlama's infill tokens), "spm-or-bpe" (tokenizer.model, else BPE), "gemma" (the
    # same, no space prefix, BPE counted from tokenizer.json)
    tokenizer: str = "spm-or-bpe"
    write_hparams: HParamsWriter | None = None  # after the keys every family writes
    extra_tensors: ExtraTensors | None = None  # written before the checkpoint's tensors


def require(hp: dict, key: str) -> Any:
    """config.json's value for `key`; CheckpointError when it has none."""
    if hp.get(key) is None:
        raise CheckpointError(f"config.json has no {key}")
    return hp[key]
