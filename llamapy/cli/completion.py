"""llamapy-cli: text generation as llama.cpp's llama-completion does it (prompt echoed, text
streamed as it is produced, llama_perf lines at the end), and chat as llama-cli does it:
`-cnv` talks with the model turn by turn through its chat template (`-sys` a system
prompt, `-p` the first user message), `-st` answers the `-p` message once.

The loop is the library's (llamapy.generate.Generator): in a conversation the KV cache keeps
what was already computed, each turn the whole conversation is rendered and tokenized again
(so the model sees exactly what the template writes, as in training) and only the tokens
after the longest prefix already in the cache are decoded."""
from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

from llamapy import Context, load_model
from llamapy.defaults import default_model_path
from llamapy.errors import InputError
from llamapy.generate import Generator, sampler_chain, token_text
from llamapy.samples import unescape
from llamapy.sampling.grammar_parser import GrammarError
from llamapy.sampling.grammar_sampler import constrain
from llamapy.sampling.json_schema_grammar import json_schema_to_grammar
from llamapy.text_input import check_text

from . import flags as F
from .args import CHAT, GENERATION, Tool, flag
from .common import (
    adapter_list,
    chat_template_for,
    freeze_startup_objects,
    kv_cache_types,
    load_adapters,
    log,
    random_seed,
    read_text,
    thread_count,
    warn,
)

if TYPE_CHECKING:  # imported when a template is used (common.chat_template_for), inside the command's
    from llamapy.chat import ChatTemplate  # error handling: a jinja2 it cannot use is one line (jinja_compat)

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


tool = Tool("llamapy-cli", llama_cpp=["completion", "cli"])

DisplayPrompt = Annotated[bool, flag("--display-prompt/--no-display-prompt", group=GENERATION,
                                     help="echo the prompt before the text")]
VerbosePrompt = Annotated[bool, flag("--verbose-prompt", group=GENERATION, show_default=False,
                                     help="print the prompt's tokens before generating")]
ReversePrompt = Annotated[Optional[list[str]], flag("-r", "--reverse-prompt", metavar="PROMPT", group=GENERATION,
                                                    show_default=False,
                                                    help="stop generating at PROMPT (repeatable); in a chat, the "
                                                         "answer ends there")]
Special = Annotated[bool, flag("-sp", "--special", group=GENERATION, show_default=False,
                               help="print special tokens (such as <end_of_turn>) as text")]
Conversation = Annotated[bool, flag("-cnv", "--conversation/-no-cnv", "--no-conversation", group=CHAT,
                                    show_default=False,
                                    help="chat turn by turn through the chat template (stdin; /exit or Ctrl-D ends)")]
SingleTurn = Annotated[bool, flag("-st", "--single-turn", "--chat", group=CHAT, show_default=False,
                                  help="answer the -p message as one chat turn, then exit")]
SystemPrompt = Annotated[Optional[str], flag("-sys", "--system-prompt", metavar="PROMPT", group=CHAT,
                                             show_default=False, help="the chat's system message")]
SystemPromptFile = Annotated[Optional[Path], flag("-sysf", "--system-prompt-file", metavar="FNAME", group=CHAT,
                                                  path="read",
                                                  show_default=False, help="read the system message from this file")]


