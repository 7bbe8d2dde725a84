"""KL divergence as llama-perplexity computes it: the base log-probabilities file
(llamapy/kld_base.py) and the statistics over another model's run (llamapy/kl_divergence.py),
through the library and llamapy-perplexity --kl-divergence-base / --kl-divergence.

The row kernels against numpy transcriptions of llama-perplexity's float32 arithmetic; the
base files llamapy writes against the bytes of llama-perplexity's, and every figure printed
by the KL-divergence runs against llama-perplexity's own output (tests/data, recorded by
tests/record_llama_cpp_kld.py): stories260K against its Q8_0, Gemma 3 270M Q4_K_M against its
Q4_0. The quantized models are made again here by llamapy-quantize (the bytes llama-quantize
writes); their sha256 must be the recorded one.
"""
from __future__ import annotations

import io
import math
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import llamapy
from llamapy.errors import InputError
from llamapy.kl_divergence import KLDivergenceResult, kl_divergence, kld_rows, median, percentile
from llamapy.kld_base import MAGIC, BaseLogProbs, BaseLogProbsWriter, file_size, quantize_log_probs, row_width
from llamapy.perplexity import perplexity

from conftest import file_sha256, tool_process
from ggml_reference import expf
from record_llama_cpp_kld import CASES, chunk_digests

F32 = np.float32
REL = 1e-4  # acceptance: every printed figure within 1e-4 relative of llama-perplexity's
DATA = Path(__file__).parent / "data"


# ---- llama-perplexity's arithmetic, transcribed --------------------------------------------------
def log_sum_exp(row: np.ndarray) -> tuple[np.float32, np.float32]:
    """The float32 max and float32(log(sum of libm expf(row - max), in double in order)))."""
    top = row.max()
    total = 0.0
    for v in expf(row - top):
        total += float(v)
    return top, F32(math.log(total))


def base_row(row: np.ndarray, tok: int) -> tuple[np.ndarray, float]:
    """llama-perplexity's log_softmax(n_vocab, logits, log_prob, tok): the row's uint16 slots
    and the NLL it returns."""
    n = len(row)
    top, lse = log_sum_exp(row)
    bottom = max(row.min(), F32(top - F32(16)))
    scale = F32(F32(top - bottom) / F32(65535))
    out = np.zeros(row_width(n), np.uint16)
    out[:4] = np.array([scale, F32(F32(bottom - top) - lse)], F32).view(np.uint16)
    if scale:
        shifted = (F32(F32(1) / scale) * (row - bottom)).astype(F32) + F32(12582912)  # nearest_int
        levels = (shifted.view(np.int32) & 0x7FFFFF) - 0x400000
        out[4:4 + n] = np.where(row > bottom, levels & 0xFFFF, 0)
    return out, float(F32(F32(top + lse) - row[tok]))


def kld_row(row: np.ndarray, base: np.ndarray, tok: int) -> tuple:
    """llama-perplexity's log_softmax(n_vocab, logits, base_log_prob, tok, kld): (nll, nll_base,
    KL divergence, Δp, same top token)."""
    n = len(row)
    top, lse = log_sum_exp(row)
    scale, low = base[:4].view(F32)
    log_p_base = (scale * base[4:4 + n].astype(F32) + low).astype(F32)
    nll = F32(F32(top + lse) - row[tok])
    nll_base = -log_p_base[tok]
    norm = F32(top + lse)
    near = log_p_base > F32(-16)
    terms = (expf(log_p_base[near]) * ((log_p_base[near] - row[near]) + norm)).astype(F32)
    kld = 0.0
    for t in terms:
        kld += float(t)
    p_diff = F32(expf(-nll) - expf(-nll_base))
    return nll, nll_base, kld, p_diff, int(np.argmax(row)) == int(np.argmax(log_p_base))


def logit_rows(rng, n_rows: int, n_vocab: int) -> np.ndarray:
    rows = (rng.standard_normal((n_rows, n_vocab)) * rng.uniform(0.5, 8, (n_rows, 1))).astype(F32)
    rows[0] = 1.5  # all equal: scale 0
    rows[1, :30] -= 40  # far below the top: stored as 0
    rows[2, 5] = rows[2].max() + 30  # one token takes it all
    rows[3, 9] = -np.inf
    return rows


