"""llamapy.vocab against llama.cpp's own tokenizer test files and behaviour.

The `.inp`/`.out` pairs are llama.cpp's tests/test-tokenizer-0 data: texts separated by
"\\n__ggml_vocab_test__\\n", one line of expected ids per text, tokenized there with
add_special=False, parse_special=False. Pre-tokenizer types without such a file are checked
against llama.cpp's output recorded by record_llama_cpp_pre.py.
"""
import json
import time
from functools import lru_cache
from pathlib import Path

import gguf
import pytest

from conftest import shared_path, tool_process
from llamapy.errors import VocabError
from llamapy.gguf_file import GGUFFile, MetaValue, ValueType
from llamapy.pretokenizers import PRE_TOKENIZERS, PreTokenizer
from llamapy.vocab import TYPE_BYTE, TYPE_CONTROL, TYPE_NORMAL, TYPE_UNKNOWN, Vocab, _byte_to_unicode

VOCABS = ["llama-spm", "llama-bpe", "gpt-2", "qwen2", "phi-3", "deepseek-coder", "command-r", "mpt", "refact",
          "qwen35", "gemma-4"]
TEST_SEPARATOR = "\n__ggml_vocab_test__\n"


def vocab_file(name: str) -> Path:
    return shared_path("data", "vocab", f"ggml-vocab-{name}.gguf")


@lru_cache(maxsize=None)
def load_vocab(path: Path) -> Vocab:
    """Building a big vocab's tokenizer takes a second, so each is built once."""
    return Vocab.from_gguf(GGUFFile(path))


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


@pytest.mark.parametrize("name, bos", [("llama-spm", 1), ("llama-bpe", 128000), ("phi-3", 1), ("gemma-4", 2)])
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


def test_gemma4_vocab() -> None:
    """gemma4 as llama.cpp runs it (ids from llama.cpp): BPE over raw UTF-8 with "▁" for
    spaces, a newline run that is a token taken whole, <0xXX> bytes for characters that are
    no token, "</s>" a normal token and not an end of generation."""
    vocab = load_vocab(vocab_file("gemma-4"))
    assert (vocab.bos_id, vocab.eos_id, vocab.unk_id, vocab.pad_id, vocab.mask_id) == (2, 1, 3, 0, 4)
    assert vocab.eot_id is None
    assert [t for t in range(vocab.n_tokens) if vocab.is_eog(t)] == [1, 50, 106]  # <eos> <|tool_response> <turn|>
    ids = vocab.tokenize("Hello world\n\n\n  x")
    assert ids == [2, 9259, 1902, 109, 138, 236781]
    assert [vocab.token_text(i) for i in ids[1:]] == ["Hello", "▁world", "\n\n\n", "▁▁", "x"]
    assert vocab.tokenize("🦙", add_special=False) == [478, 397, 404, 391]  # <0xF0> <0x9F> <0xA6> <0x99>
    chat = "<|turn>user\nHi<turn|>\n"
    ids = vocab.tokenize(chat, parse_special=True)
    assert ids == [2, 105, 2364, 107, 10979, 106, 107]
    assert vocab.detokenize(ids) == "user\nHi\n"
    assert vocab.detokenize(ids, unparse_special=True) == "<bos>" + chat
    assert vocab.tokenize("a</s>b", parse_special=True) == [2, 236746, 954, 236751, 236813, 236763]


def tokenizer_metadata(model: str, tokens: list[str], merges: list[str] | None, pre: str | None = None,
                       **scalars: int | bool) -> dict[str, MetaValue]:
    """A metadata dict as GGUFFile gives it; `scalars` are tokenizer.ggml.* ids and flags."""
    meta = {"tokenizer.ggml.model": MetaValue(ValueType.STRING, None, model),
            "tokenizer.ggml.tokens": MetaValue(ValueType.ARRAY, ValueType.STRING, tokens)}
    if merges is not None:
        meta["tokenizer.ggml.merges"] = MetaValue(ValueType.ARRAY, ValueType.STRING, merges)
    if pre is not None:
        meta["tokenizer.ggml.pre"] = MetaValue(ValueType.STRING, None, pre)
    for key, value in scalars.items():
        meta[f"tokenizer.ggml.{key}"] = MetaValue(ValueType.BOOL if isinstance(value, bool) else ValueType.UINT32,
                                                  None, value)
    return meta


