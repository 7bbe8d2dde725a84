"""The README main job (LoRA on Gemma 3 270M Q4_K_M), llamapy against PyTorch + peft doing
the same training, side by side (issue 16, acceptance 1).

    python bench/lora_vs_torch.py [-t 2] [--rounds 2] [--demo-chars 16000] [--epochs N] [--quick]
                                  [--model GGUF] [--torch-python /work/torchvenv/bin/python]
                                  [--json FILE] [--work DIR]

llamapy runs the real `llamapy-finetune` with the README defaults (no -m, no -f: the first
--demo-chars characters of CPython's `pydoc_data.topics`, ctx 256, LoRA rank 8 alpha 8 on
attn_q/k/v/output and ffn_gate/up/down, AdamW lr 3e-4, betas 0.9/0.999, eps 1e-8, wd 0,
one 256-token window per optimizer step, ubatch 256, -val-split 0.05, 2 epochs, seed 0),
only with `-t` and the output path added. PyTorch 2.13 + transformers + peft (a separate
venv, never a project dependency: `python -m venv /work/torchvenv && /work/torchvenv/bin/pip
install torch==2.13.0 transformers peft gguf sentencepiece numpy`) does the same work:
transformers loads the same GGUF (dequantized to float32), peft puts a rank-8, alpha-8,
dropout-0 LoRA on q/k/v/o/gate/up/down_proj, torch.optim.AdamW with llamapy's
hyper-parameters (weight_decay=0, not torch's 0.01) steps once per window.

How the two sides are kept identical:
- the windows: the main process makes them once with llamapy's own code
  (`llamapy.dataset.text_windows` with the architecture's BOS-in-every-window: each window
  is BOS + 255 text tokens, its labels the 256 next tokens, all of them counted; stride 128;
  the last 5% of the windows held out, `validation_windows`) and writes them, each epoch's
  window order (the text's order, as llamapy-finetune trains without --shuffle) and the initial LoRA
  A matrices (`LoraAdapter.new(model, 8, seed=0)`: Kaiming-uniform, bound 1/sqrt(n_in);
  B is zero on both sides) to one .npz. The llamapy half checks that the CLI trained on
  exactly these windows, in this order, from this A; the torch half copies A into peft.
- the loss: the mean next-token cross-entropy over the window's 256 positions; the
  validation loss: the mean over the held-out windows of their mean loss (ggmlpy's
  `Result.loss`).
- speed: training tokens/s after the first optimizer step (model loading, graph building,
  kernel loading are start-up; validation passes are not training), i.e. llamapy's
  `trainer.timing` (which the CLI prints) and the same clock around each torch step; the
  whole command's wall time and its peak RSS (getrusage of a wrapper process's child)
  include everything.

The halves run as fresh processes, alternating which goes first from round to round (the
machine is shared: compare only within a run, and read the load averages printed with every
figure). `--quick` trains one epoch on 4,000 characters (5 windows) to check the script.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from peak_rss import peak_rss_mb  # bench/, beside this script

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TORCH_PYTHON = "/work/torchvenv/bin/python"
LORA_MODULES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}
QUICK_CHARS, QUICK_EPOCHS = 4000, 1

# ================================================================================================
# the torch half (runs in the torch venv: imports torch, transformers, peft and numpy only)
# ================================================================================================
def torch_half(args) -> None:
    t_start = time.perf_counter()
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(args.threads)
    import peft
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    data = np.load(args.data)
    cfg = json.loads(str(data["config"]))
    tokens = torch.from_numpy(data["tokens"].astype(np.int64))
    labels = torch.from_numpy(data["labels"].astype(np.int64))
    orders = data["orders"]
    def window_loss(i: int, per_token: bool = False):
        logits = model(input_ids=tokens[i:i + 1]).logits[0]
        return F.cross_entropy(logits, labels[i], reduction="none" if per_token else "mean")

    t_load = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(Path(args.model).parent), gguf_file=Path(args.model).name,
                                                 dtype=torch.float32)
    model.config.use_cache = False
    hf_targets = sorted({HF_NAMES[m].split(".")[-1] for m in cfg["lora_modules"]})
    model = get_peft_model(model, LoraConfig(r=cfg["lora_rank"], lora_alpha=cfg["lora_alpha"], lora_dropout=0.0,
                                             target_modules=hf_targets, bias="none", init_lora_weights=True))
    # llamapy's initial A (B is zero on both sides): the same starting adapter
    named = dict(model.named_modules())
    n_copied = 0
    with torch.no_grad():
        for key in data.files:
            if not key.startswith("lora_a/"):
                continue
            _, il, kind = key.split("/")  # lora_a/<layer>/<module>
            mod = named[f"base_model.model.model.layers.{il}.{HF_NAMES[kind]}"]
            a = torch.from_numpy(data[key])
            if mod.lora_A["default"].weight.shape != a.shape:
                raise SystemExit(f"torch half: {key}: A {tuple(a.shape)} vs peft {tuple(mod.lora_A['default'].weight.shape)}")
            mod.lora_A["default"].weight.copy_(a)
            if mod.lora_B["default"].weight.abs().max() != 0:
                raise SystemExit(f"torch half: {key}: peft's B does not start at zero")
            n_copied += 1
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in trainable)
    if len(trainable) != 2 * n_copied or n_trainable != cfg["lora_params"]:
        raise SystemExit(f"torch half: {n_copied} A matrices copied, {len(trainable)} trainable tensors "
                         f"({n_trainable} values; llamapy trains {cfg['lora_params']})")
    load_seconds = time.perf_counter() - t_load
    if args.eval_only:  # --check: the base model's loss on every window (B = 0: the adapter adds nothing)
        model.eval()
        with torch.no_grad():
            losses = [float(window_loss(i)) for i in range(cfg["windows"])]
        Path(args.out_prefix + ".json").write_text(json.dumps(dict(window_losses=losses)))
        return
    opt = torch.optim.AdamW(trainable, lr=cfg["lr"], betas=(cfg["beta1"], cfg["beta2"]), eps=cfg["eps"],
                            weight_decay=cfg["wd"])

    step_losses, step_seconds, val_losses, val_se = [], [], [], []
    model.train()
    for epoch in range(cfg["epochs"]):
        for i in orders[epoch]:
            t0 = time.perf_counter()
            loss = window_loss(int(i))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step_losses.append(float(loss.detach()))
            step_seconds.append(time.perf_counter() - t0)
            print(f"torch: epoch {epoch + 1} step {len(step_losses)}: loss {step_losses[-1]:.5f} "
                  f"({step_seconds[-1]:.2f} s)", file=sys.stderr, flush=True)
        model.eval()
        with torch.no_grad():
            per_window = [window_loss(i, per_token=True) for i in range(cfg["idata_split"], cfg["windows"])]
        model.train()
        means = [float(x.mean()) for x in per_window]
        val_losses.append(float(np.mean(means)) if means else None)
        flat = torch.cat(per_window).numpy().astype(np.float64) if per_window else np.zeros(0)
        val_se.append(float(flat.std(ddof=1) / np.sqrt(len(flat))) if len(flat) > 1 else None)
    timed = step_seconds[1:]
    out = dict(torch=torch.__version__, transformers=transformers.__version__, peft=peft.__version__,
               threads=torch.get_num_threads(), step_losses=step_losses, val_losses=val_losses,
               val_token_se=val_se, train_tokens=len(step_losses) * cfg["n_ctx"],
               startup_seconds=step_seconds[0], load_seconds=load_seconds,
               tokens_per_second=len(timed) * cfg["n_ctx"] / sum(timed) if timed else float("nan"),
               inner_seconds=time.perf_counter() - t_start)
    Path(args.out_prefix + ".json").write_text(json.dumps(out))


# ================================================================================================
# the llamapy half: the real llamapy-finetune, recording what it trained on and its losses
# ================================================================================================
def llamapy_eval(args) -> None:
    """--check: the base model's loss on every window, through the training path (opt_evaluate)."""
    from llamapy import Context, load_model
    from llamapy.dataset import TokenWindows
    from llamapy.train_params import TrainParams
    data = np.load(args.data)
    cfg = json.loads(str(data["config"]))
    m = load_model(args.model)
    ds = TokenWindows(cfg["n_tokens"], cfg["n_ctx"], cfg["stride"], cfg["windows"])
    ds.data[:], ds.labels[:] = data["tokens"], data["labels"]
    ctx = Context(m, n_ctx=cfg["n_ctx"], n_batch=cfg["n_ctx"], n_ubatch=cfg["n_ctx"], n_threads=args.threads)
    ctx.opt_init(TrainParams.for_model(m))
    result = ctx.opt_evaluate(ds)
    Path(args.out_prefix + ".json").write_text(json.dumps(dict(window_losses=[float(x) for x in result.losses])))


