"""llamapy-train: a new model trained from nothing on a text (the twin of llama.cpp's
train-text-from-scratch): the vocabulary of --vocab-model, the shape given by --embd,
--head, --head-kv, --layer, --ff and -c, llama2.c's initialisation; then the same
training engine, flags and checkpoints as llamapy-finetune, and with --predict N a
sampled continuation at the end.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from llamapy.context import Context
from llamapy.errors import InputError
from llamapy.from_scratch import new_model
from llamapy.generate import Generator

from . import training as T
from .common import guarded, job, log, note_first_run

cli = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

DEFAULT_LR = 1e-3  # llama2.c's and nanoGPT's small-model rate (a new model starts far from any minimum)


@cli.command()
@T.with_training_flags(ctx_size=128)
def run(
    vocab_model: Annotated[Path, typer.Option("--vocab-model", help="GGUF model whose tokenizer the new model takes")],
    file: T.File = None,
    arch: Annotated[str, typer.Option("--arch", help="llama, qwen2, qwen3 or gemma3")] = "llama",
    embd: Annotated[int, typer.Option("--embd", help="embedding width")] = 256,
    head: Annotated[int, typer.Option("--head", help="attention heads")] = 8,
    head_kv: Annotated[Optional[int], typer.Option("--head-kv", help="key/value heads (default --head)")] = None,
    layer: Annotated[int, typer.Option("--layer", help="layers")] = 16,
    ff: Annotated[Optional[int], typer.Option("--ff", help="feed-forward width (default: llama's 8/3 x embd, rounded up to 32)")] = None,
    rope_freq_base: Annotated[float, typer.Option("--rope-freq-base", help="RoPE base frequency")] = 10000.0,
    rms_eps: Annotated[float, typer.Option("--rms-eps", help="RMS norm epsilon")] = 1e-5,
    output: Annotated[Path, typer.Option("-o", "--output", "--model-out", help="where to write the trained model")] = Path("trained-model.gguf"),
    predict: Annotated[int, typer.Option("--predict", help="after training, print a sampled continuation of N tokens")] = 0,
    prompt: Annotated[Optional[str], typer.Option("-p", "--prompt", help="what --predict continues (default: the text's first words)")] = None,
    *, args: T.TrainingArgs,
) -> None:
    """Train a new model on the text in FILE; writes it to -o. The seed (--seed) initialises
    the weights and shuffles the windows."""
    args.check()
    if file is None and args.data is None:
        raise InputError("give the text to train on with -f FILE (or samples with --data DIR)")
    m = new_model(arch, vocab_model, n_embd=embd, n_head=head, n_head_kv=head_kv, n_layer=layer,
                  n_ff=ff or _llama_ff(embd), n_ctx_train=args.ctx_size, rope_freq_base=rope_freq_base, rms_eps=rms_eps,
                  seed=args.seed)
    note_first_run()
    log(f"model: new {m.describe()} ({m.n_params:,} parameters), vocabulary of {vocab_model.name}")
    params = args.train_params(m, DEFAULT_LR)
    data = args.load_data(m, params.window_bos, file)
    ctx = T.train(m, params, data, args, output, None, "train")
    if predict > 0 and job().rank == 0:
        if prompt is None:
            first = data.train.data[0][data.train.data[0] != m.vocab.bos_id][:8]
            prompt = " ".join(m.vocab.detokenize(first.tolist()).split()[:4])
        sample(ctx.model, prompt, predict, args.seed, args.ctx_size)


def sample(model, prompt: str, n: int, seed: int, n_ctx: int) -> None:
    """Print `prompt` and a continuation of up to `n` tokens sampled from `model` (default chain)."""
    gen = Generator(Context(model, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx), seed=seed)
    try:
        gen.feed(gen.tokenize(prompt))
    except InputError as e:
        raise InputError(f"--predict: {e}") from None
    log("sample:")
    sys.stdout.write(prompt)
    for piece in gen.stream(n):
        sys.stdout.write(piece.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()


def _llama_ff(n_embd: int) -> int:
    """llama's feed-forward width for n_embd: 2/3 of 4 x n_embd, rounded up to a multiple of 32."""
    return -(-(8 * n_embd // 3) // 32) * 32


def main() -> None:
    sys.argv[1:] = T.bare_lr_half(sys.argv[1:])
    guarded(cli)()


if __name__ == "__main__":
    main()