@tool.command
def run(model: F.OptionalModel = None, prompt: F.Prompt = "", file: F.PromptFile = None, escape: F.Escape = False,
        n_predict: F.NPredict = -1, ctx_size: F.CtxSize = 0, batch_size: F.BatchSize = 2048,
        ubatch_size: F.UbatchSize = 512, threads: F.Threads = None, flash_attn: F.FlashAttn = "auto",
        cache_type_k: F.CacheTypeK = "f16", cache_type_v: F.CacheTypeV = "f16",
        temp: F.Temp = 0.8, top_k: F.TopK = 40, top_p: F.TopP = 0.95, min_p: F.MinP = 0.05, typical_p: F.Typical = 1.0,
        repeat_penalty: F.RepeatPenalty = 1.0, repeat_last_n: F.RepeatLastN = 64,
        frequency_penalty: F.FrequencyPenalty = 0.0, presence_penalty: F.PresencePenalty = 0.0,
        dynatemp_range: F.DynatempRange = 0.0, dynatemp_exp: F.DynatempExp = 1.0, seed: F.Seed = -1,
        logit_bias: F.LogitBias = None, ignore_eos: F.IgnoreEos = False, grammar: F.GrammarText = None,
        grammar_file: F.GrammarFile = None, json_schema: F.JsonSchema = None, json_schema_file: F.JsonSchemaFile = None,
        backend_sampling: F.BackendSampling = False,
        lora: F.Lora = None, lora_scaled: F.LoraScaled = None, display_prompt: DisplayPrompt = True,
        verbose_prompt: VerbosePrompt = False, reverse_prompt: ReversePrompt = None, special: Special = False,
        conversation: Conversation = False, chat: SingleTurn = False, system_prompt: SystemPrompt = None,
        system_prompt_file: SystemPromptFile = None, chat_template: F.ChatTemplate = None,
        chat_template_file: F.ChatTemplateFile = None) -> None:
    """Generate text continuing PROMPT with MODEL, as llama-completion, or chat with it (-cnv, -st)."""
    t_start = time.perf_counter()
    if file is not None:
        if prompt:
            raise InputError("give the prompt with -p or with -f, not both")
        prompt = read_text(file)
    check_text(prompt, "-p")
    if escape:
        prompt = unescape(prompt)
    if system_prompt_file is not None:
        if system_prompt is not None:
            raise InputError("give the system message with -sys or with -sysf, not both")
        system_prompt = read_text(system_prompt_file)
    if chat_template_file is not None:
        if chat_template is not None:
            raise InputError("give the chat template with --chat-template or --chat-template-file, not both")
        chat_template = str(chat_template_file)
    if system_prompt is not None:
        check_text(system_prompt, "-sys")
    if chat and not prompt:
        raise InputError("-st answers the -p message: give one (or use -cnv to type them)")
    if flash_attn not in ("on", "off", "auto"):
        raise InputError(f"-fa must be on, off or auto, not {flash_attn!r}")
    type_k, type_v = kv_cache_types(cache_type_k, cache_type_v)
    if repeat_penalty <= 0:
        raise InputError(f"--repeat-penalty must be > 0 (1.0: off), not {repeat_penalty:g}")
    adapter_list(lora, lora_scaled)  # a bad --lora-scaled is refused before the model is read
    constraint = read_constraint(grammar, grammar_file, json_schema, json_schema_file)
    if constraint is not None and backend_sampling:
        warn("backend sampling is not compatible with a grammar: the chain samples on the CPU (as llama.cpp)")
        backend_sampling = False
    seed = random_seed() if seed == -1 else seed
    m = load_model(model or default_model_path(log))
    if ctx_size > m.hparams.n_ctx_train:
        warn(f"the model was trained on only {m.hparams.n_ctx_train} context tokens ({ctx_size} specified)")
    ctx = Context(m, n_ctx=ctx_size, n_batch=batch_size, n_ubatch=ubatch_size, n_threads=thread_count(threads),
                  flash_attn=flash_attn != "off", type_k=type_k, type_v=type_v)
    adapters = load_adapters(m, lora, lora_scaled)
    template = None
    if conversation or chat:
        template = chat_template_for(m, chat_template)
    elif system_prompt is not None or chat_template is not None:
        raise InputError("-sys and --chat-template are for chats: add -cnv (interactive) or -st (one turn)")
    t_load = time.perf_counter() - t_start
    vocab = m.vocab
    bias = parse_logit_bias(logit_bias, vocab)
    if ignore_eos:  # llama.cpp's --ignore-eos: the end-of-generation tokens can never be sampled
        bias.update({t: float("-inf") for t in vocab.eog_ids})
    chain = sampler_chain(vocab.n_tokens, seed=seed, temp=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                          typical_p=typical_p, repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                          frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                          dynatemp_range=dynatemp_range, dynatemp_exp=dynatemp_exp, logit_bias=bias)
    if constraint is not None:
        where, text = constraint
        try:
            chain = constrain(chain, vocab, grammar=text)
        except GrammarError as e:
            raise InputError(f"{where}: {str(e).removeprefix('grammar: ')}") from None
    log(f"model: {m.path.name}: {m.describe()}")
    log(f"sampler chain: {chain!r}{' (in the graph: ' + str(chain.backend_prefix()) + ' samplers)' if backend_sampling else ''}")
    gen = Generator(ctx, chain, backend_sampling=backend_sampling, lora=adapters)
    ctx.set_warmup(True)
    freeze_startup_objects()
    out = Output(display_prompt, verbose_prompt, special, tuple(reverse_prompt or ()))
    if template is not None:
        talk(gen, template, prompt, system_prompt, n_predict, conversation, out)
    else:
        complete(gen, prompt, n_predict, out)
    print_perf(gen, t_load, time.perf_counter() - t_start)


