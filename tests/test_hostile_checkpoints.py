"""Damaged and crafted checkpoints end with one line naming the file and the problem.

Tampering with the file's bytes (a step count, a position, the RNG state, a key's name, a
tensor's byte, a truncation) breaks its checksum; files crafted with a valid checksum
(written through the checkpoint writer itself) are refused by the checks of their keys,
values and tensors. Two go through llamapy-finetune --checkpoint-in (one line, non-zero
exit, no traceback), the rest through ctx.opt_load_checkpoint / opt_fit(resume=...).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

import llamapy
from llamapy import checkpoint
from llamapy.checkpoint import load_checkpoint, save_checkpoint, write_checkpoint_file
from llamapy.dataset import token_windows
from llamapy.errors import InputError
from llamapy.gguf_file import GGUFFile, MetaValue, ValueType
from llamapy.gguf_writer import array_out
from llamapy.train_params import AdamW, LRSchedule, TrainParams

from conftest import Killed, kill_after, tool_process
from test_cli_errors import assert_one_clear_line

N_CTX = 32
CORRUPT = "truncated or corrupt"
INVALID = "the checkpoint is invalid"


def context(stories_path: Path):
    ctx = llamapy.Context(llamapy.load_model(stories_path), n_ctx=N_CTX, n_batch=2 * N_CTX, n_ubatch=16, n_threads=2)
    ctx.opt_init(TrainParams(optimizer=AdamW(wd=0.1), schedule=LRSchedule(lr0=1e-3, epochs=2), grad_clip=1.0))
    return ctx


@pytest.fixture(scope="module")
def text(wiki_path) -> str:
    return wiki_path.read_text()[:3000]


@pytest.fixture(scope="module")
def good(stories_path, text, tmp_path_factory) -> Path:
    """A checkpoint written mid-epoch (shuffled, with an RNG state): the run dies after step 3."""
    path = tmp_path_factory.mktemp("ckpt") / "good.gguf"
    ctx = context(stories_path)
    kill_after(ctx, 3)
    with pytest.raises(Killed):
        ctx.opt_fit(token_windows(ctx.model.vocab.tokenize(text), N_CTX), epochs=1, val_split=0.2, seed=11,
                    silent=True, checkpoint=path, save_every=1)
    return path


def refused(stories_path: Path, path: Path, expected: str) -> str:
    """opt_load_checkpoint's one line for `path` (which names the file and says `expected`)."""
    with pytest.raises(InputError) as e:
        context(stories_path).opt_load_checkpoint(path)
    message = str(e.value)
    assert str(path) in message and expected in message and "\n" not in message, message
    return message


# ---- tampered bytes: the checksum -------------------------------------------------------------------
def value_span(data: bytes, key: str) -> tuple[int, int]:
    """Where the string value of metadata `key` lies in a GGUF file's bytes."""
    at = data.index(key.encode()) + len(key)
    length = int.from_bytes(data[at + 4:at + 12], "little")
    return at + 12, at + 12 + length


def tampered(good: Path, tmp_path: Path, name: str, change) -> Path:
    data = bytearray(good.read_bytes())
    change(data)
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(bytes(data))
    return path


def bump_digit(data: bytearray, key: str, which: int = 0) -> None:
    """Change the `which`-th digit of a value (same length: the file's layout holds)."""
    start, end = value_span(bytes(data), key)
    digits = [i for i in range(start, end) if chr(data[i]).isdigit()]
    i = digits[which]
    data[i] = ord(str((int(chr(data[i])) + 1) % 10))


def test_the_good_checkpoint_loads(stories_path, good) -> None:
    ckpt = load_checkpoint(good)
    assert ckpt.position.shuffled and ckpt.rng_state is not None and int(ckpt.optimizer["opt.n_steps"][0]) > 0
    assert context(stories_path).opt_load_checkpoint(good) == []


