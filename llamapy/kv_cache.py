"""The KV cache: per-layer K and V tensors, and the cells that say what each slot holds.

The cache has one or more *streams*. With a unified cache all sequences share one
stream; otherwise sequence s owns stream s and its own kv_size cells, so that several
sequences decode side by side as one batched attention (what llama.cpp does when
`kv_unified` is false). A cell holds a position and the set of sequences that see it.
"""
from __future__ import annotations

import numpy as np
from numba import njit

import ggmlpy
from ggmlpy import GGMLType, Tensor

from .batch import UBatch
from .errors import LlamapyError
from .hparams import HParams

N_KV_PAD = 256  # attention spans the used cells rounded up to this, so graphs repeat


class KVCacheFullError(LlamapyError):
    """No room for a ubatch: the context is too small for the sequences decoded."""


class KVCache:
    """The cache of some layers (all by default). With n_swa > 0 its layers attend through a
    sliding window: a cell that no sequence can attend to any more is free again."""

    def __init__(self, hp: HParams, kv_size: int, n_seq_max: int = 1, unified: bool = True,
                 type_k: GGMLType = GGMLType.F32, type_v: GGMLType = GGMLType.F32,
                 layers: list[int] | None = None, n_swa: int = 0) -> None:
        if kv_size <= 0:
            raise LlamapyError(f"KV cache size must be positive, got {kv_size}")
        self.hp = hp
        self.kv_size = kv_size
        self.n_seq_max = n_seq_max
        self.unified = unified
        self.n_stream = 1 if unified else n_seq_max
        self.n_swa = n_swa
        self.layers = list(range(hp.n_layer)) if layers is None else list(layers)
        ctx = ggmlpy.Context(no_alloc=False)
        self.k: dict[int, Tensor] = {}  # model layer index -> [n_embd_k_gqa, kv_size, n_stream]
        self.v: dict[int, Tensor] = {}
        for il in self.layers:
            self.k[il] = ctx.new_tensor_3d(type_k, hp.n_embd_k_gqa, kv_size, self.n_stream, f"cache_k_l{il}")
            self.v[il] = ctx.new_tensor_3d(type_v, hp.n_embd_v_gqa, kv_size, self.n_stream, f"cache_v_l{il}")
        self.pos = np.full((self.n_stream, kv_size), -1, dtype=np.int32)
        self.seqs = np.zeros((self.n_stream, kv_size), dtype=np.uint64)
        self.shift = np.zeros((self.n_stream, kv_size), dtype=np.int32)
        self.has_shift = False

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes() for t in [*self.k.values(), *self.v.values()])

    def stream_of(self, seq: int) -> int:
        return 0 if self.unified else seq

    # ---- placing ubatches -------------------------------------------------------------
    def find_slot(self, ub: UBatch) -> np.ndarray:
        """Free cells for the ubatch's tokens, as global row indices (stream * kv_size + cell)."""
        rows = np.empty(ub.n_tokens, dtype=np.int64)
        if self.n_swa <= 0:  # free cells are the empty ones: found in one pass, in numba
            if first_empty_cells(self.pos, ub.stream0, ub.n_seqs, ub.n_seq_tokens, rows):
                return rows
        for j in range(ub.n_seqs):
            stream = ub.stream0 + j
            free = np.flatnonzero(self.free_cells(stream))
            if len(free) < ub.n_seq_tokens:
                raise KVCacheFullError(
                    f"KV cache full: {ub.n_seq_tokens} tokens need cells but only {len(free)} of "
                    f"{self.kv_size} are free (increase n_ctx)")
            rows[j * ub.n_seq_tokens:(j + 1) * ub.n_seq_tokens] = stream * self.kv_size + free[:ub.n_seq_tokens]
        return rows

    def free_cells(self, stream: int) -> np.ndarray:
        """Cells a new token may take: empty ones and, with a sliding window, those that no
        sequence can attend to any more (for each of the cell's sequences, the next
        position, one past its largest, is n_swa or more ahead of the cell's position)."""
        pos, seqs = self.pos[stream], self.seqs[stream]
        free = pos < 0
        if self.n_swa > 0:
            evictable = ~free
            for seq in range(self.n_seq_max):
                bit = np.uint64(1) << np.uint64(seq)
                member = (seqs & bit) != 0
                if not member.any():
                    continue
                next_pos = int(pos[member].max()) + 1
                evictable &= ~member | (next_pos - pos >= self.n_swa)
            free |= evictable
        return free

    def evict(self) -> int:
        """Forget every cell no sequence can attend to any more; returns how many."""
        n = 0
        for stream in range(self.n_stream):
            gone = self.free_cells(stream) & (self.pos[stream] >= 0)
            self.pos[stream, gone] = -1
            self.seqs[stream, gone] = 0
            self.shift[stream, gone] = 0
            n += int(gone.sum())
        return n

    def apply(self, ub: UBatch, rows: np.ndarray) -> None:
        """The ubatch's tokens take cells `rows` (the K written there is roped at its position already);
        a token's cell is seen by its sequence and those of its `seq_shared` bits."""
        place_tokens(self.pos, self.seqs, self.shift, rows, ub.pos, ub.seq_id)
        if ub.seq_shared is not None:
            streams, cells = np.divmod(rows, self.kv_size)
            self.seqs[streams, cells] |= ub.seq_shared

    def place(self, rows: np.ndarray, pos: np.ndarray, seqs, shift: np.ndarray | None = None) -> None:
        """Cells `rows` (global row indices) now hold positions `pos`, seen by the sequences
        whose bits are in `seqs`; `shift` is the re-rope their K still awaits (None: none)."""
        streams, cells = np.divmod(rows, self.kv_size)
        self.pos[streams, cells] = pos
        self.seqs[streams, cells] = seqs
        if shift is None:
            self.shift[streams, cells] = 0
        else:
            self.shift[streams, cells] = shift
            self.has_shift = self.has_shift or bool(np.any(shift))

    def set_cells(self, pos: np.ndarray, seqs: np.ndarray, shift: np.ndarray) -> None:
        """Replace every cell's position, sequence bits and pending shift ([n_stream, kv_size]
        each), as a saved whole-cache state."""
        self.pos[...], self.seqs[...], self.shift[...] = pos, seqs, shift
        self.has_shift = bool(self.shift.any())

    def n_kv(self, ub: UBatch) -> int:
        """How many leading cells attention must span for this ubatch's streams."""
        n = cells_in_use(self.pos, ub.stream0, ub.n_seqs)
        return min(self.kv_size, max(N_KV_PAD, -(-n // N_KV_PAD) * N_KV_PAD))

    def fill_mask(self, ub: UBatch, n_kv: int, mask: np.ndarray, n_swa: int = 0) -> None:
        """0 where a token may attend to a cell, -inf elsewhere; mask: [n_seqs, 1, n_seq_tokens, n_kv].

        A cell is visible to a token when it belongs to the token's sequence and holds an
        earlier or equal position (and, with a sliding window, one less than n_swa back).
        """
        fill_kq_mask(self.pos, self.seqs, ub.stream0, n_kv, ub.pos, ub.seq_id, n_swa, mask)

    # ---- sequence operations (llama_memory_seq_*) -----------------------------------------
    def _range(self, p0: int, p1: int) -> np.ndarray:
        p0 = 0 if p0 < 0 else p0
        p1 = np.iinfo(np.int32).max if p1 < 0 else p1
        return (self.pos >= p0) & (self.pos < p1)

    def _members(self, seq: int) -> np.ndarray:
        if seq < 0:
            return self.pos >= 0
        return (self.seqs & np.uint64(1 << seq)) != 0

    def clear(self) -> None:
        self.pos.fill(-1)
        self.seqs.fill(0)
        self.shift.fill(0)
        self.has_shift = False

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        """Forget seq's cells with positions in [p0, p1) (seq < 0: every sequence)."""
        sel = self._members(seq) & self._range(p0, p1)
        if seq < 0:
            self.seqs[sel] = 0
        else:
            self.seqs[sel] &= ~np.uint64(1 << seq)
        self.pos[self.seqs == 0] = -1
        return True

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make dst see src's cells in [p0, p1) (copies K/V across streams when not unified)."""
        if src == dst:
            return
        sel = self._members(src) & self._range(p0, p1)
        if self.unified:
            self.seqs[sel] |= np.uint64(1 << dst)
            return
        s_src, s_dst = self.stream_of(src), self.stream_of(dst)
        self.seq_rm(dst)
        cells = np.flatnonzero(sel[s_src])
        for k, v in zip(self.k.values(), self.v.values()):
            for t in (k, v):
                a = t.array()[0]
                a[s_dst, cells] = a[s_src, cells]
        self.pos[s_dst, cells] = self.pos[s_src, cells]
        self.shift[s_dst, cells] = self.shift[s_src, cells]  # the copied K awaits the same re-rope
        self.seqs[s_dst, cells] = np.uint64(1 << dst)

    def seq_keep(self, seq: int) -> None:
        keep = self._members(seq)
        self.seqs[~keep] = 0
        self.seqs[keep] = np.uint64(1 << seq)
        self.pos[self.seqs == 0] = -1

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        """Shift seq's positions in [p0, p1) by delta; K is re-roped before the next decode."""
        if delta == 0:
            return
        sel = self._members(seq) & self._range(p0, p1)
        self.pos[sel] += delta
        self.shift[sel] += delta
        gone = sel & (self.pos < 0)
        self.seqs[gone] = 0
        self.pos[gone] = -1
        self.has_shift = True

    def seq_pos_max(self, seq: int) -> int:
        sel = self._members(seq)
        return int(self.pos[sel].max()) if sel.any() else -1

    def seq_pos_min(self, seq: int) -> int:
        sel = self._members(seq)
        return int(self.pos[sel].min()) if sel.any() else -1


class KVMemory:
    """A model's KV caches: one for every layer, or, when some layers attend through a
    sliding window (llama.cpp's iswa cache), one for the global layers and one for the
    window layers. The window cache needs only n_swa cells per sequence plus a ubatch,
    since its cells are reused once no sequence can attend to them.

    Sequence operations apply to every cache; placement, spans and masks are per cache.
    """

    def __init__(self, hp: HParams, kv_size: int, n_seq_max: int = 1, unified: bool = True,
                 type_k: GGMLType = GGMLType.F32, type_v: GGMLType = GGMLType.F32, n_ubatch: int | None = None) -> None:
        swa = [il for il in range(hp.n_layer) if hp.is_swa(il) and hp.n_swa > 0]
        full = [il for il in range(hp.n_layer) if il not in swa]
        self.caches: list[KVCache] = []
        if full:
            self.caches.append(KVCache(hp, kv_size, n_seq_max, unified, type_k, type_v, layers=full))
        if swa:
            seqs_per_stream = n_seq_max if unified else 1
            size = hp.n_swa * seqs_per_stream + (kv_size if n_ubatch is None else n_ubatch)
            size = min(kv_size, -(-size // N_KV_PAD) * N_KV_PAD)
            self.caches.append(KVCache(hp, size, n_seq_max, unified, type_k, type_v, layers=swa, n_swa=hp.n_swa))
        self.cache_index = {il: i for i, c in enumerate(self.caches) for il in c.layers}

    def cache_of(self, il: int) -> KVCache:
        return self.caches[self.cache_index[il]]

    @property
    def unified(self) -> bool:
        return self.caches[0].unified

    @property
    def n_stream(self) -> int:
        return self.caches[0].n_stream

    @property
    def k(self) -> dict[int, Tensor]:
        return {il: t for c in self.caches for il, t in c.k.items()}

    @property
    def v(self) -> dict[int, Tensor]:
        return {il: t for c in self.caches for il, t in c.v.items()}

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    @property
    def has_shift(self) -> bool:
        return any(c.has_shift for c in self.caches)

    @has_shift.setter
    def has_shift(self, value: bool) -> None:
        for c in self.caches:
            c.has_shift = value

    def snapshot(self):
        return [(c.pos.copy(), c.seqs.copy(), c.shift.copy()) for c in self.caches]

    def restore(self, saved) -> None:
        for c, (pos, seqs, shift) in zip(self.caches, saved):
            c.pos[...], c.seqs[...], c.shift[...] = pos, seqs, shift

    def clear(self) -> None:
        for c in self.caches:
            c.clear()

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        return all([c.seq_rm(seq, p0, p1) for c in self.caches])

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        for c in self.caches:
            c.seq_cp(src, dst, p0, p1)

    def seq_keep(self, seq: int) -> None:
        for c in self.caches:
            c.seq_keep(seq)

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        for c in self.caches:
            c.seq_add(seq, p0, p1, delta)

    def seq_pos_max(self, seq: int) -> int:
        return max(c.seq_pos_max(seq) for c in self.caches)

    def seq_pos_min(self, seq: int) -> int:
        """The smallest position every cache still holds (the window cache forgets early ones)."""
        return max(c.seq_pos_min(seq) for c in self.caches)


@njit(cache=True)
def fill_kq_mask(cell_pos, cell_seqs, stream0, n_kv, tok_pos, tok_seq, n_swa, mask):
    """mask[j, 0, i, c] = 0 where token i of stream stream0 + j (position tok_pos, sequence
    tok_seq) may attend to cell c < n_kv of that stream (position cell_pos, sequence bits
    cell_seqs), -inf elsewhere: the cell holds the token's sequence at an earlier or equal
    position, less than n_swa back when n_swa > 0."""
    n_seqs, n_tok = mask.shape[0], mask.shape[2]
    for t in range(n_seqs * n_tok):
        j, i = t // n_tok, t % n_tok
        p, bit = tok_pos[t], np.uint64(1) << np.uint64(tok_seq[t])
        row = mask[j, 0, i]
        for c in range(n_kv):
            cp = cell_pos[stream0 + j, c]
            visible = (cell_seqs[stream0 + j, c] & bit) != 0 and cp >= 0 and cp <= p and (n_swa <= 0 or p - cp < n_swa)
            row[c] = np.float32(0.0) if visible else np.float32(-np.inf)


# Per-decode cell bookkeeping in numba: on a generation step these run once per token, where
# numpy's passes over every cell of a long context (and their temporaries) cost more than the step.
@njit(cache=True)
def first_empty_cells(pos, stream0, n_seqs, n_seq_tokens, rows):
    """rows[j * n_seq_tokens + i] = the global row (stream * kv_size + cell) of the i-th
    empty cell of stream stream0 + j; False (rows unfinished) when a stream has too few."""
    kv_size = pos.shape[1]
    for j in range(n_seqs):
        stream, found = stream0 + j, 0
        for c in range(kv_size):
            if found == n_seq_tokens:
                break
            if pos[stream, c] < 0:
                rows[j * n_seq_tokens + found] = stream * kv_size + c
                found += 1
        if found < n_seq_tokens:
            return False
    return True


@njit(cache=True)
def place_tokens(pos, seqs, shift, rows, tok_pos, tok_seq):
    """Cells `rows` (global row indices) hold the tokens' positions, each seen by its own
    sequence, with no shift pending."""
    kv_size = pos.shape[1]
    for t in range(rows.shape[0]):
        s, c = rows[t] // kv_size, rows[t] % kv_size
        pos[s, c] = tok_pos[t]
        seqs[s, c] = np.uint64(1) << np.uint64(tok_seq[t])
        shift[s, c] = 0


@njit(cache=True)
def cells_in_use(pos, stream0, n_seqs):
    """One past the last used cell of streams stream0 .. stream0 + n_seqs - 1 (0: none used).
    Blocks from the end, each a max LLVM vectorises (indexed from 0 through a slice: numba's
    negative-index check on a variable start keeps a loop scalar), until one holds a used cell."""
    n = 0
    for j in range(n_seqs):
        row = pos[stream0 + j]
        hi = row.shape[0]
        while hi > n:
            lo = max(n, hi - 256)
            blk = row[lo:hi]
            top = np.int32(-1)
            for c in range(blk.shape[0]):
                top = max(top, blk[c])
            if top >= 0:
                for c in range(blk.shape[0] - 1, -1, -1):
                    if blk[c] >= 0:
                        n = lo + c + 1
                        break
                break
            hi = lo
    return n