def llamapy_profile(args) -> None:
    """--profile: seconds per op (and per op and source types) of the main job's training
    windows, through Context.opt_fit as the CLI calls it, after one warm-up epoch."""
    from collections import Counter, defaultdict

    import ggmlpy.backend.cpu.plan as plan_module
    from ggmlpy.registry import OPS, OpKind
    from llamapy import Context, load_model
    from llamapy.dataset import TokenWindows
    from llamapy.train_params import TrainParams
    data = np.load(args.data)
    cfg = json.loads(str(data["config"]))
    original_init = plan_module.Plan.__init__
    plans = {"n": 0, "seconds": 0.0}

    def labelled_init(self, graph, *a, **kw):  # op names with their sources' types; plans made and their time
        t0 = time.perf_counter()
        original_init(self, graph, *a, **kw)
        plans["n"] += 1
        plans["seconds"] += time.perf_counter() - t0
        computed = iter([n for n in graph.nodes if OPS[n.op].kind is OpKind.COMPUTE])
        labelled = []
        for name, run, par in self.steps:  # a fused step ("ADD+RMS_NORM+MUL") stands for several nodes
            nodes = [next(computed) for _ in name.split("+")]
            types = ",".join(t.type.name for t in nodes[0].src[:2] if t is not None)
            labelled.append((f"{name}({types})" if len(nodes) == 1 else name, run, par))
        self.steps = labelled
    plan_module.Plan.__init__ = labelled_init
    m = load_model(args.model)
    n_win = min(cfg["windows"], args.profile_windows)
    ds = TokenWindows(cfg["n_tokens"], cfg["n_ctx"], cfg["stride"], n_win)
    ds.data[:], ds.labels[:] = data["tokens"][:n_win], data["labels"][:n_win]
    ctx = Context(m, n_ctx=cfg["n_ctx"], n_batch=cfg["n_ctx"], n_ubatch=512, n_threads=args.threads)
    ctx.opt_init(TrainParams.for_model(m, backward_bf16=False if args.backward_f32 else None))
    ctx.opt_fit(ds, epochs=1, val_split=0.0, seed=0, silent=True)  # warm-up: graphs, plans, kernels
    prof = ctx.backend.enable_profile()
    calls: Counter[str] = Counter()
    run = ctx.backend._run

    def counting_run(plan):
        calls.update(name for name, _, _ in plan.steps)
        run(plan)
    ctx.backend._run = counting_run
    plans.update(n=0, seconds=0.0)
    t0 = time.perf_counter()
    ctx.opt_fit(ds, epochs=1, val_split=0.0, seed=1, silent=True)
    wall = time.perf_counter() - t0
    by_op: dict[str, float] = defaultdict(float)
    for name, sec in prof.items():
        by_op[name.split("(")[0]] += sec
    Path(args.out_prefix + ".json").write_text(json.dumps(dict(
        windows=n_win, fit_seconds=wall, op_seconds=sum(prof.values()), by_label=dict(prof),
        calls=dict(calls), by_op=dict(by_op), threads=args.threads, plans_made=plans["n"],
        plan_seconds=plans["seconds"])))


