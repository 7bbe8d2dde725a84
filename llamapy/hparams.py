"""Model hyper-parameters, read from GGUF metadata with llama.cpp's keys and defaults."""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import UnsupportedModelError
from .gguf_file import GGUFMetadata


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

    def set_swa_pattern(self, n_pattern: int) -> None:
        """Every n_pattern-th layer attends globally, the others through the window
        (llama_hparams::set_swa_pattern; n_pattern 0: every layer uses the window)."""
        self.swa_layers = [n_pattern == 0 or il % n_pattern < n_pattern - 1 for il in range(self.n_layer)]


def read_common(f: GGUFMetadata, arch: str, n_vocab: int, rope_type: int) -> HParams:
    """The keys every transformer architecture shares (LLM_KV_* in llama.cpp)."""
    def key(name: str) -> str:
        return f"{arch}.{name}"

    n_embd = int(f.require(key("embedding_length")))
    n_head = int(f.require(key("attention.head_count")))
    if n_head <= 0 or (n_embd % n_head and not f.has(key("attention.key_length"))):
        raise UnsupportedModelError(f"{f.path}: n_embd {n_embd} is not divisible by n_head {n_head}")
    n_head_kv = int(f.get(key("attention.head_count_kv"), n_head))
    head_k = int(f.get(key("attention.key_length"), n_embd // n_head))
    head_v = int(f.get(key("attention.value_length"), n_embd // n_head))
    if n_head % n_head_kv:
        raise UnsupportedModelError(f"{f.path}: n_head {n_head} is not a multiple of n_head_kv {n_head_kv}")
    scaling = float(f.get(key("rope.scaling.factor")) or f.get(key("rope.scale_linear")) or 0.0)
    return HParams(
        arch=arch,
        n_vocab=n_vocab,
        n_ctx_train=int(f.require(key("context_length"))),
        n_embd=n_embd,
        n_layer=int(f.require(key("block_count"))),
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ff=int(f.require(key("feed_forward_length"))),
        n_embd_head_k=head_k,
        n_embd_head_v=head_v,
        n_rot=int(f.get(key("rope.dimension_count"), head_k)),
        norm_rms_eps=float(f.get(key("attention.layer_norm_rms_epsilon"), 1e-5)),
        rope_freq_base=float(f.get(key("rope.freq_base"), 10000.0)),
        rope_freq_scale=1.0 / scaling if scaling else 1.0,
        rope_type=rope_type,
    )
