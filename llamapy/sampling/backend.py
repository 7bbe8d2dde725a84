"""Backend sampling: a chain's leading samplers as ops at the end of the model graph.

For each output row whose sequence has a chain attached (Context.set_sampler), the row of
logits goes through the ops of the chain's backend prefix. What leaves the graph is the
sampled token (I32) when the prefix ends in greedy or dist, otherwise a candidate list:
token ids, their logits and probabilities (tokens cut by top-p / min-p are at -inf with
probability 0 and are dropped on the host).

The graph's structure depends only on the prefix's `backend_key`s, so graphs are cached
by them; per-step values (the uniform number of dist, penalty counts, a temperature) are
graph inputs that the host sets from the chain's samplers before each compute.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import ggmlpy as gg
from ggmlpy import GGMLType, Tensor

from .samplers import Candidates


class BackendRow:
    """The sampling ops of one output row, built sampler by sampler."""

    def __init__(self, ctx: gg.Context, graph: gg.Graph, logits_row: Tensor, n_vocab: int, name: str) -> None:
        self.ctx, self.graph, self.n_vocab, self.name = ctx, graph, n_vocab, name
        self.vals = logits_row       # F32 [n, 1]
        self.ids: Tensor | None = None  # I32 [n, 1]; None: all tokens in id order
        self.sorted = False
        self.token: Tensor | None = None
        self.inputs: list[tuple[int, str, Tensor]] = []  # (sampler index, key, tensor)
        self.n_backend = 0
        self._index = 0

    # ---- helpers the samplers call -------------------------------------------------------
    def input(self, sampler, key: str, type_name: str, n: int) -> Tensor:
        t = self.ctx.new_tensor_2d(GGMLType[type_name], n, 1, f"{self.name}.{self._index}.{key}").set_input()
        self.inputs.append((self._index, key, t))
        return t

    def _gather(self, idx: Tensor) -> None:
        """Reorder/narrow the candidates to positions idx (I32 [k, 1])."""
        c, n = self.ctx, self.vals.ne[0]
        k = idx.ne[0]
        self.vals = gg.reshape(c, gg.get_rows(c, gg.reshape(c, self.vals, 1, n, 1), idx), k, 1)
        self.ids = idx if self.ids is None else gg.reshape(c, gg.get_rows(c, gg.reshape(c, self.ids, 1, n, 1), idx), k, 1)

    def top_k(self, k: int) -> None:
        c, n = self.ctx, self.vals.ne[0]
        k = min(k, n)
        if self.sorted:
            self.vals = gg.cont(c, gg.view_2d(c, self.vals, k, 1, self.vals.nb[1], 0))
            if self.ids is not None:
                self.ids = gg.cont(c, gg.view_2d(c, self.ids, k, 1, self.ids.nb[1], 0))
        else:
            self._gather(gg.top_k(c, self.vals, k))
        self.sorted = True

    def sort(self) -> None:
        if not self.sorted:
            self._gather(gg.top_k(self.ctx, self.vals, self.vals.ne[0]))
            self.sorted = True

    def top_p_cut(self, p: float, min_keep: int) -> None:
        self.vals = gg.top_p_cut(self.ctx, self.vals, p, min_keep)

    def min_p_cut(self, p: float) -> None:
        self.vals = gg.min_p_cut(self.ctx, self.vals, p)

    def div(self, t: Tensor) -> None:
        self.vals = gg.div(self.ctx, self.vals, t)

    def add(self, t: Tensor) -> None:
        self.vals = gg.add(self.ctx, self.vals, t)
        self.sorted = False

    def penalties(self, counts: Tensor, repeat: float, freq: float, present: float) -> None:
        self.vals = gg.penalties(self.ctx, self.vals, counts, repeat, freq, present)
        self.sorted = False

    def argmax(self) -> Tensor:
        return gg.argmax(self.ctx, self.vals)

    def dist(self, u: Tensor) -> Tensor:
        return gg.sample_dist(self.ctx, self.vals, u, self.ids)

    def select(self, pos: Tensor) -> None:
        """The chosen token: pos (I32 [1]) is a position among the candidates, or already a
        token id (sample_dist maps through ids itself)."""
        if self.ids is not None and pos.op == gg.Op.ARGMAX:
            pos = gg.get_rows(self.ctx, gg.reshape(self.ctx, self.ids, 1, self.ids.ne[0], 1), pos)
        self.token = pos

    # ---- building --------------------------------------------------------------------------
    def build(self, chain, n_backend: int) -> None:
        for i, s in enumerate(chain.samplers[:n_backend]):
            self._index = i
            s.backend_build(self)
        self.n_backend = n_backend
        if self.token is not None:
            self.token.set_name(f"{self.name}.token")
        outs = [self.token] if self.token is not None else self._candidate_outputs()
        for t in outs:
            t.set_output()
            self.graph.visit(t)

    def _candidate_outputs(self) -> list[Tensor]:
        c = self.ctx
        if self.ids is None:  # nothing narrowed: the candidates are every token
            self.ids = c.new_tensor_2d(GGMLType.I32, self.vals.ne[0], 1, f"{self.name}.all_ids").set_input()
            self.inputs.append((-1, "all_ids", self.ids))
        self.vals = gg.cont(c, self.vals) if gg.OPS[self.vals.op].kind is gg.OpKind.VIEW else self.vals
        self.probs = gg.soft_max(c, self.vals)
        self.vals.set_name(f"{self.name}.logits")
        self.ids.set_name(f"{self.name}.ids")
        self.probs.set_name(f"{self.name}.probs")
        return [self.ids, self.vals, self.probs]

    @property
    def outputs(self) -> list[Tensor]:
        return [self.token] if self.token is not None else [self.ids, self.vals, self.probs]

    def fill_inputs(self, chain) -> None:
        for index, key, t in self.inputs:
            if index < 0:
                t.array().reshape(-1)[:] = np.arange(t.ne[0], dtype=np.int32)
            else:
                chain.samplers[index].backend_fill(key, t.array())

    def read(self, chain) -> "SampledRow":
        if self.token is not None:
            return SampledRow(chain, self.n_backend, token=int(self.token.array().reshape(-1)[0]))
        return SampledRow(chain, self.n_backend, ids=self.ids.array().reshape(-1).copy(),
                          logits=self.vals.array().reshape(-1).copy(), probs=self.probs.array().reshape(-1).copy(),
                          sorted=self.sorted)


@dataclass
class SampledRow:
    """What left the graph for one output row."""
    chain: object
    n_backend: int
    token: int | None = None
    ids: np.ndarray | None = None
    logits: np.ndarray | None = None
    probs: np.ndarray | None = None
    sorted: bool = False

    def candidates(self) -> Candidates:
        """The candidate list for the chain's CPU samplers (tokens cut in the graph dropped)."""
        keep = np.isfinite(self.logits) | (self.logits > 0)
        return Candidates(self.ids[keep].astype(np.int32), self.logits[keep].astype(np.float32),
                          None, self.sorted)


def build_rows(builder, chains: list) -> list[BackendRow | None]:
    """Append the backend samplers of each output row (chains[j] for row j, None: no sampling)."""
    logits = builder.logits
    n_vocab = logits.ne[0]
    rows: list[BackendRow | None] = []
    for j, chain in enumerate(chains):
        if chain is None:
            rows.append(None)
            continue
        row_view = gg.view_2d(builder.ctx, logits, n_vocab, 1, logits.nb[1], j * logits.nb[1])
        row = BackendRow(builder.ctx, builder.graph, row_view, n_vocab, f"sampler{j}")
        row.build(chain, chain.backend_prefix())
        rows.append(row)
    if all(r is not None for r in rows):
        logits.flags &= ~gg.Flag.OUTPUT  # the full logits no longer leave the graph
    return rows
