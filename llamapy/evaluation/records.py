"""What the evaluations read and return: one task record per format (checked pydantic models,
so a task list built in Python is refused as clearly as a bad file), a task's score and a
run's result."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Kind = Literal["hellaswag", "winogrande", "multiple-choice"]
KINDS: tuple[str, ...] = ("hellaswag", "winogrande", "multiple-choice")


class _Task(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class HellaSwagTask(_Task):
    """A context and four endings, `gold` the index of the right one (HellaSwag's
    activity_label + ": " + ctx, label, endings)."""
    context: str
    endings: tuple[str, str, str, str]
    gold: int = Field(ge=0, le=3)


class WinograndeTask(_Task):
    """A sentence cut at its blank (`first` + choice + `second`), two choices and the right
    one's number (1 or 2)."""
    first: str
    second: str
    choices: tuple[str, str]
    answer: int = Field(ge=1, le=2)


class MultipleChoiceTask(_Task):
    """A question and its answers (continuations), `labels[i]` 1 for the correct answer, 0
    otherwise (the binary format's mc1 part: ARC, MMLU, TruthfulQA, HellaSwag)."""
    question: str = Field(min_length=1)
    answers: tuple[str, ...] = Field(min_length=1, max_length=100)
    labels: tuple[int, ...]

    @model_validator(mode="after")
    def _one_label_per_answer(self) -> "MultipleChoiceTask":
        if len(self.labels) != len(self.answers):
            raise ValueError(f"{len(self.answers)} answers but {len(self.labels)} labels")
        return self


Task = HellaSwagTask | WinograndeTask | MultipleChoiceTask


@dataclass(frozen=True)
class TaskScore:
    """One scored task: `number` is its place in the run (1-based, as printed), `task` its
    index in the file or list; `choice_scores` the mean log-probability of each choice's
    scored tokens, `chosen` the best one (0-based), `correct` whether it is right."""
    number: int
    task: int
    choice_scores: tuple[float, ...]
    chosen: int
    correct: bool
    n_correct: int  # correct so far, this task included
    line: str       # llama-perplexity's line for this task (stdout)


@dataclass(frozen=True)
class EvaluationResult:
    """A run's score: the percentage of tasks answered right (HellaSwag's acc_norm), its
    standard error `error` (100 sqrt(p (1 - p) / (n - 1)), the ± llama-perplexity prints for
    Winogrande and multiple choice) and Wilson's 95% interval (what it prints for HellaSwag),
    both in percent; `final_lines`: llama-perplexity's closing lines (stderr), if any."""
    kind: str
    n_tasks: int
    n_correct: int
    tasks: list[TaskScore] = field(default_factory=list)
    final_lines: list[str] = field(default_factory=list)
    random_chance: float | None = None  # multiple choice: 100 * tasks / answers

    @property
    def score(self) -> float:
        return 100.0 * self.n_correct / self.n_tasks if self.n_tasks else math.nan

    @property
    def error(self) -> float:
        if self.n_tasks < 2:
            return math.nan
        p = self.n_correct / self.n_tasks
        return 100.0 * math.sqrt(p * (1 - p) / (self.n_tasks - 1))

    @property
    def interval(self) -> tuple[float, float]:
        if not self.n_tasks:
            return math.nan, math.nan
        low, high = wilson_interval(self.n_correct, self.n_tasks)
        return 100.0 * low, 100.0 * high


Z95 = 1.95996398454


def wilson_interval(n_correct: int, n: int) -> tuple[float, float]:
    """Wilson's 95% score interval of n_correct in n, in llama-perplexity's operation order
    (doubles, no fused multiply-add)."""
    freq = n_correct / n
    z = Z95 * Z95 / n
    cnf = z * math.sqrt(n * (4.0 * freq * (1 - freq) + z)) / (Z95 + Z95)
    return (freq + z * 0.5 - cnf) / (1.0 + z), (freq + z * 0.5 + cnf) / (1.0 + z)
