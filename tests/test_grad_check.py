"""Gradient checks in the spirit of ggml's test-backend-ops grad mode.

For each case, inputs are F32 params (some reached through non-contiguous views), the
loss is sum(out * W) with a fixed random W (a plain sum would hide errors that cancel,
e.g. softmax rows always sum to 1), ggmlpy computes the analytic gradient with
build_backward_expand, and central finite differences of the same graph evaluated in
float64 by an independent numpy interpreter (reference_graph.py) give the reference.
Error measure: max |analytic - fd| / max |fd| over the checked elements of each param.
"""
from __future__ import annotations

import numpy as np
import pytest
from reference_graph import evaluate

import ggmlpy as gg

TOL = 1e-5           # normalized error bound: float32 analytic gradients land near 1e-7, a 1e-4 slip fails
FD_STEP = 1e-5       # relative central-difference step
MAX_CHECKED = 24     # elements checked per param (all when fewer)


def param(ctx: gg.Context, x: np.ndarray, layout: str = "contig") -> tuple[gg.Tensor, gg.Tensor]:
    """(the param leaf, the tensor an op sees): `layout` puts a permute/transpose/view between them."""
    x = np.asarray(x, dtype=np.float32)
    if layout == "contig":
        p = ctx.from_numpy(x).set_param()
        return p, p
    if layout == "perm":  # memory holds dims 1 and 2 swapped
        p = ctx.from_numpy(np.ascontiguousarray(np.swapaxes(x, -2, -3))).set_param()
        return p, gg.permute(ctx, p, 0, 2, 1, 3)
    if layout == "trans":
        p = ctx.from_numpy(np.ascontiguousarray(np.swapaxes(x, -1, -2))).set_param()
        return p, gg.transpose(ctx, p)
    if layout == "view":  # a window with an offset and padded rows
        shape = x.shape[:-1] + (x.shape[-1] + 2,)
        buf = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
        buf[..., 1:-1] = x
        p = ctx.from_numpy(buf).set_param()
        ne = x.shape[::-1]
        nb = p.nb[1:len(ne)]
        return p, gg.view(ctx, p, ne, nb, offset=p.nb[0])
    raise ValueError(layout)


def build_loss(ctx: gg.Context, build, inputs: list[np.ndarray], layouts: list[str] | None,
               rng: np.random.Generator) -> tuple[list[tuple[gg.Tensor, gg.Tensor]], gg.Tensor]:
    """(the (param, seen) pairs, the loss sum(out * W)) of `build(ctx, *tensors)` over params from `inputs`."""
    layouts = layouts or ["contig"] * len(inputs)
    pairs = [param(ctx, x, lay) for x, lay in zip(inputs, layouts)]
    out = build(ctx, *[t for _, t in pairs])
    weights = ctx.from_numpy(rng.standard_normal(out.ne[::-1]).astype(np.float32))
    return pairs, gg.sum(ctx, gg.mul(ctx, out, weights)).set_loss()


def grad_check(build, inputs: list[np.ndarray], layouts: list[str] | None = None, seed: int = 0) -> dict[str, float]:
    """Build `build(ctx, *tensors)` over params from `inputs`; return the normalized error per param."""
    rng = np.random.default_rng(seed)
    ctx = gg.Context()
    pairs, loss = build_loss(ctx, build, inputs, layouts, rng)
    graph = gg.new_graph(loss)
    gg.build_backward_expand(ctx, graph)
    gg.compute(graph)

    errors = {}
    for k, (p, _) in enumerate(pairs):
        grad = graph.get_grad(p)
        assert grad is not None, f"param {k} got no gradient"
        analytic = grad.numpy().reshape(-1).astype(np.float64)
        base = np.array(p.array(), dtype=np.float64)
        flat_idx = np.arange(base.size)
        if base.size > MAX_CHECKED:
            flat_idx = rng.choice(base.size, MAX_CHECKED, replace=False)
        fd = np.empty(len(flat_idx))
        for j, i in enumerate(flat_idx):
            h = FD_STEP * max(1.0, abs(base.flat[i]))
            vals = []
            for sign in (1.0, -1.0):
                x = base.copy()
                x.flat[i] += sign * h
                vals.append(evaluate([loss], {id(p): x})[id(loss)].item())
            fd[j] = (vals[0] - vals[1]) / (2 * h)
        errors[f"param{k}"] = float(np.max(np.abs(analytic[flat_idx] - fd)) / max(np.max(np.abs(fd)), 1e-12))
    return errors


