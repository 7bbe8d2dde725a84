"""llamapy-perplexity: llama.cpp's perplexity tool (same method, flags, defaults and output), and
its KL divergence of a model from a base model (--kl-divergence-base, --kl-divergence)."""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Optional

from llamapy.errors import InputError
from llamapy.kl_divergence import KLDivergenceResult, kl_divergence
from llamapy.kld_base import BaseLogProbs
from llamapy.model import Model, load_model
from llamapy.perplexity import perplexity
from llamapy.samples import unescape

from . import flags as F
from .args import PERPLEXITY, Tool, flag
from .common import (adapter_list, freeze_startup_objects, kv_cache_types, load_adapters, log, paths, read_text,
                     thread_count, warn)
from .kld_report import TABLE_HEADER, chunk_line, statistics

tool = Tool("llamapy-perplexity", llama_cpp=["perplexity"])

Text = Annotated[Optional[Path], flag("-f", "--file", metavar="FNAME", group=PERPLEXITY, show_default=False,
                                      path="read",
                                      help="text to score")]
TextArg = Annotated[Optional[str], flag("-p", "--prompt", metavar="TEXT", group=PERPLEXITY, show_default=False,
                                        help="text to score, given on the command line")]
Chunks = Annotated[int, flag("--chunks", metavar="N", group=PERPLEXITY, min=-1, help="score only the first N chunks (-1: all)")]


KlDivergence = Annotated[bool, flag("--kl-divergence", group=PERPLEXITY, show_default=False,
                                    help="compare MODEL with the base model whose log-probabilities "
                                         "--kl-divergence-base FNAME holds (the text is the file's: no -f): KL "
                                         "divergence, both PPLs, top-token agreement, Δp")]
KlDivergenceBase = Annotated[Optional[Path], flag("--kl-divergence-base", "--save-all-logits", metavar="FNAME",
                                                  group=PERPLEXITY, show_default=False,
                                                  help="alone: also save the log-probabilities of every scored "
                                                       "token there (llama-perplexity's format); with "
                                                       "--kl-divergence: the base model's, to compare with")]


@tool.command
def run(model: F.Model, file: Text = None, prompt: TextArg = None, escape: F.Escape = False,
        ctx_size: F.CtxSize = 512, batch_size: F.BatchSize = 2048, ubatch_size: F.UbatchSize = 512,
        chunks: Chunks = -1, threads: F.Threads = None, flash_attn: F.FlashAttn = "auto",
        cache_type_k: F.CacheTypeK = "f16", cache_type_v: F.CacheTypeV = "f16",
        lora: F.Lora = None, lora_scaled: F.LoraScaled = None, kl_divergence: KlDivergence = False,
        kl_divergence_base: KlDivergenceBase = None) -> None:
    """Perplexity of MODEL on a text, llama.cpp's way: the text is cut into chunks of -c tokens,
    each chunk scored on its second half from an empty KV cache. With --kl-divergence, MODEL
    against a base model over the chunks a --kl-divergence-base run saved."""
    base = _base_to_compare(kl_divergence_base, ctx_size) if kl_divergence else None
    if base is None:
        if (file is None) == (prompt is None):
            raise InputError("give the text to score with -f FILE (or -p TEXT)")
        paths().write("--kl-divergence-base", kl_divergence_base)
    if flash_attn not in ("on", "off", "auto"):
        raise InputError(f"-fa must be on, off or auto, not {flash_attn!r}")
    type_k, type_v = kv_cache_types(cache_type_k, cache_type_v)
    adapter_list(lora, lora_scaled)  # a bad --lora-scaled is refused before the model is read
    t_load = time.perf_counter()
    m = load_model(model)
    freeze_startup_objects()
    log(f"model: {m.path.name}: {m.describe()} (loaded in {time.perf_counter() - t_load:.2f} s)")
    n_ctx = base.n_ctx if base is not None else ctx_size or m.hparams.n_ctx_train
    if n_ctx > m.hparams.n_ctx_train:
        warn(f"the model was trained on only {m.hparams.n_ctx_train} context tokens ({n_ctx} specified)")
    run_args = dict(n_batch=batch_size, n_ubatch=ubatch_size, n_chunks=chunks, n_threads=thread_count(threads),
                    on_pass=_eta(n_ctx), flash_attn=flash_attn != "off", adapters=load_adapters(m, lora, lora_scaled),
                    type_k=type_k, type_v=type_v)
    if base is not None:
        if file is not None or prompt is not None:
            log("note: -f/-p: no effect: the tokens come from the --kl-divergence-base file")
        _compare(m, base, run_args)
        return
    text = read_text(file) if file is not None else prompt
    if escape:
        text = unescape(text)
    t0 = time.perf_counter()
    tokens = m.vocab.tokenize_array(text, add_special=True)
    log(f"perplexity: tokenized {len(tokens)} tokens in {time.perf_counter() - t0:.2f} s")
    if kl_divergence_base is not None:
        log(f"perplexity: saving the log-probabilities of every scored token to {kl_divergence_base}")

    def on_chunk(i: int, n_chunk: int, ppl: float) -> None:
        sys.stdout.write(f"[{i}]{ppl:.4f},")
        sys.stdout.flush()

    start = time.perf_counter()
    result = perplexity(m, tokens, n_ctx, on_chunk=on_chunk, kl_divergence_base=kl_divergence_base, **run_args)
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    sys.stdout.flush()
    log(f"Final estimate: PPL = {result.ppl:.4f} +/- {result.ppl_error:.5f}")
    n_tok = result.n_chunks * n_ctx
    log(f"perplexity: {n_tok} tokens in {elapsed:.2f} s = {n_tok / elapsed:.1f} tokens/s")


