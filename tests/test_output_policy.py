"""The output policy: what llamapy writes goes onto a regular file or a new path, never over a
device node, FIFO or directory (a rename over /dev/full made it a regular file); a --log-file
is an output too (checked against every input and output before a byte goes into it,
appended to, a character device or FIFO written to as it is); every file is read back before
it replaces anything, so no tool exits 0 with a file llamapy cannot load; export-lora never
overwrites an adapter folder; quantize refuses layer lists and block counts the model does
not have. Each refusal is one `error:` line and a non-zero exit, and the inputs and the
special files are as they were (hashes, file types)."""
from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest

from llamapy.atomic import replace_atomically
from llamapy.errors import ModelLoadError, SaveError

import gguf_craft as C
from test_hostile_cli import TRAIN, digest, files, one_error, run_tool  # noqa: F401  (files: a fixture)

FULL, NULL = os.makedev(1, 7), os.makedev(1, 3)  # /dev/full's and /dev/null's device numbers


def file_type(path: Path) -> str:
    mode = os.lstat(path).st_mode
    return "fifo" if stat.S_ISFIFO(mode) else "char" if stat.S_ISCHR(mode) else \
        "link" if stat.S_ISLNK(mode) else "file" if stat.S_ISREG(mode) else "other"


def char_device(path: Path, device: int) -> Path:
    """A character device node in a test folder (never /dev itself): /dev/full's or /dev/null's twin."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, device)
        with open(path, "ab"):
            pass
    except PermissionError as e:
        pytest.skip(f"cannot make or open a device node here ({e.strerror}): the test needs root")
    return path


@pytest.fixture
def nodes(tmp_path):
    """name -> a special file in a folder of its own: a FIFO, /dev/full's and /dev/null's
    twins, a link to the /dev/full twin."""
    folder = tmp_path / "nodes"
    folder.mkdir()
    os.mkfifo(folder / "fifo")
    made = {"fifo": folder / "fifo", "full": char_device(folder / "full", FULL),
            "null": char_device(folder / "null", NULL), "link-to-full": folder / "link"}
    made["link-to-full"].symlink_to(made["full"])
    return made


KIND_LINE = {"fifo": "is a FIFO (named pipe)", "full": "is a character device", "null": "is a character device",
             "link-to-full": "is a character device"}


def assert_untouched(node: Path, kind: str) -> None:
    expected = {"fifo": "fifo", "full": "char", "null": "char", "link-to-full": "link"}[kind]
    assert file_type(node) == expected, f"{node} was replaced"
    if kind == "link-to-full":
        assert file_type(node.resolve()) == "char"
    assert not [p for p in node.parent.iterdir() if p.name.endswith(".tmp")], "a temp file was left"


# ---- outputs onto special files ------------------------------------------------------------------
OUTPUTS = {
    "quantize OUT": (lambda m, t, x: ["quantize", m, x, "q8_0"], "OUT"),
    "finetune -o": (lambda m, t, x: ["finetune", "-m", m, "-f", t, *TRAIN, "-o", x], "-o"),
    "finetune --checkpoint-out": (lambda m, t, x: ["finetune", "-m", m, "-f", t, *TRAIN, "--checkpoint-out", x],
                                  "--checkpoint-out"),
    "finetune --plot": (lambda m, t, x: ["finetune", "-m", m, "-f", t, *TRAIN, "--plot", x], "--plot"),
    "finetune --lora-out": (lambda m, t, x: ["finetune", "-m", m, "-f", t, *TRAIN, "--lora-rank", "2",
                                             "--lora-out", x], "--lora-out"),
    "export-lora -o": (lambda m, t, x: ["export-lora", "-m", m, "--lora", "a.gguf", "-o", x], "-o"),
    "convert --outfile": (lambda m, t, x: ["convert", m.parent, "--outtype", "f16", "--outfile", x], "-o"),
}


@pytest.mark.parametrize("kind", ["fifo", "full", "null", "link-to-full"])
@pytest.mark.parametrize("output", list(OUTPUTS))
def test_an_output_is_never_renamed_over_a_special_file(files, nodes, capsys, output, kind):
    model, text = files
    argv, flag = OUTPUTS[output]
    node = nodes[kind]
    code, err = run_tool(*argv(model, text, node), capsys=capsys)
    line = one_error(err)
    assert code != 0 and f"{flag} {node} {KIND_LINE[kind]}" in line, line
    assert "regular file" in line
    assert_untouched(node, kind)


@pytest.mark.parametrize("kind", ["fifo", "full"])
def test_a_peft_folder_file_is_never_renamed_over_a_special_file(files, nodes, tmp_path, capsys, kind):
    model, _ = files
    folder = tmp_path / "peft"
    folder.mkdir()
    node = folder / "adapter_config.json"
    os.rename(nodes[kind], node)
    code, err = run_tool("export-lora", "-m", model, "--lora", "a.gguf", "--to-peft", folder, capsys=capsys)
    assert code != 0 and f"--to-peft {node} {KIND_LINE[kind]}" in one_error(err)
    assert_untouched(node, kind)


def test_replace_atomically_refuses_a_special_file_before_writing(nodes):
    """The library's own check (a Python caller has no Paths registry): nothing is written."""
    calls = []
    for kind in ("fifo", "full", "link-to-full"):
        with pytest.raises(SaveError, match=f"cannot save a test file to .*: it {re.escape(KIND_LINE[kind])}"):
            replace_atomically(nodes[kind], calls.append, "a test file")
        assert_untouched(nodes[kind], kind)
    assert calls == []


