"""llamapy-cli: text generation as llama.cpp's llama-completion does it (prompt echoed, text
streamed as it is produced, llama_perf lines at the end)."""
from __future__ import annotations

import codecs
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from llamapy import Batch, Context, load_model
from llamapy.errors import InputError
from llamapy.sampling import DEFAULT_SEED, default_chain

from .common import default_threads, guarded, join_pairs, load_adapters, log

cli = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


class TextStream:
    """Token pieces to stdout as they come; bytes of a split UTF-8 character wait for the rest."""

    def __init__(self, vocab, out=None) -> None:
        self.vocab = vocab
        self.out = out or sys.stdout
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def write(self, token: int) -> None:
        text = self.decoder.decode(self.vocab.token_to_piece(token))
        if text:
            self.out.write(text)
            self.out.flush()

    def close(self) -> None:
        self.out.write(self.decoder.decode(b"", final=True))
        self.out.flush()


def _perf(name: str, ms: float, n: int, unit: str) -> str:
    per = ms / n if n else 0.0
    tps = 1e3 * n / ms if ms > 0 else 0.0
    return (f"llama_perf_context_print: {name:>16} = {ms:10.2f} ms / {n:5d} {unit:6} "
            f"({per:8.2f} ms per token, {tps:8.2f} tokens per second)")


@cli.command()
def run(
    model: Annotated[Path, typer.Option("-m", "--model", help="GGUF model file")],
    prompt: Annotated[str, typer.Option("-p", "--prompt", help="prompt to continue")] = "",
    n_predict: Annotated[int, typer.Option("-n", "--n-predict", help="tokens to generate (-1: until end of text or context)")] = -1,
    ctx_size: Annotated[int, typer.Option("-c", "--ctx-size", help="context size (0: the model's)")] = 4096,
    batch_size: Annotated[int, typer.Option("-b", "--batch-size", help="prompt tokens per decode")] = 2048,
    ubatch_size: Annotated[int, typer.Option("-ub", "--ubatch-size", help="tokens computed at once")] = 512,
    threads: Annotated[Optional[int], typer.Option("-t", "--threads", help="CPU threads")] = None,
    temp: Annotated[float, typer.Option("--temp", help="temperature (<= 0: greedy)")] = 0.8,
    top_k: Annotated[int, typer.Option("--top-k", help="top-k (0: off)")] = 40,
    top_p: Annotated[float, typer.Option("--top-p", help="top-p (1.0: off)")] = 0.95,
    min_p: Annotated[float, typer.Option("--min-p", help="min-p (0.0: off)")] = 0.05,
    typical_p: Annotated[float, typer.Option("--typical", help="locally typical p (1.0: off)")] = 1.0,
    repeat_penalty: Annotated[float, typer.Option("--repeat-penalty", help="repeat penalty (1.0: off)")] = 1.0,
    repeat_last_n: Annotated[int, typer.Option("--repeat-last-n", help="tokens the penalties look back")] = 64,
    frequency_penalty: Annotated[float, typer.Option("--frequency-penalty")] = 0.0,
    presence_penalty: Annotated[float, typer.Option("--presence-penalty")] = 0.0,
    dynatemp_range: Annotated[float, typer.Option("--dynatemp-range", help="dynamic temperature range")] = 0.0,
    dynatemp_exp: Annotated[float, typer.Option("--dynatemp-exp")] = 1.0,
    seed: Annotated[int, typer.Option("-s", "--seed", help="RNG seed (-1: random)")] = -1,
    backend_sampling: Annotated[bool, typer.Option("-bs", "--backend-sampling", help="sample inside the model graph")] = False,
    lora: Annotated[Optional[list[Path]], typer.Option("--lora", help="LoRA adapter (repeatable)")] = None,
    lora_scaled: Annotated[Optional[list[str]], typer.Option("--lora-scaled", help="FILE SCALE: LoRA adapter and its scale (repeatable)")] = None,
    display_prompt: Annotated[bool, typer.Option("--display-prompt/--no-display-prompt")] = True,
) -> None:
    """Generate text continuing PROMPT with MODEL."""
    t_start = time.perf_counter()
    m = load_model(model)
    ctx = Context(m, n_ctx=ctx_size, n_batch=batch_size, n_ubatch=ubatch_size, n_threads=threads or default_threads())
    for adapter, scale in load_adapters(m, lora, lora_scaled):
        ctx.attach_lora(adapter, scale)
    t_load = time.perf_counter() - t_start
    vocab = m.vocab
    tokens = vocab.tokenize(prompt, add_special=True)
    if not tokens:
        raise InputError("the prompt is empty and the model adds no BOS: nothing to continue")
    if len(tokens) >= ctx.n_ctx:
        raise InputError(f"the prompt is {len(tokens)} tokens, the context only {ctx.n_ctx}")
    chain = default_chain(vocab.n_tokens, seed=DEFAULT_SEED if seed < 0 else seed, temp=temp, top_k=top_k, top_p=top_p,
                          min_p=min_p, typical_p=typical_p, repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                          freq_penalty=frequency_penalty, presence_penalty=presence_penalty,
                          dynatemp_range=dynatemp_range, dynatemp_exp=dynatemp_exp)
    log(f"model: {m.path.name}: {m.describe()}")
    log(f"sampler chain: {chain!r}{' (in the graph: ' + str(chain.backend_prefix()) + ' samplers)' if backend_sampling else ''}")
    if backend_sampling:
        ctx.set_sampler(0, chain)
    ctx.set_warmup(True)
    stream = TextStream(vocab)
    if display_prompt:
        for t in tokens:
            stream.write(t)

    t0 = time.perf_counter()
    for start in range(0, len(tokens), ctx.n_batch):
        ctx.decode(Batch.from_tokens(tokens[start:start + ctx.n_batch], pos0=start))
    t_prompt = time.perf_counter() - t0

    n_gen, n_eval, t_eval, pos = 0, 0, 0.0, len(tokens)
    limit = n_predict if n_predict >= 0 else ctx.n_ctx
    while n_gen < limit:
        token = chain.sample(ctx, -1)
        if vocab.is_eog(token):
            break
        stream.write(token)
        n_gen += 1
        if pos >= ctx.n_ctx:
            log("\ncontext full: stopping")
            break
        if n_gen >= limit:
            break
        t1 = time.perf_counter()
        ctx.decode(Batch.from_tokens([token], pos0=pos))
        t_eval += time.perf_counter() - t1
        n_eval += 1
        pos += 1
    stream.close()
    sys.stdout.write("\n")
    sys.stdout.flush()
    t_total = time.perf_counter() - t_start
    n_s = chain.n_sample
    log("")
    log(f"llama_perf_sampler_print:    sampling time = {chain.t_sample * 1e3:10.2f} ms / {n_s:5d} runs   "
        f"({chain.t_sample * 1e3 / max(n_s, 1):8.2f} ms per token, {n_s / chain.t_sample if chain.t_sample else 0:8.2f} "
        "tokens per second)")
    log(f"llama_perf_context_print:        load time = {t_load * 1e3:10.2f} ms")
    log(_perf("prompt eval time", t_prompt * 1e3, len(tokens), "tokens"))
    log(_perf("eval time", t_eval * 1e3, n_eval, "runs"))
    log(f"llama_perf_context_print:       total time = {t_total * 1e3:10.2f} ms / {len(tokens) + n_eval:5d} tokens")


def main() -> None:
    sys.argv[1:] = join_pairs(sys.argv[1:], "--lora-scaled")
    guarded(cli)()

if __name__ == "__main__":
    main()
