"""Which type each tensor gets: llama.cpp's choice (src/llama-quant.cpp), rule for rule.

- `allows_quantization`: only 2-d and 3-d tensors whose name ends in "weight", and not the
  norms, positional embeddings, MoE gates and the other small tables llama.cpp keeps;
- a file type's mix (`TypeChooser`): output.weight (and token_embd when it is the output too)
  in Q6_K, or Q8_0 when its rows do not fit a 256 block; attn_v and ffn_down with more
  bits in the "use_more_bits" layers of Q4_K_M / Q5_K_M (the first and last eighth and every
  third between); the other per-file-type bumps of attn_v, ffn_down, attn_output and attn_qkv;
- the fallbacks when a row is not a whole number of blocks (Q4_K -> Q5_0, Q5_K -> Q5_1,
  Q6_K -> Q8_0, Q2_K/Q3_K -> Q4_0, then F16), each one said as llama.cpp says it.

Counters advance in the order tensors are visited (attn_v's index, ffn_down's), so the
caller visits them in llama.cpp's order (`tensor_order`). Branches that only the IQ (but
IQ4_NL), TQ and MXFP4 file types reach (which llamapy does not write) are left out.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum, auto

from ggmlpy import GGMLType
from ggmlpy.types import TYPE_TRAITS, traits

from ..errors import InputError, UnsupportedModelError
from ..gguf_file import MetaValue, ValueType, typed_scalar
from ..hparams import check_block_count
from .ftypes import FileType

F = FileType
T = GGMLType

# the tensor types llamapy can write (ggml_quantize_chunk's, less the ones without a quantizer here)
WRITABLE = frozenset({T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K,
                      T.Q5_K, T.Q6_K, T.IQ4_NL})


def parse_tensor_type(text: str, what: str) -> GGMLType:
    """A ggml type name as llama-quantize reads it (ggml_type_name, any case: q4_K, f16, bf16)."""
    for t, tr in TYPE_TRAITS.items():
        if tr.name.lower() == text.lower():
            if t not in WRITABLE:
                break
            return t
    names = ", ".join(traits(t).name for t in sorted(WRITABLE))
    raise InputError(f"{what} {text!r}: not a tensor type llamapy writes ({names})")


class Category(Enum):
    TOKEN_EMBD = auto()
    ATTENTION_Q = auto()
    ATTENTION_V = auto()
    ATTENTION_K = auto()
    ATTENTION_QKV = auto()
    ATTENTION_KV_B = auto()
    ATTENTION_OUTPUT = auto()
    FFN_UP = auto()
    FFN_GATE = auto()
    FFN_DOWN = auto()
    OUTPUT = auto()
    OTHER = auto()


_BY_SUBSTRING = (("attn_qkv.weight", Category.ATTENTION_QKV), ("attn_kv_b.weight", Category.ATTENTION_KV_B),
                 ("attn_v.weight", Category.ATTENTION_V), ("attn_k.weight", Category.ATTENTION_K),
                 ("attn_q.weight", Category.ATTENTION_Q), ("attn_output.weight", Category.ATTENTION_OUTPUT),
                 ("ffn_up", Category.FFN_UP), ("ffn_gate", Category.FFN_GATE), ("ffn_down", Category.FFN_DOWN))
_ATTN_V_LIKE = (Category.ATTENTION_V, Category.ATTENTION_QKV, Category.ATTENTION_KV_B)


def category_of(name: str) -> Category:
    """tensor_get_category: the first of llama.cpp's name tests that matches."""
    if name == "output.weight":
        return Category.OUTPUT
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return Category.TOKEN_EMBD
    return next((cat for part, cat in _BY_SUBSTRING if part in name), Category.OTHER)


# name parts llama.cpp never quantizes (small or sensitive tables)
_KEPT = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel", "per_layer_model_proj",
         "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight", "indexer.q_proj.weight",
         "time_mix_first.weight", "time_mix_w0.weight", "time_mix_w1.weight", "time_mix_w2.weight",
         "time_mix_v0.weight", "time_mix_v1.weight", "time_mix_v2.weight", "time_mix_a0.weight", "time_mix_a1.weight",
         "time_mix_a2.weight", "time_mix_g1.weight", "time_mix_g2.weight", "time_mix_decay_w1.weight",
         "time_mix_decay_w2.weight", "time_mix_lerp_fused.weight", "attn_rel_b.weight", ".position_embd",
         "sam.pos_embd", "sam.neck.", "sam.net_", ".rel_pos", ".patch_embd", ".patch_merger", "a.rvq.codebook",
         "mm.a.code_embd")
