"""The library's one generation loop: a prompt in, sampled tokens and their text out.

Everything that generates text goes through here (llamapy-cli's completions and chats,
llamapy-train --predict, the benchmarks, the tests), so they share one behaviour:

- `Generator` holds a `Context`, its sampler chain and the tokens the KV cache holds for
  sequence 0. `feed(tokens)` keeps the longest prefix the cache already holds and decodes
  only the rest (a chat's next turn, a second prompt sharing a prefix); `stream()` samples
  one token at a time and yields `Piece`s (token id and text). Text is released as it
  becomes certain: the bytes of a UTF-8 character split across tokens wait for the rest,
  and with stop strings whatever could still be the start of one waits too. It keeps
  llama_perf's counters (prompt tokens decoded in batches, generated tokens one by one).
- `generate(model, prompt, ...)` (mlx_lm's and llama-cpp-python's call) and
  `chat_completion(model, messages, ...)` (OpenAI-shaped messages in and out) run a
  Generator kept per model, so repeated calls reuse its Context and KV cache prefix.
- `generate_batch(model, prompts, ...)` runs several prompts together, one KV stream each
  (throughput for evaluations), with the same per-sequence rules (`TextRun`).

Finish reasons are OpenAI's: "stop" (an end-of-generation token or a stop string) and
"length" (max_tokens, or the context is full: `Generator.context_full` tells them apart).

Names: the package exports the function `llamapy.generate`, which shadows this module as
an attribute of the package; import the rest with `from llamapy.generate import Generator`
(a `from` import always finds the module). The chat call is `llamapy.chat_completion`, not
`llamapy.chat`: `llamapy.chat` is the module of `ChatTemplate` (`llamapy.chat.ChatTemplate`
is documented and used), and a function of that name would shadow it.
"""
from __future__ import annotations

import codecs
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypedDict, TypeVar, Union, Unpack

import numpy as np

from .batch import Batch
from .context import Context
from .errors import InputError
from .model import Model, load_model
from .sampling import DEFAULT_SEED, SamplerChain, default_chain
from .sampling.grammar import Grammar
from .sampling.grammar_sampler import GrammarChain, GrammarTrigger, constrain

if TYPE_CHECKING:
    from .chat import ChatTemplate
    from .lora import LoraAdapter

__all__ = ["Completion", "Generator", "Piece", "SamplingOptions", "Stream", "TextRun", "cached_generator", "chat_completion",
           "default_n_ctx", "forget", "generate", "generate_batch", "prompt_tokens", "sampler_chain", "stop_list",
           "token_logprobs", "token_text"]

ModelLike = Model | str | os.PathLike
Prompt = str | Sequence[int]
# an adapter, or a GGUF LoRA file, at scale 1, or either with its scale
LoraItem = Union["LoraAdapter", str, os.PathLike, tuple[Union["LoraAdapter", str, os.PathLike], float]]
Stop = str | Sequence[str] | None
T = TypeVar("T")

MAX_DEFAULT_N_CTX = 4096  # a default context beyond this costs KV memory most calls never use


# ---- the sampler chain ----------------------------------------------------------------------
class SamplingOptions(TypedDict, total=False):
    """llama.cpp's sampling parameters (common_params_sampling), by their usual names."""
    temperature: float  # or `temp`; <= 0: greedy
    temp: float
    top_k: int  # 0: off
    top_p: float  # 1.0: off
    min_p: float  # 0.0: off
    typical_p: float  # 1.0: off
    repeat_penalty: float  # 1.0: off
    repeat_last_n: int
    frequency_penalty: float
    presence_penalty: float
    dynatemp_range: float
    dynatemp_exp: float
    seed: int  # < 0: DEFAULT_SEED
    logit_bias: dict[int, float]  # token id -> bias added to its logit (-inf: never sampled)
    grammar: str | Grammar  # GBNF text (llama.cpp's grammars/*.gbnf format) or a compiled Grammar
    json_schema: dict | str  # a JSON schema (or its JSON text): the output is JSON that conforms
    grammar_lazy: bool  # constrain only from a trigger on
    grammar_triggers: list[str | GrammarTrigger]  # a lazy grammar's triggers (a str: a word)


