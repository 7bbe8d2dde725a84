"""Finetuning on examples from the command line: JSONL datasets (--data DIR, -f x.jsonl),
the chat template, --mask-prompt, --sample-start, validation files and steps, the test set,
and one clear line for every kind of bad dataset."""
from __future__ import annotations

import json
import re
import subprocess

import numpy as np
import pytest

import llamapy
from llamapy.chat import ChatTemplate
from llamapy.dataset import IGNORE, load_samples
from llamapy.train_params import LRSchedule, TrainParams

from conftest import tool_process
from test_cli_errors import assert_one_clear_line

N_CTX = 256
NAMES = ["Tom", "Lily", "Sue", "Ben"]
THINGS = ["ball", "cat", "dog", "tree", "cake"]


def pair(i: int) -> tuple[str, str]:
    name, thing = NAMES[i % 4], THINGS[i % 5]
    return f"What did {name} see?", f"{name} saw a {thing}."


def write_jsonl(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def completions(start: int, n: int) -> list[dict]:
    return [dict(zip(("prompt", "completion"), pair(i))) for i in range(start, start + n)]


def chats(start: int, n: int) -> list[dict]:
    return [{"messages": [{"role": "system", "content": "Answer briefly."},
                          {"role": "user", "content": pair(i)[0]}, {"role": "assistant", "content": pair(i)[1]}]}
            for i in range(start, start + n)]


@pytest.fixture
def data_dir(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    write_jsonl(d / "train.jsonl", completions(0, 24))
    write_jsonl(d / "valid.jsonl", completions(100, 4))
    write_jsonl(d / "test.jsonl", chats(200, 4))
    return d


def finetune(*args: str) -> subprocess.CompletedProcess:
    """llamapy-finetune in this process (test_finetune.py and test_checkpoint.py run it as a child process)."""
    return tool_process("finetune", *args)


def test_finetune_on_a_data_dir_validates_every_n_steps_and_tests_at_the_end(stories_path, data_dir, tmp_path):
    out = tmp_path / "sft.gguf"
    proc = finetune("-m", str(stories_path), "--data", str(data_dir), "-c", str(N_CTX), "--epochs", "2",
                    "-lr", "1e-3", "--steps-per-eval", "3", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    assert "has no chat template: using the built-in 'chatml'" in err
    n_train = int(re.search(r"train\.jsonl \(training\): 24 samples, \d+ tokens, \d+ to learn .*, packed into (\d+) "
                            r"windows", err).group(1))
    n_val = int(re.search(r"valid\.jsonl \(validation\): 4 samples, .*, packed into (\d+) windows", err).group(1))
    assert f"{n_train} windows for training, {n_val} for validation (the validation file" in err
    # a validation after every 3rd step, except where an epoch ends (the epoch's own validation)
    steps = [int(s) for s in re.findall(r"^step (\d+): val loss=", err, re.M)]
    assert steps == [s for s in range(3, 2 * n_train + 1, 3) if s % n_train]
    printed = float(re.search(r"^test: loss=([0-9.]+)", err, re.M).group(1))
    # the test line is the saved model's loss on test.jsonl (chat samples, answers only)
    model = llamapy.load_model(out)
    ctx = llamapy.Context(model, n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, n_threads=1)
    ctx.opt_init(TrainParams(n_ctx_train=N_CTX))
    test = load_samples(data_dir / "test.jsonl", model.vocab, N_CTX, chat_template=ChatTemplate.named("chatml", model.vocab))
    assert ctx.opt_evaluate(test).loss()[0] == pytest.approx(printed, abs=1e-5)
    base = llamapy.Context(llamapy.load_model(stories_path), n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, n_threads=1)
    base.opt_init(TrainParams(n_ctx_train=N_CTX))
    assert printed < 0.5 * base.opt_evaluate(test).loss()[0]  # it learned the answers


def test_mask_prompt_learns_the_answers_and_no_mask_prompt_everything(stories_path, data_dir, tmp_path):
    learned = {}
    for flag in ("--mask-prompt", "--no-mask-prompt"):
        proc = finetune("-m", str(stories_path), "-f", str(data_dir / "train.jsonl"), "-c", str(N_CTX), "--epochs", "1",
                        flag, "-o", str(tmp_path / "m.gguf"), "--chat-template", "chatml")
        assert proc.returncode == 0, proc.stderr
        m = re.search(r"24 samples, (\d+) tokens, (\d+) to learn", proc.stderr)
        learned[flag] = int(m.group(2))
        n_tokens = int(m.group(1))
    vocab = llamapy.load_model(stories_path).vocab
    template = ChatTemplate.named("chatml", vocab)
    answers = 0
    for prompt, completion in map(pair, range(24)):
        _, mask = template.tokenize_pair(vocab, prompt, completion)
        answers += int(mask.sum())
    assert learned["--mask-prompt"] == answers
    assert learned["--no-mask-prompt"] == n_tokens - 24  # every token but each sample's first


def test_sample_start_cuts_a_text_into_samples(stories_path, tmp_path):
    stories = [f"Once upon a time {name} saw a {thing}. It was a happy day and they played in the park."
               for name, thing in zip(NAMES * 3, THINGS * 3)]
    text = tmp_path / "stories.txt"
    text.write_text("header to skip" + "".join("\n<story>\n" + s for s in stories), encoding="utf-8")
    proc = finetune("-m", str(stories_path), "-f", str(text), "--sample-start", "\\n<story>\\n", "--escape",
                    "-c", "64", "--epochs", "1", "-val-split", "0.2", "-o", str(tmp_path / "m.gguf"))
    assert proc.returncode == 0, proc.stderr
    assert f"stories.txt (training): {len(stories)} samples" in proc.stderr
    assert "warning" not in proc.stderr


def test_opt_fit_validates_on_val_data_every_n_steps_without_changing_training(stories_path, data_dir):
    model = llamapy.load_model(stories_path)
    template = ChatTemplate.named("chatml", model.vocab)
    train = load_samples(data_dir / "train.jsonl", model.vocab, N_CTX, chat_template=template)
    val = load_samples(data_dir / "test.jsonl", model.vocab, N_CTX, chat_template=template)
    histories, contexts = [], []
    for eval_every in (None, 2):
        ctx = llamapy.Context(llamapy.load_model(stories_path), n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=64, n_threads=1)
        ctx.opt_init(TrainParams(n_ctx_train=N_CTX, schedule=LRSchedule(lr0=1e-3)))
        histories.append(ctx.opt_fit(train, epochs=1, val_data=val, eval_every=eval_every, silent=True, seed=3))
        contexts.append(ctx)
    plain, evaluated = histories[0][0], histories[1][0]
    assert plain.train.steps == evaluated.train.steps  # validating between steps leaves training as it was
    assert [n for n, _ in evaluated.evals] == list(range(2, train.ndata, 2))
    assert all(r.ndata == int(np.count_nonzero(val.labels != IGNORE)) for _, r in evaluated.evals)
    final = contexts[1].opt_evaluate(val)
    assert evaluated.val.loss()[0] == pytest.approx(final.loss()[0], rel=1e-6)
    assert evaluated.val.ndata == final.ndata


BAD = {
    "invalid JSON": ('{"prompt": "a", "completion": "b"}\n{"prompt": "a", \n', "train.jsonl:2: invalid JSON"),
    "missing field": ('{"prompt": "a", "completion": "b"}\n{"prompt": "a"}\n', "train.jsonl:2: a sample needs"),
    "unknown role": ('{"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}\n',
                     "train.jsonl:1: message 1 has an unknown role 'bot'"),
    "mixed formats": ('{"prompt": "a", "completion": "b"}\n\n{"text": "abc"}\n',
                      "train.jsonl:3: a 'text' sample in a file of 'completions' samples"),
    "empty": ("\n\n", "train.jsonl: no samples (the file is empty)"),
    "no answer": ('{"messages": [{"role": "user", "content": "a"}]}\n', "train.jsonl:1: the conversation has no assistant"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_dataset_gets_one_line_with_file_and_line(stories_path, tmp_path, case):
    content, expected = BAD[case]
    d = tmp_path / "d"
    d.mkdir()
    (d / "train.jsonl").write_text(content, encoding="utf-8")
    proc = finetune("-m", str(stories_path), "--data", str(d), "-c", "64", "-o", str(tmp_path / "m.gguf"))
    assert_one_clear_line(proc, expected)


def test_template_that_fails_to_render_names_the_sample_and_the_jinja_error(stories_path, tmp_path):
    template = tmp_path / "strict.jinja"
    template.write_text("{% for m in messages %}{% if m['role'] == 'system' %}"
                        "{{ raise_exception('System role not supported') }}{% endif %}"
                        "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}", encoding="utf-8")
    data = tmp_path / "chat.jsonl"
    write_jsonl(data, completions(0, 2) and chats(0, 2))
    proc = finetune("-m", str(stories_path), "-f", str(data), "--chat-template", str(template), "-c", "64",
                    "-o", str(tmp_path / "m.gguf"))
    assert_one_clear_line(proc, "chat.jsonl:1: chat template")
    assert "System role not supported" in proc.stderr


@pytest.mark.parametrize("args, expected", [
    (["--no-truncate", "-c", "32"], "train.jsonl:1: the sample is"),
    (["--chat-template", "nope"], "chat template 'nope' is neither a built-in name"),
    (["--steps-per-eval", "2", "-val-split", "0"], "eval_every must be a positive number of optimizer steps, with "
                                                    "validation data"),
    (["--data-format", "chat"], "train.jsonl:1: a 'completions' sample in a file of 'chat' samples"),
])
def test_bad_data_flags_get_one_line(stories_path, data_dir, tmp_path, args, expected):
    proc = finetune("-m", str(stories_path), "-f", str(data_dir / "train.jsonl"), *args, "-o", str(tmp_path / "m.gguf"))
    assert_one_clear_line(proc, expected)


def test_data_dir_without_train_jsonl(stories_path, tmp_path):
    proc = finetune("-m", str(stories_path), "--data", str(tmp_path), "-o", str(tmp_path / "m.gguf"))
    assert_one_clear_line(proc, "has no train.jsonl")
