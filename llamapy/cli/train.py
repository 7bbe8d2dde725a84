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

from llamapy.arch import listing
from llamapy.context import Context
from llamapy.errors import InputError
from llamapy.from_scratch import new_model
from llamapy.generate import Generator

from . import training as T
from .args import MODEL_SHAPE, OUTPUT, Tool, flag
from .common import freeze_startup_objects, job, log

tool = Tool("llamapy-train", llama_cpp=["finetune"], distributed=True)

DEFAULT_LR = 1e-3  # llama2.c's and nanoGPT's small-model rate (a new model starts far from any minimum)

VocabModel = Annotated[Path, flag("--vocab-model", metavar="FNAME", group=MODEL_SHAPE, path="read",
                                  help="GGUF model whose tokenizer (and chat template) the new model takes")]
Arch = Annotated[str, flag("--arch", metavar="NAME", group=MODEL_SHAPE, help=listing(" or "))]
Embd = Annotated[int, flag("--embd", metavar="N", group=MODEL_SHAPE, min=1, help="embedding width")]
Head = Annotated[int, flag("--head", metavar="N", group=MODEL_SHAPE, min=1, help="attention heads")]
HeadKv = Annotated[Optional[int], flag("--head-kv", metavar="N", group=MODEL_SHAPE, show_default=False, min=1,
                                       help="key/value heads (default: --head)")]
Layer = Annotated[int, flag("--layer", metavar="N", group=MODEL_SHAPE, min=1, help="layers")]
Ff = Annotated[Optional[int], flag("--ff", metavar="N", group=MODEL_SHAPE, show_default=False, min=1,
                                   help="feed-forward width (default: llama's 8/3 x embd, rounded up to 32)")]
RopeFreqBase = Annotated[float, flag("--rope-freq-base", metavar="N", group=MODEL_SHAPE, help="RoPE base frequency")]
RmsEps = Annotated[float, flag("--rms-eps", metavar="N", group=MODEL_SHAPE, help="RMS norm epsilon")]
Output = Annotated[Path, flag("-o", "--output", "--output-file", "--model-out", metavar="FNAME", group=OUTPUT,
                              path="write",
                              help="where to write the trained model")]
Predict = Annotated[int, flag("--predict", metavar="N", group=OUTPUT, min=0,
                              help="after training, print a sampled continuation of N tokens")]
Prompt = Annotated[Optional[str], flag("-p", "--prompt", metavar="PROMPT", group=OUTPUT, show_default=False,
                                       help="what --predict continues (default: the text's first words)")]


@tool.command(ctx_size=128, shuffle=True)
def run(vocab_model: VocabModel, file: T.File = None, arch: Arch = "llama", embd: Embd = 256, head: Head = 8,
        head_kv: HeadKv = None, layer: Layer = 16, ff: Ff = None, rope_freq_base: RopeFreqBase = 10000.0,
        rms_eps: RmsEps = 1e-5, output: Output = Path("trained-model.gguf"), predict: Predict = 0,
        prompt: Prompt = None, args: T.TrainingArgs = None) -> None:
    """Train a new model on the text in FILE and write it to -o. The seed (--seed) initialises
    the weights and shuffles the windows (--no-shuffle: in the text's order)."""
    args.check()
    for name, value in (("--rope-freq-base", rope_freq_base), ("--rms-eps", rms_eps)):
        if not value > 0:
            raise InputError(f"{name} must be > 0, not {value:g}")
    if file is None and args.data is None:
        raise InputError("give the text to train on with -f FILE (or samples with --data DIR)")
    m = new_model(arch, vocab_model, n_embd=embd, n_head=head, n_head_kv=head_kv, n_layer=layer,
                  n_ff=ff or _llama_ff(embd), n_ctx_train=args.ctx_size, rope_freq_base=rope_freq_base, rms_eps=rms_eps,
                  seed=args.seed)
    freeze_startup_objects()
    log(f"model: new {m.describe()} ({m.n_params:,} parameters), vocabulary of {vocab_model.name}")
    params = args.train_params(m, DEFAULT_LR)
    data = args.load_data(m, params.window_bos, file)
    ctx = T.train(m, params, data, args, output, "train")
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


main = tool.main

if __name__ == "__main__":
    main()