@pytest.mark.parametrize("model, pre", [("gemma4", None), ("gemma4", "gpt-2"), ("gpt2", "granite-embed-multi-311m")])
def test_gemma4_pre_always_adds_bos(model: str, pre: str | None) -> None:
    """llama.cpp adds BOS for the gemma4 pre type whatever add_bos_token says; the gemma4
    model uses that pre type whatever tokenizer.ggml.pre says."""
    meta = tokenizer_metadata(model, ["<pad>", "<eos>", "<bos>", "a", "▁", "▁a"], ["▁ a"], pre,
                              bos_token_id=2, add_bos_token=False)
    vocab = Vocab.from_gguf(meta)
    assert vocab.add_bos and vocab.tokenize(" a a") == [2, 5, 5]
    assert vocab.detokenize([5, 5]) == " a a"


def test_kimi_k2_needs_no_merges() -> None:
    vocab = Vocab.from_gguf(tokenizer_metadata("gpt2", ["a", "b", "ab"], None, "kimi-k2"))
    assert vocab.tokenize("ab") == [0, 1]
    with pytest.raises(VocabError, match="merges"):
        Vocab.from_gguf(tokenizer_metadata("gpt2", ["a", "b", "ab"], None, "gpt-2"))


# --- every pre-tokenizer type against llama.cpp's recorded output -----------------------

PRE_GOLDEN = Path(__file__).parent / "data" / "llama_cpp_pre_tokenizers.json"
PRE_TEXTS = [
    "Hello world, it's 1234567 o'CLOCK! I'LL see you're fine.",
    "aÄb ÄPFEL äpfel ÄpFeL e\u0301te\u0301 caf\u00e9 Ǆǅ ʰ ß",
    "Text 中文字符𠀀abc 한국어 ひらがな カタカナ ①½٣ ¹²³ ١٢٣٤٥",
    "  lead\n\n\n  \n\t x\r\ny \u00a0z\u3000w\u2028v  ",
    "x1a 12ab ²123 123² 12345678 3.14159 1,000,000",
    "<sentinel:12> IMGIMGABZ  \t\t\u200bzero\ufeffwidth ﬁⅫ",
    "def f(x):\n    return x**2  # comment\n",
    "/\u0301'sc\x85|\u0301Z½  \t0-  XǄ  ʰ\tﬁⅫ()\u00a0\x85ß(",
    "/½+.`\u3000\n\n\t\u0301're\u3000Y٣~  YǄÉ(äZ",
    "=ひ!(\u2028=(1\t!/中中$1\u0301's\tßä٣ä\t1X",
]
CLEAN_PROBE = "Hi , you 're here . Isn 't it ?"


@lru_cache(maxsize=None)
def gpt2_metadata() -> dict[str, MetaValue]:
    return dict(GGUFFile(vocab_file("gpt-2")).metadata)


def pair_bpe_metadata(pre: str) -> dict[str, MetaValue]:
    """A byte-level BPE vocab (GPT-2's alphabet and hyper-parameters) in which every pair of
    the byte characters the test texts use is one merge: each piece the pre-tokenizer cuts
    becomes two-character tokens, so the ids show where it cut (real merges rarely span a cut)."""
    byte_chars = _byte_to_unicode()
    texts = [*PRE_TEXTS, CLEAN_PROBE, *PLAIN_TEXTS]
    alphabet = sorted({byte_chars[b] for text in texts for b in text.encode()})
    pairs = [(a, b) for a in alphabet for b in alphabet]
    tokens = [byte_chars[b] for b in range(256)] + [a + b for a, b in pairs]
    meta = {key: value for key, value in gpt2_metadata().items() if not key.startswith("tokenizer.")}
    meta.update(tokenizer_metadata("gpt2", tokens, [f"{a} {b}" for a, b in pairs], pre))
    meta["tokenizer.ggml.token_type"] = MetaValue(ValueType.ARRAY, ValueType.INT32, [TYPE_NORMAL] * len(tokens))
    return meta


