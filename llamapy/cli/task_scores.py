"""llamapy-perplexity's --hellaswag, --winogrande and --multiple-choice: what llama-perplexity
prints around llamapy.evaluation's scores, on the same streams (its LOG lines on stdout,
its LOG_INF lines on stderr)."""
from __future__ import annotations

import sys

from llamapy.evaluation import TaskScore, TaskSet, evaluate_with_context
from llamapy.evaluation.hellaswag import HEADER as HELLASWAG_HEADER
from llamapy.evaluation.multiple_choice import HEADER as MC_HEADER

from .common import log

PREPARE_IN_THREADS = 500  # above this many tasks llama-perplexity prints "..." instead of dots


def _out(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _dots(n: int) -> str:
    """One dot per n / 100 tasks, as llama-perplexity shows its reading progress."""
    return "." * (n // max(n // 100, 1))


def announce(task_set: TaskSet) -> None:
    """The lines llama-perplexity prints after reading the tasks, before scoring them."""
    n, n_all = len(task_set.tasks), task_set.n_available
    if task_set.kind == "hellaswag":
        log(f"hellaswag_score : loaded {n_all} tasks from prompt.")
        log(f"hellaswag_score : selecting {n} randomized tasks.")
        log("hellaswag_score : calculating hellaswag score over selected tasks.")
        _out(HELLASWAG_HEADER)
    elif task_set.kind == "winogrande":
        log(f"winogrande_score : loaded {n_all} tasks from prompt.")
        if n < n_all:
            log(f"winogrande_score : selecting {n} random tasks")
        log("winogrande_score : tokenizing selected tasks")
        log("winogrande_score : calculating winogrande score over selected tasks.")
    else:
        log(f"multiple_choice_score: there are {n_all} tasks in prompt")
        if n == n_all:
            log("multiple_choice_score: reading tasks")
            _out(_dots(n_all) + "done\n")
        else:
            log(f"multiple_choice_score: selecting {n} random tasks from {n_all} tasks available")
        log("multiple_choice_score: preparing task data")
        _out(("..." if n > PREPARE_IN_THREADS else _dots(n)) + "done\n")
        log(f"multiple_choice_score : calculating TruthfulQA score over {n} tasks.")
        _out(MC_HEADER)


def score(ctx, task_set: TaskSet) -> None:
    """Score the tasks with `ctx`: llama-perplexity's opening lines once they are known to fit,
    each task's line as it comes, then the closing lines."""
    def on_task(task: TaskScore) -> None:
        _out(task.line + "\n")

    result = evaluate_with_context(ctx, task_set, on_task=on_task, on_start=lambda: announce(task_set))
    _out("\n")
    for line in result.final_lines:
        log(line)
    _out("\n")
