"""llamapy-perplexity: llama.cpp's perplexity tool (same method, flags, defaults and output), its
KL divergence of a model from a base model (--kl-divergence-base, --kl-divergence), and its
task scores (--hellaswag, --winogrande, --multiple-choice: llamapy.evaluation)."""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Optional

from llamapy.errors import InputError
from llamapy.evaluation import TaskSet, evaluation_context, load_tasks
from llamapy.kl_divergence import KLDivergenceResult, kl_divergence
from llamapy.kld_base import BaseLogProbs
from llamapy.model import Model, load_model
from llamapy.perplexity import perplexity
from llamapy.samples import unescape

from . import flags as F
from .args import PERPLEXITY, Tool, flag
from .common import (adapter_list, freeze_startup_objects, kv_cache_types, load_adapters, log, paths, read_text,
                     thread_count, warn)
from .kld_report import TABLE_HEADER, chunk_line, statistics
from . import task_scores

tool = Tool("llamapy-perplexity", llama_cpp=["perplexity"])

Text = Annotated[Optional[Path], flag("-f", "--file", metavar="FNAME", group=PERPLEXITY, show_default=False,
                                      path="read",
                                      help="text to score")]
TextArg = Annotated[Optional[str], flag("-p", "--prompt", metavar="TEXT", group=PERPLEXITY, show_default=False,
                                        help="text to score, given on the command line")]
Chunks = Annotated[int, flag("--chunks", metavar="N", group=PERPLEXITY, min=-1, help="score only the first N chunks (-1: all)")]


KlDivergence = Annotated[bool, flag("--kl-divergence", group=PERPLEXITY, show_default=False,
                                    help="compare MODEL with the base model whose log-probabilities "
                                         "--kl-divergence-base FNAME holds (the text is the file's: no -f): KL "
                                         "divergence, both PPLs, top-token agreement, Δp")]
KlDivergenceBase = Annotated[Optional[Path], flag("--kl-divergence-base", "--save-all-logits", metavar="FNAME",
                                                  group=PERPLEXITY, show_default=False,
                                                  help="alone: also save the log-probabilities of every scored "
                                                       "token there (llama-perplexity's format); with "
                                                       "--kl-divergence: the base model's, to compare with")]

BinaryFile = Annotated[Optional[Path], flag("-bf", "--binary-file", metavar="FNAME", group=PERPLEXITY,
                                            show_default=False, path="read",
                                            help="as -f, byte for byte (the multiple-choice tasks' binary file)")]
Hellaswag = Annotated[bool, flag("--hellaswag", group=PERPLEXITY, show_default=False,
                                 help="compute the HellaSwag score (acc_norm) over random tasks from the file given "
                                      "with -f (6 lines a task)")]
HellaswagTasks = Annotated[int, flag("--hellaswag-tasks", metavar="N", group=PERPLEXITY, min=0,
                                     help="number of tasks to use when computing the HellaSwag score")]
Winogrande = Annotated[bool, flag("--winogrande", group=PERPLEXITY, show_default=False,
                                  help="compute the Winogrande score over the tasks of the CSV file given with -f")]
WinograndeTasks = Annotated[int, flag("--winogrande-tasks", metavar="N", group=PERPLEXITY, min=0,
                                      help="number of random tasks to use when computing the Winogrande score "
                                           "(0: all)")]
MultipleChoice = Annotated[bool, flag("--multiple-choice", group=PERPLEXITY, show_default=False,
                                      help="compute the multiple-choice score (ARC, MMLU, TruthfulQA) over the tasks "
                                           "of the binary file given with -bf (or -f)")]
MultipleChoiceTasks = Annotated[int, flag("--multiple-choice-tasks", metavar="N", group=PERPLEXITY, min=0,
                                          help="number of random tasks to use when computing the multiple-choice "
                                               "score (0: all)")]
Parallel = Annotated[int, flag("-np", "--parallel", metavar="N", env="LLAMA_ARG_N_PARALLEL", group=PERPLEXITY,
                               min=1, max=64,
                               help="sequences decoded together by the task scores (at least 4: a task's choices; "
                                    "each sequence gets -c tokens); perplexity takes -b / -c")]


