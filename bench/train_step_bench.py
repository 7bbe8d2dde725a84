"""One training step (forward + backward + AdamW) in ggmlpy and in PyTorch, CPU, float32.

Run by hand (not in CI):

    python bench/train_step_bench.py                       # both models, 1 and 2 threads, 3 rounds
    python bench/train_step_bench.py --rounds 5 --steps 30
    python bench/train_step_bench.py --profile             # also ggmlpy seconds per op (1 thread)

Models (same initial weights and data in both frameworks, from one numpy seed):
  mlp    784-256-10 on a batch of 128, tanh-GELU hidden layer, cross_entropy_loss on one-hot labels
  block  one llama block: n_embd 512, 8 heads of 64, ffn 1408, 128 tokens: rms_norm, q/k/v/o,
         NEOX rope, causal soft_max_ext attention, SwiGLU FFN, residuals, then rms_norm and a
         256-way head with cross_entropy_loss (every weight trains)

ggmlpy: the graph (forward, build_backward_expand, one opt_step_adamw per param) is built and
allocated once, then `CpuBackend(n).compute(graph)` runs each step after the 7 AdamW floats
(alpha, beta1, beta2, eps, wd, beta1h, beta2h) are written into the params tensor.
PyTorch: zero_grad, forward, backward, torch.optim.AdamW.step, torch.set_num_threads(n).

Each (framework, model, threads) runs in a fresh subprocess (so numba's OpenMP settings and
torch's do not meet in one process); rounds interleave them so that machine load hits all
alike. Reported: the best over rounds of the median ms/step, with the load average. The
step-0 losses of both frameworks are printed side by side as a sanity check.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

import numpy as np

LR, BETA1, BETA2, EPS, WD = 1e-3, 0.9, 0.999, 1e-8, 0.01
RMS_EPS = 1e-5


# ---- shared data: weights in ggml/torch layout (numpy shape = (out, in) = torch Linear.weight) --------
def mlp_data(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    n_in, n_hidden, n_out, batch = 784, 256, 10, 128
    d = {
        "w1": (rng.standard_normal((n_hidden, n_in)) / math.sqrt(n_in)).astype(np.float32),
        "b1": np.zeros(n_hidden, np.float32),
        "w2": (rng.standard_normal((n_out, n_hidden)) / math.sqrt(n_hidden)).astype(np.float32),
        "b2": np.zeros(n_out, np.float32),
        "x": rng.uniform(0.0, 1.0, (batch, n_in)).astype(np.float32),
    }
    d["target"] = rng.integers(0, n_out, batch)
    return d


BLOCK = dict(n_embd=512, n_head=8, n_ff=1408, n_tokens=128, n_vocab=256, rope_base=10000.0)


def block_data(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    e, f, v, n = BLOCK["n_embd"], BLOCK["n_ff"], BLOCK["n_vocab"], BLOCK["n_tokens"]

    def lin(n_out, n_in):
        return (rng.standard_normal((n_out, n_in)) / math.sqrt(n_in)).astype(np.float32)
    d = {"attn_norm": np.ones(e, np.float32), "wq": lin(e, e), "wk": lin(e, e), "wv": lin(e, e), "wo": lin(e, e),
         "ffn_norm": np.ones(e, np.float32), "w_gate": lin(f, e), "w_up": lin(f, e), "w_down": lin(e, f),
         "out_norm": np.ones(e, np.float32), "w_out": lin(v, e),
         "x": rng.standard_normal((n, e)).astype(np.float32)}
    d["target"] = rng.integers(0, v, n)
    return d


PARAMS = {"mlp": ["w1", "b1", "w2", "b2"],
          "block": ["attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down", "out_norm", "w_out"]}
DATA = {"mlp": mlp_data, "block": block_data}


def adamw_floats(t: int) -> np.ndarray:
    return np.array([LR, BETA1, BETA2, EPS, WD, 1.0 / (1.0 - BETA1 ** t), 1.0 / (1.0 - BETA2 ** t)], np.float32)


def one_hot(target: np.ndarray, n: int) -> np.ndarray:
    y = np.zeros((len(target), n), np.float32)
    y[np.arange(len(target)), target] = 1.0
    return y


# ---- ggmlpy ------------------------------------------------------------------------------------------------
def ggml_build(model: str):
    import ggmlpy as gg

    d = DATA[model]()
    ctx = gg.Context()
    p = {k: ctx.from_numpy(d[k], name=k).set_param() for k in PARAMS[model]}
    if model == "mlp":
        x = ctx.from_numpy(d["x"], name="x")
        h = gg.gelu(ctx, gg.add(ctx, gg.mul_mat(ctx, p["w1"], x), p["b1"]))
        logits = gg.add(ctx, gg.mul_mat(ctx, p["w2"], h), p["b2"])
        labels = ctx.from_numpy(one_hot(d["target"], 10), name="labels")
    else:
        e, nh, n, v = BLOCK["n_embd"], BLOCK["n_head"], BLOCK["n_tokens"], BLOCK["n_vocab"]
        hd = e // nh
        x = ctx.from_numpy(d["x"], name="x")
        pos = ctx.from_numpy(np.arange(n, dtype=np.int32), gg.GGMLType.I32, name="pos")
        mask = ctx.from_numpy(np.triu(np.full((n, n), -np.inf, np.float32), 1), name="mask")

        def norm(t, w):
            return gg.mul(ctx, gg.rms_norm(ctx, t, RMS_EPS), w)

        def rope(t):
            return gg.rope_ext(ctx, gg.reshape(ctx, t, hd, nh, n), pos, None, hd, gg.ROPE_TYPE_NEOX, n,
                               BLOCK["rope_base"], 1.0)
        cur = norm(x, p["attn_norm"])
        q = rope(gg.mul_mat(ctx, p["wq"], cur))
        k = rope(gg.mul_mat(ctx, p["wk"], cur))
        vv = gg.reshape(ctx, gg.mul_mat(ctx, p["wv"], cur), hd, nh, n)
        kq = gg.mul_mat(ctx, gg.permute(ctx, k, 0, 2, 1, 3), gg.permute(ctx, q, 0, 2, 1, 3))  # [n_kv, n_q, nh]
        kq = gg.soft_max_ext(ctx, kq, mask, 1.0 / math.sqrt(hd))
        vt = gg.cont(ctx, gg.permute(ctx, vv, 1, 2, 0, 3))                                      # [n_kv, hd, nh]
        kqv = gg.mul_mat(ctx, vt, kq)                                                           # [hd, n_q, nh]
        attn = gg.cont(ctx, gg.permute(ctx, kqv, 0, 2, 1, 3), e, n)
        x1 = gg.add(ctx, x, gg.mul_mat(ctx, p["wo"], attn))
        cur = norm(x1, p["ffn_norm"])
        ffn = gg.swiglu_split(ctx, gg.mul_mat(ctx, p["w_gate"], cur), gg.mul_mat(ctx, p["w_up"], cur))
        x2 = gg.add(ctx, x1, gg.mul_mat(ctx, p["w_down"], ffn))
        logits = gg.mul_mat(ctx, p["w_out"], norm(x2, p["out_norm"]))
        labels = ctx.from_numpy(one_hot(d["target"], v), name="labels")
    loss = gg.cross_entropy_loss(ctx, logits, labels).set_loss().set_output()
    graph = gg.new_graph(loss)
    gg.build_backward_expand(ctx, graph)
    hp = ctx.from_numpy(adamw_floats(1), name="adamw params")
    for name, w in p.items():
        m = ctx.from_numpy(np.zeros_like(d[name]), name=f"{name} m")
        v_ = ctx.from_numpy(np.zeros_like(d[name]), name=f"{name} v")
        gg.build_forward_expand(graph, gg.opt_step_adamw(ctx, w, graph.get_grad(w), m, v_, hp))
    gg.GraphAllocator().alloc_graph(graph)
    return graph, loss, hp


def ggml_worker(model: str, threads: int, steps: int, warmup: int, profile: bool) -> dict:
    import ggmlpy as gg

    graph, loss, hp = ggml_build(model)
    backend = gg.CpuBackend(threads)
    prof = backend.enable_profile() if profile else None
    times, losses = [], []
    for t in range(1, warmup + steps + 1):
        hp.array()[...] = adamw_floats(t)
        t0 = time.perf_counter()
        backend.compute(graph)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.array().reshape(-1)[0]))
        if prof is not None and t == warmup:
            prof.clear()
    out = {"ms": [1e3 * s for s in times[warmup:]], "losses": losses, "n_nodes": len(graph.nodes)}
    if prof is not None:
        out["profile_ms_per_step"] = {k: 1e3 * s / steps for k, s in sorted(prof.items(), key=lambda kv: -kv[1])}
    return out


# ---- PyTorch -----------------------------------------------------------------------------------------------
def torch_worker(model: str, threads: int, steps: int, warmup: int) -> dict:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    d = DATA[model]()
    p = {k: torch.nn.Parameter(torch.from_numpy(d[k].copy())) for k in PARAMS[model]}
    x = torch.from_numpy(d["x"])
    target = torch.from_numpy(d["target"])
    if model == "block":
        e, nh, n = BLOCK["n_embd"], BLOCK["n_head"], BLOCK["n_tokens"]
        hd = e // nh
        # NEOX rope with ggml's float32 angle recurrence: theta_k = p * base^(-2k/hd)
        theta_scale = np.float32(BLOCK["rope_base"]) ** (np.float32(-2.0) / np.float32(hd))
        theta = np.arange(n, dtype=np.float32)[:, None] * np.cumprod(
            np.concatenate([[np.float32(1.0)], np.full(hd // 2 - 1, theta_scale, np.float32)])).astype(np.float32)
        cos = torch.from_numpy(np.cos(theta).astype(np.float32))[:, None, :]   # (n, 1, hd/2)
        sin = torch.from_numpy(np.sin(theta).astype(np.float32))[:, None, :]
        mask = torch.triu(torch.full((n, n), float("-inf")), 1)

        def rms(t, w):
            return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + RMS_EPS) * w

        def rope(t):  # t: (n, nh, hd)
            a, b = t[..., :hd // 2], t[..., hd // 2:]
            return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    def forward():
        if model == "mlp":
            h = F.gelu(F.linear(x, p["w1"], p["b1"]), approximate="tanh")
            return F.cross_entropy(F.linear(h, p["w2"], p["b2"]), target)
        cur = rms(x, p["attn_norm"])
        q = rope((cur @ p["wq"].T).view(n, nh, hd)).transpose(0, 1)   # (nh, n, hd)
        k = rope((cur @ p["wk"].T).view(n, nh, hd)).transpose(0, 1)
        v = (cur @ p["wv"].T).view(n, nh, hd).transpose(0, 1)
        att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(hd) + mask, dim=-1)
        x1 = x + (att @ v).transpose(0, 1).reshape(n, e) @ p["wo"].T
        cur = rms(x1, p["ffn_norm"])
        x2 = x1 + (F.silu(cur @ p["w_gate"].T) * (cur @ p["w_up"].T)) @ p["w_down"].T
        return F.cross_entropy(rms(x2, p["out_norm"]) @ p["w_out"].T, target)

    opt = torch.optim.AdamW(p.values(), lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WD)
    times, losses = [], []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = forward()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    return {"ms": [1e3 * s for s in times[warmup:]], "losses": losses, "torch": torch.__version__}


# ---- driver -----------------------------------------------------------------------------------------------------
def run_worker(impl: str, model: str, threads: int, steps: int, warmup: int, profile: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--worker", impl, "--models", model, "--threads", str(threads),
           "--steps", str(steps), "--warmup", str(warmup)] + (["--profile"] if profile else [])
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{impl} {model} -t {threads} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def have_torch() -> bool:
    res = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, check=False)
    return res.returncode == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,block")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="ggmlpy seconds per op (a separate 1-thread run)")
    ap.add_argument("--worker", choices=["ggml", "torch"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    models = a.models.split(",")
    threads = [int(t) for t in a.threads.split(",")]

    if a.worker:
        fn = ggml_worker if a.worker == "ggml" else torch_worker
        kw = {"profile": a.profile} if a.worker == "ggml" else {}
        print(json.dumps(fn(models[0], threads[0], a.steps, a.warmup, **kw)))
        return

    impls = ["ggml"] + (["torch"] if have_torch() else [])
    if "torch" not in impls:
        print("torch is not importable: ggmlpy only")
    print(f"load average before: {os.getloadavg()}")
    best: dict[tuple, float] = {}
    loss0: dict[tuple, float] = {}
    loads = []
    for r in range(a.rounds):
        for model in models:
            for n in threads:
                for impl in impls:
                    out = run_worker(impl, model, n, a.steps, a.warmup)
                    med = statistics.median(out["ms"])
                    key = (model, n, impl)
                    best[key] = min(best.get(key, math.inf), med)
                    loss0[(model, impl)] = out["losses"][0]
                    print(f"round {r + 1} {model:5s} -t {n} {impl:5s}: median {med:8.2f} ms/step "
                          f"(min {min(out['ms']):.2f}), loss[0] {out['losses'][0]:.6f} loss[-1] {out['losses'][-1]:.6f}",
                          flush=True)
        loads.append(os.getloadavg()[0])
    print(f"\nload average (1 min) after each round: {', '.join(f'{x:.2f}' for x in loads)}")
    print("\n| model | threads | ggmlpy ms/step | torch ms/step | torch/ggmlpy |")
    print("|---|---|---|---|---|")
    for model in models:
        for n in threads:
            g = best[(model, n, "ggml")]
            t = best.get((model, n, "torch"))
            tcol = f"{t:.2f}" if t is not None else "-"
            ratio = f"{t / g:.2f}" if t is not None else "-"
            print(f"| {model} | {n} | {g:.2f} | {tcol} | {ratio} |")
    print()
    for model in models:
        lg, lt = loss0.get((model, "ggml")), loss0.get((model, "torch"))
        if lt is not None:
            print(f"{model}: step-0 loss ggmlpy {lg:.6f} torch {lt:.6f} (rel. diff {abs(lg - lt) / abs(lt):.2e})")
    if a.profile:
        for model in models:
            out = run_worker("ggml", model, 1, a.steps, a.warmup, profile=True)
            top = list(out["profile_ms_per_step"].items())[:10]
            total = sum(out["profile_ms_per_step"].values())
            print(f"\nggmlpy {model} -t 1 profile ({out['n_nodes']} nodes, {total:.2f} ms/step in ops): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in top))


if __name__ == "__main__":
    main()
