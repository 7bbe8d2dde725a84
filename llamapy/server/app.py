"""llamapy-server's HTTP side: llama-server's endpoints on FastAPI, driving the Engine.

Endpoints (llama-server's names and fields): /health, /props, /v1/models,
/v1/chat/completions and /v1/completions (OpenAI's; also /chat/completions), /completion and
/completions (llama-server's native completion), /infill (fill-in-the-middle), /apply-template,
/embedding, /embeddings and /v1/embeddings (with --embedding), /tokenize, /detokenize,
/slots, /metrics (with --metrics), /lora-adapters (GET, POST to set the default scales) and
/lora-adapters/load (a new adapter from under --lora-dir while serving).

Every completion endpoint is a small handler over one path: the request becomes one job per
prompt (`Server.submit`), whose events the endpoint's shape turns into a stream or a whole
answer (completion_path.py; the shapes in openai_shapes.py and native_shapes.py).

Every error is OpenAI's error object {"error": {"code", "message", "type"}}. With an API key,
every endpoint but /health answers 401 without it (`Authorization: Bearer KEY`, or
`X-Api-Key`). A body past --max-body is a 413 (gate.py). A client that disconnects cancels its
jobs: the engine frees their slots at its next step. Each request leaves one line on the log
(access_log.py).

The event loop only moves bytes: parsing a body, tokenizing, rendering a chat, building a
sampler chain and rendering a large answer run in worker threads (bodies.py, `Server.prepare`),
so one client's 16 MB prompt never keeps /health or another client's stream waiting.
"""
from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable
from functools import cached_property
from importlib.resources import files

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from llamapy.errors import InputError, LlamapyError
from llamapy.generate import sampler_chain, stop_list
from llamapy.sampling.grammar_sampler import constrain
from llamapy.pooling import DEFAULT_NORMALIZE, Pooling
from llamapy.tool_calls import Tool, ToolSyntax, ToolUse, syntax_for, template_messages
from llamapy.tool_calls.messages import writes_object_arguments

from .access_log import AccessLog, note_tokens
from .adapters import Adapters
from .bodies import parse_body, validation_message
from .completion_path import Result, Shape, stream_answer, whole_answer
from .embedding_shapes import native_embeddings, openai_embeddings
from .engine import Done, Embedded, Engine, Failed, Job, QueueFull, TokenOut
from .errors import ApiError, error_response
from .gate import Gate
from .limits import DEFAULT_MAX_BODY
from .native_schemas import EmbeddingRequest, InfillRequest, NativeCompletionRequest
from .native_shapes import NativeShape, generation_settings
from .openai_shapes import ChatShape, CompletionShape
from .prompts import PromptError, check_ids, fim_missing, infill_tokens, one_prompt, prompt_list, rendered_chat
from .render import json_list_response
from .sampler_order import ordered_chain
from .schemas import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLora,
    LoraScale,
    Sampling,
    TokenizeRequest,
)
from .status import props, slot_states

