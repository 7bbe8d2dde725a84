"""`evaluate` and its parts: read a task file (or take a task list), make llama-perplexity's
context for it, score the tasks batch by batch and gather the result."""
from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..context import Context
from ..errors import InputError
from ..model import Model, load_model
from . import hellaswag, multiple_choice, winogrande
from .batching import TaskFormat, check_fits, score_in_batches
from .ctext import file_text, getline_lines, leading_int
from .records import KINDS, EvaluationResult, TaskScore

FORMATS: dict[str, TaskFormat] = {f.kind: f for f in (hellaswag.FORMAT, winogrande.FORMAT, multiple_choice.FORMAT)}
MIN_PARALLEL = 4  # llama-perplexity's n_parallel for the task scores: at least 4
KV_PAD = 256      # llama.cpp rounds a context up to this
Source = str | os.PathLike | bytes | Sequence


@dataclass(frozen=True)
class TaskSet:
    """The tasks a run scores, in scoring order, as (index in the file or list, task), and
    how many the file or list held."""
    kind: str
    tasks: list[tuple[int, object]]
    n_available: int


def load_tasks(source: Source, kind: str | None = None, n_tasks: int | None = None,
               on_warning: Callable[[str], None] | None = None, binary_file: bool = False) -> TaskSet:
    """The tasks of a file (path or its bytes) or of a list of task records
    (HellaSwagTask, WinograndeTask or MultipleChoiceTask), chosen as llama-perplexity chooses
    them: `n_tasks` None is its default (--hellaswag-tasks 400; all Winogrande and
    multiple-choice tasks), 0 its meaning of 0 (no HellaSwag task; all of the others).
    `kind` None: told from the records or the file's content. A file is read as
    llama-perplexity's -f reads it, without one trailing newline (which decides whether a
    Winogrande CSV's last line counts), or with `binary_file` byte for byte, as its -bf.
    InputError for a bad file."""
    warn = on_warning if on_warning is not None else (lambda message: warnings.warn(message, stacklevel=3))
    if isinstance(source, (str, os.PathLike, bytes)):
        data, where = _file_bytes(source)
        if not binary_file and data.endswith(b"\n"):
            data = data[:-1]
        fmt = FORMATS[_kind(kind) if kind is not None else detect_kind(data, where)]
        n = fmt.default_tasks if n_tasks is None else _count(n_tasks)
        chosen, n_available = fmt.from_file(data, where, n, warn)
        return TaskSet(fmt.kind, chosen, n_available)
    tasks = list(source)
    fmt = FORMATS[_kind(kind) if kind is not None else _kind_of_records(tasks)]
    bad = next((t for t in tasks if not isinstance(t, fmt.task_type)), None)
    if bad is not None:
        raise InputError(f"a {fmt.kind} task list holds a {type(bad).__name__}: give {fmt.task_type.__name__} records")
    n = fmt.default_tasks if n_tasks is None else _count(n_tasks)
    return TaskSet(fmt.kind, fmt.from_list(tasks, n), len(tasks))


def detect_kind(data: bytes, where: str = "the task file") -> str:
    """Which format a task file is in: llama-perplexity's binary multiple-choice file, a
    HellaSwag text (6 lines a task, the second an index 0-3) or a Winogrande CSV."""
    if _looks_binary(data):
        return "multiple-choice"
    try:
        text = file_text(data, where)
    except InputError:
        raise InputError(f"{where}: neither a multiple-choice binary file nor a text file") from None
    lines = getline_lines(text)
    if lines and len(lines) % hellaswag.LINES_PER_TASK == 0 and all(
            leading_int(lines[i]) in range(4) for i in range(1, len(lines), hellaswag.LINES_PER_TASK)):
        return "hellaswag"
    if any(not isinstance(winogrande.parse_line(line), str) for line in lines):
        return "winogrande"
    raise InputError(f"{where}: not a HellaSwag file (6 lines a task), a Winogrande CSV or a multiple-choice binary "
                     f"file: give the kind (--hellaswag, --winogrande, --multiple-choice)")


