"""The tools as llama.cpp users expect them: every flag of the matching llama.cpp tool is
parsed whole (honoured, or noted, or refused by name), -h/--version/-v/--log-disable/
--log-file and LLAMA_ARG_* work everywhere, --help is grouped and never truncated, and each
bad invocation is one line with a non-zero exit. llama.cpp's flags come from its own --help
(tests/data/llama_cpp_flags.json, recorded by tests/record_llama_cpp_cli.py)."""
from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import typer

from conftest import REPO_ROOT, run_tool
from llamapy.cli import TOOLS
from llamapy.errors import InputError

LLAMA_CPP_FLAGS = json.loads((Path(__file__).parent / "data" / "llama_cpp_flags.json").read_text())
# our tool -> llama.cpp's tools whose flags it takes (llamapy-train is the old train-text-from-scratch,
# whose flags live on in llama-finetune)
MATCHING = {"cli": ("completion", "cli"), "perplexity": ("perplexity",), "finetune": ("finetune",),
            "train": ("finetune",), "export-lora": ("export-lora",), "server": ("server",), "quantize": ("quantize",),
            "convert": ("convert", "convert-lora"), "tokenize": ()}  # llama-tokenize prints tokens: another job
REQUIRED = {"perplexity": ["-m", "m.gguf"], "export-lora": ["-m", "m.gguf"], "train": ["--vocab-model", "m.gguf"],
            "quantize": ["in.gguf", "out.gguf", "q8_0"], "convert": ["hf_dir"], "tokenize": ["-m", "m.gguf", "x.txt"]}
OWN_COMMAND_LINE = ("quantize", "convert", "tokenize")  # tools whose flags are not common/arg.cpp's


def tool_of(name: str):
    return importlib.import_module(TOOLS[name][0]).tool


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def llama_cpp_names(name: str) -> dict[str, str]:
    """Every name of every flag of the llama.cpp tools matching ours -> its value hint."""
    return {flag: entry["hint"] for tool in MATCHING[name] for entry in LLAMA_CPP_FLAGS[tool]
            for flag in entry["names"]}


def _parse_with_a_valid_value(tool, command, flag, option, required):
    """click's context for `flag` given alone, with the first of a few values its checks accept
    (`-c 1` is refused by the training tools, whose windows need two tokens)."""
    values = ("1", "2", "0.5") if option.takes_value and option.bare is None else (None,)
    for value in values:
        args, notes = tool.prescan([flag] + ([value] if value else []) + required)
        assert not notes
        try:
            return command.make_context(tool.name, args, resilient_parsing=False)
        except typer.BadParameter:
            if value == values[-1]:
                raise


@pytest.mark.parametrize("name", sorted(TOOLS))
def test_every_llama_cpp_flag_is_honoured_noted_or_refused_by_name(name):
    """Acceptance: each of llama.cpp's flags is parsed whole, in every tool; single-dash ones
    with several letters (-ngl, -fa, -sp, -ctk, ...) are the ones click would otherwise split."""
    tool = tool_of(name)
    command = tool.click_command()
    declared = tool.declared()
    problems = []
    for flag, hint in sorted(llama_cpp_names(name).items()):
        if flag in declared:
            option = declared[flag]
            if flag in ("-h", "--help", "--usage", "--version"):
                continue
            ctx = _parse_with_a_valid_value(tool, command, flag, option, REQUIRED.get(name, []))
            params = [p for p in command.params if flag in (*p.opts, *p.secondary_opts)]
            if len(params) != 1 or ctx.get_parameter_source(params[0].name).name != "COMMANDLINE":
                problems.append(f"{flag}: declared but not parsed into its option")
        elif flag in tool.llama_cpp:
            known = tool.llama_cpp[flag]
            argv = [flag] + ["1"] * known.n_values
            if known.refuse:
                with pytest.raises(InputError) as refused:
                    tool.prescan(argv)
                if not str(refused.value).startswith(f"{flag}: ") or not known.why:
                    problems.append(f"{flag}: refused without its name and a reason: {refused.value}")
            else:
                args, notes = tool.prescan(argv)
                if args or len(notes) != 1 or flag not in notes[0]:
                    problems.append(f"{flag}: noted wrongly: {args} {notes}")
        else:
            problems.append(f"{flag} ({hint}): neither declared nor in llamapy/cli/llama_cpp.py")
    assert not problems, "\n".join(problems)


