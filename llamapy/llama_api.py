"""llama-cpp-python's high-level `Llama` class over llamapy's Context, Generator and chat
templates, so that a program written for it runs by changing its import:

    from llamapy import Llama          # was: from llama_cpp import Llama
    llm = Llama(model_path="model.gguf", n_ctx=2048)
    out = llm("Q: Name the planets in the solar system? A: ", max_tokens=32, stop=["Q:", "\\n"])
    print(out["choices"][0]["text"])

The calls take llama-cpp-python's arguments with its defaults (a completion samples at
temperature 0.8 with top-k 40, top-p 0.95, min-p 0.05; a chat at 0.2) and return its dict
shapes: OpenAI's `text_completion` / `chat.completion` objects, their stream chunks, usage
counts and logprobs. The KV cache keeps the longest common prefix between calls, as
llama-cpp-python's does. Arguments that only steer a GPU (`n_gpu_layers`, `main_gpu`,
`offload_kqv`, ...) are accepted and change nothing; features llamapy does not have
(fill-in-the-middle, mirostat, speculative drafts) are refused by name with a TypeError or
ValueError, never ignored. A grammar (GBNF text) or `response_format` (JSON, by a schema)
constrains a completion; a chat's `tools` come back as OpenAI's `tool_calls` (tool_calls/).

With `embedding=True`, `embed` and `create_embedding` give the model's embeddings as
llama-cpp-python does: its last hidden states after the output norm, one per token (pooling
none, a generative model's own) or pooled per text (`pooling_type`: llama.cpp's numbers).
"""
from __future__ import annotations

import os
import random
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError as PydanticError

from .batch import Batch
from .chat import NAMED_TEMPLATES, ChatTemplate
from .context import Context
from .errors import InputError
from .generate import Generator, Piece, stop_list
from .model import load_model
from .pooling import POOLING_IDS, UNSPECIFIED as POOLING_UNSPECIFIED, Pooling
from .tool_calls import CallStream, Tool, ToolUse, syntax_for, template_messages
from .tool_calls.messages import writes_object_arguments

LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp's "no seed given"
POOLING_NUMBERS = {pooling: number for number, pooling in POOLING_IDS.items()}

# llama-cpp-python's chat_format names for llama.cpp's built-in templates
CHAT_FORMATS = {"chatml": "chatml", "llama-3": "llama3", "gemma": "gemma", "phi3": "phi3",
                "mistral-v7": "mistral-v7", **{name: name for name in NAMED_TEMPLATES}}

# Llama() arguments that place work on GPUs or tune memory mapping: nothing to do on a CPU runtime
_NO_EFFECT = {"n_gpu_layers", "split_mode", "main_gpu", "tensor_split", "use_mmap", "use_mlock", "offload_kqv",
              "op_offload", "swa_full", "numa", "no_perf", "last_n_tokens_size", "n_threads_batch", "flash_attn",
              "rpc_servers", "vocab_only", "logits_all", "kv_overrides", "rope_scaling_type", "attention_type", "type_k", "type_v", "lora_base"}
# ... and the ones that ask for what llamapy does not do
_REFUSED = {"chat_handler": "custom chat handlers", "draft_model": "speculative decoding",
            "tokenizer": "tokenizer overrides", "spm_infill": "fill-in-the-middle",
            "rope_freq_base": "RoPE overrides", "rope_freq_scale": "RoPE overrides",
            "yarn_ext_factor": "YaRN overrides", "yarn_attn_factor": "YaRN overrides",
            "yarn_beta_fast": "YaRN overrides", "yarn_beta_slow": "YaRN overrides", "yarn_orig_ctx": "YaRN overrides"}
