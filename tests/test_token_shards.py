"""Token shards (llamapy-tokenize, --data DIR): a corpus tokenized once into memory-mapped
files gives the tokens of the whole text, the windows and packed samples the in-memory path
gives, the same trained model as -f, disjoint reads over MPI ranks, and one clear line for
every broken shard directory."""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import REPO_ROOT, shared_path, tool_process
from test_cli_errors import assert_one_clear_line
from test_sft_cli import chats, completions, write_jsonl

import llamapy
from llamapy.chat import ChatTemplate
from llamapy.dataset import load_samples, token_windows
from llamapy.errors import InputError
from llamapy.gguf_file import GGUFFile
from llamapy.shard_dataset import ShardSampleWindows, ShardTextWindows, shard_windows
from llamapy.text_input import read_text_file
from llamapy.token_shards import TokenShards, write_token_shards
from llamapy.vocab import Vocab


@pytest.fixture(scope="module")
def model():
    return llamapy.load_model(shared_path("models", "stories260K.gguf"))


@pytest.fixture(scope="module")
def wiki_piece(tmp_path_factory):
    path = tmp_path_factory.mktemp("wiki") / "wiki.txt"
    path.write_text(shared_path("data", "wiki.test.raw").read_text(encoding="utf-8")[:300_000], encoding="utf-8")
    return path


def whole_tokens(vocab, path) -> np.ndarray:
    return np.asarray(vocab.tokenize(read_text_file(path), add_special=True))


@pytest.mark.parametrize("tokenizer", ["stories260K", "llama-bpe", "deepseek-coder", "gpt-2"])
def test_a_text_cut_in_pieces_gives_the_whole_texts_tokens(tokenizer, model, wiki_piece, tmp_path):
    vocab = model.vocab if tokenizer == "stories260K" else Vocab.from_gguf(
        GGUFFile(shared_path("data", "vocab", f"ggml-vocab-{tokenizer}.gguf")))
    report = write_token_shards([wiki_piece], tmp_path / "shards", vocab, workers=2, piece_bytes=20_000,
                                shard_tokens=7_000)
    shards = TokenShards.open(tmp_path / "shards", vocab)
    assert len(report.index.shards) > 5 and shards.dtype.itemsize == (2 if vocab.n_tokens <= 65536 else 4)
    np.testing.assert_array_equal(shards.read(0, shards.n_tokens), whole_tokens(vocab, wiki_piece))
    np.testing.assert_array_equal(shards.read(6_990, 30), whole_tokens(vocab, wiki_piece)[6_990:7_020])  # across files


@pytest.mark.parametrize("bos", [False, True])
def test_text_windows_read_from_shards_equal_the_in_memory_ones(bos, model, wiki_piece, tmp_path):
    vocab = model.vocab
    write_token_shards([wiki_piece], tmp_path / "s", vocab, shard_tokens=10_000)
    ds = shard_windows(tmp_path / "s", vocab, 64, window_bos=bos)
    tokens = vocab.tokenize(read_text_file(wiki_piece), add_special=True)
    ref = token_windows(tokens, 64, bos=vocab.bos_id if bos else None)
    assert isinstance(ds, ShardTextWindows) and ds.ndata == ref.ndata and ds.data is None
    rows = np.arange(ds.ndata)
    data, labels = ds.rows(rows)
    np.testing.assert_array_equal(data, ref.data)
    np.testing.assert_array_equal(labels, ref.labels)
    ds.shuffle(np.random.default_rng(1))
    ref.shuffle(np.random.default_rng(1))
    for i in (0, 5, ds.ndata - 1):
        np.testing.assert_array_equal(ds.datapoint(i)[0], ref.datapoint(i)[0])


@pytest.mark.parametrize("n_ctx", [128, 200])  # 128: the long sample is cut to fit
def test_sample_windows_read_from_shards_equal_the_packed_ones(n_ctx, model, tmp_path):
    path = tmp_path / "chats.jsonl"
    long = [{"messages": [{"role": "user", "content": "Tell a story. " * 6},
                          {"role": "assistant", "content": "Once upon a time there was a cat. " * 3}]}]
    write_jsonl(path, chats(0, 30) + long + chats(30, 10))
    template = ChatTemplate.named("chatml", model.vocab)
    write_token_shards([path], tmp_path / "s", model.vocab, workers=2, chat_template=template, piece_bytes=900,
                       shard_tokens=500)
    ds = shard_windows(tmp_path / "s", model.vocab, n_ctx)
    ref = load_samples(path, model.vocab, n_ctx, chat_template=template)
    assert isinstance(ds, ShardSampleWindows) and ds.ndata == ref.ndata and ds.n_truncated == ref.n_truncated
    assert (ds.n_truncated > 0) == (n_ctx == 128)
    data, labels = ds.rows(np.arange(ds.ndata))
    np.testing.assert_array_equal(data, ref.data)
    np.testing.assert_array_equal(labels, ref.labels)
    for j in range(ds.ndata):
        for got, want in zip(ds.layout(j), ref.layout(j)):
            np.testing.assert_array_equal(got, want)
        assert ds.counted(j) == int(np.count_nonzero(ref.labels[j] != -1))
    with pytest.raises(InputError, match="more than a window"):
        shard_windows(tmp_path / "s", model.vocab, 128, truncate=False)


