"""The loss curves of a training run as a PNG (`--plot`, `opt_fit(plot=)`), drawn from the
run's metrics records and replaced atomically at every validation, so an image viewer that
reloads the file always finds a whole image."""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from .atomic import replace_atomically
from .errors import InputError, install_hint
from .metrics import EvalRecord, StepRecord


def require_matplotlib() -> None:
    """InputError before any training when the plot cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise InputError(f"--plot needs matplotlib: {install_hint('plot')}") from None


def draw_loss_curves(steps: Sequence[StepRecord], evals: Sequence[EvalRecord], path: str | os.PathLike) -> Path:
    """The training loss of every step and the validation loss of every evaluation, against
    the optimizer step, written to `path` atomically."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # pyplot's global state is not used (a figure of its own, drawn by Agg), and the margins
    # are fixed (tight_layout measures every label: it doubled the cost of a redraw)
    fig = Figure(figsize=(8, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.12, top=0.97)
    ax = fig.add_subplot()
    ax.plot([r.step for r in steps], [r.loss for r in steps], lw=0.8, label="train (per step)")
    if evals:
        ax.plot([r.step for r in evals], [r.val_loss for r in evals], "o-", label="validation")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    return replace_atomically(Path(path), lambda out: fig.savefig(out, format="png"), "the loss curves")
