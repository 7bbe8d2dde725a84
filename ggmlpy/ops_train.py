"""Training ops: losses, the dedicated `*_back` ops of the backward pass, optimizer steps.

As in ggml, an op whose gradient has no cheap expression in other ops gets a `*_back`
op with a kernel of its own; `backward.py` is the only place that builds them.
"""
from __future__ import annotations

from .context import Context
from . import ops as _ops
from .ops import Prec, _check, _node, view_tensor
from .tensor import Op, Tensor
from .types import GGMLType, traits


# ---- losses -------------------------------------------------------------------------------
def cross_entropy_loss(ctx: Context, logits: Tensor, labels: Tensor, weights: Tensor | None = None) -> Tensor:
    """-sum(labels * log_softmax(logits)) over each row, averaged over rows: a 1-element tensor.

    A label row is a distribution, or one scaled by a weight: the loss is linear in the
    labels, so an all-zero row (a datapoint whose label is ignored) adds nothing to the
    sum (the mean still divides by every row) and gets no gradient.

    Labels may also be token ids (I32, one per row: ne = logits.ne[1:] + (1,)) with F32
    `weights` of the same shape: row r's label row is weights[r] * onehot(labels[r]),
    nothing where the id is negative. The result is the same, to the bit, without a
    [n_vocab x rows] label tensor (262,144 x 256 floats for one Gemma 3 window)."""
    if labels.type == GGMLType.I32:
        rows = logits.ne[1:] + (1,)
        _check(labels.ne == rows and weights is not None and weights.ne == rows and weights.type == GGMLType.F32,
               f"CROSS_ENTROPY_LOSS: ids and F32 weights must have shape {rows} for logits {logits.ne}")
        return _node(ctx, Op.CROSS_ENTROPY_LOSS, GGMLType.F32, (1, 1, 1, 1), (logits, labels, weights))
    _check(logits.ne == labels.ne, f"CROSS_ENTROPY_LOSS: logits {logits.ne} and labels {labels.ne} differ")
    _check(weights is None, "CROSS_ENTROPY_LOSS: weights go with label ids, not label rows")
    return _node(ctx, Op.CROSS_ENTROPY_LOSS, GGMLType.F32, (1, 1, 1, 1), (logits, labels))


def cross_entropy_loss_back(ctx: Context, grad: Tensor, logits: Tensor, labels: Tensor,
                            weights: Tensor | None = None) -> Tensor:
    """d loss / d logits = (softmax(logits) * sum(labels) - labels) * grad / rows, per row
    (ggml's softmax - labels where a row sums to 1); labels as rows or as ids and weights."""
    _check(grad.nelements() == 1, "CROSS_ENTROPY_LOSS_BACK: the loss gradient must be a scalar")
    src = (grad, logits, labels) + ((weights,) if weights is not None else ())
    return _node(ctx, Op.CROSS_ENTROPY_LOSS_BACK, GGMLType.F32, logits.ne, src)


# ---- a linear layer followed by cross-entropy ------------------------------------------------
LCE_LOSS, LCE_LSE, LCE_ARGMAX = 0, 1, 2  # the fields of each row of linear_cross_entropy's result
LCE_FIELDS = 3
LCE_MAX_CLASSES = 1 << 24  # an argmax stored in a float32 field is exact up to here


