"""Record llama.cpp's IQ4_NL, for test_iq4_nl.py (CI has no llama.cpp):

    python tests/record_llama_cpp_iq4_nl.py LLAMA_CPP_BIN_DIR LLAMA_CPP_SOURCE_DIR

- llama-quantize's stories260K IQ4_NL file: its sha256 and tensor types (never the file);
- llama-perplexity's running values on it and, as a control, on the Q8_0 file, with
  record_llama_cpp_quantize.py's text slice and arguments, and the build's CPU features
  (llamapy follows the AVX-512 build; an AVX2 build sums softmax and F16 dot products
  otherwise, so its numbers part from llamapy's after a few chunks on every model: the
  control says from which chunk);
- ggml's own MUL_MAT on IQ4_NL matrices (tests/ggml_mul_mat.c, compiled here against the
  build's libraries): matrices repacked (rows % 8 == 0) and not, 1 to 17 columns, an odd and
  an even block count, inputs and outputs to tests/data/llama_cpp_iq4_nl_products.npz.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from conftest import shared_path  # noqa: E402
from record_llama_cpp_quantize import BUILD, PPL_ARGS, SLICE_CHARS, perplexity, quantize  # noqa: E402

DATA = Path(__file__).parent / "data"
IQ4_NL = 20
# (rows, k): repacked with an odd and an even block count, not repacked likewise
SHAPES = ((40, 352), (48, 320), (37, 352), (37, 320))
COLUMNS = (1, 2, 3, 5, 8, 16, 17)  # a product of n columns takes the first n of the activations


def system_info(bin_dir: Path, model: Path, text: Path) -> str:
    """The build's CPU features, as llama-perplexity prints them."""
    run = subprocess.run([str(bin_dir / "llama-perplexity"), "-m", str(model), "-f", str(text), *PPL_ARGS[:4],
                          "--chunks", "1"], capture_output=True, text=True)
    return next((line.split("system_info: ", 1)[1] for line in (run.stdout + run.stderr).splitlines()
                 if "system_info: " in line), "")


def compile_harness(bin_dir: Path, source_dir: Path, out: Path) -> Path:
    subprocess.run(["gcc", "-O2", f"-I{source_dir / 'ggml' / 'include'}", str(Path(__file__).parent / "ggml_mul_mat.c"),
                    "-o", str(out), f"-L{bin_dir}", "-lggml", "-lggml-base", "-lggml-cpu", f"-Wl,-rpath,{bin_dir}"],
                   check=True)
    return out


def products(harness: Path, tmp: Path) -> dict[str, np.ndarray]:
    """Random IQ4_NL matrices (llama-quantize's blocks of Gaussian rows, made by ggmlpy's
    quantizer, byte-identical to ggml's) times activations with an all-zero block and an
    outlier, through ggml's MUL_MAT."""
    from ggmlpy import GGMLType, quants
    record: dict[str, np.ndarray] = {}
    rng = np.random.default_rng(46)
    for k in sorted({k for _, k in SHAPES}):
        x = (rng.standard_normal((max(COLUMNS), k)) * rng.uniform(0.1, 20.0, (max(COLUMNS), 1))).astype(np.float16)
        x[0, :64] = 0.0  # all-zero activation blocks
        x[1, 7] = 1e4  # a block dominated by one value
        record[f"x_{k}"] = x  # float16: exact float32 values, half the bytes
    for m, k in SHAPES:
        w = (rng.standard_normal((m, k)) * rng.uniform(0.05, 3.0, (m, 1))).astype(np.float32)
        w[0, :64] = 0.0  # all-zero blocks: scale 0
        rows = quants.quantize(w, GGMLType.IQ4_NL).reshape(m, -1)
        rows.tofile(tmp / "w.bin")
        record[f"rows_{m}_{k}"] = rows
        for n in COLUMNS:
            record[f"x_{k}"][:n].astype(np.float32).tofile(tmp / "x.bin")
            subprocess.run([str(harness), str(IQ4_NL), str(m), str(k), str(n), str(int(m % 8 == 0)), str(tmp / "w.bin"),
                            str(tmp / "x.bin"), str(tmp / "y.bin")], check=True, capture_output=True)
            record[f"out_{m}_{k}_{n}"] = np.fromfile(tmp / "y.bin", dtype=np.float32).reshape(n, m)
    return record


def main(bin_dir: Path, source_dir: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        text = tmp / "slice.txt"
        text.write_text(shared_path("data", "wiki.test.raw").read_text(encoding="utf-8")[:SLICE_CHARS],
                        encoding="utf-8")
        stories = shared_path("models", "stories260K.gguf")
        case = quantize(bin_dir, stories, [], "IQ4_NL", tmp / "iq4_nl.gguf")
        ppl = {"IQ4_NL": perplexity(bin_dir, tmp / "iq4_nl.gguf", text)}
        quantize(bin_dir, stories, [], "Q8_0", tmp / "q8_0.gguf")
        ppl["Q8_0"] = perplexity(bin_dir, tmp / "q8_0.gguf", text)
        record = {"llama_cpp": "; ".join(BUILD), "system_info": system_info(bin_dir, tmp / "q8_0.gguf", text),
                  "slice_chars": SLICE_CHARS, "perplexity_args": PPL_ARGS, "quantize": case, "perplexity": ppl}
        np.savez_compressed(DATA / "llama_cpp_iq4_nl_products.npz",
                            **products(compile_harness(bin_dir, source_dir, tmp / "ggml_mul_mat"), tmp))
    (DATA / "llama_cpp_iq4_nl.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
