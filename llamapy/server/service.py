"""What the endpoints share (`Server`): the engine, the model's chat template, the adapters,
the server's defaults; and the one path every request to the engine takes: the request becomes
one job per prompt (`prepare`, in a worker thread, so that tokenizing, rendering a chat and
building a sampler chain never hold up the event loop), the jobs are queued (`submit`), and
their events come back as a stream or a whole answer (`complete`, `embed`; completion_path.py
shapes them).
"""
from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable
from functools import cached_property

from fastapi import Request
from fastapi.responses import Response

from llamapy.errors import InputError, LlamapyError
from llamapy.generate import sampler_chain, stop_list
from llamapy.pooling import DEFAULT_NORMALIZE, Pooling
from llamapy.sampling.grammar_sampler import constrain
from llamapy.tool_calls import Tool, ToolSyntax, ToolUse, syntax_for, template_messages
from llamapy.tool_calls.messages import writes_object_arguments

from .access_log import note_tokens
from .adapters import Adapters
from .completion_path import Result, Shape, stream_answer, whole_answer
from .engine import Done, Embedded, Engine, Failed, Job, QueueFull, TokenOut
from .errors import ApiError
from .native_schemas import EmbeddingRequest, InfillRequest
from .native_shapes import generation_settings
from .prompts import PromptError, check_ids, infill_tokens, one_prompt, prompt_list
from .sampler_order import ordered_chain
from .schemas import ChatRequest, LoraScale, Sampling

# characters of a long prompt tokenized first to see whether it can fit (_refuse_surely_too_long):
# text runs at 3 to 5 characters a token, so the probe holds ~4 times a slot's context
PROBE_CHARS_PER_TOKEN = 16


