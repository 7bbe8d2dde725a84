"""A model graph prepared for training: forward, backward into the optimizer's
accumulators, one planned allocation, and the record of each evaluation."""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .. import ops as O
from ..alloc import GraphAllocator
from ..backward import build_backward_expand
from ..context import Context
from ..graph import new_graph
from ..tensor import Tensor
from .result import Result


class TrainGraph:
    """A model graph prepared for training (ggml_opt_build for one graph).

    `objective` is the tensor differentiated (flagged loss); `loss` is what is recorded per
    evaluation, `loss_scale` what the objective's loss was multiplied by (1 / opt_period
    for per-datapoint losses, so that accumulated gradients are the step's mean gradient),
    so recorded losses are unscaled. `pred`/`ncorrect` give accuracy when present.
    `checkpoints` (forward nodes) makes the backward pass recompute the other forward
    intermediates it needs instead of keeping them (gradient checkpointing, recompute.py).
    `allocator`: one shared with other graphs computed in turn (one arena for all of them;
    see GraphAllocator.alloc_graph); a new one when None.
    """

    def __init__(self, ctx: Context, objective: Tensor, loss: Tensor, *, grad_accs: dict[int, Tensor] | None,
                 inputs: Tensor | None = None, pred: Tensor | None = None, ncorrect: Tensor | None = None,
                 outputs: Sequence[Tensor] = (), loss_scale: float = 1.0, loss_per_datapoint: bool = True,
                 checkpoints: Sequence[Tensor] | None = None, allocator: GraphAllocator | None = None) -> None:
        self.inputs, self.loss, self.pred, self.ncorrect = inputs, loss, pred, ncorrect
        # predictions per evaluation (ggml counts the outputs' rows)
        self.ndata = pred.nelements() if pred is not None else (outputs[0].ne[1] if outputs else 1)
        self.loss_scale, self.loss_per_datapoint = loss_scale, loss_per_datapoint
        recorded = [t for t in (loss, pred, ncorrect) if t is not None]
        for t in (*recorded, *outputs):
            t.set_output()
        objective.set_loss()
        self.forward = new_graph(objective, *recorded, *outputs)
        self.backward = None
        if grad_accs is not None:
            self.backward = self.forward.copy()
            build_backward_expand(ctx, self.backward, grad_accs, checkpoints)
        O.set_blas_products((self.backward or self.forward).nodes)  # speed over llama.cpp's summation order
        self.allocator = allocator or GraphAllocator()
        self.allocator.alloc_graph(self.backward or self.forward)

    def record(self, result: Result | None, counted: np.ndarray | None = None,
               label_weight: float = 1.0) -> tuple[float, int]:
        """The evaluation's unscaled loss and how many datapoints it counts; added to `result`
        with its predictions.

        `counted` (bool per datapoint) marks the datapoints whose labels count, the others'
        label rows being all zero, and `label_weight` is the sum of a counted datapoint's
        label row (the loss is linear in it): the loss is then the mean over the counted
        datapoints alone (NaN when none is, and nothing is recorded), and only their
        predictions are kept. The graph's `ncorrect` must not count them either (compare
        the predictions with labels an ignored datapoint never equals)."""
        loss = float(self.loss.array().reshape(-1)[0]) / self.loss_scale
        ndata = self.ndata
        if counted is not None:
            ndata = int(np.count_nonzero(counted))
            loss = loss * (self.ndata / (ndata * label_weight)) if ndata else math.nan
        if result is not None and ndata:
            has_acc = self.pred is not None
            preds = self.pred.array().reshape(-1) if has_acc else ()
            result.add_batch(ndata, loss, preds if counted is None or not has_acc else preds[counted],
                             int(self.ncorrect.array().reshape(-1)[0]) if has_acc else None, self.loss_per_datapoint)
        return loss, ndata
