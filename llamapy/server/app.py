"""llamapy-server's HTTP side: llama-server's endpoints on FastAPI, driving the Engine.

Endpoints (llama-server's names and fields): /health, /v1/models, /v1/chat/completions and
/v1/completions (also without /v1; `stream` as server-sent events), /tokenize, /detokenize,
/slots, /metrics (with --metrics), /lora-adapters (GET, POST to set the default scales) and
/lora-adapters/load (a new adapter from under --lora-dir while serving).

Every error is OpenAI's error object {"error": {"code", "message", "type"}}. With an API key,
every endpoint but /health answers 401 without it (`Authorization: Bearer KEY`, or
`X-Api-Key`). A client that disconnects cancels its job: the engine frees its slot at its
next step.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llamapy.errors import InputError, LlamapyError
from llamapy.generate import stop_list, prompt_tokens

from .engine import Done, Engine, Failed, Job, QueueFull, TokenOut
from .schemas import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLora,
    LoraScale,
    Sampling,
    TokenizeRequest,
)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 501: "not_supported_error", 503: "unavailable_error"}
OPEN_PATHS = ("/health", "/v1/health")


class ApiError(Exception):
    def __init__(self, code: int, message: str, kind: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message = code, message
        self.kind = kind or ERROR_TYPES.get(code, "server_error")


def error_response(code: int, message: str, kind: str | None = None) -> JSONResponse:
    kind = kind or ERROR_TYPES.get(code, "server_error")
    return JSONResponse({"error": {"code": code, "message": message, "type": kind}}, status_code=code)


class Gate:
    """What every request passes first (a plain ASGI middleware: it never buffers a streamed
    response): with an API key, 401 without it but for /health; a body is JSON whatever its
    Content-Type says (llama-server's rule: `curl -d '{...}'` sends a form type)."""

    def __init__(self, app, api_key: str | None) -> None:
        self.app, self.api_key = app, api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = [(k, v) for k, v in scope.get("headers") or [] if k != b"content-type"]
            if self.api_key is not None and scope["path"] not in OPEN_PATHS:
                found = dict(headers)
                given = found.get(b"x-api-key") or found.get(b"authorization", b"").removeprefix(b"Bearer ").strip()
                if not secrets.compare_digest(given, self.api_key):
                    await error_response(401, "Invalid API Key")(scope, receive, send)
                    return
            scope = {**scope, "headers": headers + [(b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


class Server:
    """What the endpoints share: the engine, the model's chat template, the adapters' files."""

    def __init__(self, engine: Engine, template, alias: str, lora_paths: list[str], lora_dir: Path | None,
                 defaults: dict | None = None, logit_bias: dict[int, float] | None = None) -> None:
        self.engine, self.template, self.alias = engine, template, alias
        self.defaults = dict(defaults or {})  # request field -> the command line's value, for requests without it
        self.logit_bias = dict(logit_bias or {})
        self.vocab = engine.vocab
        self.lora_paths = list(lora_paths)
        self.lora_dir = lora_dir.resolve() if lora_dir else None
        self.model_path = str(getattr(engine.ctx.model.file, "path", ""))
        self.created = int(time.time())
        self._piece_cache: dict[int, bytes] = {}

    # ---- requests to jobs ----------------------------------------------------------------------
    def value(self, req: Sampling, name: str):
        """A request's field, or the server's default for it when the request does not set it."""
        return getattr(req, name) if name in req.model_fields_set else self.defaults.get(name, getattr(req, name))

    def sampling(self, req: Sampling) -> dict:
        bias: dict[int, float] = dict(self.logit_bias)
        items = req.logit_bias.items() if isinstance(req.logit_bias, dict) else (req.logit_bias or [])
        for item in items:
            key, value = item if isinstance(item, tuple) else (item + [None, None])[:2]
            bias.update(self._bias(key, value))
        if self.value(req, "ignore_eos"):
            bias.update({t: float("-inf") for t in self.vocab.eog_ids})
        seed = self.value(req, "seed")
        seed = seed if seed is not None and seed >= 0 else secrets.randbelow(2**31)
        v = lambda name: self.value(req, name)  # noqa: E731
        return dict(temperature=v("temperature"), top_k=v("top_k"), top_p=v("top_p"), min_p=v("min_p"),
                    typical_p=v("typical_p"), repeat_penalty=v("repeat_penalty"), repeat_last_n=v("repeat_last_n"),
                    frequency_penalty=v("frequency_penalty"), presence_penalty=v("presence_penalty"),
                    dynatemp_range=v("dynatemp_range"), dynatemp_exp=v("dynatemp_exponent"), seed=seed,
                    logit_bias=bias)

    def _bias(self, key: Any, value: Any) -> dict[int, float]:
        """One logit_bias entry: a token id (or its decimal string) or a text whose tokens all
        get the bias; `false` as the value bans them (llama-server's forms)."""
        if value is False:
            value = float("-inf")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
            raise ApiError(400, f"logit_bias: {value!r} is not a number")
        if isinstance(key, int) or (isinstance(key, str) and key.strip().lstrip("-").isdigit()):
            token = int(key)
            if not 0 <= token < self.vocab.n_tokens:
                raise ApiError(400, f"logit_bias: token {token} is not in the vocabulary (0..{self.vocab.n_tokens - 1})")
            return {token: float(value)}
        if isinstance(key, str):
            return {t: float(value) for t in self.vocab.tokenize(key, add_special=False)}
        raise ApiError(400, f"logit_bias: {key!r} is neither a token id nor a text")

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

    def job(self, req: Sampling, tokens: list[int], n_probs: int, emit) -> Job:
        limit = req.limit()
        return Job(tokens=tokens, max_tokens=self.defaults.get("n_predict", -1) if limit is None else limit, stop=stop_list(req.stop), sampling=self.sampling(req),
                   lora=self.lora_of(req.lora), emit=emit, n_probs=max(n_probs, req.n_probs))

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

    def submit(self, req: Sampling, tokens: list[int], n_probs: int) -> tuple[Job, asyncio.Queue]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        job = self.job(req, tokens, n_probs, lambda event: loop.call_soon_threadsafe(queue.put_nowait, event))
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


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON ({err.get('ctx', {}).get('error', 'decode error')})")
            continue
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        message = err.get("msg", "invalid").removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts) or "invalid request"


def create_app(server: Server, api_key: str | None = None, metrics: bool = False, slots: bool = True) -> Gate:
    """The ASGI application serving `server`'s model."""
    app = FastAPI(title="llamapy-server", docs_url=None, redoc_url=None)
    engine = server.engine

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return error_response(exc.code, exc.message, exc.kind)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error_response(400, _validation_message(exc))

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
    async def chat_completions(req: ChatRequest, request: Request):
        n_probs = max(1, req.top_logprobs or 0) if req.logprobs else 0
        job, queue = server.submit(req, server.chat_tokens(req), n_probs)
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
    async def completions(req: CompletionRequest, request: Request):
        try:
            tokens = prompt_tokens(server.vocab, req.prompt)
        except InputError as e:
            raise ApiError(400, str(e)) from None
        if any(not 0 <= t < server.vocab.n_tokens for t in tokens):
            raise ApiError(400, f"prompt: token ids must be in 0..{server.vocab.n_tokens - 1}")
        n_probs = max(1, req.logprobs) if req.logprobs is not None else 0
        job, queue = server.submit(req, tokens, n_probs)
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
    async def tokenize(req: TokenizeRequest):
        tokens = server.vocab.tokenize(req.content, add_special=req.add_special, parse_special=True)
        if req.with_pieces:
            return {"tokens": [{"id": t, "piece": server.piece(t).decode("utf-8", "replace")} for t in tokens]}
        return {"tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        if any(not 0 <= t < server.vocab.n_tokens for t in req.tokens):
            raise ApiError(400, f"tokens: ids must be in 0..{server.vocab.n_tokens - 1}")
        return {"content": b"".join(server.piece(t) for t in req.tokens).decode("utf-8", "replace")}

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
        return [{"id": i, "path": p, "scale": s} for i, (p, s) in enumerate(zip(server.lora_paths, engine.scales))]

    @app.post("/lora-adapters")
    async def set_lora(entries: list[LoraScale]):
        scales = server.lora_of(entries)
        with engine.lock:
            engine.scales[:] = scales
        return await get_lora()

    @app.post("/lora-adapters/load")
    async def load_lora(req: LoadLora):
        if server.lora_dir is None:
            raise ApiError(403, "loading adapters is off: start the server with --lora-dir DIR")
        path = Path(req.path)
        path = (path if path.is_absolute() else server.lora_dir / path).resolve()
        if not path.is_relative_to(server.lora_dir):
            raise ApiError(403, f"{req.path}: not under the --lora-dir {server.lora_dir}")
        if not path.is_file():
            raise ApiError(404, f"{req.path}: no such adapter file under --lora-dir")
        from llamapy.lora import LoraAdapter
        try:
            adapter = await asyncio.to_thread(LoraAdapter.load, path, engine.ctx.model)
        except LlamapyError as e:
            raise ApiError(400, str(e)) from None
        with engine.lock:
            engine.adapters.append(adapter)
            engine.scales.append(req.scale)
            server.lora_paths.append(str(path))
        return {"id": len(engine.adapters) - 1, "path": str(path), "scale": req.scale}

    return Gate(app, api_key)


def llamapy_version() -> str:
    import llamapy
    return llamapy.__version__


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

