"""llamapy-finetune: train a GGUF model on a text and save the result as a GGUF.

llama.cpp's finetune flags and defaults (-lr 1e-5, -val-split 0.05, 2 epochs, AdamW,
finetuned-model.gguf), plus -lr-half/-lr-halvings and --plot. Windows of -c tokens
with stride -c/2; -b tokens (whole windows) per optimizer step, computed -ub at a time.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from llamapy.context import Context, validation_windows
from llamapy.dataset import text_windows
from llamapy.defaults import default_model_path, demo_corpus
from llamapy.errors import InputError
from llamapy.lora import DEFAULT_MODULES
from llamapy.model import load_model
from llamapy.save import save_model_to_file
from llamapy.train import TrainingDivergedError
from llamapy.train_params import SGD, AdamW, LRSchedule, TrainParams

from .common import default_threads, guarded, log, read_text

cli = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

DEFAULT_CTX = 256
DEMO_CHARS = 16_000


@cli.command()
def run(
    model: Annotated[Optional[Path], typer.Option("-m", "--model", help="GGUF model file (default: Gemma 3 270M Q4_K_M)")] = None,
    file: Annotated[Optional[Path], typer.Option("-f", "--file", help="text to train on (default: a slice of the Python docs)")] = None,
    ctx_size: Annotated[int, typer.Option("-c", "--ctx-size", help="tokens per training window")] = DEFAULT_CTX,
    batch_size: Annotated[Optional[int], typer.Option("-b", "--batch-size", help="tokens per optimizer step (whole windows; default -c)")] = None,
    ubatch_size: Annotated[int, typer.Option("-ub", "--ubatch-size", help="tokens computed at once")] = 512,
    lr: Annotated[Optional[float], typer.Option("-lr", "--learning-rate", help="learning rate (default 1e-5; 3e-4 for LoRA)")] = None,
    lr_min: Annotated[float, typer.Option("-lr-min", help="decay the learning rate to this value")] = 0.0,
    decay_epochs: Annotated[float, typer.Option("-decay-epochs", help="epochs over which -lr-min is reached")] = -1.0,
    lr_half: Annotated[Optional[float], typer.Option("-lr-half", help="halve the learning rate every HALFLIFE epochs (1 if bare)")] = None,
    lr_halvings: Annotated[Optional[int], typer.Option("-lr-halvings", help="halve at most N times")] = None,
    wd: Annotated[float, typer.Option("-wd", "--weight-decay", help="decoupled weight decay")] = 0.0,
    optimizer: Annotated[str, typer.Option("-opt", "--optimizer", help="adamw or sgd")] = "adamw",
    val_split: Annotated[float, typer.Option("-val-split", "--val-split", help="fraction of windows held out")] = 0.05,
    epochs: Annotated[int, typer.Option("--epochs", "-epochs", help="passes over the training windows")] = 2,
    output: Annotated[Path, typer.Option("-o", "--output", help="where to write the trained model")] = Path("finetuned-model.gguf"),
    seed: Annotated[int, typer.Option("--seed", "-s", help="seed for shuffling the training windows each epoch")] = 0,
    threads: Annotated[Optional[int], typer.Option("-t", "--threads", help="CPU threads")] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="write the loss curves to this PNG")] = None,
    lora_rank: Annotated[Optional[int], typer.Option("--lora-rank", help="train a LoRA adapter of this rank instead of the weights")] = None,
    lora_alpha: Annotated[Optional[float], typer.Option("--lora-alpha", help="LoRA alpha (default: the rank, i.e. scale 1)")] = None,
    lora_modules: Annotated[str, typer.Option("--lora-modules", help="comma-separated matrices to adapt")] = ",".join(DEFAULT_MODULES),
    lora_out: Annotated[Path, typer.Option("--lora-out", help="where to write the adapter")] = Path("lora-adapter.gguf"),
    window_bos: Annotated[Optional[bool], typer.Option("--window-bos/--no-window-bos", help="start every window with BOS (default: what the architecture expects)")] = None,
    demo_chars: Annotated[int, typer.Option("--demo-chars", help="characters of the demo corpus used when no -f is given")] = DEMO_CHARS,
) -> None:
    """Finetune MODEL on the text in FILE; writes the trained model to -o."""
    opt_name = optimizer.lower()
    if opt_name not in ("adamw", "sgd"):
        raise InputError(f"unknown optimizer {optimizer!r}: use adamw or sgd")
    if not 0.0 <= val_split < 1.0:
        raise InputError(f"-val-split must be in [0, 1), got {val_split}")
    t_load = time.perf_counter()
    model = model or default_model_path(log)
    m = load_model(model)
    log(f"model: {m.path.name}: {m.describe()} (loaded in {time.perf_counter() - t_load:.2f} s)")
    try:
        schedule = LRSchedule(**({"lr0": lr} if lr is not None else {}), lr_min=lr_min, decay_epochs=decay_epochs,
                              half_life=lr_half, halvings=lr_halvings, epochs=epochs)
        params = TrainParams.for_model(
            m, lora_rank=lora_rank, lora_alpha=lora_alpha, lora_modules=[x.strip() for x in lora_modules.split(",") if x.strip()],
            seed=seed, window_bos=window_bos, schedule=schedule, optimizer=AdamW(wd=wd) if opt_name == "adamw" else SGD(wd=wd))
    except ValueError as e:
        raise InputError(_first_error(e)) from None
    lora = params.lora
    if lora is not None and lora_rank is None:
        log(f"finetune: the model's weights are quantized: training a LoRA adapter of rank {lora.rank}")
    for path in ([lora_out] if lora else [output]) + ([plot] if plot else []):
        _check_writable(path)
    if file is None:
        text = demo_corpus()[:demo_chars]
        log(f"text: no -f given: the first {len(text)} characters of the Python documentation "
            f"(pydoc_data.topics; --demo-chars to change, -f for your own text)")
    else:
        text = read_text(file)
    dataset = text_windows(m.vocab, text, ctx_size, params.window_bos)
    n_batch = batch_size or ctx_size
    n_val = validation_windows(dataset.ndata, val_split)
    log(f"dataset: {dataset.n_tokens} tokens, {dataset.ndata} windows of {ctx_size} (stride {dataset.stride}), "
        f"{dataset.ndata - n_val} for training, {n_val} for validation")
    log(f"training: {opt_name}, lr {params.schedule.lr0:g}, {n_batch} tokens per step, ubatch {min(ubatch_size, ctx_size)}, "
        f"{epochs} epochs")
    ctx = Context(m, n_ctx=ctx_size, n_batch=n_batch, n_ubatch=ubatch_size, n_threads=threads or default_threads())
    ctx.opt_init(params)
    adapter = ctx.trainer.adapter
    if adapter:
        log(f"lora: rank {adapter.rank}, alpha {adapter.alpha:g}, {len(adapter.tensors)} matrices ({', '.join(lora.modules)})")
    start = time.perf_counter()
    try:
        history = ctx.opt_fit(dataset, epochs=epochs, val_split=val_split, seed=seed)
    except TrainingDivergedError as e:
        where = adapter.save(lora_out) if adapter else save_model_to_file(m, output)
        log(f"saved the last good weights to {where}")
        raise InputError(str(e)) from None
    elapsed = time.perf_counter() - start
    n_trained = sum(len(h.train.losses) for h in history) * ctx.trainer.n_ubatch
    timing = ctx.trainer.timing
    log(f"finetune: {n_trained} training tokens in {elapsed:.1f} s (validation included); training: "
        f"{timing.tokens_per_second:.0f} tokens/s after the first window's {timing.startup_seconds:.2f} s "
        "of start-up (graphs built, kernels loaded)")
    if adapter:
        adapter.save(lora_out)
        log(f"finetune: saved the LoRA adapter to {lora_out}")
        if file is None:
            log(f'try it: llamapy-cli -m {model} --lora {lora_out} -p "The with statement" -n 64')
        else:
            log(f"try it: llamapy-perplexity -m {model} --lora {lora_out} -f {file} -c {ctx_size}")
    else:
        save_model_to_file(m, output)
        log(f"finetune: saved the trained model to {output}")
    if plot:
        _plot(history, plot)
        log(f"finetune: wrote the loss curves to {plot}")


def _check_writable(path: Path) -> None:
    parent = path.resolve().parent
    if path.is_dir():
        raise InputError(f"cannot write {path}: it is a directory")
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise InputError(f"cannot write {path}: directory {parent} does not exist or is not writable")


def _first_error(e: ValueError) -> str:
    errors = getattr(e, "errors", None)
    if callable(errors):
        first = errors()[0]
        return f"{'.'.join(str(x) for x in first.get('loc', ()))}: {first['msg']}".lstrip(": ")
    return str(e)


def _plot(history, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("--plot needs matplotlib: pip install 'llamapy[plot]'") from None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps, train_loss, val_x, val_loss = [], [], [], []
    for h in history:
        train_loss += h.train.steps
        steps = list(range(1, len(train_loss) + 1))
        if h.val.losses:
            val_x.append(len(train_loss))
            val_loss.append(h.val.loss()[0])
    ax.plot(steps, train_loss, lw=0.8, label="train (per step)")
    if val_loss:
        ax.plot(val_x, val_loss, "o-", label="validation (per epoch)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)
    plt.close(fig)


def _bare_lr_half(argv: list[str]) -> list[str]:
    """`-lr-half` may come without a value (halve every epoch): give it one for the parser."""
    out = []
    for i, arg in enumerate(argv):
        out.append(arg)
        if arg == "-lr-half":
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is None or not _is_number(nxt):
                out.append("1")
    return out


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def main() -> None:
    sys.argv[1:] = _bare_lr_half(sys.argv[1:])
    guarded(cli)()


if __name__ == "__main__":
    main()
