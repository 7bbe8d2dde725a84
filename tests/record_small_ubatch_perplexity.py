"""Record llama.cpp's perplexities of the stories260K architecture variants with 32-token
ubatches, for test_architectures.

    python tests/record_small_ubatch_perplexity.py LLAMA_CPP_BIN

Under 64 query rows ggml-cpu's flash attention takes its one-chunk kernel, which accumulates
the output in F16: llama.cpp's -ub 32 numbers differ from its -ub 128 ones (the goldens in
../shared/golden) by up to 1e-3, and llamapy follows the same kernel choice. For each model
(../shared/models/stories260K-ARCH.gguf) this runs

    llama-perplexity -m MODEL -f wiki.test.raw -c 128 -b 128 -ub 32 --chunks 100 -t 1

on an x86 machine with AVX-512 and keeps the running values [1], [10], [100]; and for
stories260K itself the final estimate of the whole text,

    llama-perplexity -m stories260K.gguf -f wiki.test.raw -c 128 -ub 32 -t 1

(-b 32 -ub 32 gives the same). The result goes to tests/data/llama_cpp_stories260K_ub32.json.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from conftest import shared_path  # noqa: E402

OUT = Path(__file__).parent / "data" / "llama_cpp_stories260K_ub32.json"
MODELS = ["qwen2", "qwen3", "rope-freqs"]


def main() -> None:
    exe = Path(sys.argv[1]) / "llama-perplexity"
    version = subprocess.run([str(exe), "--version"], capture_output=True, text=True).stderr.splitlines()[0]
    values = {}
    for name in MODELS:
        model = shared_path("models", f"stories260K-{name}.gguf")
        proc = subprocess.run([str(exe), "-m", str(model), "-f", str(shared_path("data", "wiki.test.raw")), "-c", "128",
                               "-b", "128", "-ub", "32", "--chunks", "100", "-t", "1"],
                              capture_output=True, text=True, check=True)
        running = {int(i): float(v) for i, v in re.findall(r"\[(\d+)\]([0-9.]+)", proc.stdout)}
        values[name] = {str(i): running[i] for i in (1, 10, 100)}
    proc = subprocess.run([str(exe), "-m", str(shared_path("models", "stories260K.gguf")), "-f",
                           str(shared_path("data", "wiki.test.raw")), "-c", "128", "-ub", "32", "-t", "1"],
                          capture_output=True, text=True, check=True)
    final = float(re.search(r"Final estimate: PPL = ([0-9.]+)", proc.stderr).group(1))
    OUT.write_text(json.dumps({
        "source": f"llama.cpp ({version.strip()}), x86_64 AVX-512 build, llama-perplexity -m "
                  "stories260K-ARCH.gguf -f wiki.test.raw -c 128 -b 128 -ub 32 --chunks 100 -t 1",
        "running": values,
        "stories260K_full_ub32_final": final,
        "stories260K_full_ub32_source": "llama-perplexity -m stories260K.gguf -f wiki.test.raw -c 128 -ub 32 -t 1",
    }, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