def _base_to_compare(path: Path | None, ctx_size: int) -> BaseLogProbs:
    """--kl-divergence's base file, checked before the model loads (InputError: none given, or
    a bad file, or one computed with a larger context than -c)."""
    if path is None:
        raise InputError("--kl-divergence needs --kl-divergence-base FNAME: the base model's log-probabilities, "
                         "saved by a run of the base model with --kl-divergence-base FNAME alone")
    paths().read("--kl-divergence-base", path)
    base = BaseLogProbs.open(path)
    if ctx_size and base.n_ctx > ctx_size:
        raise InputError(f"{path} was computed with a context of {base.n_ctx}, while the context is {ctx_size}: "
                         f"give -c {base.n_ctx}")
    return base


def _compare(m: Model, base: BaseLogProbs, run_args: dict) -> None:
    """--kl-divergence: MODEL over the base file's chunks; llama-perplexity's table and statistics
    on stdout."""
    base.require_vocabulary(m.hparams.n_vocab)
    log(f"kl_divergence: {base.n_chunk} chunks of {base.n_ctx} tokens in {base.path}")
    print(TABLE_HEADER, flush=True)

    def on_chunk(i: int, n_chunk: int, result: KLDivergenceResult) -> None:
        print(chunk_line(i, result), flush=True)

    start = time.perf_counter()
    result = kl_divergence(m, base, on_chunk=on_chunk, **run_args)
    elapsed = time.perf_counter() - start
    print()
    print("\n".join(statistics(result)), flush=True)
    n_tok = result.n_chunks * base.n_ctx
    log(f"kl_divergence: {n_tok} tokens in {elapsed:.2f} s = {n_tok / elapsed:.1f} tokens/s")


def _eta(n_ctx: int) -> Callable[[int, int], None]:
    """on_pass for the ETA line: llama.cpp's comes from its first pass; here that pass also
    compiles kernels and builds graphs, so the estimate is the second pass's time."""
    passes: list[tuple[float, int]] = []

    def on_pass(n_done: int, n_chunk: int) -> None:
        passes.append((time.perf_counter(), n_done))
        if len(passes) == 2 and n_done < n_chunk:
            (t1, n1), (t2, n2) = passes
            per_chunk = (t2 - t1) / (n2 - n1)
            log(f"perplexity: calculating over {n_chunk} chunks, n_ctx={n_ctx}; {per_chunk:.3f} s per chunk "
                f"- ETA {per_chunk * (n_chunk - n_done) / 60:.2f} minutes")
    return on_pass


main = tool.main

if __name__ == "__main__":
    main()
