"""llamapy-finetune: train a GGUF model on a text and save the result as a GGUF.

llama.cpp's finetune flags and defaults (-lr 1e-5, -val-split 0.05, 2 epochs, AdamW,
finetuned-model.gguf), plus -lr-half/-lr-halvings, warmup, cosine schedules, gradient
clipping, checkpoints and --plot (the flags llamapy-train shares are in training.py).
Windows of -c tokens with stride -c/2; -b tokens (whole windows) per optimizer step,
computed -ub at a time.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from llamapy.dataset import TokenWindows
from llamapy.defaults import default_model_path, demo_corpus
from llamapy.lora import DEFAULT_MODULES
from llamapy.model import load_model

from . import training as T
from .common import guarded, log, note_first_run

cli = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

DEFAULT_CTX = 256
DEMO_CHARS = 16_000


@cli.command()
@T.with_training_flags(ctx_size=DEFAULT_CTX)
def run(
    model: Annotated[Optional[Path], typer.Option("-m", "--model", help="GGUF model file (default: Gemma 3 270M Q4_K_M)")] = None,
    file: T.File = None,
    output: Annotated[Path, typer.Option("-o", "--output", "--model-out", help="where to write the trained model")] = Path("finetuned-model.gguf"),
    lora_rank: Annotated[Optional[int], typer.Option("--lora-rank", help="train a LoRA adapter of this rank instead of the weights")] = None,
    lora_alpha: Annotated[Optional[float], typer.Option("--lora-alpha", help="LoRA alpha (default: the rank, i.e. scale 1)")] = None,
    lora_modules: Annotated[str, typer.Option("--lora-modules", help="comma-separated matrices to adapt")] = ",".join(DEFAULT_MODULES),
    lora_out: Annotated[Path, typer.Option("--lora-out", help="where to write the adapter")] = Path("lora-adapter.gguf"),
    window_bos: Annotated[Optional[bool], typer.Option("--window-bos/--no-window-bos", help="start every window with BOS (default: what the architecture expects)")] = None,
    demo_chars: Annotated[int, typer.Option("--demo-chars", help="characters of the demo corpus used when no -f is given")] = DEMO_CHARS,
    *, args: T.TrainingArgs,
) -> None:
    """Finetune MODEL on the text in FILE or the samples in --data DIR (or a .jsonl FILE); writes the trained model to -o (or the adapter to --lora-out)."""
    args.check()
    t_load = time.perf_counter()
    model = model or default_model_path(log)
    m = load_model(model)
    note_first_run()
    log(f"model: {m.path.name}: {m.describe()} (loaded in {time.perf_counter() - t_load:.2f} s)")
    params = args.train_params(m, lora_rank=lora_rank, lora_alpha=lora_alpha, window_bos=window_bos,
                               lora_modules=[x.strip() for x in lora_modules.split(",") if x.strip()])
    if params.lora is not None and lora_rank is None:
        log(f"finetune: the model's weights are quantized: training a LoRA adapter of rank {params.lora.rank}")
    demo = None
    if file is None and args.data is None:
        demo = demo_corpus()[:demo_chars]
        log(f"text: no -f given: the first {len(demo)} characters of the Python documentation "
            f"(pydoc_data.topics; --demo-chars to change, -f or --data for your own data)")
    data = args.load_data(m, params.window_bos, file, demo)
    T.train(m, params, data, args, output, lora_out, "finetune")
    if params.lora:
        if demo is not None:
            log(f'try it: llamapy-cli -m {model} --lora {lora_out} -p "The with statement" -n 64')
        elif isinstance(data.train, TokenWindows):
            log(f"try it: llamapy-perplexity -m {model} --lora {lora_out} -f {file} -c {args.ctx_size}")
        else:
            template = f" --chat-template {args.chat_template}" if args.chat_template else ""
            log(f"try it: llamapy-cli -m {model} --lora {lora_out}{template} -cnv")


def main() -> None:
    sys.argv[1:] = T.bare_lr_half(sys.argv[1:])
    guarded(cli)()


if __name__ == "__main__":
    main()
