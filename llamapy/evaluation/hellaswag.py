"""HellaSwag as llama-perplexity's --hellaswag scores it.

The file: 6 lines per task — the context (activity_label + ": " + ctx), the index of the
right ending (0-3), the four endings. Tasks are drawn in random order (selection.py; the
first --hellaswag-tasks draws, 400 by default). Each ending is scored as the mean
log-probability of its tokens after the prefix the four share, summed in a double; the task
counts as right when the best ending is the gold one. The line per task: its number, the
running acc_norm in percent and Wilson's 95% interval of it.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import InputError
from .batching import PreparedTask, ScoredRows, TaskFormat, common_prefix
from .ctext import file_text, getline_lines, leading_int, no_tasks
from .records import HellaSwagTask, wilson_interval
from .selection import hellaswag_order

LINES_PER_TASK = 6
N_ENDINGS = 4
MAX_TASKS_PER_BATCH = 32
DEFAULT_TASKS = 400  # llama-perplexity's --hellaswag-tasks
HEADER = "\ntask\tacc_norm\t95% confidence interval\n"


def parse(text: str, where: str) -> list[HellaSwagTask]:
    """Every task of a HellaSwag file's text (InputError naming the first bad line)."""
    lines = getline_lines(text)
    if not lines:
        raise no_tasks(where, "HellaSwag", "the file is empty")
    if len(lines) % LINES_PER_TASK:
        raise InputError(f"{where}: {len(lines)} lines, not a multiple of {LINES_PER_TASK}: a HellaSwag task is 6 "
                         f"lines (context, the right ending's index 0-3, four endings)")
    tasks = []
    for i in range(0, len(lines), LINES_PER_TASK):
        gold = leading_int(lines[i + 1])
        if gold is None or not 0 <= gold < N_ENDINGS:
            raise InputError(f"{where}: line {i + 2}: {lines[i + 1][:40]!r} is not the right ending's index (0-3)")
        tasks.append(HellaSwagTask(context=lines[i], endings=tuple(lines[i + 2:i + 6]), gold=gold))
    return tasks


def from_file(data: bytes, where: str, n_tasks: int, warn=None) -> tuple[list[tuple[int, HellaSwagTask]], int]:
    """The tasks scored (from_list) and how many the file holds."""
    tasks = parse(file_text(data, where, warn), where)
    return from_list(tasks, n_tasks), len(tasks)


def from_list(tasks: Sequence[HellaSwagTask], n_tasks: int) -> list[tuple[int, HellaSwagTask]]:
    """The tasks scored, in their random order (selection.hellaswag_order)."""
    return [(i, tasks[i]) for i in hellaswag_order(len(tasks), n_tasks)]


def prepare(vocab, index: int, task: HellaSwagTask) -> PreparedTask:
    """Tokens of context + " " + each ending; every token after the shared prefix is scored,
    the first from the prefix's last logits, the others from their own sequence's."""
    seqs = [vocab.tokenize_array(task.context + " " + ending, add_special=True) for ending in task.endings]
    return choice_layout(index, seqs, task.gold)


def choice_layout(index: int, seqs: list[np.ndarray], data) -> PreparedTask:
    """The layout HellaSwag and the multiple-choice tasks share: the prefix's last row scores
    each choice's first own token, row 1 on each of its later ones (a choice's last token
    is no output)."""
    cp = common_prefix(seqs)
    if cp == 0:
        raise InputError(f"task {index + 1}: its choices share no first token (llama-perplexity needs the prefix "
                         f"they share: a model that adds BOS, or a common context)")
    for s, toks in enumerate(seqs):
        if len(toks) == cp:
            raise InputError(f"task {index + 1}: choice {s + 1} adds no token to what all choices share")
    rows, tokens = [], []
    for toks in seqs:
        first = len(rows) + 1
        rows.extend(range(first, first + len(toks) - cp - 1))
        tokens.extend(toks[cp + 1:])
    return PreparedTask(index, seqs, cp, False, np.array(rows, dtype=np.int64), np.array(tokens, dtype=np.int32),
                        np.array([toks[cp] for toks in seqs], dtype=np.int32), data)


def judge(task: PreparedTask, rows: ScoredRows) -> tuple[tuple[float, ...], int, bool]:
    """Each ending's mean log-probability (a double sum, as llama-perplexity's), the best
    (the first of equals) and whether it is the gold one."""
    scores, at = [], 0
    for s, toks in enumerate(task.seqs):
        n = len(toks) - task.common_prefix - 1
        total = float(rows.first_logprobs[s])
        for v in rows.logprobs[at:at + n].tolist():
            total += v
        at += n
        scores.append(total / (n + 1))
    chosen = best(scores)
    return tuple(scores), chosen, chosen == task.data


def best(scores: Sequence) -> int:
    """The index of the largest score, the first of equals (a strict > scan)."""
    chosen = 0
    for s in range(1, len(scores)):
        if scores[s] > scores[chosen]:
            chosen = s
    return chosen


def line(number: int, n_correct: int, task: PreparedTask, scores, chosen: int) -> str:
    freq = n_correct / number
    low, high = wilson_interval(n_correct, number)
    return "%d\t%3.8f%%\t[%3.4f%%, %3.4f%%]" % (number, freq * 100.0, low * 100.0, high * 100.0)


def final(n_done: int, n_correct: int, n_answers: int) -> list[str]:
    """llama-perplexity prints no closing line for HellaSwag (the last task's line is the score)."""
    return []


FORMAT = TaskFormat("hellaswag", HellaSwagTask, 4 * MAX_TASKS_PER_BATCH, N_ENDINGS, DEFAULT_TASKS, HEADER,
                    from_file, from_list, prepare, judge, line, final)