def rn(*shape, scale=1.0, offset=0.0, seed=1):
    """Random float32 values of numpy shape (ne3.., ne0) (reversed ggml ne)."""
    return (np.random.default_rng(seed).standard_normal(shape[::-1]) * scale + offset).astype(np.float32)


def pos_values(*shape, seed=1):
    return np.random.default_rng(seed).uniform(0.5, 2.0, shape[::-1]).astype(np.float32)


def _rope(mode, n_dims=None, ff=None):
    def build(ctx, x):
        pos = ctx.from_numpy(np.array([0, 3, 7, 100], dtype=np.int32), gg.GGMLType.I32)
        ffv = None if ff is None else ctx.from_numpy(ff)
        return gg.rope_ext(ctx, x, pos, ffv, n_dims or x.ne[0], mode, 64, 10000.0, 1.0)
    return build


def _soft_max(scale, max_bias=0.0, masked=True):
    def build(ctx, x):
        mask = None
        if masked:
            m = np.zeros((1, 1, x.ne[1], x.ne[0]), np.float32)
            for i in range(x.ne[1]):
                m[..., i, i + 2:] = -np.inf
                m[..., i, :i + 2] = -np.arange(min(i + 2, x.ne[0]))[::-1]
            mask = ctx.from_numpy(m)
        return gg.soft_max_ext(ctx, x, mask, scale, max_bias)
    return build


def _attention(ctx, q, k, v):
    """A llama-style attention core: scores, causal softmax, weighted values, heads merged."""
    kq = gg.mul_mat(ctx, gg.permute(ctx, k, 0, 2, 1, 3), gg.permute(ctx, q, 0, 2, 1, 3))
    kq = _soft_max(0.5)(ctx, kq)
    vt = gg.cont(ctx, gg.permute(ctx, v, 1, 2, 0, 3))
    kqv = gg.mul_mat(ctx, vt, kq)
    merged = gg.permute(ctx, kqv, 0, 2, 1, 3)
    return gg.cont(ctx, merged, q.ne[0] * q.ne[1], q.ne[2])


def _labels():
    p = np.random.default_rng(9).uniform(0.0, 1.0, (3, 7))
    return (p / p.sum(axis=1, keepdims=True)).astype(np.float32)