def test_replace_atomically_checks_again_right_before_the_rename(tmp_path):
    """A FIFO that appears at the destination while the file is written is not renamed over."""
    dest = tmp_path / "out.gguf"

    def write(out):
        out.write(b"content")
        os.mkfifo(dest)
    with pytest.raises(SaveError, match="it is a FIFO"):
        replace_atomically(dest, write, "a test file")
    assert file_type(dest) == "fifo" and sorted(p.name for p in tmp_path.iterdir()) == ["out.gguf"]


def test_a_link_to_a_regular_file_is_written_as_before(tmp_path):
    target, link = tmp_path / "target.bin", tmp_path / "link.bin"
    target.write_bytes(b"old")
    link.symlink_to(target)
    replace_atomically(link, lambda out: out.write(b"new"), "a test file")
    assert link.read_bytes() == b"new"


# ---- read back before replacing ------------------------------------------------------------------
def test_a_file_that_fails_its_validation_leaves_the_previous_file(tmp_path):
    dest = tmp_path / "model.gguf"
    dest.write_bytes(b"previous")
    seen = []

    def validate(tmp: Path) -> None:
        seen.append(tmp.read_bytes())
        raise ModelLoadError(f"{tmp}: tensor 'x' is damaged")
    with pytest.raises(SaveError) as info:
        replace_atomically(dest, lambda out: out.write(b"new content"), "the model", validate=validate)
    assert seen == [b"new content"]  # the validator read the whole, fsynced temp file
    message = str(info.value)
    assert message == f"cannot save the model to {dest}: what was written does not read back: {dest}: tensor 'x' " \
                      "is damaged"
    assert dest.read_bytes() == b"previous" and sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_a_model_llamapy_cannot_load_is_not_saved(stories_path, tmp_path):
    """save_model_to_file reads the model back through the loader's checks: a metadata override
    that makes it unloadable is refused and the previous file stays."""
    import llamapy
    dest = tmp_path / "saved.gguf"
    dest.write_bytes(b"previous")
    model = llamapy.load_model(stories_path)
    with pytest.raises(SaveError, match=r"does not read back: .*saved\.gguf: tensor 'blk\.4\..*' .* is not part"):
        llamapy.save_model_to_file(model, dest, metadata={"llama.block_count": 4})
    assert dest.read_bytes() == b"previous" and sorted(p.name for p in tmp_path.iterdir()) == ["saved.gguf"]


def test_every_gguf_writer_reads_its_file_back(stories_path, tmp_path):
    """write_atomically (converted models, adapters, checkpoints): a file that says it is a
    model goes through the model loader's checks, any other through the GGUF reader."""
    from llamapy.save import write_atomically
    meta, tensors = C.parts(stories_path)
    meta["general.type"] = C.string("model")
    meta["llama.block_count"] = C.u32(4)
    dest = tmp_path / "converted.gguf"
    with pytest.raises(SaveError, match=r"does not read back: .*converted\.gguf: tensor 'blk\.4\."):
        write_atomically(meta, tensors, dest, "the converted model")
    assert list(tmp_path.iterdir()) == []
    meta["general.type"] = C.string("adapter")  # an adapter's own checks need its base: the GGUF reader's
    assert write_atomically(meta, tensors, dest, "the adapter") == dest


def test_quantize_never_ends_with_a_model_llamapy_cannot_load(files, capsys):
    model, _ = files
    out = model.parent / "q.gguf"
    out.write_bytes(b"previous quantization")
    code, err = run_tool("quantize", "--override-kv", "llama.block_count=int:4", model, out, "q8_0", capsys=capsys)
    line = one_error(err)
    assert code != 0 and f"cannot save the quantized model to {out}: what was written does not read back" in line
    assert out.read_bytes() == b"previous quantization"
    assert not [p for p in model.parent.iterdir() if p.name.endswith(".tmp")]