GRAMMAR_OPTIONS = ("grammar", "json_schema", "grammar_lazy", "grammar_triggers")


def sampler_chain(vocab, sampler: SamplerChain | None = None, **options: Unpack[SamplingOptions]) -> SamplerChain:
    """`sampler` itself, or llama.cpp's default chain (penalties, top-k, typical, top-p,
    min-p, temperature, dist) with llama.cpp's defaults for the options not given; with
    `grammar` or `json_schema`, constrained by it (llama.cpp's common_sampler). `vocab`: the
    model's Vocab (a grammar needs it), or only the vocabulary's size."""
    unknown = set(options) - set(SamplingOptions.__annotations__)
    if unknown:
        raise TypeError(f"unknown sampling option(s) {', '.join(sorted(unknown))} "
                        f"(known: {', '.join(SamplingOptions.__annotations__)})")
    constraint = {k: options.pop(k) for k in GRAMMAR_OPTIONS if k in options}  # type: ignore[misc]
    n_vocab = vocab if isinstance(vocab, int) else vocab.n_tokens
    chain = _unconstrained_chain(n_vocab, sampler, options)
    if not constraint:
        return chain
    if isinstance(vocab, int):
        raise TypeError("a grammar or JSON schema needs the model's vocabulary: pass model.vocab, not its size")
    return constrain(chain, vocab, **constraint)


def _unconstrained_chain(n_vocab: int, sampler: SamplerChain | None, options: dict) -> SamplerChain:
    if sampler is not None:
        if options:
            raise TypeError(f"give a sampler chain or sampling options ({', '.join(options)}), not both")
        return sampler
    if "temperature" in options and "temp" in options:
        raise TypeError("give temperature or temp, not both")
    kw: dict[str, Any] = dict(options)
    if "temperature" in kw:
        kw["temp"] = kw.pop("temperature")
    if "frequency_penalty" in kw:
        kw["freq_penalty"] = kw.pop("frequency_penalty")
    seed = kw.pop("seed", DEFAULT_SEED)
    return default_chain(n_vocab, seed=DEFAULT_SEED if seed < 0 else seed, **kw)


# ---- text as it comes -----------------------------------------------------------------------
@dataclass(frozen=True)
class Piece:
    """One step of a stream: the sampled token and the text released with it ("" while
    it is held back). A last piece with token None carries text released at the end.
    With logprobs asked for: the token's log-probability under the model (the softmax of
    its logits, before any sampler) and the `top` most likely tokens with theirs, best first."""
    token: int | None
    text: str
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: np.ndarray, token: int, n_top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """`token`'s log-probability in a logit row and the `n_top` most likely (id, log-probability)
    pairs, best first: what llama-server's n_probs and OpenAI's logprobs report."""
    logp = np.asarray(logits, np.float64)
    logp = logp - logp.max()
    logp -= np.log(np.exp(logp).sum())
    top: tuple[tuple[int, float], ...] = ()
    if n_top > 0:
        n = min(n_top, len(logp))
        best = np.argpartition(-logp, n - 1)[:n]              # the n best of the whole vocabulary,
        best = best[np.argsort(-logp[best], kind="stable")]  # then only they are sorted
        top = tuple((int(t), float(logp[t])) for t in best)
    return float(logp[token]), top