@lru_cache(maxsize=None)
def pair_bpe_vocab(pre_type: PreTokenizer) -> Vocab:
    """Built once per pre type (aliases share one), under the first name it has."""
    name = next(name for name, known in PRE_TOKENIZERS.items() if known == pre_type)
    return Vocab.from_gguf(pair_bpe_metadata(name))


@lru_cache(maxsize=None)
def pre_golden() -> dict:
    return json.loads(PRE_GOLDEN.read_text(encoding="utf-8"))


def test_pre_tokenizer_recordings_cover_every_type() -> None:
    """Every pre type llama.cpp knows is registered, and recorded on today's texts."""
    assert sorted(pre_golden()["pre"]) == sorted(PRE_TOKENIZERS)
    assert pre_golden()["texts"] == PRE_TEXTS and pre_golden()["clean_probe"] == CLEAN_PROBE


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_pre_tokenizer_matches_llama_cpp(pre: str) -> None:
    """Ids, BOS/SEP flags and clean_spaces of each pre type, as llama.cpp gave them on the
    pair vocab; byte-level ones also round-trip."""
    golden = pre_golden()
    record = golden["records"][golden["pre"][pre]]
    vocab = pair_bpe_vocab(PRE_TOKENIZERS[pre])
    assert (vocab.add_bos, vocab.bos_id, vocab.add_sep) == (record["add_bos"], record["bos"], record["add_sep"])
    for text, expected in zip(PRE_TEXTS, record["ids"]):
        if expected is not None:  # None: llama.cpp aborts on this text
            assert vocab.tokenize(text, add_special=False) == [int(t) for t in expected.split()], text
    assert vocab.detokenize(vocab.tokenize(CLEAN_PROBE, add_special=False)) == record["clean_probe"]
    if PRE_TOKENIZERS[pre].byte_encode:  # SPM-style ones drop what GPT-2 has no token for
        for text in PLAIN_TEXTS:
            assert vocab.detokenize(vocab.tokenize(text, add_special=False)) == text


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
    with pytest.raises(VocabError, match=r"tokenizer.ggml.model = 'bert'; llamapy supports 'llama', 'gpt2', 'gemma4'$"):
        Vocab.from_gguf(gguf.GGUFReader(path))


def test_unsupported_pre_tokenizer(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "pre.gguf", "gpt2", BYTE_LEVEL_TOKENS, pre="no-such-pre", merges=["a b"])
    with pytest.raises(VocabError, match="tokenizer.ggml.pre = 'no-such-pre'; llamapy supports ") as error:
        Vocab.from_gguf(gguf.GGUFReader(path))
    message = str(error.value)
    assert "\n" not in message and all(f" {name}," in message or message.endswith(name) for name in PRE_TOKENIZERS)


@pytest.mark.parametrize("model, pre, expected", [
    ("bert", None, "tokenizer.ggml.model = 'bert'; llamapy supports 'llama', 'gpt2', 'gemma4'"),
    ("gpt2", "no-such-pre", "tokenizer.ggml.pre = 'no-such-pre'; llamapy supports a.x-4.0, afmoe, "),
])
def test_cli_reports_unsupported_tokenizer_in_one_line(tmp_path: Path, model: str, pre: str | None,
                                                       expected: str) -> None:
    path = write_gguf(tmp_path / "vocab.gguf", model, BYTE_LEVEL_TOKENS, pre=pre, merges=["a b"])
    text = tmp_path / "text.txt"
    text.write_text("Hello world", encoding="utf-8")
    proc = tool_process("perplexity", "-m", str(path), "-f", str(text))  # in this process: a start-up saved
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(f"error: {path}: unsupported "), proc.stderr
    assert expected in proc.stderr


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
