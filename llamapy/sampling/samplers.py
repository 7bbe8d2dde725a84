"""Samplers and sampler chains (llama.cpp's llama-sampling.cpp) over candidate arrays.

A `Candidates` array is llama_token_data_array: token ids, their logits, probabilities
(when a sampler computed them), whether it is sorted by logit (largest first) and the
selected position. A sampler's `apply` narrows or reshapes it; a chain applies its
samplers in order; `accept(token)` tells each sampler the token that was chosen.

Every sampler here also says whether it has a *backend form* (`backend_ok`), ops that do
the same inside the model graph (see backend.py). The sums, exps and sorts of both forms
are the kernels of ggmlpy.rowops, so both pick the same tokens.

Differences from llama.cpp, on purpose:
- sorts are stable (ties keep the lower token first; std::partial_sort leaves them open);
- `dist` draws its uniform number even when one candidate is left (llama.cpp skips the
  draw), so that the draw count does not depend on data the host cannot see when the
  draw happens in the graph.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ggmlpy import rowops

from ..errors import InputError
from .rng import DEFAULT_SEED, StdRng

F32 = np.float32


@dataclass
class Candidates:
    ids: np.ndarray          # int32 [n]
    logits: np.ndarray       # float32 [n]
    p: np.ndarray | None = None
    sorted: bool = False
    selected: int = -1

    @classmethod
    def from_logits(cls, logits: np.ndarray) -> "Candidates":
        logits = np.array(logits, dtype=np.float32).reshape(-1)
        return cls(np.arange(len(logits), dtype=np.int32), logits)

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, order: np.ndarray, sorted_: bool | None = None) -> None:
        self.ids, self.logits = self.ids[order], self.logits[order]
        if self.p is not None:
            self.p = self.p[order]
        if sorted_ is not None:
            self.sorted = sorted_

    def sort(self) -> None:
        if not self.sorted:
            self.take(rowops.sort_desc(self.logits), True)

    def softmax(self, do_sort: bool) -> None:
        """llama_sampler_softmax_impl: probabilities of the candidates (sorted first if asked)."""
        if len(self) == 0:
            raise InputError("softmax of an empty candidate list")
        if do_sort:
            self.sort()
        self.p = np.empty(len(self), dtype=np.float32)
        rowops.softmax(self.logits, self.p)

    @property
    def token(self) -> int:
        return int(self.ids[self.selected])


@dataclass
class BackendState:
    """What a backend form can rely on at its place in the chain (known before compute)."""
    full_vocab: bool = True   # candidates are all tokens, in id order
    sorted: bool = False
    selects: bool = False     # a token has been chosen


class Sampler:
    name = "sampler"

    def apply(self, cur: Candidates) -> None:
        raise NotImplementedError

    def accept(self, token: int) -> None:
        pass

    def reset(self) -> None:
        pass

    def clone(self) -> "Sampler":
        import copy
        return copy.deepcopy(self)

    # ---- backend form (ops in the graph); see backend.py ---------------------------------
    def backend_ok(self, state: BackendState) -> bool:
        """True if this sampler can run in the graph at this point; updates `state`."""
        return False

    def backend_key(self) -> tuple:
        """Everything the graph's structure depends on (values set by the host excluded)."""
        return (self.name,)

    def backend_build(self, row) -> None:
        raise NotImplementedError

    def backend_fill(self, key: str, array: np.ndarray) -> None:
        """Set this step's value of one of the inputs `backend_build` registered."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.name


# ---- selecting samplers -------------------------------------------------------------------------
class Greedy(Sampler):
    name = "greedy"

    def apply(self, cur: Candidates) -> None:
        cur.selected = int(np.argmax(cur.logits))  # first of equal maxima, as llama.cpp's strict >

    def backend_ok(self, state: BackendState) -> bool:
        state.selects = True
        return True

    def backend_build(self, row) -> None:
        row.select(row.argmax())


class Dist(Sampler):
    """A draw from the softmax of the candidates with a seeded std::mt19937."""
    name = "dist"

    def __init__(self, seed: int = DEFAULT_SEED) -> None:
        self.seed = seed
        self.rng = StdRng(seed)

    def apply(self, cur: Candidates) -> None:
        if len(cur) == 0:
            raise InputError("dist: no candidates left")
        rnd = self.rng.uniform()
        cur.p = np.empty(len(cur), dtype=np.float32)
        rowops.softmax(cur.logits, cur.p)
        cur.selected = int(rowops.dist_select(cur.logits, rnd))

    def reset(self) -> None:
        self.rng.seed(self.seed)

    def backend_ok(self, state: BackendState) -> bool:
        state.selects = True
        return True

    def backend_build(self, row) -> None:
        row.select(row.dist(row.input(self, "u", "F64", 1)))

    def backend_fill(self, key: str, array: np.ndarray) -> None:
        array.reshape(-1)[0] = self.rng.uniform()


# ---- narrowing samplers -----------------------------------------------------------------------------
class TopK(Sampler):
    name = "top-k"

    def __init__(self, k: int) -> None:
        self.k = int(k)

    def apply(self, cur: Candidates) -> None:
        if self.k <= 0:
            return
        k = min(self.k, len(cur))
        if not cur.sorted:
            order = rowops.top_k_desc(cur.logits, k)
            cur.take(order, True)
        else:
            cur.take(np.arange(k))

    def backend_ok(self, state: BackendState) -> bool:
        if self.k > 0:
            state.full_vocab, state.sorted = False, True
        return True

    def backend_key(self) -> tuple:
        return (self.name, self.k)

    def backend_build(self, row) -> None:
        if self.k > 0:
            row.top_k(self.k)


class TopP(Sampler):
    name = "top-p"

    def __init__(self, p: float, min_keep: int = 1) -> None:
        self.p, self.min_keep = float(p), int(min_keep)

    def apply(self, cur: Candidates) -> None:
        if self.p >= 1.0:
            return
        cur.softmax(True)
        keep = int(rowops.top_p_keep(cur.logits, self.p, self.min_keep))
        cur.take(np.arange(keep))

    def backend_ok(self, state: BackendState) -> bool:
        if self.p < 1.0:
            if not state.sorted:
                state.full_vocab = False
            state.sorted = True
        return True

    def backend_key(self) -> tuple:
        return (self.name, self.p, self.min_keep)

    def backend_build(self, row) -> None:
        if self.p < 1.0:
            row.sort()
            row.top_p_cut(self.p, self.min_keep)


class MinP(Sampler):
    name = "min-p"

    def __init__(self, p: float, min_keep: int = 1) -> None:
        self.p, self.min_keep = float(p), int(min_keep)

    def apply(self, cur: Candidates) -> None:
        if self.p <= 0.0 or len(cur) == 0:
            return
        if not cur.sorted:
            keep = cur.logits >= rowops.min_p_threshold(cur.logits, self.p)
            if keep.any() and keep.sum() >= self.min_keep:
                cur.take(np.flatnonzero(keep))
                return
        cur.sort()
        threshold = rowops.min_p_threshold(cur.logits, self.p)
        i = 1
        while i < len(cur) and not (cur.logits[i] < threshold and i >= self.min_keep):
            i += 1
        cur.take(np.arange(i))

    def backend_ok(self, state: BackendState) -> bool:
        return self.p <= 0.0 or (self.min_keep <= 1 and self.p <= 1.0)

    def backend_key(self) -> tuple:
        return (self.name, self.p)

    def backend_build(self, row) -> None:
        if self.p > 0.0:
            row.min_p_cut(self.p)


class Typical(Sampler):
    """Locally typical sampling (CPU only: it reorders by a score, not by logit)."""
    name = "typical"

    def __init__(self, p: float, min_keep: int = 1) -> None:
        self.p, self.min_keep = float(p), int(min_keep)

    def apply(self, cur: Candidates) -> None:
        if self.p >= 1.0:
            return
        cur.softmax(True)
        with np.errstate(divide="ignore", invalid="ignore"):
            logp = np.log(cur.p)
            terms = np.where(cur.p > 0, -cur.p * logp, F32(0))
            entropy = F32(0)
            for t in terms:
                entropy = F32(entropy + t)
            shifted = np.abs(-logp - entropy).astype(np.float32)
        order = np.argsort(shifted, kind="stable")
        cum, last = F32(0), len(order)
        for i, idx in enumerate(order):
            cum = F32(cum + cur.p[idx])
            if cum > F32(self.p) and (self.min_keep == 0 or i >= self.min_keep - 1):
                last = i + 1
                break
        cur.take(order[:last], False)


def _temp_impl(cur: Candidates, temp: float) -> None:
    if temp <= 0.0:
        keep = int(np.argmax(cur.logits))
        logits = np.full_like(cur.logits, -np.inf)
        logits[keep] = cur.logits[keep]
        cur.logits = logits
        return
    cur.logits = (cur.logits / F32(temp)).astype(np.float32)


class Temp(Sampler):
    name = "temp"

    def __init__(self, temp: float) -> None:
        self.temp = float(temp)

    def apply(self, cur: Candidates) -> None:
        _temp_impl(cur, self.temp)

    def backend_ok(self, state: BackendState) -> bool:
        return self.temp > 0.0

    def backend_build(self, row) -> None:
        row.div(row.input(self, "t", "F32", 1))

    def backend_fill(self, key: str, array: np.ndarray) -> None:
        array.reshape(-1)[0] = self.temp


class TempExt(Temp):
    """Dynamic temperature: temp +- delta, scaled by the normalized entropy ** exponent."""
    name = "temp-ext"

    def __init__(self, temp: float, delta: float, exponent: float = 1.0) -> None:
        super().__init__(temp)
        self.delta, self.exponent = float(delta), float(exponent)

    def apply(self, cur: Candidates) -> None:
        if self.delta <= 0:
            _temp_impl(cur, self.temp)
            return
        min_temp = max(0.0, self.temp - self.delta)
        max_temp = self.temp + self.delta
        if len(cur) <= 1:
            return
        max_entropy = -math.log(1.0 / len(cur))
        cur.softmax(True)
        p = cur.p[cur.p > 0].astype(np.float64)
        entropy = float(-(p * np.log(p)).sum())
        with np.errstate(all="ignore"):  # as llama.cpp's powf: 0 ** -x is inf, an overflow inf, never an error
            dyn = float(min_temp + (max_temp - min_temp) * np.power(np.float64(entropy / max_entropy), self.exponent))
        _temp_impl(cur, dyn)
        e = np.exp(cur.logits.astype(np.float64) - float(cur.logits[0]))
        cur.p = (e / e.sum()).astype(np.float32)

    def backend_ok(self, state: BackendState) -> bool:
        return self.delta <= 0 and self.temp > 0.0


class Penalties(Sampler):
    """Repeat (multiplicative), frequency and presence penalties over the last `last_n` accepted tokens."""
    name = "penalties"

    def __init__(self, last_n: int = 64, repeat: float = 1.0, freq: float = 0.0, present: float = 0.0) -> None:
        if last_n < 0:
            raise InputError("penalties: last_n must be >= 0")
        self.last_n, self.repeat, self.freq, self.present = int(last_n), float(repeat), float(freq), float(present)
        self.prev: deque[int] = deque()
        self.counts: dict[int, int] = {}

    @property
    def neutral(self) -> bool:
        return self.last_n == 0 or (self.repeat == 1.0 and self.freq == 0.0 and self.present == 0.0)

    def accept(self, token: int) -> None:
        if self.last_n == 0:
            return
        self.counts[token] = self.counts.get(token, 0) + 1
        if len(self.prev) >= self.last_n:
            old = self.prev.popleft()
            self.counts[old] -= 1
            if self.counts[old] == 0:
                del self.counts[old]
        self.prev.append(token)

    def reset(self) -> None:
        self.prev.clear()
        self.counts.clear()

    def apply(self, cur: Candidates) -> None:
        if self.neutral:
            return
        counts = np.zeros(len(cur), dtype=np.float32)
        if self.counts and len(cur):
            seen = np.fromiter(self.counts, dtype=np.int64, count=len(self.counts))
            by_id = np.zeros(max(int(cur.ids.max()), int(seen.max())) + 1, dtype=np.float32)
            by_id[seen] = np.fromiter(self.counts.values(), dtype=np.float32, count=len(self.counts))
            counts = by_id[cur.ids]
        cur.logits = rowops.apply_penalties(cur.logits, counts, self.repeat, self.freq, self.present)
        cur.sorted = False

    def backend_ok(self, state: BackendState) -> bool:
        if self.neutral:
            return True
        if not state.full_vocab:
            return False
        state.sorted = False
        return True

    def backend_key(self) -> tuple:
        return (self.name, self.neutral, self.repeat, self.freq, self.present)

    def backend_build(self, row) -> None:
        if not self.neutral:
            row.penalties(row.input(self, "counts", "F32", row.n_vocab), self.repeat, self.freq, self.present)

    def backend_fill(self, key: str, array: np.ndarray) -> None:
        a = array.reshape(-1)
        a.fill(0)
        for t, c in self.counts.items():
            a[t] = c


class LogitBias(Sampler):
    name = "logit-bias"

    def __init__(self, n_vocab: int, biases: dict[int, float] | list[tuple[int, float]]) -> None:
        self.n_vocab = n_vocab
        self.bias = np.zeros(n_vocab, dtype=np.float32)
        items = biases.items() if isinstance(biases, dict) else biases
        for t, b in items:
            if not 0 <= t < n_vocab:
                raise InputError(f"logit-bias: token {t} out of range")
            self.bias[t] = F32(self.bias[t] + F32(b))
        self.active = bool(np.any(self.bias != 0))

    def apply(self, cur: Candidates) -> None:
        if not self.active:
            return
        cur.logits = (cur.logits + self.bias[cur.ids]).astype(np.float32)
        cur.sorted = False

    def backend_ok(self, state: BackendState) -> bool:
        if not self.active:
            return True
        if not state.full_vocab:
            return False
        state.sorted = False
        return True

    def backend_key(self) -> tuple:
        return (self.name, self.active)

    def backend_build(self, row) -> None:
        if self.active:
            row.add(row.input(self, "bias", "F32", row.n_vocab))

    def backend_fill(self, key: str, array: np.ndarray) -> None:
        array.reshape(-1)[:] = self.bias


# ---- the chain --------------------------------------------------------------------------------------
@dataclass
class SamplerChain(Sampler):
    """Samplers applied in order (llama_sampler_chain). `sample(ctx, idx)` picks the token of
    output `idx` of the last decode: from the graph when the context sampled it there (the
    chain attached with Context.set_sampler), otherwise from the logits on the CPU."""
    samplers: list[Sampler] = field(default_factory=list)
    n_sample: int = 0
    t_sample: float = 0.0
    name = "chain"

    def add(self, sampler: Sampler) -> "SamplerChain":
        self.samplers.append(sampler)
        return self

    def __len__(self) -> int:
        return len(self.samplers)

    def apply(self, cur: Candidates, start: int = 0) -> None:
        for s in self.samplers[start:]:
            s.apply(cur)

    def accept(self, token: int) -> None:
        for s in self.samplers:
            s.accept(token)
        self.n_sample += 1

    def reset(self) -> None:
        for s in self.samplers:
            s.reset()

    def backend_prefix(self) -> int:
        """How many leading samplers run in the graph: the longest run with a backend form
        (ending at the first sampler that selects a token)."""
        state = BackendState()
        n = 0
        for s in self.samplers:
            if not s.backend_ok(state):
                break
            n += 1
            if state.selects:
                break
        return n

    def backend_signature(self) -> tuple:
        n = self.backend_prefix()
        return tuple(s.backend_key() for s in self.samplers[:n])

    def sample(self, ctx, idx: int = -1) -> int:
        import time
        t0 = time.perf_counter()
        got = ctx.get_sampled_ith(idx) if hasattr(ctx, "get_sampled_ith") else None
        if got is not None and got.chain is self:
            if got.token is not None:
                token = int(got.token)
            else:
                cur = got.candidates()
                self.apply(cur, got.n_backend)
                token = self._selected(cur)
        else:
            cur = Candidates.from_logits(ctx.get_logits_ith(idx))
            self.apply(cur)
            token = self._selected(cur)
        self.accept(token)
        self.t_sample += time.perf_counter() - t0
        return token

    def sample_logits(self, logits: np.ndarray) -> int:
        """Apply the chain to one row of logits, accept and return the token."""
        cur = Candidates.from_logits(logits)
        self.apply(cur)
        token = self._selected(cur)
        self.accept(token)
        return token

    @staticmethod
    def _selected(cur: Candidates) -> int:
        if not 0 <= cur.selected < len(cur):
            raise InputError("the sampler chain selected no token (end it with greedy or dist)")
        return cur.token

    def __repr__(self) -> str:
        return " -> ".join(s.name for s in self.samplers)


def default_chain(n_vocab: int, seed: int = DEFAULT_SEED, temp: float = 0.8, top_k: int = 40, top_p: float = 0.95,
                  min_p: float = 0.05, typical_p: float = 1.0, repeat_penalty: float = 1.0, repeat_last_n: int = 64,
                  freq_penalty: float = 0.0, presence_penalty: float = 0.0, dynatemp_range: float = 0.0,
                  dynatemp_exp: float = 1.0, logit_bias: dict[int, float] | None = None, min_keep: int = 0) -> SamplerChain:
    """llama.cpp's common sampler order: logit-bias, penalties, top-k, typical, top-p, min-p,
    temperature, dist; temp <= 0 is greedy (after bias and penalties)."""
    chain = SamplerChain()
    if logit_bias:
        chain.add(LogitBias(n_vocab, logit_bias))
    if repeat_penalty != 1.0 or freq_penalty != 0.0 or presence_penalty != 0.0:
        chain.add(Penalties(repeat_last_n, repeat_penalty, freq_penalty, presence_penalty))
    if temp <= 0:
        return chain.add(Greedy())
    keep = max(min_keep, 1)
    if top_k > 0:
        chain.add(TopK(top_k))
    if typical_p < 1.0:
        chain.add(Typical(typical_p, keep))
    if top_p < 1.0:
        chain.add(TopP(top_p, keep))
    if min_p > 0.0:
        chain.add(MinP(min_p, keep))
    chain.add(TempExt(temp, dynatemp_range, dynatemp_exp) if dynatemp_range > 0 else Temp(temp))
    return chain.add(Dist(seed))
