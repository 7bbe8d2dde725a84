"""What watching a training run costs: the same finetune with nothing watched, with the
metrics JSONL and a step hook (a record and the gradient norm every step), and with
everything (also a plot redrawn and the best model saved at every validation).

Run by hand (not in CI):

    python bench/metrics_overhead.py                       # stories260K full finetune, 3 rounds
    python bench/metrics_overhead.py --model gemma --steps 12 --ctx 128    # LoRA on Gemma 3 270M Q4_K_M

Every variant trains the same windows from the same start; rounds alternate the variants so
that machine load hits all alike. Reported per variant: the median over rounds of the
seconds per optimizer step (the fit's wall time / steps, validations included, as a user
waits), and its ratio to the unwatched run; with the load average, which makes any figure
taken on a busy machine a first look only.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import llamapy  # noqa: E402
from llamapy.dataset import token_windows  # noqa: E402
from llamapy.train_params import TrainParams  # noqa: E402

SHARED = Path(os.environ.get("LLAMAPY_SHARED", ROOT.parent / "shared"))
VARIANTS = ("plain", "metrics", "everything")


def model_path(name: str) -> Path:
    if name == "stories":
        return SHARED / "models" / "stories260K.gguf"
    return Path(os.environ.get("LLAMAPY_MODEL_CACHE", "/tmp/llamapy-models")) / "gemma3-270m-q4_k_m.gguf"


def run(variant: str, path: Path, text: str, n_ctx: int, steps: int, eval_every: int, threads: int,
        folder: Path) -> float:
    """Seconds per optimizer step of one fit."""
    model = llamapy.load_model(path)
    ctx = llamapy.Context(model, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads)
    ctx.opt_init(TrainParams.for_model(model))
    data = token_windows(model.vocab.tokenize(text), n_ctx)
    n_val = max(1, data.ndata // 10)
    watch = {}
    if variant != "plain":
        watch = {"metrics": folder / f"{variant}.jsonl", "on_step": lambda record: None}
    if variant == "everything":
        watch |= {"plot": folder / "loss.png", "save_best": folder / "best.gguf"}
    t0 = time.perf_counter()
    ctx.opt_fit(data, epochs=1, val_split=n_val / data.ndata, eval_every=eval_every, silent=True, **watch)
    return (time.perf_counter() - t0) / ctx.trainer.n_steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("stories", "gemma"), default="stories")
    ap.add_argument("--ctx", type=int, default=32, help="tokens per window (one window per step)")
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps per fit (about)")
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    path = model_path(args.model)
    vocab = llamapy.load_model(path).vocab
    words = (SHARED / "data" / "wiki.test.raw").read_text()[:200_000]
    # about `steps` training windows (stride n_ctx / 2) plus a tenth for validation
    n_tokens = int(1.1 * args.steps * args.ctx / 2) + args.ctx
    text = vocab.detokenize(list(vocab.tokenize(words)[:n_tokens]))
    results: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        run("plain", path, text, args.ctx, args.steps, args.eval_every, args.threads, Path(tmp))  # compile, warm caches
        for r in range(args.rounds):
            order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                results[variant].append(run(variant, path, text, args.ctx, args.steps, args.eval_every,
                                            args.threads, Path(tmp)))
    base = statistics.median(results["plain"])
    print(f"{args.model}, -c {args.ctx}, eval every {args.eval_every} steps, -t {args.threads}, "
          f"load average {os.getloadavg()[0]:.2f}")
    for variant in VARIANTS:
        s = statistics.median(results[variant])
        print(f"  {variant:<11} {1e3 * s:8.1f} ms/step  x{s / base:.3f}  "
              f"(rounds: {', '.join(f'{1e3 * x:.1f}' for x in results[variant])})")


if __name__ == "__main__":
    main()
