"""Hostile token shard directories (`--data DIR`): an edited index or shard (its digest
recomputed, as anyone editing a shard would) is refused when the directory is opened, with
one `error:` line and a non-zero exit, before any kernel sees an id: ids past the vocabulary,
a shard listed twice, an entry naming a file that is not one of the directory's token
files, lengths or masks that do not fit the tokens, and a --data-format the shards do not
hold. Nothing in the directory or the model is modified."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO_ROOT
from test_hostile_cli import digest, one_error, run_tool
from test_sft_cli import completions, write_jsonl

import llamapy
from llamapy.chat import ChatTemplate
from llamapy.errors import InputError
from llamapy.shard_dataset import shard_windows
from llamapy.token_shards import INDEX, TokenShards, _verify_tokens, write_token_shards

TRAIN = ["-c", "16", "--epochs", "1", "-t", "1"]


# ---- shard directories and the edits a user could make to them --------------------------------
def make_shards(vocab, root: Path) -> dict[str, Path]:
    """Small shard directories of each kind, each in several shards: a text, completions
    samples rendered with chatml (whole conversations learned), and {"text"} samples."""
    root.mkdir(parents=True, exist_ok=True)
    text = root / "story.txt"
    text.write_text("Once upon a time there was a little cat. The cat liked to play in the sun. " * 20,
                    encoding="utf-8")
    pairs, texts = root / "pairs.jsonl", root / "texts.jsonl"
    write_jsonl(pairs, completions(0, 8))
    write_jsonl(texts, [{"text": f"Tom had {i} red balls and a blue kite."} for i in range(8)])
    chatml = ChatTemplate.named("chatml", vocab)
    out = {"text": root / "text-shards", "completions": root / "pair-shards", "texts": root / "texts-shards"}
    write_token_shards([text], out["text"], vocab, shard_tokens=150)
    write_token_shards([pairs], out["completions"], vocab, chat_template=chatml, mask_prompt=False,  # learned
                       shard_tokens=200)                                  # in a window of 16 (the answers are later)
    write_token_shards([texts], out["texts"], vocab, shard_tokens=60)
    return out


def read_index(d: Path) -> dict:
    return json.loads((d / INDEX).read_text(encoding="utf-8"))


def write_index(d: Path, index) -> None:
    (d / INDEX).write_text(json.dumps(index), encoding="utf-8")


def rewrite_tokens(d: Path, k: int, ids: np.ndarray) -> None:
    """Shard k's tokens replaced by `ids`, its digest and count in the index recomputed (what
    a user editing a shard by hand would do)."""
    index = read_index(d)
    entry = index["shards"][k]
    data = np.asarray(ids).astype(np.dtype(index["dtype"]).newbyteorder("<")).tobytes()
    (d / entry["tokens"]).write_bytes(data)
    entry["digest"], entry["n_tokens"] = hashlib.blake2b(data, digest_size=16).hexdigest(), len(ids)
    write_index(d, index)


def tokens_of(d: Path, k: int) -> np.ndarray:
    index = read_index(d)
    return np.fromfile(d / index["shards"][k]["tokens"], np.dtype(index["dtype"]).newbyteorder("<"))


def hashes(d: Path) -> dict[str, str]:
    return {p.name: digest(p) for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def vocab(stories_path):
    return llamapy.load_model(stories_path).vocab


@pytest.fixture(scope="module")
def shard_dirs(vocab, tmp_path_factory):
    return make_shards(vocab, tmp_path_factory.mktemp("shards"))


@pytest.fixture
def clone(shard_dirs, tmp_path):
    """A copy of one of the shard directories to damage; every file of it (and the model
    copy) must be as it was after the run."""
    made: list[Path] = []

    def get(kind: str) -> Path:
        d = tmp_path / f"{kind}-{len(made)}"
        shutil.copytree(shard_dirs[kind], d)
        made.append(d)
        return d
    yield get
    for d in made:
        if (d / ".hashes").exists():
            assert (d / ".hashes").read_text() == json.dumps(hashes_without_marker(d)), f"{d} was modified"


def hashes_without_marker(d: Path) -> dict[str, str]:
    return {k: v for k, v in hashes(d).items() if k != ".hashes"}


def seal(d: Path) -> Path:
    """Record the directory's files as damaged, so the run can be checked to leave them alone."""
    (d / ".hashes").write_text(json.dumps(hashes_without_marker(d)))
    return d


@pytest.fixture
def model(tmp_path, stories_path):
    copy = tmp_path / "m.gguf"
    copy.write_bytes(stories_path.read_bytes())
    before = digest(copy)
    yield copy
    assert digest(copy) == before, "the model was modified"