@dataclass(frozen=True)
class Output:
    """What the output flags ask of the text: the prompt echoed (--display-prompt) or listed
    token by token (--verbose-prompt), special tokens as text (-sp), stop strings (-r)."""

    display_prompt: bool = True
    verbose_prompt: bool = False
    special: bool = False
    stop: tuple[str, ...] = ()


def read_constraint(grammar: str | None, grammar_file: Path | None, json_schema: str | None,
                    json_schema_file: Path | None) -> tuple[str, str] | None:
    """(the flag that gave it, GBNF text) of --grammar, --grammar-file, -j or -jf (a schema is
    converted here, as llama.cpp converts it while reading its flags), or None."""
    given = [(name, value) for name, value in (("--grammar", grammar), ("--grammar-file", grammar_file),
                                               ("-j", json_schema), ("-jf", json_schema_file)) if value is not None]
    if len(given) > 1:
        raise InputError(f"give one grammar or JSON schema, not {' and '.join(name for name, _ in given)}")
    if not given:
        return None
    name, value = given[0]
    where = name if isinstance(value, str) else f"{name} {value}"
    text = value if isinstance(value, str) else read_text(value, "grammar" if name == "--grammar-file" else "JSON schema")
    if name in ("-j", "-jf"):
        try:
            text = json_schema_to_grammar(text, warn=warn)
        except GrammarError as e:
            raise InputError(f"{where}: {e}") from None
    return (where, text) if text else None


def parse_logit_bias(items: list[str] | None, vocab) -> dict[int, float]:
    """llama.cpp's `-l TOKEN_ID(+/-)BIAS`: `15043+1`, `15043-1`, `15043-inf`."""
    biases: dict[int, float] = {}
    for item in items or []:
        m = re.fullmatch(r"\s*(\d+)\s*([+-])\s*(inf|[0-9.]+(?:e[+-]?\d+)?)\s*", item, re.IGNORECASE)
        if m is None:
            raise InputError(f"-l {item}: expected TOKEN_ID(+/-)BIAS, e.g. 15043+1 or 15043-inf")
        token = int(m.group(1))
        if not 0 <= token < vocab.n_tokens:
            raise InputError(f"-l {item}: token {token} is not in the vocabulary (0..{vocab.n_tokens - 1})")
        biases[token] = float(m.group(2) + m.group(3))
    return biases


def complete(gen: Generator, prompt: str, n_predict: int, out: Output) -> None:
    """Continue `prompt` (llama-completion)."""
    tokens = gen.tokenize(prompt)
    if out.verbose_prompt:
        show_prompt(gen.vocab, prompt, tokens)
    if out.display_prompt:
        write(token_text(gen.vocab, tokens, out.special))
    gen.feed(tokens)
    for piece in gen.stream(n_predict, out.stop, out.special):
        write(piece.text)
    write("\n")
    if gen.context_full:
        log("context full: stopping")


def talk(gen: Generator, template: ChatTemplate, first: str, system_prompt: str | None, n_predict: int,
         interactive: bool, out: Output) -> None:
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
            try:
                check_text(message, "your message")
            except InputError as e:
                log(f"error: {e} (type it again)", 1)
                message = ""
                continue
            if not message:
                continue
        messages.append({"role": "user", "content": message})
        tokens, _ = template.tokenize(gen.vocab, messages, add_generation_prompt=True)
        if out.verbose_prompt:
            show_prompt(gen.vocab, None, tokens)
        gen.feed(tokens)
        try:
            for piece in gen.stream(n_predict, out.stop, out.special):
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


def show_prompt(vocab, prompt: str | None, tokens) -> None:
    """llama.cpp's --verbose-prompt: the prompt and each of its tokens with its text."""
    if prompt is not None:
        log(f"prompt: {prompt!r}")
    log(f"number of tokens in prompt = {len(tokens)}")
    for t in tokens:
        log(f"{int(t):6d} -> {vocab.token_to_piece(int(t), True).decode('utf-8', 'replace')!r}")


main = tool.main

if __name__ == "__main__":
    main()