@tool.command
def run(model: F.Model, file: Text = None, prompt: TextArg = None, escape: F.Escape = False,
        ctx_size: F.CtxSize = 512, batch_size: F.BatchSize = 2048, ubatch_size: F.UbatchSize = 512,
        chunks: Chunks = -1, threads: F.Threads = None, flash_attn: F.FlashAttn = "auto",
        cache_type_k: F.CacheTypeK = "f16", cache_type_v: F.CacheTypeV = "f16",
        lora: F.Lora = None, lora_scaled: F.LoraScaled = None, kl_divergence: KlDivergence = False,
        kl_divergence_base: KlDivergenceBase = None, binary_file: BinaryFile = None, hellaswag: Hellaswag = False,
        hellaswag_tasks: HellaswagTasks = 400, winogrande: Winogrande = False, winogrande_tasks: WinograndeTasks = 0,
        multiple_choice: MultipleChoice = False, multiple_choice_tasks: MultipleChoiceTasks = 0,
        parallel: Parallel = 1) -> None:
    """Perplexity of MODEL on a text, llama.cpp's way: the text is cut into chunks of -c tokens,
    each chunk scored on its second half from an empty KV cache. With --kl-divergence, MODEL
    against a base model over the chunks a --kl-divergence-base run saved. With --hellaswag,
    --winogrande or --multiple-choice, its score on the tasks of the file."""
    kinds = [k for k, on in (("hellaswag", hellaswag), ("winogrande", winogrande),
                             ("multiple-choice", multiple_choice)) if on]
    if kinds:
        n_tasks = {"hellaswag": hellaswag_tasks, "winogrande": winogrande_tasks,
                   "multiple-choice": multiple_choice_tasks}
        _tasks_run(kinds, n_tasks, file, binary_file, prompt, kl_divergence, model, ctx_size,
                   dict(n_parallel=parallel, n_batch=batch_size, n_ubatch=ubatch_size, n_threads=thread_count(threads),
                        flash_attn=flash_attn != "off"), flash_attn, cache_type_k, cache_type_v, lora, lora_scaled)
        return
    if binary_file is not None:
        if file is not None or prompt is not None:
            raise InputError("give the text to score with one of -f, -bf and -p")
        file = binary_file
    base = _base_to_compare(kl_divergence_base, ctx_size) if kl_divergence else None
    if base is None:
        if (file is None) == (prompt is None):
            raise InputError("give the text to score with -f FILE (or -p TEXT)")
        paths().write("--kl-divergence-base", kl_divergence_base)
    if flash_attn not in ("on", "off", "auto"):
        raise InputError(f"-fa must be on, off or auto, not {flash_attn!r}")
    type_k, type_v = kv_cache_types(cache_type_k, cache_type_v)
    adapter_list(lora, lora_scaled)  # a bad --lora-scaled is refused before the model is read
    t_load = time.perf_counter()
    m = load_model(model)
    freeze_startup_objects()
    log(f"model: {m.path.name}: {m.describe()} (loaded in {time.perf_counter() - t_load:.2f} s)")
    n_ctx = base.n_ctx if base is not None else ctx_size or m.hparams.n_ctx_train
    if n_ctx > m.hparams.n_ctx_train:
        warn(f"the model was trained on only {m.hparams.n_ctx_train} context tokens ({n_ctx} specified)")
    run_args = dict(n_batch=batch_size, n_ubatch=ubatch_size, n_chunks=chunks, n_threads=thread_count(threads),
                    on_pass=_eta(n_ctx), flash_attn=flash_attn != "off", adapters=load_adapters(m, lora, lora_scaled),
                    type_k=type_k, type_v=type_v)
    if base is not None:
        if file is not None or prompt is not None:
            log("note: -f/-p: no effect: the tokens come from the --kl-divergence-base file")
        _compare(m, base, run_args)
        return
    text = read_text(file) if file is not None else prompt
    if escape:
        text = unescape(text)
    t0 = time.perf_counter()
    tokens = m.vocab.tokenize_array(text, add_special=True)
    log(f"perplexity: tokenized {len(tokens)} tokens in {time.perf_counter() - t0:.2f} s")
    if kl_divergence_base is not None:
        log(f"perplexity: saving the log-probabilities of every scored token to {kl_divergence_base}")

    def on_chunk(i: int, n_chunk: int, ppl: float) -> None:
        sys.stdout.write(f"[{i}]{ppl:.4f},")
        sys.stdout.flush()

    start = time.perf_counter()
    result = perplexity(m, tokens, n_ctx, on_chunk=on_chunk, kl_divergence_base=kl_divergence_base, **run_args)
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    sys.stdout.flush()
    log(f"Final estimate: PPL = {result.ppl:.4f} +/- {result.ppl_error:.5f}")
    n_tok = result.n_chunks * n_ctx
    log(f"perplexity: {n_tok} tokens in {elapsed:.2f} s = {n_tok / elapsed:.1f} tokens/s")


