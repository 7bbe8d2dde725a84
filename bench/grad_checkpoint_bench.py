"""Gradient checkpointing: peak RSS, planned memory and training speed with and without
`--grad-checkpoint`, side by side (runs alternate, each in a fresh process).

Two runs of llamapy-finetune at -c 1024: LoRA on the README's main-job model (gemma-3-270m
Q4_K_M, its demo text) and a full finetune of stories260K (the first 60,000 characters of
the TinyStories sample). `--root DIR` runs another checkout's apps (say, main's worktree,
which may not know the flag: its runs are then without it only).

    python bench/grad_checkpoint_bench.py [--repeat 2] [--threads 1] [--only gemma|stories]

`--paired N` measures the cost of recomputation more finely: in one process, a plain and a
checkpointing trainer of each model take turns on the same training window, N times each,
and the median seconds per window of each are compared (the machine's load then weighs
on both alike).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

from peak_rss import peak_rss_mb  # bench/, beside this script

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("LLAMAPY_SHARED", ROOT.parent / "shared"))


def configs(tmp: Path) -> dict[str, list[str]]:
    stories_text = tmp / "stories60k.txt"
    stories_text.write_text((SHARED / "data" / "tinystories_sample.txt").read_text()[:60_000])
    return {
        "gemma": ["--epochs", "1", "-c", "1024"],  # the main job (default model, demo text, LoRA) at -c 1024
        "stories": ["-m", str(SHARED / "models" / "stories260K.gguf"), "-f", str(stories_text), "--epochs", "1",
                    "-c", "1024"],
    }


def paired(n: int, threads: int, only: str | None) -> None:
    import time

    import numpy as np

    import llamapy
    from llamapy.dataset import token_windows
    from llamapy.defaults import default_model_path, demo_corpus
    from llamapy.train_params import TrainParams

    runs = {"gemma": (default_model_path(), demo_corpus()[:16_000]),
            "stories": (SHARED / "models" / "stories260K.gguf",
                        (SHARED / "data" / "tinystories_sample.txt").read_text()[:20_000])}
    for name, (path, text) in runs.items():
        if only and name != only:
            continue
        trainers = {}
        for on in (False, True):
            model = llamapy.load_model(path)
            ctx = llamapy.Context(model, n_ctx=1024, n_batch=1024, n_ubatch=512, n_threads=threads)
            ctx.opt_init(TrainParams.for_model(model, grad_checkpoint=on))
            trainers[on] = ctx.trainer
        model = trainers[False].model
        ds = token_windows(model.vocab.tokenize(text, add_special=True), 1024)
        seconds = {False: [], True: []}
        for i in range(n + 1):  # the first turn builds the graphs and loads the kernels: not counted
            for on, tr in trainers.items():
                t0 = time.perf_counter()
                tr.window(ds.data[0], ds.labels[0], True)
                if i:
                    seconds[on].append(time.perf_counter() - t0)
        plain, ckpt = (float(np.median(seconds[on])) for on in (False, True))
        print(f"{name:8s} paired, {n} windows of 1024 each: plain {plain:.3f} s, --grad-checkpoint {ckpt:.3f} s "
              f"per window ({ckpt / plain:.2f}x the time)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=2, help="alternations of without/with")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", choices=["gemma", "stories"])
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout whose apps run")
    ap.add_argument("--without-only", action="store_true", help="skip the --grad-checkpoint runs")
    ap.add_argument("--paired", type=int, default=0, help="N alternating windows in one process instead")
    args = ap.parse_args()
    if args.paired:
        paired(args.paired, args.threads, args.only)
        return
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in configs(Path(tmp)).items():
            if args.only and name != args.only:
                continue
            for rep in range(args.repeat):
                for extra in ([], ["--grad-checkpoint"]):
                    if extra and args.without_only:
                        continue
                    cmd = [sys.executable, "-m", "llamapy.cli.finetune", *flags, "-t", str(args.threads),
                           "-o", str(Path(tmp) / "out.gguf"), *extra]
                    r, rss = peak_rss_mb(cmd, args.root)
                    if r.returncode:
                        sys.exit(r.stderr)
                    tps = re.search(r"training: (\d+) tokens/s", r.stderr).group(1)
                    planned = re.search(r"graph arenas ([\d.,]+ [MG]B).*; ([\d.,]+ [MG]B) in all", r.stderr)
                    loss = re.findall(r"val: .*?loss=([\d.]+)", r.stderr)
                    print(f"{name:8s} {'--grad-checkpoint' if extra else 'plain':17s} run {rep + 1}: "
                          f"{tps:>6s} training tokens/s, peak RSS {rss:6.0f} MB, planned arenas {planned.group(1)} "
                          f"({planned.group(2)} in all), val loss {loss[-1] if loss else '-'}", flush=True)


if __name__ == "__main__":
    main()
