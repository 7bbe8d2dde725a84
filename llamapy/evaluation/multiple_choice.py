"""Multiple-choice tasks (ARC, MMLU, TruthfulQA, HellaSwag) as llama-perplexity's
--multiple-choice scores them, from its binary file.

The file (little-endian): uint32 n_tasks, uint32 offsets[n_tasks] (each task's byte offset
from the file's start), then the tasks, each: a string (the question), then two answer
sets (mc1: a single correct answer, scored; mc2: several, read and ignored), each a uint32
count (at most 100), that many strings and that many int32 labels (1: correct). A string is
a uint32 byte count and UTF-8 bytes.

All tasks are read in sequence after the offsets, or --multiple-choice-tasks N of them are
drawn at random (selection.py) and read at their offsets. Each answer is scored as the mean
log-probability of question + " " + answer's tokens after what all answers share (float32
sums), the first from the shared prefix's last logits; a task is right when the best
answer's label is 1. The line per task: its number and the running accuracy; then the
final score and the random-chance score (tasks / answers), each with its standard error.
"""
from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

from ..errors import InputError
from .batching import PreparedTask, ScoredRows, TaskFormat
from .ctext import c_float, no_tasks
from .hellaswag import best, choice_layout
from .records import MultipleChoiceTask
from .selection import scaled_sample

MAX_TASKS_PER_BATCH = 32
MAX_ANSWERS = 100
HEADER = "\ntask\tacc_norm\n"


class _Reader:
    """Reads the binary format's fields from `data` at `at`; None when the data ends first."""

    def __init__(self, data: bytes, at: int) -> None:
        self.data, self.at = data, at

    def u32s(self, n: int) -> tuple[int, ...] | None:
        end = self.at + 4 * n
        if end > len(self.data):
            return None
        values = struct.unpack_from(f"<{n}I", self.data, self.at)
        self.at = end
        return values

    def string(self) -> bytes | None:
        size = self.u32s(1)
        if size is None or self.at + size[0] > len(self.data):
            return None
        text = self.data[self.at:self.at + size[0]]
        self.at += size[0]
        return text

    def answers(self) -> tuple[list[bytes], tuple[int, ...]] | None:
        n = self.u32s(1)
        if n is None or n[0] > MAX_ANSWERS:
            return None
        answers = [self.string() for _ in range(n[0])]
        if any(a is None for a in answers):
            return None
        labels = self.u32s(n[0])
        if labels is None:
            return None
        return answers, tuple(struct.unpack(f"<{n[0]}i", struct.pack(f"<{n[0]}I", *labels)))


def _task(data: bytes, at: int, where: str, what: str) -> tuple[MultipleChoiceTask, int]:
    """The task stored at byte `at` and where it ends (InputError naming it as `what` when it
    is cut short or not text)."""
    reader = _Reader(data, at)
    question = reader.string()
    mc1 = reader.answers() if question is not None else None
    mc2 = reader.answers() if mc1 is not None else None
    if mc2 is None:
        raise InputError(f"{where}: failed to read {what}: the file ends inside it, or an answer set has more than "
                         f"{MAX_ANSWERS} answers")
    try:
        texts = [question.decode("utf-8"), *(a.decode("utf-8") for a in mc1[0])]
    except UnicodeDecodeError as e:
        raise InputError(f"{where}: {what}: a string is not UTF-8 ({e.reason} at byte {e.start})") from None
    if not texts[0] or len(texts) == 1:
        raise InputError(f"{where}: {what}: found bad task with empty question and/or answers")
    if not all(texts[1:]):
        raise InputError(f"{where}: {what}: found empty answer")
    return MultipleChoiceTask(question=texts[0], answers=tuple(texts[1:]), labels=mc1[1]), reader.at


