"""Record what llama.cpp's command-line tools do, for test_cli_flags and test_perplexity.

    python tests/record_llama_cpp_cli.py LLAMA_CPP_BIN_DIR [--flags-only] [--convert PYTHON LLAMA_CPP_SRC]

- each tool's flags, from its `--help` (llama-perplexity, llama-completion, llama-cli,
  llama-finetune, llama-export-lora, llama-server: common/arg.cpp's format; llama-quantize:
  its own usage text): every option line's names and value hint, to
  tests/data/llama_cpp_flags.json; with --convert, also convert_hf_to_gguf.py's and
  convert_lora_to_gguf.py's (their argparse --help, run by PYTHON, a venv with PyTorch and
  transformers), as "convert" and "convert-lora" (kept from the previous recording otherwise);
- the bare perplexity run `llama-perplexity -m stories260K.gguf -f wiki.test.raw -t 2`
  (its defaults: -c 512, -b 2048): the running estimates (stdout) and the final line, to
  tests/data/llama_cpp_ppl_stories260K_bare.txt.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from conftest import shared_path  # noqa: E402

TOOLS = ("perplexity", "completion", "cli", "finetune", "export-lora", "server", "quantize")
DATA = Path(__file__).parent / "data"


def flags_of(help_text: str) -> list[dict]:
    """Names and value hint of each option line of llama.cpp's --help (`-c,    --ctx-size N   help`)."""
    out = []
    for line in help_text.splitlines():
        if not line.startswith("-") or line.startswith("-----"):  # "----- common params -----"
            continue
        head = re.split(r"\s{2,}", re.sub(r",\s+", ", ", line), maxsplit=1)[0]
        names, hint = [], []
        for part in head.split(" "):
            part = part.rstrip(",")
            if part.startswith("-") and not hint:
                names.append(part)
            elif part:
                hint.append(part)
        out.append({"names": names, "hint": " ".join(hint)})
    return out


def quantize_flags_of(help_text: str) -> list[dict]:
    """llama-quantize's usage text: an option line is two spaces, the flag, and its value hint
    (`  --tensor-type tensor_name=ggml_type`); its help follows on lines indented further."""
    out = []
    for line in help_text.splitlines():
        m = re.fullmatch(r"  (--[\w-]+)(?: (\S+))?", line.rstrip())
        if m:
            out.append({"names": [m.group(1)], "hint": m.group(2) or ""})
    return out


def argparse_flags_of(help_text: str) -> list[dict]:
    """Names and value hint of each option line of an argparse --help (`  --outfile OUTFILE  help`)."""
    out = []
    for line in help_text.splitlines():
        match = re.match(r"  (-[^ ].*?)(?:\s{2,}|$)", line)
        if not match:
            continue
        names, hint = [], []
        for part in match.group(1).split(", "):
            name, _, value = part.partition(" ")
            names.append(name)
            hint = hint or ([value] if value else [])
        out.append({"names": names, "hint": " ".join(hint)})
    return out


def convert_flags(python: str, src: Path, script: str) -> list[dict]:
    run = subprocess.run([python, str(src / script), "--help"], capture_output=True, text=True,
                         env={"PYTHONPATH": str(src / "gguf-py"), "PATH": "/usr/bin:/bin", "COLUMNS": "200"})
    return argparse_flags_of(run.stdout)


def main(bin_dir: Path) -> None:
    old = json.loads((DATA / "llama_cpp_flags.json").read_text())
    flags = {}
    for tool in TOOLS:
        text = subprocess.run([str(bin_dir / f"llama-{tool}"), "--help"], capture_output=True, text=True).stdout
        flags[tool] = quantize_flags_of(text) if tool == "quantize" else flags_of(text)
    if "--convert" in sys.argv:
        i = sys.argv.index("--convert")
        for name, script in (("convert", "convert_hf_to_gguf.py"), ("convert-lora", "convert_lora_to_gguf.py")):
            flags[name] = convert_flags(sys.argv[i + 1], Path(sys.argv[i + 2]), script)
    else:
        flags["convert"], flags["convert-lora"] = old["convert"], old["convert-lora"]
    (DATA / "llama_cpp_flags.json").write_text(json.dumps(flags, indent=1) + "\n")
    if "--flags-only" in sys.argv:
        return
    run = subprocess.run([str(bin_dir / "llama-perplexity"), "-m", str(shared_path("models", "stories260K.gguf")),
                          "-f", str(shared_path("data", "wiki.test.raw")), "-t", "2"], capture_output=True, text=True)
    final = re.search(r"Final estimate: PPL = .*", run.stderr).group(0)
    (DATA / "llama_cpp_ppl_stories260K_bare.txt").write_text(run.stdout.strip() + "\n" + final + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
