"""llamapy: llama.cpp's model runtime and training stack, in Python on ggmlpy."""
__version__ = "0.1.0"  # the one place the version is written (pyproject.toml reads it)

from .batch import Batch
from .context import Context
from .errors import LlamapyError
from .from_scratch import new_model
from .generate import (  # the function shadows the module: `from llamapy.generate import ...`
           chat_completion,
           generate,
)
from .model import Model, load_model
from .quantize import QuantizeParams, quantize_model
from .save import save_model_to_file

__all__ = ["__version__", "Batch", "Context", "LlamapyError", "Model", "QuantizeParams", "chat_completion", "generate",
           "load_model", "new_model", "quantize_model", "save_model_to_file"]
