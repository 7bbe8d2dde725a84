"""Record llama.cpp's greedy continuations of Gemma 3 270M, for test_gemma3.

    python tests/record_gemma3_greedy.py LLAMA_CPP_BIN [GEMMA3_GGUF]

LLAMA_CPP_BIN holds llama-completion (cmake --build BUILD --target llama-completion). For
each prompt it runs, on an x86 machine with AVX-512 (the build's `-march=native` code
paths decide llama.cpp's roundings; simd.py in ggmlpy's CPU backend says which):

    llama-completion -m GEMMA3_GGUF -p PROMPT -n 64 --temp 0 -s 1 -t 2 -no-cnv

and keeps its standard output: the prompt and the 64 greedy tokens, as text. Its defaults
are llama.cpp's CPU defaults: flash attention on (auto), an F16 KV cache, n_ubatch 512.
The result goes to tests/data/llama_cpp_gemma3_greedy.json.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

DATA = Path(__file__).parent / "data"
OUT = DATA / "llama_cpp_gemma3_greedy.json"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]
N_PREDICT = 64


def main() -> None:
    bin_dir = Path(sys.argv[1])
    if len(sys.argv) > 2:
        model = Path(sys.argv[2])
    else:
        import llamapy.defaults
        model = Path(llamapy.defaults.default_model_path())
    exe = bin_dir / "llama-completion"
    version = subprocess.run([str(exe), "--version"], capture_output=True, text=True).stderr.splitlines()[0]
    runs = []
    for prompt in PROMPTS:
        args = ["-m", str(model), "-p", prompt, "-n", str(N_PREDICT), "--temp", "0", "-s", "1", "-t", "2", "-no-cnv"]
        proc = subprocess.run([str(exe), *args], capture_output=True, text=True, check=True)
        runs.append({"prompt": prompt, "text": proc.stdout.rstrip("\n")})
    OUT.write_text(json.dumps({
        "source": f"llama.cpp ({version.strip()}), x86_64 AVX-512 build, "
                  f"llama-completion -m {model.name} -p PROMPT -n {N_PREDICT} --temp 0 -s 1 -t 2 -no-cnv",
        "model": model.name,
        "n_predict": N_PREDICT,
        "runs": runs,
    }, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