def from_file(data: bytes, where: str, n_tasks: int, warn=None) -> tuple[list[tuple[int, MultipleChoiceTask]], int]:
    """The tasks scored, in order, read as llama-perplexity reads them (module docstring), and
    how many the file holds."""
    header = _Reader(data, 0)
    count = header.u32s(1)
    if count is None or count[0] == 0:
        raise no_tasks(where, "multiple-choice", "no task count: not llama-perplexity's binary file?")
    n_task = count[0]
    offsets = header.u32s(n_task)
    if offsets is None:
        raise InputError(f"{where}: failed to read the offsets of its {n_task} tasks: the file ends first "
                         f"(not llama-perplexity's binary multiple-choice file?)")
    if not 0 < n_tasks < n_task:
        tasks, at = [], header.at
        for i in range(n_task):
            task, at = _task(data, at, where, f"task {i + 1} of {n_task}")
            tasks.append((i, task))
        return tasks, n_task
    return [(i, _task(data, offsets[i], where, f"task {i + 1} (at byte {offsets[i]})")[0])
            for i in scaled_sample(n_task, n_tasks)], n_task


def from_list(tasks: Sequence[MultipleChoiceTask], n_tasks: int) -> list[tuple[int, MultipleChoiceTask]]:
    return [(i, tasks[i]) for i in scaled_sample(len(tasks), n_tasks)]


def to_bytes(tasks: Sequence[MultipleChoiceTask]) -> bytes:
    """The binary file of `tasks` (mc2 empty): what from_file reads, and llama-perplexity."""
    def string(text: str) -> bytes:
        raw = text.encode("utf-8")
        return struct.pack("<I", len(raw)) + raw

    bodies = []
    for task in tasks:
        mc1 = (struct.pack("<I", len(task.answers)) + b"".join(string(a) for a in task.answers)
               + struct.pack(f"<{len(task.labels)}i", *task.labels))
        bodies.append(string(task.question) + mc1 + struct.pack("<I", 0))
    offsets, at = [], 4 + 4 * len(tasks)
    for body in bodies:
        offsets.append(at)
        at += len(body)
    return struct.pack(f"<{1 + len(tasks)}I", len(tasks), *offsets) + b"".join(bodies)


def prepare(vocab, index: int, task: MultipleChoiceTask) -> PreparedTask:
    """question + " " + answer for each answer, laid out as HellaSwag's endings."""
    seqs = [vocab.tokenize_array(task.question + " " + answer, add_special=True) for answer in task.answers]
    return choice_layout(index, seqs, task.labels)


def judge(task: PreparedTask, rows: ScoredRows) -> tuple[tuple[float, ...], int, bool]:
    """Each answer's mean log-probability (float32 sums), the best and whether its label is 1."""
    scores, at = [], 0
    for s, toks in enumerate(task.seqs):
        n = len(toks) - task.common_prefix - 1
        total = rows.first_logprobs[s]
        for v in rows.logprobs[at:at + n]:
            total = np.float32(total + v)
        at += n
        scores.append(np.float32(total / np.float32(n + 1)))
    chosen = best(scores)
    return tuple(float(s) for s in scores), chosen, task.data[chosen] == 1


def line(number: int, n_correct: int, task: PreparedTask, scores, chosen: int) -> str:
    return f"{number}\t{100.0 * n_correct / number:.8f}"


def _with_error(n: int, p: np.float32) -> tuple[str, str]:
    """100 p and 100 sqrt(p (1 - p) / (n - 1)), in float32 as llama-perplexity prints them."""
    with np.errstate(invalid="ignore", divide="ignore"):
        var = np.float32(p * (np.float32(1) - p)) / np.float32(n - 1)
        sigma = np.float32(np.sqrt(np.float64(var)))
    return c_float(".4", float(np.float32(100) * p)), c_float(".4", float(np.float32(100) * sigma))


def final(n_done: int, n_correct: int, n_answers: int) -> list[str]:
    """The score and the random-chance score, each with its standard error."""
    score, score_err = _with_error(n_done, np.float32(n_correct) / np.float32(n_done))
    chance, chance_err = _with_error(n_done, np.float32(n_done) / np.float32(n_answers))
    return [f"Final result: {score} +/- {score_err}", f"Random chance: {chance} +/- {chance_err}"]


FORMAT = TaskFormat("multiple-choice", MultipleChoiceTask, 4 * MAX_TASKS_PER_BATCH, 1, 0, HEADER, from_file, from_list,
                    prepare, judge, line, final)