# name -> (build, inputs, layouts or None)
CASES = {
    "add": (gg.add, [rn(5, 4, 3), rn(5, 4, 3, seed=2)], None),
    "add_bcast_rows": (gg.add, [rn(5, 4, 3), rn(5, 1, 1, seed=2)], None),
    "add_bcast_tiled_perm": (gg.add, [rn(6, 4, 2), rn(3, 2, 1, seed=2)], ["perm", "contig"]),
    "sub": (gg.sub, [rn(5, 4), rn(5, 4, seed=2)], None),
    "sub_bcast": (gg.sub, [rn(5, 4, 3), rn(1, 4, 1, seed=2)], None),
    "mul": (gg.mul, [rn(5, 4), rn(5, 4, seed=2)], ["trans", "contig"]),
    "mul_bcast": (gg.mul, [rn(6, 4, 2), rn(6, 1, 2, seed=2)], None),
    "div": (gg.div, [rn(5, 4), pos_values(5, 4)], None),
    "div_bcast_view": (gg.div, [rn(5, 4, 2), pos_values(5, 1, 1)], ["view", "contig"]),
    "scale": (lambda ctx, a: gg.scale(ctx, a, 0.7), [rn(5, 4)], None),
    "scale_bias": (lambda ctx, a: gg.scale(ctx, a, -1.3, 0.2), [rn(5, 4)], ["trans"]),
    "sqr": (gg.sqr, [rn(5, 4)], None),
    "sqrt": (gg.sqrt, [pos_values(5, 4)], None),
    "log": (gg.log, [pos_values(5, 4)], ["trans"]),
    "exp": (gg.exp, [rn(5, 4)], None),
    "sum": (gg.sum, [rn(5, 4, 3)], ["perm"]),
    "sum_rows": (gg.sum_rows, [rn(5, 4, 3)], ["view"]),
    "mean": (gg.mean, [rn(7, 4)], None),
    "repeat": (lambda ctx, a: gg.repeat(ctx, a, gg.Tensor(gg.GGMLType.F32, (4, 6, 3, 2))), [rn(4, 2, 3, 1)], None),
    "repeat_back": (lambda ctx, a: gg.repeat_back(ctx, a, gg.Tensor(gg.GGMLType.F32, (4, 1, 3, 1))), [rn(4, 6, 3, 2)], None),
    "acc": (lambda ctx, a, b: gg.acc(ctx, a, b, a.nb[1], a.nb[2], a.nb[3], a.nb[1] + a.nb[0]), [rn(6, 5), rn(3, 2, seed=2)], None),
    "concat_dim0": (lambda ctx, a, b: gg.concat(ctx, a, b, 0), [rn(3, 4, 2), rn(5, 4, 2, seed=2)], None),
    "concat_dim2_perm": (lambda ctx, a, b: gg.concat(ctx, a, b, 2), [rn(3, 4, 2), rn(3, 4, 5, seed=2)], ["perm", "contig"]),
    "get_rows": (lambda ctx, a: gg.get_rows(ctx, a, ctx.from_numpy(np.array([3, 0, 3, 1], np.int32), gg.GGMLType.I32)),
                 [rn(5, 4)], None),
    "get_rows_3d": (lambda ctx, a: gg.get_rows(ctx, a, ctx.from_numpy(np.array([[2, 2, 0], [1, 0, 1]], np.int32), gg.GGMLType.I32)),
                    [rn(4, 3, 2)], None),
    "rms_norm": (lambda ctx, a: gg.rms_norm(ctx, a, 1e-5), [rn(8, 3, 2)], None),
    "rms_norm_perm": (lambda ctx, a: gg.rms_norm(ctx, a, 1e-6), [rn(8, 3, 2, offset=0.5)], ["perm"]),
    "norm": (lambda ctx, a: gg.norm(ctx, a, 1e-5), [rn(8, 3)], None),
    "norm_view": (lambda ctx, a: gg.norm(ctx, a, 1e-5), [rn(8, 3, 2, offset=1.0)], ["view"]),
    "mul_mat": (gg.mul_mat, [rn(6, 4), rn(6, 3, seed=2)], None),
    "mul_mat_batched": (gg.mul_mat, [rn(6, 4, 2), rn(6, 3, 2, seed=2)], None),
    "mul_mat_gqa_dim2": (gg.mul_mat, [rn(6, 4, 2), rn(6, 3, 6, seed=2)], None),
    "mul_mat_bcast_dim2_dim3": (gg.mul_mat, [rn(5, 3, 2, 1), rn(5, 2, 4, 3, seed=2)], None),
    "mul_mat_trans_a": (gg.mul_mat, [rn(6, 4), rn(6, 3, seed=2)], ["trans", "contig"]),
    "mul_mat_perm_b": (gg.mul_mat, [rn(6, 4, 3), rn(6, 2, 3, seed=2)], ["contig", "perm"]),
    "out_prod": (gg.out_prod, [rn(4, 5), rn(3, 5, seed=2)], None),
    "out_prod_bcast": (gg.out_prod, [rn(4, 5, 1), rn(3, 5, 2, seed=2)], None),
    "rope_norm": (_rope(gg.ROPE_TYPE_NORM), [rn(8, 2, 4)], None),
    "rope_neox_partial": (_rope(gg.ROPE_TYPE_NEOX, n_dims=4), [rn(8, 2, 4)], ["perm"]),
    "rope_freq_factors": (_rope(gg.ROPE_TYPE_NEOX, ff=np.array([1.0, 2.0, 4.0, 8.0], np.float32)), [rn(8, 3, 4)], None),
    "soft_max": (_soft_max(1.0, masked=False), [rn(7, 4, 2)], None),
    "soft_max_ext_mask_scale": (_soft_max(0.35), [rn(7, 5, 2)], None),
    "soft_max_ext_alibi_perm": (_soft_max(0.5, max_bias=8.0), [rn(7, 5, 4)], ["perm"]),
    "silu": (gg.silu, [rn(6, 4, scale=2.0)], None),
    "silu_trans": (gg.silu, [rn(6, 4, scale=2.0)], ["trans"]),
    "swiglu": (gg.swiglu_split, [rn(6, 4, scale=2.0), rn(6, 4, seed=2)], None),
    "gelu": (gg.gelu, [rn(6, 4, scale=2.0)], None),
    "geglu": (gg.geglu_split, [rn(6, 4, 2, scale=2.0), rn(6, 4, 2, seed=2)], ["perm", "contig"]),
    "cpy_reshaped": (lambda ctx, a: gg.cpy(ctx, a, ctx.new_tensor_2d(gg.GGMLType.F32, 4, 6)), [rn(6, 4)], ["trans"]),
    "cont": (gg.cont, [rn(6, 4, 3)], ["perm"]),
    "cont_new_shape": (lambda ctx, a: gg.cont(ctx, a, 12, 2), [rn(6, 4)], ["trans"]),
    "dup": (gg.dup, [rn(6, 4)], None),
    "view_window": (lambda ctx, a: gg.view_2d(ctx, gg.scale(ctx, a, 1.5), 3, 2, a.nb[1], a.nb[0] * 2), [rn(6, 4)], None),
    "reshape": (lambda ctx, a: gg.sqr(ctx, gg.reshape(ctx, gg.exp(ctx, a), 4, 6)), [rn(6, 4)], None),
    "permute_intermediate": (lambda ctx, a: gg.silu(ctx, gg.permute(ctx, gg.scale(ctx, a, 2.0), 2, 0, 1, 3)), [rn(5, 4, 3)], None),
    "transpose_intermediate": (lambda ctx, a, b: gg.mul_mat(ctx, gg.transpose(ctx, gg.sqr(ctx, a)), b),
                               [rn(4, 6), rn(6, 5, seed=2)], None),
    "cross_entropy_loss": (lambda ctx, a: gg.cross_entropy_loss(ctx, a, ctx.from_numpy(_labels())), [rn(7, 3, scale=2.0)], None),
    # rows weighted, one ignored (all zero): a masked language-model loss
    "cross_entropy_loss_weighted_rows": (lambda ctx, a: gg.cross_entropy_loss(
        ctx, a, ctx.from_numpy(_labels() * np.array([[0.0], [2.5], [0.7]], np.float32))), [rn(7, 3, scale=2.0)], None),
    # the same with labels as token ids and weights (the trainer's form; id -1 ignored)
    "cross_entropy_loss_label_ids": (lambda ctx, a: gg.cross_entropy_loss(
        ctx, a, ctx.from_numpy(np.array([[[[3, -1, 6]]]], np.int32), gg.GGMLType.I32),
        ctx.from_numpy(np.array([[[[1.0, 1.0, 2.5]]]], np.float32))), [rn(7, 3, scale=2.0)], None),
    # the output layer fused with its loss: every field of the rows (loss, log-sum-exp; the
    # argmax has no gradient) weighted by the check's random W, in the weight and the input
    "linear_cross_entropy": (lambda ctx, w, x: gg.linear_cross_entropy(
        ctx, w, x, ctx.from_numpy(np.array([[[[3, -1, 6, 0]]]], np.int32), gg.GGMLType.I32),
        ctx.from_numpy(np.array([[[[1.0, 1.0, 2.5, 0.0]]]], np.float32))), [rn(5, 7, scale=0.7), rn(5, 4, seed=2)],
        ["trans", "view"]),
    "linear_cross_entropy_loss_batched": (lambda ctx, w, x: gg.linear_cross_entropy_loss(
        ctx, w, x, ctx.from_numpy(np.array([[[1], [4]], [[2], [6]], [[0], [3]]], np.int32), gg.GGMLType.I32),
        ctx.from_numpy(np.array([[[0.5], [1.0]], [[2.0], [1.0]], [[1.0], [0.0]]], np.float32)))[0],
        [rn(5, 7, scale=0.7), rn(5, 1, 2, 3, seed=2)], ["view", "contig"]),
    "shared_input_several_uses": (lambda ctx, a: gg.add(ctx, gg.mul(ctx, a, a), gg.mul_mat(ctx, a, a)), [rn(4, 4)], None),
    "attention_block": (_attention, [rn(4, 2, 5), rn(4, 2, 5, seed=2), rn(4, 2, 5, seed=3)], None),
    # the pieces qwen2, qwen3 and Llama 3 add to llama's layer
    "rope_norm_freq_factors": (_rope(gg.ROPE_TYPE_NORM, ff=np.array([1.0, 1.5, 3.0, 8.0], np.float32)), [rn(8, 3, 4)], None),
    "biased_projection": (lambda ctx, w, x, b: gg.add(ctx, gg.mul_mat(ctx, w, x), b),  # qwen2's Q/K/V: W x + b
                          [rn(6, 4), rn(6, 3, seed=2), rn(4, seed=3)], None),
    "per_head_qk_norm": (lambda ctx, q, w: gg.mul(ctx, gg.rms_norm(ctx, q, 1e-6), w),  # qwen3: each head's RMS norm
                         [rn(8, 3, 4), rn(8, offset=1.0, scale=0.1, seed=2)], None),
}


