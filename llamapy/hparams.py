"""Model hyper-parameters, read from GGUF metadata with llama.cpp's keys and defaults."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from .errors import ModelLoadError, UnsupportedModelError
from .gguf_file import FLOAT32_MAX, GGUFMetadata


@dataclass
class HParams:
    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_embd_head_k: int
    n_embd_head_v: int
    n_rot: int
    norm_rms_eps: float
    rope_freq_base: float
    rope_freq_scale: float
    rope_type: int  # ggmlpy.ROPE_TYPE_NORM or ROPE_TYPE_NEOX
    # per-layer sliding window (0: full attention); architectures without SWA leave it empty
    swa_layers: list[bool] = field(default_factory=list)
    n_swa: int = 0
    rope_freq_base_swa: float = 10000.0
    # Q is multiplied by this before attention (0: attention scales by 1/sqrt(head_dim) itself)
    f_attention_scale: float = 0.0

    @property
    def n_embd_k_gqa(self) -> int:
        return self.n_embd_head_k * self.n_head_kv

    @property
    def n_embd_v_gqa(self) -> int:
        return self.n_embd_head_v * self.n_head_kv

    def is_swa(self, il: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[il]

    def n_swa_of(self, il: int) -> int:
        """The sliding window of layer il (0: the layer attends to the whole context)."""
        return self.n_swa if self.is_swa(il) else 0

    def rope_base_of(self, il: int) -> float:
        return self.rope_freq_base_swa if self.is_swa(il) else self.rope_freq_base

    def check_finite(self, where: object) -> None:
        """Every float parameter, derived ones included (1 / rope.scaling.factor), is a finite
        float32: ggml computes with them as such, and an infinity would make every logit NaN."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
                raise ModelLoadError(f"{where}: hyper-parameter {f.name} = {value!r} is not a finite float32")

    def set_swa_pattern(self, n_pattern: int) -> None:
        """Every n_pattern-th layer attends globally, the others through the window
        (llama_hparams::set_swa_pattern; n_pattern 0: every layer uses the window)."""
        self.swa_layers = [n_pattern == 0 or il % n_pattern < n_pattern - 1 for il in range(self.n_layer)]


def check_block_count(n_layer: int, n_tensors: int, where: object, key: str) -> None:
    """Every layer has tensors: a block count above the file's tensor count (10^9 in a small
    file) is refused before anything is planned or allocated for layers the file cannot hold."""
    if n_layer < 1:
        raise ModelLoadError(f"{where}: metadata {key} = {n_layer} is out of range (a model has at least 1 layer)")
    if n_layer > n_tensors:
        raise ModelLoadError(f"{where}: {key} = {n_layer}, but the file holds only {n_tensors} tensors")


def read_common(f: GGUFMetadata, arch: str, n_vocab: int, rope_type: int) -> HParams:
    """The keys every transformer architecture shares (LLM_KV_* in llama.cpp), each of its
    type and in its range, and the relations between them that the graph relies on."""
    def key(name: str) -> str:
        return f"{arch}.{name}"

    n_embd = f.get_int(key("embedding_length"), at_least=1)
    n_head = f.get_int(key("attention.head_count"), at_least=1)
    n_layer = f.get_int(key("block_count"), at_least=1)
    check_block_count(n_layer, len(f.tensors), f.path, key("block_count"))
    if n_embd % n_head and not (f.has(key("attention.key_length")) and f.has(key("attention.value_length"))):
        raise UnsupportedModelError(f"{f.path}: n_embd {n_embd} is not divisible by n_head {n_head}")
    n_head_kv = f.get_int(key("attention.head_count_kv"), n_head, at_least=1)
    if n_head % n_head_kv:
        raise UnsupportedModelError(f"{f.path}: n_head {n_head} is not a multiple of n_head_kv {n_head_kv}")
    head_k = f.get_int(key("attention.key_length"), n_embd // n_head, at_least=1)
    head_v = f.get_int(key("attention.value_length"), n_embd // n_head, at_least=1)
    n_rot = f.get_int(key("rope.dimension_count"), head_k, at_least=2, at_most=head_k)
    if n_rot % 2:
        raise ModelLoadError(f"{f.path}: {key('rope.dimension_count')} = {n_rot} is odd: RoPE rotates pairs")
    # 0 means no scaling, as in llama.cpp
    scaling = (f.get_float(key("rope.scaling.factor"), 0.0, at_least=0.0)
               or f.get_float(key("rope.scale_linear"), 0.0, at_least=0.0))
    return HParams(
        arch=arch,
        n_vocab=n_vocab,
        n_ctx_train=f.get_int(key("context_length"), at_least=1),
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ff=f.get_int(key("feed_forward_length"), at_least=1),
        n_embd_head_k=head_k,
        n_embd_head_v=head_v,
        n_rot=n_rot,
        norm_rms_eps=f.get_float(key("attention.layer_norm_rms_epsilon"), 1e-5, above=0.0),
        # angles are pos * base^(-2i/n_rot): a base below 1 would grow them without bound
        rope_freq_base=f.get_float(key("rope.freq_base"), 10000.0, at_least=1.0),
        rope_freq_scale=1.0 / scaling if scaling else 1.0,
        rope_type=rope_type,
    )