def evaluation_context(model: Model, n_ctx: int = 512, n_parallel: int = MIN_PARALLEL, n_batch: int = 2048,
                       n_ubatch: int = 512, n_threads: int | None = None, adapters=(), **context_args) -> Context:
    """llama-perplexity's context for the task scores: max(4, n_parallel) sequences sharing
    one KV cache of that many times n_ctx cells (rounded up to 256), decodes of at most
    n_batch tokens. `adapters`: (LoraAdapter, scale) pairs attached to it."""
    if n_ctx <= 0:
        raise InputError("the task scores need a context size (-c) above 0")
    n_seq = max(MIN_PARALLEL, n_parallel)
    total = n_seq * n_ctx
    ctx = Context(model, n_ctx=-(-total // KV_PAD) * KV_PAD, n_batch=min(n_batch, total), n_ubatch=n_ubatch,
                  n_seq_max=n_seq, n_threads=n_threads, kv_unified=True, **context_args)
    for adapter, scale in adapters:
        ctx.attach_lora(adapter, scale)
    return ctx


def evaluate_with_context(ctx: Context, tasks: Source | TaskSet, kind: str | None = None,
                          n_tasks: int | None = None, on_task: Callable[[TaskScore], None] | None = None,
                          on_warning: Callable[[str], None] | None = None,
                          on_start: Callable[[], None] | None = None) -> EvaluationResult:
    """Score `tasks` (a TaskSet from load_tasks, or what load_tasks takes) with `ctx`, its
    adapters included, as llama-perplexity would with that context: its KV cache must be
    unified (it is cleared for every batch) with room for a task's choices as sequences
    (evaluation_context makes one, e.g. beside a training context, with its adapters).
    `on_start` is called once the tasks are tokenized and known to fit (InputError before
    that, for a task too long for the context), `on_task` for each task as it is scored."""
    task_set = tasks if isinstance(tasks, TaskSet) else load_tasks(tasks, kind, n_tasks, on_warning)
    fmt = FORMATS[task_set.kind]
    max_seq = min(fmt.max_seq, ctx.n_seq_max)
    if not ctx.kv.unified or ctx.n_seq_max < fmt.min_seq:
        raise InputError(f"{fmt.kind} scores need a context with a unified KV cache and at least {fmt.min_seq} "
                         f"sequences (llamapy.evaluation.evaluation_context makes one)")
    vocab = ctx.model.vocab
    prepared = [fmt.prepare(vocab, index, task) for index, task in task_set.tasks]
    check_fits(prepared, ctx.n_ctx, max_seq, lambda i: i + 1)
    if on_start is not None:
        on_start()
    scores: list[TaskScore] = []
    n_correct = n_answers = 0
    for task, rows in score_in_batches(ctx, prepared, ctx.n_batch, max_seq):
        choice_scores, chosen, correct = fmt.judge(task, rows)
        n_correct += bool(correct)
        n_answers += task.n_seq
        number = len(scores) + 1
        score = TaskScore(number, task.index, choice_scores, chosen, bool(correct), n_correct,
                          fmt.line(number, n_correct, task, choice_scores, chosen))
        scores.append(score)
        if on_task is not None:
            on_task(score)
    n_done = len(scores)
    final = fmt.final(n_done, n_correct, n_answers) if n_done else []
    chance = 100.0 * n_done / n_answers if fmt.kind == "multiple-choice" and n_answers else None
    return EvaluationResult(fmt.kind, n_done, n_correct, scores, final, chance)


def evaluate(model: Model | str | os.PathLike, tasks: Source | TaskSet, kind: str | None = None,
             n_tasks: int | None = None, n_ctx: int = 512, n_parallel: int = MIN_PARALLEL, n_batch: int = 2048,
             n_ubatch: int = 512, n_threads: int | None = None, adapters=(),
             on_task: Callable[[TaskScore], None] | None = None, on_warning: Callable[[str], None] | None = None,
             **context_args) -> EvaluationResult:
    """llama-perplexity's HellaSwag, Winogrande or multiple-choice score of `model` on
    `tasks` (a task file's path or bytes, a list of task records, or a TaskSet), with its
    defaults: -c 512 per sequence, 4 sequences, -b 2048; `n_tasks` None is its default task
    count (400 HellaSwag tasks, all of the others). The tasks are read (and a bad file
    refused) before the model is loaded."""
    task_set = tasks if isinstance(tasks, TaskSet) else load_tasks(tasks, kind, n_tasks, on_warning)
    if not isinstance(model, Model):
        model = load_model(model)
    ctx = evaluation_context(model, n_ctx, n_parallel, n_batch, n_ubatch, n_threads, adapters, **context_args)
    return evaluate_with_context(ctx, task_set, on_task=on_task)


def _file_bytes(source: str | os.PathLike | bytes) -> tuple[bytes, str]:
    if isinstance(source, bytes):
        return source, "the task data"
    path = Path(source)
    if not path.is_file():
        raise InputError(f"task file not found: {path}")
    try:
        return path.read_bytes(), str(path)
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}") from None


def _kind(kind: str) -> str:
    if kind not in KINDS:
        raise InputError(f"kind must be one of {', '.join(KINDS)} (or None: told from the tasks), not {kind!r}")
    return kind


def _kind_of_records(tasks: list) -> str:
    for fmt in FORMATS.values():
        if tasks and isinstance(tasks[0], fmt.task_type):
            return fmt.kind
    raise InputError("give the tasks as a file, or as a non-empty list of HellaSwagTask, WinograndeTask or "
                     "MultipleChoiceTask records")


def _count(n_tasks: int) -> int:
    if not isinstance(n_tasks, int) or n_tasks < 0:
        raise InputError(f"n_tasks must be a count of tasks (0 or more), not {n_tasks!r}")
    return n_tasks


def _looks_binary(data: bytes) -> bool:
    """llama-perplexity's multiple-choice file: a task count, offsets past the offset table,
    in order and inside the file."""
    n = _u32_count(data)
    table_end = 4 + 4 * n
    if n == 0 or table_end > len(data):
        return False
    offsets = np.frombuffer(data, dtype="<u4", count=n, offset=4)
    return bool(offsets[0] == table_end and np.all(offsets[1:] >= offsets[:-1]) and offsets[-1] < len(data))


def _u32_count(data: bytes) -> int:
    return int.from_bytes(data[:4], "little") if len(data) >= 4 else 0