# Params whose analytic gradient carries a rounding the float64 reference does not have:
# geglu's gradient for b is g * gelu(a) (the form of ggml's SWIGLU backward), gelu from
# ggml's half table as in the forward: one rounding to half (relative 2^-11) against the
# float64 reference's exact GELU.
TOL_BY_PARAM = {("geglu", "param1"): 2.0 ** -11}


@pytest.mark.parametrize("name", CASES)
def test_grad_check(name):
    build, inputs, layouts = CASES[name]
    errors = grad_check(build, inputs, layouts)
    bad = {k: e for k, e in errors.items() if not e <= TOL_BY_PARAM.get((name, k), TOL)}
    assert not bad, f"{name}: normalized gradient error {bad} > {TOL}"


def test_every_differentiable_input_has_a_case():
    """Derived from the op registry: every input of every differentiable op, except those
    it declares without a gradient, is differentiated by some case (so the float64
    reference interprets every such op); and each declared input occurs in some case."""
    arity: dict[gg.Op, int] = {}
    differentiated: set[tuple[gg.Op, int]] = set()
    for build, inputs, layouts in CASES.values():
        pairs, loss = build_loss(gg.Context(), build, inputs, layouts, np.random.default_rng(0))
        evaluate([loss])
        needs = {id(p) for p, _ in pairs}
        for node in gg.new_graph(loss).nodes:
            arity[node.op] = max(arity.get(node.op, 0), len(node.src))
            for i, s in enumerate(node.src):
                if id(s) in needs:
                    differentiated.add((node.op, i))
                    needs.add(id(node))
    differentiable = {op: info for op, info in gg.OPS.items() if info.differentiable}
    missing = sorted(op.name for op in differentiable.keys() - arity.keys())
    assert not missing, f"differentiable ops in no case: {missing}"
    wanted = {(op, i) for op, info in differentiable.items() for i in range(arity[op]) if i not in info.no_grad}
    missing = sorted((op.name, i) for op, i in wanted - differentiated)
    assert not missing, f"(op, src index) with a gradient that no case differentiates: {missing}"
    unseen = sorted((op.name, i) for op, info in differentiable.items() for i in info.no_grad if i >= arity[op])
    assert not unseen, f"(op, src index) declared without a gradient that no case has: {unseen}"