def _tasks_run(kinds: list[str], n_tasks: dict[str, int], file: Path | None, binary_file: Path | None,
               prompt: str | None, kl_divergence: bool, model: Path, ctx_size: int, context_args: dict,
               flash_attn: str, cache_type_k: str, cache_type_v: str, lora, lora_scaled) -> None:
    """--hellaswag / --winogrande / --multiple-choice: the tasks are read (a bad file refused)
    before the model loads; then llama-perplexity's context, lines and score."""
    if len(kinds) > 1:
        raise InputError(f"give one of --hellaswag, --winogrande and --multiple-choice, not {' and '.join(kinds)}")
    kind = kinds[0]
    if kl_divergence:
        raise InputError(f"--{kind} and --kl-divergence are two different runs: give one")
    if sum(x is not None for x in (file, binary_file, prompt)) != 1:
        raise InputError(f"give the {kind} tasks with -f FNAME (or -bf FNAME, -p TEXT)")
    if ctx_size <= 0:
        raise InputError("the task scores need -c above 0 (the tokens of each sequence)")
    if flash_attn not in ("on", "off", "auto"):
        raise InputError(f"-fa must be on, off or auto, not {flash_attn!r}")
    type_k, type_v = kv_cache_types(cache_type_k, cache_type_v)
    adapter_list(lora, lora_scaled)
    source = prompt.encode("utf-8", errors="surrogateescape") if prompt is not None else (file or binary_file)
    task_set: TaskSet = load_tasks(source, kind, n_tasks[kind], on_warning=warn, binary_file=binary_file is not None)
    t_load = time.perf_counter()
    m = load_model(model)
    freeze_startup_objects()
    log(f"model: {m.path.name}: {m.describe()} (loaded in {time.perf_counter() - t_load:.2f} s)")
    n_ctx = max(4, context_args["n_parallel"]) * ctx_size
    if n_ctx > m.hparams.n_ctx_train:
        warn(f"the model was trained on only {m.hparams.n_ctx_train} context tokens ({n_ctx} specified)")
    ctx = evaluation_context(m, ctx_size, adapters=load_adapters(m, lora, lora_scaled), type_k=type_k, type_v=type_v,
                             **context_args)
    start = time.perf_counter()
    task_scores.score(ctx, task_set)
    log(f"{kind}: {len(task_set.tasks)} tasks in {time.perf_counter() - start:.2f} s")


def _base_to_compare(path: Path | None, ctx_size: int) -> BaseLogProbs:
    """--kl-divergence's base file, checked before the model loads (InputError: none given, or
    a bad file, or one computed with a larger context than -c)."""
    if path is None:
        raise InputError("--kl-divergence needs --kl-divergence-base FNAME: the base model's log-probabilities, "
                         "saved by a run of the base model with --kl-divergence-base FNAME alone")
    paths().read("--kl-divergence-base", path)
    base = BaseLogProbs.open(path)
    if ctx_size and base.n_ctx > ctx_size:
        raise InputError(f"{path} was computed with a context of {base.n_ctx}, while the context is {ctx_size}: "
                         f"give -c {base.n_ctx}")
    return base


def _compare(m: Model, base: BaseLogProbs, run_args: dict) -> None:
    """--kl-divergence: MODEL over the base file's chunks; llama-perplexity's table and statistics
    on stdout."""
    base.require_vocabulary(m.hparams.n_vocab)
    log(f"kl_divergence: {base.n_chunk} chunks of {base.n_ctx} tokens in {base.path}")
    print(TABLE_HEADER, flush=True)

    def on_chunk(i: int, n_chunk: int, result: KLDivergenceResult) -> None:
        print(chunk_line(i, result), flush=True)

    start = time.perf_counter()
    result = kl_divergence(m, base, on_chunk=on_chunk, **run_args)
    elapsed = time.perf_counter() - start
    print()
    print("\n".join(statistics(result)), flush=True)
    n_tok = result.n_chunks * base.n_ctx
    log(f"kl_divergence: {n_tok} tokens in {elapsed:.2f} s = {n_tok / elapsed:.1f} tokens/s")


def _eta(n_ctx: int) -> Callable[[int, int], None]:
    """on_pass for the ETA line: llama.cpp's comes from its first pass; here that pass also
    compiles kernels and builds graphs, so the estimate is the second pass's time."""
    passes: list[tuple[float, int]] = []

    def on_pass(n_done: int, n_chunk: int) -> None:
        passes.append((time.perf_counter(), n_done))
        if len(passes) == 2 and n_done < n_chunk:
            (t1, n1), (t2, n2) = passes
            per_chunk = (t2 - t1) / (n2 - n1)
            log(f"perplexity: calculating over {n_chunk} chunks, n_ctx={n_ctx}; {per_chunk:.3f} s per chunk "
                f"- ETA {per_chunk * (n_chunk - n_done) / 60:.2f} minutes")
    return on_pass


main = tool.main

if __name__ == "__main__":
    main()