def llamapy_half(args) -> None:
    if args.profile:
        return llamapy_profile(args)
    if args.eval_only:
        return llamapy_eval(args)
    t_start = time.perf_counter()
    import llamapy.context
    data = np.load(args.data)
    cfg = json.loads(str(data["config"]))
    record: dict = {}
    original_fit = llamapy.context.Context.opt_fit

    def recording_fit(self, dataset, *a, **kw):  # checks the CLI's data against the .npz, keeps the history
        if not (np.array_equal(dataset.data, data["tokens"]) and np.array_equal(dataset.labels, data["labels"])):
            raise SystemExit("llamapy half: the CLI's windows are not the bench's")
        adapter = self.trainer.adapter
        for key in data.files:
            if key.startswith("lora_a/"):
                _, il, kind = key.split("/")
                lora_a, lora_b = adapter.tensors[f"blk.{il}.{kind}.weight"]
                if not np.array_equal(lora_a.array()[0, 0], data[key]) or np.any(lora_b.array()[0, 0]):
                    raise SystemExit(f"llamapy half: the CLI's initial adapter differs at {key}")
        orders = []
        user_on_epoch = kw.pop("on_epoch", None)

        def on_epoch(result):
            orders.append(dataset.permutation[: cfg["n_train"]].copy())
            if user_on_epoch:
                user_on_epoch(result)
        history = original_fit(self, dataset, *a, on_epoch=on_epoch, **kw)
        if not np.array_equal(np.stack(orders), data["orders"]):
            raise SystemExit("llamapy half: the CLI trained the windows in another order than the bench's")
        timing = self.trainer.timing
        record.update(step_losses=[x for h in history for x in h.train.steps],
                      val_losses=[h.val.loss()[0] if h.val.losses else None for h in history],
                      val_uncertainty=[h.val.loss()[1] if h.val.losses else None for h in history],
                      train_tokens=sum(len(h.train.losses) for h in history) * self.trainer.n_ubatch,
                      startup_seconds=timing.startup_seconds, tokens_per_second=timing.tokens_per_second)
        return history

    llamapy.context.Context.opt_fit = recording_fit
    from llamapy.cli import finetune
    argv = ["llamapy-finetune", "-t", str(args.threads), "--lora-out", args.out_prefix + ".lora.gguf"]
    if args.model_given:
        argv += ["-m", args.model]
    if cfg["demo_chars"] != finetune.DEMO_CHARS:
        argv += ["--demo-chars", str(cfg["demo_chars"])]
    if cfg["epochs_given"]:
        argv += ["--epochs", str(cfg["epochs"])]
    if args.backward_f32:
        argv += ["--backward-f32"]
    sys.argv = argv
    print("llamapy half: " + " ".join(argv), file=sys.stderr, flush=True)
    try:
        finetune.main()
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    if "step_losses" not in record:
        raise SystemExit("llamapy half: the CLI did not train")
    record.update(command=" ".join(argv), inner_seconds=time.perf_counter() - t_start, threads=args.threads)
    Path(args.out_prefix + ".json").write_text(json.dumps(record))