def test_gradient_accumulates_over_uses():
    """x feeding three nodes gets the sum of the three contributions."""
    ctx = gg.Context()
    x = ctx.from_numpy(np.array([1.0, 2.0, 3.0], np.float32)).set_param()
    loss = gg.sum(ctx, gg.add(ctx, gg.add(ctx, gg.sqr(ctx, x), gg.scale(ctx, x, 3.0)), x)).set_loss()
    graph = gg.new_graph(loss)
    gg.build_backward_expand(ctx, graph)
    gg.compute(graph)
    np.testing.assert_array_equal(graph.get_grad(x).numpy(), 2 * np.array([1, 2, 3]) + 4)


def test_no_gradient_for_what_does_not_need_one():
    """Nodes that do not depend on a param get no gradient nodes at all."""
    ctx = gg.Context()
    w = ctx.from_numpy(rn(4, 3)).set_param()
    x = ctx.from_numpy(rn(4, 5, seed=2))
    h = gg.silu(ctx, gg.rms_norm(ctx, x, 1e-5))          # input-only branch
    loss = gg.sum(ctx, gg.mul_mat(ctx, w, h)).set_loss()
    graph = gg.new_graph(loss)
    n_forward = len(graph.nodes)
    gg.build_backward_expand(ctx, graph)
    ops = [n.op for n in graph.nodes[n_forward:]]
    assert gg.Op.SILU_BACK not in ops and gg.Op.RMS_NORM_BACK not in ops
    assert graph.get_grad(x) is None