def test_quantize_passes_on_an_architecture_llamapy_does_not_run(files, capsys):
    """The read-back of a model of another architecture is the GGUF reader's: it is quantized."""
    model, _ = files
    meta, tensors = C.parts(model)
    meta = {key.replace("llama.", "phi9.", 1): v for key, v in meta.items()}
    meta["general.architecture"] = C.string("phi9")
    other = C.write(model.parent / "phi9.gguf", meta, tensors)
    code, err = run_tool("quantize", other, model.parent / "q.gguf", "q8_0", capsys=capsys)
    assert code == 0, err
    from llamapy.gguf_file import GGUFFile
    assert GGUFFile(model.parent / "q.gguf").metadata["general.architecture"].value == "phi9"


# ---- the log file ----------------------------------------------------------------------------------
def hf_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return folder


LOG_ONTO_INPUT = {
    "quantize": (lambda m, t, d: ["quantize", m, d / "q.gguf", "q8_0", "--log-file", m], "is the file IN reads"),
    "quantize OUT": (lambda m, t, d: ["quantize", m, d / "prev.gguf", "q8_0", "--log-file", d / "prev.gguf"],
                     "are the same file"),
    "convert": (lambda m, t, d: ["convert", d / "hf", "--outtype", "f16", "-o", d / "c.gguf", "--log-file",
                                 d / "hf" / "config.json"], "is the file HF_DIR reads"),
    "tokenize": (lambda m, t, d: ["tokenize", "-m", m, t, "-o", d / "shards", "--log-file", t],
                 "is the file TEXT reads"),
    "finetune": (lambda m, t, d: ["finetune", "-m", m, "-f", t, *TRAIN, "--log-file", t], "is the file -f reads"),
    "finetune model": (lambda m, t, d: ["finetune", "-m", m, "-f", t, *TRAIN, "--log-file", m],
                       "is the file -m reads"),
}


@pytest.mark.parametrize("case", list(LOG_ONTO_INPUT))
def test_a_log_file_onto_an_input_is_refused_before_a_byte_goes_into_it(files, tmp_path, capsys, case):
    """Its refusal line included: the model, text, config or earlier output keeps its hash."""
    model, text = files
    config = hf_folder(tmp_path) / "config.json"
    previous = tmp_path / "prev.gguf"
    previous.write_bytes(b"an earlier quantization")
    before = {p: digest(p) for p in (config, previous)}
    argv, expected = LOG_ONTO_INPUT[case]
    code, err = run_tool(*argv(model, text, tmp_path), capsys=capsys)
    line = one_error(err)
    assert code != 0 and "--log-file" in line and expected in line, line
    assert {p: digest(p) for p in before} == before
    assert not (tmp_path / "shards").exists() and not (tmp_path / "q.gguf").exists()


def test_a_log_file_onto_a_default_output_is_refused_before_a_byte_goes_into_it(files, capsys, monkeypatch):
    """finetune's default -o (finetuned-model.gguf) is known once the model is loaded: it is
    declared before the first log line, so an earlier run's model there is not appended to."""
    model, text = files
    monkeypatch.chdir(model.parent)
    earlier = model.parent / "finetuned-model.gguf"
    earlier.write_bytes(b"an earlier finetune")
    code, err = run_tool("finetune", "-m", model, "-f", text, *TRAIN, "--log-file", earlier.name, capsys=capsys)
    assert code != 0 and "-o finetuned-model.gguf and --log-file finetuned-model.gguf are the same file" in \
        one_error(err)
    assert earlier.read_bytes() == b"an earlier finetune"


def test_a_log_file_on_a_full_device_is_one_line(files, nodes, capsys):
    model, _ = files
    out = model.parent / "q.gguf"
    code, err = run_tool("quantize", model, out, "q8_0", "--log-file", nodes["full"], capsys=capsys)
    assert code != 0 and f"--log-file {nodes['full']}: cannot write to it: No space left on device" in one_error(err)
    assert_untouched(nodes["full"], "full")
    assert not out.exists()  # refused at the first log line, before the work


def test_a_log_file_on_a_character_device_is_written_to_not_replaced(files, nodes, capsys):
    model, _ = files
    code, err = run_tool("quantize", model, model.parent / "q.gguf", "q8_0", "--log-file", nodes["null"],
                         capsys=capsys)
    assert code == 0, err
    assert_untouched(nodes["null"], "null")


def test_a_log_file_on_a_fifo_is_written_to_its_reader(files, nodes, capsys):
    model, _ = files
    reader = os.open(nodes["fifo"], os.O_RDONLY | os.O_NONBLOCK)
    try:
        code, err = run_tool("quantize", model, model.parent / "q.gguf", "q8_0", "--log-file", nodes["fifo"],
                             capsys=capsys)
        received = os.read(reader, 1 << 20).decode()
    finally:
        os.close(reader)
    assert code == 0, err
    assert "llamapy-quantize: quantizing" in received and "quant size" in received
    assert_untouched(nodes["fifo"], "fifo")


