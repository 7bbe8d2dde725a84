"""Hostile command lines and inputs: each ends in one `error:` line naming the problem and a
non-zero exit (or runs correctly where that is harmless), never a traceback, and nothing a
user owns is modified (hashes of every input checked before and after)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

import conftest


def run_tool(name: str, *argv: str, capsys) -> tuple[int, str]:
    """The tool in this process (conftest.run_tool): exit code and stderr."""
    code, _, err = conftest.run_tool(name, *argv, capsys=capsys)
    return code, err


def one_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def files(tmp_path, stories_path, wiki_path):
    """A model and a text the runs must never modify, in a folder of their own."""
    model, text = tmp_path / "m.gguf", tmp_path / "t.txt"
    model.write_bytes(stories_path.read_bytes())
    text.write_text(wiki_path.read_text(encoding="utf-8")[:3000], encoding="utf-8")
    before = {p: digest(p) for p in (model, text)}
    yield model, text
    assert {p: digest(p) for p in before} == before, "an input was modified"


TRAIN = ["-c", "32", "--epochs", "1", "-t", "1"]


@pytest.mark.parametrize("extra, expected", [
    (["--checkpoint-out", "{m}"], "--checkpoint-out {m} is the file -m reads"),
    (["--plot", "{m}"], "--plot {m} is the file -m reads"),
    (["--lora-rank", "2", "--lora-out", "{m}"], "--lora-out {m} is the file -m reads"),
    (["-o", "{m}"], "-o {m} is the file -m reads"),
    (["-o", "{t}"], "-o {t} is the file -f reads"),
    (["--checkpoint-out", "{t}"], "--checkpoint-out {t} is the file -f reads"),
    (["--val-file", "{t}", "-o", "{t}"], "-o {t} is the file -f reads"),
    (["-o", "{d}/x.gguf", "--checkpoint-out", "{d}/x.gguf"], "are the same file"),
    (["--log-file", "{m}"], "--log-file {m} is the file -m reads"),
])
def test_finetune_never_writes_onto_an_input_or_another_output(files, capsys, extra, expected):
    model, text = files
    fill = {"m": model, "t": text, "d": model.parent}
    code, err = run_tool("finetune", "-m", model, "-f", text, *TRAIN, *[a.format(**fill) for a in extra],
                         capsys=capsys)
    assert code != 0 and expected.format(**fill) in one_error(err)
    assert not (model.parent / "x.gguf").exists()


def test_a_default_output_onto_the_model_is_refused(files, capsys, monkeypatch):
    model, text = files
    monkeypatch.chdir(model.parent)
    model.rename("finetuned-model.gguf")
    try:
        code, err = run_tool("finetune", "-m", "finetuned-model.gguf", "-f", text, *TRAIN, capsys=capsys)
        assert code != 0 and "-o finetuned-model.gguf is the file -m reads" in one_error(err)
    finally:
        Path("finetuned-model.gguf").rename(model)


def test_a_link_to_the_model_is_the_model(files, capsys):
    model, text = files
    link = model.parent / "link.gguf"
    link.symlink_to(model)
    code, err = run_tool("finetune", "-m", model, "-f", text, *TRAIN, "-o", link, capsys=capsys)
    assert code != 0 and "is the file -m reads" in one_error(err)


def test_export_lora_and_train_never_overwrite_their_model(files, capsys):
    model, text = files
    code, err = run_tool("export-lora", "-m", model, "-o", model, "--lora", "a.gguf", capsys=capsys)
    assert code != 0 and f"-o {model} is the file -m reads" in one_error(err)
    code, err = run_tool("train", "--vocab-model", model, "-o", model, "-f", text, capsys=capsys)
    assert code != 0 and f"-o {model} is the file --vocab-model reads" in one_error(err)


def test_a_checkpoint_is_resumed_and_written_again_in_one_place(files, capsys):
    """--checkpoint-in and --checkpoint-out may name one file: resuming a run in place."""
    model, text = files
    ckpt, out = model.parent / "run.ckpt", model.parent / "out.gguf"
    assert run_tool("finetune", "-m", model, "-f", text, *TRAIN, "--checkpoint-out", ckpt, "-o", out,
                    capsys=capsys)[0] == 0
    code, err = run_tool("finetune", "-m", model, "-f", text, *TRAIN, "--epochs", "2", "--checkpoint-out", ckpt,
                         "--checkpoint-in", ckpt, "-o", out, capsys=capsys)
    assert code == 0, err
    assert "resume: epoch 2" in err and "epoch 2:" in err and "nan" not in err


def test_a_killed_writes_temp_file_is_removed_by_the_next_write(tmp_path):
    from llamapy.atomic import replace_atomically
    dest = tmp_path / "x.gguf"
    dead = tmp_path / ".x.gguf.999999999.abc.tmp"  # no process has this pid
    alive = tmp_path / f".x.gguf.{os.getpid()}.def.tmp"  # a write in progress in this process
    dead.write_bytes(b"half")
    alive.write_bytes(b"half")
    replace_atomically(dest, lambda out: out.write(b"whole"), "a test file")
    assert dest.read_bytes() == b"whole" and not dead.exists() and alive.exists()


def test_a_failed_write_leaves_no_temp_file_and_the_old_file(tmp_path):
    from llamapy.atomic import replace_atomically
    from llamapy.errors import SaveError
    dest = tmp_path / "x.gguf"
    dest.write_bytes(b"old")

    def fail(out):
        out.write(b"partial")
        raise OSError(28, "No space left on device")
    with pytest.raises(SaveError, match="No space left on device"):
        replace_atomically(dest, fail, "a test file")
    assert dest.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["x.gguf"]


@pytest.mark.parametrize("argv, expected", [
    (["-t", "0"], "-t must be >= 1"),
    (["-t", "-3"], "-t must be >= 1"),
    (["-t", "1000"], "-t must be <= 512"),
    (["--temp", "nan"], "--temp must be a finite number, not nan"),
    (["--temp", "inf"], "--temp must be a finite number, not inf"),
    (["--min-p", "nan"], "--min-p"),
    (["--typical", "nan"], "--typical"),
    (["--repeat-penalty", "nan"], "--repeat-penalty"),
    (["--repeat-penalty", "0"], "--repeat-penalty must be > 0"),
    (["--dynatemp-range", "nan"], "--dynatemp-range"),
    (["--top-p", "-1"], "--top-p must be >= 0"),
    (["-n", "-5"], "-n must be >= -1"),
    (["-b", "0"], "-b must be >= 1"),
    (["-s", "-7"], "-s must be >= -1"),
])
def test_numeric_flags_are_checked_where_they_are_parsed(stories_path, capsys, argv, expected):
    code, err = run_tool("cli", "-m", stories_path, "-p", "hi", "-n", "2", *argv, capsys=capsys)
    assert code != 0 and expected in one_error(err)


@pytest.mark.parametrize("name, argv, expected", [
    ("train", ["--ff", "0"], "--ff must be >= 1"),
    ("train", ["--predict", "-5"], "--predict must be >= 0"),
    ("train", ["--rms-eps", "-1"], "--rms-eps must be > 0"),
    ("train", ["--rope-freq-base", "0"], "--rope-freq-base must be > 0"),
    ("finetune", ["-lr", "nan"], "-lr must be a finite number"),
    ("finetune", ["-val-split", "1"], "-val-split must be <= 0.99"),
    ("export-lora", ["--lora-scaled", "a.gguf:nan"], "expected FNAME:SCALE with a finite SCALE"),
])
def test_numeric_flags_of_every_tool(files, capsys, name, argv, expected):
    model, text = files
    args = (["--vocab-model", model, "-f", text] if name == "train" else
            ["-m", model] + (["-f", text] if name == "finetune" else []))
    code, err = run_tool(name, *args, *argv, capsys=capsys)
    assert code != 0 and expected in one_error(err)


def test_more_threads_than_cores_are_said(files, capsys):
    model, text = files
    code, err = run_tool("perplexity", "-m", model, "-f", text, "-c", "64", "--chunks", "1",
                         "-t", str((os.cpu_count() or 1) + 1), capsys=capsys)
    assert code == 0 and "more threads than the" in err


def binary_and_bad_texts(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, the error it must give)."""
    made = {
        "executable": (Path("/bin/ls"), "not text"),
        "zeros": (tmp_path / "zeros.txt", "not text (100000 NUL bytes"),
        "latin1": (tmp_path / "latin1.txt", "not UTF-8 text"),
        "surrogate": (tmp_path / "sur.jsonl", "a lone surrogate U+D800"),
        "deep": (tmp_path / "deep.jsonl", "JSON nested too deeply"),
        "upper-case": (tmp_path / "train.JSONL", "a lone surrogate U+D800"),
    }
    made["zeros"][0].write_bytes(b"\0" * 100_000)
    made["latin1"][0].write_bytes("déjà vu, à la carte, ".encode("latin-1") * 500)
    made["surrogate"][0].write_text('{"text": "a \\ud800 b"}\n')
    made["deep"][0].write_text('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    made["upper-case"][0].write_text('{"text": "a \\ud800 b"}\n')  # read as JSONL, not as plain text
    return made


@pytest.mark.parametrize("case", ["executable", "zeros", "latin1", "surrogate", "deep", "upper-case"])
def test_what_is_not_text_is_not_trained_on(files, tmp_path, capsys, case):
    model, _ = files
    path, expected = binary_and_bad_texts(tmp_path)[case]
    code, err = run_tool("finetune", "-m", model, "-f", path, *TRAIN, "-o", tmp_path / "o.gguf", capsys=capsys)
    assert code != 0 and expected in one_error(err)
    assert not (tmp_path / "o.gguf").exists()


def test_a_few_invalid_bytes_are_replaced_and_said(files, tmp_path, capsys):
    model, text = files
    mostly = tmp_path / "mostly.txt"
    mostly.write_bytes(text.read_bytes() + b" caf\xe9 ")
    code, err = run_tool("perplexity", "-m", model, "-f", mostly, "-c", "64", "--chunks", "1", capsys=capsys)
    assert code == 0 and "1 bytes are not UTF-8; each was replaced by U+FFFD" in err


def test_jsonl_lines_end_at_newline_only(files, tmp_path, capsys):
    model, _ = files
    data = tmp_path / "u2028.jsonl"
    data.write_text("".join(json.dumps({"text": f"line {i} a\u2028b\u0085c " * 20}, ensure_ascii=False) + "\n"
                            for i in range(8)), encoding="utf-8")
    code, err = run_tool("finetune", "-m", model, "-f", data, *TRAIN, "-o", tmp_path / "o.gguf", capsys=capsys)
    assert code == 0, err
    assert "8 samples" in err


@pytest.mark.parametrize("flag", ["-p", "-sys"])
def test_invalid_utf8_on_the_command_line_is_one_line(stories_path, capsys, flag):
    argv = ["-st", "-p", "hi", "-sys", "\udcff oops"] if flag == "-sys" else ["-p", "\udcff\udcfe hi"]
    code, err = run_tool("cli", "-m", stories_path, *argv, "-n", "2", capsys=capsys)
    assert code != 0 and f"{flag}: not valid text: the byte 0xff" in one_error(err)


def test_export_lora_to_a_type_the_rows_do_not_fit_falls_back(files, tmp_path, capsys):
    """stories260K's rows are 64 wide (Q4_K's 256-blocks do not fit: llama-quantize's fallback
    Q5_0 does) or 172 (ffn_down: no block type fits, F16 does)."""
    import llamapy
    from llamapy.lora import LoraAdapter
    model, _ = files
    adapter = LoraAdapter.new(llamapy.load_model(model), 2)
    adapter.save(tmp_path / "a.gguf")
    code, err = run_tool("export-lora", "-m", model, "--lora", tmp_path / "a.gguf", "--outtype", "q4_k",
                         "-o", tmp_path / "q.gguf", capsys=capsys)
    assert code == 0, err
    merged = llamapy.load_model(tmp_path / "q.gguf")
    assert merged.tensors["blk.0.ffn_down.weight"].type.name == "F16"
    assert merged.tensors["blk.0.attn_q.weight"].type.name == "Q5_0"