@pytest.mark.parametrize("n_vocab", [256, 301])  # 301: rows padded with one uint16
def test_base_rows_are_llama_perplexitys(n_vocab):
    rng = np.random.default_rng(n_vocab)
    rows = logit_rows(rng, 9, n_vocab)
    targets = rng.integers(0, n_vocab, 9).astype(np.int32)
    q = np.full((9, row_width(n_vocab)), 7, np.uint16)  # what the kernel does not write stays
    q[:, :4] = 0
    q[:, 4 + n_vocab:] = 0
    params = np.empty((9, 2), F32)
    nll = quantize_log_probs(rows, targets, q, params)
    q[:, :4] = params.view(np.uint16)
    for r in range(9):
        want, want_nll = base_row(rows[r], targets[r])
        np.testing.assert_array_equal(q[r], want)
        assert nll[r] == want_nll


def test_kld_rows_are_llama_perplexitys():
    rng = np.random.default_rng(3)
    n, n_vocab = 8, 301
    base_logits = logit_rows(rng, n, n_vocab)
    targets = rng.integers(0, n_vocab, n).astype(np.int32)
    targets[2] = 5
    base = np.stack([base_row(base_logits[r], targets[r])[0] for r in range(n)])
    logits = (base_logits + rng.standard_normal((n, n_vocab)).astype(F32) * F32(0.3)).astype(F32)
    logits[0] = 1.5  # a row equal to its base's
    out = [np.empty(n, F32), np.empty(n, F32), np.empty(n), np.empty(n, F32), np.empty(n, np.bool_)]
    kld_rows(logits, targets, base, np.ascontiguousarray(base[:, :4]).view(F32), *out)
    for r in range(n):
        nll, nll_base, kld, p_diff, same = kld_row(logits[r], base[r], targets[r])
        assert (out[0][r], out[1][r], out[2][r], out[3][r], out[4][r]) == (nll, nll_base, kld, p_diff, same), r


def test_statistics_add_up_as_llama_perplexity():
    """The sums in token order with llama-perplexity's float32 products, chunk after chunk; its
    percentiles in float32 (linear between neighbours)."""
    rng = np.random.default_rng(4)
    chunks = [(rng.uniform(0, 8, 50).astype(F32), rng.uniform(0, 8, 50).astype(F32), rng.uniform(0, 2, 50),
               rng.uniform(-1, 1, 50).astype(F32), rng.random(50) < 0.7) for _ in range(3)]
    result = KLDivergenceResult()
    sums = dict.fromkeys(("nll", "nll2", "nll_base", "nll_base2", "nll_nll_base", "kld", "kld2", "p_diff",
                          "p_diff2", "p_diff4"), 0.0)
    for chunk in chunks:
        result.add(*chunk)
        for nll, nll_base, kld, p_diff, _ in zip(*chunk):
            sums["nll"] += float(nll)
            sums["nll2"] += float(nll * nll)
            sums["nll_base"] += float(nll_base)
            sums["nll_base2"] += float(nll_base * nll_base)
            sums["nll_nll_base"] += float(nll * nll_base)
            sums["kld"] += kld
            sums["kld2"] += kld * kld
            sums["p_diff"] += float(p_diff)
            p_diff2 = float(p_diff * p_diff)
            sums["p_diff2"] += p_diff2
            sums["p_diff4"] += p_diff2 * p_diff2
    assert {k: getattr(result, k) for k in sums} == sums
    assert (result.count, result.n_chunks) == (150, 3)
    assert result.same_top == sum(int(c[4].sum()) for c in chunks)
    values = result.sorted_kld()
    assert values.dtype == F32 and len(values) == 150
    for fraction in (0.001, 0.1, 0.5, 0.999):
        assert percentile(values, fraction) == pytest.approx(np.percentile(values.astype(np.float64), 100 * fraction),
                                                             rel=1e-6)
    assert (percentile(values, 0.0), percentile(values, 1.0)) == (values[0], values[-1])
    assert median(values) == F32(F32(0.5) * (values[74] + values[75]))


