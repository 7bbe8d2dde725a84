"""Architectures: one module each, registered by their GGUF `general.architecture` name."""
from __future__ import annotations

from .base import ARCHITECTURES, Architecture, register
from . import llama  # noqa: F401  (registers itself)

__all__ = ["ARCHITECTURES", "Architecture", "register"]
