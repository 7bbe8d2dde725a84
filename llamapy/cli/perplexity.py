"""llamapy-perplexity: llama.cpp's perplexity tool (same method, flags and output)."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from llamapy.model import load_model
from llamapy.perplexity import perplexity

from .common import default_threads, guarded, join_pairs, load_adapters, log, note_first_run, read_text

cli = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@cli.command()
def run(
    model: Annotated[Path, typer.Option("-m", "--model", help="GGUF model file")],
    file: Annotated[Path, typer.Option("-f", "--file", help="text to score")],
    ctx_size: Annotated[int, typer.Option("-c", "--ctx-size", help="tokens per chunk")] = 4096,
    batch_size: Annotated[int, typer.Option("-b", "--batch-size", help="tokens per decode (several chunks at once)")] = 2048,
    ubatch_size: Annotated[int, typer.Option("-ub", "--ubatch-size", help="tokens computed at once")] = 512,
    chunks: Annotated[int, typer.Option("--chunks", help="score only the first N chunks (-1: all)")] = -1,
    threads: Annotated[Optional[int], typer.Option("-t", "--threads", help="CPU threads")] = None,
    flash_attn: Annotated[str, typer.Option("-fa", "--flash-attn", help="on|off|auto")] = "auto",
    lora: Annotated[Optional[list[Path]], typer.Option("--lora", help="LoRA adapter (repeatable)")] = None,
    lora_scaled: Annotated[Optional[list[str]], typer.Option("--lora-scaled", help="FILE SCALE: LoRA adapter and its scale (repeatable)")] = None,
) -> None:
    """Perplexity of MODEL on the text in FILE."""
    t_load = time.perf_counter()
    m = load_model(model)
    note_first_run()
    log(f"model: {m.path.name}: {m.describe()} (loaded in {time.perf_counter() - t_load:.2f} s)")
    adapters = load_adapters(m, lora, lora_scaled)
    text = read_text(file)
    t0 = time.perf_counter()
    tokens = m.vocab.tokenize(text, add_special=True)
    log(f"perplexity: tokenized {len(tokens)} tokens in {time.perf_counter() - t0:.2f} s")
    if flash_attn not in ("on", "off", "auto"):
        raise typer.BadParameter("-fa must be on, off or auto")

    start = time.perf_counter()
    state = {"eta_shown": False}

    def on_chunk(i: int, n_chunk: int, ppl: float) -> None:
        if not state["eta_shown"]:
            per_chunk = (time.perf_counter() - start) / i
            log(f"perplexity: calculating over {n_chunk} chunks, n_ctx={ctx_size}; "
                f"{per_chunk:.3f} s per chunk - ETA {per_chunk * n_chunk / 60:.2f} minutes")
            state["eta_shown"] = True
        sys.stdout.write(f"[{i}]{ppl:.4f},")
        sys.stdout.flush()

    result = perplexity(m, tokens, ctx_size, batch_size, ubatch_size, chunks, threads or default_threads(),
                        on_chunk=on_chunk, flash_attn=flash_attn != "off", adapters=adapters)
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    sys.stdout.flush()
    log(f"Final estimate: PPL = {result.ppl:.4f} +/- {result.ppl_error:.5f}")
    n_tok = result.n_chunks * ctx_size
    log(f"perplexity: {n_tok} tokens in {elapsed:.2f} s = {n_tok / elapsed:.1f} tokens/s")


def main() -> None:
    sys.argv[1:] = join_pairs(sys.argv[1:], "--lora-scaled")
    guarded(cli)()

if __name__ == "__main__":
    main()
