"""A long text is tokenized in bounded pieces (llamapy.long_text) with the ids of the text
tokenized whole, so its memory is a small multiple of its size whatever its line lengths (one
100 MB line once grew a process to 3.5 GB); a text with nowhere to cut it is refused in one
line before any of it is encoded."""
from __future__ import annotations

import sys
from functools import lru_cache

import pytest

from llamapy import long_text
from llamapy.errors import InputError
from llamapy.gguf_file import GGUFFile
from llamapy.vocab import Vocab

from conftest import REPO_ROOT, shared_path
from test_hostile_cli import digest, one_error, run_tool

sys.path.insert(0, str(REPO_ROOT / "bench"))
from peak_rss import peak_rss_mb  # noqa: E402  (bench/ is no package)

VOCABS = {"spm": ("models", "stories260K.gguf"), "bpe": ("data", "vocab", "ggml-vocab-qwen2.gguf"),
          "gemma4": ("data", "vocab", "ggml-vocab-gemma-4.gguf")}


@lru_cache(maxsize=None)
def vocab(kind: str) -> Vocab:
    return Vocab.from_gguf(GGUFFile(shared_path(*VOCABS[kind])))


@pytest.fixture(scope="module")
def texts(wiki_path) -> list[str]:
    """Prose with headings and blank lines, a play's short lines, llama.cpp's tokenizer test
    texts (runs of spaces, tabs, newlines, emoji, CJK), and one long line of prose."""
    wiki = wiki_path.read_text(encoding="utf-8")
    tests = shared_path("data", "vocab", "ggml-vocab-llama-spm.gguf.inp").read_text(encoding="utf-8")
    play = shared_path("data", "tinyshakespeare.txt").read_text(encoding="utf-8")[:8000]
    return [wiki[:12000], play, tests, wiki[20000:30000].replace("\n", " ")]


@pytest.mark.parametrize("kind", sorted(VOCABS))
@pytest.mark.parametrize("piece_chars", [500, 4000])
def test_pieces_give_the_ids_of_the_whole_text(texts, monkeypatch, kind: str, piece_chars: int) -> None:
    """Cut every `piece_chars` characters (hundreds of cuts) against the texts whole."""
    assert max(map(len, texts)) < long_text.PIECE_CHARS  # as they are, each is one piece
    whole = [vocab(kind).tokenize(t, parse_special=special) for t in texts for special in (False, True)]
    monkeypatch.setattr(long_text, "PIECE_CHARS", piece_chars)
    cut = [vocab(kind).tokenize(t, parse_special=special) for t in texts for special in (False, True)]
    assert cut == whole


def test_tokenize_array_is_tokenize(texts) -> None:
    v = vocab("spm")
    array = v.tokenize_array(texts[0])
    assert array.dtype.name == "int32" and array.tolist() == v.tokenize(texts[0])


def counting(v: Vocab, monkeypatch) -> list[int]:
    """How many times `v` encodes a piece (the list's one item)."""
    calls, encode = [0], v._encode

    def counted(text: str) -> list[int]:
        calls[0] += 1
        return encode(text)
    monkeypatch.setattr(v, "_encode", counted)
    return calls


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_a_run_without_whitespace_past_the_limit_is_refused_before_encoding(monkeypatch, where: str) -> None:
    monkeypatch.setattr(long_text, "PIECE_CHARS", 500)
    monkeypatch.setattr(long_text, "MAX_RUN_CHARS", 4000)
    prose, run = "Once upon a time, there was a girl. " * 300, "x" * 4001
    text = {"start": run + " " + prose, "middle": prose + run + " " + prose, "end": prose + run}[where]
    v = vocab("spm")
    calls = counting(v, monkeypatch)
    with pytest.raises(InputError) as error:
        v.tokenize(text)
    start = text.index(run)
    assert str(error.value) == (f"the text to tokenize has 4001 characters without whitespace (from character "
                                f"{start}): llamapy tokenizes a long text in pieces cut at whitespace, at most 4000 "
                                "characters at a time; add line breaks or spaces to it")
    assert calls[0] == 0


def test_a_run_up_to_the_limit_is_tokenized_as_whole(monkeypatch) -> None:
    """A run of MAX_RUN_CHARS is not cut (it has nowhere to be): its piece is longer, its ids
    those of the whole text."""
    prose = "Once upon a time, there was a girl. " * 100
    text = prose + "ab" * 2000 + " " + prose
    v = vocab("spm")
    whole = v.tokenize(text)
    monkeypatch.setattr(long_text, "PIECE_CHARS", 500)
    monkeypatch.setattr(long_text, "MAX_RUN_CHARS", 4000)
    assert v.tokenize(text) == whole


def test_a_tool_refuses_a_text_of_one_character_in_one_line(tmp_path, stories_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(long_text, "MAX_RUN_CHARS", 100_000)
    text = tmp_path / "one.txt"
    text.write_text("a" * 300_000, encoding="utf-8")
    before = digest(text)
    code, err = run_tool("perplexity", "-m", stories_path, "-f", text, "-c", "16", capsys=capsys)
    assert code != 0 and "the text to tokenize has 300000 characters without whitespace" in one_error(err)
    assert digest(text) == before


CHILD = """
import resource, sys
from llamapy.gguf_file import GGUFFile
from llamapy.text_input import read_text_file
from llamapy.vocab import Vocab
vocab = Vocab.from_gguf(GGUFFile(sys.argv[1]))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
tokens = vocab.tokenize_array(read_text_file(sys.argv[2]))
print("GROWTH_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before, len(tokens))
"""


def test_one_long_line_takes_a_small_multiple_of_its_size(tmp_path, stories_path, wiki_path) -> None:
    """6 MB of prose on one line (tokenized whole it took 50 times its size: 1.1 GB for 20 MB)
    grows a process by less than 8 times its size: the text, its ids, one piece at a time."""
    line = wiki_path.read_text(encoding="utf-8").replace("\n", " ")
    path = tmp_path / "line.txt"
    path.write_text((line * (6_000_000 // len(line) + 1))[:6_000_000], encoding="utf-8")
    size_mb = path.stat().st_size / 2**20
    result, _ = peak_rss_mb([sys.executable, "-c", CHILD, str(stories_path), str(path)], REPO_ROOT)
    assert result.returncode == 0, result.stderr
    growth_kb, n_tokens = map(int, result.stdout.split("GROWTH_KB")[1].split())
    assert n_tokens > 3_000_000
    assert growth_kb / 1024 < 8 * size_mb, f"{growth_kb / 1024:.0f} MB for a {size_mb:.1f} MB line"


PARTS = ["the", "Once", "upon", " ", "  ", "\t", "\n", "\n\n", " \n ", ".", ",", "'s", "don't", "42", "1234567",
         "日本語", "のテキスト", "🦙", "é", "—", "<s>", "</s>", "<|im_end|>", "▁", "   \t  "]


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(VOCABS))
def test_fuzz_pieces_give_the_ids_of_the_whole_text(monkeypatch, kind: str) -> None:
    """Seeded random texts of words, whitespace runs, digits, CJK, emoji and special-token
    texts, cut every 100 characters, against the texts whole."""
    import random
    rng = random.Random(1234)
    texts = ["".join(rng.choice(PARTS) for _ in range(rng.randint(50, 600))) for _ in range(40)]
    whole = [vocab(kind).tokenize(t, parse_special=True) for t in texts]
    monkeypatch.setattr(long_text, "PIECE_CHARS", 100)
    for text, ids in zip(texts, whole):
        assert vocab(kind).tokenize(text, parse_special=True) == ids, text[:80]
