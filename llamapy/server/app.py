"""llamapy-server's HTTP side: llama-server's endpoints on FastAPI, driving the Engine.

Endpoints (llama-server's names and fields): /health, /props, /v1/models,
/v1/chat/completions and /v1/completions (OpenAI's; also /chat/completions), /completion and
/completions (llama-server's native completion), /infill (fill-in-the-middle), /apply-template,
/embedding, /embeddings and /v1/embeddings (with --embedding), /tokenize, /detokenize,
/slots, /metrics (with --metrics), /lora-adapters (GET, POST to set the default scales) and
/lora-adapters/load (a new adapter from under --lora-dir while serving).

Every endpoint is a small handler (`Endpoints`, one method each, bound to its paths by
`ROUTES`) over what the endpoints share (`Server`, service.py). The completion endpoints differ
only in how their body becomes prompts (text, a rendered chat with its tools, an infill
prompt) and in the shape that answers; all go through one path: the request becomes one job per
prompt (`Server.complete`), whose events the shape turns into a stream or a whole answer
(completion_path.py; the shapes in openai_shapes.py and native_shapes.py).

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
from collections.abc import Callable
from importlib.resources import files

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from llamapy.errors import InputError, LlamapyError
from llamapy.pooling import Pooling

from .access_log import AccessLog
from .bodies import parse_body, validation_message
from .embedding_shapes import native_embeddings, openai_embeddings
from .engine import Job
from .errors import ApiError, error_response
from .gate import Gate
from .limits import DEFAULT_MAX_BODY
from .native_schemas import EmbeddingRequest, InfillRequest, NativeCompletionRequest
from .native_shapes import NativeShape
from .openai_shapes import ChatShape, CompletionShape
from .prompts import fim_missing, rendered_chat
from .render import json_list_response
from .schemas import ChatRequest, CompletionRequest, DetokenizeRequest, LoadLora, LoraScale, TokenizeRequest
from .service import Server
from .status import metrics_text, model_list, props, slot_states

__all__ = ["Server", "create_app"]

CHAT_PAGE = (files("llamapy.server") / "web" / "chat.html").read_text(encoding="utf-8")


class Endpoints:
    """The endpoints' handlers over one Server (module docstring); `slots` and `metrics`: the
    command line's --no-slots and --metrics."""

    def __init__(self, server: Server, slots: bool, metrics: bool) -> None:
        self.server, self.slots, self.metrics = server, slots, metrics

    # ---- the server and its model ----------------------------------------------------------------
    async def health(self):
        return {"status": "ok"}

    async def chat_page(self):
        """The chat page (web/chat.html): served without the API key, which it asks for."""
        return HTMLResponse(CHAT_PAGE)

    async def get_props(self):
        return await asyncio.to_thread(props, self.server, self.slots, self.metrics, llamapy_version())

    async def models(self):
        return model_list(self.server)

    # ---- completions: each a prompt and a shape over Server.complete ----------------------------
    async def chat_completions(self, request: Request):
        server, req = self.server, await parse_body(request, ChatRequest)
        server.resolve_tools(req)
        n_probs = max(1, req.top_logprobs or 0) if req.logprobs else 0
        model = req.model or server.alias
        return await server.complete(request, req, lambda: server.chat_tokens(req), n_probs,
                                     lambda jobs: ChatShape(server, model, req.logprobs, req.include_usage(),
                                                            req.tool_use))

    async def completions(self, request: Request):
        server, req = self.server, await parse_body(request, CompletionRequest)
        n_probs = max(1, req.logprobs) if req.logprobs is not None else 0
        model = req.model or server.alias
        return await server.complete(request, req, lambda: server.prompts(req.prompt), n_probs,
                                     lambda jobs: CompletionShape(server, model, req.logprobs, req.include_usage()))

    async def completion(self, request: Request):
        server, req = self.server, await parse_body(request, NativeCompletionRequest)
        return await server.complete(request, req, lambda: server.prompts(req.prompt), 0, self._native_shape(req),
                                     cache_prompt=req.cache_prompt, id_slot=req.id_slot)

    async def infill(self, request: Request):
        server = self.server
        missing = fim_missing(server.vocab)
        if missing:
            raise ApiError(501, f"Infill is not supported by this model: {missing}")
        req: InfillRequest = await parse_body(request, InfillRequest)
        return await server.complete(request, req, lambda: server.infill_prompt(req), 0, self._native_shape(req),
                                     cache_prompt=req.cache_prompt, id_slot=req.id_slot)

    def _native_shape(self, req: NativeCompletionRequest) -> Callable[[list[Job]], NativeShape]:
        """llama-server's native answer to `req` (/completion, /infill), made once its jobs are."""
        def shape(jobs: list[Job]) -> NativeShape:
            return NativeShape(self.server, jobs, jobs[0].settings, model=self.server.alias,
                               return_tokens=req.return_tokens, n_probs=req.n_probs,
                               response_fields=req.response_fields, stream=req.stream)
        return shape

    async def apply_template(self, request: Request):
        server, req = self.server, await parse_body(request, ChatRequest)

        def render() -> dict:
            try:
                return {"prompt": rendered_chat(server.template, server.vocab, server.messages(req), req.tools)}
            except LlamapyError as e:
                raise ApiError(400, str(e)) from None
        return await asyncio.to_thread(render)

    # ---- embeddings -----------------------------------------------------------------------------
    async def embedding(self, request: Request):
        self._embeddings_served()
        req: EmbeddingRequest = await parse_body(request, EmbeddingRequest)
        results = await self.server.embed(request, req)
        return PlainTextResponse("", status_code=499) if results is None else native_embeddings(results)

    async def embeddings_openai(self, request: Request):
        self._embeddings_served()
        if self.server.engine.ctx.pooling_type is Pooling.NONE:
            raise ApiError(400, "Pooling type 'none' is not OAI compatible. Please use a different pooling type")
        req: EmbeddingRequest = await parse_body(request, EmbeddingRequest)
        results = await self.server.embed(request, req)
        if results is None:
            return PlainTextResponse("", status_code=499)
        if "input" not in req.model_fields_set:  # llama-server: "content" is its own field, answered its way
            return native_embeddings(results)
        return openai_embeddings(results, req.model or self.server.alias, req.encoding_format == "base64")

    def _embeddings_served(self) -> None:
        if not self.server.embedding:
            raise ApiError(501, "This server does not support embeddings. Start it with `--embeddings`")

    # ---- tokens (in a worker thread: time and size grow with the content) ------------------------
    async def tokenize(self, request: Request):
        server, req = self.server, await parse_body(request, TokenizeRequest)

        def answer() -> Response:
            tokens = server.vocab.tokenize(req.content, add_special=req.add_special, parse_special=True)
            if req.with_pieces:
                return json_list_response("tokens", [{"id": t, "piece": server.piece(t).decode("utf-8", "replace")}
                                                     for t in tokens])
            return json_list_response("tokens", tokens)
        return await asyncio.to_thread(answer)

    async def detokenize(self, request: Request):
        server, req = self.server, await parse_body(request, DetokenizeRequest)

        def answer() -> JSONResponse:
            if any(not 0 <= t < server.vocab.n_tokens for t in req.tokens):
                raise ApiError(400, f"tokens: ids must be in 0..{server.vocab.n_tokens - 1}")
            return JSONResponse({"content": b"".join(server.piece(t) for t in req.tokens).decode("utf-8", "replace")})
        return await asyncio.to_thread(answer)

    # ---- the server's state -----------------------------------------------------------------------
    async def get_slots(self):
        if not self.slots:
            raise ApiError(501, "This server does not support slots endpoint. Start it without `--no-slots`")
        return slot_states(self.server.engine)

    async def get_metrics(self):
        if not self.metrics:
            raise ApiError(501, "This server does not support metrics endpoint. Start it with `--metrics`")
        return PlainTextResponse(metrics_text(self.server.engine), media_type="text/plain; version=0.0.4")

    async def get_lora(self):
        return self.server.adapters.listing()

    async def set_lora(self, request: Request):
        entries = await parse_body(request, list[LoraScale])
        await asyncio.to_thread(self.server.adapters.set_scales, self.server.lora_of(entries))
        return self.server.adapters.listing()

    async def load_lora(self, request: Request):
        req: LoadLora = await parse_body(request, LoadLora)
        return await self.server.adapters.load(req.path, req.scale)


