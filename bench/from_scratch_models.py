"""Two tiny models trained from nothing, for checking against llama.cpp (issue 14).

    python bench/from_scratch_models.py OUTDIR

writes OUTDIR/scratch-llama.gguf (embd 64, 4 heads, 2 layers, ff 192; 200,000 characters
of tinyshakespeare, 2 epochs, AdamW lr 2e-3, -c 128), OUTDIR/scratch-gemma3.gguf (the same
sizes with 2 KV heads, head_dim 32, sliding window 64; 60,000 characters, BOS in every
window, 1 epoch) and OUTDIR/shakespeare-last10.txt (the last 10 % of the text, never trained
on). Both vocabularies come from stories260K.gguf. Then compare, e.g.:

    llama-perplexity -m OUTDIR/scratch-llama.gguf -f OUTDIR/shakespeare-last10.txt -c 128 -t 2
    llamapy-perplexity -m OUTDIR/scratch-llama.gguf -f OUTDIR/shakespeare-last10.txt -c 128 -t 2
"""
from __future__ import annotations

import sys
from pathlib import Path

import llamapy
from llamapy.dataset import text_windows
from llamapy.train_params import LRSchedule, TrainParams

SHARED = Path(__file__).resolve().parent.parent.parent / "shared"


def train(model: llamapy.Model, text: str, epochs: int, window_bos: bool, out: Path) -> None:
    """A short AdamW run on `text` in windows of 128 tokens, then save to `out`."""
    ds = text_windows(model.vocab, text, 128, window_bos=window_bos)
    ctx = llamapy.Context(model, n_ctx=128, n_batch=128, n_ubatch=128, n_threads=2)
    ctx.opt_init(TrainParams(schedule=LRSchedule(lr0=2e-3), window_bos=window_bos))
    ctx.opt_fit(ds, epochs=epochs, val_split=0.05)
    llamapy.save_model_to_file(model, out)
    print(f"saved {out}: {model.describe()}")


def main(outdir: Path) -> None:
    outdir.mkdir(parents=True, exist_ok=True)
    text = (SHARED / "data" / "tinyshakespeare.txt").read_text()
    (outdir / "shakespeare-last10.txt").write_text(text[int(len(text) * 0.9):])
    vocab = SHARED / "models" / "stories260K.gguf"
    sizes = dict(n_embd=64, n_head=4, n_layer=2, n_ff=192, n_ctx_train=128, seed=0)
    train(llamapy.new_model("llama", vocab, **sizes), text[:200_000], 2, False, outdir / "scratch-llama.gguf")
    gemma = llamapy.new_model("gemma3", vocab, **sizes, n_head_kv=2, head_dim=32, sliding_window=64)
    train(gemma, text[:60_000], 1, True, outdir / "scratch-gemma3.gguf")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python bench/from_scratch_models.py OUTDIR")
    main(Path(sys.argv[1]))
