"""llama.cpp's flags that a llamapy tool does not declare: each is noted (accepted, with one
line saying why it has no effect) or refused by name, never misread as another flag.

The lists follow llama.cpp's `common/arg.cpp` (the `--help` of llama-perplexity,
llama-completion, llama-cli, llama-finetune, llama-export-lora and llama-server),
llama-quantize's own usage text and the argparse flags of convert_hf_to_gguf.py and
convert_lora_to_gguf.py for llamapy-convert; tests/data holds them.
A flag a tool declares itself is the tool's (it is removed from these); a flag of one of
llama.cpp's tools that is neither declared nor listed here would reach the generic "unknown
flag" refusal, which tests/test_cli_flags.py checks never happens.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from llamapy.arch import listing

ALL = ("perplexity", "completion", "cli", "finetune", "export-lora", "server")
GENERATING = ("completion", "cli", "server")  # the tools that sample tokens
CHAT = ("completion", "cli", "server")
CLI_OR_SERVER = ("cli", "server")
SERVER = ("server",)
QUANTIZE = ("quantize",)  # llama-quantize has its own command line, not common/arg.cpp's: not in ALL
CONVERT = ("convert",)  # convert_hf_to_gguf.py: its own flags, none of the C++ tools'
CONVERT_LORA = ("convert-lora",)  # convert_lora_to_gguf.py's (the ones convert_hf_to_gguf.py shares are CONVERT's)


@dataclass(frozen=True)
class LlamaCppFlag:
    """One of llama.cpp's flags (all its names): how many values follow it, whether it is
    refused, and why it is refused or has no effect."""

    names: tuple[str, ...]
    n_values: int
    refuse: bool
    why: str


@dataclass(frozen=True)
class _Entry:
    names: tuple[str, ...]
    n_values: int
    refuse: bool
    why: str
    tools: tuple[str, ...]
    sampling: bool = False  # a sampling flag: only noted in the tools that do not sample


def _entries(refuse: bool, why: str, flags: Iterable[tuple[str, int]], tools: tuple[str, ...] = ALL,
             sampling: bool = False) -> list[_Entry]:
    return [_Entry(tuple(names.split()), n, refuse, why, tools, sampling) for names, n in flags]


def note(why: str, *flags: tuple[str, int], tools: tuple[str, ...] = ALL) -> list[_Entry]:
    return _entries(False, why, flags, tools)


def refuse(why: str, *flags: tuple[str, int], tools: tuple[str, ...] = ALL, sampling: bool = False) -> list[_Entry]:
    return _entries(True, why, flags, tools, sampling)


ENTRIES: list[_Entry] = [
    # llama-quantize's own
    *refuse("importance matrices are not supported: llamapy's block quantizers are ggml's reference ones, "
            "without importance weights", ("--imatrix", 1), ("--include-weights", 1), ("--exclude-weights", 1),
            tools=QUANTIZE),
    *refuse("split GGUF files are not supported: the input is one file and so is the output", ("--keep-split", 0),
            tools=QUANTIZE),
    # convert_hf_to_gguf.py's
    *note("tensors are always converted one at a time, while the file is written",
          ("--use-temp-file", 0), ("--no-lazy", 0), tools=CONVERT),
    *refuse("only whole model files are written (no vocabulary-only file)", ("--vocab-only", 0), tools=CONVERT),
    *refuse("GGUF files are written little-endian", ("--bigendian", 0), tools=CONVERT),
    *refuse("split GGUF files are not written", ("--split-max-tensors", 1), ("--split-max-size", 1),
            ("--dry-run", 0), ("--no-tensor-first-split", 0), tools=CONVERT),
    *refuse("authorship override files are not read (--model-name sets the name)", ("--metadata", 1), tools=CONVERT),
    *refuse(f"llamapy-convert converts {listing(' and ', converted=True)} checkpoints (-h)",
            ("--print-supported-models", 0), tools=CONVERT),
    *refuse("llamapy does not download models: give a local checkpoint folder", ("--remote", 0), tools=CONVERT),
    *refuse("only the text model is converted (no projector, MTP or draft heads)", ("--mmproj", 0), ("--mtp", 0),
            ("--no-nextn --no-mtp", 0), ("--dspark", 0), ("--target-model-dir", 1), tools=CONVERT),
    *refuse("Mistral's own checkpoint format is not read", ("--mistral-format", 0),
            ("--disable-mistral-community-chat-template", 0), tools=CONVERT),
    *refuse("embedding models are not converted", ("--sentence-transformers-dense-modules", 0), tools=CONVERT),
    *refuse("tensors are converted as the checkpoint holds them (no fusing, no FP8 weights)",
            ("--fuse-gate-up-exps", 0), ("--fuse-qkv", 0), ("--fp8-as-q8", 0), tools=CONVERT),
    # convert_lora_to_gguf.py's
    *refuse("llamapy does not download models: give the base's folder with --base", ("--base-model-id", 1),
            tools=CONVERT_LORA),
    *refuse("no code from a checkpoint is run: its architecture must be one llamapy-convert knows",
            ("--trust-remote-code", 0), tools=CONVERT_LORA),
    # llama-server's own
    *note("requests are always batched continuously", ("-cb --cont-batching -nocb --no-cont-batching", 0), tools=SERVER),
    *note("each slot always keeps its last conversation in its KV cache and reuses its longest common prefix",
          ("--cache-prompt --no-cache-prompt", 0), ("--cache-reuse", 1), ("--cache-idle-slots --no-cache-idle-slots", 0),
          ("-cms --checkpoint-min-step", 1), tools=SERVER),
    *note("HTTP is served by uvicorn's event loop (one thread)", ("--threads-http", 1), tools=SERVER),
    *note("requests have no server-side time limit; a client that disconnects stops its generation",
          ("-to --timeout", 1), ("--sse-ping-interval", 1), ("--sleep-idle-seconds", 1), tools=SERVER),
    *note("the model has no tags", ("--tags", 1), tools=SERVER),
    *refuse("the port is not shared", ("--reuse-port", 0), tools=SERVER),
    *refuse("there is no web UI: the server answers the API only", ("--path", 1), ("--ui --webui --no-ui --no-webui", 0),
            ("--ui-config --webui-config", 1), ("--ui-config-file --webui-config-file", 1),
            ("--ui-mcp-proxy --webui-mcp-proxy --no-ui-mcp-proxy --no-webui-mcp-proxy", 0), ("--media-path", 1),
            tools=SERVER),
    *refuse("HTTPS is not served: put a TLS proxy in front", ("--ssl-key-file", 1), ("--ssl-cert-file", 1),
            tools=SERVER),
    *refuse("CORS is not configurable: no browser origin is allowed", ("--cors-origins", 1), ("--cors-methods", 1),
            ("--cors-headers", 1), ("--cors-credentials --no-cors-credentials", 0), tools=SERVER),
    *refuse("the API is served at / and /v1 only", ("--api-prefix", 1), tools=SERVER),
    *refuse("reranking is not served (no model here has a classifier head)", ("--rerank --reranking", 0),
            tools=SERVER),
    *refuse("tool calls, MCP servers and agents are not supported", ("--tools", 1), ("--tools-runtime", 1),
            ("--mcp-servers-config", 1), ("--mcp-servers-json", 1), ("-ag --agent -no-ag --no-agent", 0),
            tools=SERVER),
    *refuse("one model per server: give it with -m", ("--models-dir", 1), ("--models-preset", 1), ("--models-max", 1),
            ("--models-autoload --no-models-autoload", 0), tools=SERVER),
    *refuse("slots are not saved to files", ("--slot-save-path", 1), ("--kv-unified-per-slot", 1), tools=SERVER),
    *refuse("POST /props is not served", ("--props", 0), tools=SERVER),
    *refuse("an assistant message last in a chat is answered, not continued", ("--prefill-assistant "
            "--no-prefill-assistant", 0), tools=SERVER),
    *note("prompts come as JSON strings", ("-e --escape --no-escape", 0), tools=SERVER),
    *note("stop strings are given per request (\"stop\")", ("-r --reverse-prompt", 1), tools=SERVER),
    *note("special tokens' text is never returned", ("-sp --special", 0), tools=SERVER),
    *note("slots sample their tokens after each step", ("-bs --backend-sampling", 0), tools=SERVER),

    *note("llamapy runs on the CPU: there is no GPU, device or tensor placement to choose",
          ("-ngl --gpu-layers --n-gpu-layers", 1), ("-dev --device", 1), ("--list-devices", 0),
          ("-sm --split-mode", 1), ("-ts --tensor-split", 1), ("-mg --main-gpu", 1),
          ("-ot --override-tensor", 1), ("-cmoe --cpu-moe", 0), ("-ncmoe --n-cpu-moe", 1), ("-ncffn --n-cpu-ffn", 1),
          ("-kvo --kv-offload -nkvo --no-kv-offload", 0), ("--op-offload --no-op-offload", 0), ("--no-host", 0),
          ("--repack -nr --no-repack", 0), ("-fit --fit", 1), ("-fitt --fit-target", 1), ("-fitc --fit-ctx", 1)),
    *note("thread placement, priority and polling are left to the operating system (llamapy's threads yield "
          "after a short spin)",
          ("-C --cpu-mask", 1), ("-Cr --cpu-range", 1), ("--cpu-strict", 1), ("--prio", 1), ("--poll", 1),
          ("-Cb --cpu-mask-batch", 1), ("-Crb --cpu-range-batch", 1), ("--cpu-strict-batch", 1),
          ("--prio-batch", 1), ("--poll-batch", 1), ("--numa", 1)),
    *note("llamapy uses the -t threads for prompts and batches too", ("-tb --threads-batch", 1)),
    *note("the model file is always memory-mapped and read in place", ("-lm --load-mode", 1),
          ("-lzm --lazy-mode", 1)),
    *note("tensor shapes and types are always checked when a model loads; values are not scanned",
          ("--check-tensors", 0)),
    *note("the KV cache needs no defragmentation here", ("-dt --defrag-thold", 1)),
    *note("the cache of a sliding-window layer holds its window", ("--swa-full", 0)),
    *note("timings are always printed", ("--perf --no-perf", 0)),
    *note("log lines are plain text", ("--log-colors", 1), ("--log-prefix --no-log-prefix", 0),
          ("--log-timestamps --no-log-timestamps", 0), ("--log-jsonl --no-log-jsonl", 0)),
    *note("llamapy never downloads anything", ("--offline", 0)),
    *refuse("llamapy does not download models: give a local GGUF file with -m",
            ("-mu --model-url", 1), ("-dr --docker-repo", 1), ("-hf -hfr --hf-repo", 1), ("-hff --hf-file", 1),
            ("-hft --hf-token", 1), ("-cl --cache-list", 0)),
    *refuse("there is no shell completion script", ("--completion-bash", 0)),
    *refuse("remote (RPC) backends are not supported", ("--rpc", 1)),
    *refuse("RoPE overrides are not supported: the model's own RoPE parameters are used",
            ("--rope-scaling", 1), ("--rope-scale", 1), ("--rope-freq-base", 1), ("--rope-freq-scale", 1),
            ("--yarn-orig-ctx", 1), ("--yarn-ext-factor", 1), ("--yarn-attn-factor", 1), ("--yarn-beta-slow", 1),
            ("--yarn-beta-fast", 1)),
    *refuse("metadata overrides are not supported", ("--override-kv", 1)),
    *refuse("control vectors are not supported", ("--control-vector", 1), ("--control-vector-scaled", 1),
            ("--control-vector-layer-range", 2)),
    *refuse("binary prompt files are not supported", ("-bf --binary-file", 1)),
    *refuse("speculative decoding is not supported", ("--spec-draft-type-k -ctkd --cache-type-k-draft", 1),
            ("--spec-draft-type-v -ctvd --cache-type-v-draft", 1)),
    # sampling: the generating tools honour what llamapy's sampler chain has and refuse the rest
    *refuse("this sampler is not in llamapy's chain (penalties, top-k, typical, top-p, min-p, temperature, "
            "dynamic temperature, logit bias)", ("--samplers", 1), ("--sampler-seq --sampling-seq", 1),
            ("--top-nsigma --top-n-sigma", 1), ("--xtc-probability", 1), ("--xtc-threshold", 1),
            ("--dry-multiplier", 1), ("--dry-base", 1), ("--dry-allowed-length", 1), ("--dry-penalty-last-n", 1),
            ("--dry-sequence-breaker", 1), ("--adaptive-target", 1), ("--adaptive-decay", 1), ("--mirostat", 1),
            ("--mirostat-lr", 1), ("--mirostat-ent", 1), sampling=True),
    *refuse("llamapy-server takes grammars and JSON schemas per request (\"grammar\", \"json_schema\", "
            "\"response_format\")", ("--grammar", 1), ("--grammar-file", 1), ("-j --json-schema", 1),
            ("-jf --json-schema-file", 1), sampling=True),
    *refuse("", ("-s --seed", 1), ("--ignore-eos", 0), ("--temp --temperature", 1), ("--top-k", 1), ("--top-p", 1),
            ("--min-p", 1), ("--typical --typical-p", 1), ("--repeat-last-n", 1), ("--repeat-penalty", 1),
            ("--presence-penalty", 1), ("--frequency-penalty", 1), ("--dynatemp-range", 1), ("--dynatemp-exp", 1),
            ("-l --logit-bias", 1), ("-bs --backend-sampling", 0), sampling=True),
    # what only generation uses, in the tools that do not generate
    *note("this tool does not generate text", ("-n --predict --n-predict", 1), ("--keep", 1),
          ("--context-shift --no-context-shift", 0), ("-np --parallel", 1),
          tools=("perplexity", "finetune", "export-lora")),
    *note("this tool does not read a prompt", ("-p --prompt", 1), ("-e --escape --no-escape", 0),
          tools=("finetune", "export-lora")),
    *note("export-lora does not run the model", ("-c --ctx-size", 1), ("-b --batch-size", 1), ("-ub --ubatch-size", 1),
          ("-fa --flash-attn", 1), ("-ctk --cache-type-k", 1), ("-ctv --cache-type-v", 1), ("-f --file", 1),
          tools=("export-lora",)),
    *note("training has no KV cache: attention is computed whole for each window", ("-fa --flash-attn", 1),
          ("-ctk --cache-type-k", 1), ("-ctv --cache-type-v", 1), tools=("finetune",)),
    *refuse("an existing adapter does not train further here: resume its run with --checkpoint-in, or merge it "
            "first with llamapy-export-lora", ("--lora", 1), ("--lora-scaled", 1), tools=("finetune",)),
    *refuse("llamapy-train makes a new model: give the model whose tokenizer it takes with --vocab-model "
            "(llamapy-finetune trains an existing one)", ("-m --model", 1), tools=("finetune",)),
    # perplexity
    *note("the KV cache is llama-perplexity's: one stream per chunk for perplexity, one shared by the sequences of the "
          "task scores", ("-kvu --kv-unified -no-kvu --no-kv-unified", 0), tools=("perplexity",)),
    *note("llamapy warms up by itself where it helps", ("--warmup --no-warmup", 0),
          tools=("perplexity", "completion", "cli", "server")),
    *refuse("not in llamapy-perplexity: it computes perplexity over whole chunks (no strided runs, no per-token "
            "output)", ("--ppl-stride", 1), ("--ppl-output-type", 1), tools=("perplexity",)),
    # generation and chat
    *note("llamapy stops generating when the context is full (no context shift)", ("--keep", 1),
          ("--context-shift --no-context-shift", 0), tools=GENERATING),
    *note("one sequence is generated", ("-np --parallel", 1), tools=("completion", "cli")),
    *note("output is plain text", ("-co --color", 1), ("--simple-io", 0), tools=("completion", "cli")),
    *note("the token count is printed at the end", ("-ptc --print-token-count", 1), tools=("completion", "cli")),
    *note("a line ending in \\ continues on the next", ("-mli --multiline-input", 0), tools=("completion", "cli")),
    *note("chat templates always run in jinja2's sandbox", ("--jinja --no-jinja", 0), tools=CHAT),
    *note("the answer is printed as the model writes it", ("--skip-chat-parsing --no-skip-chat-parsing", 0),
          tools=CHAT),
    *note("timings are printed at the end", ("--show-timings --no-show-timings", 0), tools=("completion", "cli")),
    *note("the conversation stays in the KV cache; nothing is kept in RAM besides",
          ("-ctxcp --ctx-checkpoints --swa-checkpoints", 1), ("-cram --cache-ram", 1), tools=CHAT),
    *refuse("prompt cache files are not supported (a conversation keeps its KV cache between turns)",
            ("--prompt-cache", 1), ("--prompt-cache-all", 0), ("--prompt-cache-ro", 0), tools=CHAT),
    *refuse("interactive completion is not supported: -cnv chats through the chat template",
            ("-i --interactive", 0), ("-if --interactive-first", 0), ("--in-prefix-bos", 0), ("--in-prefix", 1),
            ("--in-suffix", 1), tools=CHAT),
    *refuse("self-extend (grouped attention) is not supported", ("-gan --grp-attn-n", 1), ("-gaw --grp-attn-w", 1),
            tools=CHAT),
    *refuse("reasoning control is not supported", ("--reasoning-format", 1), ("-rea --reasoning", 1),
            ("--reasoning-effort", 1), ("--reasoning-budget", 1), ("--reasoning-budget-message", 1),
            ("--reasoning-preserve --no-reasoning-preserve", 0), tools=CHAT),
    *refuse("template variables are not supported", ("--chat-template-kwargs", 1), tools=CLI_OR_SERVER),
    *refuse("llamapy-cli writes the text to stdout (redirect it to a file)", ("-o --output --output-file", 1),
            tools=("cli",)),
    *refuse("prompt logging is not supported", ("--log-prompts-dir", 1), tools=CLI_OR_SERVER),
    *refuse("llamapy does not download models: give a local GGUF file with -m", ("--gpt-oss-20b-default", 0),
            ("--gpt-oss-120b-default", 0), ("--vision-gemma-4b-default", 0), ("--vision-gemma-12b-default", 0),
            ("--embd-gemma-default", 0), ("--fim-qwen-1.5b-default", 0), ("--fim-qwen-3b-default", 0),
            ("--fim-qwen-7b-default", 0), ("--fim-qwen-7b-spec", 0), ("--fim-qwen-14b-spec", 0),
            ("--fim-qwen-30b-default", 0), tools=CLI_OR_SERVER),
    *refuse("there is no llama-server to connect to", ("--server-base", 1), tools=("cli",)),
    *refuse("multimodal input is not supported", ("-mm --mmproj", 1), ("-mmu --mmproj-url", 1),
            ("--mmproj-auto --no-mmproj --no-mmproj-auto", 0), ("--mmproj-offload --no-mmproj-offload", 0),
            ("-mmdev --mmproj-device", 1), ("--image --audio --video", 1), ("--image-min-tokens", 1),
            ("--image-max-tokens", 1), ("--video-fps", 1), ("--video-timestamp-interval", 1),
            ("--video-ffmpeg-dir", 1), ("--mtmd-batch-max-tokens", 1), tools=CLI_OR_SERVER),
    *refuse("speculative decoding is not supported", ("--spec-default", 0),
            ("--spec-draft-hf -hfd -hfrd --hf-repo-draft", 1), ("--spec-draft-threads -td --threads-draft", 1),
            ("--spec-draft-threads-batch -tbd --threads-batch-draft", 1), ("--spec-draft-cpu-mask -Cd --cpu-mask-draft", 1),
            ("--spec-draft-cpu-range -Crd --cpu-range-draft", 1), ("--spec-draft-cpu-strict --cpu-strict-draft", 1),
            ("--spec-draft-prio --prio-draft", 1), ("--spec-draft-poll --poll-draft", 1),
            ("--spec-draft-cpu-mask-batch -Cbd --cpu-mask-batch-draft", 1),
            ("--spec-draft-cpu-strict-batch --cpu-strict-batch-draft", 1),
            ("--spec-draft-prio-batch --prio-batch-draft", 1), ("--spec-draft-poll-batch --poll-batch-draft", 1),
            ("--spec-draft-override-tensor -otd --override-tensor-draft", 1),
            ("--spec-draft-cpu-moe -cmoed --cpu-moe-draft", 0),
            ("--spec-draft-n-cpu-moe --spec-draft-ncmoe -ncmoed --n-cpu-moe-draft", 1),
            ("--spec-draft-n-max", 1), ("--spec-draft-n-min", 1), ("--spec-synth-len", 1), ("--spec-synth-rates", 1),
            ("--spec-draft-p-split --draft-p-split", 1), ("--spec-draft-p-min --draft-p-min", 1),
            ("--spec-draft-backend-sampling --no-spec-draft-backend-sampling", 0),
            ("--spec-draft-device -devd --device-draft", 1),
            ("--spec-draft-ngl -ngld --gpu-layers-draft --n-gpu-layers-draft", 1),
            ("--spec-draft-model -md --model-draft", 1), ("--spec-type", 1), ("--spec-ngram-mod-n-min", 1),
            ("--spec-ngram-mod-n-max", 1), ("--spec-ngram-mod-n-match", 1), ("--spec-ngram-simple-size-n", 1),
            ("--spec-ngram-simple-size-m", 1), ("--spec-ngram-simple-min-hits", 1), ("--spec-ngram-map-k-size-n", 1),
            ("--spec-ngram-map-k-size-m", 1), ("--spec-ngram-map-k-min-hits", 1),
            ("--spec-ngram-map-k4v-size-n", 1), ("--spec-ngram-map-k4v-size-m", 1),
            ("--spec-ngram-map-k4v-min-hits", 1), ("--draft --draft-n --draft-max", 1),
            ("--draft-min --draft-n-min", 1), ("--spec-ngram-size-n", 1), ("--spec-ngram-size-m", 1),
            ("--spec-ngram-min-hits", 1), ("-lcs --lookup-cache-static", 1), ("-lcd --lookup-cache-dynamic", 1),
            tools=CLI_OR_SERVER),
]


def llama_cpp_flags(tools: Iterable[str], declared: Iterable[str]) -> dict[str, LlamaCppFlag]:
    """Name -> flag for llama.cpp's flags of `tools` (names in ALL) that are not `declared`.
    A sampling flag is only noted in a tool that does not sample."""
    tools, declared = set(tools), set(declared)
    generates = bool(tools & set(GENERATING))
    out: dict[str, LlamaCppFlag] = {}
    for entry in ENTRIES:
        if not tools & set(entry.tools) or not set(entry.names) - declared:
            continue
        refused, why = entry.refuse, entry.why
        if entry.sampling and not generates:
            refused, why = False, "this tool does not sample tokens"
        elif entry.sampling and not why and not all(name in out for name in set(entry.names) - declared):
            raise AssertionError(f"{entry.names[0]}: a sampling flag the generating tools must declare")
        flag = LlamaCppFlag(entry.names, entry.n_values, refused, why)
        for name in entry.names:
            if name not in declared:
                out.setdefault(name, flag)
    return out