CHAT_PAGE = (files("llamapy.server") / "web" / "chat.html").read_text(encoding="utf-8")

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
    async def submit(self, req: Sampling, tokens_of: Callable[[], list[list[int]]], n_probs: int,
                     **job_fields) -> tuple[list[Job], asyncio.Queue]:
        """Prepare the request's jobs in a worker thread and queue them; their events come in
        one queue as (prompt index, event)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emits(index: int):
            return lambda event: loop.call_soon_threadsafe(queue.put_nowait, (index, event))
        jobs = await asyncio.to_thread(self.prepare, req, tokens_of, n_probs, emits, **job_fields)
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
        jobs, queue = await self.submit(req, tokens_of, n_probs, **job_fields)
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
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        jobs = await asyncio.to_thread(
            prepare, lambda i: lambda event: loop.call_soon_threadsafe(queue.put_nowait, (i, event)))
        self.queue_jobs(jobs)
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


def create_app(server: Server, api_key: str | None = None, metrics: bool = False, slots: bool = True,
               max_body: int = DEFAULT_MAX_BODY, log: Callable[[str], None] | None = None):
    """The ASGI application serving `server`'s model (bodies up to `max_body` bytes; with
    `log`, a line per request)."""
    app = FastAPI(title="llamapy-server", docs_url=None, redoc_url=None)
    engine = server.engine

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return error_response(exc.code, exc.message, exc.kind)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error_response(400, validation_message(exc.errors()))

    @app.exception_handler(InputError)
    async def _input_error(request: Request, exc: InputError):
        return error_response(400, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return error_response(500, f"{type(exc).__name__}: {exc}")

    @app.get("/health")
    @app.get("/v1/health")
    async def health():
        return {"status": "ok"}

    @app.get("/")
    @app.get("/index.html")
    async def chat_page():
        """The chat page (web/chat.html): served without the API key, which it asks for."""
        return HTMLResponse(CHAT_PAGE)

    @app.get("/props")
    async def get_props():
        return await asyncio.to_thread(props, server, slots, metrics, llamapy_version())

    @app.get("/v1/models")
    @app.get("/models")
    async def models():
        hp = engine.ctx.model.hparams
        return {"object": "list", "data": [{
            "id": server.alias, "object": "model", "created": server.created, "owned_by": "llamapy",
            "meta": {"n_vocab": hp.n_vocab, "n_ctx_train": hp.n_ctx_train, "n_embd": hp.n_embd,
                     "n_ctx_slot": engine.n_ctx_slot, "n_slots": len(engine.slots)}}]}

    # ---- completions: small handlers over Server.complete --------------------------------------
    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: Request):
        req: ChatRequest = await parse_body(request, ChatRequest)
        server.resolve_tools(req)
        n_probs = max(1, req.top_logprobs or 0) if req.logprobs else 0
        model = req.model or server.alias
        return await server.complete(request, req, lambda: server.chat_tokens(req), n_probs,
                                     lambda jobs: ChatShape(server, model, req.logprobs, req.include_usage(),
                                                            req.tool_use))

    @app.post("/v1/completions")
    async def completions(request: Request):
        req: CompletionRequest = await parse_body(request, CompletionRequest)
        n_probs = max(1, req.logprobs) if req.logprobs is not None else 0
        model = req.model or server.alias
        return await server.complete(request, req, lambda: server.prompts(req.prompt), n_probs,
                                     lambda jobs: CompletionShape(server, model, req.logprobs, req.include_usage()))

    def native_shape(req: NativeCompletionRequest):
        def shape(jobs: list[Job]) -> NativeShape:
            return NativeShape(server, jobs, jobs[0].settings, model=server.alias, return_tokens=req.return_tokens,
                               n_probs=req.n_probs, response_fields=req.response_fields, stream=req.stream)
        return shape

    @app.post("/completion")
    @app.post("/completions")
    async def completion(request: Request):
        req: NativeCompletionRequest = await parse_body(request, NativeCompletionRequest)
        return await server.complete(request, req, lambda: server.prompts(req.prompt), 0, native_shape(req),
                                     cache_prompt=req.cache_prompt, id_slot=req.id_slot)

    @app.post("/infill")
    async def infill(request: Request):
        missing = fim_missing(server.vocab)
        if missing:
            raise ApiError(501, f"Infill is not supported by this model: {missing}")
        req: InfillRequest = await parse_body(request, InfillRequest)
        return await server.complete(request, req, lambda: server.infill_prompt(req), 0, native_shape(req),
                                     cache_prompt=req.cache_prompt, id_slot=req.id_slot)

    @app.post("/apply-template")
    async def apply_template(request: Request):
        req: ChatRequest = await parse_body(request, ChatRequest)

        def render() -> dict:
            try:
                return {"prompt": rendered_chat(server.template, server.vocab, server.messages(req), req.tools)}
            except LlamapyError as e:
                raise ApiError(400, str(e)) from None
        return await asyncio.to_thread(render)

    # ---- embeddings -------------------------------------------------------------------------
    def embeddings_served() -> None:
        if not server.embedding:
            raise ApiError(501, "This server does not support embeddings. Start it with `--embeddings`")

    @app.post("/embedding")
    @app.post("/embeddings")
    async def embedding(request: Request):
        embeddings_served()
        req: EmbeddingRequest = await parse_body(request, EmbeddingRequest)
        results = await server.embed(request, req)
        return PlainTextResponse("", status_code=499) if results is None else native_embeddings(results)

    @app.post("/v1/embeddings")
    async def embeddings_openai(request: Request):
        embeddings_served()
        if engine.ctx.pooling_type is Pooling.NONE:
            raise ApiError(400, "Pooling type 'none' is not OAI compatible. Please use a different pooling type")
        req: EmbeddingRequest = await parse_body(request, EmbeddingRequest)
        results = await server.embed(request, req)
        if results is None:
            return PlainTextResponse("", status_code=499)
        if "input" not in req.model_fields_set:  # llama-server: "content" is its own field, answered its way
            return native_embeddings(results)
        return openai_embeddings(results, req.model or server.alias, req.encoding_format == "base64")

    # ---- tokens ------------------------------------------------------------------------------
    @app.post("/tokenize")
    async def tokenize(request: Request):
        req: TokenizeRequest = await parse_body(request, TokenizeRequest)

        def answer() -> Response:  # in a worker thread: time and size grow with the content
            tokens = server.vocab.tokenize(req.content, add_special=req.add_special, parse_special=True)
            if req.with_pieces:
                return json_list_response("tokens", [{"id": t, "piece": server.piece(t).decode("utf-8", "replace")}
                                                     for t in tokens])
            return json_list_response("tokens", tokens)
        return await asyncio.to_thread(answer)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req: DetokenizeRequest = await parse_body(request, DetokenizeRequest)

        def answer() -> JSONResponse:
            if any(not 0 <= t < server.vocab.n_tokens for t in req.tokens):
                raise ApiError(400, f"tokens: ids must be in 0..{server.vocab.n_tokens - 1}")
            return JSONResponse({"content": b"".join(server.piece(t) for t in req.tokens).decode("utf-8", "replace")})
        return await asyncio.to_thread(answer)

    # ---- the server's state ---------------------------------------------------------------------
    @app.get("/slots")
    async def get_slots():
        if not slots:
            raise ApiError(501, "This server does not support slots endpoint. Start it without `--no-slots`")
        return slot_states(engine)

    @app.get("/metrics")
    async def get_metrics():
        if not metrics:
            raise ApiError(501, "This server does not support metrics endpoint. Start it with `--metrics`")
        m = engine.metrics
        busy = sum(s.busy for s in engine.slots)
        rows = [
            ("prompt_tokens_total", "counter", m.prompt_tokens, "Number of prompt tokens processed."),
            ("prompt_seconds_total", "counter", m.prompt_seconds, "Prompt process time"),
            ("tokens_predicted_total", "counter", m.predicted_tokens, "Number of generation tokens processed."),
            ("tokens_predicted_seconds_total", "counter", m.predicted_seconds, "Predict process time"),
            ("n_decode_total", "counter", m.n_decode, "Total number of llama_decode() calls"),
            ("n_busy_slots_per_decode", "counter", m.n_busy_slots / max(m.n_decode, 1),
             "Average number of busy slots per llama_decode() call"),
            ("prompt_tokens_seconds", "gauge", m.prompt_tokens / m.prompt_seconds if m.prompt_seconds else 0.0,
             "Average prompt throughput in tokens/s."),
            ("predicted_tokens_seconds", "gauge",
             m.predicted_tokens / m.predicted_seconds if m.predicted_seconds else 0.0,
             "Average generation throughput in tokens/s."),
            ("requests_processing", "gauge", busy, "Number of requests processing."),
            ("requests_deferred", "gauge", engine.n_waiting, "Number of requests deferred."),
        ]
        text = "".join(f"# HELP llamacpp:{name} {help_}\n# TYPE llamacpp:{name} {kind}\nllamacpp:{name} {value}\n"
                       for name, kind, value, help_ in rows)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/lora-adapters")
    async def get_lora():
        return server.adapters.listing()

    @app.post("/lora-adapters")
    async def set_lora(request: Request):
        entries = await parse_body(request, list[LoraScale])
        await asyncio.to_thread(server.adapters.set_scales, server.lora_of(entries))
        return server.adapters.listing()

    @app.post("/lora-adapters/load")
    async def load_lora(request: Request):
        req: LoadLora = await parse_body(request, LoadLora)
        return await server.adapters.load(req.path, req.scale)

    gate = Gate(app, api_key, max_body)
    return AccessLog(gate, log) if log is not None else gate


def llamapy_version() -> str:
    import llamapy
    return llamapy.__version__
