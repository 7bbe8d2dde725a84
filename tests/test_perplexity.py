"""Perplexity against llama.cpp's own numbers (shared/golden), through the library and the CLI."""
from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import llamapy
from llamapy.log_softmax import expf_or_nan_row, token_nll
from llamapy.perplexity import perplexity

from conftest import shared_path, tool_process
from ggml_reference import expf
from golden import running_ppl

REL = 1e-4  # acceptance: running and final values within 1e-4 relative of llama.cpp's


@pytest.fixture(scope="module")
def stories(stories_path):
    return llamapy.load_model(stories_path)


@pytest.fixture(scope="module")
def wiki_tokens(stories, wiki_path):
    return stories.vocab.tokenize(wiki_path.read_text(encoding="utf-8"), add_special=True)


@pytest.fixture(scope="module")
def golden_c128():
    return running_ppl(shared_path("golden", "ppl_stories260K_wiki_c128.txt"))


def test_tokenized_chunk_count(wiki_tokens):
    assert len(wiki_tokens) // 128 == 6322


def test_first_chunks_are_llama_cpps(stories, wiki_tokens, golden_c128):
    """The running values as llama-perplexity prints them, digit for digit."""
    result = perplexity(stories, wiki_tokens, n_ctx=128, n_chunks=40)
    assert [f"{ppl:.4f}" for ppl in result.running] == [f"{golden_c128[i]:.4f}" for i in range(1, 41)]


def llama_perplexity_nll(row: np.ndarray, tok: int) -> float:
    """llama-perplexity's log_softmax, negated: std::max over the row, libm's expf of each
    float difference summed in double in order, libm's log; (float logit - max) - log(sum)."""
    m = row[0]
    for v in row[1:]:
        m = v if m < v else m
    total = 0.0
    for v in expf(row - m):
        total += float(v)
    return -(float(row[tok] - m) - math.log(total))


def test_token_nll_is_llama_perplexitys_log_softmax():
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((2, 5, 512)) * rng.uniform(1, 20, (2, 5, 1))).astype(np.float32)
    logits[0, 1, :40] -= 200  # far below the max: subnormal and zero exps
    logits[1, 2, 7] = -np.inf
    targets = rng.integers(0, 512, (2, 5)).astype(np.int32)
    got = token_nll(logits, targets)
    want = [[llama_perplexity_nll(logits[s, i], targets[s, i]) for i in range(5)] for s in range(2)]
    assert got.tolist() == want


def test_fast_expf_is_libms_or_defers_to_it():
    """The vectorised expf of the NLLs gives libm's bits, or NaN (then libm is asked): on a
    sample here; every float32 in [-87, 0] was checked once (see llamapy/perplexity.py)."""
    rng = np.random.default_rng(6)
    bits = rng.integers(0x80000000, int(np.float32(-87.0).view(np.uint32)) + 1, 200_000, dtype=np.uint32)
    x = np.concatenate([bits.view(np.float32), -rng.uniform(0, 30, 200_000).astype(np.float32),
                        np.float32([0.0, -0.0, -87.0, -87.5, -104.0, -np.inf])])
    got = np.empty_like(x)
    expf_or_nan_row(x, np.float32(0.0), got)
    sure = ~np.isnan(got)
    np.testing.assert_array_equal(got[sure], expf(x[sure]))
    assert sure.mean() > 0.99 and not sure[-3:].any()


@pytest.mark.parametrize("n_batch,n_ubatch", [(2048, 32), (32, 32), (128, 128), (64, 16)])
def test_batch_sizes_do_not_change_results(stories, wiki_tokens, n_batch, n_ubatch):
    """n_batch and n_ubatch trade speed for memory only.

    BLAS may round a product differently for a different number of rows (1 ulp); the F16
    KV cache can turn that into one f16 ulp of a K or V value, so single early chunks move
    by up to ~6e-5 while the estimate over many chunks stays within 1e-5.
    """
    ref = perplexity(stories, wiki_tokens, n_ctx=128, n_chunks=48)
    other = perplexity(stories, wiki_tokens, n_ctx=128, n_batch=n_batch, n_ubatch=n_ubatch, n_chunks=48)
    assert other.ppl == pytest.approx(ref.ppl, rel=1e-5)
    assert other.running == pytest.approx(ref.running, rel=1e-4)