# ---- the file: written, read back, refused when it is not one ------------------------------------
def write_file(path: Path, n_ctx: int = 12, n_vocab: int = 301, n_chunk: int = 2, seed: int = 0) -> np.ndarray:
    """A base file of random logits through BaseLogProbsWriter; returns its tokens."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, n_vocab, n_chunk * n_ctx).astype(np.int32)
    n_scored = n_ctx - 1 - n_ctx // 2  # 5: every kind of row of logit_rows
    out = io.BytesIO()
    out.write(MAGIC + np.array([n_ctx, n_vocab, n_chunk], "<i4").tobytes() + tokens.tobytes())
    writer = BaseLogProbsWriter(out, n_vocab)
    for c in range(n_chunk):
        writer.score(logit_rows(rng, n_scored, n_vocab)[None], tokens[None, c * n_ctx + 5:c * n_ctx + 5 + n_scored])
    path.write_bytes(out.getvalue())
    return tokens


def test_a_written_file_reads_back(tmp_path):
    tokens = write_file(tmp_path / "base.kld")
    base = BaseLogProbs.open(tmp_path / "base.kld")
    assert (base.n_ctx, base.n_vocab, base.n_chunk) == (12, 301, 2)
    assert base.tokens.tolist() == tokens.tolist()
    assert (tmp_path / "base.kld").stat().st_size == file_size(12, 301, 2)
    q, params = base.block(1, 0, 3)
    assert q.shape == (3, row_width(301)) and params.shape == (3, 2) and (params[:, 1] <= 0).all()


def corrupt(data: bytes, what: str) -> bytes:
    if what == "truncated":
        return data[:-1]
    if what == "longer":
        return data + b"\0\0"
    if what == "magic":
        return b"_lodits_" + data[8:]
    if what == "header":
        return data[:8] + np.int32(-8).tobytes() + data[12:]
    if what == "token":
        return data[:20] + np.int32(301).tobytes() + data[24:]
    if what == "row":  # the first row's scale: NaN
        return data[:20 + 4 * 24] + np.float32(np.nan).tobytes() + data[20 + 4 * 24 + 4:]
    raise ValueError(what)


@pytest.mark.parametrize("what, message", [
    ("truncated", "is truncated: 2 chunks of 12 tokens over a vocabulary of 301 take"),
    ("longer", "has 2 bytes too many"),
    ("magic", "is not a file of base log-probabilities (it does not start with _logits_"),
    ("header", "is corrupt: its header says n_ctx -8"),
    ("token", "is corrupt: its token 0 is 301, outside the vocabulary of 301 tokens"),
    ("row", "is corrupt: row 0 of chunk 1 has scale nan"),
])
def test_a_damaged_file_is_refused(tmp_path, what, message):
    path = tmp_path / "base.kld"
    write_file(path)
    path.write_bytes(corrupt(path.read_bytes(), what))
    with pytest.raises(InputError, match=re.escape(message)):
        BaseLogProbs.open(path).block(0, 0, 3)


def test_a_file_of_another_vocabulary_is_refused(tmp_path):
    write_file(tmp_path / "base.kld")
    with pytest.raises(InputError, match="holds log-probabilities over 301 tokens, but the model's vocabulary has 512"):
        BaseLogProbs.open(tmp_path / "base.kld").require_vocabulary(512)
    with pytest.raises(InputError, match="base log-probabilities file not found"):
        BaseLogProbs.open(tmp_path / "absent.kld")


# ---- the library on stories260K ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def stories(stories_path):
    return llamapy.load_model(stories_path)


@pytest.fixture(scope="module")
def stories_base(stories, wiki_path, tmp_path_factory):
    """stories260K's base file of 8 chunks of 128 tokens, and its perplexity result."""
    path = tmp_path_factory.mktemp("kld") / "stories.kld"
    tokens = stories.vocab.tokenize(wiki_path.read_text(encoding="utf-8")[:100_000], add_special=True)
    result = perplexity(stories, tokens, 128, n_batch=128, n_chunks=8, kl_divergence_base=path)
    return path, result, tokens


