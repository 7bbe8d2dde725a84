"""llamapy.vocab against llama.cpp's own tokenizer test files and behaviour.

The `.inp`/`.out` pairs are llama.cpp's tests/test-tokenizer-0 data: texts separated by
"\\n__ggml_vocab_test__\\n", one line of expected ids per text, tokenized there with
add_special=False, parse_special=False.
"""
import time
from functools import lru_cache
from pathlib import Path

import gguf
import pytest

from conftest import shared_path
from llamapy.errors import VocabError
from llamapy.vocab import TYPE_BYTE, TYPE_CONTROL, TYPE_NORMAL, TYPE_UNKNOWN, Vocab

VOCABS = ["llama-spm", "llama-bpe", "gpt-2", "qwen2", "phi-3"]
TEST_SEPARATOR = "\n__ggml_vocab_test__\n"


def vocab_file(name: str) -> Path:
    return shared_path("data", "vocab", f"ggml-vocab-{name}.gguf")


@lru_cache(maxsize=None)
def load_vocab(path: Path) -> Vocab:
    """Vocabs are slow to read (GGUFReader parses every string), so load each once."""
    return Vocab.from_gguf(gguf.GGUFReader(path))


def read_cases(path: Path) -> list[tuple[str, list[int]]]:
    """Texts and expected ids, split exactly like llama.cpp's read_tests()."""
    raw = Path(f"{path}.inp").read_bytes().decode("utf-8")
    texts: list[str] = []
    pos = 0
    while pos < len(raw):
        nxt = raw.find(TEST_SEPARATOR, pos)
        if nxt < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:nxt])
        pos = nxt + len(TEST_SEPARATOR)
    lines = Path(f"{path}.out").read_text(encoding="utf-8").splitlines()
    assert len(texts) == len(lines), f"{path}: {len(texts)} texts but {len(lines)} expected lines"
    return [(text, [int(t) for t in line.split()]) for text, line in zip(texts, lines)]


@pytest.mark.parametrize("name", VOCABS)
def test_tokenize_matches_llama_cpp(name: str) -> None:
    path = vocab_file(name)
    vocab = load_vocab(path)
    cases = read_cases(path)
    mismatches = []
    for text, expected in cases:
        got = vocab.tokenize(text, add_special=False, parse_special=False)
        if got != expected:
            mismatches.append((text, got, expected))
    if mismatches:
        text, got, expected = mismatches[0]
        pytest.fail(f"{name}: {len(mismatches)}/{len(cases)} texts mismatch; first: {text!r}\n"
                    f"  got      {got}\n  expected {expected}")


PLAIN_TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog",
    "  two leading spaces\nand a second line\n",
    "Äpfel und Birnen kosten 3,50 €",
    "tabs\tand emoji 🦙 and 中文",
]


@pytest.mark.parametrize("name", VOCABS)
def test_detokenize_round_trip(name: str) -> None:
    vocab = load_vocab(vocab_file(name))
    for text in PLAIN_TEXTS:
        assert vocab.detokenize(vocab.tokenize(text, add_special=False)) == text


@pytest.mark.parametrize("name, bos", [("llama-spm", 1), ("llama-bpe", 128000), ("phi-3", 1)])
def test_bos_added(name: str, bos: int) -> None:
    vocab = load_vocab(vocab_file(name))
    assert vocab.add_bos and vocab.bos_id == bos
    assert vocab.tokenize("Hello")[0] == bos
    assert bos not in vocab.tokenize("Hello", add_special=False)
    assert vocab.tokenize("") == [bos]
    assert vocab.tokenize("", add_special=False) == []


@pytest.mark.parametrize("name", ["gpt-2", "qwen2"])
def test_no_bos_when_metadata_says_so(name: str) -> None:
    vocab = load_vocab(vocab_file(name))
    assert not vocab.add_bos and not vocab.add_eos
    assert vocab.tokenize("Hello") == vocab.tokenize("Hello", add_special=False)


def test_stories_wiki_token_count(stories_path: Path, wiki_path: Path) -> None:
    """The perplexity run over wiki.test.raw at n_ctx=128 has 6322 chunks in llama.cpp."""
    vocab = Vocab.from_gguf(gguf.GGUFReader(stories_path))
    text = wiki_path.read_bytes().decode("utf-8")
    start = time.perf_counter()
    tokens = vocab.tokenize(text, add_special=True)
    elapsed = time.perf_counter() - start
    assert tokens[0] == vocab.bos_id
    assert len(tokens) // 128 == 6322
    assert elapsed < 10, f"tokenizing {len(text)} characters took {elapsed:.1f} s"


def test_spm_special_tokens_and_space_prefix() -> None:
    vocab = load_vocab(vocab_file("llama-spm"))
    hello = vocab.tokenize("Hello", add_special=False)
    # parsed "<s>" is one token, and the text after it gets the space prefix again
    assert vocab.tokenize("<s>Hello", parse_special=True) == [1, 1, *hello]
    assert vocab.tokenize("<s>Hello")[:2] != [1, 1]
    assert vocab.detokenize([1, *hello]) == " Hello"  # BOS kept: its space stays, as in llama.cpp
    assert vocab.detokenize(hello) == "Hello"
    assert vocab.detokenize([1, *hello], unparse_special=True) == "<s> Hello"