# defaults of the refused ones: a program that passes the default asks for nothing missing
_REFUSED_DEFAULTS = {"chat_handler": None, "draft_model": None, "tokenizer": None, "spm_infill": False,
                     "rope_freq_base": 0.0, "rope_freq_scale": 0.0, "yarn_ext_factor": -1.0,
                     "yarn_attn_factor": 1.0, "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "yarn_orig_ctx": 0}


def _scalar_text(value: Any) -> str:
    """A metadata value as llama.cpp's llama_model_meta_val_str prints it (booleans lower-case)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _refuse_unsupported(**asked: Any) -> None:
    """A completion argument llamapy cannot honour, given other than as its default: refused."""
    if asked.get("suffix") is not None:
        raise ValueError("suffix (fill-in-the-middle) is not supported by llamapy")
    if asked.get("mirostat_mode", 0):
        raise ValueError("mirostat sampling is not supported by llamapy")
    if asked.get("tfs_z", 1.0) != 1.0:
        raise ValueError("tail-free sampling (tfs_z) was removed from llama.cpp; leave it at 1.0")
    if asked.get("stopping_criteria") is not None or asked.get("logits_processor") is not None:
        raise ValueError("stopping_criteria and logits_processor callbacks are not supported by llamapy")
    if asked.get("functions"):
        raise ValueError("functions and function_call (OpenAI's old form) are not supported by llamapy: give tools")


def _grammar_options(grammar: Any = None, response_format: dict | None = None) -> dict:
    """The sampler's constraint: `grammar` (GBNF text, or llama-cpp-python's LlamaGrammar,
    which keeps its text), or `response_format` json_object / json_schema (with its schema:
    JSON that conforms to it)."""
    fmt = response_format or {"type": "text"}
    kind = fmt.get("type", "text")
    if kind not in ("text", "json_object", "json_schema"):
        raise ValueError(f'response_format type must be "text", "json_object" or "json_schema", not {kind!r}')
    if kind != "text" and grammar is not None:
        raise ValueError("give a grammar or a response_format, not both")
    if kind == "json_object":
        return {"json_schema": fmt.get("schema") or {"type": "object"}}
    if kind == "json_schema":
        wrapper = fmt.get("json_schema") or {}
        return {"json_schema": wrapper.get("schema") or fmt.get("schema") or {"type": "object"}}
    if grammar is None:
        return {}
    text = grammar if isinstance(grammar, str) else getattr(grammar, "_grammar", None)
    if not isinstance(text, str):
        raise ValueError("grammar: give the GBNF text (or llama-cpp-python's LlamaGrammar)")
    return {"grammar": text}


class Llama:
    """A model and its context, with llama-cpp-python's calls (module docstring)."""

    def __init__(self, model_path: str | os.PathLike, *, seed: int = LLAMA_DEFAULT_SEED, n_ctx: int = 512,
                 n_batch: int = 512, n_ubatch: int = 512, n_threads: int | None = None,
                 lora_path: str | os.PathLike | None = None, lora_scale: float = 1.0, chat_format: str | None = None,
                 embedding: bool = False, pooling_type: int = POOLING_UNSPECIFIED, verbose: bool = True,
                 **kwargs: Any) -> None:
        for name, value in kwargs.items():
            if name in _REFUSED:
                if value != _REFUSED_DEFAULTS[name]:
                    raise ValueError(f"Llama({name}=...): {_REFUSED[name]} are not supported by llamapy")
            elif name not in _NO_EFFECT:
                raise TypeError(f"Llama() got an unexpected keyword argument {name!r}")
        self.model_path = str(model_path)
        self.verbose = verbose
        self._model = load_model(model_path)
        # llama-cpp-python's metadata: every scalar key as a string (arrays such as the vocabulary left out)
        self.metadata: dict[str, str] = {key: _scalar_text(value) for key in self._model.file.metadata
                                         if isinstance(value := self._model.file.get(key), (str, int, float, bool))}
        self._seed = seed
        self._n_ctx = n_ctx or self._model.hparams.n_ctx_train
        try:
            context = Context(self._model, n_ctx=self._n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_threads=n_threads,
                              pooling_type=pooling_type)
        except InputError as e:
            raise ValueError(str(e)) from None
        self._gen = Generator(context)
        self._embedding = embedding
        self.n_batch = context.n_batch
        self._lora = [(str(lora_path), float(lora_scale))] if lora_path else []
        if self._lora:
            self._gen.set_lora(self._lora)
        self.chat_format = chat_format
        self._template, note = self._chat_template(chat_format)
        if verbose:
            print(f"llamapy: {Path(self.model_path).name}: {self._model.hparams.arch}, n_ctx {self._n_ctx}; "
                  f"{note or 'chat template: ' + self._template.name}", file=sys.stderr)

    def _chat_template(self, chat_format: str | None) -> tuple[ChatTemplate, str | None]:
        if chat_format is None:
            return ChatTemplate.for_model(self._model)
        if chat_format not in CHAT_FORMATS:
            raise ValueError(f"chat_format {chat_format!r}: llamapy knows {', '.join(sorted(CHAT_FORMATS))} "
                             "(or leave it out to use the model's own template)")
        return ChatTemplate.named(CHAT_FORMATS[chat_format], self._model.vocab), None

    # -- the model's numbers ---------------------------------------------------------------
    def n_ctx(self) -> int:
        return self._gen.ctx.n_ctx

    def n_vocab(self) -> int:
        return self._model.vocab.n_tokens

    def n_embd(self) -> int:
        return self._model.hparams.n_embd

    def token_bos(self) -> int:
        return -1 if self._model.vocab.bos_id is None else self._model.vocab.bos_id

    def token_eos(self) -> int:
        return -1 if self._model.vocab.eos_id is None else self._model.vocab.eos_id

    def pooling_type(self) -> int:
        """llama.cpp's number of the context's pooling type (0 none, 1 mean, 2 cls, 3 last)."""
        return POOLING_NUMBERS[self._gen.ctx.pooling_type]

    # -- tokens ----------------------------------------------------------------------------
    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of UTF-8 `text` (BOS first with `add_bos` when the model adds one;
        `special`: control tokens written in the text become tokens)."""
        vocab = self._model.vocab
        ids = vocab.tokenize(text.decode("utf-8", "replace"), add_special=False, parse_special=special)
        return ([vocab.bos_id] if add_bos and vocab.add_bos else []) + ids

    def detokenize(self, tokens: Sequence[int], prev_tokens: Sequence[int] | None = None,
                   special: bool = False) -> bytes:
        """The bytes of `tokens`, piece after piece (`special`: control tokens' texts too)."""
        vocab = self._model.vocab
        return b"".join(vocab.token_to_piece(int(t), special) for t in tokens)

    def reset(self) -> None:
        """Forget what the KV cache holds (the next call decodes its whole prompt)."""
        self._gen.ctx.memory_clear()
        self._gen.cached = []

    def set_seed(self, seed: int) -> None:
        self._seed = seed

    # -- completions -----------------------------------------------------------------------
    def __call__(self, prompt: str | list[int], **kwargs: Any) -> dict | Iterator[dict]:
        return self.create_completion(prompt, **kwargs)

    def create_completion(self, prompt: str | list[int], suffix: str | None = None, max_tokens: int | None = 16,
                          temperature: float = 0.8, top_p: float = 0.95, min_p: float = 0.05,
                          typical_p: float = 1.0, logprobs: int | None = None, echo: bool = False,
                          stop: str | list[str] | None = None, frequency_penalty: float = 0.0,
                          presence_penalty: float = 0.0, repeat_penalty: float = 1.0, top_k: int = 40,
                          stream: bool = False, seed: int | None = None, tfs_z: float = 1.0, mirostat_mode: int = 0,
                          mirostat_tau: float = 5.0, mirostat_eta: float = 0.1, model: str | None = None,
                          stopping_criteria: Any = None, logits_processor: Any = None, grammar: Any = None,
                          logit_bias: dict[int, float] | None = None, *,
                          _constraint: dict | None = None) -> dict | Iterator[dict]:
        """OpenAI's text completion of `prompt` (a text, tokenized with special tokens and a
        BOS as the model wants, or token ids as given): `max_tokens` None or <= 0 runs to
        the end of the context; `stop` strings end it (not included); `echo` puts the prompt
        in front; `logprobs=N` gives each token's log-probability and N alternatives;
        `grammar` (GBNF) constrains the text."""
        _refuse_unsupported(suffix=suffix, mirostat_mode=mirostat_mode, tfs_z=tfs_z,
                            stopping_criteria=stopping_criteria, logits_processor=logits_processor)
        tokens = self._prompt_tokens(prompt)
        sampling = dict(temperature=temperature, top_p=top_p, min_p=min_p, typical_p=typical_p, top_k=top_k,
                        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                        repeat_penalty=repeat_penalty, logit_bias={int(k): float(v) for k, v in (logit_bias or {}).items()},
                        seed=self._call_seed(seed),
                        **(_constraint if _constraint is not None else _grammar_options(grammar)))
        prompt_text = prompt if isinstance(prompt, str) else self.detokenize(tokens).decode("utf-8", "replace")
        run = _Run(self, tokens, max_tokens, stop, logprobs, echo, len(prompt_text), sampling)
        head = {"id": f"cmpl-{uuid.uuid4()}", "object": "text_completion", "created": int(time.time()),
                "model": model or self.model_path}
        if stream:
            return self._completion_chunks(head, run, prompt_text if echo else "")
        return self._completion(head, run, prompt_text if echo else "")

    def _prompt_tokens(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            tokens = self.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)
        else:
            tokens = [int(t) for t in prompt]
        if not tokens:
            raise ValueError("the prompt is empty and the model adds no BOS: nothing to continue")
        if len(tokens) >= self.n_ctx():
            raise ValueError(f"Requested tokens ({len(tokens)}) exceed context window of {self.n_ctx()}")
        return tokens

    def _call_seed(self, seed: int | None) -> int:
        """llama-cpp-python's: a call's seed, else one drawn from the Llama's seed (so that the
        same Llama(seed=...) answers a repeated call the same way)."""
        return seed if seed is not None else random.Random(self._seed).randint(0, 2**31 - 1)

    def _completion(self, head: dict, run: _Run, echoed: str) -> dict:
        pieces = list(run.pieces())
        text = echoed + "".join(p.text for p in pieces)
        return {**head, "choices": [{"text": text, "index": 0, "logprobs": run.logprobs_of(pieces),
                                     "finish_reason": run.finish_reason}], "usage": run.usage()}

    def _completion_chunks(self, head: dict, run: _Run, echoed: str) -> Iterator[dict]:
        def chunk(text: str, logprobs: dict | None = None, finish_reason: str | None = None) -> dict:
            return {**head, "choices": [{"text": text, "index": 0, "logprobs": logprobs,
                                         "finish_reason": finish_reason}]}
        if echoed:
            yield chunk(echoed, run.logprobs_of([]) if run.n_logprobs is not None else None)
        for piece in run.pieces():
            if piece.text or piece.logprob is not None:
                yield chunk(piece.text, run.logprobs_of([piece], include_prompt=False))
        yield chunk("", None, run.finish_reason)

    # -- chat ------------------------------------------------------------------------------
    def create_chat_completion(self, messages: list[dict[str, Any]], functions: Any = None, function_call: Any = None,
                               tools: Any = None, tool_choice: Any = None, temperature: float = 0.2,
                               top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05, typical_p: float = 1.0,
                               stream: bool = False, stop: str | list[str] | None = None, seed: int | None = None,
                               response_format: dict | None = None, max_tokens: int | None = None,
                               presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                               repeat_penalty: float = 1.0, tfs_z: float = 1.0, mirostat_mode: int = 0,
                               mirostat_tau: float = 5.0, mirostat_eta: float = 0.1, model: str | None = None,
                               logits_processor: Any = None, grammar: Any = None,
                               logit_bias: dict[int, float] | None = None, logprobs: bool | None = None,
                               top_logprobs: int | None = None) -> dict | Iterator[dict]:
        """OpenAI's chat completion of `messages` through the model's chat template (or
        `chat_format`'s), with the generation prompt: a `chat.completion` object, or with
        `stream` its `chat.completion.chunk`s (the role first, then content deltas). `tools`
        (with `tool_choice`) are given to the template and the model's calls come back as
        `tool_calls` (finish_reason "tool_calls"); `grammar` or `response_format` constrain
        the answer."""
        _refuse_unsupported(mirostat_mode=mirostat_mode, tfs_z=tfs_z, logits_processor=logits_processor,
                            functions=functions or function_call)
        constraint = _grammar_options(grammar, response_format)
        try:
            use = ToolUse.of([Tool.model_validate(t) for t in tools or []], tool_choice, False,
                             syntax_for(self._template.source), self._template.name)
            if use is not None and use.mode == "none":
                use = None
            if use is not None:
                if constraint:
                    raise InputError("give tools or a grammar / response_format, not both")
                constraint = use.constraint()
            if any(m.get("tool_calls") for m in messages):
                messages = template_messages(messages, writes_object_arguments(self._template))
            tokens, _ = self._template.tokenize(self._model.vocab, messages, add_generation_prompt=True, tools=tools)
        except (InputError, PydanticError) as e:
            raise ValueError(" ".join(str(e).split())) from None
        n_top = (top_logprobs or 0) if logprobs else None
        completion = self.create_completion([int(t) for t in tokens], max_tokens=max_tokens, temperature=temperature,
                                            top_p=top_p, min_p=min_p, typical_p=typical_p, logprobs=n_top,
                                            stop=stop, frequency_penalty=frequency_penalty,
                                            presence_penalty=presence_penalty, repeat_penalty=repeat_penalty,
                                            top_k=top_k, stream=stream, seed=seed, model=model, logit_bias=logit_bias,
                                            _constraint=constraint)
        if stream:
            return _chat_chunks(completion, CallStream(use.syntax) if use is not None else None)
        choice = completion["choices"][0]
        message, finish = {"role": "assistant", "content": choice["text"]}, choice["finish_reason"]
        reply = use.syntax.parse(choice["text"]) if use is not None else None
        if reply is not None and reply.calls:
            message = {"role": "assistant", "content": reply.content.strip() or None,
                       "tool_calls": [call.openai() for call in reply.calls]}
            finish = "tool_calls"
        return {"id": "chat" + completion["id"], "object": "chat.completion", "created": completion["created"],
                "model": completion["model"],
                "choices": [{"index": 0, "message": message, "logprobs": _chat_logprobs(choice["logprobs"]),
                             "finish_reason": finish}],
                "usage": completion["usage"]}

    # -- embeddings --------------------------------------------------------------------------
    def embed(self, input: str | list[str], normalize: bool = False, truncate: bool = True,
              return_count: bool = False) -> Any:
        """The embeddings of a text (or of each of a list of texts): a vector per token with
        pooling none, else one per text; `normalize`: to unit Euclidean length; `truncate`:
        a text's tokens past n_batch dropped (else refused). With `return_count`, also the
        number of tokens read."""
        if not self._embedding:
            raise RuntimeError("Llama model must be created with embedding=True to call this method")
        texts = [input] if isinstance(input, str) else list(input)
        ctx, pooled = self._gen.ctx, self._gen.ctx.pooling_type is not Pooling.NONE
        data: list = []
        total = 0
        ctx.set_embeddings(True)
        try:
            for text in texts:
                tokens = self.tokenize(text.encode("utf-8"))
                if truncate:
                    tokens = tokens[:self.n_batch]
                if len(tokens) > self.n_batch:
                    raise ValueError(f"Requested tokens ({len(tokens)}) exceed batch size of {self.n_batch}")
                total += len(tokens)
                ctx.memory_clear()
                ctx.decode(Batch.from_tokens(tokens, all_outputs=True))
                if pooled:
                    data.append(_vector(ctx.get_embeddings_seq(0), normalize))
                else:
                    data.append([_vector(row, normalize) for row in ctx.get_embeddings()])
        finally:
            ctx.set_embeddings(False)
            self.reset()
        output = data[0] if isinstance(input, str) else data
        return (output, total) if return_count else output

    def create_embedding(self, input: str | list[str], model: str | None = None) -> dict:
        """OpenAI's embeddings object for a text or a list of texts."""
        embeddings, total = self.embed(input, return_count=True)
        if isinstance(input, str):
            embeddings = [embeddings]
        return {"object": "list", "data": [{"object": "embedding", "embedding": e, "index": i}
                                           for i, e in enumerate(embeddings)],
                "model": model or self.model_path, "usage": {"prompt_tokens": total, "total_tokens": total}}

    def close(self) -> None:
        """Free the context's memory (the model stays memory-mapped until collected)."""
        self._gen.ctx.memory_clear()

    def __enter__(self) -> Llama:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Run:
    """One completion's generation: its prompt fed (scored too for echo with logprobs), its
    pieces as they come, and what the response reports of them."""

    def __init__(self, llm: Llama, tokens: list[int], max_tokens: int | None, stop: str | list[str] | None,
                 logprobs: int | None, echo: bool, prompt_chars: int, sampling: dict) -> None:
        self.llm, self.gen, self.tokens, self.n_logprobs = llm, llm._gen, tokens, logprobs
        n_ctx = llm.n_ctx()
        room = n_ctx - len(tokens)
        self.max_tokens = room if max_tokens is None or max_tokens <= 0 else min(max_tokens, room)
        self.stops = stop_list(stop)
        self.gen.set_sampler(**sampling)
        self.gen.set_lora(llm._lora)
        self.prompt_scores = self.gen.feed(tokens, logprobs if (echo and logprobs is not None) else None)
        self.echo = echo
        self.text_at = 0 if echo else prompt_chars  # where the first reported token's text starts
        self.generated: list[Piece] = []

    def pieces(self) -> Iterator[Piece]:
        for piece in self.gen.stream(self.max_tokens, self.stops, logprobs=self.n_logprobs):
            self.generated.append(piece)
            yield piece

    @property
    def finish_reason(self) -> str | None:
        return self.gen.finish_reason

    def usage(self) -> dict[str, int]:
        n = len(self.gen.tokens)
        return {"prompt_tokens": len(self.tokens), "completion_tokens": n, "total_tokens": len(self.tokens) + n}

    def logprobs_of(self, pieces: list[Piece], include_prompt: bool = True) -> dict | None:
        """OpenAI's completion logprobs of these pieces (and of the echoed prompt)."""
        if self.n_logprobs is None:
            return None
        vocab = self.llm._model.vocab
        scored = [p for p in pieces if p.token is not None and p.logprob is not None]
        rows: list[tuple[str, float | None, dict | None]] = []
        if include_prompt and self.echo and self.prompt_scores is not None:
            first = self.tokens[0]
            if first != vocab.bos_id:
                rows.append((vocab.token_to_piece(first).decode("utf-8", "replace"), None, None))
            rows += [(p.text, p.logprob, self._top(p)) for p in self.prompt_scores]
            rows[0] = (rows[0][0], None, None)  # OpenAI's: the first token of an echoed prompt is not scored
        rows += [(vocab.token_to_piece(p.token).decode("utf-8", "replace"), p.logprob, self._top(p)) for p in scored]
        offsets = []
        for text, _, _ in rows:
            offsets.append(self.text_at)
            self.text_at += len(text)
        return {"tokens": [r[0] for r in rows], "text_offset": offsets, "token_logprobs": [r[1] for r in rows],
                "top_logprobs": [r[2] for r in rows]}

    def _top(self, piece: Piece) -> dict[str, float]:
        vocab = self.llm._model.vocab
        top = {vocab.token_to_piece(t).decode("utf-8", "replace"): lp for t, lp in piece.top}
        top[vocab.token_to_piece(piece.token).decode("utf-8", "replace")] = piece.logprob
        return top


def _chat_logprobs(logprobs: dict | None) -> dict | None:
    """A completion's logprobs as a chat completion gives them (OpenAI's `content` list)."""
    if logprobs is None:
        return None
    return {"content": [{"token": token, "bytes": None, "logprob": lp,
                         "top_logprobs": [{"token": t, "logprob": v, "bytes": None} for t, v in (top or {}).items()]}
                        for token, lp, top in zip(logprobs["tokens"], logprobs["token_logprobs"],
                                                  logprobs["top_logprobs"])],
            "refusal": None}


def _chat_chunks(chunks: Iterator[dict], calls: CallStream | None = None) -> Iterator[dict]:
    """Completion chunks as chat chunks: the assistant's role first, then content deltas,
    then an empty delta with the finish reason; with `calls` (a chat with tools), the words
    as they come and each call whole at the end (finish_reason "tool_calls")."""
    for i, chunk in enumerate(chunks):
        head = {"id": "chat" + chunk["id"], "model": chunk["model"], "created": chunk["created"],
                "object": "chat.completion.chunk"}

        def delta(d: dict, logprobs=None, finish: str | None = None) -> dict:
            return {**head, "choices": [{"index": 0, "delta": d, "logprobs": logprobs, "finish_reason": finish}]}
        if i == 0:
            yield delta({"role": "assistant"})
        choice = chunk["choices"][0]
        finish = choice["finish_reason"]
        if finish is None:
            text = choice["text"] if calls is None else calls.feed(choice["text"])
            yield delta({"content": text}, _chat_logprobs(choice["logprobs"]))
            continue
        if calls is not None:
            reply = calls.finish()
            if reply.content:
                yield delta({"content": reply.content})
            for index, call in enumerate(reply.calls):
                yield delta({"tool_calls": [{"index": index, **call.openai()}]})
            finish = "tool_calls" if reply.calls else finish
        yield delta({}, _chat_logprobs(choice["logprobs"]), finish)


def _vector(values, normalize: bool) -> list[float]:
    """An embedding as llama-cpp-python returns it: a list of floats, with `normalize` of unit
    Euclidean length (a zero vector as it is)."""
    import numpy as np
    v = np.asarray(values, dtype=np.float32)
    if normalize:
        norm = float(np.linalg.norm(v))
        if norm != 0.0:
            return [float(x) / norm for x in v]
    return [float(x) for x in v]
