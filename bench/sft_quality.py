"""Instruction finetuning works: a date-conversion task, Gemma 3 270M before and after a LoRA SFT run.

The task (generated, fixed seed): 600 distinct questions such as "Convert 'March 3, 2021' to
ISO 8601." with one exact answer ("2021-03-03"), the date written in one of 13 formats
("March 3, 2021", "3 March 2021", "Mar 3, 2021", "03/03/2021 (US)", "the 3rd of March 2021",
"2021 March 3", ...) inside one of 6 phrasings of the instruction. 500 train, 100 are held out
(test.jsonl); 40 more distinct questions (valid.jsonl) give the validation loss during training
and are not scored. The files are in the {"prompt", "completion"} format (llamapy.samples: a
user turn and the assistant turn that answers it), written to --out:

    train.jsonl (500)   valid.jsonl (40)   test.jsonl (100, scored)

Steps, each timed:
1. greedy generation (argmax, at most --max-new tokens, stopping at an end-of-generation
   token) of the base model on the 100 held-out prompts, rendered with llama.cpp's built-in
   "gemma" chat template (the 270M GGUF carries none) and the generation prompt;
2. a LoRA SFT run on train.jsonl: the prompts rendered with the same template and masked
   (loss on the answer and its <end_of_turn> only), samples packed into -c windows -- by the
   command a user runs, `llamapy-finetune -m MODEL --data DIR --chat-template gemma ...`
   (run here as `python -m llamapy.cli.finetune` from this checkout), or, with --python-api, by the
   same steps through the Python API (llamapy.dataset.load_samples, Context.opt_fit);
3. the same generation with the adapter attached.

Scores: exact match (the generated text, stripped, equals the answer) and, for information,
"contains" (the answer occurs in the generated text). Acceptance: the finetuned exact match
is at least twice the base's and at least 80%; the exit code is 1 otherwise.

The 100 prompts are generated together, --eval-batch sequences per decode (one KV stream
each; every sequence of a group decodes at every step, so each step is one ubatch): on 2
cores 25 sequences per step cost about as much as 3 alone. The greedy tokens are those of one
prompt at a time up to float rounding: the finetuned answers were identical on 25 of 25
prompts; the base model's rambling hit a near-tie on 1 of 8 (its score is 0 either way).

The base GGUF is the pretrained (not instruction-tuned) Gemma 3 270M: it continues the
prompt (mostly echoing it) and scores 0, so "twice the base" only holds with the 80% bar.
Defaults: -c 256 packs 5 samples (~45 tokens each) per window, the cheapest per sample on
2 cores (-c 128 fits 2 and costs ~1.6x as much per sample; -c 512 ~the same as 256); one
epoch at lr 2e-3 (99 steps) scored 94 and 90 (training seeds 0 and 1), lr 3e-3 cosine 92.

    python bench/sft_quality.py [--out DIR] [--epochs 1 -lr 2e-3 -c 256 ...] [--python-api]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

N_TRAIN, N_TEST, N_VALID = 500, 100, 40

# ---- the task -----------------------------------------------------------------------------------
# English names written out (calendar's follow the locale)
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
MONTHS_ABBR = [m[:3] for m in MONTHS]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def ordinal(n: int) -> str:
    suffix = "th" if 11 <= n % 100 <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


# each: the date as a user might write it (every one names the date unambiguously)
FORMATS = [
    lambda d: f"{MONTHS[d.month - 1]} {d.day}, {d.year}",                    # March 3, 2021
    lambda d: f"{d.day} {MONTHS[d.month - 1]} {d.year}",                     # 3 March 2021
    lambda d: f"{MONTHS_ABBR[d.month - 1]} {d.day}, {d.year}",               # Mar 3, 2021
    lambda d: f"{d.month:02d}/{d.day:02d}/{d.year} (US)",                    # 03/03/2021 (US)
    lambda d: f"{d.day:02d}/{d.month:02d}/{d.year} (UK)",                    # 03/03/2021 (UK)
    lambda d: f"the {ordinal(d.day)} of {MONTHS[d.month - 1]} {d.year}",     # the 3rd of March 2021
    lambda d: f"{d.year} {MONTHS[d.month - 1]} {d.day}",                     # 2021 March 3
    lambda d: f"{MONTHS[d.month - 1]} {ordinal(d.day)}, {d.year}",           # March 3rd, 2021
    lambda d: f"{d.day}-{MONTHS_ABBR[d.month - 1]}-{d.year}",                # 3-Mar-2021
    lambda d: f"{WEEKDAYS[d.weekday()]}, {MONTHS[d.month - 1]} {d.day}, {d.year}",  # Wednesday, March 3, 2021
    lambda d: f"{d.day}.{d.month}.{d.year}",                                 # 3.3.2021 (always day first)
    lambda d: f"{MONTHS_ABBR[d.month - 1]}. {d.day} {d.year}",               # Mar. 3 2021
    lambda d: f"{d.day} {MONTHS_ABBR[d.month - 1]} '{d.year % 100:02d} ({d.year})",  # 3 Mar '21 (2021)
]

PHRASINGS = [
    "Convert '{date}' to ISO 8601.",
    "Write {date} as an ISO 8601 date.",
    "What is '{date}' in YYYY-MM-DD format?",
    "Give the ISO 8601 form of the date {date}.",
    "Rewrite the date '{date}' as YYYY-MM-DD.",
    "Date: {date}. Convert it to ISO 8601 (YYYY-MM-DD).",
]


def make_task(seed: int, n: int) -> list[dict[str, str]]:
    """`n` distinct questions with their ISO 8601 answers, drawn with random.Random(seed):
    a day between 1950-01-01 and 2049-12-31, a format and a phrasing, uniformly."""
    rng = random.Random(seed)
    first, last = dt.date(1950, 1, 1).toordinal(), dt.date(2049, 12, 31).toordinal()
    seen, out = set(), []
    while len(out) < n:
        day = dt.date.fromordinal(rng.randint(first, last))
        prompt = rng.choice(PHRASINGS).format(date=rng.choice(FORMATS)(day))
        if prompt in seen:
            continue
        seen.add(prompt)
        out.append({"prompt": prompt, "completion": day.isoformat()})
    return out


def write_task(out: Path, seed: int, n_train: int = N_TRAIN) -> dict[str, list[dict[str, str]]]:
    """The task's files in `out`: the held-out and validation questions are the same whatever
    `n_train` (the first `n_train` of the N_TRAIN training questions are written)."""
    records = make_task(seed, N_TRAIN + N_TEST + N_VALID)
    splits = {"train": records[:n_train], "test": records[N_TRAIN:N_TRAIN + N_TEST],
              "valid": records[N_TRAIN + N_TEST:]}
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in splits.items():
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    return splits


# ---- greedy generation ---------------------------------------------------------------------------
def generate(model, template, prompts: list[str], adapter=None, n_seq: int = 16, max_new: int = 16,
             threads: int = 2) -> list[str]:
    """Greedy completions of each prompt (one user turn, then the generation prompt), `n_seq`
    prompts at a time as separate sequences of one context (llamapy.generate.generate_batch);
    stops at an end-of-generation token or after `max_new` tokens."""
    from llamapy.generate import generate_batch
    tokenized = [template.tokenize(model.vocab, [{"role": "user", "content": p}], add_generation_prompt=True)[0]
                 for p in prompts]
    return generate_batch(model, tokenized, max_new, lora=None if adapter is None else [(adapter, 1.0)], n_seq=n_seq,
                          n_threads=threads, temperature=0.0)


def score(outputs: list[str], answers: list[str]) -> tuple[int, int]:
    exact = sum(o.strip() == a for o, a in zip(outputs, answers))
    contains = sum(a in o for o, a in zip(outputs, answers))
    return exact, contains


# ---- training ------------------------------------------------------------------------------------
def finetune_cli(args, model_path: Path, adapter_path: Path) -> list[str]:
    """The command a user runs (llamapy-finetune), run from this checkout."""
    flags = ["-m", str(model_path), "--data", str(args.out), "--chat-template", "gemma", "--mask-prompt",
             "--lora-rank", str(args.lora_rank), "-c", str(args.ctx), "-b", str(args.batch), "-ub", str(args.ubatch),
             "--epochs", str(args.epochs), "-lr", f"{args.lr:g}", "--lr-schedule", args.lr_schedule,
             "--warmup", str(args.warmup), "--seed", str(args.seed), "-t", str(args.threads),
             "--lora-out", str(adapter_path)]
    print("$ llamapy-finetune " + shlex.join(flags), flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    r = subprocess.run([sys.executable, "-m", "llamapy.cli.finetune", *flags], cwd=ROOT, env=env)
    if r.returncode:
        raise SystemExit(f"llamapy-finetune failed (exit {r.returncode})")
    return flags


def finetune_python(args, model, template, adapter_path: Path) -> None:
    """The same run through the Python API: train.jsonl and valid.jsonl packed into windows,
    a rank-r adapter, opt_fit validating on valid.jsonl after each epoch."""
    import llamapy
    from llamapy.dataset import load_samples
    from llamapy.train_params import LRSchedule, TrainParams
    train, valid = (load_samples(args.out / f"{name}.jsonl", model.vocab, args.ctx, chat_template=template,
                                 mask_prompt=True) for name in ("train", "valid"))
    print(f"python api: {train.n_samples} train samples in {train.ndata} windows of {args.ctx}, "
          f"{valid.n_samples} validation samples in {valid.ndata}", flush=True)
    params = TrainParams.for_model(model, lora_rank=args.lora_rank, seed=args.seed,
                                   schedule=LRSchedule(lr0=args.lr, epochs=args.epochs, kind=args.lr_schedule,
                                                       warmup=args.warmup))
    if args.batch > args.ctx:
        params = params.model_copy(update={"n_ctx_train": args.ctx})
    ctx = llamapy.Context(model, n_ctx=max(args.ctx, args.batch), n_batch=args.batch, n_ubatch=args.ubatch,
                          n_threads=args.threads)
    ctx.opt_init(params)
    ctx.opt_fit(train, epochs=args.epochs, val_data=valid, seed=args.seed)
    ctx.trainer.adapter.save(adapter_path)


# ---- the benchmark -----------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("sft-dates"), help="where the data and the adapter go")
    ap.add_argument("-m", "--model", type=Path, default=None, help="GGUF model (default: Gemma 3 270M Q4_K_M)")
    ap.add_argument("--task-seed", type=int, default=0, help="seed of the generated questions")
    ap.add_argument("--seed", type=int, default=0, help="training seed (adapter init, window order)")
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("-c", "--ctx", type=int, default=256, help="training window (samples are packed into it)")
    ap.add_argument("-b", "--batch", type=int, default=256, help="tokens per optimizer step")
    ap.add_argument("-ub", "--ubatch", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("-lr", "--lr", type=float, default=2e-3)
    ap.add_argument("--lr-schedule", default="constant", choices=["constant", "exp", "cosine"])
    ap.add_argument("--warmup", type=int, default=0)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--eval-batch", type=int, default=25, help="prompts generated together")
    ap.add_argument("--max-new", type=int, default=16, help="generated tokens at most per prompt")
    ap.add_argument("--python-api", action="store_true", help="train through the Python API, not llamapy-finetune")
    ap.add_argument("--skip-base", action="store_true", help="do not score the base model (development)")
    ap.add_argument("--adapter", type=Path, default=None, help="score this adapter instead of training one")
    ap.add_argument("--show", type=int, default=5, help="print this many held-out answers of each model")
    ap.add_argument("--data-only", action="store_true", help="write train/valid/test.jsonl to --out and stop")
    ap.add_argument("--n-train", type=int, default=N_TRAIN, choices=range(1, N_TRAIN + 1), metavar=f"1..{N_TRAIN}",
                    help="with --data-only: write only the first N training questions")
    args = ap.parse_args()
    args.out = args.out.resolve()  # llamapy-finetune runs from the checkout's root
    if args.data_only:
        write_task(args.out, args.task_seed, args.n_train)
        print(f"wrote {args.out}/train.jsonl ({args.n_train}), valid.jsonl ({N_VALID}), test.jsonl ({N_TEST})")
        return

    import llamapy
    from llamapy.chat import ChatTemplate
    from llamapy.defaults import default_model_path
    from llamapy.lora import LoraAdapter

    t_all = time.perf_counter()
    model_path = Path(args.model or default_model_path(print)).resolve()
    model = llamapy.load_model(model_path)
    template = ChatTemplate.named("gemma", model.vocab)
    splits = write_task(args.out, args.task_seed)
    test = splits["test"]
    prompts, answers = [r["prompt"] for r in test], [r["completion"] for r in test]
    print(f"task: {N_TRAIN} train, {N_VALID} validation, {N_TEST} held-out questions (seed {args.task_seed}) in "
          f"{args.out}/; e.g. {test[0]['prompt']!r} -> {test[0]['completion']!r}", flush=True)

    rows = []
    if not args.skip_base:
        t0 = time.perf_counter()
        base = generate(model, template, prompts, None, args.eval_batch, args.max_new, args.threads)
        t_base = time.perf_counter() - t0
        rows.append(("base", *score(base, answers), t_base))
        for p, o in list(zip(prompts, base))[:args.show]:
            print(f"  base: {p!r} -> {o!r}", flush=True)
        print(f"base: exact {rows[-1][1]}/{N_TEST}, contains {rows[-1][2]}/{N_TEST} ({t_base:.0f} s)", flush=True)

    adapter_path = (args.adapter or args.out / "lora-dates.gguf").resolve()
    t_train = 0.0
    how = "given adapter"
    if args.adapter is None:
        t0 = time.perf_counter()
        if args.python_api:
            finetune_python(args, model, template, adapter_path)
            how = "Python API"
        else:
            finetune_cli(args, model_path, adapter_path)
            how = "llamapy-finetune"
        t_train = time.perf_counter() - t0

    t0 = time.perf_counter()
    adapter = LoraAdapter.load(adapter_path, model)
    tuned = generate(model, template, prompts, adapter, args.eval_batch, args.max_new, args.threads)
    t_tuned = time.perf_counter() - t0
    rows.append(("LoRA SFT", *score(tuned, answers), t_tuned))
    for p, o, a in zip(prompts, tuned, answers):
        if o.strip() != a:
            print(f"  miss: {p!r} -> {o!r} (expected {a})")
    for p, o in list(zip(prompts, tuned))[:args.show]:
        print(f"  sft:  {p!r} -> {o!r}")

    print()
    print(f"| model | exact match | contains the ISO date | generation time ({N_TEST} prompts) |")
    print("|---|---|---|---|")
    for name, exact, contains, seconds in rows:
        print(f"| {name} | {exact}/{N_TEST} | {contains}/{N_TEST} | {seconds:.0f} s |")
    print(f"\ntraining ({how}): {t_train:.0f} s; lora rank {args.lora_rank}, -c {args.ctx} -b {args.batch} "
          f"-ub {args.ubatch}, {args.epochs} epochs, lr {args.lr:g} ({args.lr_schedule}"
          f"{f', warmup {args.warmup}' if args.warmup else ''}), seed {args.seed}")
    print(f"total: {time.perf_counter() - t_all:.0f} s")
    tuned_exact = rows[-1][1]
    base_exact = rows[0][1] if not args.skip_base else None
    ok = tuned_exact >= 0.8 * N_TEST and (base_exact is None or tuned_exact >= 2 * base_exact)
    print(f"acceptance (finetuned exact >= 80% and >= 2x base): {'PASS' if ok else 'FAIL'}"
          f"{' (base not scored)' if base_exact is None else ''}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