class Server:
    """What the endpoints share: the engine, the model's chat template, the adapters."""

    def __init__(self, engine: Engine, template, alias: str, adapters: Adapters,
                 defaults: dict | None = None, logit_bias: dict[int, float] | None = None,
                 embedding: bool = False, n_batch: int | None = None, embd_normalize: int = DEFAULT_NORMALIZE,
                 spm_infill: bool = False) -> None:
        self.engine, self.template, self.alias, self.adapters = engine, template, alias, adapters
        self.defaults = dict(defaults or {})  # request field -> the command line's value, for requests without it
        self.logit_bias = dict(logit_bias or {})
        self.embedding = embedding  # --embedding: the embedding endpoints serve
        self.embd_normalize = embd_normalize  # --embd-normalize: for requests without their own
        self.spm_infill = spm_infill  # --spm-infill: /infill's prompt suffix first
        self.n_batch = n_batch or engine.ctx.n_batch  # -b, as llama-server's infill prompt reads it
        self.vocab = engine.vocab
        self.model_path = str(getattr(engine.ctx.model.file, "path", ""))
        self.created = int(time.time())
        self._piece_cache: dict[int, bytes] = {}

    # ---- requests to jobs (in a worker thread) --------------------------------------------------
    def value(self, req: Sampling, name: str):
        """A request's field, or the server's default for it when the request does not set it."""
        return getattr(req, name) if name in req.model_fields_set else self.defaults.get(name, getattr(req, name))

    def sampling(self, req: Sampling) -> dict:
        bias: dict[int, float] = dict(self.logit_bias)
        for key, value in req.logit_bias or []:
            bias.update(self._bias(key, value))
        if self.value(req, "ignore_eos"):
            bias.update({t: float("-inf") for t in self.vocab.eog_ids})
        seed = self.value(req, "seed")
        seed = seed if seed is not None and seed >= 0 else secrets.randbelow(2**31)
        v = lambda name: self.value(req, name)  # noqa: E731
        last_n = v("repeat_last_n")
        last_n = self.engine.n_ctx_slot if last_n == -1 else last_n  # llama.cpp's -1: the whole context
        return dict(temperature=v("temperature"), top_k=v("top_k"), top_p=v("top_p"), min_p=v("min_p"),
                    typical_p=v("typical_p"), repeat_penalty=v("repeat_penalty"), repeat_last_n=last_n,
                    frequency_penalty=v("frequency_penalty"), presence_penalty=v("presence_penalty"),
                    dynatemp_range=v("dynatemp_range"), dynatemp_exp=v("dynatemp_exponent"), seed=seed,
                    logit_bias=bias)

    def _bias(self, key: int | str, value: float) -> dict[int, float]:
        """One logit_bias entry (schemas.py has made it a token id or a text, and a bias):
        a token id must be in the vocabulary; a text's tokens all get the bias."""
        if isinstance(key, int):
            if not 0 <= key < self.vocab.n_tokens:
                raise ApiError(400, f"logit_bias: token {key} is not in the vocabulary (0..{self.vocab.n_tokens - 1})")
            return {key: value}
        return {t: value for t in self.vocab.tokenize(key, add_special=False)}

    def lora_of(self, given: list[LoraScale] | None) -> tuple[float, ...]:
        """A request's adapter scales: llama-server's rule, every adapter it does not list at 0."""
        if given is None:
            return self.engine.default_lora()
        scales = [0.0] * len(self.engine.adapters)
        for entry in given:
            if entry.id >= len(scales):
                raise ApiError(400, f"lora: no adapter has id {entry.id} (ids 0..{len(scales) - 1}; GET /lora-adapters)")
            scales[entry.id] = entry.scale
        return tuple(scales)

    def settings(self, req: Sampling, options: dict, limit: int, lora: tuple[float, ...]) -> dict:
        """The request's generation settings, as llama-server reports them."""
        return generation_settings(options, seed=self.value(req, "seed"), n_predict=limit, stop=stop_list(req.stop),
                                   stream=req.stream, n_probs=req.n_probs, min_keep=getattr(req, "min_keep", 0),
                                   ignore_eos=bool(self.value(req, "ignore_eos")),
                                   order=req.order() if hasattr(req, "order") else None, lora=lora,
                                   logit_bias={t: b for t, b in options["logit_bias"].items()
                                               if not (self.value(req, "ignore_eos") and t in self.vocab.eog_ids)})

    def default_settings(self) -> dict:
        """The settings of a request that sets nothing (/props)."""
        req = Sampling()
        return self.settings(req, self.sampling(req), self.defaults.get("n_predict", -1), self.engine.default_lora())

    def prepare(self, req: Sampling, tokens_of: Callable[[], list[list[int]]], n_probs: int,
                emits: Callable[[int], Callable], **job_fields) -> list[Job]:
        """The request as one job per prompt for the engine: its prompt's tokens, its limits,
        its own sampler chain (made here, so that a request the sampler refuses fails alone,
        not in the loop that serves everyone)."""
        limit = self._limit(req)
        try:
            token_lists = tokens_of()
        except (InputError, PromptError) as e:
            raise ApiError(400, str(e)) from None
        for tokens in token_lists:
            if len(tokens) >= self.engine.n_ctx_slot:
                raise ApiError(400, f"the request ({len(tokens)} prompt tokens) exceeds the available context size "
                                    f"({self.engine.n_ctx_slot} tokens per slot), try increasing it",
                               "exceed_context_size_error")
        lora = self.lora_of(req.lora)
        options = self.sampling(req)
        settings = self.settings(req, options, limit, lora)
        order = req.order() if hasattr(req, "order") else None
        constraint = req.constraint()  # its grammar or JSON schema (a bad one: a 400)
        jobs = []
        for i, tokens in enumerate(token_lists):  # each prompt its own chain (a chain keeps state)
            if order is None:
                chain = sampler_chain(self.vocab.n_tokens, **options)
            else:
                chain = ordered_chain(self.vocab.n_tokens, order, min_keep=req.min_keep, **options)
            chain = constrain(chain, self.vocab, **constraint)
            jobs.append(Job(tokens=tokens, max_tokens=limit, stop=stop_list(req.stop), chain=chain, lora=lora,
                            emit=emits(i), n_probs=max(n_probs, req.n_probs), settings=settings, **job_fields))
        return jobs

    def _limit(self, req: Sampling) -> int:
        """The tokens to generate: the request's max_tokens (or the server's -n), at most a slot's context."""
        given = req.limit()
        if given is None:
            return self.defaults.get("n_predict", -1)
        if given > self.engine.n_ctx_slot:
            raise ApiError(400, f"max_tokens {given} is more than a slot's context ({self.engine.n_ctx_slot} tokens): "
                                f"ask for at most {self.engine.n_ctx_slot} (or -1: until the end or a full slot)",
                           "exceed_context_size_error")
        return given

    def prompts(self, prompt) -> list[list[int]]:
        """A request's prompt(s) as token lists (prompts.py), each id in the vocabulary."""
        texts = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) else []
        for text in texts:
            if isinstance(text, str):
                self._refuse_surely_too_long(text)
        token_lists = prompt_list(self.vocab, prompt)
        for tokens in token_lists:
            check_ids(self.vocab, tokens)
        return token_lists

    def _refuse_surely_too_long(self, text: str) -> None:
        """A prompt many times a slot's context is refused from the tokens of a prefix (a 16 MB
        text takes seconds of CPU to tokenize, shared with the other clients' decoding). The
        prefix's tokens are a lower bound of the whole text's but for the few a merge across
        the cut may save: twice the context leaves room for them."""
        n_ctx = self.engine.n_ctx_slot
        probe = text[:PROBE_CHARS_PER_TOKEN * n_ctx]
        if len(probe) < len(text):
            n_probe = len(self.vocab.tokenize(probe, add_special=False))
            if n_probe > 2 * n_ctx:
                raise ApiError(400, f"the request (more than {n_probe} prompt tokens in its first {len(probe)} of "
                                    f"{len(text)} characters) exceeds the available context size ({n_ctx} tokens per "
                                    "slot), try increasing it", "exceed_context_size_error")

    def messages(self, req: ChatRequest) -> list[dict]:
        """The request's messages as the template reads them (tool calls' arguments as the
        template takes them: tool_calls/messages.py)."""
        messages = [m.for_template() for m in req.messages]
        if any("tool_calls" in m for m in messages):
            messages = template_messages(messages, writes_object_arguments(self.template))
        return messages

    @cached_property
    def tool_syntax(self) -> ToolSyntax | None:
        """How the chat template has its model call tools (None: it takes no tools)."""
        return syntax_for(self.template.source)

    def resolve_tools(self, req: ChatRequest) -> None:
        """The request's tools and tool_choice against the template's call syntax (a 400 if
        they do not fit)."""
        try:
            tools = [Tool.model_validate(t) for t in req.tools or []]
            req.use_tools(ToolUse.of(tools, req.tool_choice, req.parallel_tool_calls, self.tool_syntax,
                                     self.template.name))
        except InputError as e:
            raise ApiError(400, str(e)) from None
        except ValueError as e:  # pydantic's, on a tool of the wrong shape
            raise ApiError(400, "tools: " + " ".join(str(e).split())) from None

    def chat_tokens(self, req: ChatRequest) -> list[list[int]]:
        try:
            return [list(self.template.tokenize(self.vocab, self.messages(req), add_generation_prompt=True,
                                                tools=req.tools)[0])]
        except LlamapyError as e:
            raise ApiError(400, str(e)) from None

    def infill_prompt(self, req: InfillRequest) -> list[list[int]]:
        """llama-server's FIM prompt: the extra files, prefix, suffix and the prompt's tokens."""
        prompt = one_prompt(self.vocab, req.prompt, add_special=False)
        tokens = infill_tokens(self.vocab, req.input_prefix, req.input_suffix,
                               [c.model_dump() for c in req.input_extra], prompt, self.n_batch,
                               self.defaults.get("n_predict", -1), self.engine.n_ctx_slot, self.spm_infill)
        check_ids(self.vocab, tokens)
        return [tokens]

    def piece(self, token: int) -> bytes:
        piece = self._piece_cache.get(token)
        if piece is None:
            piece = self._piece_cache[token] = self.vocab.token_to_piece(token, True)
        return piece

    def chat_logprob(self, out: TokenOut) -> dict:
        def entry(token: int, logprob: float) -> dict:
            piece = self.piece(token)
            return {"id": token, "token": piece.decode("utf-8", "replace"), "bytes": list(piece), "logprob": logprob}
        return {**entry(out.token, out.logprob), "top_logprobs": [entry(t, lp) for t, lp in out.top or []]}

    # ---- running jobs --------------------------------------------------------------------------
    async def submit(self, prepare: Callable[[Callable[[int], Callable]], list[Job]]
                     ) -> tuple[list[Job], asyncio.Queue]:
        """Make the request's jobs in a worker thread (`prepare(emits)`; `emits(i)` is what prompt
        i's job calls with each event) and queue them; their events come in one queue as
        (prompt index, event)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emits(index: int):
            return lambda event: loop.call_soon_threadsafe(queue.put_nowait, (index, event))
        jobs = await asyncio.to_thread(prepare, emits)
        self.queue_jobs(jobs)
        return jobs, queue

    def queue_jobs(self, jobs: list[Job]) -> None:
        for i, job in enumerate(jobs):
            try:
                self.engine.submit(job)
            except (QueueFull, InputError) as e:
                for queued in jobs[:i]:
                    queued.cancelled.set()
                if isinstance(e, QueueFull):
                    raise ApiError(503, f"server busy: {e}; retry later") from None
                raise ApiError(400, str(e), "exceed_context_size_error" if "context size" in str(e) else None) from None

    async def events(self, request: Request, jobs: list[Job], queue: asyncio.Queue) -> AsyncIterator:
        """The jobs' (index, event)s as they come, until each has ended; a client gone cancels
        them (checked while waiting). Their tokens go to the request's log line."""
        checked = time.monotonic()
        running = len(jobs)
        try:
            while running:
                try:
                    index, event = await asyncio.wait_for(queue.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    index, event = None, None
                if time.monotonic() - checked >= 0.25:  # also while tokens keep coming
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return
                if event is None:
                    continue
                if isinstance(event, Done):
                    note_tokens(request, event.n_prompt, event.n_decoded, event.n_cached)
                elif isinstance(event, Embedded):
                    note_tokens(request, event.n_tokens)
                yield index, event
                if isinstance(event, Failed):
                    return
                if isinstance(event, (Done, Embedded)):
                    running -= 1
        finally:
            for job in jobs:
                job.cancelled.set()  # a no-op once done; else the engine frees the slot at its next step

    async def collect(self, request: Request, jobs: list[Job], queue: asyncio.Queue) -> list | None:
        """The jobs' whole answers (Result, or Embedded for embedding jobs), in prompt order;
        None when the client left."""
        results: list = [Result() for _ in jobs]
        ended = 0
        async for index, event in self.events(request, jobs, queue):
            if isinstance(event, TokenOut):
                results[index].outs.append(event)
            elif isinstance(event, Done):
                results[index].done = event
                ended += 1
            elif isinstance(event, Embedded):
                results[index] = event
                ended += 1
            else:
                raise ApiError(event.code, event.message)
        return results if ended == len(jobs) else None

    async def complete(self, request: Request, req: Sampling, tokens_of: Callable[[], list[list[int]]],
                       n_probs: int, shape_of: Callable[[list[Job]], Shape], **job_fields) -> Response:
        """The completion path: the request's jobs, answered in the endpoint's shape."""
        jobs, queue = await self.submit(lambda emits: self.prepare(req, tokens_of, n_probs, emits, **job_fields))
        shape = shape_of(jobs)
        if req.stream:
            return stream_answer(self.events(request, jobs, queue), shape)
        return whole_answer(await self.collect(request, jobs, queue), shape)

    async def embed(self, request: Request, req: EmbeddingRequest) -> list[Embedded] | None:
        """The embeddings of the request's input(s), one embedding job each."""
        prompt = req.input if "input" in req.model_fields_set else req.content

        def prepare(emits) -> list[Job]:
            try:
                token_lists = self.prompts(prompt)
            except (InputError, PromptError) as e:
                raise ApiError(400, str(e).replace('"prompt"', '"input"')) from None
            for tokens in token_lists:
                self._check_embeddable(tokens)
            normalize = self.embd_normalize if req.embd_normalize is None else req.embd_normalize
            return [Job(tokens=t, max_tokens=0, stop=(), chain=None, lora=self.engine.default_lora(), emit=emits(i),
                        embed=True, embd_normalize=normalize) for i, t in enumerate(token_lists)]
        jobs, queue = await self.submit(prepare)
        return await self.collect(request, jobs, queue)

    def _check_embeddable(self, tokens: list[int]) -> None:
        """llama-server's limits: a prompt's embeddings come from one decode of it whole."""
        ctx = self.engine.ctx
        if not tokens:
            raise ApiError(400, "Input content cannot be empty")
        if len(tokens) > self.engine.n_ctx_slot:
            raise ApiError(400, f"input ({len(tokens)} tokens) is larger than the max context size "
                                f"({self.engine.n_ctx_slot} tokens). skipping", "exceed_context_size_error")
        limit = ctx.n_batch if ctx.pooling_type is Pooling.LAST else ctx.n_ubatch
        if len(tokens) > limit:
            raise ApiError(400, f"input ({len(tokens)} tokens) is too large to process. increase the physical batch "
                                f"size (current batch size: {limit})")
