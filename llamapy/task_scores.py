"""Choice-task scores during training (`--eval-task`, `opt_fit(eval_tasks=)`): a HellaSwag,
Winogrande or multiple-choice file scored at every validation, as llama-perplexity scores
it (llamapy.evaluation), by a context beside the training one that applies the training
run's adapters and reads its weights as they are at that moment.

The tasks are read, tokenized and checked to fit before the first step, so a bad file or a
task too long for the context is an error before any training, not at the first validation.
"""
from __future__ import annotations

import os

from .errors import InputError
from .evaluation import FORMATS, EvaluationResult, TaskSet, evaluate_with_context, evaluation_context, load_tasks
from .evaluation.api import MIN_PARALLEL
from .evaluation.batching import check_fits

TASK_CONTEXT = 512  # tokens per sequence: llama-perplexity's default -c for its task scores


class TaskScores:
    """The scores of one task file (or TaskSet) for `model`, as {kind: percent correct,
    kind_unc: its standard error} (e.g. {"hellaswag": 31.5, "hellaswag_unc": 2.3}).
    `n_tasks` None: llama-perplexity's default count (400 HellaSwag tasks, all others)."""

    def __init__(self, model, tasks: str | os.PathLike | bytes | TaskSet, n_tasks: int | None = None,
                 n_ctx: int = TASK_CONTEXT, n_threads: int | None = None) -> None:
        self.tasks = tasks if isinstance(tasks, TaskSet) else load_tasks(tasks, n_tasks=n_tasks)
        self.kind = self.tasks.kind
        fmt = FORMATS[self.kind]
        prepared = [fmt.prepare(model.vocab, index, task) for index, task in self.tasks.tasks]
        if not prepared:
            raise InputError(f"the {self.kind} task file gives no task to score (a task count of 0?)")
        # enough sequence slots for the task with the most choices (llama-perplexity's -np)
        n_parallel = max(MIN_PARALLEL, max(task.n_seq for task in prepared))
        self.ctx = evaluation_context(model, n_ctx, n_parallel, n_threads=n_threads)
        self.last: EvaluationResult | None = None  # the last scoring's details (each task's choice scores)
        check_fits(prepared, self.ctx.n_ctx, min(fmt.max_seq, self.ctx.n_seq_max), lambda i: i + 1)

    def __call__(self, training_ctx) -> dict[str, float]:
        """The scores now, with `training_ctx`'s adapters (a LoRA being trained) applied."""
        self.ctx.detach_lora()
        for adapter, scale in training_ctx.adapters:
            self.ctx.attach_lora(adapter, scale)
        result = self.last = evaluate_with_context(self.ctx, self.tasks)
        return {self.kind: result.score, f"{self.kind}_unc": result.error}
