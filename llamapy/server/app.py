"""llamapy-server's HTTP side: llama-server's endpoints on FastAPI, driving the Engine.

Endpoints (llama-server's names and fields): /health, /v1/models, /v1/chat/completions and
/v1/completions (also without /v1; `stream` as server-sent events), /tokenize, /detokenize,
/slots, /metrics (with --metrics), /lora-adapters (GET, POST to set the default scales) and
/lora-adapters/load (a new adapter from under --lora-dir while serving).

Every error is OpenAI's error object {"error": {"code", "message", "type"}}. With an API key,
every endpoint but /health answers 401 without it (`Authorization: Bearer KEY`, or
`X-Api-Key`). A body past --max-body is a 413 (gate.py). A client that disconnects cancels its
job: the engine frees its slot at its next step.

The event loop only moves bytes: parsing a body, tokenizing, rendering a chat, building a
sampler chain and rendering a large answer run in worker threads (bodies.py, `Server.prepare`),
so one client's 16 MB prompt never keeps /health or another client's stream waiting.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llamapy.errors import InputError, LlamapyError
from llamapy.generate import prompt_tokens, sampler_chain, stop_list

from .adapters import Adapters
from .bodies import parse_body, validation_message
from .engine import Done, Engine, Failed, Job, QueueFull, TokenOut
from .errors import ApiError, error_response
from .gate import Gate
from .limits import DEFAULT_MAX_BODY
from .render import json_list_response
from .schemas import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLora,
    LoraScale,
    Sampling,
    TokenizeRequest,
)


# characters of a long prompt tokenized first to see whether it can fit (_refuse_surely_too_long):
# text runs at 3 to 5 characters a token, so the probe holds ~4 times a slot's context
PROBE_CHARS_PER_TOKEN = 16


class Server:
    """What the endpoints share: the engine, the model's chat template, the adapters."""

    def __init__(self, engine: Engine, template, alias: str, adapters: Adapters,
                 defaults: dict | None = None, logit_bias: dict[int, float] | None = None) -> None:
        self.engine, self.template, self.alias, self.adapters = engine, template, alias, adapters
        self.defaults = dict(defaults or {})  # request field -> the command line's value, for requests without it
        self.logit_bias = dict(logit_bias or {})
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

    def prepare(self, req: Sampling, tokens_of: Callable[[], list[int]], n_probs: int, emit) -> Job:
        """The request as a job for the engine: its prompt's tokens, its limits, its own sampler
        chain (made here, so that a request the sampler refuses fails alone, not in the loop
        that serves everyone)."""
        limit = self._limit(req)
        try:
            tokens = tokens_of()
        except InputError as e:
            raise ApiError(400, str(e)) from None
        if len(tokens) >= self.engine.n_ctx_slot:
            raise ApiError(400, f"the request ({len(tokens)} prompt tokens) exceeds the available context size "
                                f"({self.engine.n_ctx_slot} tokens per slot), try increasing it",
                           "exceed_context_size_error")
        chain = sampler_chain(self.vocab.n_tokens, **self.sampling(req))
        return Job(tokens=tokens, max_tokens=limit, stop=stop_list(req.stop), chain=chain, lora=self.lora_of(req.lora),
                   emit=emit, n_probs=max(n_probs, req.n_probs))

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

    def completion_tokens(self, req: CompletionRequest) -> list[int]:
        if isinstance(req.prompt, str):
            self._refuse_surely_too_long(req.prompt)
        tokens = prompt_tokens(self.vocab, req.prompt)
        if any(not 0 <= t < self.vocab.n_tokens for t in tokens):
            raise ApiError(400, f"prompt: token ids must be in 0..{self.vocab.n_tokens - 1}")
        return tokens

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

    def chat_tokens(self, req: ChatRequest) -> list[int]:
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
        try:
            return list(self.template.tokenize(self.vocab, messages, add_generation_prompt=True)[0])
        except LlamapyError as e:
            raise ApiError(400, str(e)) from None

    def piece(self, token: int) -> bytes:
        piece = self._piece_cache.get(token)
        if piece is None:
            piece = self._piece_cache[token] = self.vocab.token_to_piece(token, True)
        return piece

    # ---- running a job -------------------------------------------------------------------------
    async def events(self, request: Request, job: Job, queue: asyncio.Queue) -> AsyncIterator:
        """The job's events as they come; a client gone cancels it (checked while waiting)."""
        checked = time.monotonic()
        try:
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    event = None
                if time.monotonic() - checked >= 0.25:  # also while tokens keep coming
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return
                if event is None:
                    continue
                yield event
                if isinstance(event, (Done, Failed)):
                    return
        finally:
            job.cancelled.set()  # a no-op once done; else the engine frees the slot at its next step

    async def collect(self, request: Request, job: Job, queue: asyncio.Queue) -> tuple[list[TokenOut], Done | None]:
        """A whole (not streamed) answer: its tokens, and how it ended (None: the client left)."""
        outs, done = [], None
        async for event in self.events(request, job, queue):
            if isinstance(event, TokenOut):
                outs.append(event)
            elif isinstance(event, Done):
                done = event
            else:
                raise ApiError(500, event.message)
        return outs, done

    async def submit(self, req: Sampling, tokens_of: Callable[[], list[int]],
                     n_probs: int) -> tuple[Job, asyncio.Queue]:
        """Prepare the request's job in a worker thread and queue it; its events come in the queue."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        emit = lambda event: loop.call_soon_threadsafe(queue.put_nowait, event)  # noqa: E731
        job = await asyncio.to_thread(self.prepare, req, tokens_of, n_probs, emit)
        try:
            self.engine.submit(job)
        except QueueFull as e:
            raise ApiError(503, f"server busy: {e}; retry later") from None
        except InputError as e:
            raise ApiError(400, str(e), "exceed_context_size_error" if "context size" in str(e) else None) from None
        return job, queue

    # ---- OpenAI's shapes -----------------------------------------------------------------------
    def usage(self, done: Done) -> dict:
        return {"prompt_tokens": done.n_prompt, "completion_tokens": done.n_generated,
                "total_tokens": done.n_prompt + done.n_generated,
                "prompt_tokens_details": {"cached_tokens": done.n_cached}}

    def timings(self, done: Done) -> dict:
        """llama-server's `timings` object."""
        n_new = done.n_prompt - done.n_cached
        return {"cache_n": done.n_cached, "prompt_n": n_new, "prompt_ms": done.t_prompt * 1e3,
                "prompt_per_second": n_new / done.t_prompt if done.t_prompt else 0.0,
                "predicted_n": done.n_generated, "predicted_ms": done.t_generate * 1e3,
                "predicted_per_second": done.n_generated / done.t_generate if done.t_generate else 0.0}

    def chat_logprob(self, out: TokenOut) -> dict:
        def entry(token: int, logprob: float) -> dict:
            piece = self.piece(token)
            return {"id": token, "token": piece.decode("utf-8", "replace"), "bytes": list(piece), "logprob": logprob}
        return {**entry(out.token, out.logprob), "top_logprobs": [entry(t, lp) for t, lp in out.top or []]}