def test_a_log_file_on_a_fifo_that_nobody_reads_is_one_line_not_a_hang(files, nodes, capsys):
    model, _ = files
    code, err = run_tool("quantize", model, model.parent / "q.gguf", "q8_0", "--log-file", nodes["fifo"],
                         capsys=capsys)
    assert code != 0 and "cannot write to it: no process reads it" in one_error(err)
    assert_untouched(nodes["fifo"], "fifo")


def test_a_log_file_is_appended_to_with_the_lines_before_the_command(files, capsys):
    """Lines logged before the command's own first one (-v's flags, notes) reach it too."""
    model, _ = files
    log = model.parent / "run.log"
    log.write_text("an earlier run\n")
    code, err = run_tool("quantize", "-v", model, model.parent / "q.gguf", "q8_0", "--log-file", log, capsys=capsys)
    assert code == 0, err
    lines = log.read_text().splitlines()
    assert lines[0] == "an earlier run" and lines[1].startswith("flags: ")
    assert any(line.startswith("llamapy-quantize: quantizing") for line in lines)


def test_a_log_file_onto_a_directory_is_one_line(files, tmp_path, capsys):
    model, _ = files
    code, err = run_tool("quantize", model, tmp_path / "q.gguf", "q8_0", "--log-file", tmp_path, capsys=capsys)
    assert code != 0 and f"--log-file {tmp_path} is a directory" in one_error(err)


def test_an_error_after_the_log_opened_is_in_the_log(files, capsys):
    model, _ = files
    log = model.parent / "run.log"
    code, err = run_tool("quantize", "--prune-layers", "7", model, model.parent / "q.gguf", "q8_0", "--log-file", log,
                         capsys=capsys)
    assert code != 0
    assert one_error(err) in log.read_text().splitlines()


# ---- export-lora --to-peft -----------------------------------------------------------------------
@pytest.mark.parametrize("held", ["adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"])
def test_export_lora_never_overwrites_an_adapter_folder(files, tmp_path, capsys, held):
    model, _ = files
    folder = tmp_path / "peft"
    folder.mkdir()
    (folder / held).write_bytes(b"the user's adapter")
    code, err = run_tool("export-lora", "-m", model, "--lora", "a.gguf", "--to-peft", folder, capsys=capsys)
    line = one_error(err)
    assert code != 0 and f"{folder} already holds a PEFT adapter ({held})" in line and "new or empty folder" in line
    assert [p.name for p in folder.iterdir()] == [held] and (folder / held).read_bytes() == b"the user's adapter"


def test_an_empty_or_new_folder_takes_a_peft_adapter(tmp_path):
    from llamapy.convert.peft import check_peft_folder
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "README.md").write_text("notes")
    for folder in ("empty", "new", "other"):
        check_peft_folder(tmp_path / folder)


# ---- quantize: layers the model has --------------------------------------------------------------
@pytest.mark.parametrize("layers, expected", [
    ("0,1,2,3,4", "--prune-layers names every layer of the model (5): nothing would be left to run"),
    ("4,3,2,1,0", "--prune-layers names every layer of the model (5)"),
    ("99", "--prune-layers 99: the model has 5 layers (0 to 4)"),
    ("1,5", "--prune-layers 5: the model has 5 layers (0 to 4)"),
])
def test_quantize_refuses_layers_to_prune_the_model_does_not_have(files, capsys, layers, expected):
    model, _ = files
    out = model.parent / "q.gguf"
    code, err = run_tool("quantize", "--prune-layers", layers, model, out, "q8_0", capsys=capsys)
    assert code != 0 and expected in one_error(err)
    assert not out.exists()


@pytest.mark.parametrize("arch", ["llama", "phi9"])
def test_quantize_refuses_a_block_count_its_tensors_cannot_hold(files, capsys, arch):
    """llama: the model loader's refusal; phi9 (not run by llamapy, quantized as it is): the same rule."""
    model, _ = files
    meta, tensors = C.parts(model)
    meta = {key.replace("llama.", f"{arch}.", 1): v for key, v in meta.items()}
    meta["general.architecture"] = C.string(arch)
    meta[f"{arch}.block_count"] = C.u32(10**9)
    bad = C.write(model.parent / "big.gguf", meta, tensors)
    out = model.parent / "q.gguf"
    code, err = run_tool("quantize", bad, out, "q8_0", capsys=capsys)
    assert code != 0 and f"{arch}.block_count = 1000000000, but the file holds only 48 tensors" in one_error(err)
    assert not out.exists()
