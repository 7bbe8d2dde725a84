"""What a newcomer meets in the first hour: a chat with a base model says why it answers
nonsense, training data that cannot train is an error before any work (not a run that
"succeeds" at nothing), a small dataset is not half held out, a resumed run times itself, a
finished run's checkpoint is not silently reused, and an exported PEFT adapter without a
base says what it lacks."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from test_hostile_cli import digest, one_error, run_tool

TRAIN = ["-c", "64", "-t", "1"]


def chat_samples(path: Path, n: int, prompt_words: int) -> Path:
    lines = [{"messages": [{"role": "user", "content": " ".join(["Tell me about the cat"] * prompt_words) + f" {i}"},
                           {"role": "assistant", "content": "The cat sat on the mat."}]} for i in range(n)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


def test_chat_with_a_model_without_a_template_says_it_is_likely_a_base_model(stories_path, capsys):
    code, err = run_tool("cli", "-m", stories_path, "-st", "-p", "Hi", "-n", "4", "--temp", "0", capsys=capsys)
    assert code == 0
    note = next(line for line in err.splitlines() if "has no chat template" in line)
    assert "using the built-in 'chatml', as llama.cpp does" in note and "likely a base model" in note


def test_samples_with_nothing_to_learn_are_an_error_before_any_work(stories_path, tmp_path, capsys):
    data = chat_samples(tmp_path / "chat.jsonl", 10, 30)  # each prompt fills the 64-token window
    out = tmp_path / "out.gguf"
    before = digest(data)
    code, err = run_tool("finetune", "-m", stories_path, "-f", data, *TRAIN, "--epochs", "3", "-o", out,
                         "--checkpoint-out", tmp_path / "c.ckpt", capsys=capsys)
    line = one_error(err)
    assert code != 0 and "none of the 10 samples has a token to learn within a window of 64" in line
    needed = int(re.search(r"a window of at least (\d+)", line).group(1))
    assert needed > 64
    assert "loss=" not in err and not out.exists() and not (tmp_path / "c.ckpt").exists()
    assert digest(data) == before


def test_a_small_dataset_trains_on_all_its_windows(stories_path, tmp_path, capsys):
    data = chat_samples(tmp_path / "chat.jsonl", 10, 1)  # 10 samples of ~65 tokens: 4 windows of 256
    code, err = run_tool("finetune", "-m", stories_path, "-f", data, "-c", "256", "-t", "1", "--epochs", "1", "-o",
                         tmp_path / "out.gguf", capsys=capsys)
    assert code == 0, err
    assert re.search(r"dataset: \d+ windows, all for training: too few to hold out 5%", err)
    assert "val:" not in err


def test_a_resumed_run_times_its_own_first_window(stories_path, wiki_path, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(wiki_path.read_text(encoding="utf-8")[:6000], encoding="utf-8")
    ckpt = tmp_path / "run.ckpt"
    args = ["-m", stories_path, "-f", text, "-c", "32", "-t", "1", "-o", tmp_path / "out.gguf", "--checkpoint-out", ckpt]
    code, err = run_tool("finetune", *args, "--epochs", "1", capsys=capsys)
    assert code == 0, err
    code, err = run_tool("finetune", *args, "--epochs", "2", "--checkpoint-in", ckpt, capsys=capsys)
    assert code == 0, err
    timing = re.search(r"training tokens in ([\d.]+) s .* after the first window's ([\d.]+) s of start-up", err)
    assert timing and float(timing.group(2)) <= float(timing.group(1)), err


def test_a_finished_runs_checkpoint_is_refused_not_reused(stories_path, wiki_path, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(wiki_path.read_text(encoding="utf-8")[:4000], encoding="utf-8")
    ckpt = tmp_path / "run.ckpt"
    args = ["-m", stories_path, "-f", text, "-c", "32", "-t", "1", "-o", tmp_path / "out.gguf", "--epochs", "1"]
    code, err = run_tool("finetune", *args, "--checkpoint-out", ckpt, capsys=capsys)
    assert code == 0, err
    saved = digest(ckpt)
    code, err = run_tool("finetune", *args, "--checkpoint-out", ckpt, capsys=capsys)  # a new run onto it
    assert code != 0 and "holds the checkpoint of an earlier run" in one_error(err)
    code, err = run_tool("finetune", *args, "--checkpoint-in", ckpt, capsys=capsys)  # resuming the finished run
    assert code != 0 and "finished its 1 epoch(s): nothing is left to train for 1" in one_error(err)
    assert digest(ckpt) == saved


def test_to_peft_without_base_says_what_the_adapter_lacks(stories_path, tmp_path, capsys):
    from llamapy import load_model
    from llamapy.lora import LoraAdapter
    model = load_model(stories_path)
    adapter = tmp_path / "a.gguf"
    LoraAdapter.new(model, rank=2).save(adapter)
    code, err = run_tool("export-lora", "-m", stories_path, "--lora", adapter, "--to-peft", tmp_path / "peft",
                         capsys=capsys)
    if code != 0:  # stories260K did not come from a Hugging Face checkpoint: the export may be refused
        pytest.skip(f"export refused: {one_error(err)}")
    assert "warning: --to-peft without --base" in err
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] is None
