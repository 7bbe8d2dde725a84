"""llamapy-perplexity: llama.cpp's perplexity tool (same method, flags, defaults and output)."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Optional

from llamapy.errors import InputError
from llamapy.model import load_model
from llamapy.perplexity import perplexity
from llamapy.samples import unescape

from . import flags as F
from .args import PERPLEXITY, Tool, flag
from .common import kv_cache_types, load_adapters, log, read_text, thread_count, warn

tool = Tool("llamapy-perplexity", llama_cpp=["perplexity"])

Text = Annotated[Optional[Path], flag("-f", "--file", metavar="FNAME", group=PERPLEXITY, show_default=False,
                                      path="read",
                                      help="text to score")]
TextArg = Annotated[Optional[str], flag("-p", "--prompt", metavar="TEXT", group=PERPLEXITY, show_default=False,
                                        help="text to score, given on the command line")]
Chunks = Annotated[int, flag("--chunks", metavar="N", group=PERPLEXITY, min=-1, help="score only the first N chunks (-1: all)")]


@tool.command
def run(model: F.Model, file: Text = None, prompt: TextArg = None, escape: F.Escape = False,
        ctx_size: F.CtxSize = 512, batch_size: F.BatchSize = 2048, ubatch_size: F.UbatchSize = 512,
        chunks: Chunks = -1, threads: F.Threads = None, flash_attn: F.FlashAttn = "auto",
        cache_type_k: F.CacheTypeK = "f16", cache_type_v: F.CacheTypeV = "f16",
        lora: F.Lora = None, lora_scaled: F.LoraScaled = None) -> None:
    """Perplexity of MODEL on a text, llama.cpp's way: the text is cut into chunks of -c tokens,
    each chunk scored on its second half from an empty KV cache."""
    if (file is None) == (prompt is None):
        raise InputError("give the text to score with -f FILE (or -p TEXT)")
    if flash_attn not in ("on", "off", "auto"):
        raise InputError(f"-fa must be on, off or auto, not {flash_attn!r}")
    type_k, type_v = kv_cache_types(cache_type_k, cache_type_v)
    t_load = time.perf_counter()
    m = load_model(model)
    log(f"model: {m.path.name}: {m.describe()} (loaded in {time.perf_counter() - t_load:.2f} s)")
    n_ctx = ctx_size or m.hparams.n_ctx_train
    if n_ctx > m.hparams.n_ctx_train:
        warn(f"the model was trained on only {m.hparams.n_ctx_train} context tokens ({n_ctx} specified)")
    adapters = load_adapters(m, lora, lora_scaled)
    text = read_text(file) if file is not None else prompt
    if escape:
        text = unescape(text)
    t0 = time.perf_counter()
    tokens = m.vocab.tokenize(text, add_special=True)
    log(f"perplexity: tokenized {len(tokens)} tokens in {time.perf_counter() - t0:.2f} s")

    start = time.perf_counter()
    passes: list[tuple[float, int]] = []

    def on_pass(n_done: int, n_chunk: int) -> None:
        # llama.cpp's ETA comes from its first pass; here that pass also compiles kernels and
        # builds graphs, so the estimate is the second pass's time
        passes.append((time.perf_counter(), n_done))
        if len(passes) == 2 and n_done < n_chunk:
            (t1, n1), (t2, n2) = passes
            per_chunk = (t2 - t1) / (n2 - n1)
            log(f"perplexity: calculating over {n_chunk} chunks, n_ctx={n_ctx}; {per_chunk:.3f} s per chunk "
                f"- ETA {per_chunk * (n_chunk - n_done) / 60:.2f} minutes")

    def on_chunk(i: int, n_chunk: int, ppl: float) -> None:
        sys.stdout.write(f"[{i}]{ppl:.4f},")
        sys.stdout.flush()

    result = perplexity(m, tokens, n_ctx, batch_size, ubatch_size, chunks, thread_count(threads),
                        on_chunk=on_chunk, on_pass=on_pass, flash_attn=flash_attn != "off", adapters=adapters,
                        type_k=type_k, type_v=type_v)
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    sys.stdout.flush()
    log(f"Final estimate: PPL = {result.ppl:.4f} +/- {result.ppl_error:.5f}")
    n_tok = result.n_chunks * n_ctx
    log(f"perplexity: {n_tok} tokens in {elapsed:.2f} s = {n_tok / elapsed:.1f} tokens/s")


main = tool.main

if __name__ == "__main__":
    main()