_KEPT_GLM5_NEXT = ("hc_", "indexer.attn_q_b", "indexer.attn_k", "indexer.proj", "indexer_compressor_gate",
                   "indexer_compressor_ape", "ssm_f_a.weight", "ssm_f_b.weight", "ssm_g_a.weight", "ssm_g_b.weight",
                   "ssm_beta.weight", "attn_kv_a_mqa.weight", "attn_k_b.weight", "attn_v_b.weight")


def allows_quantization(name: str, n_dims: int, arch: str, quantize_output: bool = True,
                        only_copy: bool = False) -> bool:
    """tensor_allows_quantization: whether llama.cpp would change this tensor's type at all."""
    if only_copy or n_dims < 2 or not name.endswith("weight"):
        return False
    if not quantize_output and name == "output.weight":
        return False
    if name in ("position_embd.weight", "token_types.weight"):
        return False
    kept = _KEPT + (_KEPT_GLM5_NEXT if arch == "glm5-next" else ())
    return not any(part in name for part in kept)


def ggml_n_dims(ne: Sequence[int]) -> int:
    """ggml_n_dims: dimensions up to the last one above 1 (at least 1)."""
    return max([i + 1 for i, n in enumerate(ne) if n > 1] or [1])


@dataclass(frozen=True)
class ModelFacts:
    """What llama.cpp's choice reads of the model's hyper-parameters."""

    arch: str
    n_layer: int
    n_expert: int = 0
    n_gqa: int = 1
    is_70b: bool = False  # LLM_TYPE_70B: 8 query heads share each attn_v, which gets more bits

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, MetaValue], where: str, n_tensors: int | None = None) -> ModelFacts:
        """The facts of a model's metadata; with `n_tensors` (the file's tensor count), a block
        count the tensors cannot hold is refused as the model loader refuses it."""
        def number(key: str, default: int | None) -> int:
            v = metadata.get(key)
            if v is not None and v.type == ValueType.ARRAY:  # an array per layer: llama.cpp's n_head(0) reads layer 0
                values = list(v.value)
                if not values:
                    raise UnsupportedModelError(f"{where}: metadata {key} is an empty array")
                return int(values[0])
            value = typed_scalar(metadata, key, int, where)
            if value is None:
                if default is None:
                    raise UnsupportedModelError(f"{where}: required metadata key {key!r} is missing")
                return default
            return value

        arch = typed_scalar(metadata, "general.architecture", str, where)
        if arch is None:
            raise UnsupportedModelError(f"{where}: required metadata key 'general.architecture' is missing")
        n_layer = number(f"{arch}.block_count", None)
        if n_tensors is not None:
            check_block_count(n_layer, n_tensors, where, f"{arch}.block_count")
        n_head = number(f"{arch}.attention.head_count", 0)
        n_head_kv = number(f"{arch}.attention.head_count_kv", n_head)
        # llama.cpp's model types that matter here: 80-layer llama with grouped K/V heads, 80-layer qwen2
        is_70b = n_layer == 80 and ((arch == "llama" and n_head != n_head_kv) or arch == "qwen2")
        return cls(arch, n_layer, number(f"{arch}.expert_count", 0), n_head // n_head_kv if n_head_kv else 0, is_70b)


def layer_of(name: str) -> int | None:
    """The layer sscanf(name, "blk.%d.") reads, as llama.cpp reads it (None for no layer)."""
    m = re.match(r"blk\.\s*([+-]?\d+)", name)
    return int(m.group(1)) if m else None


def tensor_order(names: Sequence[str]) -> list[str]:
    """The order llama-quantize visits and writes tensors in (the loader's weight_name_comparer):
    by layer (tensors outside the blocks first), then by name."""
    def key(name: str) -> tuple[int, bytes]:
        layer = layer_of(name)
        return (-1 if layer is None else layer), name.encode("utf-8", "surrogateescape")
    return sorted(names, key=key)


@dataclass
class Fallback:
    """A tensor whose rows do not fit its type's blocks, and the type it gets instead."""

    name: str
    ncols: int
    wanted: GGMLType
    used: GGMLType

    def __str__(self) -> str:
        shape = "(WARNING: must use F16 due to unusual shape) " if self.used == T.F16 else ""
        return (f"{self.name:<36} - ncols {self.ncols:6d} not divisible by {traits(self.wanted).blck_size:3d} "
                f"(required for type {traits(self.wanted).name:>7}) {shape}-> falling back to "
                f"{traits(self.used).name:>7}")


_FALLBACK = {T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


@dataclass
class TypeChooser:
    """llama.cpp's quantize_state_impl and llama_tensor_get_type: call `choose` for every
    tensor in `tensor_order`; `fallbacks` collects the tensors that could not take their type."""

    facts: ModelFacts
    ftype: FileType
    default_type: GGMLType
    names: Sequence[str]
    pure: bool = False
    quantize_output: bool = True
    only_copy: bool = False
    output_tensor_type: GGMLType | None = None
    token_embedding_type: GGMLType | None = None
    tensor_types: Sequence[tuple[str, GGMLType]] = ()  # (regex searched in the name, type): the first match wins
    on_override: Callable[[str], None] | None = None
    fallbacks: list[Fallback] = field(default_factory=list)

    def __post_init__(self) -> None:
        categories = [category_of(name) for name in self.names]
        self.n_attention_wv = sum(cat in _ATTN_V_LIKE for cat in categories)
        self.tied_embeddings = Category.OUTPUT not in categories
        self.n_ffn_down = self.n_ffn_gate = self.n_ffn_up = self.facts.n_layer
        self.i_attention_wv = self.i_ffn_down = self.i_ffn_gate = self.i_ffn_up = 0
        self._patterns = [(re.compile(pattern), t) for pattern, t in self.tensor_types]

    def allows(self, name: str, ne: Sequence[int]) -> bool:
        return allows_quantization(name, ggml_n_dims(ne), self.facts.arch, self.quantize_output, self.only_copy)

    def choose(self, name: str, ne: Sequence[int], current: GGMLType) -> GGMLType:
        """The type `name` (dimensions `ne`, now of type `current`) is written in."""
        if not self.allows(name, ne):
            return current
        category = category_of(name)
        if self.token_embedding_type is not None and category == Category.TOKEN_EMBD:
            if name != "per_layer_token_embd.weight" or not any(p.search(name) for p, _ in self._patterns):
                return self.token_embedding_type
        if self.output_tensor_type is not None and category == Category.OUTPUT:
            return self.output_tensor_type
        new_type = self.default_type
        if not traits(new_type).is_quantized:
            return new_type
        manual = False
        for pattern, t in self._patterns:
            if pattern.search(name):
                if t != new_type and self.on_override is not None:
                    self.on_override(f"llama_tensor_get_type: {name:<36} - applying manual override: "
                                     f"{traits(new_type).name} -> {traits(t).name}")
                new_type, manual = t, True
                break
        if not manual and not self.pure:
            new_type = self._mix(new_type, name, ne, category)
        return self._fallback(name, ne[0], new_type)

    def _fallback(self, name: str, ncols: int, wanted: GGMLType) -> GGMLType:
        block = traits(wanted).blck_size
        if ncols % block == 0:
            return wanted
        used = _FALLBACK.get(wanted, wanted)
        if ncols % traits(used).blck_size:
            used = T.F16
        self.fallbacks.append(Fallback(name, ncols, wanted, used))
        return used

    def _layer(self, counter: int, n_layer: int, name: str) -> tuple[int, int]:
        """layer_info: the counter, or with experts the layer in the name."""
        if max(1, self.facts.n_expert) > 1:
            layer = layer_of(name)
            if layer is None:
                raise UnsupportedModelError(f"failed to determine the layer of tensor {name}")
            counter = layer
            if not 0 <= counter < n_layer:
                raise UnsupportedModelError(f"bad layer {counter} for tensor {name}: must be in [0, {n_layer})")
        return counter, n_layer

    def _mix(self, new_type: GGMLType, name: str, ne: Sequence[int], category: Category) -> GGMLType:
        """llama_tensor_get_type_impl, for the file types llamapy writes."""
        ft, facts = self.ftype, self.facts
        falcon = facts.arch == "falcon"
        if category == Category.OUTPUT or (self.tied_embeddings and category == Category.TOKEN_EMBD):
            if self.output_tensor_type is not None:
                return self.output_tensor_type
            if falcon or ne[0] % traits(new_type).blck_size:
                return T.Q8_0
            return T.Q6_K if new_type != T.Q8_0 else new_type
        if category == Category.TOKEN_EMBD:
            return self.token_embedding_type if self.token_embedding_type is not None else new_type
        if category in _ATTN_V_LIKE:
            i, n = self.i_attention_wv, self.n_attention_wv
            if ft == F.MOSTLY_Q2_K:
                new_type = T.Q4_K if facts.n_gqa >= 4 else T.Q3_K
            elif ft == F.MOSTLY_Q3_K_M:
                new_type = T.Q5_K if i < 2 else T.Q4_K
            elif ft == F.MOSTLY_Q3_K_L:
                new_type = T.Q5_K
            elif ft == F.MOSTLY_IQ4_NL and facts.n_gqa >= 4:
                new_type = T.Q5_K
            elif ft in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M) and _use_more_bits(i, n):
                new_type = T.Q6_K
            elif ft == F.MOSTLY_Q4_K_S and i < 4:
                new_type = T.Q5_K
            if facts.is_70b and new_type in (T.Q3_K, T.Q4_K):
                new_type = T.Q5_K
            if facts.n_expert == 8:
                new_type = T.Q8_0
            self.i_attention_wv += 1
        elif category == Category.ATTENTION_K:
            if facts.n_expert == 8:
                new_type = T.Q8_0
        elif category == Category.FFN_DOWN:
            i_layer, n_layer = self._layer(self.i_ffn_down, self.n_ffn_down, name)
            if ft == F.MOSTLY_Q2_K:
                new_type = T.Q3_K
            elif ft == F.MOSTLY_Q3_K_M:
                new_type = (T.Q5_K if i_layer < n_layer // 16
                            else T.Q4_K if not falcon or _use_more_bits(i_layer, n_layer) else T.Q3_K)
            elif ft == F.MOSTLY_Q3_K_L:
                new_type = T.Q4_K if falcon else T.Q5_K
            elif ft == F.MOSTLY_Q4_K_M:
                if falcon:
                    new_type = (T.Q6_K if i_layer < n_layer // 16
                                else T.Q5_K if _use_more_bits(i_layer, n_layer) else T.Q4_K)
                elif _use_more_bits(i_layer, n_layer):
                    new_type = T.Q6_K
            elif ft == F.MOSTLY_IQ4_NL and i_layer < n_layer // 8:  # without an importance matrix
                new_type = T.Q5_K
            elif ft == F.MOSTLY_Q5_K_M and _use_more_bits(i_layer, n_layer):
                new_type = T.Q6_K
            elif ft == F.MOSTLY_Q4_K_S and not falcon and i_layer < n_layer // 8:
                new_type = T.Q5_K
            self.i_ffn_down += 1
        elif category == Category.ATTENTION_OUTPUT:
            if not falcon:
                if facts.n_expert == 8:
                    if ft in (F.MOSTLY_Q2_K, F.MOSTLY_Q3_K_S, F.MOSTLY_Q3_K_M, F.MOSTLY_IQ4_NL, F.MOSTLY_Q4_K_S,
                              F.MOSTLY_Q4_K_M):
                        new_type = T.Q5_K
                else:
                    new_type = {F.MOSTLY_Q2_K: T.Q3_K, F.MOSTLY_Q3_K_M: T.Q4_K, F.MOSTLY_Q3_K_L: T.Q5_K}.get(ft, new_type)
            elif ft == F.MOSTLY_Q3_K_L:
                new_type = T.Q4_K
        elif category == Category.FFN_GATE:
            self._layer(self.i_ffn_gate, self.n_ffn_gate, name)
            self.i_ffn_gate += 1
        elif category == Category.FFN_UP:
            self._layer(self.i_ffn_up, self.n_ffn_up, name)
            self.i_ffn_up += 1
        return new_type