def test_the_base_run_keeps_its_perplexity(stories, stories_base):
    """Writing the file changes only the float32 rounding of each NLL (llama-perplexity's in
    that mode): the same PPL to 1e-6, and the file holds the run's chunks."""
    path, result, tokens = stories_base
    plain = perplexity(stories, tokens, 128, n_batch=128, n_chunks=8)
    assert result.ppl == pytest.approx(plain.ppl, rel=1e-6) and result.n_chunks == 8
    base = BaseLogProbs.open(path)
    assert (base.n_ctx, base.n_chunk) == (128, 8) and base.tokens.tolist() == tokens[:8 * 128]


def test_a_model_against_its_own_base(stories, stories_base):
    """Same model, same chunks: only the file parts them (log-probabilities in 16 bits, and
    those more than 16 below the top raised to that floor): KLD ~1e-7, every top token the
    same, and PPL(base) lower (its rare tokens less surprising), as in llama-perplexity."""
    path, result, _ = stories_base
    seen = []
    kld = kl_divergence(stories, path, n_batch=128, on_chunk=lambda i, n, r: seen.append((i, n, r.count)))
    assert seen == [(i, 8, 63 * i) for i in range(1, 9)]
    assert kld.ppl()[0] == pytest.approx(result.ppl, rel=1e-12)
    assert 0.95 * result.ppl < kld.ppl_base()[0] < result.ppl
    assert 0 <= kld.kl_divergence()[0] < 1e-6 and kld.same_top_fraction()[0] == 1.0
    assert abs(kld.mean_p_diff()[0]) < 1e-4


def test_several_chunks_per_decode_give_the_same_figures(stories, stories_base):
    """-b 2048 decodes 4 chunks of 128 at once (one KV stream each; 6 chunks: passes of 4 and
    2): the rows reach the statistics in the file's order, and the figures stay those of one
    chunk at a time, to rounding."""
    path, _, _ = stories_base
    one = kl_divergence(stories, path, n_batch=128, n_chunks=6)
    four = kl_divergence(stories, path, n_batch=2048, n_chunks=6)
    assert (one.n_chunks, four.n_chunks) == (6, 6)
    for stat in ("ppl", "ppl_base", "kl_divergence", "rms_p_diff", "same_top_fraction"):
        assert getattr(four, stat)() == pytest.approx(getattr(one, stat)(), rel=1e-4), stat
    np.testing.assert_allclose(four.sorted_kld(), one.sorted_kld(), rtol=1e-3, atol=1e-7)


# ---- llamapy-perplexity against llama-perplexity ----------------------------------------------------
@dataclass
class Recorded:
    """tests/data/llama_cpp_kld_NAME.txt: what record_llama_cpp_kld.py saw llama.cpp do."""
    quantized_sha256: str
    base_bytes: int
    base_sha256: str
    chunk_sha256: list[str]  # per chunk of the base file: its tokens and rows
    base_lines: list[str]  # the base run's running estimates and final line
    kld_lines: list[str]   # everything the KL-divergence run printed on stdout

    @classmethod
    def load(cls, name: str) -> Recorded:
        lines = (DATA / f"llama_cpp_kld_{name}.txt").read_text(encoding="utf-8").splitlines()
        base_at = next(i for i, line in enumerate(lines) if line.startswith("== base run:"))
        kld_at = next(i for i, line in enumerate(lines) if line.startswith("== kld run:"))
        head = dict(line.split(": ", 1) for line in lines[:base_at])
        return cls(head[next(k for k in head if k.startswith("quantized"))], int(head["base bytes"]),
                   head["base sha256"], head.get("chunk sha256", "").split(), lines[base_at + 1:kld_at],
                   lines[kld_at + 1:])