def create_app(server: Server, api_key: str | None = None, metrics: bool = False, slots: bool = True,
               max_body: int = DEFAULT_MAX_BODY) -> Gate:
    """The ASGI application serving `server`'s model (bodies up to `max_body` bytes)."""
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

    @app.get("/props")
    async def props():
        """llama-server's GET /props: what a client reads to set itself up."""
        d = server.defaults
        return {"default_generation_settings": {"n_ctx": engine.n_ctx_slot, "params": {
                    "n_predict": d.get("n_predict", -1), "temperature": d.get("temperature", 0.8),
                    "top_k": d.get("top_k", 40), "top_p": d.get("top_p", 0.95), "min_p": d.get("min_p", 0.05),
                    "repeat_penalty": d.get("repeat_penalty", 1.0), "seed": d.get("seed") or -1}},
                "total_slots": len(engine.slots), "model_alias": server.alias, "model_path": server.model_path,
                "chat_template": server.template.source, "build_info": f"llamapy {llamapy_version()}"}

    @app.get("/v1/models")
    @app.get("/models")
    async def models():
        hp = engine.ctx.model.hparams
        return {"object": "list", "data": [{
            "id": server.alias, "object": "model", "created": server.created, "owned_by": "llamapy",
            "meta": {"n_vocab": hp.n_vocab, "n_ctx_train": hp.n_ctx_train, "n_embd": hp.n_embd,
                     "n_ctx_slot": engine.n_ctx_slot, "n_slots": len(engine.slots)}}]}

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: Request):
        req: ChatRequest = await parse_body(request, ChatRequest)
        n_probs = max(1, req.top_logprobs or 0) if req.logprobs else 0
        job, queue = await server.submit(req, lambda: server.chat_tokens(req), n_probs)
        ident, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
        head = {"id": ident, "created": created, "model": req.model or server.alias}
        if req.stream:
            async def chunks() -> AsyncIterator[str]:
                def chunk(delta: dict, finish: str | None = None, logprobs: list | None = None, **more) -> str:
                    choice = {"index": 0, "delta": delta, "finish_reason": finish,
                              "logprobs": {"content": logprobs} if logprobs else None}
                    return _sse({**head, "object": "chat.completion.chunk", "choices": [choice], **more})
                yield chunk({"role": "assistant", "content": None})
                async for event in server.events(request, job, queue):
                    if isinstance(event, TokenOut):
                        logprobs = [server.chat_logprob(event)] if event.logprob is not None else None
                        if event.text or logprobs:
                            yield chunk({"content": event.text}, logprobs=logprobs)
                    elif isinstance(event, Done):
                        yield chunk({}, event.finish_reason, timings=server.timings(event))
                        if req.include_usage():
                            yield _sse({**head, "object": "chat.completion.chunk", "choices": [],
                                        "usage": server.usage(event)})
                    else:
                        yield _sse({"error": {"code": 500, "message": event.message, "type": "server_error"}})
                yield "data: [DONE]\n\n"
            return StreamingResponse(chunks(), media_type="text/event-stream")
        outs, done = await server.collect(request, job, queue)
        if done is None:
            return PlainTextResponse("", status_code=499)  # the client is gone
        logprobs = [server.chat_logprob(o) for o in outs if o.logprob is not None]
        choice = {"index": 0, "message": {"role": "assistant", "content": "".join(o.text for o in outs)},
                  "finish_reason": done.finish_reason, "logprobs": {"content": logprobs} if req.logprobs else None}
        return {**head, "object": "chat.completion", "choices": [choice], "usage": server.usage(done),
                "timings": server.timings(done)}

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(request: Request):
        req: CompletionRequest = await parse_body(request, CompletionRequest)
        n_probs = max(1, req.logprobs) if req.logprobs is not None else 0
        job, queue = await server.submit(req, lambda: server.completion_tokens(req), n_probs)
        ident, created = f"cmpl-{secrets.token_hex(12)}", int(time.time())
        head = {"id": ident, "created": created, "model": req.model or server.alias, "object": "text_completion"}

        def logprobs_of(outs: list[TokenOut], offset: int) -> dict | None:
            if req.logprobs is None:
                return None
            pieces = [server.piece(o.token).decode("utf-8", "replace") for o in outs]
            offsets = list(itertools.accumulate([offset] + [len(p) for p in pieces[:-1]])) if pieces else []
            return {"tokens": pieces, "token_logprobs": [o.logprob for o in outs],
                    "top_logprobs": [{server.piece(t).decode("utf-8", "replace"): lp for t, lp in o.top or []}
                                     for o in outs],
                    "text_offset": offsets}

        if req.stream:
            async def chunks() -> AsyncIterator[str]:
                offset = 0
                async for event in server.events(request, job, queue):
                    if isinstance(event, TokenOut):
                        if event.text or event.logprob is not None:
                            outs = [event] if event.logprob is not None and event.token is not None else []
                            yield _sse({**head, "choices": [{"index": 0, "text": event.text, "finish_reason": None,
                                                             "logprobs": logprobs_of(outs, offset)}]})
                            offset += len(event.text)
                    elif isinstance(event, Done):
                        yield _sse({**head, "choices": [{"index": 0, "text": "", "finish_reason": event.finish_reason,
                                                         "logprobs": None}], "timings": server.timings(event)})
                        if req.include_usage():
                            yield _sse({**head, "choices": [], "usage": server.usage(event)})
                    else:
                        yield _sse({"error": {"code": 500, "message": event.message, "type": "server_error"}})
                yield "data: [DONE]\n\n"
            return StreamingResponse(chunks(), media_type="text/event-stream")
        outs, done = await server.collect(request, job, queue)
        if done is None:
            return PlainTextResponse("", status_code=499)
        scored = [o for o in outs if o.logprob is not None and o.token is not None]
        choice = {"index": 0, "text": "".join(o.text for o in outs), "finish_reason": done.finish_reason,
                  "logprobs": logprobs_of(scored, 0)}
        return {**head, "choices": [choice], "usage": server.usage(done), "timings": server.timings(done)}

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

    @app.get("/slots")
    async def get_slots():
        if not slots:
            raise ApiError(501, "This server does not support slots endpoint. Start it without `--no-slots`")
        return [{"id": s.id, "n_ctx": engine.n_ctx_slot, "is_processing": s.busy, "n_cached": len(s.cached),
                 "n_cells": engine.cells_used(s), "id_task": s.job.id if s.job else -1,
                 "lora": [{"id": i, "scale": x} for i, x in enumerate(s.lora)]}
                for s in engine.slots]

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

    return Gate(app, api_key, max_body)


def llamapy_version() -> str:
    import llamapy
    return llamapy.__version__


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

