"""Writes tests/data/clip_grad_norm_torch.npz: random gradients and what PyTorch's
torch.nn.utils.clip_grad_norm_ makes of them, the reference test_schedules.py checks
llamapy's --grad-clip against. Run with a PyTorch venv (never a llamapy dependency):

    /work/torchvenv/bin/python bench/torch_clip_reference.py
"""
from pathlib import Path

import numpy as np
import torch

MAX_NORMS = (1.0, 50.0, 1e6)


def main() -> None:
    rng = np.random.default_rng(1234)
    grads = [rng.standard_normal((64, 33)).astype(np.float32) * 3,
             rng.standard_normal(70_001).astype(np.float32),
             rng.standard_normal((5,)).astype(np.float32) * 100]
    out = {"n": np.array(len(grads)), "max_norms": np.array(MAX_NORMS), "total_norms": []}
    for i, g in enumerate(grads):
        out[f"grad{i}"] = g
    for max_norm in MAX_NORMS:
        params = [torch.nn.Parameter(torch.zeros(g.shape)) for g in grads]
        for p, g in zip(params, grads):
            p.grad = torch.from_numpy(g.copy())
        total = torch.nn.utils.clip_grad_norm_(params, max_norm)
        out["total_norms"].append(float(total))
        for i, p in enumerate(params):
            out[f"clipped{i}_{max_norm:g}"] = p.grad.numpy().copy()
    out["total_norms"] = np.array(out["total_norms"])
    dest = Path(__file__).resolve().parent.parent / "tests" / "data" / "clip_grad_norm_torch.npz"
    np.savez_compressed(dest, **out)
    print(f"wrote {dest} (torch {torch.__version__}): total norms {out['total_norms']}")


if __name__ == "__main__":
    main()
