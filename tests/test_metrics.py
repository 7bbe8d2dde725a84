"""Watching a training run: the metrics JSONL holds a whole record per step and per validation
while the run goes on, the plot is a whole PNG whenever a viewer reads it, --save-best keeps
the weights of the lowest validation loss, a resumed run continues the same files with
every step exactly once, and llamapy-finetune's flags drive it all."""
from __future__ import annotations

import json
import math
import os
import subprocess
import threading

import pytest

import llamapy
from llamapy.dataset import token_windows
from llamapy.errors import InputError
from llamapy.fit_watch import BEST_LOSS_KEY, BEST_STEP_KEY
from llamapy.gguf_file import GGUFFile
from llamapy.metrics import EvalRecord, MetricsFile, StepRecord, read_records
from llamapy.train_params import LRSchedule, TrainParams

from conftest import Killed, kill_after, tool_process

N_CTX = 32
PNG_END = b"IEND\xaeB`\x82"
TIMING = ("elapsed", "tokens_per_s")  # the only fields a resumed run may not repeat exactly


@pytest.fixture(scope="module")
def texts(wiki_path) -> tuple[str, str]:
    text = wiki_path.read_text()
    return text[:600], text[5000:5400]  # 23 training windows, 13 validation windows of 32 tokens


def new_run(stories_path, lr: float = 1e-2):
    """stories260K fully finetuned, one window per step (a constant rate high enough that the
    validation loss goes up and down)."""
    model = llamapy.load_model(stories_path)
    ctx = llamapy.Context(model, n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, n_threads=1)
    ctx.opt_init(TrainParams(schedule=LRSchedule(lr0=lr, kind="constant", epochs=2), grad_clip=None))
    return ctx


def windows(ctx, text: str):
    return token_windows(ctx.model.vocab.tokenize(text), N_CTX)


def test_records_are_whole_and_readable_while_the_run_goes(stories_path, texts, tmp_path):
    metrics, plot, best = tmp_path / "metrics.jsonl", tmp_path / "loss.png", tmp_path / "best.gguf"
    ctx = new_run(stories_path)
    train, val = windows(ctx, texts[0]), windows(ctx, texts[1])
    seen_steps, seen_evals, inodes, png_reads, done = [], [], [], [], threading.Event()

    def on_step(record: StepRecord) -> None:
        lines = metrics.read_text().splitlines()  # what `tail -f` or a notebook sees now
        assert json.loads(lines[-1]) == record.to_dict()
        assert [json.loads(x)["step"] for x in lines if '"step"' in x][-1] == record.step
        seen_steps.append(sum(json.loads(x)["type"] == "step" for x in lines))

    def on_eval(record: EvalRecord) -> None:
        assert json.loads(metrics.read_text().splitlines()[-1]) == record.to_dict()
        data = plot.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and data.endswith(PNG_END)
        inodes.append(os.stat(plot).st_ino)  # a new file renamed over the old one, never rewritten in place
        seen_evals.append(record)

    def viewer() -> None:  # an image viewer reloading the plot as fast as it can
        while not done.is_set():
            try:
                png_reads.append(plot.read_bytes())
            except FileNotFoundError:
                pass

    thread = threading.Thread(target=viewer)
    thread.start()
    try:
        history = ctx.opt_fit(train, epochs=1, val_data=val, eval_every=4, silent=True, metrics=metrics, plot=plot,
                              save_best=best, on_step=on_step, on_eval=on_eval)
    finally:
        done.set()
        thread.join()
    n_steps = ctx.trainer.n_steps
    assert seen_steps == list(range(1, n_steps + 1))  # each step's line was in the file when its hook ran
    assert png_reads and all(d.startswith(b"\x89PNG") and d.endswith(PNG_END) for d in png_reads)
    assert all(a != b for a, b in zip(inodes, inodes[1:]))
    records = read_records(metrics)
    steps = [r for r in records if isinstance(r, StepRecord)]
    evals = [r for r in records if isinstance(r, EvalRecord)]
    assert [r.step for r in steps] == list(range(1, n_steps + 1))
    assert [(r.step, r.end_of_epoch) for r in evals] == [(s, False) for s in range(4, n_steps, 4)] + [(n_steps, True)]
    assert evals == seen_evals
    assert [r.loss for r in steps] == history[0].train.steps
    assert (evals[-1].val_loss, evals[-1].val_loss_unc) == history[0].val.loss()
    assert all(r.lr == 1e-2 and r.grad_norm > 0 and r.tokens == r.step * N_CTX for r in steps)
    assert steps[-1].epoch == evals[-1].epoch == 1.0 and 0 < steps[0].epoch < 0.1
    # the best file holds the weights of the lowest validation loss, which was not the last one
    lowest = min(evals, key=lambda r: r.val_loss)
    assert lowest is not evals[-1]
    f = GGUFFile(best)
    assert (f.get(BEST_LOSS_KEY), f.get(BEST_STEP_KEY)) == (lowest.val_loss, lowest.step)
    again = llamapy.Context(llamapy.load_model(best), n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, n_threads=1)
    again.opt_init(TrainParams())
    assert again.opt_evaluate(val).loss()[0] == pytest.approx(lowest.val_loss, rel=1e-6)