@pytest.mark.parametrize("name, change", [
    ("n_steps", lambda d: bump_digit(d, "llamapy.checkpoint.n_steps")),
    ("position", lambda d: bump_digit(d, "llamapy.checkpoint.position", 1)),
    ("rng_state", lambda d: bump_digit(d, "llamapy.checkpoint.rng_state", -1)),
    ("key_name", lambda d: d.__setitem__(bytes(d).index(b"llamapy.checkpoint.position") + 19, ord("P"))),
    ("checksum_key_name", lambda d: d.__setitem__(bytes(d).index(b"llamapy.checkpoint.checksum") + 20, ord("C"))),
    ("checksum_value", lambda d: bump_digit(d, "llamapy.checkpoint.checksum")),
    ("tensor_byte", lambda d: d.__setitem__(len(d) - 100, d[len(d) - 100] ^ 0x40)),
    ("tensor_info_byte", lambda d: d.__setitem__(value_span(bytes(d), "llamapy.checkpoint.params")[1] + 1,
                                             d[value_span(bytes(d), "llamapy.checkpoint.params")[1] + 1] ^ 1)),
    ("truncated", lambda d: d.__delitem__(slice(len(d) // 2, None))),
    ("one_byte_short", lambda d: d.pop()),
    ("appended", lambda d: d.extend(b"\0" * 32)),
])
def test_tampered_bytes_break_the_checksum(stories_path, good, tmp_path, name, change) -> None:
    refused(stories_path, tampered(good, tmp_path, name, change), CORRUPT)


def test_a_tiny_or_foreign_file_is_not_a_checkpoint(stories_path, good, tmp_path) -> None:
    tiny = tmp_path / "tiny.gguf"
    tiny.write_bytes(good.read_bytes()[:40])
    refused(stories_path, tiny, "not a llamapy checkpoint, or truncated")
    text = tmp_path / "text.gguf"
    text.write_text("hello " * 100)
    refused(stories_path, text, "not a llamapy checkpoint (not a GGUF file)")
    refused(stories_path, stories_path, "not a llamapy checkpoint")


# ---- crafted files with a valid checksum: the checks of keys, values and tensors -------------------
def contents(good: Path) -> tuple[dict[str, MetaValue], list]:
    """The good checkpoint's metadata (without its checksum entry) and tensors, to rewrite."""
    f = GGUFFile(good)
    metadata = {k: v for k, v in f.metadata.items() if k != checkpoint.CHECKSUM_KEY}
    tensors = [array_out(n, t.numpy().reshape(t.ne[:f.tensor_n_dims[n]][::-1])) for n, t in f.tensors.items()]
    return metadata, tensors


def crafted(good: Path, tmp_path: Path, name: str, edit) -> Path:
    """The good checkpoint with `edit(metadata, tensors)` applied, written with a valid checksum."""
    metadata, tensors = contents(good)
    edit(metadata, tensors)
    return write_checkpoint_file(metadata, tensors, tmp_path / f"{name}.gguf")


def set_json(key: str, change):
    def edit(metadata, tensors):
        value = json.loads(metadata[checkpoint.PREFIX + key].value)
        metadata[checkpoint.PREFIX + key] = MetaValue(ValueType.STRING, None, json.dumps(change(value)))
    return edit


def replace_tensor(name: str, values: np.ndarray):
    def edit(metadata, tensors):
        tensors[[t.name for t in tensors].index(name)] = array_out(name, values)
    return edit


def rng_without_state(state: dict) -> dict:
    return {**state, "state": "nonsense"}


@pytest.mark.parametrize("name, edit, expected", [
    ("negative_n_steps", set_json("n_steps", lambda v: -3), "llamapy.checkpoint.n_steps must be >= 0, not -3"),
    ("fractional_n_steps", set_json("n_steps", lambda v: 2.5), "llamapy.checkpoint.n_steps must be a whole number"),
    ("negative_epoch", set_json("position", lambda v: [-1, *v[1:]]), "llamapy.checkpoint.position must be >= 0"),
    ("short_position", set_json("position", lambda v: v[:2]), "llamapy.checkpoint.position"),
    ("unshuffled_mid_epoch", set_json("position", lambda v: [v[0], 2, 0]), "whose windows were not shuffled"),
    ("negative_ndata", set_json("epoch_result", lambda v: {**v, "ndata": -5}), "epoch_result.ndata must be >= 0"),
    ("negative_count", set_json("epoch_result", lambda v: {**v, "counts": [-1] * len(v["counts"])}),
     "epoch_result.counts must be >= 0"),
    ("counts_without_losses", set_json("epoch_result", lambda v: {**v, "losses": []}), "losses but"),
    ("rng_state", set_json("rng_state", rng_without_state), "not the state of numpy's PCG64 generator"),
    ("rng_state_type", set_json("rng_state", lambda v: [1, 2, 3]), "llamapy.checkpoint.rng_state must be a dict"),
    ("fingerprint", set_json("model_fingerprint", lambda v: "../../etc"), "model_fingerprint"),
    ("version", set_json("version", lambda v: 7), "llamapy.checkpoint.version"),
    ("not_json", lambda m, t: m.__setitem__(checkpoint.PREFIX + "position", MetaValue(ValueType.STRING, None, "[1,")),
     "is not JSON"),
    ("deep_json", lambda m, t: m.__setitem__(checkpoint.PREFIX + "rng_state",
                                             MetaValue(ValueType.STRING, None, "[" * 100000 + "]" * 100000)),
     "is not JSON"),
    ("missing_key", lambda m, t: m.pop(checkpoint.PREFIX + "position"), "has no llamapy.checkpoint.position"),
    ("extra_key", lambda m, t: m.__setitem__("llamapy.checkpoint.extra", MetaValue(ValueType.STRING, None, "1")),
     "unexpected key 'llamapy.checkpoint.extra'"),
    ("mistyped_key", lambda m, t: m.__setitem__(checkpoint.PREFIX + "n_steps", MetaValue(ValueType.INT64, None, 3)),
     "llamapy.checkpoint.n_steps is a INT64, not a string"),
    ("params", lambda m, t: m.__setitem__(checkpoint.PREFIX + "params", MetaValue(ValueType.STRING, None, "{}")),
     "is required"),
    ("duplicate_permutation", replace_tensor("data.permutation", np.zeros(8, np.int64)), "is not a permutation"),
    ("permutation_out_of_range", replace_tensor("data.permutation", np.arange(8, dtype=np.int64) + 1000),
     "is not a permutation"),
    ("permutation_type", replace_tensor("data.permutation", np.arange(8, dtype=np.float32)),
     "tensor data.permutation is F32"),
    ("missing_tensor", lambda m, t: t.pop(0), "has no tensor param."),
    ("extra_tensor", lambda m, t: t.append(array_out("param.extra", np.zeros(3, np.float32))),
     "unexpected tensor 'param.extra'"),
])
def test_crafted_checkpoints_are_refused(stories_path, good, tmp_path, name, edit, expected) -> None:
    refused(stories_path, crafted(good, tmp_path, name, edit), expected)


def with_value(prefix: str, index: int, value: float):
    """An edit setting entry `index` (flat) of the first tensor whose name starts with `prefix`."""
    def edit(metadata, tensors):
        i = next(k for k, t in enumerate(tensors) if t.name.startswith(prefix))
        values = np.frombuffer(bytes(tensors[i].data), np.float32).reshape(tuple(reversed(tensors[i].ne))).copy()
        values.reshape(-1)[index] = value
        tensors[i] = array_out(tensors[i].name, values)
    return edit


@pytest.mark.parametrize("name, edit, expected", [
    ("nan_weight", with_value("param.", 3, np.nan), r"tensor param\.\S+ has a non-finite value \(nan\) at index 3"),
    ("inf_weight", with_value("param.", 0, np.inf), r"tensor param\.\S+ has a non-finite value \(inf\) at index 0"),
    ("nan_first_moment", with_value("opt.m.", 7, np.nan),
     r"tensor opt\.m\.\S+ has a non-finite value \(nan\) at index 7"),
    ("inf_second_moment", with_value("opt.v.", 1, np.inf), r"tensor opt\.v\.\S+ has a non-finite value \(inf\)"),
    ("negative_second_moment", with_value("opt.v.", 5, -1e-3),
     r"tensor opt\.v\.\S+ has a negative value \(-0\.001\) at index 5"),
    ("n_steps_past_int64", set_json("n_steps", lambda v: 10**30), r"llamapy\.checkpoint\.n_steps must be <="),
    ("epoch_past_int64", set_json("position", lambda v: [2**63, *v[1:]]), r"llamapy\.checkpoint\.position must be <="),
    ("fewer_steps_than_the_epoch_records", set_json("n_steps", lambda v: 1),
     "n_steps 1 is fewer than the 2 steps its epoch_result records"),
    ("epoch_start_with_steps", set_json("position", lambda v: [v[0], 0, 1]),
     r"position \[0, 0, 1\] is the start of an epoch, but its epoch_result records 2 steps"),
    ("steps_without_result", set_json("epoch_result", lambda v: {**v, "steps": []}),
     r"position \[0, 2, 1\] is inside an epoch, but its epoch_result records no step"),
])
def test_inconsistent_or_non_finite_checkpoints_are_refused(stories_path, good, tmp_path, name, edit, expected):
    """Re-sealed with a valid checksum: counters out of range or disagreeing with each other,
    weights and optimizer moments that are not finite (or a negative second moment)."""
    message = refused(stories_path, crafted(good, tmp_path, name, edit), INVALID)
    assert re.search(expected, message), message


def test_a_tensor_of_the_wrong_size_is_refused(stories_path, good, tmp_path) -> None:
    first = next(t for t in contents(good)[1] if t.name.startswith("param."))
    path = crafted(good, tmp_path, "size", replace_tensor(first.name, np.zeros(7, np.float32)))
    refused(stories_path, path, f"tensor {first.name} is F32 with 7 values")


def test_positions_and_orders_that_do_not_fit_the_run_are_refused(stories_path, good, text, tmp_path) -> None:
    """Checked against the run that resumes: a position past its epoch, an order of another length."""
    ckpt = load_checkpoint(good)
    windows = token_windows(llamapy.load_model(stories_path).vocab.tokenize(text), N_CTX)
    steps = int(ckpt.optimizer["opt.n_steps"][0])
    assert ckpt.position.ibatch == steps == len(ckpt.epoch_result.steps)  # one window a step, all in epoch 0
    cases = {"past_the_data": ("position", "is not a step of this run's epoch"),
             "short_order": ("permutation", "does not fit this text"),
             "later_epoch_same_steps": ("position", f"step count {steps} is fewer than its position takes "
                                                    rf"\(epoch 2, window {steps}: at least"),
             "epoch_far_past_the_run": ("position", f"step count {steps} is fewer than its position takes"),
             "position_ahead_of_its_steps": ("position", f"its epoch_result records {steps} steps of this epoch, "
                                                         rf"but its position \(window {steps + 1}, 1 window a "
                                                         rf"step\) is after {steps + 1}")}
    for name, (field, expected) in cases.items():
        changed = load_checkpoint(good)
        if name == "past_the_data":
            changed.position = type(ckpt.position)(0, 10**6, True)
        elif name == "short_order":
            changed.permutation = np.arange(ckpt.permutation.size - 1)
        elif name == "later_epoch_same_steps":
            changed.position = type(ckpt.position)(1, ckpt.position.ibatch, True)
        elif name == "epoch_far_past_the_run":
            changed.position = type(ckpt.position)(10**6, 0, False)
            changed.epoch_result = type(ckpt.epoch_result)()
        else:
            changed.position = type(ckpt.position)(0, ckpt.position.ibatch + 1, True)
        path = save_checkpoint(changed, tmp_path / f"{name}.gguf")
        with pytest.raises(InputError) as e:
            context(stories_path).opt_fit(windows, epochs=1, val_split=0.2, seed=11, silent=True, resume=path)
        message = str(e.value)
        assert str(path) in message and re.search(expected, message) and "\n" not in message, (field, message)


# ---- through the command line ------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["n_steps", "permutation"])
def test_finetune_refuses_a_bad_checkpoint_in_one_line(stories_path, good, text, tmp_path, name) -> None:
    if name == "n_steps":
        bad, expected = tampered(good, tmp_path, name, lambda d: bump_digit(d, "llamapy.checkpoint.n_steps")), CORRUPT
    else:
        bad, expected = crafted(good, tmp_path, name, replace_tensor("data.permutation", np.zeros(8, np.int64))), \
            "is not a permutation"
    data = tmp_path / "text.txt"
    data.write_text(text)
    before = bad.read_bytes()
    out = tmp_path / "out.gguf"
    proc = tool_process("finetune", "-m", str(stories_path), "-f", str(data), "-c", str(N_CTX), "-b", str(2 * N_CTX),
                        "--seed", "11", "--shuffle", "-t", "2", "-o", str(out), "--checkpoint-in", str(bad))  # in this process
    assert_one_clear_line(proc, f"{bad}: ")
    assert expected in proc.stderr
    assert not out.exists() and bad.read_bytes() == before
