"""The result of a pass over data: losses per batch with their uncertainties, predictions
and accuracy, the mean loss of each optimizer step (ggml_opt_result)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np


def weighted_mean(values: Sequence[float], counts: Sequence[int]) -> float:
    """The mean of per-batch mean losses over all their datapoints (batch i counting
    counts[i]). Equal counts give the plain mean bit for bit: the weights are then 1.0."""
    w = np.asarray(counts, dtype=np.float64)
    w /= w.max()
    return float((w * np.asarray(values, dtype=np.float64)).sum() / w.sum())


class Result:
    """One pass over data: the loss of each evaluated batch, the datapoints it counted,
    predictions, the correct count, and the mean loss of each optimizer step taken (for
    loss curves). A batch's datapoints whose labels are ignored are not counted: they are
    in neither its loss, nor ndata, nor the predictions."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.ndata = 0
        self.losses: list[float] = []
        self.counts: list[int] = []  # datapoints counted in each batch's loss
        self.steps: list[float] = []
        self._preds: list[np.ndarray] = []  # each batch's, as int32 (a run predicts millions of tokens)
        self.ncorrect = 0
        self.loss_per_datapoint = False

    def loss(self) -> tuple[float, float]:
        """(loss, uncertainty): for per-datapoint losses the mean over every counted datapoint
        (batches weighted by their counts), else the sum over batches."""
        n = len(self.losses)
        if n == 0:
            return 0.0, math.nan
        values = np.asarray(self.losses, dtype=np.float32).astype(np.float64)
        if not self.loss_per_datapoint:
            total = values.sum()
            if n < 2:
                return float(total), math.nan
            mean = total / n
            sample_var = max((values ** 2).sum() / n - mean * mean, 0.0) * n / (n - 1)
            # (ggml reports the sample standard deviation for sums, without the sqrt(n).)
            return float(total), math.sqrt(sample_var * n)
        w = np.asarray(self.counts, dtype=np.float64)
        w /= w.max()  # 1.0 each when the batches count alike: the unweighted statistics bit for bit
        total = w.sum()
        mean = (w * values).sum() / total
        if n < 2:
            return float(mean), math.nan
        n_eff = total * total / (w * w).sum()  # Kish's effective number of batches (n for equal weights)
        sample_var = max((w * values ** 2).sum() / total - mean * mean, 0.0) * n_eff / (n_eff - 1)
        return float(mean), math.sqrt(sample_var / n_eff)  # the standard error of the mean

    def add_batch(self, ndata: int, loss: float, preds, ncorrect: int | None, loss_per_datapoint: bool) -> None:
        """Record one evaluated batch of `ndata` counted datapoints (ncorrect None: no accuracy
        for this loss)."""
        if self.ndata == 0:
            self.loss_per_datapoint = loss_per_datapoint
        self.ndata += ndata
        self.losses.append(loss)
        self.counts.append(ndata)
        if ncorrect is None:
            self.ncorrect = -1
            return
        self._preds.append(np.array(preds, dtype=np.int32).reshape(-1))
        if self.ncorrect >= 0:
            self.ncorrect += ncorrect

    def extend(self, other: "Result") -> None:
        """Append `other`'s batches (another rank's share of a step or of a validation pass)."""
        if other.ndata == 0:
            return
        if self.ndata == 0:
            self.loss_per_datapoint = other.loss_per_datapoint
        self.ndata += other.ndata
        self.losses.extend(other.losses)
        self.counts.extend(other.counts)
        self._preds.extend(other._preds)
        self.ncorrect = -1 if min(self.ncorrect, other.ncorrect) < 0 else self.ncorrect + other.ncorrect

    @property
    def preds(self) -> np.ndarray:
        """The prediction (argmax class) of every counted datapoint, in order (ggml_opt_result_pred)."""
        return np.concatenate(self._preds) if self._preds else np.zeros(0, dtype=np.int32)

    def to_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of a pass in progress (per-datapoint predictions are not kept)."""
        return {"ndata": self.ndata, "losses": list(self.losses), "counts": list(self.counts),
                "steps": list(self.steps), "ncorrect": self.ncorrect, "loss_per_datapoint": self.loss_per_datapoint}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Result":
        r = cls()
        r.ndata, r.ncorrect, r.loss_per_datapoint = int(d["ndata"]), int(d["ncorrect"]), bool(d["loss_per_datapoint"])
        r.losses, r.steps = [float(x) for x in d["losses"]], [float(x) for x in d["steps"]]
        # a pass saved before counts were kept counted every batch alike
        r.counts = [int(x) for x in d.get("counts", [1] * len(r.losses))]
        return r

    def accuracy(self) -> tuple[float, float]:
        """(fraction correct, its binomial standard error); NaN when there are no predictions."""
        if self.ncorrect < 0 or self.ndata == 0:
            return math.nan, math.nan
        acc = self.ncorrect / self.ndata
        unc = math.sqrt(acc * (1.0 - acc) / (self.ndata - 1)) if self.ndata >= 2 else math.nan
        return acc, unc
