"""Record llama.cpp's grammars and its greedy grammar-constrained texts, for test_grammar.py.

    python tests/record_llama_cpp_grammars.py LLAMA_CPP_DIR LLAMA_CPP_BIN [STORIES260K_GGUF]

LLAMA_CPP_DIR is llama.cpp's source tree (its grammars/*.gbnf are read as they are), LLAMA_CPP_BIN
holds llama-completion. For each grammar, and for a JSON schema (-j), it runs

    llama-completion -m stories260K.gguf -p "Once upon a time" -n 48 --temp 0 -s 1 -t 2 -no-cnv --grammar-file FILE

and keeps the text after the prompt (greedy: the grammar picks among the model's best tokens
only where the best one breaks it, so the text is llama.cpp's token for token). The result
goes to tests/data/llama_cpp_grammars.json.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

DATA = Path(__file__).parent / "data"
OUT = DATA / "llama_cpp_grammars.json"
PROMPT = "Once upon a time"
N_PREDICT = 48
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "pet": {"enum": ["cat", "dog", "bird"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}


def completion(exe: Path, model: Path, *flags: str) -> str:
    args = ["-m", str(model), "-p", PROMPT, "-n", str(N_PREDICT), "--temp", "0", "-s", "1", "-t", "2", "-no-cnv",
            *flags]
    out = subprocess.run([str(exe), *args], capture_output=True, check=True).stdout.decode("utf-8", "replace")
    if PROMPT not in out:
        raise SystemExit(f"error: llama-completion's output does not echo the prompt: {out[:80]!r}")
    # the echo starts with SPM's space; llama-completion ends with " [end of text]\n" (an end of
    # generation) and then "\n\n" (always), which are not the model's text
    return out[out.index(PROMPT) + len(PROMPT):].removesuffix("\n\n").removesuffix(" [end of text]\n")


def main() -> None:
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    source, bin_dir = Path(sys.argv[1]), Path(sys.argv[2])
    model = Path(sys.argv[3]) if len(sys.argv) > 3 else Path(__file__).resolve().parents[2] / "shared" / "models" / \
        "stories260K.gguf"
    exe = bin_dir / "llama-completion"
    version = subprocess.run([str(exe), "--version"], capture_output=True, text=True).stderr.strip().splitlines()[0]
    grammars = {path.name: path.read_text() for path in sorted((source / "grammars").glob("*.gbnf"))}
    greedy = {name: completion(exe, model, "--grammar-file", str(source / "grammars" / name)) for name in grammars}
    schema_text = completion(exe, model, "-j", json.dumps(SCHEMA))
    OUT.write_text(json.dumps({
        "source": f"llama.cpp ({version}): grammars/*.gbnf; llama-completion -m {model.name} -p {PROMPT!r} "
                  f"-n {N_PREDICT} --temp 0 -s 1 -t 2 -no-cnv --grammar-file FILE (or -j SCHEMA)",
        "prompt": PROMPT, "n_predict": N_PREDICT, "grammars": grammars, "greedy": greedy,
        "schema": SCHEMA, "schema_greedy": schema_text,
    }, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {OUT}: {len(grammars)} grammars")


if __name__ == "__main__":
    main()