def linear_cross_entropy(ctx: Context, w: Tensor, x: Tensor, ids: Tensor, weights: Tensor,
                         skip_ignored: bool = False) -> Tensor:
    """Per row r of x: the cross-entropy of the logits z_r = W x_r (row r of mul_mat(w, x))
    against the label weights[r] * onehot(ids[r]), without ever holding the logits: the
    product is computed a bounded chunk of W's rows at a time and only per-row statistics
    are kept. A classifier's output layer over many classes (a language model's
    vocabulary) costs as much memory as its input, not classes x rows.

    w: [K, classes] (F32, F16, BF16 or block-quantized, used in place); x: F32 [K, rows...];
    ids: I32 and weights: F32, one per row (ne = x.ne[1:] + (1,)), as cross_entropy_loss
    takes them. Result: F32 [LCE_FIELDS, rows...], per row: LCE_LOSS = weights[r] *
    (lse_r - z_r[ids[r]]) (0 where ids[r] < 0), LCE_LSE = lse_r = log(sum(exp(z_r))),
    LCE_ARGMAX = the first index of the largest logit (a float: exact below 2^24 classes).
    The loss and the log-sum-exp fields are differentiable in w and x (a z-loss may use the
    latter); the argmax is piecewise constant and passes no gradient.
    With `skip_ignored`, a row whose id is negative is not computed at all: its three fields
    are 0 and it passes no gradient, so a training step's masked positions (a chat's prompt,
    padding) cost nothing in the output layer; the other rows are as without it.
    `linear_cross_entropy_loss` builds cross_entropy_loss's mean and the predictions."""
    rows = x.ne[1:] + (1,)
    _check(w.ne[2] == 1 and w.ne[3] == 1 and w.ne[0] == x.ne[0],
           f"LINEAR_CROSS_ENTROPY: weight {w.ne} must be one [K, classes] matrix for input {x.ne}")
    _check(x.type == GGMLType.F32 and not traits(x.type).is_quantized, "LINEAR_CROSS_ENTROPY: the input must be F32")
    _check(w.ne[1] <= LCE_MAX_CLASSES, f"LINEAR_CROSS_ENTROPY: {w.ne[1]} classes, at most {LCE_MAX_CLASSES}")
    _check(ids.type == GGMLType.I32 and ids.ne == rows and weights.type == GGMLType.F32 and weights.ne == rows,
           f"LINEAR_CROSS_ENTROPY: ids (I32) and weights (F32) must have shape {rows} for input {x.ne}")
    return _node(ctx, Op.LINEAR_CROSS_ENTROPY, GGMLType.F32, (LCE_FIELDS,) + x.ne[1:], (w, x, ids, weights),
                 (Prec.DEFAULT, int(skip_ignored)))  # (the product's precision: set_prec, the skip)


def linear_cross_entropy_field(ctx: Context, rows: Tensor, field: int) -> Tensor:
    """One field of every row of a linear_cross_entropy result: [1, rows...] (a view)."""
    _check(rows.op == Op.LINEAR_CROSS_ENTROPY and 0 <= field < LCE_FIELDS, "a field of a LINEAR_CROSS_ENTROPY node")
    return _ops.view(ctx, rows, (1,) + rows.ne[1:], rows.nb[1:], field * rows.nb[0])


def linear_cross_entropy_loss(ctx: Context, w: Tensor, x: Tensor, ids: Tensor,
                              weights: Tensor, skip_ignored: bool = False) -> tuple[Tensor, Tensor]:
    """(cross_entropy_loss(mul_mat(w, x), ids, weights), argmax(mul_mat(w, x))) from one
    linear_cross_entropy node: the loss summed over rows and divided by their count (a
    1-element tensor), and each row's prediction (I32, shaped like ids; 0 for a row with a
    negative id when `skip_ignored` leaves it out: see linear_cross_entropy)."""
    rows = linear_cross_entropy(ctx, w, x, ids, weights, skip_ignored)
    n_rows = rows.nelements() // LCE_FIELDS
    loss = _ops.scale(ctx, _ops.sum(ctx, linear_cross_entropy_field(ctx, rows, LCE_LOSS)), 1.0 / n_rows)
    pred = _ops.cpy(ctx, linear_cross_entropy_field(ctx, rows, LCE_ARGMAX), ctx.new_tensor(GGMLType.I32, ids.ne, "pred"))
    return loss, pred


def linear_cross_entropy_back(ctx: Context, grad: Tensor, rows: Tensor, wrt: int) -> Tensor:
    """The gradient of the loss through linear_cross_entropy's result `rows` (whose gradient
    is `grad`) with respect to its weight (wrt = 0) or its input (wrt = 1): with
    p_r = softmax(z_r), dz_r = (g_lse_r + weights[r] g_loss_r) p_r - weights[r] g_loss_r
    onehot(ids[r]), then dW = dz^T x and dx = dz W, never holding dz whole."""
    _check(rows.op == Op.LINEAR_CROSS_ENTROPY and grad.ne == rows.ne and wrt in (0, 1),
           "LINEAR_CROSS_ENTROPY_BACK: needs a LINEAR_CROSS_ENTROPY node, its gradient and 0 (weight) or 1 (input)")
    w, x, ids, weights = rows.src
    like = (w, x)[wrt]
    return _node(ctx, Op.LINEAR_CROSS_ENTROPY_BACK, GGMLType.F32, like.ne, (grad, rows, w, x, ids, weights), (wrt,))