def test_too_short_text_is_an_input_error(stories):
    tokens = stories.vocab.tokenize("Once upon a time there was a tiny text.", add_special=True)
    with pytest.raises(llamapy.LlamapyError, match="at least 256 tokens"):
        perplexity(stories, tokens, n_ctx=128)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """llamapy-perplexity as a child process, as its users run it (the acceptance run)."""
    return subprocess.run([sys.executable, "-m", "llamapy.cli.perplexity", *args], capture_output=True, text=True,
                          timeout=1800)


def run_in_process(*args: str) -> subprocess.CompletedProcess:
    """llamapy-perplexity in this process: the same output without a child's start-up."""
    return tool_process("perplexity", *args)


def final_estimate(stderr: str) -> tuple[float, float]:
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", stderr)
    assert m, stderr
    return float(m.group(1)), float(m.group(2))


@pytest.fixture(scope="module")
def full_run(stories_path, wiki_path):
    """The acceptance command, run once: all 6322 chunks of wiki.test.raw at -c 128."""
    proc = run_cli("-m", str(stories_path), "-f", str(wiki_path), "-c", "128")
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.mark.slow
def test_cli_full_wikitext_matches_llama_cpp(full_run, golden_c128):
    """Acceptance: every running value and the final PPL as llama.cpp prints them."""
    ours = {int(i): v for i, v in re.findall(r"\[(\d+)\]([0-9.]+)", full_run.stdout)}
    assert len(ours) == 6322
    assert [c for c in ours if ours[c] != f"{golden_c128[c]:.4f}"] == []
    assert "Final estimate: PPL = 111.6975 +/- 0.67053" in full_run.stderr


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["-ub", "32"], ["-b", "32", "-ub", "32"]])
def test_cli_full_wikitext_ubatch_invariance(full_run, stories_path, wiki_path, extra):
    """Acceptance: -ub 32 (and -b 32 -ub 32) give the same PPL to 1e-5 relative: over the first
    600 chunks (77k tokens), against the full run's estimate there."""
    proc = run_in_process("-m", str(stories_path), "-f", str(wiki_path), "-c", "128", "--chunks", "600", *extra)
    assert proc.returncode == 0, proc.stderr
    at_600 = float(re.search(r"\[600\]([0-9.]+)", full_run.stdout).group(1))
    assert final_estimate(proc.stderr)[0] == pytest.approx(at_600, rel=1e-5)


BARE_CHUNKS = ("--chunks", "400")  # a quarter of the 1580 (--chunks changes none of the defaults)


@pytest.mark.slow
def test_a_bare_cli_run_gives_llama_cpps_bare_run(stories_path, wiki_path):
    """Acceptance: no -c, as a llama.cpp user types it: llama-perplexity's defaults (-c 512,
    -b 2048) and its numbers (tests/data, recorded by tests/record_llama_cpp_cli.py): the running
    values of the first 400 chunks."""
    golden_path = Path(__file__).parent / "data" / "llama_cpp_ppl_stories260K_bare.txt"
    proc = run_in_process("-m", str(stories_path), "-f", str(wiki_path), *BARE_CHUNKS)
    assert proc.returncode == 0, proc.stderr
    ours = dict(re.findall(r"\[(\d+)\]([0-9.]+)", proc.stdout))
    want = dict(re.findall(r"\[(\d+)\]([0-9.]+)", golden_path.read_text()))
    assert len(want) == 1580 and len(ours) == 400
    assert [c for c in ours if ours[c] != want[c]] == []  # every running value, digit for digit
    assert "n_ctx=512" in proc.stderr and "warning" not in proc.stderr
