"""llama-perplexity's way of scoring choice tasks: many tasks per batch, each task's choices
as parallel sequences that share the KV cells of their common prefix.

A task's choices are token sequences (BOS, context, choice, ...) that begin with the same
`common_prefix` tokens. A batch holds consecutive tasks while their tokens fit the context
and their sequences the context's sequence slots (`max_seq`): each task's prefix once, seen
by all its sequences (Batch.seq_shared), its last token an output, then each choice's own
tokens as its own sequence, outputs where the format wants them. The KV cache starts empty
for every batch, which is decoded in pieces of n_batch tokens (computed in ubatches as the
context splits them), and only the rows a task format asked for are read from each piece's
logits: the log-probability of each scored token (logprobs.token_logprobs) and, from the
prefix's last row, that of each choice's first token (logprobs.softmax_logprobs).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ..batch import Batch
from ..context import Context
from ..errors import InputError
from .logprobs import softmax_logprobs, token_logprobs


@dataclass
class PreparedTask:
    """A task, tokenized and laid out: `seqs` the tokens of each choice; `output_last`
    whether each choice's last token is an output too; `pair_rows` / `pair_tokens` the
    tokens to score and the output row (counted from the task's first output, the prefix's
    last token) that predicts each; `first_tokens` each choice's first token after the
    prefix, scored from row 0 (None: none)."""
    index: int
    seqs: list[np.ndarray]
    common_prefix: int
    output_last: bool
    pair_rows: np.ndarray
    pair_tokens: np.ndarray
    first_tokens: np.ndarray | None
    data: object = None  # the format's own (e.g. the right answer)

    @property
    def required_tokens(self) -> int:
        return self.common_prefix + sum(len(s) - self.common_prefix for s in self.seqs)

    @property
    def n_seq(self) -> int:
        return len(self.seqs)


def common_prefix(seqs: Sequence[np.ndarray]) -> int:
    """How many leading tokens all sequences share."""
    n = min(len(s) for s in seqs)
    first = seqs[0][:n]
    same = np.ones(n, dtype=bool)
    for s in seqs[1:]:
        same &= s[:n] == first
    return n if same.all() else int(np.argmin(same))


def check_fits(tasks: Sequence[PreparedTask], n_ctx: int, max_seq: int, number: Callable[[int], int]) -> None:
    """InputError for the first task that no batch can hold: more tokens than the context,
    or more choices than the sequence slots (`number(i)`: the task's number to name)."""
    for i, task in enumerate(tasks):
        if task.required_tokens > n_ctx:
            raise InputError(f"task {number(i)} does not fit in the context window (requires {task.required_tokens} "
                             f"tokens, the context holds {n_ctx}): give a larger -c")
        if task.n_seq > max_seq:
            raise InputError(f"task {number(i)} has {task.n_seq} choices: it requires a higher -np|--parallel value "
                             f"(at least {task.n_seq})")


def pack(tasks: Sequence[PreparedTask], i0: int, n_ctx: int, max_seq: int) -> tuple[int, Batch, list[int]]:
    """The batch of tasks i0, i0 + 1, ... (as many as fit), its end i1 and the first output
    row of each of its tasks."""
    tokens, pos, seq, shared, output = [], [], [], [], []
    first_rows = []
    n_cur = n_rows = s0 = 0
    i1 = i0
    while i1 < len(tasks) and n_cur + tasks[i1].required_tokens <= n_ctx and s0 + tasks[i1].n_seq <= max_seq:
        task = tasks[i1]
        cp, n = task.common_prefix, task.n_seq
        tokens.append(task.seqs[0][:cp])
        pos.append(np.arange(cp))
        seq.append(np.full(cp, s0))
        shared.append(np.full(cp, ((1 << n) - 1) << s0, dtype=np.uint64))
        out = np.zeros(cp, dtype=bool)
        out[-1] = True
        output.append(out)
        first_rows.append(n_rows)
        n_rows += 1
        for s, toks in enumerate(task.seqs):
            m = len(toks) - cp
            tokens.append(toks[cp:])
            pos.append(np.arange(cp, len(toks)))
            seq.append(np.full(m, s0 + s))
            shared.append(np.zeros(m, dtype=np.uint64))
            out = np.ones(m, dtype=bool)
            if not task.output_last:
                out[-1:] = False
            output.append(out)
            n_rows += int(out.sum())
        s0 += n
        n_cur += task.required_tokens
        i1 += 1
    if i1 == i0:
        raise InputError(f"task {i0 + 1} does not fit in the context window (requires {tasks[i0].required_tokens} "
                         f"tokens)")
    batch = Batch(np.concatenate(tokens), np.concatenate(pos), np.concatenate(seq), np.concatenate(output),
                  np.concatenate(shared))
    return i1, batch, first_rows


@dataclass
class ScoredRows:
    """What a decode gave one task: the log-probability of each of its scored tokens (its
    pairs' order) and of each choice's first token (None when the format has none)."""
    logprobs: np.ndarray
    first_logprobs: np.ndarray | None


def decode_and_score(ctx: Context, batch: Batch, n_batch: int, tasks: Sequence[PreparedTask],
                     first_rows: Sequence[int]) -> list[ScoredRows]:
    """Decode `batch` from an empty KV cache in pieces of n_batch tokens and read the rows
    `tasks` (the batch's) asked for from each piece's logits."""
    rows = np.concatenate([r0 + t.pair_rows for t, r0 in zip(tasks, first_rows)]).astype(np.int64)
    targets = np.concatenate([t.pair_tokens for t in tasks]).astype(np.int32)
    pair_logprobs = np.empty(len(rows), dtype=np.float32)
    firsts: list[np.ndarray | None] = [None] * len(tasks)
    ctx.memory_clear()
    row0 = 0  # the first output row of the piece
    for lo in range(0, len(batch), n_batch):
        hi = min(lo + n_batch, len(batch))
        piece = Batch(batch.tokens[lo:hi], batch.pos[lo:hi], batch.seq_id[lo:hi], batch.output[lo:hi],
                      batch.seq_shared[lo:hi])
        ctx.decode(piece)
        n_out = int(piece.output.sum())
        if n_out == 0:
            continue
        logits = ctx.get_logits()
        mine = (rows >= row0) & (rows < row0 + n_out)
        if mine.any():
            pair_logprobs[mine] = token_logprobs(logits, rows[mine] - row0, targets[mine])
        for k, (task, r0) in enumerate(zip(tasks, first_rows)):
            if task.first_tokens is not None and row0 <= r0 < row0 + n_out:
                firsts[k] = softmax_logprobs(logits[r0 - row0], task.first_tokens.astype(np.int32))
        row0 += n_out
    out, at = [], 0
    for task, first in zip(tasks, firsts):
        n = len(task.pair_rows)
        out.append(ScoredRows(pair_logprobs[at:at + n], first))
        at += n
    return out


def score_in_batches(ctx: Context, tasks: Sequence[PreparedTask], n_batch: int,
                     max_seq: int) -> Iterator[tuple[PreparedTask, ScoredRows]]:
    """Every task with its scored rows, in order, batch by batch (module docstring)."""
    i0 = 0
    while i0 < len(tasks):
        i1, batch, first_rows = pack(tasks, i0, ctx.n_ctx, max_seq)
        group = tasks[i0:i1]
        yield from zip(group, decode_and_score(ctx, batch, n_batch, group, first_rows))
        i0 = i1


@dataclass(frozen=True)
class TaskFormat:
    """One task format (a module of this package): how its tasks are read, chosen, laid out,
    judged and printed as llama-perplexity does for it.

    from_file(data, where, n_tasks, warn) and from_list(tasks, n_tasks): the (index, task)
    pairs scored, in order; prepare(vocab, index, task): its PreparedTask; judge(task, rows):
    (the score of each choice, the chosen one, right or not); line(number, n_correct, task,
    scores, chosen): the printed line; final(n_done, n_correct, n_answers): the closing
    lines (stderr)."""
    kind: str
    task_type: type
    max_seq: int             # sequences per batch (before the context's own limit)
    min_seq: int             # sequence slots a context needs (a task's choices)
    default_tasks: int       # llama-perplexity's default of --KIND-tasks (0: all)
    header: str              # printed (stdout) before the first task's line
    from_file: Callable
    from_list: Callable
    prepare: Callable
    judge: Callable
    line: Callable
    final: Callable
