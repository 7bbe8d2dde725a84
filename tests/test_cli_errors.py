"""Bad input gets one clear line on stderr and a non-zero exit, never a traceback."""
from __future__ import annotations

import subprocess

import gguf
import pytest

from conftest import tool_process


def run_perplexity(*args: str) -> subprocess.CompletedProcess:
    """llamapy-perplexity in this process (test_perplexity.py runs it as a child process)."""
    return tool_process("perplexity", *args)


def assert_one_clear_line(proc: subprocess.CompletedProcess, expected: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert expected in errors[0], errors[0]


@pytest.fixture
def text_file(tmp_path, wiki_path):
    path = tmp_path / "text.txt"
    path.write_text(wiki_path.read_text(encoding="utf-8")[:20000], encoding="utf-8")
    return path


def test_missing_model(tmp_path, text_file):
    proc = run_perplexity("-m", str(tmp_path / "nope.gguf"), "-f", str(text_file), "-c", "128")
    assert_one_clear_line(proc, "model file not found")


def test_not_gguf(text_file):
    proc = run_perplexity("-m", str(text_file), "-f", str(text_file), "-c", "128")
    assert_one_clear_line(proc, "is not a GGUF file")


def test_truncated_gguf(tmp_path, stories_path, text_file):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(stories_path.read_bytes()[:600_000])
    proc = run_perplexity("-m", str(truncated), "-f", str(text_file), "-c", "128")
    assert_one_clear_line(proc, "truncated")


def test_unsupported_architecture(tmp_path, text_file):
    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    proc = run_perplexity("-m", str(path), "-f", str(text_file), "-c", "128")
    assert_one_clear_line(proc, "architecture 'mamba' is not supported")


def test_text_too_short(tmp_path, stories_path):
    short = tmp_path / "short.txt"
    short.write_text("Once upon a time there was a tiny text.", encoding="utf-8")
    proc = run_perplexity("-m", str(stories_path), "-f", str(short), "-c", "128")
    assert_one_clear_line(proc, "you need at least 256 tokens")


def test_missing_text(tmp_path, stories_path):
    proc = run_perplexity("-m", str(stories_path), "-f", str(tmp_path / "none.txt"), "-c", "128")
    assert_one_clear_line(proc, "text file not found")


def test_f16_model_runs_perplexity(tiny_random_path, text_file):
    """The F16, 32000-token model runs the whole tool on a short text."""
    proc = run_perplexity("-m", str(tiny_random_path), "-f", str(text_file), "-c", "128", "--chunks", "4")
    assert proc.returncode == 0, proc.stderr
    assert "Final estimate: PPL =" in proc.stderr
    assert "[4]" in proc.stdout