@pytest.mark.parametrize("what", ["mask", "labels", "positions"])
def test_not_differentiable_inputs_say_so(what):
    ctx = gg.Context()
    w = ctx.from_numpy(rn(4, 3)).set_param()
    x = ctx.from_numpy(rn(4, 3, seed=2))
    if what == "mask":
        out = gg.soft_max_ext(ctx, x, gg.scale(ctx, w, 1.0), 1.0)
    elif what == "labels":
        out = gg.cross_entropy_loss(ctx, x, gg.soft_max(ctx, w))
    else:
        pos = gg.Tensor(gg.GGMLType.I32, (3, 1, 1, 1))
        pos.op, pos.src = gg.Op.ARGMAX, (w,)
        out = gg.rope_ext(ctx, gg.reshape(ctx, x, 4, 1, 3), pos, None, 4, 0, 64, 10000.0, 1.0)
    loss = gg.sum(ctx, out).set_loss()
    with pytest.raises(gg.NotDifferentiableError, match="not differentiable with respect to"):
        gg.build_backward_expand(ctx, gg.new_graph(loss))


# ---- LoRA through a frozen quantized base (the types of the gemma3 Q4_K_M file) ----------------
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_0", "Q6_K", "Q8_0"])
def test_lora_gradients_through_quantized_base(qtype):
    """Two quantized layers with a LoRA delta on the first: out = W2 (W1 x + s B (A x)).

    The gradients of A and B reach them through W2's quantized product (OUT_PROD from
    packed rows); finite differences evaluate the same graph in float64 on gguf's own
    dequantization of the same bytes."""
    from ggmlpy.backend.cpu.products.type_table import round_activations
    from ggmlpy.quants import quantize
    t = gg.GGMLType[qtype]
    rng = np.random.default_rng(4)
    k, r = 256, 4

    def build(ctx, x, a, b):
        w1 = ctx.from_numpy(quantize(rng.standard_normal((k, k)).astype(np.float32) / 16, t), t)
        w2 = ctx.from_numpy(quantize(rng.standard_normal((8, k)).astype(np.float32) / 16, t), t)
        h = gg.add(ctx, gg.mul_mat(ctx, w1, x), gg.scale(ctx, gg.mul_mat(ctx, b, gg.mul_mat(ctx, a, x)), 0.5))
        return gg.mul_mat(ctx, w2, gg.silu(ctx, h))

    # ggml rounds the activations of a quantized product (to Q8_0 / Q8_K), and the gradient
    # passes that rounding straight through; x starts on its grid (rounding it again changes
    # nothing), so W1's forward equals the float64 one and only W2's (whose output is not
    # differentiated further) rounds
    x = round_activations(rn(k, 3, seed=6), t)
    a = rn(k, r, seed=7, scale=1 / 16)
    b = rn(r, k, seed=8, scale=1 / 4)
    errors = grad_check(build, [x, a, b])
    assert all(e <= TOL for e in errors.values()), errors
