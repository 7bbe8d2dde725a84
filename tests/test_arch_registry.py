"""llamapy.arch's one registry: a family that registers itself is known to the runtime,
llamapy-convert's class-name lookup, new_model and the help texts, with nothing else edited."""
from __future__ import annotations

import pytest

import llamapy
from llamapy.arch import ARCHITECTURES, HFConversion, listing
from llamapy.arch.hf import COMMON_LAYER
from llamapy.arch.qwen2 import Qwen2
from llamapy.convert import architectures as A
from llamapy.errors import CheckpointError

SHAPE = dict(n_embd=64, n_head=4, n_layer=2, n_ff=192, n_ctx_train=128)


class Qwen2Variant(Qwen2):
    """A made-up family: qwen2's graph under another name, converted from its own class name."""
    name = "qwen2variant"
    hf = HFConversion(("Qwen2VariantForCausalLM",), {**COMMON_LAYER, "post_attention_layernorm": "ffn_norm"})


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(ARCHITECTURES, Qwen2Variant.name, Qwen2Variant)


def test_the_registry_lists_the_families_in_order():
    assert list(ARCHITECTURES)[:4] == ["llama", "qwen2", "qwen3", "gemma3"]
    assert listing() == ", ".join(ARCHITECTURES)
    assert listing(" or ").endswith(f"qwen3 or {list(ARCHITECTURES)[-1]}")


def test_a_registered_family_is_known_everywhere(registered, stories_path):
    assert listing(" and ").endswith("gemma3 and qwen2variant")
    arch = A.architecture_of({"architectures": ["Qwen2VariantForCausalLM"]})
    assert arch.name == "qwen2variant" and A.gguf_name(arch, "model.layers.1.self_attn.q_proj.bias", 2) == \
        "blk.1.attn_q.bias"
    with pytest.raises(CheckpointError, match=r"\(llamapy-convert converts LlamaForCausalLM, .*, "
                                              r"Qwen2VariantForCausalLM\)$"):
        A.architecture_of({"architectures": ["GPT2LMHeadModel"]})
    model = llamapy.new_model("qwen2variant", stories_path, **SHAPE)
    assert model.hparams.arch == "qwen2variant" and "blk.0.attn_q.bias" in model.tensors


def test_a_subclass_converts_only_the_class_names_it_declares(monkeypatch):
    class Unconverted(Qwen2):
        name = "qwen2unconverted"
    from llamapy.arch import register
    monkeypatch.setitem(ARCHITECTURES, Unconverted.name, Unconverted)
    register(Unconverted)
    assert Unconverted.hf is None and Qwen2.hf is not None
    assert "qwen2unconverted" not in listing(converted=True) and "qwen2unconverted" in listing()
    assert [a.name for a in A.convertible()] == [n for n, a in ARCHITECTURES.items() if a.hf is not None]
