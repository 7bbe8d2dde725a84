"""Record llama-perplexity's KL-divergence runs, for test_kl_divergence.py.

    python tests/record_llama_cpp_kld.py LLAMA_CPP_BIN_DIR

For each case (stories260K against its Q8_0, Gemma 3 270M Q4_K_M against its Q4_0 made by
`llama-quantize --allow-requantize`): the base run `llama-perplexity -m MODEL -f wiki.test.raw
... --kl-divergence-base BASE` (its running estimates and final line, and the size and
sha256 of the BASE file it wrote), then `llama-perplexity -m QUANTIZED ... --kl-divergence
--kl-divergence-base BASE` (everything it prints on stdout: the table per chunk and the
statistics), with the sha256 of QUANTIZED, to tests/data/llama_cpp_kld_NAME.txt; also a
sha256 per chunk of the BASE file (its tokens and its rows), so that a test may run only the
first chunks and still compare bytes. The base files (1.3 GB for Gemma 3) and the quantized
models stay in a temporary folder.
"""
from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from conftest import file_sha256, shared_path  # noqa: E402
from llamapy.kld_base import HEADER_BYTES, MAGIC, file_size  # noqa: E402

DATA = Path(__file__).parent / "data"
# name -> (quantized type, flags of the base run, flags of the KL-divergence run, the chunks
# the test runs: None for all, k for the first k). stories260K at -c 128 -b 128: llama.cpp's
# chunks one at a time (with -b 2048 it decodes 4 chunks per ubatch, in other summation
# orders than llamapy's); Gemma 3 at its defaults, -c 512 -b 2048, its test on 2 of the 10
# chunks (two Gemma runs of 10 chunks were the slowest test of the suite).
CASES = {
    "stories260K": ("Q8_0", ["-c", "128", "-b", "128", "--chunks", "100", "-t", "2"], ["-c", "128", "-b", "128", "-t", "2"],
                    None),
    "gemma3": ("Q4_0", ["-c", "512", "--chunks", "10", "-t", "2"], ["-t", "2"], 2),
}
ETA = re.compile(r"[\d.]+ minutes")  # the end of llama.cpp's ETA line lands on stdout


def model_path(name: str) -> Path:
    if name == "gemma3":
        from llamapy.defaults import default_model_path
        return Path(default_model_path(print))
    return shared_path("models", f"{name}.gguf")


def chunk_digests(base: Path) -> list[str]:
    """sha256 of each chunk of a --kl-divergence-base file: its n_ctx tokens, then its rows."""
    with open(base, "rb") as f:
        head = f.read(HEADER_BYTES)
        assert head[:len(MAGIC)] == MAGIC, base
        n_ctx, n_vocab, n_chunk = (int.from_bytes(head[len(MAGIC) + 4 * i:len(MAGIC) + 4 * i + 4], "little")
                                   for i in range(3))
        rows_bytes = (file_size(n_ctx, n_vocab, 1) - HEADER_BYTES - 4 * n_ctx)
        tokens = [f.read(4 * n_ctx) for _ in range(n_chunk)]
        return [hashlib.sha256(tokens[c] + f.read(rows_bytes)).hexdigest() for c in range(n_chunk)]


def stdout_lines(run: subprocess.CompletedProcess) -> list[str]:
    """The run's stdout without the ETA's end and the blank line around it."""
    lines = [line for line in run.stdout.splitlines() if not ETA.fullmatch(line.strip())]
    while lines and not lines[0].strip():
        lines.pop(0)
    return [line.rstrip() for line in lines if line.strip()]


def llama_perplexity(bin_dir: Path, *args: str, must_print: str) -> subprocess.CompletedProcess:
    """Run llama-perplexity; again when its log thread lost the last lines (seen once)."""
    for _ in range(3):
        run = subprocess.run([str(bin_dir / "llama-perplexity"), *args], capture_output=True, text=True, check=True)
        if must_print in run.stdout + run.stderr:
            return run
    raise RuntimeError(f"llama-perplexity {' '.join(args)} never printed {must_print!r}")


def record(bin_dir: Path, name: str, work: Path) -> None:
    qtype, base_flags, kld_flags, _ = CASES[name]
    model, base, quantized = model_path(name), work / f"{name}.kld", work / f"{name}-{qtype}.gguf"
    subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(model), str(quantized), qtype],
                   capture_output=True, check=True)
    run = llama_perplexity(bin_dir, "-m", str(model), "-f", str(shared_path("data", "wiki.test.raw")), *base_flags,
                           "--kl-divergence-base", str(base), must_print="Final estimate")
    final = re.search(r"Final estimate: PPL = .*", run.stderr).group(0)
    kld = llama_perplexity(bin_dir, "-m", str(quantized), *kld_flags, "--kl-divergence", "--kl-divergence-base",
                           str(base), must_print="Same top p")
    lines = [f"quantized {qtype} sha256: {file_sha256(quantized)}",
             f"base bytes: {base.stat().st_size}", f"base sha256: {file_sha256(base)}",
             f"chunk sha256: {' '.join(chunk_digests(base))}",
             f"== base run: {' '.join(base_flags)}", *stdout_lines(run), final,
             f"== kld run: {' '.join(kld_flags)}", *stdout_lines(kld)]
    (DATA / f"llama_cpp_kld_{name}.txt").write_text("\n".join(lines) + "\n")


def main(bin_dir: Path) -> None:
    with tempfile.TemporaryDirectory() as work:
        for name in CASES:
            record(bin_dir, name, Path(work))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