def quantize(src: Path, dst: Path, qtype: str) -> None:
    """The quantized model of the recorded run, by llamapy-quantize (llama-quantize's bytes)."""
    done = tool_process("quantize", "--allow-requantize", src, dst, qtype)
    assert done.returncode == 0, done.stderr


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """llamapy-perplexity in this process (test_perplexity.py's acceptance run is a child process)."""
    return tool_process("perplexity", *args)


NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def assert_same_figures(ours: list[str], theirs: list[str]) -> None:
    """Line by line, the same words and the same numbers: within REL relative, or one unit of
    the last digit printed (a figure may round the other way where both are that close)."""
    assert len(ours) == len(theirs), "\n".join(ours)
    for a, b in zip(ours, theirs):
        assert NUMBER.split(a) == NUMBER.split(b), (a, b)
        for x, y in zip(NUMBER.findall(a), NUMBER.findall(b)):
            unit = 10.0 ** -len(y.partition(".")[2])
            assert abs(float(x) - float(y)) <= max(REL * abs(float(y)), unit * 1.000001), (a, b)


@dataclass
class CaseRun:
    recorded: Recorded
    chunks: int | None  # the first chunks of the recorded run, or None: all of them
    base: Path
    base_run: subprocess.CompletedProcess
    kld_run: subprocess.CompletedProcess


@pytest.fixture(scope="module", params=[pytest.param("stories260K", marks=pytest.mark.slow),
                                        pytest.param("gemma3", marks=pytest.mark.slow)])
def case_run(request, wiki_path, tmp_path_factory):
    """A recorded case run by llamapy-perplexity: the base run writes its file (of the first
    chunks only, where the case says so), the quantized model is made, the KL-divergence run
    reads the file. The files go when the module ends."""
    name = request.param
    qtype, base_flags, kld_flags, chunks = CASES[name]
    if chunks is not None:
        at = base_flags.index("--chunks") + 1
        base_flags = [*base_flags[:at], str(chunks), *base_flags[at + 1:]]
    model = request.getfixturevalue("gemma3_path" if name == "gemma3" else "stories_path")
    recorded = Recorded.load(name)
    work = tmp_path_factory.mktemp(f"kld-{name}")
    base, quantized = work / f"{name}.kld", work / f"{name}-{qtype}.gguf"
    try:
        base_run = run_cli("-m", str(model), "-f", str(wiki_path), *base_flags, "--kl-divergence-base", str(base))
        assert base_run.returncode == 0, base_run.stderr
        quantize(model, quantized, qtype)
        assert file_sha256(quantized) == recorded.quantized_sha256, f"the {qtype} model is not the one llama.cpp ran"
        kld_run = run_cli("-m", str(quantized), *kld_flags, "--kl-divergence", "--kl-divergence-base", str(base))
        assert kld_run.returncode == 0, kld_run.stderr
        yield CaseRun(recorded, chunks, base, base_run, kld_run)
    finally:
        base.unlink(missing_ok=True)
        quantized.unlink(missing_ok=True)


def test_the_base_file_is_llama_perplexitys(case_run):
    """Acceptance: the same bytes as llama-perplexity's file for the same model, text and
    flags (so either tool reads the other's), and the base run's printed perplexities; on the
    first chunks only, the same bytes chunk by chunk and the same running estimates."""
    final = re.search(r"Final estimate: PPL = .*", case_run.base_run.stderr).group(0)
    recorded = case_run.recorded
    if case_run.chunks is None:
        assert case_run.base.stat().st_size == recorded.base_bytes
        assert file_sha256(case_run.base) == recorded.base_sha256
        assert_same_figures([case_run.base_run.stdout.strip(), final], recorded.base_lines)
        return
    k = case_run.chunks
    assert chunk_digests(case_run.base) == recorded.chunk_sha256[:k]
    running = recorded.base_lines[0].split(",")[:k]
    assert_same_figures([case_run.base_run.stdout.strip()], [",".join(running) + ","])
    assert_same_figures([final.split(" +/- ")[0]], [f"Final estimate: PPL = {running[-1].split(']')[1]}"])


