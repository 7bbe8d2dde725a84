"""Architectures: one module each, registered by their GGUF `general.architecture` name."""
from __future__ import annotations

from . import gemma3, llama, qwen2, qwen3  # noqa: F401  (each registers itself)
from .base import ARCHITECTURES, Architecture, register

__all__ = ["ARCHITECTURES", "Architecture", "register"]
