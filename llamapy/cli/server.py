"""llamapy-server: a GGUF model (and its LoRA adapters) behind llama-server's HTTP API (its
native endpoints and OpenAI's), on uvicorn. `-np N` slots share one Context (n_ctx / N cells
each) and decode together (llamapy/server/engine.py); the endpoints are in
llamapy/server/app.py. Each request leaves a line on the log."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Optional

from llamapy import Context, load_model
from llamapy.defaults import default_model_path
from llamapy.errors import InputError, install_hint
from llamapy.server.limits import DEFAULT_MAX_ADAPTERS, DEFAULT_MAX_BODY

from . import flags as F
from .args import Tool, flag
from .completion import parse_logit_bias
from .common import (adapter_list, chat_template_for, freeze_startup_objects, kv_cache_types, load_adapters, log,
                     read_text, thread_count)

SERVER = "Server"

tool = Tool("llamapy-server", llama_cpp=["server"])

Parallel = Annotated[int, flag("-np", "--parallel", metavar="N", env="LLAMA_ARG_N_PARALLEL", group=SERVER, min=1, max=64,
                               help="slots: requests served at once, decoded together (each gets n_ctx / N cells)")]
Host = Annotated[str, flag("--host", metavar="HOST", env="LLAMA_ARG_HOST", group=SERVER,
                           help="address to listen on (127.0.0.1: this machine only)")]
Port = Annotated[int, flag("--port", metavar="PORT", env="LLAMA_ARG_PORT", group=SERVER, min=0, max=65535,
                           help="port to listen on (0: any free one, printed)")]
ApiKey = Annotated[Optional[str], flag("--api-key", metavar="KEY", env="LLAMA_API_KEY", group=SERVER,
                                       show_default=False,
                                       help="the key clients must send (Authorization: Bearer KEY); /health is open")]
ApiKeyFile = Annotated[Optional[Path], flag("--api-key-file", metavar="FNAME", group=SERVER, show_default=False,
                                            path="read", help="read the key from the first line of this file")]
Alias = Annotated[Optional[str], flag("-a", "--alias", metavar="NAME", env="LLAMA_ARG_ALIAS", group=SERVER,
                                      show_default=False, help="the model's name in /v1/models and in responses "
                                                               "(default: the file's name)")]
Metrics = Annotated[bool, flag("--metrics", env="LLAMA_ARG_ENDPOINT_METRICS", group=SERVER, show_default=False,
                               help="serve /metrics (Prometheus text)")]
Slots = Annotated[bool, flag("--slots/--no-slots", env="LLAMA_ARG_ENDPOINT_SLOTS", group=SERVER,
                             help="serve /slots")]
QueueSize = Annotated[int, flag("--queue-size", metavar="N", group=SERVER, min=0,
                                help="requests that may wait for a slot; past them, 503")]
LoraDir = Annotated[Optional[Path], flag("--lora-dir", metavar="DIR", group=SERVER, show_default=False,
                                         help="POST /lora-adapters/load may load adapters from under this directory")]
KvUnified = Annotated[bool, flag("-kvu", "--kv-unified/-no-kvu", "--no-kv-unified", env="LLAMA_ARG_KV_UNIFIED",
                                 group=SERVER, show_default=False,
                                 help="one KV cache of -c cells shared by the slots (default: n_ctx / N per slot)")]
SlotSimilarity = Annotated[float, flag("-sps", "--slot-prompt-similarity", metavar="SIMILARITY", group=SERVER, min=0,
                                       max=1, help="reuse a slot's cache when it holds at least this share of the "
                                                   "prompt (0: always the longest prefix)")]
MaxBody = Annotated[int, flag("--max-body", metavar="BYTES", group=SERVER, min=1024,
                              help="the largest request body accepted; past it, 413 (llama-server has no limit; "
                                   "16 MiB is far more than any context holds)")]
LoraMax = Annotated[int, flag("--lora-max", metavar="N", group=SERVER, min=1, max=1024,
                              help="adapters loaded at most, the command line's included (past it, "
                                   "POST /lora-adapters/load answers 409)")]
Embedding = Annotated[bool, flag("--embedding", "--embeddings", env="LLAMA_ARG_EMBEDDINGS", group=SERVER,
                                 show_default=False, help="serve /embedding and /v1/embeddings (the model's last "
                                                          "hidden states, pooled with --pooling)")]
PoolingFlag = Annotated[Optional[str], flag("--pooling", metavar="{none,mean,cls,last}", env="LLAMA_ARG_POOLING",
                                            group=SERVER, show_default=False,
                                            help="how a prompt's token embeddings become one (default: the model's, "
                                                 "none for generative models)")]
EmbdNormalize = Annotated[int, flag("--embd-normalize", metavar="N", group=SERVER, min=-1, max=64,
                                    help="normalization of pooled embeddings: -1 none, 0 max absolute int16, "
                                         "1 taxicab, 2 Euclidean, >2 p-norm")]
SpmInfill = Annotated[bool, flag("--spm-infill", group=SERVER, show_default=False,
                                 help="/infill's prompt in suffix/prefix/middle order (for models trained so)")]
LoraInitWithoutApply = Annotated[bool, flag("--lora-init-without-apply", group=SERVER, show_default=False,
                                            help="load the adapters at scale 0 (set them with POST /lora-adapters)")]


@tool.command
def run(model: F.OptionalModel = None, ctx_size: F.CtxSize = 0, batch_size: F.BatchSize = 2048,
        ubatch_size: F.UbatchSize = 512, threads: F.Threads = None, flash_attn: F.FlashAttn = "auto",
        cache_type_k: F.CacheTypeK = "f16", cache_type_v: F.CacheTypeV = "f16",
        lora: F.Lora = None, lora_scaled: F.LoraScaled = None, lora_init_without_apply: LoraInitWithoutApply = False,
        lora_dir: LoraDir = None, chat_template: F.ChatTemplate = None,
        chat_template_file: F.ChatTemplateFile = None, parallel: Parallel = 1, host: Host = "127.0.0.1",
        port: Port = 8080, api_key: ApiKey = None, api_key_file: ApiKeyFile = None, alias: Alias = None,
        metrics: Metrics = False, slots: Slots = True, queue_size: QueueSize = 64, kv_unified: KvUnified = False,
        slot_prompt_similarity: SlotSimilarity = 0.1, n_predict: F.NPredict = -1, seed: F.Seed = -1,
        temp: F.Temp = 0.8, top_k: F.TopK = 40, top_p: F.TopP = 0.95, min_p: F.MinP = 0.05,
        typical_p: F.Typical = 1.0, repeat_penalty: F.RepeatPenalty = 1.0, repeat_last_n: F.RepeatLastN = 64,
        frequency_penalty: F.FrequencyPenalty = 0.0, presence_penalty: F.PresencePenalty = 0.0,
        dynatemp_range: F.DynatempRange = 0.0, dynatemp_exp: F.DynatempExp = 1.0, logit_bias: F.LogitBias = None,
        ignore_eos: F.IgnoreEos = False, max_body: MaxBody = DEFAULT_MAX_BODY,
        lora_max: LoraMax = DEFAULT_MAX_ADAPTERS, embedding: Embedding = False, pooling: PoolingFlag = None,
        embd_normalize: EmbdNormalize = 2, spm_infill: SpmInfill = False) -> None:
    """Serve MODEL over HTTP with llama-server's API (/completion, /v1/chat/completions, ...).
    The sampling flags are the defaults of requests that do not set their own."""
    try:
        import uvicorn

        from llamapy.server.adapters import Adapters
        from llamapy.server.app import create_app
        from llamapy.server.engine import Engine
        from llamapy.server.service import Server
    except ImportError as e:
        raise InputError(f"llamapy-server needs the server extra ({e.name} is missing): "
                         f"{install_hint('server')}") from None
    if flash_attn not in ("on", "off", "auto"):
        raise InputError(f"-fa must be on, off or auto, not {flash_attn!r}")
    if api_key_file is not None:
        if api_key is not None:
            raise InputError("give the key with --api-key or with --api-key-file, not both")
        api_key = (read_text(api_key_file, "API key file").splitlines() or [""])[0].strip()
    if api_key is not None and not api_key:
        raise InputError("the API key is empty")
    if lora_dir is not None and not lora_dir.is_dir():
        raise InputError(f"--lora-dir {lora_dir}: not a directory")
    if chat_template_file is not None:
        if chat_template is not None:
            raise InputError("give the chat template with --chat-template or --chat-template-file, not both")
        chat_template = str(chat_template_file)
    type_k, type_v = kv_cache_types(cache_type_k, cache_type_v)
    paths = [p for p, _ in adapter_list(lora, lora_scaled)]  # a bad --lora-scaled is refused before any reading
    if len(paths) > lora_max:
        raise InputError(f"{len(paths)} adapters given, more than --lora-max {lora_max}")
    defaults = dict(n_predict=n_predict, seed=None if seed == -1 else seed, temperature=temp, top_k=top_k,
                    top_p=top_p, min_p=min_p, typical_p=typical_p, repeat_penalty=repeat_penalty,
                    repeat_last_n=repeat_last_n, frequency_penalty=frequency_penalty,
                    presence_penalty=presence_penalty, dynatemp_range=dynatemp_range, dynatemp_exponent=dynatemp_exp,
                    ignore_eos=ignore_eos)
    check_request_defaults(defaults)
    t0 = time.perf_counter()
    path = model or default_model_path(log)
    m = load_model(path)
    n_ctx = ctx_size or m.hparams.n_ctx_train
    if not kv_unified:
        n_ctx -= n_ctx % parallel  # each slot gets the same number of cells
    slot_ctx = n_ctx if kv_unified else n_ctx // parallel
    if slot_ctx < 2:
        raise InputError(f"-c {n_ctx} leaves no room in {parallel} slots: use a larger context or fewer slots")
    if n_predict > slot_ctx:
        raise InputError(f"-n {n_predict} is more than a slot's context ({slot_ctx} tokens): use a larger -c, fewer "
                         "slots or a smaller -n")
    bias = parse_logit_bias(logit_bias, m.vocab)
    check_server_bias(bias)
    ctx = Context(m, n_ctx=n_ctx, n_batch=batch_size, n_ubatch=ubatch_size, n_seq_max=parallel,
                  n_threads=thread_count(threads), kv_unified=kv_unified, flash_attn=flash_attn != "off",
                  type_k=type_k, type_v=type_v, pooling_type=pooling)
    pairs = load_adapters(m, lora, lora_scaled)
    engine = Engine(ctx, [a for a, _ in pairs], [0.0 if lora_init_without_apply else s for _, s in pairs],
                    max_queue=queue_size, slot_similarity=slot_prompt_similarity)
    template = chat_template_for(m, chat_template)
    server = Server(engine, template, alias or Path(path).name, Adapters(engine, paths, lora_dir, lora_max), defaults,
                    bias, embedding=embedding, n_batch=batch_size, embd_normalize=embd_normalize,
                    spm_infill=spm_infill)
    app = create_app(server, api_key=api_key, metrics=metrics, slots=slots, max_body=max_body, log=log)
    freeze_startup_objects()
    log(f"model loaded in {time.perf_counter() - t0:.2f} s: {parallel} slot{'s' if parallel > 1 else ''} of "
        f"{engine.n_ctx_slot} tokens, {ctx.backend.n_threads} threads"
        + (f"; embeddings with pooling {ctx.pooling_type.value}" if embedding else ""))
    engine.start()
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, timeout_graceful_shutdown=3)
    web = uvicorn.Server(config)
    _announce_when_listening(web, host)
    try:
        web.run()
    except SystemExit:  # uvicorn's way of saying it could not bind (its reason is on stderr)
        pass
    finally:
        engine.stop()
    if not web.started:
        raise InputError(f"cannot listen on {host}:{port} (in use, or not an address of this machine)")


# a request field -> the flag that sets its default
DEFAULT_FLAGS = {"n_predict": "-n", "seed": "-s", "temperature": "--temp", "top_k": "--top-k", "top_p": "--top-p",
                 "min_p": "--min-p", "typical_p": "--typical", "repeat_penalty": "--repeat-penalty",
                 "repeat_last_n": "--repeat-last-n", "frequency_penalty": "--frequency-penalty",
                 "presence_penalty": "--presence-penalty", "dynatemp_range": "--dynatemp-range",
                 "dynatemp_exponent": "--dynatemp-exp", "ignore_eos": "--ignore-eos"}


def check_request_defaults(defaults: dict) -> None:
    """The sampling flags are the defaults of requests, so they keep the ranges a request's
    fields have (llamapy/server/schemas.py): a default no request could send is refused."""
    from pydantic import ValidationError

    from llamapy.server.schemas import Sampling
    try:
        Sampling.model_validate(defaults)
    except ValidationError as e:
        err = e.errors()[0]
        name = str(err["loc"][0]) if err.get("loc") else ""
        flag_name = DEFAULT_FLAGS.get(name, name)
        raise InputError(f"{flag_name} {defaults.get(name)}: {err['msg'].removeprefix('Value error, ')} "
                         "(the range of the request field it is the default of)") from None


def check_server_bias(bias: dict[int, float]) -> None:
    """-l: a bias every request gets, so within a request's range (-inf, llama-server's ban, allowed)."""
    from llamapy.server.schemas import LOGIT_BIAS_LIMIT
    for token, value in bias.items():
        if value != float("-inf") and not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise InputError(f"-l {token}{value:+g}: a bias must be from {-LOGIT_BIAS_LIMIT:g} to "
                             f"{LOGIT_BIAS_LIMIT:g}, or -inf (the token is never sampled)")


def _announce_when_listening(web, host: str) -> None:
    """Print the address once uvicorn listens (the port it got, when --port 0)."""
    startup = web.startup

    async def announced(sockets=None):
        await startup(sockets=sockets)
        if web.started:
            for server in web.servers:
                for sock in server.sockets:
                    port = sock.getsockname()[1]
                    log(f"listening on http://{host}:{port} (the OpenAI API under /v1)")
                    sys.stderr.flush()
                    return
    web.startup = announced


main = tool.main

if __name__ == "__main__":
    main()
