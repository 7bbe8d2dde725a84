"""llamapy-cli: text generation as llama.cpp's llama-completion does it (prompt echoed, text
streamed as it is produced, llama_perf lines at the end), and chat as llama-cli does it:
`-cnv` talks with the model turn by turn through its chat template (`-sys` a system
prompt, `-p` the first user message), `--chat` answers the `-p` message once.

In a conversation the KV cache keeps what was already computed: each turn the whole
conversation is rendered and tokenized again (so the model sees exactly what the template
writes, as in training) and only the tokens after the longest prefix already in the cache
are decoded."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from llamapy import Context, load_model
from llamapy.chat import ChatTemplate
from llamapy.defaults import default_model_path
from llamapy.errors import InputError
from llamapy.generate import Generator, sampler_chain, token_text

from .common import (ChatTemplateOption, chat_template_for, default_threads, guarded, join_pairs, load_adapters,
                     log, note_first_run)

cli = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

EXIT_COMMANDS = ("/exit", "/quit")


def _perf(name: str, ms: float, n: int, unit: str) -> str:
    per = ms / n if n else 0.0
    tps = 1e3 * n / ms if ms > 0 else 0.0
    return (f"llama_perf_context_print: {name:>16} = {ms:10.2f} ms / {n:5d} {unit:6} "
            f"({per:8.2f} ms per token, {tps:8.2f} tokens per second)")


def print_perf(gen: Generator, t_load: float, t_total: float) -> None:
    chain = gen.chain
    n_s = chain.n_sample
    log("")
    log(f"llama_perf_sampler_print:    sampling time = {chain.t_sample * 1e3:10.2f} ms / {n_s:5d} runs   "
        f"({chain.t_sample * 1e3 / max(n_s, 1):8.2f} ms per token, {n_s / chain.t_sample if chain.t_sample else 0:8.2f} "
        "tokens per second)")
    log(f"llama_perf_context_print:        load time = {t_load * 1e3:10.2f} ms")
    log(_perf("prompt eval time", gen.t_prompt * 1e3, gen.n_prompt, "tokens"))
    log(_perf("eval time", gen.t_eval * 1e3, gen.n_eval, "runs"))
    log(f"llama_perf_context_print:       total time = {t_total * 1e3:10.2f} ms / {gen.n_prompt + gen.n_eval:5d} tokens")
    log(f"llama_perf_context_print:    graphs reused = {gen.ctx.n_graphs_reused:10d}")


@cli.command()
def run(
    model: Annotated[Optional[Path], typer.Option("-m", "--model", help="GGUF model file (default: Gemma 3 270M Q4_K_M)")] = None,
    prompt: Annotated[str, typer.Option("-p", "--prompt", help="prompt to continue (with -cnv or --chat: the first user message)")] = "",
    n_predict: Annotated[int, typer.Option("-n", "--n-predict", help="tokens to generate, per turn in a chat (-1: until end of text or context)")] = -1,
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
    conversation: Annotated[bool, typer.Option("-cnv", "--conversation", help="chat turn by turn through the chat template (stdin; /exit or Ctrl-D ends)")] = False,
    chat: Annotated[bool, typer.Option("--chat", "-st", "--single-turn", help="answer the -p message as a chat turn, then exit")] = False,
    system_prompt: Annotated[Optional[str], typer.Option("-sys", "--system-prompt", help="system message of the chat")] = None,
    chat_template: ChatTemplateOption = None,
) -> None:
    """Generate text continuing PROMPT with MODEL, or chat with it (-cnv, --chat)."""
    t_start = time.perf_counter()
    if chat and not prompt:
        raise InputError("--chat answers the -p message: give one (or use -cnv to type them)")
    m = load_model(model or default_model_path(log))
    note_first_run()
    ctx = Context(m, n_ctx=ctx_size, n_batch=batch_size, n_ubatch=ubatch_size, n_threads=threads or default_threads())
    adapters = load_adapters(m, lora, lora_scaled)
    template = None
    if conversation or chat:
        template = chat_template_for(m, chat_template)
    elif system_prompt is not None or chat_template is not None:
        raise InputError("-sys and --chat-template are for chats: add -cnv (interactive) or --chat (one turn)")
    t_load = time.perf_counter() - t_start
    vocab = m.vocab
    chain = sampler_chain(vocab.n_tokens, seed=seed, temp=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                          typical_p=typical_p, repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                          frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                          dynatemp_range=dynatemp_range, dynatemp_exp=dynatemp_exp)
    log(f"model: {m.path.name}: {m.describe()}")
    log(f"sampler chain: {chain!r}{' (in the graph: ' + str(chain.backend_prefix()) + ' samplers)' if backend_sampling else ''}")
    gen = Generator(ctx, chain, backend_sampling=backend_sampling, lora=adapters)
    ctx.set_warmup(True)
    if template is not None:
        talk(gen, template, prompt, system_prompt, n_predict, interactive=conversation)
    else:
        complete(gen, prompt, n_predict, display_prompt)
    print_perf(gen, t_load, time.perf_counter() - t_start)


def complete(gen: Generator, prompt: str, n_predict: int, display_prompt: bool) -> None:
    """Continue `prompt` (llama-completion)."""
    tokens = gen.tokenize(prompt)
    if display_prompt:
        write(token_text(gen.vocab, tokens))
    gen.feed(tokens)
    for piece in gen.stream(n_predict):
        write(piece.text)
    write("\n")
    if gen.context_full:
        log("context full: stopping")


def talk(gen: Generator, template: ChatTemplate, first: str, system_prompt: str | None, n_predict: int,
         interactive: bool) -> None:
    """A chat: each user message (the first from -p, the others read from stdin when
    interactive) is answered through the template; the answers join the conversation."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    message = first
    while True:
        if not message:
            if not interactive:
                return
            message = read_message()
            if message is None:
                return
            if not message:
                continue
        messages.append({"role": "user", "content": message})
        tokens, _ = template.tokenize(gen.vocab, messages, add_generation_prompt=True)
        gen.feed(tokens)
        try:
            for piece in gen.stream(n_predict):
                write(piece.text)
            reply, full = gen.tokens, gen.context_full
        except KeyboardInterrupt:  # Ctrl-C ends the answer, not the chat
            reply, full = [], False
            if not interactive:
                raise
        write("\n")
        messages.append({"role": "assistant", "content": gen.vocab.detokenize(reply)})
        if full:
            log("context full: ending the chat")
            return
        if not interactive:
            return
        message = ""


def write(text: str) -> None:
    """Text to stdout as soon as it comes."""
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


def read_message() -> str | None:
    """The next user message from stdin after a "> " prompt (a line ending in \\ continues
    on the next); None at end of input or /exit."""
    lines = []
    while True:
        sys.stdout.write("\n> " if not lines else "")
        sys.stdout.flush()
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:
            return None
        if not line:
            return None if not lines else "\n".join(lines)
        line = line.rstrip("\n")
        if line.endswith("\\"):
            lines.append(line[:-1])
            continue
        lines.append(line)
        text = "\n".join(lines).strip()
        return None if text in EXIT_COMMANDS else text


def main() -> None:
    sys.argv[1:] = join_pairs(sys.argv[1:], "--lora-scaled")
    guarded(cli)()

if __name__ == "__main__":
    main()