def test_the_kl_divergence_figures_are_llama_perplexitys(case_run):
    """Acceptance: every figure of the KL-divergence run (its table per chunk, the perplexity,
    KL-divergence and token-probability statistics) as llama-perplexity prints it, to 1e-4
    (Gemma 3: its Q4_K_M quantized again to Q4_0, against its own base file); on the first
    chunks only, the table's rows of those chunks, and the statistics' lines by their names."""
    ours = [line.rstrip() for line in case_run.kld_run.stdout.splitlines() if line.strip()]
    theirs = case_run.recorded.kld_lines
    if case_run.chunks is None:
        assert_same_figures(ours, theirs)
        return
    k = case_run.chunks
    assert_same_figures(ours[:k + 1], theirs[:k + 1])
    def words(line: str) -> list[str]:
        return [" ".join(part.split()) for part in NUMBER.split(line)]
    n_recorded_chunks = len(case_run.recorded.chunk_sha256)
    assert [words(line) for line in ours[k + 1:]] == [words(line) for line in theirs[n_recorded_chunks + 1:]]


# ---- the command line ---------------------------------------------------------------------------------
def test_the_cli_compares_a_model_with_its_base(stories_path, wiki_path, tmp_path, capsys):
    """A base run then a KL-divergence run, in this process: the table, then the statistics
    (from 100 scored tokens: 4 chunks of 31); -f is not read then, and a note says so."""
    from test_cli_flags import run_tool
    text = tmp_path / "t.txt"
    text.write_text(wiki_path.read_text(encoding="utf-8")[:8000], encoding="utf-8")
    base = tmp_path / "base.kld"
    code, out, err = run_tool("perplexity", "-m", str(stories_path), "-f", str(text), "-c", "64", "--chunks", "4",
                              "--kl-divergence-base", str(base), capsys=capsys)
    assert code == 0 and out.startswith("[1]") and "Final estimate" in err
    assert BaseLogProbs.open(base).n_chunk == 4
    code, out, err = run_tool("perplexity", "-m", str(stories_path), "-f", str(text), "--kl-divergence",
                              "--kl-divergence-base", str(base), capsys=capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("chunk             PPL") and lines[4].startswith("   4 ")
    assert "Mean    KLD:" in out and out.rstrip().splitlines()[-1].startswith("Same top p: 100.000 ±")
    assert "note: -f/-p: no effect: the tokens come from the --kl-divergence-base file" in err


@pytest.mark.parametrize("setup, argv, message", [
    (None, ["--kl-divergence"], "--kl-divergence needs --kl-divergence-base FNAME"),
    (None, ["--kl-divergence-base", "{base}"], "give the text to score with -f FILE (or -p TEXT)"),
    (None, ["-f", "{text}", "--kl-divergence-base", "{model}"], "--kl-divergence-base {model} is the file -m reads"),
    ("truncated", ["--kl-divergence", "--kl-divergence-base", "{base}"], "is truncated"),
    ("vocabulary", ["--kl-divergence", "--kl-divergence-base", "{base}"],
     "holds log-probabilities over 301 tokens, but the model's vocabulary has 512"),
    ("context", ["-c", "64", "--kl-divergence", "--kl-divergence-base", "{base}"],
     "was computed with a context of 128, while the context is 64: give -c 128"),
    ("absent", ["--kl-divergence", "--kl-divergence-base", "{base}"], "base log-probabilities file not found"),
])
def test_bad_kl_divergence_runs_are_one_line(stories_path, tmp_path, capsys, setup, argv, message):
    from test_cli_flags import one_error_line, run_tool
    base, text = tmp_path / "base.kld", tmp_path / "t.txt"
    text.write_text("Once upon a time. " * 100, encoding="utf-8")
    if setup in ("truncated", "context"):
        write_file(base, n_ctx=128, n_vocab=512, n_chunk=1)
    elif setup == "vocabulary":
        write_file(base)
    if setup == "truncated":
        base.write_bytes(base.read_bytes()[:-100])
    names = {"base": str(base), "text": str(text), "model": str(stories_path)}
    code, _, err = run_tool("perplexity", "-m", str(stories_path), *(a.format(**names) for a in argv), capsys=capsys)
    assert code != 0 and message.format(**names) in one_error_line(err)