def test_the_multi_letter_single_dash_flags_are_many_and_covered():
    """The flags click would split (-ngl into -n gl) are there in each llama.cpp tool built on
    common/arg.cpp (llama-quantize and convert_hf_to_gguf.py have their own, all --long)."""
    for name in set(TOOLS) - set(OWN_COMMAND_LINE):
        multi = [f for f in llama_cpp_names(name) if re.fullmatch(r"-[^-].+", f)]
        assert len(multi) >= 40, name


@pytest.mark.parametrize("argv, expected", [
    (["-xyz"], "unknown flag -xyz"),
    (["--temprature", "1"], "did you mean --temperature?"),
    (["-ngl"], "-ngl needs a value"),
    (["-hf", "user/model"], "-hf: llamapy does not download models"),
    (["-c=128"], "unknown flag -c=128"),
    (["--lora-scaled", "a.gguf", "-p", "hi"], "--lora-scaled a.gguf: expected FNAME:SCALE"),
    (["--lora-scaled", "a.gguf:half"], "--lora-scaled a.gguf:half: expected FNAME:SCALE"),
    (["-n", "x"], "invalid value for -n: "),
    (["-ctk", "q8_0", "-p", "hi"], "-ctk q8_0: the KV cache can be f16 or f32"),
    (["-fa", "maybe", "-p", "hi"], "-fa must be on, off or auto"),
    (["-l", "15043*2", "-p", "hi"], "-l 15043*2: expected TOKEN_ID(+/-)BIAS"),
    (["--samplers", "kt"], "--samplers: this sampler is not in llamapy's chain"),
])
def test_bad_cli_invocations_are_one_line(argv, expected, stories_path, capsys):
    code, _, err = run_tool("cli", "-m", str(stories_path), *argv, capsys=capsys)
    assert code != 0
    assert expected in one_error_line(err)


@pytest.mark.parametrize("name, argv, expected", [
    ("finetune", ["--lora-rank", "0"], "--lora-rank"),
    ("finetune", ["--seed", "-2"], "--seed must be >= 0, or -1 for a random one"),
    ("finetune", ["-lr", "-1"], "-lr must be > 0"),
    ("finetune", ["--lora", "a.gguf"], "--lora: an existing adapter does not train further here"),
    ("train", ["--lora-rank", "4"], "unknown flag --lora-rank"),
    ("perplexity", ["-f", "x.txt", "-p", "text"], "give the text to score with -f FILE (or -p TEXT)"),
    ("perplexity", ["--kl-divergence"], "--kl-divergence needs --kl-divergence-base FNAME"),
    ("perplexity", ["--ppl-stride", "256"], "--ppl-stride: not in llamapy-perplexity"),
    ("export-lora", [], "give at least one adapter"),
])
def test_bad_invocations_of_every_tool_are_one_line(name, argv, expected, stories_path, capsys):
    model = ["--vocab-model" if name == "train" else "-m", str(stories_path)]
    code, _, err = run_tool(name, *model, *argv, capsys=capsys)
    assert code != 0
    assert expected in one_error_line(err)


