"""llamapy-finetune: train a GGUF model on a text and save the result as a GGUF.

llama.cpp's finetune flags and defaults (-lr 1e-5, -val-split 0.05, 2 epochs, AdamW,
finetuned-model.gguf), plus -lr-half/-lr-halvings, warmup, cosine schedules, gradient
clipping, checkpoints and --plot (the flags llamapy-train shares are in training.py).
Windows of -c tokens with stride -c/2; -b tokens (whole windows) per optimizer step,
computed -ub at a time.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

from llamapy.dataset import TokenWindows
from llamapy.defaults import default_model_path, demo_corpus
from llamapy.errors import InputError
from llamapy.lora import DEFAULT_MODULES
from llamapy.model import load_model

from . import flags as F
from . import training as T
from .args import DATA, LORA, OUTPUT, Tool, flag
from .common import freeze_startup_objects, log, paths

tool = Tool("llamapy-finetune", llama_cpp=["finetune"], distributed=True)

DEMO_CHARS = 16_000

Output = Annotated[Optional[Path], flag("-o", "--output", "--output-file", "--model-out", metavar="FNAME", group=OUTPUT,
                                        show_default=False,
                                        help="where to write the trained model (default finetuned-model.gguf), or the "
                                             "adapter when a LoRA trains (default lora-adapter.gguf)")]
LoraRank = Annotated[Optional[int], flag("--lora-rank", metavar="R", group=LORA, show_default=False, min=1,
                                         help="train a LoRA adapter of rank R instead of the weights (default: "
                                              "rank 8 when the model's matrices are quantized, else a full finetune)")]
LoraAlpha = Annotated[Optional[float], flag("--lora-alpha", metavar="ALPHA", group=LORA, show_default=False, min=0,
                                            help="LoRA alpha (default: the rank, i.e. scale 1)")]
LoraModules = Annotated[str, flag("--lora-modules", metavar="NAMES", group=LORA,
                                  help="comma-separated matrices to adapt")]
LoraOut = Annotated[Optional[Path], flag("--lora-out", metavar="FNAME", group=OUTPUT, show_default=False,
                                         help="where to write the adapter (same as -o when a LoRA trains)")]
WindowBos = Annotated[Optional[bool], flag("--window-bos/--no-window-bos", group=DATA, show_default=False,
                                           help="start every window with BOS (default: what the architecture "
                                                "expects)")]
DemoChars = Annotated[int, flag("--demo-chars", metavar="N", group=DATA, min=1,
                                help="characters of the demo text (the Python docs) used when no -f is given")]


@tool.command
def run(model: F.OptionalModel = None, file: T.File = None, output: Output = None, lora_rank: LoraRank = None,
        lora_alpha: LoraAlpha = None, lora_modules: LoraModules = ",".join(DEFAULT_MODULES), lora_out: LoraOut = None,
        window_bos: WindowBos = None, demo_chars: DemoChars = DEMO_CHARS, args: T.TrainingArgs = None) -> None:
    """Finetune MODEL on a text (-f) or on samples (--data DIR, or a .jsonl -f); writes the trained
    model, or the LoRA adapter that trained, to -o."""
    args.check()
    t_load = time.perf_counter()
    model = model or default_model_path(log)
    paths().read("-m", model)
    m = load_model(model)
    freeze_startup_objects()
    params = args.train_params(m, lora_rank=lora_rank, lora_alpha=lora_alpha, window_bos=window_bos,
                               lora_modules=[x.strip() for x in lora_modules.split(",") if x.strip()])
    if params.lora is None and lora_out is not None:
        raise InputError("--lora-out names the adapter of a LoRA run: add --lora-rank R (or write the model with -o)")
    if output is not None and lora_out is not None and output != lora_out:
        raise InputError(f"-o {output} and --lora-out {lora_out} both name the adapter: give one")
    flag = "-o" if output is not None or lora_out is None else "--lora-out"
    output = output or lora_out or Path("lora-adapter.gguf" if params.lora else "finetuned-model.gguf")
    paths().write(flag, output)  # before the first log line: it opens the log file (common._Log)
    log(f"model: {m.path.name}: {m.describe()} (loaded in {time.perf_counter() - t_load:.2f} s)")
    if params.lora is not None and lora_rank is None:
        log(f"finetune: the model's weights are quantized: training a LoRA adapter of rank {params.lora.rank}")
    demo = None
    if file is None and args.data is None:
        demo = demo_corpus()[:demo_chars]
        log(f"text: no -f given: the first {len(demo)} characters of the Python documentation "
            f"(pydoc_data.topics; --demo-chars to change, -f or --data for your own data)")
    data = args.load_data(m, params.window_bos, file, demo)
    T.train(m, params, data, args, output, "finetune")
    if params.lora:
        if demo is not None:
            log(f'try it: llamapy-cli -m {model} --lora {output} -p "The with statement" -n 64')
        elif isinstance(data.train, TokenWindows):
            log(f"try it: llamapy-perplexity -m {model} --lora {output} -f {file} -c {args.ctx_size}")
        else:
            template = f" --chat-template {args.chat_template}" if args.chat_template else ""
            log(f"try it: llamapy-cli -m {model} --lora {output}{template} -cnv")


main = tool.main

if __name__ == "__main__":
    main()
