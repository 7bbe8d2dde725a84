"""Fuzzing `--data DIR`: 500 mutated token shard directories (the index's types, counts,
names, digests, dtype, entries and paths; token files cut, extended or changed with their
digests recomputed; ids past the vocabulary; masks and lengths damaged; the index replaced
by what is not one) are opened as llamapy-finetune opens them, and a subset is trained on
with the command itself. A directory is either refused with one line (InputError; the
command: exactly one `error:` line, a non-zero exit, nothing written) or it is sound: every
id the windows hold is the vocabulary's, and the command trains on it and writes a model
that loads. Never a traceback or a crash, and neither the shards nor the model is changed.
Seeded and bounded; each case is opened in this process first, so a directory that reaches
the command's kernels is one whose ids were all read and checked."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_hostile_cli import digest, one_error, run_tool
from test_hostile_shards import make_shards, read_index, write_index

import llamapy
from llamapy.dataset import IGNORE
from llamapy.errors import InputError
from llamapy.shard_dataset import shard_windows
from llamapy.token_shards import INDEX

pytestmark = pytest.mark.slow

SEED = 20_241_207
CASES = 500
CLI_ACCEPTED, CLI_REFUSED = 20, 30       # cases also run through llamapy-finetune (a few seconds each at most)
N_CTX = 16
ODD_VALUES = [None, True, False, -1, 0, 1, 2**70, -(2**63), 3.5, float("nan"), "", "x", "12", [], {},
              ["tokens-00000.bin"], {"tokens": "tokens-00000.bin"}]


# ---- mutations: each changes the directory `d` and says what it did --------------------------------
def pick_entry(index: dict, rng) -> dict:
    return index["shards"][int(rng.integers(len(index["shards"])))]


def redigest(d: Path, entry: dict) -> None:
    entry["digest"] = hashlib.blake2b((d / entry["tokens"]).read_bytes(), digest_size=16).hexdigest()


def token_dtype(index: dict) -> np.dtype:
    return np.dtype(index["dtype"]).newbyteorder("<")


def index_type(d: Path, rng) -> str:
    index = read_index(d)
    target = index if rng.random() < 0.5 else pick_entry(index, rng)
    key = str(rng.choice(sorted(target)))
    target[key] = ODD_VALUES[int(rng.integers(len(ODD_VALUES)))]
    write_index(d, index)
    return f"{key} = {target[key]!r}"


def index_drop_key(d: Path, rng) -> str:
    index = read_index(d)
    target = index if rng.random() < 0.5 else pick_entry(index, rng)
    key = str(rng.choice(sorted(target)))
    del target[key]
    write_index(d, index)
    return f"no {key}"


def index_extra_key(d: Path, rng) -> str:
    index = read_index(d)
    (index if rng.random() < 0.5 else pick_entry(index, rng))["surprise"] = 1
    write_index(d, index)
    return "an unknown key"


def index_count(d: Path, rng) -> str:
    index = read_index(d)
    entry = pick_entry(index, rng)
    key = "n_samples" if rng.random() < 0.4 else "n_tokens"
    entry[key] = int(rng.choice([entry[key] - 1, entry[key] + 1, entry[key] * 2, entry[key] // 2, 0, -5, 2**40]))
    write_index(d, index)
    return f"{key} = {entry[key]}"


def index_name(d: Path, rng) -> str:
    index = read_index(d)
    entry = pick_entry(index, rng)
    other = pick_entry(index, rng)["tokens"]
    entry["tokens"] = str(rng.choice([other, str(d / entry["tokens"]), f"../{d.name}/{entry['tokens']}", INDEX,
                                      "masks-00000.bin", "lengths-00000.bin", "tokens-99999.bin", "tokens-0.bin",
                                      entry["tokens"] + "/", "", ".", "tokens-00000.bin\0", "TOKENS-00000.BIN",
                                      "/dev/zero", "sub/tokens-00000.bin"]))
    write_index(d, index)
    return f"tokens = {entry['tokens']!r}"


def index_digest(d: Path, rng) -> str:
    index = read_index(d)
    entry = pick_entry(index, rng)
    entry["digest"] = str(rng.choice([pick_entry(index, rng)["digest"], entry["digest"].upper(), entry["digest"][:-1],
                                      "0" * 32, bytes(rng.integers(0, 256, 16, dtype=np.uint8)).hex()]))
    write_index(d, index)
    return f"digest = {entry['digest']}"


def index_dtype(d: Path, rng) -> str:
    index = read_index(d)
    index["dtype"] = str(rng.choice(["uint32", "uint16", "int32", "int16", "float32", "<u2", "uint8", "uint64"]))
    if rng.random() < 0.5 and index["dtype"] == "uint32":  # the bytes read as half as many uint32
        for entry in index["shards"]:
            entry["n_tokens"] //= 2
    write_index(d, index)
    return f"dtype = {index['dtype']}"


def index_entries(d: Path, rng) -> str:
    index = read_index(d)
    shards, how = index["shards"], str(rng.choice(["duplicate", "drop", "reorder", "empty"]))
    if how == "duplicate":
        shards.insert(int(rng.integers(len(shards) + 1)), dict(pick_entry(index, rng)))
    elif how == "drop" and len(shards) > 1:
        del shards[int(rng.integers(len(shards)))]
    elif how == "reorder":
        rng.shuffle(shards)
    elif how == "empty":
        shards.clear()
    write_index(d, index)
    return f"entries: {how}"


def index_header(d: Path, rng) -> str:
    index = read_index(d)
    key = str(rng.choice(["kind", "n_vocab", "vocab", "formats", "version", "format", "mask_prompt", "chat_template"]))
    index[key] = {"kind": lambda: "samples" if index["kind"] == "text" else "text",
                  "n_vocab": lambda: int(rng.choice([0, 1, 256, 511, 513, 65536])),
                  "vocab": lambda: "f" * 32,
                  "formats": lambda: [["chat"], ["text"], ["completions"], ["chat", "text"], [], None, "chat"][
                      int(rng.integers(7))],
                  "version": lambda: int(rng.choice([0, 2])),
                  "format": lambda: "llamapy-token-shard",
                  "mask_prompt": lambda: False,
                  "chat_template": lambda: "zephyr"}[key]()
    write_index(d, index)
    return f"{key} = {index[key]!r}"


def index_garbage(d: Path, rng) -> str:
    text = json.dumps(read_index(d))
    choices = [text[: int(rng.integers(len(text)))], "[]", "null", "1", "[" * 100_000, "\ufeff" + text, "",
               text.replace('"n_tokens": ', '"n_tokens": ' + "1" * 5000 + ", \"x\": ", 1)]
    k = int(rng.integers(len(choices) + 1))
    if k == len(choices):
        (d / INDEX).write_bytes(b"\xff\xfe" + text.encode("utf-16-le"))
        return "index: UTF-16"
    (d / INDEX).write_text(choices[k], encoding="utf-8")
    return f"index: garbage {k}"


def tokens_resize(d: Path, rng) -> str:
    """Tokens cut or added, the digest recomputed and (half the time) the count too."""
    index = read_index(d)
    entry, dtype = pick_entry(index, rng), token_dtype(index)
    ids = np.fromfile(d / entry["tokens"], dtype)
    k = int(rng.integers(1, 6))
    ids = ids[:-k] if rng.random() < 0.5 else np.concatenate([ids, rng.integers(0, 512, k).astype(dtype)])
    ids.tofile(d / entry["tokens"])
    redigest(d, entry)
    if rng.random() < 0.5:
        entry["n_tokens"] = len(ids)
    write_index(d, index)
    return f"{entry['tokens']}: {len(ids)} tokens"


def tokens_flip(d: Path, rng) -> str:
    """Bytes changed, the digest recomputed (an id in or past the vocabulary) or not."""
    index = read_index(d)
    entry = pick_entry(index, rng)
    data = bytearray((d / entry["tokens"]).read_bytes())
    for _ in range(int(rng.integers(1, 4))):
        data[int(rng.integers(len(data)))] ^= 1 << int(rng.integers(8))
    (d / entry["tokens"]).write_bytes(bytes(data))
    if rng.random() < 0.8:
        redigest(d, entry)
    write_index(d, index)
    return f"{entry['tokens']}: bytes flipped"


def tokens_out_of_range(d: Path, rng) -> str:
    index = read_index(d)
    entry, dtype = pick_entry(index, rng), token_dtype(index)
    ids = np.fromfile(d / entry["tokens"], dtype)
    bad = int(rng.choice([512, 513, 1000, np.iinfo(dtype).max]))
    ids[rng.integers(len(ids), size=int(rng.integers(1, 4)))] = bad
    ids.tofile(d / entry["tokens"])
    redigest(d, entry)
    write_index(d, index)
    return f"{entry['tokens']}: id {bad}"


def tokens_odd_size(d: Path, rng) -> str:
    index = read_index(d)
    entry = pick_entry(index, rng)
    with open(d / entry["tokens"], "ab") as f:
        f.write(b"\1")
    redigest(d, entry)
    write_index(d, index)
    return f"{entry['tokens']}: one byte more"


def side_files(d: Path, rng) -> str:
    """Masks or lengths changed, cut, extended or gone (samples); a file of a text gone."""
    index = read_index(d)
    entry = pick_entry(index, rng)
    what = str(rng.choice(["masks", "lengths", "tokens"]))
    file = d / entry["tokens"].replace("tokens-", f"{what}-")
    if not file.exists() or rng.random() < 0.15:
        if file.exists():
            file.unlink()
        file.mkdir()
        return f"{file.name}: a directory"
    data = bytearray(file.read_bytes())
    how = str(rng.choice(["cut", "extend", "change", "relength"]))
    if how == "cut" and data:
        data = data[:-int(rng.integers(1, len(data) + 1))]
    elif how == "extend":
        data += bytes(int(rng.integers(1, 9)))
    elif how == "change" and data:
        data[int(rng.integers(len(data)))] = int(rng.integers(256))
    elif how == "relength" and what == "lengths" and len(data) >= 8:  # two samples re-cut, the sum kept
        n = np.frombuffer(bytes(data), "<u4").copy()
        move = int(rng.integers(0, int(n[0]) + 1))
        n[0] -= move
        n[1] += move
        data = bytearray(n.tobytes())
    file.write_bytes(bytes(data))
    return f"{file.name}: {how}"


MUTATIONS = [index_type, index_drop_key, index_extra_key, index_count, index_name, index_digest, index_dtype,
             index_entries, index_header, index_garbage, tokens_resize, tokens_flip, tokens_out_of_range,
             tokens_odd_size, side_files]


def mutate(d: Path, rng) -> list[str]:
    """One to three mutations (later ones may find the index already unreadable: they stop there)."""
    done = []
    for _ in range(int(rng.choice([1, 1, 1, 2, 3]))):
        try:
            done.append(MUTATIONS[int(rng.integers(len(MUTATIONS)))](d, rng))
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, OSError, RecursionError):
            break  # the index or a file is no longer what a mutation edits
    return done


# ---- the oracle ----------------------------------------------------------------------------------
def hashes(d: Path) -> dict[str, str]:
    return {p.name: digest(p) if p.is_file() else "a directory" for p in sorted(d.iterdir())}


def opened(d: Path, vocab, data_format: str | None):
    """The windows of `d` as llamapy-finetune opens it, or the one-line InputError refusing it;
    accepted windows are checked to hold only the vocabulary's ids."""
    try:
        ds = shard_windows(d, vocab, N_CTX, data_format=data_format)
    except InputError as e:
        assert str(e) and "\n" not in str(e), repr(str(e))
        return e
    data, labels = ds.rows(np.arange(ds.ndata))
    assert 0 <= data.min() and data.max() < vocab.n_tokens
    assert np.all((labels == IGNORE) | ((labels >= 0) & (labels < vocab.n_tokens)))
    return ds