# ================================================================================================
# the driver
# ================================================================================================
def prepare(args, work: Path) -> tuple[dict, Path]:
    """The windows, window orders and initial LoRA A, with llamapy's code, for both halves."""
    from llamapy.cli.training import TrainingArgs
    from llamapy.dataset import validation_windows
    from llamapy.dataset import text_windows
    from llamapy.defaults import default_model_path, demo_corpus
    from llamapy.lora import LoraAdapter
    from llamapy.model import load_model
    from llamapy.train_params import TrainParams
    defaults = TrainingArgs()
    n_ctx = defaults.ctx_size
    model_path = str(args.model or default_model_path(lambda s: print(s, file=sys.stderr)))
    m = load_model(model_path)
    params = TrainParams.for_model(m, seed=defaults.seed)  # the CLI's policy: LoRA rank 8, lr 3e-4, BOS per window
    if params.lora is None or tuple(params.lora.modules) != LORA_MODULES:
        raise SystemExit(f"the main job should train a LoRA on {LORA_MODULES}; llamapy's policy gives {params.lora}")
    epochs = args.epochs or defaults.epochs
    ds = text_windows(m.vocab, demo_corpus()[: args.demo_chars], n_ctx, params.window_bos)
    idata_split = ds.ndata - validation_windows(ds.ndata, defaults.val_split)
    perm, rng, orders = np.arange(ds.ndata), np.random.default_rng(defaults.seed), []
    for _ in range(epochs):  # the CLI's order: as the text runs, unless --shuffle
        if defaults.shuffle:
            rng.shuffle(perm[:idata_split])
        orders.append(perm[:idata_split].copy())
    adapter = LoraAdapter.new(m, params.lora.rank, params.lora.alpha, params.lora.modules, params.lora.seed)
    lora = {}
    for name, (a, _) in adapter.tensors.items():
        _, il, kind, _ = name.split(".")
        lora[f"lora_a/{il}/{kind}"] = np.ascontiguousarray(a.array()[0, 0])
    opt = params.optimizer
    lr = params.schedule.lr_at(0, idata_split)
    if any(params.schedule.lr_at(s, idata_split) != lr for s in range(epochs * idata_split)):
        raise SystemExit("the main job's learning rate is not constant: the torch half assumes it is")
    cfg = dict(model=model_path, n_ctx=n_ctx, windows=int(ds.ndata), idata_split=int(idata_split),
               n_train=int(idata_split), n_tokens=int(ds.n_tokens), stride=int(ds.stride), epochs=epochs,
               epochs_given=bool(args.epochs), demo_chars=args.demo_chars, lr=lr, beta1=opt.beta1,
               beta2=opt.beta2, eps=opt.eps, wd=opt.wd, lora_rank=adapter.rank, lora_alpha=adapter.alpha,
               lora_modules=list(params.lora.modules), window_bos=bool(params.window_bos),
               lora_params=int(sum(np.prod(a.array().shape) + np.prod(b.array().shape)
                                   for a, b in adapter.tensors.values())))
    path = work / "windows.npz"
    np.savez(path, tokens=ds.data, labels=ds.labels, orders=np.stack(orders), config=json.dumps(cfg), **lora)
    return cfg, path


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_half(which: str, args, data_path: Path, prefix: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               OPENBLAS_NUM_THREADS=str(args.threads))
    if which == "llamapy":
        py = sys.executable
        env["PYTHONPATH"] = str(ROOT)
    else:
        py = args.torch_python
        env.pop("PYTHONPATH", None)  # the torch venv must not pick up llamapy or its numpy
    cmd = [py, str(Path(__file__).resolve()), "--half", which, "--data", str(data_path), "--out-prefix",
           str(prefix), "-t", str(args.threads), "--model", str(args.model_path)] \
        + (["--model-given"] if args.model else []) + (["--eval-only"] if args.check else []) \
        + (["--profile", "--profile-windows", str(args.profile_windows)] if args.profile else []) \
        + (["--backward-f32"] if args.backward_f32 and which == "llamapy" else [])
    load_before = load_average()
    t0 = time.perf_counter()
    r, peak_mb = peak_rss_mb(cmd, ROOT, env)
    wall = time.perf_counter() - t0
    Path(str(prefix) + ".log").write_text(r.stdout + r.stderr)
    if r.returncode:
        raise SystemExit(f"{which} half failed (log {prefix}.log):\n{r.stderr[-3000:]}")
    res = json.loads(Path(str(prefix) + ".json").read_text())
    res.update(wall_seconds=wall, load_before=load_before, load_after=load_average(),
               peak_rss_mb=peak_mb)
    if which == "llamapy" and not (args.check or args.profile):  # the CLI's own lines, for the record
        res["cli_lines"] = [ln for ln in r.stderr.splitlines() if ln.startswith(("finetune:", "memory:", "epoch", " "))]
    return res