def test_bpe_special_tokens_and_clean_spaces() -> None:
    vocab = load_vocab(vocab_file("llama-bpe"))
    text = "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
    ids = vocab.tokenize(text, add_special=False, parse_special=True)
    assert ids[0] == 128006 and ids[2] == 128007 and ids[-1] == 128009
    assert vocab.detokenize(ids, unparse_special=True) == text
    assert vocab.detokenize(ids) == "user\n\nHi!"
    assert 128009 not in vocab.tokenize(text, add_special=False)
    # llama.cpp's clean_spaces removes spaces a word tokenizer left before punctuation
    assert vocab.detokenize(vocab.tokenize("Hi , you 're here .", add_special=False)) == "Hi, you're here."


def test_phi3_special_tokens_strip_following_space() -> None:
    vocab = load_vocab(vocab_file("phi-3"))
    ids = vocab.tokenize("<|user|>\nHi<|end|>", parse_special=True)
    assert ids[:2] == [1, 32010] and ids[-1] == 32007
    assert [vocab.token_text(i) for i in ids[2:-1]] == ["▁Hi"]


def test_token_pieces_and_types() -> None:
    vocab = load_vocab(vocab_file("llama-spm"))
    assert vocab.n_tokens == 32000
    assert vocab.token_type(0) == TYPE_UNKNOWN and vocab.token_type(1) == TYPE_CONTROL
    assert vocab.token_type(13) == TYPE_BYTE and vocab.token_text(13) == "<0x0A>"
    assert vocab.token_to_piece(13) == b"\n"
    assert vocab.token_to_piece(1) == b"" and vocab.token_to_piece(1, special=True) == b"<s>"
    hello = vocab.tokenize(" Hello", add_special=False)[-1]
    assert vocab.token_type(hello) == TYPE_NORMAL and vocab.token_to_piece(hello) == b" Hello"
    # byte fallback pieces are partial UTF-8 that only decode together
    llama = vocab.tokenize("🦙", add_special=False)
    assert b"".join(vocab.token_to_piece(t) for t in llama).decode("utf-8").strip() == "🦙"


def test_end_of_generation_tokens() -> None:
    bpe = load_vocab(vocab_file("llama-bpe"))
    assert bpe.eos_id == 128001 and bpe.eot_id == 128009
    assert bpe.is_eog(128001) and bpe.is_eog(128009) and not bpe.is_eog(128000)
    qwen = load_vocab(vocab_file("qwen2"))
    assert qwen.eot_id == 151645 and qwen.is_eog(151643) and qwen.is_eog(151645)
    assert qwen.pad_id == 151643 and qwen.unk_id is None


# --- hand-made GGUF files -------------------------------------------------------------


def write_gguf(path: Path, model: str, tokens: list[str], pre: str | None = None,
               merges: list[str] | None = None, **flags: bool) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([TYPE_NORMAL] * len(tokens))
    if merges is not None:
        writer.add_token_merges(merges)
    for key, value in flags.items():
        writer.add_bool(f"tokenizer.ggml.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


BYTE_LEVEL_TOKENS = ["a", "b", "Ġ", "ab", "Ġa"]


def test_unsupported_tokenizer_model(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "bert.gguf", "bert", ["[UNK]", "a"])
    with pytest.raises(VocabError, match="bert"):
        Vocab.from_gguf(gguf.GGUFReader(path))


def test_unsupported_pre_tokenizer(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "pre.gguf", "gpt2", BYTE_LEVEL_TOKENS, pre="no-such-pre", merges=["a b"])
    with pytest.raises(VocabError, match="no-such-pre"):
        Vocab.from_gguf(gguf.GGUFReader(path))


def test_bpe_without_merges_is_refused(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "nomerges.gguf", "gpt2", BYTE_LEVEL_TOKENS, pre="gpt-2")
    with pytest.raises(VocabError, match="merges"):
        Vocab.from_gguf(gguf.GGUFReader(path))


def test_default_pre_tokenizer_and_flags(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "tiny.gguf", "gpt2", BYTE_LEVEL_TOKENS, merges=["a b", "Ġ a"],
                      add_bos_token=True, add_eos_token=True)
    with pytest.raises(VocabError, match="bos_token_id"):  # default BOS id 11 is out of range
        Vocab.from_gguf(gguf.GGUFReader(path))
    path = write_gguf(tmp_path / "tiny2.gguf", "gpt2", BYTE_LEVEL_TOKENS, merges=["a b", "Ġ a"])
    vocab = Vocab.from_gguf(gguf.GGUFReader(path))
    assert vocab.tokenize("ab a") == [3, 4]
    assert vocab.detokenize([3, 4]) == "ab a"


def test_spm_add_space_prefix_false(tmp_path: Path) -> None:
    tokens = ["<unk>", "<s>", "</s>", "▁", "a", "b", "▁a", "ab"]
    on = Vocab.from_gguf(gguf.GGUFReader(write_gguf(tmp_path / "on.gguf", "llama", tokens)))
    off = Vocab.from_gguf(gguf.GGUFReader(
        write_gguf(tmp_path / "off.gguf", "llama", tokens, add_space_prefix=False)))
    assert on.tokenize("a b", add_special=False) == [6, 3, 5]
    assert off.tokenize("a b", add_special=False) == [4, 3, 5]
    assert on.tokenize("a") == [1, 6] and off.tokenize("a") == [1, 4]