def run(tool: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"llamapy.cli.{tool}", *args], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=timeout)


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["text", "chat"])
def test_finetune_on_shards_writes_the_model_finetune_on_the_file_writes(kind, wiki_piece, tmp_path):
    if kind == "text":
        source = tmp_path / "text.txt"
        source.write_text(wiki_piece.read_text(encoding="utf-8")[:12_000], encoding="utf-8")
        extra = []
    else:
        source = tmp_path / "train.jsonl"
        write_jsonl(source, completions(0, 40))
        extra = ["--chat-template", "chatml"]
    stories = str(shared_path("models", "stories260K.gguf"))
    # llamapy-tokenize as its users run it (a child process) once; the rest in this process
    tokenize = run if kind == "text" else tool_process
    r = tokenize("tokenize", "-m", stories, str(source), "-o", str(tmp_path / "shards"), *extra)
    assert r.returncode == 0, r.stderr
    assert "tokens (uint16) in 1 shard(s)" in r.stderr
    outs = []
    for data in (["-f", str(source), *extra], ["--data", str(tmp_path / "shards")]):
        out = tmp_path / f"out{len(outs)}.gguf"
        r = tool_process("finetune", "-m", stories, *data, "-c", "64", "--epochs", "2", "-t", "2", "--seed", "5",
                         "--shuffle", "-lr", "1e-3", "-val-split", "0.1", "-o", str(out))
        assert r.returncode == 0, r.stderr
        # the losses and accuracies; the elapsed time and ETA vary with the machine's load
        outs.append((digest(out), [re.sub(r" t=\S+ ETA=\S+", "", ln) for ln in r.stderr.splitlines() if "loss=" in ln]))
    if kind == "text":
        assert "read from the shards as they train" in r.stderr
    assert outs[0] == outs[1]  # the same weights, losses and accuracies


