"""Real-size model shapes for benches (issue 35): random weights made with llamapy.new_model,
quantized by llama.cpp's llama-quantize, kept in a temp folder (never committed).

    python bench/big_model.py --llama-cpp BUILD/bin [--shape llama3-1.5b|llama3-8b] [--layers N] [--type Q4_K_M]

Prints the GGUF's path (made once; reused while it exists). The shapes:
- llama3-1.5b: n_embd 2048, 16 layers, 32 heads / 8 KV heads, n_ff 8192, Llama 3's
  128,256-token vocabulary (1.5 B parameters; 955 MB at Q4_K_M);
- llama3-8b: Llama 3 8B's layers (n_embd 4096, n_ff 14336, 32/8 heads), same vocabulary,
  --layers of them (default 1; 32 make the 8B): a 1- and a 2-layer model give per-layer
  figures to extrapolate the whole model's.
Random weights give near-uniform outputs: use these models for speed and memory only.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VOCAB = REPO.parent / "shared" / "data" / "vocab" / "ggml-vocab-llama-bpe.gguf"  # Llama 3's tokenizer
SHAPES = {
    "llama3-1.5b": dict(n_embd=2048, n_layer=16, n_head=32, n_head_kv=8, n_ff=8192),
    "llama3-8b": dict(n_embd=4096, n_layer=1, n_head=32, n_head_kv=8, n_ff=14336),
}


def big_model(llama_cpp: Path, shape: str, qtype: str = "Q4_K_M", folder: Path | None = None,
              layers: int | None = None) -> Path:
    """The model file of `shape` (with `layers` layers instead of its own) in `qtype`, made in
    `folder` (default: the temp folder) if absent."""
    import llamapy
    folder = folder or Path(tempfile.gettempdir()) / "llamapy-big-models"
    folder.mkdir(parents=True, exist_ok=True)
    sizes = {**SHAPES[shape], **({"n_layer": layers} if layers else {})}
    name = f"{shape}-{sizes['n_layer']}l" if layers else shape
    out = folder / f"{name}-{qtype.lower()}.gguf"
    if out.exists():
        return out
    f32 = folder / f"{name}-f32.gguf"
    model = llamapy.new_model("llama", VOCAB, n_ctx_train=8192, rope_freq_base=500000.0, seed=1, name=name, **sizes)
    llamapy.save_model_to_file(model, f32)
    del model
    r = subprocess.run([str(llama_cpp / "llama-quantize"), str(f32), str(out), qtype], capture_output=True, text=True)
    f32.unlink()
    if r.returncode:
        sys.exit(f"llama-quantize failed: {r.stderr[-800:]}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, required=True, help="directory with llama-quantize")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-1.5b")
    ap.add_argument("--layers", type=int, help="layers instead of the shape's own")
    ap.add_argument("--type", default="Q4_K_M")
    ap.add_argument("--folder", type=Path)
    args = ap.parse_args()
    print(big_model(args.llama_cpp, args.shape, args.type, args.folder, args.layers))


if __name__ == "__main__":
    main()