def test_mutated_shard_directories_are_refused_in_one_line_or_train(stories_path, tmp_path, capsys):
    vocab = llamapy.load_model(stories_path).vocab
    bases = make_shards(vocab, tmp_path / "bases")
    model = tmp_path / "m.gguf"
    model.write_bytes(stories_path.read_bytes())
    model_digest = digest(model)
    rng = np.random.default_rng(SEED)
    verdicts = {"accepted": 0, "refused": 0}
    cli = {"accepted": 0, "refused": 0}
    for case in range(CASES):
        kind = str(rng.choice(sorted(bases)))
        d = tmp_path / f"case-{case:03d}"
        shutil.copytree(bases[kind], d)
        what = mutate(d, rng)
        data_format = [None] * 6 + ["text", "completions", "chat"]
        data_format = data_format[int(rng.integers(len(data_format)))]
        where = f"case {case} ({kind}, --data-format {data_format}): {'; '.join(what)}"
        before = hashes(d)
        result = opened(d, vocab, data_format)
        verdict = "refused" if isinstance(result, InputError) else "accepted"
        verdicts[verdict] += 1
        if cli[verdict] < (CLI_ACCEPTED if verdict == "accepted" else CLI_REFUSED):
            cli[verdict] += 1
            out = tmp_path / "out.gguf"
            code, err = run_tool("finetune", "-m", model, "--data", d, "-c", str(N_CTX), "--epochs", "1", "-t", "1",
                                 "-o", out, *(["--data-format", data_format] if data_format else []), capsys=capsys)
            assert "Traceback" not in err, where
            if verdict == "accepted":
                assert code == 0 and "loss=" in err, f"{where}\n{err}"
                assert digest(out) != model_digest, f"{where}\n{err}"
                assert llamapy.load_model(out).vocab.n_tokens == vocab.n_tokens
                out.unlink()
            else:
                assert code != 0 and not out.exists(), where
                assert str(result) in one_error(err), where
            assert digest(model) == model_digest, where
        assert hashes(d) == before, where
        shutil.rmtree(d)
    # the mutations reach both verdicts, and the command saw both
    assert verdicts["refused"] > CASES // 2 and verdicts["accepted"] >= CLI_ACCEPTED, verdicts
    assert cli == {"accepted": CLI_ACCEPTED, "refused": CLI_REFUSED}, cli