def bench(args, work: Path) -> None:
    if args.quick:
        args.demo_chars, args.epochs = QUICK_CHARS, args.epochs or QUICK_EPOCHS
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
          f"{os.cpu_count()} CPUs, load average {load_average()}", flush=True)
    cfg, data_path = prepare(args, work)
    args.model_path = cfg["model"]
    print(f"data: the first {cfg['demo_chars']} characters of pydoc_data.topics: {cfg['n_tokens']} tokens, "
          f"{cfg['windows']} windows of {cfg['n_ctx']} (stride {cfg['stride']}, BOS first: {cfg['window_bos']}), "
          f"{cfg['idata_split']} trained on per epoch, {cfg['windows'] - cfg['idata_split']} held out; "
          f"{cfg['epochs']} epoch(s), one window per step", flush=True)
    print(f"LoRA rank {cfg['lora_rank']} alpha {cfg['lora_alpha']:g} on {', '.join(cfg['lora_modules'])} "
          f"({cfg['lora_params']:,} values); AdamW lr {cfg['lr']:g} betas ({cfg['beta1']:g}, {cfg['beta2']:g}) "
          f"eps {cfg['eps']:g} wd {cfg['wd']:g}; -t {args.threads}", flush=True)
    if args.check:
        return check(args, data_path, work)
    if args.profile:
        return profile(args, data_path, work)
    runs: dict[str, list[dict]] = {"llamapy": [], "torch": []}
    for rnd in range(args.rounds):
        order = ("llamapy", "torch") if (rnd + args.torch_first) % 2 == 0 else ("torch", "llamapy")
        for which in order:
            res = run_half(which, args, data_path, work / f"{which}-{rnd}")
            runs[which].append(res)
            print_round(rnd, which, res)
    summarize(args, cfg, runs)