def finetune(model: Path, data: Path, capsys, *extra: str) -> tuple[int, str, Path]:
    out = model.parent / "out.gguf"
    code, err = run_tool("finetune", "-m", model, "--data", data, *TRAIN, "-o", out, *extra, capsys=capsys)
    return code, err, out


def refused(model: Path, data: Path, capsys, *extra: str) -> str:
    """The one error line of a run on `data`, which must write nothing."""
    code, err, out = finetune(model, data, capsys, *extra)
    assert code != 0 and not out.exists(), err
    return one_error(err)


def trained(model: Path, data: Path, capsys, *extra: str) -> str:
    code, err, out = finetune(model, data, capsys, *extra)
    assert code == 0 and "Traceback" not in err, err
    assert "loss=" in err and llamapy.load_model(out).vocab.n_tokens == 512
    return err


# ---- ids past the vocabulary ---------------------------------------------------------------------
def test_an_id_past_the_vocabulary_ends_in_one_line_not_a_crash(clone, model):
    """The audit's finding, end to end in a process of its own: id 512 of stories260K's 512
    used to end in a traceback (65535: SIGSEGV)."""
    d = clone("text")
    ids = tokens_of(d, 1)
    ids[7] = 512
    rewrite_tokens(d, 1, ids)
    out = model.parent / "out.gguf"
    r = subprocess.run([sys.executable, "-m", "llamapy.cli.finetune", "-m", str(model), "--data", str(seal(d)),
                        *TRAIN, "-o", str(out)], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "tokens-00001.bin: token 7 is id 512, not one of the vocabulary's 512 (0 to 511" in one_error(r.stderr)
    assert not out.exists()


@pytest.mark.parametrize("kind, where, bad", [("texts", "first", 515), ("texts", "last", 515),
                                              ("texts", "every", 515), ("completions", "last", 65535),
                                              ("text", "first", 512)])
def test_ids_past_the_vocabulary_are_found_anywhere_in_any_shard(clone, vocab, model, capsys, kind, where, bad):
    d = clone(kind)
    k = len(read_index(d)["shards"]) - 1
    ids = tokens_of(d, k)
    at = {"first": [0], "last": [len(ids) - 1], "every": list(range(len(ids)))}[where]
    ids[at] = bad
    rewrite_tokens(d, k, ids)
    with pytest.raises(InputError, match=f"token {at[0]} is id {bad}"):  # refused in this process before any
        TokenShards.open(seal(d), vocab)                                  # kernel sees an id...
    assert f"token {at[0]} is id {bad}" in refused(model, d, capsys)     # ...so the command refuses it too


def test_the_last_id_of_the_vocabulary_trains(clone, vocab, model, capsys):
    d = clone("text")
    ids = tokens_of(d, 0)
    ids[3] = vocab.n_tokens - 1
    rewrite_tokens(d, 0, ids)
    trained(model, seal(d), capsys)


def test_negative_ids_of_a_signed_type_are_refused(tmp_path):
    """The index admits only unsigned types (an "int32" index is refused); the check reading
    the ids still refuses a negative one of a signed type."""
    file = tmp_path / "tokens-00000.bin"
    ids = np.array([1, 2, -1, 4], "<i4")
    file.write_bytes(ids.tobytes())
    with pytest.raises(InputError, match="token 2 is id -1"):
        _verify_tokens(file, hashlib.blake2b(ids.tobytes(), digest_size=16).hexdigest(), ids.dtype, 512)


def test_a_signed_type_and_a_changed_vocabulary_size_are_refused(clone, model, capsys):
    d = clone("text")
    write_index(d, {**read_index(d), "dtype": "int32"})
    assert "dtype: Input should be 'uint16' or 'uint32'" in refused(model, seal(d), capsys)
    d = clone("text")
    write_index(d, {**read_index(d), "n_vocab": 600})
    assert "n_vocab 600, but the model's vocabulary has 512 tokens" in refused(model, seal(d), capsys)


# ---- the index's entries -----------------------------------------------------------------------------
def test_a_shard_listed_twice_is_refused(clone, model, capsys):
    for kind in ("text", "completions"):
        d = clone(kind)
        index = read_index(d)
        write_index(d, {**index, "shards": [*index["shards"], index["shards"][0]]})
        assert f"shard '{index['shards'][0]['tokens']}' is listed twice" in refused(model, seal(d), capsys)


@pytest.mark.parametrize("name, expected", [
    ("{d}/tokens-00000.bin", "not a file of the directory"),   # its own shard, by an absolute path
    ("../{base}/tokens-00000.bin", "not a file of the directory"),
    ("./tokens-00000.bin", "not a file of the directory"),
    ("..", "not a file of the directory"),
    ("", "not a file of the directory"),
    ("index.json", "not a token file (tokens-NNNNN.bin)"),
    ("masks-00000.bin", "not a token file (tokens-NNNNN.bin)"),
    ("copy.bin", "not a token file (tokens-NNNNN.bin)"),
    ("tokens-00009.bin", "'tokens-00009.bin' is missing"),
])
def test_an_entry_naming_a_file_that_is_not_one_of_the_shards_is_refused(clone, model, capsys, name, expected):
    d = clone("completions")
    shutil.copy(d / "tokens-00000.bin", d / "copy.bin")  # the same bytes: only the name tells
    index = read_index(d)
    index["shards"][0]["tokens"] = name.format(d=d, base=d.name)
    write_index(d, index)
    assert expected in refused(model, seal(d), capsys)


def test_a_text_entry_counting_samples_is_refused(clone, vocab):
    d = clone("text")
    index = read_index(d)
    index["shards"][0]["n_samples"] = 3
    write_index(d, index)
    with pytest.raises(InputError, match="of a text counts 3 samples"):
        TokenShards.open(seal(d), vocab)


# ---- lengths and masks against the tokens -----------------------------------------------------------
def lengths_of(d: Path, k: int) -> np.ndarray:
    return np.fromfile(d / read_index(d)["shards"][k]["tokens"].replace("tokens-", "lengths-"), "<u4")


def set_lengths(d: Path, k: int, lengths) -> None:
    index = read_index(d)
    entry = index["shards"][k]
    np.asarray(lengths, "<u4").tofile(d / entry["tokens"].replace("tokens-", "lengths-"))
    entry["n_samples"] = len(lengths)
    write_index(d, index)


@pytest.mark.parametrize("damage, expected", [
    (lambda n: [*n[:-1], n[-1] + 1], "add up to"),                     # one token more than the shard has
    (lambda n: n[:-1], "add up to"),                                   # a sample dropped
    (lambda n: [1, n[0] - 1, *n[1:]], "sample 0 is 1 token(s); a sample has at least 2"),
    (lambda n: [0, *n], "sample 0 is 0 token(s)"),
])
def test_lengths_that_do_not_cut_the_tokens_into_samples_are_refused(clone, vocab, damage, expected):
    d = clone("completions")
    set_lengths(d, 0, damage(lengths_of(d, 0).tolist()))
    with pytest.raises(InputError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        TokenShards.open(seal(d), vocab)


@pytest.mark.parametrize("what, size", [("masks", -1), ("masks", +1), ("lengths", +4), ("lengths", -4)])
def test_masks_and_lengths_files_of_another_size_are_refused(clone, model, capsys, what, size):
    d = clone("completions")
    file = d / f"{what}-00000.bin"
    data = file.read_bytes()
    file.write_bytes(data[:size] if size < 0 else data + b"\1" * size)
    assert f"{what}-00000.bin: {len(data) + size} bytes, the index says {len(data)}" in refused(model, seal(d),
                                                                                               capsys)


# ---- --data-format against what the shards hold ------------------------------------------------------
@pytest.mark.parametrize("kind, data_format, expected", [
    ("text", "chat", "--data-format chat, but the shards hold a plain text, not chat samples"),
    ("text", "completions", "--data-format completions, but the shards hold a plain text"),
    ("completions", "text", "--data-format text, but the shards hold completions samples"),
    ("completions", "chat", "--data-format chat, but the shards hold completions samples"),
    ("texts", "chat", "--data-format chat, but the shards hold text samples"),
    ("text", "yaml", "unknown data format 'yaml'"),
])
def test_a_data_format_the_shards_do_not_hold_is_refused(clone, model, capsys, kind, data_format, expected):
    assert expected in refused(model, seal(clone(kind)), capsys, "--data-format", data_format)


@pytest.mark.parametrize("kind, data_format", [("text", "text"), ("completions", "completions"),
                                               ("texts", "text")])
def test_the_format_the_shards_hold_trains(clone, model, capsys, kind, data_format):
    trained(model, seal(clone(kind)), capsys, "--data-format", data_format)


def test_an_index_from_before_formats_were_recorded_trains_but_cannot_vouch_for_one(clone, vocab, model, capsys):
    d = clone("completions")
    index = read_index(d)
    del index["formats"]
    write_index(d, index)
    assert shard_windows(d, vocab, 16, data_format=None).ndata > 1
    assert "does not record the samples' format" in refused(model, seal(d), capsys, "--data-format", "completions")
    trained(model, d, capsys)


def test_the_tokenizer_records_the_samples_formats(shard_dirs):
    assert read_index(shard_dirs["completions"])["formats"] == ["completions"]
    assert read_index(shard_dirs["texts"])["formats"] == ["text"]
    assert read_index(shard_dirs["text"])["formats"] is None


def test_sample_start_on_shards_is_refused_not_ignored(clone, model, capsys):
    assert "--sample-start: " in refused(model, seal(clone("text")), capsys, "--sample-start", "Once")
