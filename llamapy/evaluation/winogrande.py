"""Winogrande as llama-perplexity's --winogrande scores it.

The file: CSV lines `index,sentence,choice 1,choice 2,answer` (the sentence may be quoted;
its `_` marks the blank), the right choice's number (1 or 2) last. Like llama-perplexity, a
line that does not parse is skipped with a warning, and the last line is read only when the
file ends in a blank line (std::getline reaching the end without a newline stops there).
All tasks are scored in file order, or --winogrande-tasks N of them drawn at random.

Each choice fills the blank; its score is the mean log-probability (float32 sums) of the
tokens after the choice word when both sentences go on for more than 3 tokens past their
shared prefix, else of those after the shared prefix -- with llama-perplexity's own
row offsets for the second sentence (its FIXME: the first scored token of the second choice
then reads a row of the first), so that the scores are its own. The line per task: its
number, the running accuracy, both scores, the choice made and the right one; after 100
tasks or more, a final score with its standard error.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import InputError
from .batching import PreparedTask, ScoredRows, TaskFormat, common_prefix
from .ctext import c_float, file_text, leading_int, no_tasks, size_t
from .records import WinograndeTask
from .selection import scaled_sample

MAX_TASKS_PER_BATCH = 128
MIN_TRAILING_TOKENS = 3  # llama-perplexity's k_min_trailing_ctx
MIN_TASKS_FOR_FINAL = 100


def parse_line(line: str) -> WinograndeTask | str:
    """One CSV line's task, or why it is skipped (llama-perplexity's reading: the first four
    commas outside double quotes cut the fields; quotes around the sentence are dropped)."""
    commas = []
    quoted = False
    for i, ch in enumerate(line):
        if quoted:
            quoted = ch != '"'
        elif ch == ",":
            commas.append(i)
            if len(commas) == 4:
                break
        elif ch == '"':
            quoted = True
    if len(commas) != 4:
        return f"failed to find comma separators in <{line}>"
    c0, c1, c2, c3 = commas
    if line[c0 + 1] == '"':
        n = c1 - c0 - 3
        sentence = line[c0 + 2:] if n < 0 else line[c0 + 2:c0 + 2 + n]
    else:
        sentence = line[c0 + 1:c1]
    where = sentence.find("_")
    if where < 0:
        return f"no _ in <{sentence}>"
    answer = leading_int(line[c3 + 1:])
    if answer is None or not 1 <= answer <= 2:
        return f"failed to parse answer <{line[c3 + 1:]}>"
    return WinograndeTask(first=sentence[:where], second=sentence[where + 1:],
                          choices=(line[c1 + 1:c2], line[c2 + 1:c3]), answer=answer)


def parse(text: str, where: str, warn=None) -> list[WinograndeTask]:
    """The tasks of a Winogrande CSV text; `warn` hears of each line skipped (InputError
    when none is left)."""
    tasks, skipped = [], 0
    lines = text.split("\n")[:-1]  # the last piece: nothing, or a line std::getline ends on (module docstring)
    for number, text_line in enumerate(lines, 1):
        got = parse_line(text_line)
        if isinstance(got, str):
            skipped += 1
            if warn is not None:
                warn(f"{where}: line {number}: skipped: {got[:200]}")
        else:
            tasks.append(got)
    if not tasks:
        why = (f"none of its {len(lines)} lines is `index,sentence with _,choice 1,choice 2,1|2`" if lines
               else "the file is empty or has one line: the last line counts only when a newline follows it")
        raise no_tasks(where, "Winogrande", why)
    return tasks


def from_file(data: bytes, where: str, n_tasks: int, warn=None) -> tuple[list[tuple[int, WinograndeTask]], int]:
    """The tasks scored (from_list) and how many the file holds."""
    tasks = parse(file_text(data, where, warn), where, warn)
    return from_list(tasks, n_tasks), len(tasks)


def from_list(tasks: Sequence[WinograndeTask], n_tasks: int) -> list[tuple[int, WinograndeTask]]:
    return [(i, tasks[i]) for i in scaled_sample(len(tasks), n_tasks)]


def prepare(vocab, index: int, task: WinograndeTask) -> PreparedTask:
    """Both sentences' tokens (each choice in the blank) and the rows scoring them (module
    docstring); every token after the shared prefix is an output."""
    tok = lambda text: vocab.tokenize_array(text, add_special=True)  # noqa: E731
    seqs = [tok(task.first + choice + task.second) for choice in task.choices]
    n_base = [len(tok(task.first + choice)) for choice in task.choices]
    cp = common_prefix(seqs)
    if cp == 0:
        raise InputError(f"task {index + 1}: its sentences share no first token (llama-perplexity needs the prefix "
                         f"they share: a model that adds BOS)")
    skip_choice = all(len(s) - cp > MIN_TRAILING_TOKENS for s in seqs)
    rows, tokens, counts = [], [], []
    for s, toks in enumerate(seqs):
        base = n_base[s] if skip_choice else cp
        if base < cp:
            raise InputError(f"task {index + 1}: choice {s + 1}'s sentence up to its choice tokenizes to fewer tokens "
                             f"than the sentences share")
        last = 1 if size_t(len(toks) - base) > 1 else 0
        li = base - cp if s == 0 else len(seqs[0]) - cp + base - cp
        j_range = range(base - 1, len(toks) - 1 - last)
        rows.extend(range(li, li + len(j_range)))
        tokens.extend(int(toks[j + 1]) for j in j_range)
        counts.append((len(j_range), size_t(len(toks) - base - last)))
    return PreparedTask(index, seqs, cp, True, np.array(rows, dtype=np.int64), np.array(tokens, dtype=np.int32),
                        None, (task.answer, counts))


def judge(task: PreparedTask, rows: ScoredRows) -> tuple[tuple[float, ...], int, bool]:
    """Both scores (float32 sums over llama-perplexity's rows, divided by its count), the
    choice (the first when it scores higher, else the second: `score_1st > score_2nd ? 1 :
    2`) and whether it is the answer."""
    answer, counts = task.data
    scores, at = [], 0
    with np.errstate(invalid="ignore", divide="ignore"):
        for n, divisor in counts:
            total = np.float32(0.0)
            for v in rows.logprobs[at:at + n]:
                total = np.float32(total + v)
            at += n
            scores.append(np.float32(total / np.float32(divisor)))
    chosen = 0 if scores[0] > scores[1] else 1
    return (float(scores[0]), float(scores[1])), chosen, chosen + 1 == answer


def line(number: int, n_correct: int, task: PreparedTask, scores, chosen: int) -> str:
    return (f"{number}\t{100.0 * n_correct / number:.4f}\t{c_float('10.6', scores[0])}  {c_float('10.6', scores[1])}  "
            f"{chosen + 1}  {task.data[0]}")


def final(n_done: int, n_correct: int, n_answers: int) -> list[str]:
    """The final score and its standard error in percent (float32, as llama-perplexity), from
    100 tasks on."""
    if n_done < MIN_TASKS_FOR_FINAL:
        return []
    p = np.float32(n_correct) / np.float32(n_done)
    var = np.float32(p * (np.float32(1) - p)) / np.float32(n_done - 1)
    sigma = np.float32(100.0 * float(np.sqrt(np.float64(var))))
    return [f"Final Winogrande score({n_done} tasks): {c_float('.4', float(np.float32(100) * p))} +/- "
            f"{c_float('.4', float(sigma))}"]


FORMAT = TaskFormat("winogrande", WinograndeTask, 2 * MAX_TASKS_PER_BATCH, 2, 0, "", from_file, from_list, prepare,
                    judge, line, final)