def print_round(rnd: int, which: str, res: dict) -> None:
    vals = ", ".join(f"{v:.4f}" for v in res["val_losses"] if v is not None)
    print(f"round {rnd + 1} {which:7s}: {res['tokens_per_second']:7.1f} training tokens/s (first step "
          f"{res['startup_seconds']:.1f} s), whole command {res['wall_seconds']:6.1f} s, peak RSS "
          f"{res['peak_rss_mb']:6.0f} MB, step-0 loss {res['step_losses'][0]:.5f}, val loss per epoch "
          f"[{vals}]; load {res['load_before']} -> {res['load_after']}", flush=True)


def check(args, data_path: Path, work: Path) -> None:
    res = {w: run_half(w, args, data_path, work / f"check-{w}") for w in ("llamapy", "torch")}
    a, b = np.asarray(res["llamapy"]["window_losses"]), np.asarray(res["torch"]["window_losses"])
    d = a - b
    for i, (x, y) in enumerate(zip(a, b)):
        print(f"window {i:3d}: llamapy {x:.5f} torch {y:.5f} diff {x - y:+.5f}")
    print(f"check: base-model loss per window, llamapy - torch over {len(d)} windows: mean {d.mean():+.5f}, "
          f"max |diff| {np.abs(d).max():.5f}, relative {np.abs(d / b).max():.2e}; mean llamapy {a.mean():.5f}, "
          f"torch {b.mean():.5f}; load {load_average()}")


