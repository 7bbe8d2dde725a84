"""A float64 numpy interpreter of ggmlpy graphs, for finite-difference gradient checks.

Every node is evaluated from ggml's definition of its op (the references of
test_ggml_ops.py), independently of ggmlpy's kernels. Views (view, reshape, permute,
transpose) are evaluated the way ggml stores them: a strided window, in elements, on
their base tensor's memory, so offsets and strides are checked too.
"""
from __future__ import annotations

import gguf
import numpy as np
from test_ggml_ops import (
    _gelu_ref,
    bcast_tile,
    mul_mat_ref,
    rope_angles,
    rope_ref,
    soft_max_ref,
)

import ggmlpy as gg
from ggmlpy import Op


def leaf_value(t: gg.Tensor) -> np.ndarray:
    if gg.traits(t.type).is_quantized:  # gguf's own numpy dequantizer, independent of ggmlpy's
        rows = np.ascontiguousarray(t.array()).reshape(-1, gg.row_size(t.type, t.ne[0]))
        values = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(int(t.type)))
        return values.astype(np.float64).reshape(t.ne[::-1])
    if t.type == gg.GGMLType.BF16:
        return (t.array().astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return np.array(t.array(), dtype=np.float64 if t.type in (gg.GGMLType.F32, gg.GGMLType.F16) else t.array().dtype)


def _tiles_sum(x: np.ndarray, small) -> np.ndarray:
    shape = []
    for big, n in zip(x.shape, small):
        shape += [big // n, n]
    return x.reshape(shape).sum(axis=(0, 2, 4, 6))


def _window(base_value: np.ndarray, base: gg.Tensor, t: gg.Tensor) -> np.ndarray:
    assert base.is_contiguous(), "reference views need a contiguous base"
    size = gg.traits(base.type).type_size
    flat = np.ascontiguousarray(base_value).reshape(-1)
    strides = tuple(nb // size * flat.itemsize for nb in t.nb[::-1])
    return np.lib.stride_tricks.as_strided(flat[t.view_offs // size:], shape=t.ne[::-1], strides=strides, writeable=False)


def evaluate(outputs: list[gg.Tensor], overrides: dict[int, np.ndarray] | None = None) -> dict[int, np.ndarray]:
    """Values (float64, numpy shape ne3..ne0) of every tensor the outputs depend on."""
    graph = gg.new_graph(*outputs)
    values: dict[int, np.ndarray] = {}
    overrides = overrides or {}
    for t in graph.leafs:
        values[id(t)] = overrides.get(id(t), leaf_value(t) if t.buffer is not None else None)
    for node in graph.nodes:
        if id(node) in overrides:
            values[id(node)] = overrides[id(node)]
        elif node.op == Op.NONE:
            values[id(node)] = leaf_value(node)
        elif gg.OPS[node.op].kind is gg.OpKind.VIEW:
            values[id(node)] = _window(values[id(node.view_src)], node.view_src, node)
        else:
            values[id(node)] = _op(node, [values[id(s)] for s in node.src])
    return values


def _op(node: gg.Tensor, x: list[np.ndarray]) -> np.ndarray:
    op, p = node.op, node.op_params
    shape = node.ne[::-1]
    if op in (Op.ADD, Op.SUB, Op.MUL, Op.DIV):
        b = bcast_tile(x[1], x[0].shape)
        return {Op.ADD: np.add, Op.SUB: np.subtract, Op.MUL: np.multiply, Op.DIV: np.divide}[op](x[0], b)
    if op == Op.SCALE:
        return x[0] * np.float64(np.float32(p[0])) + p[1]
    if op in (Op.SQR, Op.SQRT, Op.LOG, Op.EXP):
        return {Op.SQR: np.square, Op.SQRT: np.sqrt, Op.LOG: np.log, Op.EXP: np.exp}[op](x[0])
    if op == Op.SILU:
        return x[0] / (1.0 + np.exp(-x[0]))
    if op == Op.GELU:
        return _gelu_ref(x[0])
    if op == Op.SWIGLU:
        return x[0] / (1.0 + np.exp(-x[0])) * x[1]
    if op == Op.GEGLU:
        return _gelu_ref(x[0]) * x[1]
    if op == Op.SUM:
        return np.full(shape, x[0].sum())
    if op == Op.SUM_ROWS:
        return x[0].sum(axis=-1, keepdims=True)
    if op == Op.MEAN:
        return x[0].mean(axis=-1, keepdims=True)
    if op == Op.REPEAT:
        return bcast_tile(x[0], shape)
    if op == Op.REPEAT_BACK:
        return _tiles_sum(x[0], shape)
    if op == Op.CONCAT:
        return np.concatenate(x, axis=3 - p[0])
    if op == Op.ACC:
        nb1, nb2, nb3, offset = p
        out = np.array(x[0], dtype=np.float64)
        win = gg.Tensor(gg.GGMLType.F32, node.src[1].ne, (4, nb1, nb2, nb3))
        flat = out.reshape(-1)
        strides = tuple(nb // 4 * 8 for nb in win.nb[::-1])
        view = np.lib.stride_tricks.as_strided(flat[offset // 4:], shape=win.ne[::-1], strides=strides)
        view += x[1]
        return out
    if op == Op.RMS_NORM:
        return x[0] / np.sqrt(np.mean(x[0] ** 2, axis=-1, keepdims=True) + p[0])
    if op == Op.NORM:
        c = x[0] - x[0].mean(axis=-1, keepdims=True)
        return c / np.sqrt(np.mean(c ** 2, axis=-1, keepdims=True) + p[0])
    if op == Op.MUL_MAT:
        return mul_mat_ref(x[0], x[1])[0]
    if op == Op.OUT_PROD:
        a, b = x
        r3, r2 = b.shape[0] // a.shape[0], b.shape[1] // a.shape[1]
        a_rep = np.repeat(np.repeat(a, r3, axis=0), r2, axis=1)
        return np.einsum("xyja,xyjb->xyba", a_rep, b)
    if op == Op.GET_ROWS:
        a, idx = x
        n12, n11, n10 = idx.shape[1:]
        out = np.empty(shape)
        for i12 in range(n12):
            for i11 in range(n11):
                out[i12, i11] = a[i12, i11, idx[0, i12, i11]]
        return out
    if op == Op.SOFT_MAX:
        mask = x[1][:, :, :x[0].shape[2]] if len(x) > 1 else None
        return soft_max_ref(x[0], mask, p[0], p[1])[0]
    if op == Op.ROPE:
        n_dims, mode, n_ctx_orig, base, fscale, ext, attn, beta_fast, beta_slow = p
        ff = x[2].reshape(-1) if len(x) > 2 else None
        pos = x[1].reshape(-1)
        cos, sin, mscale = rope_angles(pos, n_dims, n_ctx_orig, base, fscale, ext, attn, beta_fast, beta_slow, ff)
        return rope_ref(x[0], pos, n_dims, mode, cos, sin, mscale)[0]
    if op in (Op.CPY, Op.CONT, Op.DUP):
        return np.reshape(x[0], shape)
    if op == Op.CROSS_ENTROPY_LOSS:
        logits, labels = x[:2]
        if len(x) == 3:  # token ids and weights: the rows weights * onehot(ids)
            ids, weights = labels.reshape(-1), x[2].reshape(-1)
            labels = np.zeros(logits.shape).reshape(-1, logits.shape[-1])
            keep = ids >= 0
            labels[np.flatnonzero(keep), ids[keep].astype(np.int64)] = weights[keep]
            labels = labels.reshape(logits.shape)
        mx = logits.max(axis=-1, keepdims=True)
        log_softmax = logits - mx - np.log(np.exp(logits - mx).sum(axis=-1, keepdims=True))
        rows = -(labels * log_softmax).sum(axis=-1)
        return np.full(shape, rows.sum() / rows.size)
    if op == Op.LINEAR_CROSS_ENTROPY:
        return linear_cross_entropy_ref(*x).reshape(shape)
    raise NotImplementedError(f"reference for {op.name}")


def linear_cross_entropy_ref(w: np.ndarray, x: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """ggmlpy's linear_cross_entropy in float64 from the whole logits mul_mat(w, x): per row
    (weights * (lse - logit at the id), 0 where the id is negative; lse; first argmax)."""
    logits = mul_mat_ref(w, x)[0]
    flat = logits.reshape(-1, logits.shape[-1])
    ids, weights = ids.reshape(-1).astype(np.int64), weights.reshape(-1)
    mx = flat.max(axis=-1)
    lse = np.log(np.exp(flat - mx[:, None]).sum(axis=-1)) + mx
    target = flat[np.arange(flat.shape[0]), np.maximum(ids, 0)]
    loss = np.where(ids >= 0, weights * (lse - target), 0.0)
    return np.stack([loss, lse, flat.argmax(axis=-1).astype(np.float64)], axis=-1).reshape(logits.shape[:-1] + (3,))