@dataclass
class Completion:
    """A whole generation with its accounting (`generate(..., details=True)`): the text, the
    generated tokens (an end-of-generation token not included), why it ended, OpenAI's usage
    counts, and with logprobs one Piece per generated token carrying its log-probabilities."""
    text: str
    tokens: list[int]
    finish_reason: str | None
    prompt_tokens: int
    logprobs: list[Piece] | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)

    @property
    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def stop_list(stop: Stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    return tuple(s for s in stop if s)  # an empty stop string would end every generation at once


def _held(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the start of a stop string (not a whole one)."""
    held = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:k]):
                held = k
                break
    return held


class TextRun:
    """One sequence's generation rules: tokens in, text out, and when it ends. The UTF-8
    bytes of a character split across tokens wait for the rest (an incremental decoder);
    with stop strings the text that could still begin one waits too, and the first stop
    string found ends the run (it and what follows are dropped)."""

    def __init__(self, vocab, max_tokens: int, stops: tuple[str, ...], special: bool = False) -> None:
        self.vocab, self.max_tokens, self.stops, self.special = vocab, max_tokens, stops, special
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.pending = ""  # decoded, held back: it may be the start of a stop string
        self.stopped = False  # a stop string was found: nothing more is released
        self.stop_word: str | None = None  # the stop string that ended the run
        self.tokens: list[int] = []
        self.text: list[str] = []
        self.finish_reason: str | None = "length" if max_tokens == 0 else None

    def push(self, token: int) -> str:
        """Take a sampled token; returns the text it releases. Sets finish_reason when the
        run ends with it (an end-of-generation token is not kept)."""
        if self.vocab.is_eog(token):
            return self.end("stop")
        self.tokens.append(token)
        out = self._release(self.decoder.decode(self.vocab.token_to_piece(token, self.special)), False)
        if self.finish_reason is None and 0 <= self.max_tokens <= len(self.tokens):
            out += self.end("length")
        return out

    def end(self, reason: str) -> str:
        """End the run for `reason`; returns the text still held back (a stop string found
        in it makes the reason "stop")."""
        self.finish_reason = self.finish_reason or reason
        return self._release(self.decoder.decode(b"", final=True), True)

    def _release(self, text: str, final: bool) -> str:
        if self.stopped:
            return ""
        if self.stops:
            text, self.pending = self.pending + text, ""
            found = [(i, s) for s in self.stops if (i := text.find(s)) >= 0]
            if found:
                cut, self.stop_word = min(found, key=lambda f: f[0])  # the first of the earliest
                self.stopped, self.finish_reason, text = True, "stop", text[:cut]
            elif not final:
                held = _held(text, self.stops)
                if held:
                    text, self.pending = text[:-held], text[-held:]
        self.text.append(text)
        return text


def prompt_tokens(vocab, prompt: Prompt) -> list[int]:
    """A text's tokens (BOS first when the model adds one), or the given token ids."""
    tokens = vocab.tokenize(prompt, add_special=True) if isinstance(prompt, str) else [int(t) for t in prompt]
    if not tokens:
        raise InputError("the prompt is empty and the model adds no BOS: nothing to continue")
    return tokens


def _load_adapter(item: LoraItem, model: Model, loaded: dict[tuple[str, int], LoraAdapter]) -> tuple[LoraAdapter, float]:
    """(adapter, scale) of a `lora` item; files are read once into `loaded` (by path and
    modification time: a rewritten file is a new adapter)."""
    from .lora import LoraAdapter
    thing, scale = item if isinstance(item, tuple) else (item, 1.0)
    if isinstance(thing, LoraAdapter):
        return thing, float(scale)
    path = Path(thing).resolve()
    if not path.is_file():
        raise InputError(f"LoRA adapter {thing}: no such file")
    key = (str(path), path.stat().st_mtime_ns)
    if key not in loaded:
        for old in [k for k in loaded if k[0] == key[0]]:
            del loaded[old]
        loaded[key] = LoraAdapter.load(path, model)
    return loaded[key], float(scale)


def token_text(vocab, tokens: Iterable[int], special: bool = False) -> str:
    """The text of `tokens` as a stream prints it: each token's piece in turn (unlike
    `Vocab.detokenize`, no leading space is removed; `special`: control tokens too)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    return ("".join(decoder.decode(vocab.token_to_piece(int(t), special)) for t in tokens)
            + decoder.decode(b"", final=True))


# ---- the generator --------------------------------------------------------------------------
def default_n_ctx(model: Model) -> int:
    """The model's training context, capped at 4096 (most prompts need far less KV cache)."""
    return min(model.hparams.n_ctx_train, MAX_DEFAULT_N_CTX)


class Generator:
    """A Context, its sampler chain and the tokens its KV cache holds for sequence 0, with
    llama_perf's counters: prompt tokens decoded in batches of n_batch (`n_prompt`,
    `t_prompt` seconds), generated tokens decoded one by one (`n_eval`, `t_eval`).

    `Generator(model_or_path, temperature=0.0)` makes its own Context (`n_ctx`, `n_threads`);
    `Generator(ctx, chain)` uses yours. `lora` attaches adapters (None: keep the context's).
    """

    def __init__(self, ctx: Context | ModelLike, sampler: SamplerChain | None = None, *, backend_sampling: bool = False,
                 lora: Iterable[LoraItem] | None = None, n_ctx: int | None = None, n_threads: int | None = None,
                 **sampling: Unpack[SamplingOptions]) -> None:
        if isinstance(ctx, Context):
            if n_ctx is not None or n_threads is not None:
                raise TypeError("n_ctx and n_threads make a new Context: give them with a model, not a Context")
        else:
            model = ctx if isinstance(ctx, Model) else load_model(ctx)
            ctx = Context(model, n_ctx=default_n_ctx(model) if n_ctx is None else n_ctx, n_threads=n_threads)
        self.ctx: Context = ctx
        self.model: Model = ctx.model
        self.vocab = ctx.model.vocab
        self.cached: list[int] = []  # the tokens the KV cache holds for sequence 0, in order
        self._deps: tuple = self._dependencies()  # what the cached K/V were computed with
        self.t_prompt = self.t_eval = 0.0
        self.n_prompt = self.n_eval = 0
        self.tokens: list[int] = []  # the last run's generated tokens (an end-of-generation token not included)
        self.finish_reason: str | None = None  # the last run's: "stop", "length" (None: running or abandoned)
        self.context_full = False  # the last run ended because the context was full
        self._lora_files: dict[tuple[str, int], LoraAdapter] = {}
        self._fed = False  # the logits of the last fed token are there to sample from
        self._run_id = 0
        self.chain: SamplerChain = SamplerChain()
        self._backend_sampling = False
        self.set_sampler(sampler, backend_sampling=backend_sampling, **sampling)
        if lora is not None:
            self.set_lora(lora)

    # -- configuration -------------------------------------------------------------------------
    def set_sampler(self, sampler: SamplerChain | None = None, *, backend_sampling: bool = False,
                    **sampling: Unpack[SamplingOptions]) -> SamplerChain:
        """Sample with `sampler`, or llama.cpp's default chain made from `sampling`; with
        `backend_sampling` the chain's leading samplers run inside the model graph (the
        CLI's -bs; same tokens). Takes effect from the next feed."""
        self.chain = sampler_chain(self.vocab, sampler, **sampling)
        self.ctx.set_sampler(0, self.chain if backend_sampling else None)
        if backend_sampling or self._backend_sampling:
            self._fed = False  # what the graph sampled last was for the previous chain: feed again
        self._backend_sampling = backend_sampling
        return self.chain

    def set_lora(self, lora: Iterable[LoraItem]) -> None:
        """Apply these adapters (and no others) from the next feed: each an adapter or a GGUF
        file, at scale 1 or paired with its scale. A different set than before makes the
        cached tokens useless: the next feed decodes its prompt from the start."""
        pairs = [_load_adapter(item, self.model, self._lora_files) for item in lora]
        if [(id(a), s) for a, s in pairs] == [(id(a), s) for a, s in self.ctx.adapters]:
            return
        self.ctx.detach_lora()
        for adapter, scale in pairs:
            self.ctx.attach_lora(adapter, scale)

    def _dependencies(self) -> tuple:
        """What K/V in the cache depend on besides the tokens: the weights' revision and the
        adapters (compared as objects, with their scales)."""
        return self.model.revision, tuple(self.ctx.adapters)

    # -- prompt --------------------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> list[int]:
        """A text's tokens (BOS first when the model adds one), or the given token ids."""
        return prompt_tokens(self.vocab, prompt)

    def feed(self, tokens: Sequence[int], prompt_logprobs: int | None = None) -> list[Piece] | None:
        """Make the cache hold `tokens`: keep the longest prefix it already holds (at least
        one token is decoded, for the logits), decode the rest in batches of n_batch.
        `prompt_logprobs` (the number of top alternatives, 0 for none): every prompt token
        after the first is scored, so all are decoded with their logits, and a Piece per
        scored token is returned (llama-cpp-python's echo with logprobs)."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise InputError("the prompt is empty and the model adds no BOS: nothing to continue")
        if len(tokens) >= self.ctx.n_ctx:
            raise InputError(f"the prompt is {len(tokens)} tokens and the context holds {self.ctx.n_ctx} (n_ctx, -c): "
                             "no room to generate; use a larger context or a shorter prompt")
        self._run_id += 1  # a stream still open on this generator is over
        deps = self._dependencies()
        if deps != self._deps:  # other weights or adapters: the cached K/V are not these tokens' any more
            self.cached, self._deps = [], deps
        keep = 0
        while (prompt_logprobs is None and keep < min(len(tokens) - 1, len(self.cached))
               and tokens[keep] == self.cached[keep]):
            keep += 1
        self.cached = self.cached[:keep]
        self._fed = False
        self.ctx.memory_seq_rm(0, keep, -1)  # also what an interrupted decode may have left
        scored: list[Piece] | None = None if prompt_logprobs is None else []
        t0 = time.perf_counter()
        for start in range(keep, len(tokens), self.ctx.n_batch):
            chunk = tokens[start:start + self.ctx.n_batch]
            if scored is None:
                self.ctx.decode(Batch.from_tokens(chunk, pos0=start))
            else:
                self.ctx.decode(Batch(np.array(chunk, np.int32), np.arange(start, start + len(chunk)),
                                      np.zeros(len(chunk), np.int32), np.ones(len(chunk), bool)))
                for row, nxt in enumerate(tokens[start + 1:start + 1 + len(chunk)]):
                    lp, top = token_logprobs(self.ctx.get_logits_ith(row), nxt, prompt_logprobs)
                    scored.append(Piece(nxt, self.vocab.token_to_piece(nxt).decode("utf-8", "replace"), lp, top))
            self.cached = tokens[:start + self.ctx.n_batch]
        self.t_prompt += time.perf_counter() - t0
        self.n_prompt += len(tokens) - keep
        self._fed = True
        return scored

    # -- generation ----------------------------------------------------------------------------
    def stream(self, max_tokens: int = -1, stop: Stop = None, special: bool = False,
               logprobs: int | None = None) -> Iterator[Piece]:
        """Continue what `feed` put in the cache: a Piece per sampled token (its text may be
        held back and come with a later piece), up to `max_tokens` (-1: until an
        end-of-generation token or a full context). With `stop`, generation ends where the
        text first contains one of them (not returned). `special`: control tokens (such as
        <end_of_turn>) have their text, as llama.cpp's --special. `logprobs`: each piece of a
        sampled token carries its log-probability and this many top alternatives (0: none).
        Then `finish_reason`, `tokens` and `context_full` describe the run."""
        if not self._fed:
            raise InputError("feed() the prompt before streaming: a stream continues the tokens fed last")
        if logprobs is not None and logprobs < 0:
            raise InputError(f"logprobs must be >= 0 (the number of top alternatives), not {logprobs}")
        self._fed = False
        if isinstance(self.chain, GrammarChain):
            self.chain.constraint.reset()  # each run is one text of the grammar (a chat's every answer)
        run = TextRun(self.vocab, max_tokens, stop_list(stop), special)
        self.tokens, self.finish_reason, self.context_full = run.tokens, None, False
        return self._stream(run, self._run_id, logprobs)

    def _stream(self, run: TextRun, run_id: int, logprobs: int | None) -> Iterator[Piece]:
        ctx, chain = self.ctx, self.chain
        while run.finish_reason is None:
            if self._run_id != run_id:
                raise InputError("this stream was abandoned: its generator was fed another prompt since")
            logits = None if logprobs is None else np.array(ctx.get_logits_ith(-1))  # before samplers touch it
            token = chain.sample(ctx, -1)
            lp, top = (None, ()) if logits is None else token_logprobs(logits, token, logprobs)
            text = run.push(token)
            if run.finish_reason is None and len(self.cached) >= ctx.n_ctx:
                self.context_full = True
                text += run.end("length")
            if run.finish_reason is not None:
                self.finish_reason = run.finish_reason  # known before the last piece is taken
                eog = self.vocab.is_eog(token)
                if text or not eog:
                    yield Piece(None if eog else token, text, None if eog else lp, () if eog else top)
                return
            yield Piece(token, text, lp, top)
            if self._run_id != run_id:
                raise InputError("this stream was abandoned: its generator was fed another prompt since")
            t1 = time.perf_counter()
            ctx.decode(Batch.from_tokens([token], pos0=len(self.cached)))
            self.t_eval += time.perf_counter() - t1
            self.n_eval += 1
            self.cached.append(token)
        self.finish_reason = run.finish_reason  # max_tokens 0

    def __call__(self, prompt: Prompt, max_tokens: int = -1, stop: Stop = None) -> str:
        """Feed `prompt` and return its continuation's text."""
        self.feed(self.tokenize(prompt))
        return "".join(p.text for p in self.stream(max_tokens, stop))


class Stream(Generic[T]):
    """An iterator over a generation's pieces (text, or chat deltas) that knows, once done,
    why it ended (`finish_reason`)."""

    def __init__(self, items: Iterator[T], gen: Generator) -> None:
        self._items, self._gen, self._run_id = items, gen, gen._run_id

    def __iter__(self) -> Stream[T]:
        return self

    def __next__(self) -> T:
        return next(self._items)

    @property
    def finish_reason(self) -> str | None:
        """"stop" or "length" once the stream is exhausted (None before)."""
        return self._gen.finish_reason if self._gen._run_id == self._run_id else None


# ---- the calls people know (mlx_lm, llama-cpp-python) -----------------------------------------
_last_loaded: dict[str, Model] = {}  # the model last given as a path (one): its session outlives the call


def _as_model(model: ModelLike) -> Model:
    if isinstance(model, Model):
        return model
    key = str(Path(model).resolve())
    if key not in _last_loaded:
        _last_loaded.clear()
        _last_loaded[key] = load_model(key)
    return _last_loaded[key]


@dataclass
class _Session:
    gen: Generator
    n_threads: int | None
    templates: dict[str, ChatTemplate]


def _session(model: Model, n_ctx: int | None, n_threads: int | None) -> _Session:
    """The model's Generator for generate() and chat_completion(): kept on the model itself
    (a WeakKeyDictionary cannot hold it, since the Generator refers to its model and would
    keep the key alive), replaced when a call needs a larger context or other threads."""
    want = default_n_ctx(model) if n_ctx is None else (n_ctx or model.hparams.n_ctx_train)
    session: _Session | None = getattr(model, "_llamapy_generation", None)
    if session is None or session.gen.ctx.n_ctx < want or (n_threads is not None and n_threads != session.n_threads):
        session = _Session(Generator(model, n_ctx=want, n_threads=n_threads), n_threads, {})
        model._llamapy_generation = session
    return session


def _start(session: _Session, tokens: Sequence[int] | Prompt, max_tokens: int, stop: Stop,
           lora: Iterable[LoraItem] | None, sampler: SamplerChain | None, backend_sampling: bool,
           sampling: SamplingOptions, logprobs: int | None = None) -> tuple[list[int], Iterator[Piece]]:
    """The prompt's tokens, fed, and the stream of its continuation."""
    gen = session.gen
    gen.set_sampler(sampler, backend_sampling=backend_sampling, **sampling)
    gen.set_lora(lora or [])
    prompt = gen.tokenize(tokens)
    gen.feed(prompt)
    return prompt, gen.stream(max_tokens, stop, logprobs=logprobs)


def _finished(gen: Generator, prompt: list[int], pieces: Iterator[Piece], logprobs: int | None) -> Completion:
    """Run a stream to its end, with its accounting."""
    kept = list(pieces)
    return Completion("".join(p.text for p in kept), list(gen.tokens), gen.finish_reason, len(prompt),
                      [p for p in kept if p.token is not None] if logprobs is not None else None)


def _check_model_call(model: ModelLike, prompt: Any, max_tokens: Any) -> tuple[Any, Any]:
    """mlx-lm's call shape `generate(model, tokenizer, prompt)`: the model's own vocabulary in
    the second place is allowed (llamapy needs no tokenizer passed), the prompt then third."""
    from .vocab import Vocab
    if isinstance(prompt, Vocab):
        if isinstance(model, Model) and prompt is not model.vocab:
            raise TypeError("generate(model, tokenizer, prompt): the tokenizer must be the model's own (model.vocab)")
        if not isinstance(max_tokens, (str, list, tuple)):
            raise TypeError("generate(model, tokenizer, prompt): the prompt is missing")
        return max_tokens, 256
    return prompt, max_tokens


def generate(model: ModelLike, prompt: Prompt, max_tokens: int = 256, *, stop: Stop = None, stream: bool = False,
             lora: Iterable[LoraItem] | None = None, sampler: SamplerChain | None = None,
             backend_sampling: bool = False, n_ctx: int | None = None, n_threads: int | None = None,
             details: bool = False, logprobs: int | None = None,
             **sampling: Unpack[SamplingOptions]) -> str | Completion | Stream[str] | Stream[Piece]:
    """The continuation of `prompt` (a text, BOS added as the model wants, or token ids),
    without the prompt: up to `max_tokens` tokens (-1: until end of generation or a full
    context), ended early by any of the `stop` strings (not included). Sampling: llama.cpp's
    default chain from `temperature`, `top_k`, ... (`seed`), or `sampler`. `lora`: adapters
    (or GGUF files), each at scale 1 or as (adapter, scale). `stream=True`: an iterator of
    text pieces as they come (with `finish_reason` at the end).

    `details=True` returns a `Completion` (text, tokens, finish_reason, usage) instead of the
    text, and with `stream=True` yields `Piece`s (token, text); `logprobs=N` (implies
    details) gives each generated token its log-probability and N top alternatives.
    mlx-lm's `generate(model, model.vocab, prompt)` is accepted too.

    Calls on the same model share a Context and keep the KV cache of the longest common
    prefix. Its n_ctx is the model's training context capped at 4096, or `n_ctx` when a
    call asks for more (a smaller one reuses the larger context); `n_threads` other than
    the last call's makes a new one. The cache assumes the weights and the adapter objects
    are not changed in place between calls: after training them in place, `forget(model)`
    (replacing tensors with `Model.set_tensor`, or an adapter by another object or a
    rewritten file, is noticed)."""
    prompt, max_tokens = _check_model_call(model, prompt, max_tokens)
    m = _as_model(model)
    session = _session(m, n_ctx, n_threads)
    details = details or logprobs is not None
    tokens, pieces = _start(session, prompt, max_tokens, stop, lora, sampler, backend_sampling, sampling, logprobs)
    if details:
        return Stream(pieces, session.gen) if stream else _finished(session.gen, tokens, pieces, logprobs)
    texts = (p.text for p in pieces if p.text)
    if stream:
        return Stream(texts, session.gen)
    return "".join(texts)


def chat_completion(model: ModelLike, messages: list[dict[str, Any]], max_tokens: int = 256, *, stop: Stop = None,
                    stream: bool = False, chat_template: str | os.PathLike | None = None,
                    lora: Iterable[LoraItem] | None = None, sampler: SamplerChain | None = None,
                    backend_sampling: bool = False, n_ctx: int | None = None, n_threads: int | None = None,
                    **sampling: Unpack[SamplingOptions]) -> dict[str, str] | Stream[dict[str, str]]:
    """The assistant's answer to `messages` (OpenAI's [{"role": ..., "content": ...}]) through
    the model's chat template (`chat_template`: a built-in name or a Jinja file instead) with
    the generation prompt: {"role": "assistant", "content": text}. `stream=True`: OpenAI's
    deltas, {"role": "assistant", "content": ""} first, then {"content": piece}s. The other
    arguments are generate()'s; a conversation's next turn decodes only its new tokens."""
    from .chat import ChatTemplate
    m = _as_model(model)
    session = _session(m, n_ctx, n_threads)
    key = "" if chat_template is None else str(chat_template)
    if key not in session.templates:
        session.templates[key] = ChatTemplate.for_model(m, chat_template)[0]
    tokens, _ = session.templates[key].tokenize(m.vocab, messages, add_generation_prompt=True)
    _, pieces = _start(session, tokens, max_tokens, stop, lora, sampler, backend_sampling, sampling)
    if stream:
        def deltas() -> Iterator[dict[str, str]]:
            yield {"role": "assistant", "content": ""}
            yield from ({"content": p.text} for p in pieces if p.text)
        return Stream(deltas(), session.gen)
    return {"role": "assistant", "content": "".join(p.text for p in pieces)}


def cached_generator(model: ModelLike) -> Generator | None:
    """The Generator that generate() and chat_completion() keep for `model` (its Context,
    cached tokens and llama_perf counters), or None before the first call."""
    session = getattr(_as_model(model), "_llamapy_generation", None)
    return None if session is None else session.gen


def forget(model: ModelLike) -> None:
    """Drop the Context generate() and chat_completion() keep for `model` (its memory, and a
    KV cache made stale by changing the weights in place)."""
    m = _as_model(model)
    if getattr(m, "_llamapy_generation", None) is not None:
        m._llamapy_generation = None


# ---- several prompts at once ------------------------------------------------------------------
def generate_batch(model: ModelLike, prompts: Sequence[Prompt], max_tokens: int = 256, *, stop: Stop = None,
                   lora: Iterable[LoraItem] | None = None, n_seq: int = 16, n_threads: int | None = None,
                   n_ubatch: int = 512, **sampling: Unpack[SamplingOptions]) -> list[str]:
    """The continuations of several prompts, `n_seq` at a time as separate sequences of one
    Context (one KV stream each): each as generate() would give it alone (same rules, one
    sampler chain per prompt; equal up to float rounding, since a batch rounds as a
    batch). On a CPU a step of many sequences costs little more than one, so evaluations
    over many prompts run several times faster. Every sequence of a group decodes at every
    step (a finished one is fed its last token and ignored): each step is then one ubatch
    of the same shape, where a sparse set of sequences would be split into several."""
    if max_tokens < 0:
        raise InputError("generate_batch needs max_tokens >= 0 (it sizes each sequence's KV stream)")
    if not prompts:
        return []
    m = _as_model(model)
    stops, vocab = stop_list(stop), m.vocab
    tokenized = [prompt_tokens(vocab, p) for p in prompts]
    adapters = [_load_adapter(item, m, {}) for item in lora or []]
    if max_tokens == 0:
        return [""] * len(prompts)
    per_seq = -(-(max(len(t) for t in tokenized) + max_tokens) // 32) * 32  # a sequence's prompt and answer
    n_seq = max(1, min(n_seq, len(prompts)))
    ctx = Context(m, n_ctx=per_seq * n_seq, n_batch=per_seq * n_seq, n_ubatch=n_ubatch, n_seq_max=n_seq,
                  n_threads=n_threads)
    for adapter, scale in adapters:
        ctx.attach_lora(adapter, scale)
    results: list[str] = []
    for first in range(0, len(prompts), n_seq):
        group = tokenized[first:first + n_seq]
        ctx.memory_clear()
        runs = [TextRun(vocab, max_tokens, stops) for _ in group]
        chains = [sampler_chain(vocab, **sampling) for _ in group]
        ends = np.cumsum([len(t) for t in group])
        output = np.zeros(ends[-1], bool)
        output[ends - 1] = True
        ctx.decode(Batch(np.concatenate(group), np.concatenate([np.arange(len(t)) for t in group]),
                         np.concatenate([np.full(len(t), i) for i, t in enumerate(group)]), output))
        rows = ends - 1  # each sequence's token with logits in the last decode (batch order)
        next_pos = np.array([len(t) for t in group])
        last = np.array([t[-1] for t in group], np.int32)
        everyone = np.arange(len(group))
        while any(r.finish_reason is None for r in runs):
            for i, run in enumerate(runs):
                if run.finish_reason is None:
                    token = chains[i].sample(ctx, int(rows[i]))
                    run.push(token)
                    if run.finish_reason is None:
                        last[i] = token
            if all(r.finish_reason is not None for r in runs):
                break
            ctx.decode(Batch(last, next_pos, everyone, np.ones(len(group), bool)))
            rows, next_pos = everyone, next_pos + 1
        results += ["".join(r.text) for r in runs]
    return results