def profile(args, data_path: Path, work: Path) -> None:
    r = run_half("llamapy", args, data_path, work / "profile")
    n, wall, ops = r["windows"], r["fit_seconds"], r["op_seconds"]
    print(f"profile: llamapy, {n} training windows of the main job (after a warm-up epoch), -t {args.threads}: "
          f"{wall / n:.2f} s per window ({n * 256 / wall:.1f} tokens/s), of which {ops / n:.2f} s in op kernels "
          f"and {(wall - ops) / n:.2f} s outside them ({r['plans_made'] / n:.1f} compute plans prepared per window, "
          f"{r['plan_seconds'] / n:.2f} s); load {r['load_before']} -> {r['load_after']}")
    print("by op:")
    for op, sec in sorted(r["by_op"].items(), key=lambda kv: -kv[1])[:args.profile_top]:
        print(f"  {op:22s} {sec / n:7.3f} s/window  {100 * sec / ops:5.1f}%")
    print("by op and source types:")
    for label, sec in sorted(r["by_label"].items(), key=lambda kv: -kv[1])[:args.profile_top]:
        c = r["calls"].get(label, 0)
        print(f"  {label:40s} {sec / n:7.3f} s/window  {100 * sec / ops:5.1f}%  {c // n:5d} calls/window  "
              f"{1e3 * sec / max(c, 1):8.2f} ms/call")