# (HTTP method, paths, Endpoints method), in the order the routes are matched and listed
ROUTES = (
    ("GET", ("/v1/health", "/health"), "health"),
    ("GET", ("/index.html", "/"), "chat_page"),
    ("GET", ("/props",), "get_props"),
    ("GET", ("/models", "/v1/models"), "models"),
    ("POST", ("/chat/completions", "/v1/chat/completions"), "chat_completions"),
    ("POST", ("/v1/completions",), "completions"),
    ("POST", ("/completions", "/completion"), "completion"),
    ("POST", ("/infill",), "infill"),
    ("POST", ("/apply-template",), "apply_template"),
    ("POST", ("/embeddings", "/embedding"), "embedding"),
    ("POST", ("/v1/embeddings",), "embeddings_openai"),
    ("POST", ("/tokenize",), "tokenize"),
    ("POST", ("/detokenize",), "detokenize"),
    ("GET", ("/slots",), "get_slots"),
    ("GET", ("/metrics",), "get_metrics"),
    ("GET", ("/lora-adapters",), "get_lora"),
    ("POST", ("/lora-adapters",), "set_lora"),
    ("POST", ("/lora-adapters/load",), "load_lora"),
)


# ---- errors: every one as OpenAI's error object ------------------------------------------------------
async def _api_error(request: Request, exc: ApiError):
    return error_response(exc.code, exc.message, exc.kind)


async def _invalid(request: Request, exc: RequestValidationError):
    return error_response(400, validation_message(exc.errors()))


async def _input_error(request: Request, exc: InputError):
    return error_response(400, str(exc))


async def _http(request: Request, exc: StarletteHTTPException):
    return error_response(exc.status_code, str(exc.detail))


async def _unexpected(request: Request, exc: Exception):
    return error_response(500, f"{type(exc).__name__}: {exc}")


ERROR_HANDLERS = ((ApiError, _api_error), (RequestValidationError, _invalid), (InputError, _input_error),
                  (StarletteHTTPException, _http), (Exception, _unexpected))


def create_app(server: Server, api_key: str | None = None, metrics: bool = False, slots: bool = True,
               max_body: int = DEFAULT_MAX_BODY, log: Callable[[str], None] | None = None):
    """The ASGI application serving `server`'s model (bodies up to `max_body` bytes; with
    `log`, a line per request)."""
    app = FastAPI(title="llamapy-server", docs_url=None, redoc_url=None)
    for kind, handler in ERROR_HANDLERS:
        app.add_exception_handler(kind, handler)
    endpoints = Endpoints(server, slots, metrics)
    for method, paths, name in ROUTES:
        for path in paths:
            app.add_api_route(path, getattr(endpoints, name), methods=[method])
    gate = Gate(app, api_key, max_body)
    return AccessLog(gate, log) if log is not None else gate


def llamapy_version() -> str:
    import llamapy
    return llamapy.__version__