def test_a_resumed_run_continues_the_same_files(stories_path, texts, tmp_path):
    def fit(ctx, folder, epochs=2, **kw):
        folder.mkdir(exist_ok=True)
        return ctx.opt_fit(windows(ctx, texts[0][:300]), epochs=epochs, val_data=windows(ctx, texts[1][:200]),
                           eval_every=3, seed=5, silent=True, metrics=folder / "m.jsonl", save_best=folder / "best.gguf",
                           **kw)

    reference = new_run(stories_path)
    fit(reference, tmp_path / "ref")
    total = reference.trainer.n_steps
    ckpt = tmp_path / "run" / "run.ckpt"
    killed = new_run(stories_path)
    # die in the second epoch two steps after a checkpoint (every 3 steps): the step after the
    # checkpoint has its record in the file, which the resumed run must drop and write again
    die_at = next(n for n in range(reference.trainer.steps_per_epoch + 2, total) if n % 3 == 2)
    kill_after(killed, die_at)
    with pytest.raises(Killed):
        fit(killed, tmp_path / "run", checkpoint=ckpt, save_every=3)
    written = [r.step for r in read_records(tmp_path / "run" / "m.jsonl") if isinstance(r, StepRecord)]
    assert written == list(range(1, die_at))  # the dying step's record was never written
    del killed
    resumed = new_run(stories_path)
    fit(resumed, tmp_path / "run", checkpoint=ckpt, save_every=3, resume=ckpt)
    assert resumed.trainer.n_steps == total

    def without_timing(path):
        return [{k: v for k, v in r.to_dict().items() if k not in TIMING} for r in read_records(path)]
    got, expect = without_timing(tmp_path / "run" / "m.jsonl"), without_timing(tmp_path / "ref" / "m.jsonl")
    assert [r["step"] for r in got if r["type"] == "step"] == list(range(1, total + 1))
    assert got == expect  # every step and validation once, with the uninterrupted run's numbers
    elapsed = [r.elapsed for r in read_records(tmp_path / "run" / "m.jsonl")]
    assert elapsed == sorted(elapsed)  # the resumed run's clock carries on from the file's
    best_run, best_ref = GGUFFile(tmp_path / "run" / "best.gguf"), GGUFFile(tmp_path / "ref" / "best.gguf")
    assert best_run.get(BEST_STEP_KEY) == best_ref.get(BEST_STEP_KEY)
    assert best_run.get(BEST_LOSS_KEY) == best_ref.get(BEST_LOSS_KEY)
    # a further opt_fit of the same trainer continues the file too
    fit(resumed, tmp_path / "run", epochs=1)
    steps = [r.step for r in read_records(tmp_path / "run" / "m.jsonl") if isinstance(r, StepRecord)]
    assert steps == list(range(1, resumed.trainer.n_steps + 1)) and len(steps) > total