@pytest.mark.parametrize("name", sorted(TOOLS))
def test_help_version_and_env_vars_in_every_tool(name, capsys, monkeypatch):
    code, out, _ = run_tool(name, "-h", capsys=capsys)
    assert code == 0 and out.startswith(f"Usage: llamapy-{name} [OPTIONS]")
    code, out, _ = run_tool(name, "--version", capsys=capsys)
    assert code == 0 and "llamapy 0." in out
    tool = tool_of(name)
    monkeypatch.setenv("LLAMA_ARG_CTX_SIZE", "128")
    monkeypatch.setenv("LLAMA_ARG_THREADS", "3")
    ctx = tool.click_command().make_context(tool.name, REQUIRED.get(name, []))
    if "-c" in tool.declared():
        assert ctx.params["ctx_size"] == 128
    if "-t" in tool.declared():
        assert ctx.params["threads"] == 3


@pytest.mark.parametrize("name", sorted(TOOLS))
def test_help_at_80_columns_is_grouped_and_never_truncated(name, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run_tool(name, "--help", capsys=capsys)
    assert code == 0
    assert "…" not in out
    assert max(len(line) for line in out.splitlines()) <= 80
    for flag in tool_of(name).declared():
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", out), f"{flag} missing from the help"
    groups = re.findall(r"^(\w[\w ]*):$", out, re.MULTILINE)
    assert "Common" in groups and "Logging" in groups and len(groups) >= 3


def test_logging_flags(stories_path, wiki_path, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(wiki_path.read_text(encoding="utf-8")[:6000], encoding="utf-8")
    args = ["-m", str(stories_path), "-f", str(text), "-c", "64", "--chunks", "2", "-t", "1"]
    code, out, err = run_tool("perplexity", *args, "--log-disable", capsys=capsys)
    assert code == 0 and err == "" and out.startswith("[1]")
    code, _, err = run_tool("perplexity", *args, "-v", "-ngl", "99", "--log-file", str(tmp_path / "log"),
                            capsys=capsys)
    assert code == 0 and "flags: " in err and "note: -ngl 99: no effect" in err
    assert "Final estimate" in (tmp_path / "log").read_text()
    code, _, err = run_tool("perplexity", *args, "-lv", "2", "-c", "4096", capsys=capsys)
    assert code != 0 and "warning: the model was trained on only 2048" in err
    assert "model:" not in err  # info lines hidden at level 2


def test_lora_lists_and_scales_parse_as_llama_cpp():
    from llamapy.cli.common import adapter_list
    assert adapter_list(["a.gguf,b.gguf", "c.gguf"], ["d.gguf:0.5,e.gguf:-1", "C:/x.gguf:2"]) == [
        ("a.gguf", 1.0), ("b.gguf", 1.0), ("c.gguf", 1.0), ("d.gguf", 0.5), ("e.gguf", -1.0), ("C:/x.gguf", 2.0)]


def test_a_lora_finetune_honours_o_and_does_not_shuffle(stories_path, wiki_path, tmp_path, capsys, monkeypatch):
    """-o names the adapter; two seeds give the same losses for a full finetune (llama-finetune
    never shuffles); --seed -1 is a random seed, printed; export-lora writes llama.cpp's
    default file, which loads."""
    import llamapy
    monkeypatch.chdir(tmp_path)
    text = tmp_path / "t.txt"
    text.write_text(wiki_path.read_text(encoding="utf-8")[:4000], encoding="utf-8")
    base = ["-m", str(stories_path), "-f", str(text), "-c", "32", "--epochs", "1", "-t", "1"]
    code, _, err = run_tool("finetune", *base, "--lora-rank", "2", "-o", "mine.gguf", "--seed", "-1", capsys=capsys)
    assert code == 0, err
    assert (tmp_path / "mine.gguf").is_file() and not (tmp_path / "lora-adapter.gguf").exists()
    assert re.search(r"seed: \d+ \(random: --seed \d+ repeats this run\)", err)
    losses = []
    for seed in ("1", "2"):
        code, _, err = run_tool("finetune", *base, "--seed", seed, "-o", f"full{seed}.gguf", capsys=capsys)
        assert code == 0, err
        losses.append(re.findall(r"loss=([\d.]+)", err))
    assert losses[0] == losses[1] and losses[0]
    code, _, err = run_tool("export-lora", "-m", str(stories_path), "--lora", "mine.gguf", capsys=capsys)
    assert code == 0, err
    merged = llamapy.load_model(tmp_path / "ggml-lora-merged-f16.gguf")
    assert merged.tensors["blk.0.attn_q.weight"].type.name == "F32"  # llama.cpp's rule: F32 stays F32


def test_llama_cpp_flags_on_the_command_line(stories_path):
    """The rows of the issue's table, as a user types them."""
    proc = subprocess.run([sys.executable, "-m", "llamapy.cli.completion", "-m", str(stories_path), "-p", "Once",
                           "-n", "6", "--temp", "0", "-ngl", "0", "-fa", "off", "-sp", "-t", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "note: -ngl 0: no effect" in proc.stderr
    assert proc.stdout.startswith("<s> Once")  # -sp prints BOS's text


def test_python_m_llamapy_lists_and_runs_the_tools():
    proc = subprocess.run([sys.executable, "-m", "llamapy"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and all(f"llamapy-{name}" in proc.stdout for name in TOOLS)
    proc = subprocess.run([sys.executable, "-m", "llamapy", "perplexity", "--version"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("llamapy-perplexity (llamapy ")


def test_the_wheel_holds_only_llamapy_and_ggmlpy(tmp_path):
    """`pip install .` puts no top-level package but llamapy and ggmlpy into site-packages
    (built from a copy of the sources: a build writes its folders beside them)."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "build", "*.egg-info", ".git", "tests", "bench")
    shutil.copytree(REPO_ROOT, src, ignore=ignore)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(src)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("llamapy-*.whl")
    with zipfile.ZipFile(wheel) as z:
        tops = {name.split("/")[0] for name in z.namelist() if not name.split("/")[0].endswith(".dist-info")}
        scripts = z.read(next(n for n in z.namelist() if n.endswith("entry_points.txt"))).decode()
    assert tops == {"llamapy", "ggmlpy"}
    assert all(f"llamapy-{name} = " in scripts for name in TOOLS)


def test_the_compile_note_comes_only_when_numba_compiles(tmp_path):
    """The first-run note is tied to numba really compiling, not to a guess from one kernel."""
    probe = ("from ggmlpy.backend.cpu import on_first_compile\n"
             "import numpy as np\n"
             "on_first_compile(lambda: print('compiling'))\n"
             "from ggmlpy.backend.cpu.rows.kernels import rms_norm_f32\n"
             "x = np.ones((1, 1, 2, 8), np.float32)\n"
             "rms_norm_f32(x, np.empty_like(x), 1e-5)\n")
    env = {**__import__("os").environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO_ROOT, env=env,
                           timeout=300).stdout for _ in range(2)]
    assert runs == ["compiling\n", ""]


@pytest.mark.parametrize("name", ["perplexity", "cli"])
def test_a_tool_keeps_its_startup_objects_out_of_full_collections_and_gives_them_back(
        name, stories_path, wiki_path, tmp_path, capsys, monkeypatch):
    """A full garbage collection over a loaded model's ~170k objects took ~90 ms, set off by the
    first graph of a new shape (the first token after a long prompt): the tools freeze what
    they made at startup, and unfreeze it when they end (in process, for a caller like this)."""
    import gc
    frozen = []
    real_freeze = gc.freeze
    monkeypatch.setattr(gc, "freeze", lambda: (real_freeze(), frozen.append(gc.get_freeze_count())))
    text = tmp_path / "t.txt"
    text.write_text(wiki_path.read_text(encoding="utf-8")[:3000], encoding="utf-8")
    argv = {"perplexity": ["-f", str(text), "-c", "64", "--chunks", "2"], "cli": ["-p", "Once", "-n", "4"]}[name]
    code, _, _ = run_tool(name, "-m", str(stories_path), *argv, "-t", "1", capsys=capsys)
    assert code == 0
    assert len(frozen) == 1 and frozen[0] > 10_000
    assert gc.get_freeze_count() == 0
