"""One exception family for everything a user can get wrong.

Command-line front ends catch `LlamapyError` and print its message as a single line,
so every message must stand on its own ("what is wrong with which input").
"""


class LlamapyError(Exception):
    """Base of all user-facing errors (bad files, unsupported models, bad arguments)."""

    # True for an error that every rank of a distributed run meets at the same point (a
    # collective check): the ranks stop together, rank 0 says why, and nothing need abort
    on_every_rank = False


class ModelLoadError(LlamapyError):
    """The model file is missing, not GGUF, truncated, or otherwise unreadable."""


class UnsupportedModelError(LlamapyError):
    """The file is valid GGUF but describes something llamapy does not run."""


class VocabError(LlamapyError):
    """The tokenizer described by the GGUF metadata cannot be rebuilt."""


class InputError(LlamapyError):
    """The user's input (text, arguments) does not fit the requested job."""


class CheckpointError(LlamapyError):
    """A Hugging Face checkpoint cannot be converted (missing or broken files, an
    architecture or tokenizer this converter does not know)."""


class SaveError(LlamapyError):
    """A model could not be written (unwritable destination, disk full, unsavable value)."""


class TrainingInterrupted(KeyboardInterrupt):
    """A run stopped on request (Ctrl-C) after writing its checkpoint; the message says where."""

    on_every_rank = True  # the request is shared: every rank stops after the same step


def install_hint(extra: str) -> str:
    """The command that installs one of llamapy's extras: into the clone this llamapy runs
    from (an editable install: its folder holds pyproject.toml), where `pip install
    'llamapy[extra]'` would fetch another llamapy from the package index; else that."""
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file():
        return f"pip install -e '{root}[{extra}]'"
    return f"pip install 'llamapy[{extra}]'"