def test_a_metrics_file_cut_mid_line_resumes_and_a_foreign_file_is_refused(tmp_path):
    path = tmp_path / "m.jsonl"
    step = StepRecord(step=1, epoch=0.5, tokens=32, loss=4.0, accuracy=None, lr=1e-3, grad_norm=math.nan,
                      tokens_per_s=10.0, elapsed=1.0)
    line = json.dumps(step.to_dict())
    assert json.loads(line)["grad_norm"] is None  # no NaN in the JSON: null
    path.write_text(line + "\n" + line.replace('"step": 1', '"step": 2')[:40])  # killed while writing step 2
    kept = MetricsFile.create(path, keep=lambda r: True)
    kept.write(StepRecord(**{**vars(step), "step": 2}))
    kept.close()
    assert [r.step for r in read_records(path)] == [1, 2]
    path.write_text("step 1: loss 4.0\nstep 2: loss 3.9\n")
    with pytest.raises(InputError, match=r"m.jsonl:1: not a llamapy metrics record"):
        MetricsFile.create(path, keep=lambda r: True)


def run_finetune(*args: str) -> subprocess.CompletedProcess:
    """llamapy-finetune in this process (test_finetune.py and test_checkpoint.py run it as a child process)."""
    return tool_process("finetune", *args)


