"""Architectures: one module each, registered by their GGUF `general.architecture` name.

The import order is the registry's order: help texts and messages list the families in it,
and llamapy-convert matches config.json's class names in it."""
from __future__ import annotations

from . import llama, qwen2, qwen3, gemma3  # noqa: F401,I001  (each registers itself, in this order)
from .base import ARCHITECTURES, Architecture, listing, register
from .hf import HFConversion

__all__ = ["ARCHITECTURES", "Architecture", "HFConversion", "listing", "register"]
