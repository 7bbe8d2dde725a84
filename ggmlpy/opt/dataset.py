"""Datasets for the optimizer (ggml_opt_dataset): datapoints and labels in shards that
shuffling permutes, read in memory or, by a subclass, from elsewhere (token shards)."""
from __future__ import annotations

import numpy as np

from ..tensor import Tensor
from ..types import GGMLType, traits


class Dataset:
    """`ndata` datapoints of `ne_datapoint` values (and labels of `ne_label` values), grouped
    in shards of `ndata_shard` consecutive datapoints; shuffling permutes whole shards.

    The datapoints live in `data` and `labels`, unless a subclass reads them from elsewhere
    (files larger than memory): it is made with `in_memory=False` and overrides `rows`."""

    def __init__(self, ne_datapoint: int, ne_label: int, ndata: int, ndata_shard: int = 1,
                 type_data: GGMLType = GGMLType.F32, type_label: GGMLType = GGMLType.F32,
                 in_memory: bool = True) -> None:
        if ne_datapoint <= 0 or ne_label < 0 or ndata <= 0 or ndata_shard <= 0 or ndata % ndata_shard:
            raise ValueError(f"dataset: bad geometry (ne_datapoint={ne_datapoint}, ne_label={ne_label}, "
                             f"ndata={ndata}, ndata_shard={ndata_shard})")
        self.ndata, self.ndata_shard = ndata, ndata_shard
        self.ne_datapoint, self.ne_label = ne_datapoint, ne_label
        self.type_data, self.type_label = GGMLType(type_data), GGMLType(type_label)
        self.data = np.zeros((ndata, ne_datapoint), dtype=traits(type_data).np_dtype) if in_memory else None
        self.labels = (np.zeros((ndata, ne_label), dtype=traits(type_label).np_dtype)
                       if ne_label and in_memory else None)
        n_shards = ndata // ndata_shard  # int32 while it fits: a corpus's windows number tens of millions
        self.permutation = np.arange(n_shards, dtype=np.int32 if n_shards < 2**31 else np.int64)

    def rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Data and labels of the stored datapoints `rows` (indices in storage order)."""
        return self.data[rows], None if self.labels is None else self.labels[rows]

    def shuffle(self, rng: np.random.Generator, idata: int = -1) -> None:
        """Shuffle the shards of the first `idata` datapoints (all when negative)."""
        if idata < 0:
            rng.shuffle(self.permutation)
            return
        if idata > self.ndata or idata % self.ndata_shard:
            raise ValueError(f"dataset: cannot shuffle the first {idata} of {self.ndata} datapoints in shards of {self.ndata_shard}")
        rng.shuffle(self.permutation[: idata // self.ndata_shard])

    def get_batch(self, data_batch: Tensor, labels_batch: Tensor | None, ibatch: int) -> None:
        """Copy batch `ibatch` (in shuffled shard order) into the batch tensors."""
        data = np.reshape(data_batch.array(), (-1, self.ne_datapoint), copy=False)
        rows_data, rows_labels = self.rows(self._shards(data.shape[0], ibatch))
        data[...] = rows_data
        if labels_batch is not None:
            labels = np.reshape(labels_batch.array(), (-1, self.ne_label), copy=False)
            labels[...] = rows_labels

    def index(self, i: int) -> int:
        """The row of the i-th datapoint in the current (shuffled) order."""
        return int(self.permutation[i // self.ndata_shard]) * self.ndata_shard + i % self.ndata_shard

    def datapoint(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Data and labels of the i-th datapoint in the current (shuffled) order."""
        data, labels = self.rows(np.array([self.index(i)]))
        return data[0], None if labels is None else labels[0]

    def _shards(self, n_batch: int, ibatch: int) -> np.ndarray:
        per_batch = n_batch // self.ndata_shard
        if n_batch % self.ndata_shard or (ibatch + 1) * per_batch > len(self.permutation):
            raise ValueError(f"dataset: batch {ibatch} of {n_batch} datapoints is out of range")
        shards = self.permutation[ibatch * per_batch:(ibatch + 1) * per_batch]
        return (shards[:, None] * self.ndata_shard + np.arange(self.ndata_shard)).reshape(-1)