def summarize(args, cfg: dict, runs: dict) -> None:
    L, T = runs["llamapy"], runs["torch"]
    ratios = [a["tokens_per_second"] / b["tokens_per_second"] for a, b in zip(L, T)]
    a, b = np.asarray(L[0]["step_losses"]), np.asarray(T[0]["step_losses"])
    d = np.abs(a - b)
    per_epoch = cfg["idata_split"]
    print(f"step losses llamapy / torch: step 0 {a[0]:.5f} / {b[0]:.5f} (diff {a[0] - b[0]:+.5f}); "
          f"max |diff| over the first epoch {d[:per_epoch].max():.4f}, over all {len(d)} steps {d.max():.4f}; "
          f"mean llamapy {a.mean():.4f}, torch {b.mean():.4f}")
    for e in range(cfg["epochs"]):
        vl, vt = L[0]["val_losses"][e], T[0]["val_losses"][e]
        if vl is not None:
            se = T[0]["val_token_se"][e]
            print(f"validation loss after epoch {e + 1}: llamapy {vl:.4f}, torch {vt:.4f} (diff {vl - vt:+.4f}; "
                  f"torch's per-token standard error {se:.4f})")

    def med(xs):
        return statistics.median(xs)
    tl, tt = med([r["tokens_per_second"] for r in L]), med([r["tokens_per_second"] for r in T])
    wl, wt = med([r["wall_seconds"] for r in L]), med([r["wall_seconds"] for r in T])
    rl, rt = max(r["peak_rss_mb"] for r in L), max(r["peak_rss_mb"] for r in T)
    print(f"per-round speed ratios llamapy/torch: {', '.join(f'{r:.2f}x' for r in ratios)}")
    print(f"median of {args.rounds}: llamapy {tl:.1f} tokens/s, torch {tt:.1f} tokens/s: {tl / tt:.2f}x "
          f"({'meets' if tl / tt >= 2.0 else 'below'} 2.0x); whole command {wl:.1f} s / {wt:.1f} s "
          f"({wt / wl:.2f}x); peak RSS {rl:.0f} MB / {rt:.0f} MB ({'within' if rl <= 1024 else 'above'} 1.0 GB)")
    print(f"torch {T[0]['torch']}, transformers {T[0]['transformers']}, peft {T[0]['peft']}; torch loaded and "
          f"dequantized the GGUF in {T[0]['load_seconds']:.1f} s; llamapy command: {L[0]['command']}")
    cmd = "python bench/lora_vs_torch.py " + " ".join(sys.argv[1:])
    print(f"| {datetime.date.today()} | `{cmd}` | {tl:.1f} / {tt:.1f} = {tl / tt:.2f}x | {wl:.0f} / {wt:.0f} s "
          f"| {rl:.0f} / {rt:.0f} MB | {a[0]:.4f} / {b[0]:.4f} | "
          + " ; ".join(f"{L[0]['val_losses'][e]:.4f} / {T[0]['val_losses'][e]:.4f}" for e in range(cfg["epochs"])
                       if L[0]["val_losses"][e] is not None)
          + f" | {load_average()} |")
    if args.json:
        args.json.write_text(json.dumps(dict(date=str(datetime.datetime.now(datetime.timezone.utc)), command=cmd,
                                             machine=platform.machine(), cpus=os.cpu_count(), config=cfg,
                                             ratios=ratios, runs=runs), indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="runs of each half, alternating which goes first")
    ap.add_argument("--demo-chars", type=int, default=16_000, help="the CLI's --demo-chars")
    ap.add_argument("--epochs", type=int, default=0, help="epochs (default: the CLI's, 2; --quick: 1)")
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_CHARS} characters, one epoch: checks the script")
    ap.add_argument("--model", help="GGUF (default: the CLI's, Gemma 3 270M Q4_K_M)")
    ap.add_argument("--torch-first", action="store_true", help="torch runs first in odd rounds (default: llamapy)")
    ap.add_argument("--summarize", type=Path, metavar="DIR",
                    help="only print the summary of the runs kept in DIR (a --work directory), e.g. after a "
                         "run was stopped between rounds")
    ap.add_argument("--torch-python", default=DEFAULT_TORCH_PYTHON)
    ap.add_argument("--json", type=Path, help="also write every run's numbers here")
    ap.add_argument("--work", type=Path, help="keep the files (windows, logs, adapters) here")
    ap.add_argument("--check", action="store_true",
                    help="no training: the base model's loss on every window, llamapy (opt_evaluate) and torch")
    ap.add_argument("--profile", action="store_true",
                    help="no torch: llamapy's seconds per op over --profile-windows training windows of the main job")
    ap.add_argument("--profile-windows", type=int, default=6)
    ap.add_argument("--backward-f32", action="store_true",
                    help="llamapy's backward products through the quantized weights in float32 (its --backward-f32)")
    ap.add_argument("--profile-top", type=int, default=20)
    ap.add_argument("--eval-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--half", choices=("llamapy", "torch"), help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--out-prefix", help=argparse.SUPPRESS)
    ap.add_argument("--model-given", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.half == "llamapy":
        return llamapy_half(args)
    if args.half == "torch":
        return torch_half(args)
    if not Path(args.torch_python).exists():
        raise SystemExit(f"no PyTorch at {args.torch_python}: python -m venv /work/torchvenv && /work/torchvenv/bin/pip "
                         "install torch==2.13.0 transformers peft gguf sentencepiece numpy")
    sys.path.insert(0, str(ROOT))
    if args.summarize:
        data = np.load(args.summarize / "windows.npz")
        cfg = json.loads(str(data["config"]))
        runs = {w: [json.loads(p.read_text()) for p in sorted(args.summarize.glob(f"{w}-[0-9]*.json"),
                                                                 key=lambda p: int(p.stem.split("-")[1]))]
                for w in ("llamapy", "torch")}
        n = min(len(runs["llamapy"]), len(runs["torch"]))
        runs = {w: r[:n] for w, r in runs.items()}
        args.rounds = n
        for rnd in range(n):
            for w in ("llamapy", "torch"):
                print_round(rnd, w, runs[w][rnd])
        return summarize(args, cfg, runs)
    if args.work:
        args.work.mkdir(parents=True, exist_ok=True)
        bench(args, args.work)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            bench(args, Path(tmp))


if __name__ == "__main__":
    main()