@pytest.mark.slow
def test_broken_shard_directories_get_one_clear_line(model, wiki_piece, tmp_path, capsys):
    stories = str(shared_path("models", "stories260K.gguf"))

    def run(tool: str, *args: str) -> subprocess.CompletedProcess:  # in this process: ten start-ups saved
        return tool_process(tool, *args, capsys=capsys)

    good = tmp_path / "good"
    write_token_shards([wiki_piece], good, model.vocab)

    def broken(name: str, damage) -> str:
        d = tmp_path / name
        shutil.copytree(good, d)
        damage(d)
        return str(d)

    def flip_a_byte(d):  # the same size, one token changed: only the digest tells
        data = bytearray((d / "tokens-00000.bin").read_bytes())
        data[len(data) // 2] ^= 1
        (d / "tokens-00000.bin").write_bytes(bytes(data))

    index = json.loads((good / "index.json").read_text())
    cases = {
        broken("short", lambda d: (d / "tokens-00000.bin").write_bytes(b"\0" * 100)): "a damaged or unfinished shard",
        broken("gone", lambda d: (d / "tokens-00000.bin").unlink()): "is missing",
        broken("flipped", flip_a_byte): "not the ones llamapy-tokenize wrote",
        broken("json", lambda d: (d / "index.json").write_text("{nope")): "unreadable",
        broken("version", lambda d: (d / "index.json").write_text(json.dumps({**index, "version": 9}))): "version 9",
        broken("escape", lambda d: (d / "index.json").write_text(json.dumps(
            {**index, "shards": [{**index["shards"][0], "tokens": "../good/tokens-00000.bin"}]}))):
            "not a file of the directory",
        broken("vocab", lambda d: (d / "index.json").write_text(json.dumps({**index, "vocab": "0" * 32}))):
            "another tokenizer",
    }
    for path, expected in cases.items():
        r = run("finetune", "-m", stories, "--data", path, "-c", "64", "-o", str(tmp_path / "x.gguf"))
        assert_one_clear_line(r, expected)
    assert_one_clear_line(run("tokenize", "-m", stories, str(wiki_piece), "-o", str(good)), "already exists")
    jsonl = tmp_path / "a.jsonl"
    write_jsonl(jsonl, completions(0, 2))
    assert_one_clear_line(run("tokenize", "-m", stories, str(wiki_piece), str(jsonl), "-o", str(tmp_path / "n")),
                          "mix JSONL samples and plain text")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(bytes(range(128, 256)) * 100)
    assert_one_clear_line(run("tokenize", "-m", stories, str(binary), "-o", str(tmp_path / "n")), "not UTF-8 text")
    write_jsonl(jsonl, completions(0, 2) + [{"prompt": 1}])
    assert_one_clear_line(run("tokenize", "-m", stories, str(jsonl), "-o", str(tmp_path / "n"), "--chat-template",
                              "chatml"), "a.jsonl:3")
    assert not (tmp_path / "n").exists() and not list(tmp_path.glob(".n.*"))  # nothing half-written is left


@pytest.mark.slow
def test_mpi_ranks_read_disjoint_windows_and_train_as_one_process(model, wiki_piece, tmp_path):
    pytest.importorskip("mpi4py", reason="the mpi extra")
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        pytest.skip("no mpirun")
    piece = tmp_path / "piece.txt"  # 60 kB: ~250 windows, enough for each rank to read its own
    piece.write_text(wiki_piece.read_text(encoding="utf-8")[:60_000], encoding="utf-8")
    write_token_shards([piece], tmp_path / "s", model.vocab)
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys, numpy as np, llamapy
        from llamapy.distributed import world
        from llamapy.shard_dataset import shard_windows
        from llamapy.train_params import TrainParams, LRSchedule
        comm = world()
        model = llamapy.load_model({str(shared_path("models", "stories260K.gguf"))!r})
        ds = shard_windows({str(tmp_path / "s")!r}, model.vocab, 64)
        read, rows = [], ds.rows
        ds.rows = lambda js: (read.extend(int(j) for j in js), rows(js))[1]
        per_rank = 64 * 2 // comm.size
        ctx = llamapy.Context(model, n_ctx=per_rank, n_batch=per_rank, n_ubatch=64, n_threads=1)
        ctx.opt_init(TrainParams(schedule=LRSchedule(lr0=1e-3), n_ctx_train=64), comm)  # as llamapy-finetune -b
        history = ctx.opt_fit(ds, epochs=1, silent=True, seed=1, val_split=0.5)
        weights = float(sum(np.abs(t.numpy()).sum() for t in ctx.trainer.trained.values()))
        with open({str(tmp_path)!r} + f"/{{comm.size}}-{{comm.rank}}.json", "w") as f:
            json.dump({{"read": read, "n": ds.ndata, "weights": weights, "val": history[0].val.loss()[0]}}, f)
    """))
    for ranks in (2, 1):
        cmd = [sys.executable, str(script)] if ranks == 1 else [mpirun, "-n", "2", sys.executable, str(script)]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
        assert r.returncode == 0, r.stderr
    ranks = [json.loads((tmp_path / f"2-{k}.json").read_text()) for k in (0, 1)]
    alone = json.loads((tmp_path / "1-0.json").read_text())
    a, b = (set(x["read"]) for x in ranks)
    assert a and b and not a & b  # each window is read by one rank only
    assert sorted(a | b) == sorted(set(alone["read"]))
    assert len(ranks[0]["read"]) + len(ranks[1]["read"]) == len(alone["read"])
    assert ranks[0]["weights"] == ranks[1]["weights"]  # the same steps on every rank...
    assert abs(ranks[0]["weights"] - alone["weights"]) <= 1e-6 * abs(alone["weights"])  # ...and as one process's
    assert abs(ranks[0]["val"] - alone["val"]) <= 1e-6 * abs(alone["val"])


@pytest.mark.slow
def test_a_run_on_shards_resumes_bit_identically_and_refuses_other_shards(stories_path, wiki_piece, tmp_path):
    from conftest import Killed, kill_after
    from test_checkpoint import EPOCHS, N_CTX, fresh_context, trained

    source = tmp_path / "text.txt"
    source.write_text(wiki_piece.read_text(encoding="utf-8")[:2500], encoding="utf-8")
    vocab = llamapy.load_model(stories_path).vocab
    write_token_shards([source], tmp_path / "s", vocab)

    def fit(ctx, **kw):
        ds = shard_windows(tmp_path / "s", vocab, N_CTX)
        return ctx.opt_fit(ds, epochs=EPOCHS, val_split=0.2, seed=11, silent=True, **kw)

    reference = fresh_context(stories_path, "adamw")
    fit(reference)
    run, ckpt = fresh_context(stories_path, "adamw"), tmp_path / "run.ckpt.gguf"
    kill_after(run, reference.trainer.steps_per_epoch + 2)
    with pytest.raises(Killed):
        fit(run, checkpoint=ckpt, save_every=3)
    resumed = fresh_context(stories_path, "adamw")
    fit(resumed, checkpoint=ckpt, resume=ckpt)
    expect, got = trained(reference), trained(resumed)
    assert all(np.array_equal(got[n], expect[n]) for n in expect)
    source.write_text(wiki_piece.read_text(encoding="utf-8")[2500:5000], encoding="utf-8")  # other text, same size
    shutil.rmtree(tmp_path / "s")
    write_token_shards([source], tmp_path / "s", vocab)
    with pytest.raises(InputError, match="another"):
        fit(fresh_context(stories_path, "adamw"), resume=ckpt)