# ---- backward ops ---------------------------------------------------------------------------
def rms_norm_back(ctx: Context, grad: Tensor, x: Tensor, eps: float) -> Tensor:
    """Gradient of rms_norm(x) given the output gradient."""
    _check(grad.ne == x.ne, f"RMS_NORM_BACK: {grad.ne} vs {x.ne}")
    return _node(ctx, Op.RMS_NORM_BACK, GGMLType.F32, x.ne, (grad, x), (float(eps),))


def soft_max_ext_back(ctx: Context, grad: Tensor, y: Tensor, scale: float, max_bias: float = 0.0) -> Tensor:
    """Gradient of soft_max_ext given its output y: scale * y * (grad - dot(grad, y)) per row."""
    _check(grad.ne == y.ne, f"SOFT_MAX_BACK: {grad.ne} vs {y.ne}")
    return _node(ctx, Op.SOFT_MAX_BACK, GGMLType.F32, y.ne, (grad, y), (float(scale), float(max_bias)))


def rope_back(ctx: Context, grad: Tensor, rope: Tensor) -> Tensor:
    """Gradient of a rope node: the inverse rotation, same positions and parameters."""
    _check(rope.op == Op.ROPE and grad.ne == rope.ne, "ROPE_BACK: needs a ROPE node and its gradient")
    return _node(ctx, Op.ROPE_BACK, GGMLType.F32, grad.ne, (grad,) + rope.src[1:], rope.op_params)


def silu_back(ctx: Context, grad: Tensor, x: Tensor) -> Tensor:
    """grad * silu'(x)."""
    _check(grad.ne == x.ne, f"SILU_BACK: {grad.ne} vs {x.ne}")
    return _node(ctx, Op.SILU_BACK, GGMLType.F32, x.ne, (grad, x))


def gelu_back(ctx: Context, grad: Tensor, x: Tensor) -> Tensor:
    """grad * gelu'(x) (tanh approximation, as the forward)."""
    _check(grad.ne == x.ne, f"GELU_BACK: {grad.ne} vs {x.ne}")
    return _node(ctx, Op.GELU_BACK, GGMLType.F32, x.ne, (grad, x))


def get_rows_back(ctx: Context, grad: Tensor, rows: Tensor, like: Tensor) -> Tensor:
    """The picked rows' gradients added back into a zero tensor shaped like the table."""
    _check(grad.ne[0] == like.ne[0], f"GET_ROWS_BACK: rows of {grad.ne} do not fit {like.ne}")
    return _node(ctx, Op.GET_ROWS_BACK, GGMLType.F32, like.ne, (grad, rows))


# ---- optimizer steps ---------------------------------------------------------------------------
ADAMW_PARAMS = 7  # alpha, beta1, beta2, eps, wd, beta1h, beta2h
SGD_PARAMS = 2    # alpha, wd


def opt_step_adamw(ctx: Context, w: Tensor, grad: Tensor, m: Tensor, v: Tensor, params: Tensor) -> Tensor:
    """One AdamW update of w in place (decoupled weight decay; beta1h/beta2h carry the bias correction).

    `params` is a host-filled F32 tensor, so schedules change values without rebuilding graphs.
    """
    _check(w.ne == grad.ne == m.ne == v.ne, "OPT_STEP_ADAMW: w, grad, m, v must have one shape")
    _check(params.nelements() == ADAMW_PARAMS and params.type == GGMLType.F32, "OPT_STEP_ADAMW: 7 F32 params")
    out = view_tensor(ctx, w)
    out.op, out.src = Op.OPT_STEP_ADAMW, (w, grad, m, v, params)
    return out


def opt_step_sgd(ctx: Context, w: Tensor, grad: Tensor, params: Tensor) -> Tensor:
    """One SGD update of w in place: w = w * (1 - alpha*wd) - alpha * grad. No optimizer state."""
    _check(w.ne == grad.ne, "OPT_STEP_SGD: w and grad must have one shape")
    _check(params.nelements() == SGD_PARAMS and params.type == GGMLType.F32, "OPT_STEP_SGD: 2 F32 params")
    out = view_tensor(ctx, w)
    out.op, out.src = Op.OPT_STEP_SGD, (w, grad, params)
    return out