def test_finetune_flags(stories_path, texts, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(texts[0] + texts[1])
    common = ["-m", str(stories_path), "-f", str(text), "-c", str(N_CTX), "--epochs", "1", "-lr", "1e-3", "-t", "1",
              "-o", str(tmp_path / "out.gguf")]
    tasks = tmp_path / "hellaswag.txt"
    tasks.write_text(HELLASWAG)
    run = run_finetune(*common, "-val-split", "0.25", "--eval-every", "10", "--metrics", str(tmp_path / "m.jsonl"),
                       "--save-best", str(tmp_path / "best.gguf"), "--plot", str(tmp_path / "loss.png"),
                       "--eval-task", str(tasks), "--eval-task-count", "2")
    assert run.returncode == 0, run.stderr
    assert f"eval task: 2 hellaswag tasks of {tasks}" in run.stderr
    records = read_records(tmp_path / "m.jsonl")
    n_steps = sum(isinstance(r, StepRecord) for r in records)
    evals = [r for r in records if isinstance(r, EvalRecord)]
    assert [r.step for r in evals] == list(range(10, n_steps, 10)) + [n_steps]
    assert all(r.tasks["hellaswag"] in (0.0, 50.0, 100.0) for r in evals)
    assert (tmp_path / "best.gguf").is_file() and (tmp_path / "loss.png").read_bytes().endswith(PNG_END)
    # the metrics file is an output: never one of the run's inputs
    refused = run_finetune(*common, "--metrics", str(text))
    assert refused.returncode == 1 and refused.stderr.strip().splitlines() == [
        f"error: --metrics {text} is the file -f reads: writing it would destroy an input (choose another path)"]
    assert text.read_text() == texts[0] + texts[1]


HELLASWAG = "".join(f"{context}\n{gold}\n" + "".join(e + "\n" for e in endings) for context, gold, endings in [
    ("Story: Once upon a time, there was a little girl named Lily.", 1,
     ["Dog the ran far.", "She loved to play outside in the sun.", "Blue seven window.", "The car is a tree."]),
    ("Story: Tom had a big red ball.", 0,
     ["He liked to throw it to his friend.", "Ball big red the.", "Sky is very sad of.", "Happy ran jump the."]),
    ("Story: One day, a cat went to the park.", 3,
     ["Park the went.", "Green very fast the.", "It the was.", "The cat saw a bird in a tree."]),
    ("Story: Sue and her mom baked a cake.", 2,
     ["Cake mom the sue.", "Tree dog run fast.", "It was sweet and they ate it together.", "The the the."]),
])


def test_task_scores_at_every_validation(stories_path, texts, tmp_path):
    from llamapy.evaluation import evaluate
    from llamapy.task_scores import TaskScores
    tasks = tmp_path / "hellaswag.txt"
    tasks.write_text(HELLASWAG)
    ctx = new_run(stories_path, lr=1e-3)
    untrained = evaluate(ctx.model, tasks)
    scorer, evals = TaskScores(ctx.model, tasks), []
    ctx.opt_fit(windows(ctx, texts[0][:300]), epochs=1, val_data=windows(ctx, texts[1][:200]), eval_every=4,
                silent=True, eval_tasks=scorer, on_eval=evals.append)
    assert len(evals) >= 2 and all(set(r.tasks) == {"hellaswag", "hellaswag_unc"} for r in evals)
    assert '"tasks": {"hellaswag": ' in json.dumps(evals[-1].to_dict())
    # the last validation follows the last step: the tasks were scored with the trained weights, as
    # llamapy-perplexity scores the trained model, not with the weights the run started from
    trained = evaluate(ctx.model, tasks)
    assert evals[-1].tasks["hellaswag"] == trained.score
    scored = [t.choice_scores for t in scorer.last.tasks]
    assert scored == [t.choice_scores for t in trained.tasks] != [t.choice_scores for t in untrained.tasks]
    # a task file given by its path is read once, before the first step
    bad = tmp_path / "not-tasks.txt"
    bad.write_text("no tasks here\n")
    with pytest.raises(InputError, match="not a HellaSwag file"):
        ctx.opt_fit(windows(ctx, texts[0][:300]), epochs=1, val_data=windows(ctx, texts[1][:200]), silent=True,
                    eval_tasks=bad, on_step=lambda record: pytest.fail("trained with a bad task file"))


def test_a_fifo_nobody_reads_is_refused_and_a_reader_sees_the_end_only_at_the_end(tmp_path, stories_path, texts):
    """--metrics on a FIFO: with no reader, one line and no hang (the open does not block);
    with one, it gets every record, and end of file only when the run closes the file."""
    import select
    import time
    from llamapy.errors import SaveError
    fifo = tmp_path / "metrics.fifo"
    os.mkfifo(fifo)
    started = time.monotonic()
    with pytest.raises(SaveError, match="no process reads it"):
        MetricsFile.create(fifo)
    assert time.monotonic() - started < 5
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        out = MetricsFile.create(fifo)
        record = StepRecord(step=1, epoch=0.5, tokens=64, loss=2.5, accuracy=0.5, lr=1e-3, grad_norm=1.0,
                            tokens_per_s=100.0, elapsed=0.6)
        out.write(record)
        out.write(record)
        assert select.select([reader], [], [], 5)[0]
        got = os.read(reader, 65536)
        assert got.count(b"\n") == 2 and json.loads(got.splitlines()[0])["loss"] == 2.5
        assert select.select([reader], [], [], 0.2)[0] == []  # no end of file while the run writes
        out.close()
        assert select.select([reader], [], [], 5)[0] and os.read(reader, 100) == b""  # the end, now
    finally:
        os.close(reader)
    text = tmp_path / "text.txt"
    text.write_text(texts[0])
    run = run_finetune("-m", str(stories_path), "-f", str(text), "-c", str(N_CTX), "--epochs", "1", "-t", "1",
                       "-o", str(tmp_path / "out.gguf"), "--metrics", str(fifo))
    assert run.returncode == 1 and run.stderr.strip().splitlines()[-1] == (
        f"error: cannot write the metrics to {fifo}: no process reads it (a FIFO or socket needs a reader)")
