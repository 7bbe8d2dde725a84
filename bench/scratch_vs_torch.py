"""Training a small llama from scratch: llamapy against PyTorch doing the same training.

Both sides start from the same initial GGUF, train every tensor on the same token windows
in the same order with the same AdamW (learning rate, betas, eps, decoupled weight decay,
bias correction) for the same tokens, and save a GGUF; held-out perplexity is then
measured on both files by the same evaluator (`llamapy-perplexity -c N`) on the last 10%
of the text, which neither side trained on. The acceptance of issue 14: held-out
perplexity within 3% of PyTorch's, llamapy's training tokens/s at least 1.5x PyTorch's
at the same thread count.

    python bench/scratch_vs_torch.py [--init GGUF | --embd 128 --head 8 --layer 6 --ff 384]
                                     [-f TEXT] [--chars N] [-c 128] [-b 128] [-ub 128]
                                     [-lr 1e-3] [-wd 0] [--epochs 1] [--seed 0] [-t 2] [--repeat 1]
                                     [--torch-fused] [--torch-compile] [--noise-floor] [--work DIR] [--json FILE]
    python bench/scratch_vs_torch.py --check [--init GGUF]    # forward logits, llamapy vs torch

--embd needs `llamapy.new_model` (the issue's shape: --embd 128 --head 8 --layer 6 --ff 384
-c 128, vocabulary from --init, default stories260K); without it, give the initial model
with --init. It prints one line per run, the step-loss and trained-weight agreement, both
held-out perplexities and the speed ratio, and a row for bench/RESULTS.md. Over a
thousand steps two trainings that differ only in float rounding drift apart (AdamW
amplifies it); `--noise-floor` trains torch once more with other rounding (compiled) so
the llamapy-torch gap can be read against torch's gap with itself.

How the two halves are kept identical:
- the data: the main process (llamapy) cuts the text at 90% (at a line start), makes the
  training windows of the first part with `llamapy.dataset.text_windows`, and writes
  them, their labels and the window order of every epoch to one .npz that both halves
  read. The order is the one `Context.opt_fit(seed=...)` uses: the training windows'
  permutation shuffled in place by one `np.random.default_rng(seed)` at the start of
  every epoch; the llamapy half checks that its fit really used it.
- the model: the torch half reads the initial GGUF with the `gguf` package and runs the
  llama graph exactly as llamapy builds it (RMS norm with the file's eps, ggml's NORM
  rope on adjacent pairs of each head as GGUF llama files expect, grouped K/V heads
  shared by head // (n_head / n_head_kv), causal attention scaled by 1/sqrt(head_dim),
  SwiGLU FFN, output.weight (or the embeddings when the file ties them)); `--check`
  compares its logits with llamapy's on one window.
- the step: -b tokens (whole windows) per optimizer step; the loss is the mean token
  cross-entropy of the step; torch.optim.AdamW (`weight_decay` = ggml's wd: both apply
  p *= 1 - lr*wd) on every tensor, as llamapy trains every F32 tensor.
- speed: training tokens/s after the first optimizer step (graph building, kernel
  compilation, allocator warm-up are start-up), i.e. llamapy's `trainer.timing` and the
  same clock around each torch step; the wall time of the whole fit is reported too.

The two halves run as separate processes (llamapy in this Python, torch in
--torch-python, by default /work/torchvenv/bin/python, a venv that is never a project
dependency), alternating A/B then B/A with --repeat > 1; each gets -t threads (llamapy's
Context n_threads; torch.set_num_threads and OMP/MKL_NUM_THREADS).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("LLAMAPY_SHARED", ROOT.parent / "shared"))
DEFAULT_TORCH_PYTHON = "/work/torchvenv/bin/python"


# ================================================================================================
# the torch half (runs in the torch venv: imports torch, numpy and gguf only)
# ================================================================================================
def _gguf_model(path: str):
    """hparams and the F32 tensors (numpy, GGUF row-major layout) of a llama GGUF file."""
    import gguf
    r = gguf.GGUFReader(path)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    if arch != "llama":
        raise SystemExit(f"torch half: only the llama architecture is implemented (got {arch})")

    def kv(name, default=None):
        f = r.fields.get(f"{arch}.{name}")
        return default if f is None else f.parts[-1].tolist()[0]
    n_embd, n_head = int(kv("embedding_length")), int(kv("attention.head_count"))
    head_dim = int(kv("attention.key_length", n_embd // n_head))
    hp = dict(n_embd=n_embd, n_head=n_head, n_head_kv=int(kv("attention.head_count_kv", n_head)),
              n_layer=int(kv("block_count")), n_ff=int(kv("feed_forward_length")), head_dim=head_dim,
              n_rot=int(kv("rope.dimension_count", head_dim)),
              eps=float(kv("attention.layer_norm_rms_epsilon", 1e-5)),
              freq_base=float(kv("rope.freq_base", 10000.0)))
    scaling = kv("rope.scaling.factor") or kv("rope.scale_linear")
    if scaling and float(scaling) != 1.0:
        raise SystemExit("torch half: rope scaling is not implemented")
    tensors = {}
    for t in r.tensors:
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            raise SystemExit(f"torch half: tensor {t.name} is {t.tensor_type.name}; only F32 trains")
        tensors[t.name] = np.array(t.data, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)])
    hp["n_vocab"] = tensors["token_embd.weight"].shape[0]
    return hp, tensors


def _rope_table(n_ctx: int, n_rot: int, freq_base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [n_ctx, n_rot/2] in ggml's float32 order: theta_i = p * theta_scale^i, iterated."""
    theta_scale = np.float32(freq_base) ** np.float32(-2.0 / n_rot)
    cos = np.empty((n_ctx, n_rot // 2), np.float32)
    sin = np.empty_like(cos)
    theta = np.arange(n_ctx, dtype=np.float32)
    for i in range(n_rot // 2):
        cos[:, i] = np.cos(theta.astype(np.float64)).astype(np.float32)
        sin[:, i] = np.sin(theta.astype(np.float64)).astype(np.float32)
        theta = (theta * theta_scale).astype(np.float32)
    return cos, sin


def _torch_llama(hp: dict, tensors: dict, n_ctx: int):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            # one Parameter per GGUF tensor, under its GGUF name ('.' is not allowed in keys)
            self.p = nn.ParameterDict({k.replace(".", "/"): nn.Parameter(torch.from_numpy(v.copy()))
                                       for k, v in tensors.items()})
            cos, sin = _rope_table(n_ctx, hp["n_rot"], hp["freq_base"])
            self.register_buffer("cos", torch.from_numpy(cos)[None, :, None, :], persistent=False)
            self.register_buffer("sin", torch.from_numpy(sin)[None, :, None, :], persistent=False)

        def w(self, name):
            return self.p[name.replace(".", "/")]

        def rope(self, x):  # x: [B, T, H, D]; ggml NORM mode: pairs (2k, 2k+1) of the first n_rot
            T, n_rot = x.shape[1], hp["n_rot"]
            xr = x[..., :n_rot].unflatten(-1, (n_rot // 2, 2))
            a, b = xr[..., 0], xr[..., 1]
            c, s = self.cos[:, :T], self.sin[:, :T]
            out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
            return out if n_rot == x.shape[-1] else torch.cat((out, x[..., n_rot:]), dim=-1)

        def forward(self, tokens):  # tokens: [B, T] int64 -> logits [B, T, V]
            B, T = tokens.shape
            H, Hkv, D, eps = hp["n_head"], hp["n_head_kv"], hp["head_dim"], hp["eps"]
            x = F.embedding(tokens, self.w("token_embd.weight"))
            for il in range(hp["n_layer"]):
                blk = f"blk.{il}."
                cur = F.rms_norm(x, (hp["n_embd"],), self.w(blk + "attn_norm.weight"), eps)
                q = F.linear(cur, self.w(blk + "attn_q.weight")).view(B, T, H, D)
                k = F.linear(cur, self.w(blk + "attn_k.weight")).view(B, T, Hkv, D)
                v = F.linear(cur, self.w(blk + "attn_v.weight")).view(B, T, Hkv, D)
                q, k = self.rope(q), self.rope(k)
                att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                     is_causal=True, scale=1.0 / math.sqrt(D),
                                                     enable_gqa=Hkv != H)
                cur = F.linear(att.transpose(1, 2).reshape(B, T, H * D), self.w(blk + "attn_output.weight"))
                x = x + cur
                cur = F.rms_norm(x, (hp["n_embd"],), self.w(blk + "ffn_norm.weight"), eps)
                gate = F.linear(cur, self.w(blk + "ffn_gate.weight"))
                up = F.linear(cur, self.w(blk + "ffn_up.weight"))
                x = x + F.linear(F.silu(gate) * up, self.w(blk + "ffn_down.weight"))
            x = F.rms_norm(x, (hp["n_embd"],), self.w("output_norm.weight"), eps)
            out = self.w("output.weight") if "output.weight" in tensors else self.w("token_embd.weight")
            return F.linear(x, out)

        def named_gguf_arrays(self):
            return {k.replace("/", "."): v.detach().numpy() for k, v in self.p.items()}

    return Llama()


def torch_half(args) -> None:
    threads = args.threads
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(threads)
    hp, tensors = _gguf_model(args.init_path)
    data = np.load(args.data)
    tokens = torch.from_numpy(data["tokens"].astype(np.int64))
    labels = torch.from_numpy(data["labels"].astype(np.int64))
    n_ctx = tokens.shape[1]
    model = _torch_llama(hp, tensors, n_ctx)
    out = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    if args.half == "torch-logits":
        with torch.no_grad():
            logits = model(tokens[:1])[0].numpy()
        np.save(args.out_prefix + ".logits.npy", logits)
        Path(args.out_prefix + ".json").write_text(json.dumps(out))
        return
    cfg = json.loads(str(data["config"]))
    orders = data["orders"]
    wps, idata_split = cfg["windows_per_step"], cfg["idata_split"]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(cfg["beta1"], cfg["beta2"]), eps=cfg["eps"],
                            weight_decay=cfg["wd"], fused=args.torch_fused or None)
    fwd = torch.compile(model) if args.torch_compile else model  # compiled on the first step (start-up)
    step_losses, step_seconds, val_losses = [], [], []
    t_fit = time.perf_counter()
    for epoch in range(cfg["epochs"]):
        order = torch.from_numpy(orders[epoch].astype(np.int64))
        for s in range(len(order) // wps):
            t0 = time.perf_counter()
            idx = order[s * wps:(s + 1) * wps]
            logits = fwd(tokens[idx])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[idx].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step_losses.append(float(loss.detach()))
            step_seconds.append(time.perf_counter() - t0)
        if idata_split < len(tokens):
            with torch.no_grad():
                for i in range(idata_split, len(tokens)):
                    lg = model(tokens[i:i + 1])
                    val_losses.append(float(F.cross_entropy(lg.reshape(-1, lg.shape[-1]), labels[i])))
    wall = time.perf_counter() - t_fit
    np.savez(args.out_prefix + ".weights.npz", **model.named_gguf_arrays())
    timed = step_seconds[1:]
    out.update(step_losses=step_losses, val_loss=float(np.mean(val_losses)) if val_losses else None,
               train_tokens=len(step_losses) * wps * n_ctx, wall_seconds=wall,
               startup_seconds=step_seconds[0] if step_seconds else None,
               tokens_per_second=len(timed) * wps * n_ctx / sum(timed) if timed else float("nan"),
               fused=bool(args.torch_fused), compiled=bool(args.torch_compile))
    Path(args.out_prefix + ".json").write_text(json.dumps(out))


# ================================================================================================
# the llamapy half and the driver (run in llamapy's Python)
# ================================================================================================
def _train_params(cfg: dict):
    from llamapy.train_params import AdamW, LRSchedule, TrainParams
    return TrainParams(schedule=LRSchedule(lr0=cfg["lr"], epochs=cfg["epochs"]),
                       optimizer=AdamW(beta1=cfg["beta1"], beta2=cfg["beta2"], eps=cfg["eps"], wd=cfg["wd"]),
                       window_bos=cfg["window_bos"])


def llamapy_half(args) -> None:
    from llamapy import Context, load_model, save_model_to_file
    from llamapy.dataset import TokenWindows
    data = np.load(args.data)
    cfg = json.loads(str(data["config"]))
    m = load_model(args.init_path)
    tokens, labels, orders = data["tokens"], data["labels"], data["orders"]
    ds = TokenWindows(cfg["n_tokens"], cfg["n_ctx"], cfg["stride"], len(tokens))
    ds.data[:], ds.labels[:] = tokens, labels
    ctx = Context(m, n_ctx=cfg["n_ctx"], n_batch=cfg["n_batch"], n_ubatch=cfg["n_ubatch"], n_threads=args.threads)
    ctx.opt_init(_train_params(cfg))
    used = []
    t0 = time.perf_counter()
    history = ctx.opt_fit(ds, epochs=cfg["epochs"], val_split=cfg["val_split"], seed=cfg["seed"], silent=True,
                          on_epoch=lambda _: used.append(ds.permutation[: orders.shape[1]].copy()))
    wall = time.perf_counter() - t0
    if not np.array_equal(np.stack(used), orders):
        raise SystemExit("llamapy half: opt_fit used another window order than the one given to torch")
    save_model_to_file(m, args.out_prefix + ".gguf")
    timing = ctx.trainer.timing
    steps = [x for h in history for x in h.train.steps]
    val = history[-1].val.loss()[0] if history[-1].val.losses else None
    Path(args.out_prefix + ".json").write_text(json.dumps(dict(
        step_losses=steps, val_loss=val, train_tokens=len(steps) * cfg["n_batch"], wall_seconds=wall,
        startup_seconds=timing.startup_seconds, tokens_per_second=timing.tokens_per_second,
        threads=args.threads)))


def _llamapy_logits(init_path: str, tokens: np.ndarray, threads: int, exact: bool) -> np.ndarray:
    """llamapy's logits of every token of one window (exact: F32 KV cache, attention unfused)."""
    from ggmlpy import GGMLType
    from llamapy import Batch, Context, load_model
    m = load_model(init_path)
    n = len(tokens)
    kw = dict(type_k=GGMLType.F32, type_v=GGMLType.F32, flash_attn=False) if exact else {}
    ctx = Context(m, n_ctx=n, n_batch=n, n_ubatch=n, n_threads=threads, **kw)
    ctx.decode(Batch.from_tokens(tokens, all_outputs=True))
    return np.array(ctx.get_logits())


def _weights_to_gguf(init_path: str, weights_npz: str, out_path: str) -> None:
    """The initial model with the torch half's trained tensors, written by llamapy's saver."""
    from llamapy import load_model, save_model_to_file
    m = load_model(init_path)
    w = np.load(weights_npz)
    if set(w.files) != set(m.tensors):
        raise SystemExit(f"torch weights {sorted(set(w.files) ^ set(m.tensors))[:4]} do not match the model's tensors")
    for name, t in m.tensors.items():
        arr = np.ascontiguousarray(w[name], dtype=np.float32)
        if arr.size != t.nelements():
            raise SystemExit(f"torch weight {name}: {arr.size} values, the model has {t.nelements()}")
        t.bind(arr.reshape(-1).view(np.uint8).copy())
    save_model_to_file(m, out_path)


def _weight_diff(path_a: str, path_b: str, path_init: str) -> tuple[float, str]:
    """How far apart two trainings of the same init ended, per tensor: |A - B| / |B - init|
    (Frobenius norms: the disagreement relative to how far training moved the tensor); the
    largest and the tensor where it is."""
    from llamapy import load_model
    a, b, init = load_model(path_a), load_model(path_b), load_model(path_init)
    worst = (0.0, "")
    for name, t in a.tensors.items():
        x, y, x0 = t.numpy(), b.tensors[name].numpy(), init.tensors[name].numpy()
        moved = float(np.linalg.norm(y - x0))
        worst = max(worst, (float(np.linalg.norm(x - y)) / max(moved, 1e-30), name))
    return worst


def _perplexity(model_path: str, text_path: str, n_ctx: int, threads: int) -> tuple[float, float]:
    r = subprocess.run([sys.executable, "-m", "llamapy.cli.perplexity", "-m", model_path, "-f", text_path, "-c", str(n_ctx),
                        "-t", str(threads)], capture_output=True, text=True, cwd=ROOT)
    hit = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", r.stderr)
    if r.returncode or not hit:
        raise SystemExit(f"llamapy-perplexity failed on {model_path}:\n{r.stderr[-2000:]}")
    return float(hit.group(1)), float(hit.group(2))


def _make_init(args, work: Path) -> str:
    """The initial GGUF: --init as it is, or a new model of the issue's shape (llamapy.new_model)."""
    if args.embd is None:
        return str(args.init)
    import llamapy
    new_model = getattr(llamapy, "new_model", None)
    if new_model is None:
        raise SystemExit("--embd/--head/--layer/--ff need llamapy.new_model, which this llamapy does not have yet; "
                         "use --init GGUF")
    from llamapy import save_model_to_file
    m = new_model(arch="llama", vocab_from=str(args.init), n_embd=args.embd, n_head=args.head, n_layer=args.layer,
                  n_ff=args.ff, n_ctx_train=args.ctx, seed=args.seed)
    path = work / "init.gguf"
    save_model_to_file(m, path)
    return str(path)


def _prepare_data(args, init_path: str, work: Path) -> tuple[dict, Path, Path]:
    """Split the text (train: the first 90%, held out: the rest, cut at a line start), make
    the training windows and every epoch's window order; write them for both halves."""
    from llamapy import load_model
    from llamapy.dataset import validation_windows
    from llamapy.dataset import text_windows
    text = Path(args.file).read_text(encoding="utf-8", errors="replace")
    if args.chars:
        text = text[: args.chars]
    cut = int(len(text) * (1.0 - args.heldout))
    line = text.rfind("\n", 0, cut)
    cut = line + 1 if line > 0 else cut
    train_text, heldout = text[:cut], text[cut:]
    heldout_path = work / "heldout.txt"
    heldout_path.write_text(heldout, encoding="utf-8")
    m = load_model(init_path)
    window_bos = m.arch.bos_in_every_window
    ds = text_windows(m.vocab, train_text, args.ctx, window_bos)
    n_batch = args.batch or args.ctx
    if n_batch % args.ctx:
        raise SystemExit("-b must be a multiple of -c (whole windows per step)")
    wps = n_batch // args.ctx
    idata_split = ds.ndata - validation_windows(ds.ndata, args.val_split)
    n_train = idata_split - idata_split % wps
    if n_train < 2 * wps:
        raise SystemExit(f"the training text gives {idata_split} training windows: too few for two steps of {wps}")
    perm, rng, orders = np.arange(ds.ndata), np.random.default_rng(args.seed), []
    for _ in range(args.epochs):  # ggmlpy's TrainingLoop.run: Dataset.shuffle(rng, idata_split) each epoch
        rng.shuffle(perm[:idata_split])
        orders.append(perm[:n_train].copy())
    cfg = dict(n_ctx=args.ctx, n_batch=n_batch, n_ubatch=min(args.ubatch or args.ctx, args.ctx),
               windows_per_step=wps, idata_split=int(idata_split), val_split=args.val_split, seed=args.seed,
               epochs=args.epochs, lr=args.lr, beta1=args.beta1, beta2=args.beta2, eps=args.adam_eps, wd=args.wd,
               window_bos=bool(window_bos), n_tokens=int(ds.n_tokens), stride=int(ds.stride),
               train_chars=len(train_text), heldout_chars=len(heldout), windows=int(ds.ndata))
    data_path = work / "data.npz"
    np.savez(data_path, tokens=ds.data, labels=ds.labels, orders=np.stack(orders), config=json.dumps(cfg))
    return cfg, data_path, heldout_path


def _run_half(which: str, args, init_path: str, data_path: Path, prefix: Path, compile_torch: bool = False) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               OPENBLAS_NUM_THREADS=str(args.threads))
    py = sys.executable if which == "llamapy" else args.torch_python
    cmd = [py, str(Path(__file__).resolve()), "--half", which, "--init-path", init_path, "--data", str(data_path),
           "--out-prefix", str(prefix), "-t", str(args.threads)] + (["--torch-fused"] if args.torch_fused else []) \
        + (["--torch-compile"] if args.torch_compile or compile_torch else [])
    if which != "llamapy":
        env.pop("PYTHONPATH", None)  # the torch venv must not pick up llamapy or its numpy
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode:
        raise SystemExit(f"{which} half failed:\n{r.stdout[-1000:]}\n{r.stderr[-3000:]}")
    res = json.loads(Path(str(prefix) + ".json").read_text())
    res["process_seconds"] = time.perf_counter() - t0
    return res


def _load_average() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def check(args, work: Path) -> None:
    """Forward logits of one window: the torch llama against llamapy (F32 KV, unfused; and defaults)."""
    from llamapy import load_model
    from llamapy.dataset import text_windows
    init_path = _make_init(args, work)
    m = load_model(init_path)
    text = Path(args.file).read_text(encoding="utf-8", errors="replace")[:20_000]
    ds = text_windows(m.vocab, text, args.ctx, m.arch.bos_in_every_window)
    data_path = work / "check.npz"
    np.savez(data_path, tokens=ds.data[:1], labels=ds.labels[:1], orders=np.zeros((1, 1), np.int64),
             config=json.dumps({}))
    prefix = work / "check-torch"
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    env.pop("PYTHONPATH", None)
    r = subprocess.run([args.torch_python, str(Path(__file__).resolve()), "--half", "torch-logits", "--init-path",
                        init_path, "--data", str(data_path), "--out-prefix", str(prefix), "-t", str(args.threads)],
                       capture_output=True, text=True, env=env)
    if r.returncode:
        raise SystemExit(f"torch half failed:\n{r.stderr[-3000:]}")
    theirs = np.load(str(prefix) + ".logits.npy")
    worst = 0.0
    for exact in (True, False):
        ours = _llamapy_logits(init_path, ds.data[0], args.threads, exact)
        diff = np.abs(ours - theirs)
        rel = diff.max() / np.abs(theirs).max()
        label = "F32 KV cache, attention unfused" if exact else "defaults (F16 KV cache, flash attention)"
        print(f"check: {Path(init_path).name}, one window of {args.ctx} tokens, llamapy ({label}) vs torch: "
              f"max |logit diff| {diff.max():.3g}, relative to max |logit| {rel:.3g}, "
              f"argmax agreement {np.mean(ours.argmax(1) == theirs.argmax(1)):.4f}")
        if exact:
            worst = rel
    print(f"check: {'PASS' if worst <= 1e-4 else 'FAIL'} (relative max diff {worst:.3g}, target 1e-4)")
    if worst > 1e-4:
        sys.exit(1)


def bench(args, work: Path) -> None:
    init_path = _make_init(args, work)
    cfg, data_path, heldout_path = _prepare_data(args, init_path, work)
    print(f"data: {args.file} ({cfg['train_chars']} chars for training, last {cfg['heldout_chars']} held out), "
          f"{cfg['windows']} windows of {cfg['n_ctx']} (stride {cfg['stride']}), {cfg['idata_split']} trained on, "
          f"{cfg['windows_per_step']} per step, {cfg['epochs']} epochs; init {init_path}")
    print(f"optimizer: AdamW lr {cfg['lr']:g} betas ({cfg['beta1']:g}, {cfg['beta2']:g}) eps {cfg['eps']:g} "
          f"wd {cfg['wd']:g}; seed {cfg['seed']}; -t {args.threads}; load average before: {_load_average()}")
    runs = {"llamapy": [], "torch": []}
    for rep in range(args.repeat):
        order = ("llamapy", "torch") if rep % 2 == 0 else ("torch", "llamapy")
        for which in order:
            res = _run_half(which, args, init_path, data_path, work / f"{which}-{rep}")
            runs[which].append(res)
            print(f"run {rep + 1} {which:8s}: {res['tokens_per_second']:8.0f} training tokens/s "
                  f"(start-up {res['startup_seconds']:.2f} s), fit wall {res['wall_seconds']:.1f} s, "
                  f"process {res['process_seconds']:.1f} s, final step loss {res['step_losses'][-1]:.4f}"
                  + (f", val loss {res['val_loss']:.4f}" if res["val_loss"] is not None else "")
                  + f"; load average {_load_average()}", flush=True)
    # the same evaluator on both trained models (the first run of each: every run trains the same)
    _weights_to_gguf(init_path, str(work / "torch-0.weights.npz"), str(work / "torch-0.gguf"))
    ppl = {w: _perplexity(str(work / f"{w}-0.gguf"), str(heldout_path), cfg["n_ctx"], args.threads)
           for w in ("llamapy", "torch")}
    ppl_init = _perplexity(init_path, str(heldout_path), cfg["n_ctx"], args.threads)
    floor = None
    if args.noise_floor:  # torch against itself: the same training with other float rounding
        ref = _run_half("torch", args, init_path, data_path, work / "torch-ref", compile_torch=not args.torch_compile)
        _weights_to_gguf(init_path, str(work / "torch-ref.weights.npz"), str(work / "torch-ref.gguf"))
        ref_ppl = _perplexity(str(work / "torch-ref.gguf"), str(heldout_path), cfg["n_ctx"], args.threads)
        r = np.abs(np.asarray(ref["step_losses"]) - np.asarray(runs["torch"][0]["step_losses"]))
        floor = dict(ppl=ref_ppl, ratio=ref_ppl[0] / ppl["torch"][0], max_step_loss_diff=float(r.max()),
                     mean_step_loss_diff_last_third=float(r[-len(r) // 3:].mean()))
    wdiff, wname = _weight_diff(str(work / "llamapy-0.gguf"), str(work / "torch-0.gguf"), init_path)
    a, b = runs["llamapy"][0]["step_losses"], runs["torch"][0]["step_losses"]
    d = np.abs(np.asarray(a) - np.asarray(b))
    best = {w: max(r["tokens_per_second"] for r in runs[w]) for w in runs}
    wall = {w: min(r["wall_seconds"] for r in runs[w]) for w in runs}
    ppl_ratio = ppl["llamapy"][0] / ppl["torch"][0]
    torch_kind = ("compiled" if args.torch_compile else "eager") + (", fused AdamW" if args.torch_fused else "")
    speed_ratio = best["llamapy"] / best["torch"]
    print(f"step losses, llamapy vs torch: first {a[0]:.4f} / {b[0]:.4f}, last {a[-1]:.4f} / {b[-1]:.4f}, "
          f"max |diff| {d.max():.4f} over {len(d)} steps (first 10: {d[:10].max():.2g}); trained weights: |llamapy - torch| "
          f"/ |torch - init| at most {wdiff:.3g} ({wname})")
    print(f"  mean |step loss diff| over the last third: {d[-len(d) // 3:].mean():.4f}")
    print(f"held-out perplexity (llamapy-perplexity -c {cfg['n_ctx']}, {heldout_path.name}): "
          f"initial {ppl_init[0]:.4f}, llamapy {ppl['llamapy'][0]:.4f} +/- {ppl['llamapy'][1]:.4f}, "
          f"torch {ppl['torch'][0]:.4f} +/- {ppl['torch'][1]:.4f}; ratio {ppl_ratio:.4f} "
          f"({'within' if abs(ppl_ratio - 1) <= 0.03 else 'NOT within'} 3%)")
    if floor:
        print(f"noise floor: torch {'eager' if args.torch_compile else 'compiled'} (other rounding) against torch: "
              f"held-out perplexity {floor['ppl'][0]:.4f} (ratio {floor['ratio']:.4f}), step losses max |diff| "
              f"{floor['max_step_loss_diff']:.4f}, mean over the last third {floor['mean_step_loss_diff_last_third']:.4f}")
    print(f"training speed (best of {args.repeat}, -t {args.threads}): llamapy {best['llamapy']:.0f} tokens/s, "
          f"torch {runs['torch'][0]['torch']} ({torch_kind}) {best['torch']:.0f} tokens/s; ratio {speed_ratio:.2f}x "
          f"({'meets' if speed_ratio >= 1.5 else 'below'} 1.5x); fit wall time llamapy {wall['llamapy']:.1f} s, "
          f"torch {wall['torch']:.1f} s")
    cmd = "python bench/scratch_vs_torch.py " + " ".join(sys.argv[1:])
    if args.json:
        args.json.write_text(json.dumps(dict(
            date=str(datetime.date.today()), command=cmd, machine=platform.machine(), cpus=os.cpu_count(),
            load_average=_load_average(), config=cfg, init=init_path, ppl=ppl, ppl_init=ppl_init, ppl_ratio=ppl_ratio,
            tokens_per_second=best, speed_ratio=speed_ratio, fit_wall_seconds=wall, max_step_loss_diff=float(d.max()),
            max_weight_rel_diff=wdiff, noise_floor=floor, runs=runs), indent=1))
    print("RESULTS.md row:")
    print(f"| {datetime.date.today()} | {platform.machine()}, {os.cpu_count()} cores, load avg {_load_average()} "
          f"| `{cmd}` | {cfg['windows_per_step'] * cfg['n_ctx']} tok/step, {len(a)} steps "
          f"| {ppl['llamapy'][0]:.3f} / {ppl['torch'][0]:.3f} = {ppl_ratio:.3f} "
          f"| {best['llamapy']:.0f} / {best['torch']:.0f} = {speed_ratio:.2f}x "
          f"| {wall['llamapy']:.1f} / {wall['torch']:.1f} s |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--init", type=Path, default=SHARED / "models" / "stories260K.gguf",
                    help="initial GGUF (or, with --embd, the model whose vocabulary the new model takes)")
    ap.add_argument("--embd", type=int, help="create the initial model with llamapy.new_model: n_embd")
    ap.add_argument("--head", type=int, default=8)
    ap.add_argument("--layer", type=int, default=6)
    ap.add_argument("--ff", type=int, default=384)
    ap.add_argument("-f", "--file", default=str(SHARED / "data" / "tinystories_sample.txt"))
    ap.add_argument("--chars", type=int, default=0, help="use only the first N characters of the text (0: all)")
    ap.add_argument("--heldout", type=float, default=0.1, help="fraction of the text held out (at its end)")
    ap.add_argument("-c", "--ctx", type=int, default=128)
    ap.add_argument("-b", "--batch", type=int, default=0, help="tokens per optimizer step (default -c)")
    ap.add_argument("-ub", "--ubatch", type=int, default=0, help="llamapy's ubatch (default -c)")
    ap.add_argument("-lr", "--lr", type=float, default=1e-3)
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.999)
    ap.add_argument("--adam-eps", type=float, default=1e-8)
    ap.add_argument("-wd", "--wd", type=float, default=0.0)
    ap.add_argument("--val-split", type=float, default=0.0,
                    help="fraction of the training windows opt_fit holds out for a val loss (default none)")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1, help="runs of each half, alternating which goes first")
    ap.add_argument("--torch-python", default=DEFAULT_TORCH_PYTHON)
    ap.add_argument("--torch-fused", action="store_true", help="torch.optim.AdamW(fused=True)")
    ap.add_argument("--torch-compile", action="store_true",
                    help="torch.compile the model (not the default: the comparison is with eager PyTorch)")
    ap.add_argument("--noise-floor", action="store_true",
                    help="also train torch once more with other rounding (compiled if the runs are eager, and the "
                         "reverse) and report how far its perplexity and losses are from torch's own")
    ap.add_argument("--check", action="store_true", help="only compare forward logits on one window")
    ap.add_argument("--json", type=Path, help="also write the summary and every run's numbers here")
    ap.add_argument("--work", type=Path, help="keep the files here (default: a temporary directory)")
    # internal: one half of the bench
    ap.add_argument("--half", choices=("llamapy", "torch", "torch-logits"), help=argparse.SUPPRESS)
    ap.add_argument("--init-path", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--out-prefix", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.half == "llamapy":
        return llamapy_half(args)
    if args.half:
        return torch_half(args)
    if not Path(args.torch_python).exists():
        raise SystemExit(f"no PyTorch at {args.torch_python}: python -m venv /work/torchvenv && "
                         "/work/torchvenv/bin/pip install torch numpy gguf sentencepiece")
    if args.work:
        args.work.mkdir(parents=True, exist_ok=True)
        (check if args.check else bench)(args, args.work)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            (check if args.check else bench)(args, Path(tmp))


if __name__ == "__main__":
    main()
