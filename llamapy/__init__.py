"""llamapy: llama.cpp's model runtime and training stack, in Python on ggmlpy."""
from __future__ import annotations

__version__ = "0.1.0"  # the one place the version is written (pyproject.toml reads it)

import importlib
import sys
import types
from typing import TYPE_CHECKING

from .batch import Batch
from .errors import LlamapyError
from .model import Model, load_model

if TYPE_CHECKING:
    from .context import Context
    from .evaluation import evaluate
    from .from_scratch import new_model
    from .generate import Completion, chat_completion, generate
    from .llama_api import Llama
    from .quantize import QuantizeParams, quantize_model
    from .save import save_model_to_file

__all__ = ["__version__", "Batch", "Completion", "Context", "Llama", "LlamapyError", "Model", "QuantizeParams",
           "chat_completion", "evaluate", "generate", "load_model", "new_model", "quantize_model", "save_model_to_file"]

# What runs a model (Context, generation, training) loads numba's compiled kernels: imported
# when first used, so `import llamapy` and the tools that only read and write GGUF files
# (llamapy-quantize, llamapy-convert) start fast. `llamapy.generate` is the function, which
# shadows the module of that name (`from llamapy.generate import Generator` finds the module).
_LAZY = {"Context": ".context", "new_model": ".from_scratch", "chat_completion": ".generate", "generate": ".generate",
         "Completion": ".generate", "Llama": ".llama_api", "QuantizeParams": ".quantize", "quantize_model": ".quantize",
         "save_model_to_file": ".save", "evaluate": ".evaluation"}


class _Package(types.ModuleType):
    """The package keeps `generate` the function: importing the submodule `llamapy.generate`
    (lazily, or by `from llamapy.generate import Generator`) would otherwise rebind the
    package's attribute to the module, as the import system does for every submodule."""

    def __setattr__(self, name: str, value) -> None:
        if name == "generate" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __dir__() -> list[str]:
    """The public API, the lazily imported names included (help() and tab completion find them),
    and the package's modules imported so far; not the names the package itself imports."""
    own = {name for name, value in globals().items()
           if name.startswith("__") or (isinstance(value, types.ModuleType) and value.__name__.startswith(__name__ + "."))}
    return sorted(own | set(__all__))


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'llamapy' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value
