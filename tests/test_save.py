"""save_model_to_file: complete GGUF round trips, trained weights saved, atomic failures."""
from __future__ import annotations

import filecmp
import shutil
import types

import gguf
import numpy as np
import pytest

import llamapy
from ggmlpy import GGMLType, traits
from llamapy.errors import SaveError
from llamapy.gguf_file import GGUFFile, StringArray


def fields_of(source) -> dict:
    """Every real metadata key: (value types, decoded value), in file order (source: a path or a loaded Model)."""
    reader = source.file.reader if isinstance(source, llamapy.Model) else gguf.GGUFReader(source)
    return {k: (list(f.types), f.contents()) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def assert_same_tensors(a: llamapy.Model, b: llamapy.Model) -> None:
    assert list(a.tensors) == list(b.tensors)
    for name, ta in a.tensors.items():
        tb = b.tensors[name]
        assert (ta.type, ta.ne) == (tb.type, tb.ne), name
        assert ta.array().tobytes() == tb.array().tobytes(), name


def make_writable(t) -> None:
    """Model weights are memory-mapped read-only: give the tensor its own copy of its bytes."""
    t.bind(np.ascontiguousarray(t.array()).reshape(-1).view(np.uint8).copy())


def logits(model, tokens) -> np.ndarray:
    ctx = llamapy.Context(model, n_ctx=32, n_batch=32, n_ubatch=32)
    ctx.decode(llamapy.Batch.from_tokens(tokens, all_outputs=True))
    return ctx.get_logits().copy()


def leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


@pytest.mark.parametrize("which", ["stories_path", "tiny_random_path"])
def test_round_trip_is_complete_and_bit_exact(which, request, tmp_path):
    src = request.getfixturevalue(which)
    model = llamapy.load_model(src)
    out = tmp_path / "saved.gguf"
    assert llamapy.save_model_to_file(model, out) == out
    again = llamapy.load_model(out)
    assert_same_tensors(model, again)
    src_fields, out_fields = fields_of(model), fields_of(again)  # the readers the loads already parsed
    assert list(out_fields) == list(src_fields)  # same keys, same order (tokenizer arrays included)
    assert out_fields == src_fields
    assert again.vocab.n_tokens == model.vocab.n_tokens
    # an unchanged model is saved byte for byte as llama.cpp's own writer laid it out
    assert filecmp.cmp(src, out, shallow=False)
    assert leftovers(tmp_path) == []


def test_trained_weights_are_saved_and_give_the_same_logits(stories_path, tmp_path):
    model = llamapy.load_model(stories_path)
    tokens = model.vocab.tokenize("Once upon a time, there was a little dog.", add_special=True)
    before = logits(model, tokens)
    for name in ("blk.0.attn_q.weight", "output_norm.weight"):
        t = model.tensors[name]
        make_writable(t)
        t.array()[...] *= np.float32(1.5)
    trained = logits(model, tokens)
    assert not np.array_equal(trained, before)

    out = tmp_path / "trained.gguf"
    llamapy.save_model_to_file(model, out)
    again = llamapy.load_model(out)
    assert_same_tensors(model, again)
    original = llamapy.load_model(stories_path)
    np.testing.assert_array_equal(again.tensors["blk.0.attn_q.weight"].numpy(),
                                  original.tensors["blk.0.attn_q.weight"].numpy() * np.float32(1.5))
    np.testing.assert_array_equal(logits(again, tokens), trained)
    assert fields_of(again) == fields_of(original)


def test_metadata_overrides_keep_type_and_place(stories_path, tmp_path):
    model = llamapy.load_model(stories_path)
    out = tmp_path / "named.gguf"
    llamapy.save_model_to_file(model, out, metadata={"general.name": "stories-finetuned", "training.steps": 12,
                                                     "training.loss": 1.25})
    src, saved = fields_of(stories_path), fields_of(out)
    assert list(saved) == list(src) + ["training.steps", "training.loss"]
    assert saved["general.name"] == ([gguf.GGUFValueType.STRING], "stories-finetuned")
    assert saved["training.steps"] == ([gguf.GGUFValueType.UINT32], 12)
    assert saved["training.loss"] == ([gguf.GGUFValueType.FLOAT32], 1.25)
    assert {k: v for k, v in saved.items() if k != "general.name" and k in src} == \
           {k: v for k, v in src.items() if k != "general.name"}
    assert_same_tensors(model, llamapy.load_model(out))


def test_saving_over_the_source_file(stories_path, tmp_path):
    """The model is memory-mapped from the file it is saved over: the rename keeps that safe."""
    path = tmp_path / "model.gguf"
    shutil.copyfile(stories_path, path)
    model = llamapy.load_model(path)
    t = model.tensors["blk.1.ffn_up.weight"]
    make_writable(t)
    t.array()[...] = -t.array()
    expected = model.tensors["blk.0.ffn_down.weight"].numpy()
    llamapy.save_model_to_file(model, path)
    again = llamapy.load_model(path)
    assert_same_tensors(model, again)
    np.testing.assert_array_equal(model.tensors["blk.0.ffn_down.weight"].numpy(), expected)  # old map still valid
    assert leftovers(tmp_path) == []


def test_destination_in_a_missing_directory(stories_path, tmp_path):
    model = llamapy.load_model(stories_path)
    dest = tmp_path / "no" / "such" / "dir" / "model.gguf"
    with pytest.raises(llamapy.LlamapyError, match=r"cannot save model to .*model\.gguf: No such file or directory"):
        llamapy.save_model_to_file(model, dest)
    assert not (tmp_path / "no").exists()
    assert list(tmp_path.iterdir()) == []


def test_destination_that_is_a_directory(stories_path, tmp_path):
    model = llamapy.load_model(stories_path)
    dest = tmp_path / "models"
    dest.mkdir()
    with pytest.raises(SaveError, match="is a directory") as info:
        llamapy.save_model_to_file(model, dest)
    assert "\n" not in str(info.value) and str(dest) in str(info.value)
    assert list(dest.iterdir()) == [] and leftovers(tmp_path) == []


def test_disk_full_midway_leaves_the_old_file_intact(stories_path, tmp_path, disk_full_after):
    model = llamapy.load_model(stories_path)
    dest = tmp_path / "model.gguf"
    dest.write_bytes(b"previous contents")
    files = disk_full_after(stories_path.stat().st_size // 2)  # the disk fills up in the data section
    with pytest.raises(SaveError, match=r"^cannot save model to .*model\.gguf: No space left on device$"):
        llamapy.save_model_to_file(model, dest)
    assert len(files) == 1 and files[0].writes > 10  # it failed midway, tensors written before it
    assert dest.read_bytes() == b"previous contents"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_other_types_layouts_and_metadata_kinds(tmp_path):
    """Types and values the shared models lack: I32, BF16, 64-bit scalars, bool, nested arrays, 64-byte alignment,
    a 2-d tensor with a trailing 1."""
    src = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(src, "llama")
    w.add_custom_alignment(64)
    w.add_bool("odd.flag", True)
    w.add_int64("odd.i64", -(2**40))
    w.add_uint64("odd.u64", 2**60)
    w.add_float64("odd.f64", np.pi)
    w.add_int8("odd.i8", -3)
    w.add_key_value("odd.nested", [[1, 2, 3], [4, 5]], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.ARRAY)
    w.add_array("odd.strings", ["a", "ä", "▁b"])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("row", rng.standard_normal((1, 7)).astype(np.float16))
    w.add_tensor("ids", np.arange(11, dtype=np.int32))
    w.add_tensor("bf16", rng.integers(0, 2**16, (2, 4), dtype=np.uint16), raw_dtype=gguf.GGMLQuantizationType.BF16)
    out = save_raw_file(w, tmp_path)
    assert filecmp.cmp(src, out, shallow=False)
    assert fields_of(out) == fields_of(src)
    reader = gguf.GGUFReader(out)
    assert reader.alignment == 64
    assert [len(t.shape) for t in reader.tensors] == [2, 2, 1, 2]


def save_raw_file(w: gguf.GGUFWriter, tmp_path):
    """Finish a GGUFWriter's file, open it as llamapy does and save it through save_model_to_file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(w.path)
    model = types.SimpleNamespace(file=f, tensors=f.tensors, path=f.path)  # no architecture needed to save
    out = tmp_path / "saved.gguf"
    llamapy.save_model_to_file(model, out)
    return out


def test_quantized_tensors_are_saved_as_raw_blocks(tmp_path):
    try:
        traits(GGMLType.Q8_0)
    except NotImplementedError:
        pytest.skip("ggmlpy has no Q8_0 yet: quantized tensors not exercised")
    src = tmp_path / "q8.gguf"
    w = gguf.GGUFWriter(src, "llama")
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 255, (4, 3 * 34), dtype=np.uint8)  # 4 rows of 3 blocks of 32 values
    w.add_tensor("q8", blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("f32", rng.standard_normal((2, 96)).astype(np.float32))
    f = GGUFFile(save_raw_file(w, tmp_path))
    assert f.tensors["q8"].type == GGMLType.Q8_0 and f.tensors["q8"].ne == (96, 4, 1, 1)
    assert f.tensors["q8"].array().tobytes() == blocks.tobytes()
    assert filecmp.cmp(src, f.path, shallow=False)


def gguf_with_one_key(path, key: str, value_bytes: bytes):
    """A GGUF file with one metadata key of raw encoded value (type tag included) and no tensors:
    values gguf's writer cannot produce."""
    name = key.encode()
    header = (b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (1).to_bytes(8, "little")
              + len(name).to_bytes(8, "little") + name + value_bytes)
    path.write_bytes(header + bytes(-len(header) % 32))  # padded to the data section, as written
    return path


@pytest.mark.parametrize("value", [
    ((9).to_bytes(4, "little") + (4).to_bytes(4, "little") + (0).to_bytes(8, "little")),
    ((9).to_bytes(4, "little") + (8).to_bytes(4, "little") + (0).to_bytes(8, "little")),
    ((9).to_bytes(4, "little") + (9).to_bytes(4, "little") + (2).to_bytes(8, "little")
     + (0).to_bytes(4, "little") + (2).to_bytes(8, "little") + bytes([7, 8])
     + (8).to_bytes(4, "little") + (1).to_bytes(8, "little") + (2).to_bytes(8, "little") + b"\xff!"),
    ((8).to_bytes(4, "little") + (3).to_bytes(8, "little") + b"a\xc3("),
], ids=["empty array", "empty string array", "nested arrays of uint8 and of strings", "string not UTF-8"])
def test_metadata_gguf_can_hold_is_saved_byte_for_byte(tmp_path, value):
    """Values the gguf package's writer cannot produce (empty arrays, nested arrays with their
    own item types) and strings that are not UTF-8 are copied exactly: the saved file is the source."""
    src = gguf_with_one_key(tmp_path / "odd.gguf", "odd.key", value)
    f = GGUFFile(src)
    model = types.SimpleNamespace(file=f, tensors=f.tensors, path=f.path)
    dest = tmp_path / "saved.gguf"
    llamapy.save_model_to_file(model, dest)
    assert dest.read_bytes() == src.read_bytes()


def test_a_string_array_is_read_as_its_bytes_and_used_as_a_list(tmp_path):
    """A vocabulary passes through a tool as the bytes it was read as (llamapy-quantize never
    decodes Gemma's 262,144 tokens), and reads like the list of str it stands for."""
    items = ["a", "", "é", "a\udcff(", "<s>"]  # the 4th: the bytes a\xff( kept via surrogateescape
    body = b"".join(len(s.encode("utf-8", "surrogateescape")).to_bytes(8, "little")
                    + s.encode("utf-8", "surrogateescape") for s in items)
    value = (9).to_bytes(4, "little") + (8).to_bytes(4, "little") + len(items).to_bytes(8, "little") + body
    f = GGUFFile(gguf_with_one_key(tmp_path / "strings.gguf", "some.strings", value))
    read = f.metadata["some.strings"].value
    assert isinstance(read, StringArray) and read.raw == body
    assert len(read) == 5 and read == items and list(read) == items and read.tolist() == items
    assert read[2] == "é" and read[-1] == "<s>" and read[1:3] == ["", "é"]
    assert StringArray(body, 5) == read and StringArray(body[:-11], 4) != read
    assert read != items[:-1] and read != ["a", "", "é", "a\udcff(", "</s>"]
