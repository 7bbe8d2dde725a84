"""llama-perplexity's task scores: HellaSwag (--hellaswag), Winogrande (--winogrande) and
multiple-choice benchmarks in its binary format (--multiple-choice: ARC, MMLU, TruthfulQA),
each read, chosen, batched and scored as llama-perplexity does, to its printed digits.

    from llamapy import evaluate
    result = evaluate("model.gguf", "hellaswag_val_full.txt", n_tasks=400)
    print(result.score, result.interval)

One module per task format (hellaswag, winogrande, multiple_choice), the shared batching
and scoring (batching, logprobs), the task choice (selection) and the entry points (api):
`evaluate` makes llama-perplexity's context for a model; `evaluate_with_context` scores with
an existing one (adapters attached included), e.g. at each evaluation of a training run.
"""
from .api import FORMATS, TaskSet, detect_kind, evaluate, evaluate_with_context, evaluation_context, load_tasks
from .records import (EvaluationResult, HellaSwagTask, MultipleChoiceTask, TaskScore, WinograndeTask,
                      wilson_interval)

__all__ = ["FORMATS", "EvaluationResult", "HellaSwagTask", "MultipleChoiceTask", "TaskScore", "TaskSet",
           "WinograndeTask", "detect_kind", "evaluate", "evaluate_with_context", "evaluation_context", "load_tasks",
           "wilson_interval"]
