"""The KV cache (llamapy/kv_cache.py) and its use by Context.decode.

Unit tests drive KVCache directly with a tiny hand-made HParams: cell placement
(find_slot/apply), the attended span (n_kv), the attention mask, and the sequence
operations (llama_memory_seq_*), on the unified cache and on one stream per sequence.

Integration tests run the real stories260K model: batching several sequences, removing
one, the ubatch size, and the K shift (seq_add) must not change logits beyond float
rounding. Tolerances: 1e-4 absolute on logits (whose magnitudes are O(1..10)) when the
cache is F32, so the two runs differ only by summation order; with the default F16
cache, a shift rounds the rotated keys to F16 once more than a fresh run does, so
logits differ by O(1e-3) there (still 1000 times less than not shifting at all).
"""
from __future__ import annotations

import numpy as np
import pytest

import llamapy
from ggmlpy import GGMLType
from llamapy.batch import Batch, UBatch
from llamapy.errors import LlamapyError
from llamapy.hparams import HParams
from llamapy.kv_cache import N_KV_PAD, KVCache, KVCacheFullError, KVMemory, cells_in_use

ATOL = 1e-4
# exact comparisons need F32 attention: an F32 cache, and no flash attention (which, as in
# llama.cpp, reads the keys and values as F16)
F32_KV = dict(type_k=GGMLType.F32, type_v=GGMLType.F32, flash_attn=False)


def tiny_hparams(n_layer: int = 2) -> HParams:
    return HParams(arch="llama", n_vocab=32, n_ctx_train=64, n_embd=8, n_layer=n_layer, n_head=2, n_head_kv=1,
                   n_ff=16, n_embd_head_k=4, n_embd_head_v=4, n_rot=4, norm_rms_eps=1e-5,
                   rope_freq_base=10000.0, rope_freq_scale=1.0, rope_type=0)


def ubatch(pos, seq, stream0: int = 0, n_seqs: int = 1) -> UBatch:
    pos = np.asarray(pos, dtype=np.int32)
    seq = np.asarray(seq, dtype=np.int32)
    n = len(pos)
    return UBatch(np.zeros(n, dtype=np.int32), pos, seq, np.ones(n, dtype=bool), np.arange(n),
                  n // n_seqs, n_seqs, stream0)


def place(kv: KVCache, pos, seq, stream0: int = 0, n_seqs: int = 1) -> np.ndarray:
    ub = ubatch(pos, seq, stream0, n_seqs)
    rows = kv.find_slot(ub)
    kv.apply(ub, rows)
    return rows


def cells_of(kv: KVCache, seq: int, stream: int = 0) -> list[tuple[int, int]]:
    """(cell, pos) of the cells seq sees in a stream."""
    bit = np.uint64(1 << seq)
    return [(int(c), int(kv.pos[stream, c])) for c in np.flatnonzero(kv.seqs[stream] & bit)]


# ---- placing ubatches ---------------------------------------------------------------------------
def test_find_slot_apply_unified():
    kv = KVCache(tiny_hparams(), 8, n_seq_max=2)
    assert kv.n_stream == 1 and kv.k[0].ne[:3] == (4, 8, 1)
    rows = place(kv, [0, 1, 2], [0, 0, 0])
    np.testing.assert_array_equal(rows, [0, 1, 2])
    rows = place(kv, [0, 1], [1, 1])
    np.testing.assert_array_equal(rows, [3, 4])
    assert cells_of(kv, 0) == [(0, 0), (1, 1), (2, 2)]
    assert cells_of(kv, 1) == [(3, 0), (4, 1)]
    np.testing.assert_array_equal(kv.pos[0, 5:], -1)
    # holes left by removal are reused first
    kv.seq_rm(0, 1, -1)
    rows = place(kv, [5, 6, 7], [1, 1, 1])
    np.testing.assert_array_equal(rows, [1, 2, 5])


def test_find_slot_streams():
    kv = KVCache(tiny_hparams(), 6, n_seq_max=3, unified=False)
    assert kv.n_stream == 3 and kv.k[1].ne[:3] == (4, 6, 3)
    place(kv, [0], [1], stream0=1)
    # sequences 1 and 2, two tokens each, go to their own streams
    rows = place(kv, [1, 2, 0, 1], [1, 1, 2, 2], stream0=1, n_seqs=2)
    np.testing.assert_array_equal(rows, [6 + 1, 6 + 2, 12 + 0, 12 + 1])
    assert cells_of(kv, 1, stream=1) == [(0, 0), (1, 1), (2, 2)]
    assert cells_of(kv, 2, stream=2) == [(0, 0), (1, 1)]
    assert (kv.pos[0] < 0).all()


def test_kv_cache_full():
    kv = KVCache(tiny_hparams(), 4)
    place(kv, [0, 1, 2], [0, 0, 0])
    with pytest.raises(KVCacheFullError, match="KV cache full"):
        kv.find_slot(ubatch([3, 4], [0, 0]))
    assert issubclass(KVCacheFullError, LlamapyError)
    place(kv, [3], [0])  # exactly full is fine
    kv.seq_rm(0, 0, 2)
    np.testing.assert_array_equal(place(kv, [4, 5], [0, 0]), [0, 1])
    # a stream fills on its own, whatever the others hold
    kv = KVCache(tiny_hparams(), 2, n_seq_max=2, unified=False)
    place(kv, [0, 1], [1, 1], stream0=1)
    place(kv, [0, 1], [0, 0], stream0=0)
    with pytest.raises(KVCacheFullError):
        kv.find_slot(ubatch([2], [1], stream0=1))


def test_kv_size_must_be_positive():
    with pytest.raises(LlamapyError):
        KVCache(tiny_hparams(), 0)


def test_n_kv():
    kv = KVCache(tiny_hparams(), 1024)
    ub = ubatch([0, 1, 2], [0, 0, 0])
    assert kv.n_kv(ub) == N_KV_PAD  # nothing placed yet: still one padded block
    kv.apply(ub, kv.find_slot(ub))
    assert kv.n_kv(ub) == N_KV_PAD
    kv.pos[0, 300] = 5
    kv.seqs[0, 300] = 1
    assert kv.n_kv(ub) == 2 * N_KV_PAD  # spans the last used cell, rounded up
    kv.pos[0, 1023] = 6
    kv.seqs[0, 1023] = 1
    assert kv.n_kv(ub) == 1024
    assert KVCache(tiny_hparams(), 100).n_kv(ub) == 100  # never beyond the cache
    # per stream: only the ubatch's streams count
    kv = KVCache(tiny_hparams(), 1024, n_seq_max=2, unified=False)
    kv.pos[1, 700] = 0
    kv.seqs[1, 700] = 2
    assert kv.n_kv(ubatch([0], [0], stream0=0)) == N_KV_PAD
    assert kv.n_kv(ubatch([0], [1], stream0=1)) == 3 * N_KV_PAD
    assert kv.n_kv(ubatch([0, 0], [0, 1], stream0=0, n_seqs=2)) == 3 * N_KV_PAD


def test_cells_in_use_against_numpy():
    """The span kernel (blocks from the end) against a plain numpy reading, on used cells at
    and around its block edges, in one stream of several and across streams."""
    rng = np.random.default_rng(0)
    for kv_size in (1, 100, 256, 257, 1024, 4096):
        for trial in range(40):
            pos = np.full((3, kv_size), -1, dtype=np.int32)
            for s in range(3):
                k = int(rng.integers(0, 4))
                cells = rng.choice([0, kv_size - 1, kv_size // 2, max(0, kv_size - 256), max(0, kv_size - 257)] +
                                   list(rng.integers(0, kv_size, 3)), size=k)
                pos[s, cells] = rng.integers(0, 50, size=k)
            for s0, n in ((0, 1), (1, 1), (2, 1), (0, 2), (1, 2), (0, 3)):
                used = pos[s0:s0 + n] >= 0
                want = max((int(np.flatnonzero(u)[-1]) + 1 if u.any() else 0) for u in used)
                assert cells_in_use(pos, s0, n) == want, (kv_size, trial, s0, n)


def expected_mask(kv: KVCache, ub: UBatch, n_kv: int, n_swa: int) -> np.ndarray:
    """Cell by cell, the rule the mask must follow."""
    out = np.full((ub.n_seqs, 1, ub.n_seq_tokens, n_kv), -np.inf, dtype=np.float32)
    for j in range(ub.n_seqs):
        stream = ub.stream0 + j
        for t in range(ub.n_seq_tokens):
            i = j * ub.n_seq_tokens + t
            for c in range(n_kv):
                p = kv.pos[stream, c]
                if p < 0 or not (int(kv.seqs[stream, c]) >> int(ub.seq_id[i])) & 1:
                    continue
                if p <= ub.pos[i] and (n_swa == 0 or ub.pos[i] - p < n_swa):
                    out[j, 0, t, c] = 0.0
    return out


@pytest.mark.parametrize("n_swa", [0, 1, 3])
def test_fill_mask_unified(n_swa):
    kv = KVCache(tiny_hparams(), 16, n_seq_max=3)
    # two sequences interleaved in cells, a third sharing seq 0's first cells
    place(kv, [0, 0, 1, 1, 2], [0, 1, 0, 1, 0])
    kv.seq_cp(0, 2, 0, 2)
    ub = ubatch([3, 2, 4, 2], [0, 1, 0, 2])
    kv.apply(ub, kv.find_slot(ub))
    n_kv = 12
    mask = np.empty((1, 1, 4, n_kv), dtype=np.float32)
    kv.fill_mask(ub, n_kv, mask, n_swa)
    np.testing.assert_array_equal(mask, expected_mask(kv, ub, n_kv, n_swa))
    if n_swa == 0:
        # seq 0's token at pos 3 (cell 5) sees seq 0's cells 0, 2, 4 and itself, not the token at pos 4
        assert np.flatnonzero(mask[0, 0, 0] == 0).tolist() == [0, 2, 4, 5]
        # seq 2 at pos 2 sees the two cells copied from seq 0 and itself only
        assert np.flatnonzero(mask[0, 0, 3] == 0).tolist() == [0, 2, 8]
    if n_swa == 1:
        assert (mask == 0).sum() == 4  # each token sees only itself


@pytest.mark.parametrize("n_swa", [0, 2])
def test_fill_mask_streams(n_swa):
    kv = KVCache(tiny_hparams(), 8, n_seq_max=3, unified=False)
    place(kv, [0, 1, 2, 0, 1, 2], [1, 1, 1, 2, 2, 2], stream0=1, n_seqs=2)
    place(kv, [0, 1], [0, 0], stream0=0)
    ub = ubatch([3, 4, 3, 4], [1, 1, 2, 2], stream0=1, n_seqs=2)
    kv.apply(ub, kv.find_slot(ub))
    mask = np.empty((2, 1, 2, 8), dtype=np.float32)
    kv.fill_mask(ub, 8, mask, n_swa)
    np.testing.assert_array_equal(mask, expected_mask(kv, ub, 8, n_swa))
    if n_swa == 0:
        assert np.flatnonzero(mask[1, 0, 0] == 0).tolist() == [0, 1, 2, 3]


# ---- sequence operations -----------------------------------------------------------------------
def unified_cache() -> KVCache:
    """seq 0 at cells 0..4 (pos 0..4), seq 1 at cells 5..7 (pos 0..2)."""
    kv = KVCache(tiny_hparams(), 16, n_seq_max=4)
    place(kv, range(5), [0] * 5)
    place(kv, range(3), [1] * 3)
    return kv


def test_seq_rm():
    kv = unified_cache()
    assert kv.seq_rm(0, 1, 3) is True
    assert cells_of(kv, 0) == [(0, 0), (3, 3), (4, 4)]
    assert kv.pos[0, 1] == -1 and kv.pos[0, 2] == -1
    assert kv.seq_pos_max(0) == 4 and kv.seq_pos_min(0) == 0
    kv.seq_rm(0, 4, -1)  # p1 < 0: to the end
    assert kv.seq_pos_max(0) == 3
    kv.seq_rm(0, -1, 1)  # p0 < 0: from the start
    assert cells_of(kv, 0) == [(3, 3)]
    assert cells_of(kv, 1) == [(5, 0), (6, 1), (7, 2)]  # untouched
    kv.seq_rm(-1, 1, 2)  # every sequence
    assert cells_of(kv, 1) == [(5, 0), (7, 2)]
    kv.seq_rm(-1)
    assert (kv.pos == -1).all() and (kv.seqs == 0).all()
    assert kv.seq_pos_max(0) == -1 and kv.seq_pos_min(1) == -1


def test_seq_cp_unified_shares_cells():
    kv = unified_cache()
    kv.seq_cp(0, 2, 1, 4)
    assert cells_of(kv, 2) == [(1, 1), (2, 2), (3, 3)]
    assert kv.seq_pos_max(2) == 3 and kv.seq_pos_min(2) == 1
    # shared cells survive the removal of one of their sequences
    kv.seq_rm(0)
    assert cells_of(kv, 0) == []
    assert cells_of(kv, 2) == [(1, 1), (2, 2), (3, 3)]
    assert kv.pos[0, 0] == -1 and kv.pos[0, 4] == -1
    kv.seq_cp(2, 2)  # no-op
    assert cells_of(kv, 2) == [(1, 1), (2, 2), (3, 3)]


def test_seq_keep():
    kv = unified_cache()
    kv.seq_cp(1, 3)
    kv.seq_cp(0, 2, 0, 2)
    kv.seq_keep(1)
    assert cells_of(kv, 1) == [(5, 0), (6, 1), (7, 2)]
    for s in (0, 2, 3):
        assert cells_of(kv, s) == []
        assert kv.seq_pos_max(s) == -1
    assert (kv.pos >= 0).sum() == 3


def test_seq_add_and_clear():
    kv = unified_cache()
    kv.seq_add(0, 2, -1, 10)
    assert cells_of(kv, 0) == [(0, 0), (1, 1), (2, 12), (3, 13), (4, 14)]
    np.testing.assert_array_equal(kv.shift[0, :6], [0, 0, 10, 10, 10, 0])
    assert kv.has_shift
    kv.seq_add(0, 0, 13, -1)  # positions at or beyond p1 stay; a position pushed below 0 is removed
    assert cells_of(kv, 0) == [(1, 0), (2, 11), (3, 13), (4, 14)]
    assert kv.pos[0, 0] == -1
    np.testing.assert_array_equal(kv.shift[0, 1:5], [-1, 9, 10, 10])
    assert cells_of(kv, 1) == [(5, 0), (6, 1), (7, 2)]
    kv.clear()
    assert (kv.pos == -1).all() and (kv.seqs == 0).all() and (kv.shift == 0).all() and not kv.has_shift
    kv.seq_add(0, -1, -1, 0)  # no-op
    assert not kv.has_shift


def streamed_cache() -> KVCache:
    """Three streams of 6 cells: seq 0 at pos 0..3, seq 1 at pos 0..1; K/V hold random values."""
    kv = KVCache(tiny_hparams(), 6, n_seq_max=3, unified=False)
    place(kv, range(4), [0] * 4, stream0=0)
    place(kv, range(2), [1] * 2, stream0=1)
    rng = np.random.default_rng(0)
    for t in [*kv.k.values(), *kv.v.values()]:
        t.array()[...] = rng.standard_normal(t.array().shape)
    return kv


def test_seq_cp_streams_copies_data():
    kv = streamed_cache()
    before = [t.array().copy() for t in [*kv.k.values(), *kv.v.values()]]
    kv.seq_cp(0, 2, 1, 3)
    assert cells_of(kv, 2, stream=2) == [(1, 1), (2, 2)]
    assert cells_of(kv, 2, stream=0) == []  # the source stream is untouched
    assert cells_of(kv, 0, stream=0) == [(0, 0), (1, 1), (2, 2), (3, 3)]
    for t, old in zip([*kv.k.values(), *kv.v.values()], before):
        a = t.array()[0]  # [n_stream, kv_size, n_embd]
        np.testing.assert_array_equal(a[2, 1:3], old[0][0, 1:3])
        np.testing.assert_array_equal(a[:2], old[0][:2])
    # copying replaces what dst held before
    kv.seq_cp(1, 2)
    assert cells_of(kv, 2, stream=2) == [(0, 0), (1, 1)]
    assert kv.seq_pos_max(2) == 1
    for t in [*kv.k.values(), *kv.v.values()]:
        a = t.array()[0]
        np.testing.assert_array_equal(a[2, :2], a[1, :2])


def test_seq_cp_streams_carries_pending_shift():
    """A copy made before the K shift is applied must be shifted like its source."""
    kv = streamed_cache()
    kv.seq_add(1, -1, -1, 3)  # seq 1 has a pending shift in its own stream
    kv.seq_add(0, 2, -1, 5)
    kv.seq_cp(0, 1)
    assert cells_of(kv, 1, stream=1) == [(0, 0), (1, 1), (2, 7), (3, 8)]
    np.testing.assert_array_equal(kv.shift[1, :4], kv.shift[0, :4])
    np.testing.assert_array_equal(kv.shift[1, :4], [0, 0, 5, 5])


def test_seq_ops_streams():
    kv = streamed_cache()
    kv.seq_rm(0, 2, -1)
    assert cells_of(kv, 0) == [(0, 0), (1, 1)]
    assert kv.seq_pos_max(1) == 1
    kv.seq_keep(1)
    assert cells_of(kv, 0) == [] and cells_of(kv, 1, stream=1) == [(0, 0), (1, 1)]
    kv.seq_add(1, -1, -1, 2)
    assert kv.seq_pos_min(1) == 2 and kv.shift[1, :2].tolist() == [2, 2] and (kv.shift[0] == 0).all()


# ---- the real model ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(stories_path):
    return llamapy.load_model(stories_path)


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 20) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 512, int(rng.integers(lo, hi))).astype(np.int32) for _ in range(n)]


def decode_alone(model, tokens, **kw) -> np.ndarray:
    ctx = llamapy.Context(model, n_ctx=64, **(F32_KV | kw))
    ctx.decode(Batch.from_tokens(tokens))
    return ctx.get_logits()[0].copy()


def interleaved(seqs: dict[int, np.ndarray], pos0: dict[int, int] | None = None) -> Batch:
    """Tokens of several sequences, interleaved round-robin, logits for each one's last token."""
    tok, pos, sid, out = [], [], [], []
    longest = max(len(t) for t in seqs.values())
    for i in range(longest):
        for s, t in seqs.items():
            if i < len(t):
                tok.append(t[i])
                pos.append((pos0 or {}).get(s, 0) + i)
                sid.append(s)
                out.append(i == len(t) - 1)
    return Batch(np.array(tok), np.array(pos), np.array(sid), np.array(out))


@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize("n_ubatch", [5, 512])
def test_parallel_sequences_match_alone(model, unified, n_ubatch):
    ps = prompts(4)
    ctx = llamapy.Context(model, n_ctx=256, n_seq_max=4, kv_unified=unified, n_ubatch=n_ubatch, **F32_KV)
    batch = interleaved(dict(enumerate(ps)))
    ctx.decode(batch)
    order = [int(s) for s in batch.seq_id[batch.output]]  # outputs come in batch order
    for row, s in enumerate(order):
        np.testing.assert_allclose(ctx.get_logits()[row], decode_alone(model, ps[s]), rtol=0, atol=ATOL)
        np.testing.assert_array_equal(ctx.get_logits_ith(int(np.flatnonzero(batch.output)[row])), ctx.get_logits()[row])
    # one generation step for every sequence together, positions continued by the context
    nxt = np.array([7, 8, 9, 10], dtype=np.int32)
    ctx.decode(Batch(nxt, None, np.arange(4), np.ones(4, dtype=bool)))
    for s in range(4):
        np.testing.assert_allclose(ctx.get_logits()[s], decode_alone(model, np.append(ps[s], nxt[s])),
                                   rtol=0, atol=ATOL)
        assert ctx.memory_seq_pos_max(s) == len(ps[s])


@pytest.mark.parametrize("unified", [True, False])
def test_parallel_sequences_default_f16_cache(model, unified):
    """The default F16 cache: a K or V value computed in a different batch shape can round
    to the neighbouring F16 value, and such flips cascade through the layers (llama.cpp
    behaves alike), so the agreement is O(1e-3) instead of O(1e-5)."""
    ps = prompts(4, seed=9)
    ctx = llamapy.Context(model, n_ctx=256, n_seq_max=4, kv_unified=unified, n_ubatch=6)
    assert ctx.kv.k[0].type == GGMLType.F16
    batch = interleaved(dict(enumerate(ps)))
    ctx.decode(batch)
    for row, s in enumerate(int(s) for s in batch.seq_id[batch.output]):
        alone = decode_alone(model, ps[s], type_k=GGMLType.F16, type_v=GGMLType.F16)
        np.testing.assert_allclose(ctx.get_logits()[row], alone, rtol=0, atol=2e-2)


@pytest.mark.parametrize("unified", [True, False])
def test_removed_sequence_leaves_no_trace(model, unified):
    ps = prompts(3, seed=1)
    more = prompts(3, seed=2)
    kw = dict(n_ctx=192, n_seq_max=3, kv_unified=unified, n_ubatch=8, **F32_KV)
    ctx = llamapy.Context(model, **kw)
    ctx.decode(interleaved(dict(enumerate(ps))))
    assert ctx.memory_seq_rm(1) is True
    assert ctx.memory_seq_pos_max(1) == -1
    ctx.decode(interleaved({0: more[0], 2: more[2]}, {0: len(ps[0]), 2: len(ps[2])}))
    ref = llamapy.Context(model, **kw)
    ref.decode(interleaved({0: ps[0], 2: ps[2]}))
    ref.decode(interleaved({0: more[0], 2: more[2]}, {0: len(ps[0]), 2: len(ps[2])}))
    np.testing.assert_allclose(ctx.get_logits(), ref.get_logits(), rtol=0, atol=ATOL)
    # the freed sequence starts afresh
    ctx.decode(Batch.from_tokens(more[1], seq_id=1))
    np.testing.assert_allclose(ctx.get_logits()[0], decode_alone(model, more[1]), rtol=0, atol=ATOL)


def test_partial_seq_rm_then_continue(model):
    """Dropping a sequence's tail and decoding other tokens equals never having had the tail."""
    ps = prompts(1, seed=3, lo=30, hi=31)[0]
    tail = np.array([11, 12, 13], dtype=np.int32)
    ctx = llamapy.Context(model, n_ctx=64, **F32_KV)
    ctx.decode(Batch.from_tokens(ps))
    ctx.memory_seq_rm(0, 20, -1)
    ctx.decode(Batch(tail))  # positions continue at 20
    np.testing.assert_allclose(ctx.get_logits()[0], decode_alone(model, np.append(ps[:20], tail)), rtol=0, atol=ATOL)


def test_seq_cp_then_diverge(model):
    """A shared prefix copied to another sequence (unified: shared cells; streams: copied data)."""
    prefix = prompts(1, seed=4, lo=12, hi=13)[0]
    a, b = np.array([20, 21], dtype=np.int32), np.array([30, 31, 32], dtype=np.int32)
    for unified in (True, False):
        ctx = llamapy.Context(model, n_ctx=128, n_seq_max=2, kv_unified=unified, **F32_KV)
        ctx.decode(Batch.from_tokens(prefix))
        ctx.memory_seq_cp(0, 1)
        ctx.decode(interleaved({0: a, 1: b}, {0: len(prefix), 1: len(prefix)}))
        out = ctx.get_logits()
        np.testing.assert_allclose(out[0], decode_alone(model, np.append(prefix, a)), rtol=0, atol=ATOL)
        np.testing.assert_allclose(out[1], decode_alone(model, np.append(prefix, b)), rtol=0, atol=ATOL)


def test_n_ubatch_does_not_change_logits(model):
    tokens = prompts(1, seed=5, lo=100, hi=101)[0]
    results = {}
    for n_ubatch in (128, 1, 7, 32):
        ctx = llamapy.Context(model, n_ctx=128, n_ubatch=n_ubatch, **F32_KV)
        ctx.decode(Batch.from_tokens(tokens, all_outputs=True))
        results[n_ubatch] = ctx.get_logits().copy()
    assert results[128].shape == (100, model.hparams.n_vocab)
    for n_ubatch in (1, 7, 32):
        np.testing.assert_allclose(results[n_ubatch], results[128], rtol=0, atol=ATOL, err_msg=f"n_ubatch {n_ubatch}")


@pytest.mark.parametrize("n_ubatch", [16, 4])
def test_context_full_leaves_cache_unchanged(model, n_ubatch):
    """A batch that does not fit fails before anything is placed, even when its first
    ubatches would fit (llama.cpp prepares every ubatch before computing)."""
    tokens = np.arange(1, 17)
    ctx = llamapy.Context(model, n_ctx=16, n_ubatch=n_ubatch, **F32_KV)
    ctx.decode(Batch.from_tokens(tokens[:10]))
    logits = ctx.get_logits().copy()
    kv = ctx.kv.caches[0]
    pos, seqs = kv.pos.copy(), kv.seqs.copy()
    with pytest.raises(KVCacheFullError):
        ctx.decode(Batch(np.arange(1, 11)))
    np.testing.assert_array_equal(kv.pos, pos)
    np.testing.assert_array_equal(kv.seqs, seqs)
    assert ctx.memory_seq_pos_max(0) == 9
    np.testing.assert_array_equal(ctx.get_logits(), logits)  # the last good outputs stay
    ctx.decode(Batch(tokens[10:]))  # exactly n_ctx fits
    np.testing.assert_allclose(ctx.get_logits()[0], decode_alone(model, tokens), rtol=0, atol=ATOL)


# ---- the K shift -----------------------------------------------------------------------------------
@pytest.mark.parametrize("cache_type,atol", [(GGMLType.F32, ATOL), (GGMLType.F16, 3e-2)])
def test_k_shift_matches_fresh_decode(model, cache_type, atol):
    tokens = prompts(1, seed=6, lo=21, hi=22)[0]
    kw = dict(n_ctx=64, type_k=cache_type, type_v=cache_type, flash_attn=cache_type != GGMLType.F32)
    ctx = llamapy.Context(model, **kw)
    ctx.decode(Batch.from_tokens(tokens[:20], pos0=10))
    ctx.kv.seq_add(0, -1, -1, -10)
    assert ctx.memory_seq_pos_max(0) == 19 and ctx.kv.has_shift
    ctx.decode(Batch.from_tokens(tokens[20:], pos0=20))
    assert not ctx.kv.has_shift and not any(c.shift.any() for c in ctx.kv.caches)
    fresh = decode_alone(model, tokens, type_k=cache_type, type_v=cache_type, flash_attn=kw["flash_attn"])
    err = np.abs(ctx.get_logits()[0] - fresh).max()
    assert err <= atol, f"shifted vs fresh logits differ by {err}"
    # without re-roping K the logits are far off: the test can tell
    unshifted = llamapy.Context(model, **kw)
    unshifted.decode(Batch.from_tokens(tokens[:20], pos0=10))
    unshifted.kv.seq_add(0, -1, -1, -10)
    unshifted.kv.has_shift = False
    unshifted.decode(Batch.from_tokens(tokens[20:], pos0=20))
    assert np.abs(unshifted.get_logits()[0] - fresh).max() > 100 * atol


def test_warmup_between_a_shift_and_the_next_decode_shifts_once(model):
    """A warmup applies the pending K shift for good: the next decode must not shift again."""
    tokens = prompts(1, seed=6, lo=21, hi=22)[0]
    results = []
    for warmup in (False, True):
        ctx = llamapy.Context(model, n_ctx=64, **F32_KV)
        ctx.decode(Batch.from_tokens(tokens[:20], pos0=10))
        ctx.memory_seq_add(0, -1, -1, -10)
        if warmup:
            ctx.set_warmup(True)
        ctx.decode(Batch.from_tokens(tokens[20:], pos0=20))
        ctx.memory_seq_add(0, -1, -1, -5)  # a second shift moves every cell by 5 only
        ctx.decode(Batch.from_tokens(tokens[:1], pos0=16))
        results.append(ctx.get_logits()[0].copy())
    np.testing.assert_array_equal(results[1], results[0])


def test_k_shift_partial_range_layer0_keys(model):
    """llama.cpp's context shift: drop cells [5, 10) and move [10, 20) back by 5.

    Layer 0's K depends only on the token and its position, so the moved keys must equal
    those of a fresh decode at the new positions, and the unmoved keys stay bit-identical.
    """
    tokens = prompts(1, seed=7, lo=20, hi=21)[0]
    ctx = llamapy.Context(model, n_ctx=64, **F32_KV)
    ctx.decode(Batch.from_tokens(tokens))
    k0_before = ctx.kv.k[0].array()[0, 0].copy()  # [kv_size, n_embd_k_gqa]
    ctx.memory_seq_rm(0, 5, 10)
    ctx.kv.seq_add(0, 10, -1, -5)
    ctx.decode(Batch([1]))  # applies the shift, then lands at position 15 (first free cell: 5)
    assert ctx.memory_seq_pos_max(0) == 15
    k0 = ctx.kv.k[0].array()[0, 0]
    np.testing.assert_array_equal(k0[:5], k0_before[:5])
    ref = llamapy.Context(model, n_ctx=64, **F32_KV)
    ref.decode(Batch.from_tokens(np.concatenate([tokens[:5], tokens[10:]])))
    np.testing.assert_allclose(k0[10:20], ref.kv.k[0].array()[0, 0, 5:15], rtol=0, atol=1e-5)
    assert np.abs(k0[10:20] - k0_before[10:20]).max() > 1e-2  # they did move


def test_k_shift_one_stream_of_several(model):
    """Shifting one sequence re-ropes only its stream; the other continues unchanged."""
    a, b = prompts(2, seed=8, lo=10, hi=16)
    kw = dict(n_ctx=128, n_seq_max=2, kv_unified=False, **F32_KV)
    ctx = llamapy.Context(model, **kw)
    ctx.decode(interleaved({0: a[:-1], 1: b[:-1]}, {0: 0, 1: 7}))
    ctx.kv.seq_add(1, -1, -1, -7)
    ctx.decode(interleaved({0: a[-1:], 1: b[-1:]}, {0: len(a) - 1, 1: len(b) - 1}))
    np.testing.assert_allclose(ctx.get_logits()[0], decode_alone(model, a), rtol=0, atol=ATOL)
    np.testing.assert_allclose(ctx.get_logits()[1], decode_alone(model, b), rtol=0, atol=ATOL)


# ---- sliding window: eviction and the layered (iswa) memory ------------------------------------------
def test_swa_cache_reuses_cells_no_sequence_can_attend():
    """With a window of 4, a sequence at pos 0..5 needs only pos 3..5 for its next token (6
    attends to 3..6): the cells of pos 0..2 are free again, and a full cache keeps accepting tokens."""
    kv = KVCache(tiny_hparams(), 6, n_seq_max=1, n_swa=4)
    place(kv, range(6), [0] * 6)
    assert kv.free_cells(0).tolist() == [True, True, True, False, False, False]
    rows = place(kv, [6, 7], [0, 0])
    assert sorted(rows.tolist()) == [0, 1]
    assert sorted(p for _, p in cells_of(kv, 0)) == [2, 3, 4, 5, 6, 7]
    for p in range(8, 40):  # decoding on and on in 6 cells
        place(kv, [p], [0])
    held = {p for _, p in cells_of(kv, 0)}
    assert len(held) == 6 and {37, 38, 39} <= held  # stale cells stay until reused (or evicted)
    assert kv.evict() == 3
    assert {p for _, p in cells_of(kv, 0)} == {37, 38, 39}
    # the mask of the next token still sees exactly the window
    ub = ubatch([40], [0])
    kv.apply(ub, kv.find_slot(ub))
    mask = np.empty((1, 1, 1, 6), dtype=np.float32)
    kv.fill_mask(ub, 6, mask, 4)
    assert sorted(int(kv.pos[0, c]) for c in np.flatnonzero(mask[0, 0, 0] == 0)) == [37, 38, 39, 40]
    # without a window nothing is ever evicted
    full = KVCache(tiny_hparams(), 6, n_seq_max=1)
    place(full, range(6), [0] * 6)
    with pytest.raises(KVCacheFullError):
        place(full, [6], [0])


def test_swa_eviction_needs_every_sequence_of_a_cell():
    """A cell shared by two sequences stays while either can still attend to it."""
    kv = KVCache(tiny_hparams(), 16, n_seq_max=2, n_swa=3)
    place(kv, [0, 1], [0, 0])
    kv.seq_cp(0, 1)                       # seq 1 shares pos 0, 1
    place(kv, [2, 3, 4], [0, 0, 0])       # seq 0 moves on to pos 4: pos 0, 1 out of its window
    free = kv.free_cells(0)
    assert not free[0] and not free[1]    # seq 1 (next pos 2) still sees pos 0 and 1
    assert free[2]                        # seq 0's own pos 2 is out of its window (next pos 5)
    rows = place(kv, [2], [1])            # seq 1 now at pos 2 (next 3): pos 0 is out of both windows
    assert rows.tolist() == [2]           # (it took the cell seq 0 no longer needed)
    free = kv.free_cells(0)
    assert free[0] and not free[1]
    assert kv.evict() == 1                # the shared pos 0
    assert sorted(p for _, p in cells_of(kv, 0)) == [1, 3, 4]
    assert sorted(p for _, p in cells_of(kv, 1)) == [1, 2]
    assert kv.seq_pos_min(0) == 1 and kv.seq_pos_max(0) == 4


def gemma_like_hparams(n_layer: int = 6, n_swa: int = 4) -> HParams:
    hp = tiny_hparams(n_layer)
    hp.n_swa = n_swa
    hp.set_swa_pattern(3)
    return hp


def test_layered_memory_splits_global_and_window_layers():
    hp = gemma_like_hparams()
    assert hp.swa_layers == [True, True, False, True, True, False]
    mem = KVMemory(hp, 1024, n_seq_max=1, n_ubatch=8)
    full, swa = mem.caches
    assert full.layers == [2, 5] and full.n_swa == 0 and full.kv_size == 1024
    assert swa.layers == [0, 1, 3, 4] and swa.n_swa == 4 and swa.kv_size == N_KV_PAD  # 4 + 8 padded
    assert mem.cache_of(3) is swa and mem.cache_of(5) is full
    assert sorted(mem.k) == list(range(6))
    # a model without window layers has one cache for all
    assert [c.layers for c in KVMemory(tiny_hparams(3), 64).caches] == [[0, 1, 2]]
    # sequence operations reach both caches
    ub = ubatch(range(20), [0] * 20)
    for cache in mem.caches:
        cache.apply(ub, cache.find_slot(ub))
    mem.seq_rm(0, 10, -1)
    assert mem.seq_pos_max(0) == 9 and all(c.seq_pos_max(0) == 9 for c in mem.caches)
    swa.evict()
    assert swa.seq_pos_min(0) == 7 and full.seq_pos_min(0) == 0 and mem.seq_pos_min(0) == 7  # pos 10 sees 7..10
    saved = mem.snapshot()
    mem.clear()
    assert mem.seq_pos_max(0) == -1
    mem.restore(saved)
    assert mem.seq_pos_max(0) == 9


def test_warmup_plans_the_generation_step(model):
    """After a warmup the first one-token decode finds its graph built (the warmup ran that
    shape too), the cache holds nothing of the warmup, and the logits are those of a context
    without warmup."""
    tokens = prompts(1, seed=8, lo=6, hi=7)[0]
    logits = []
    for warmup in (False, True):
        ctx = llamapy.Context(model, n_ctx=64)
        if warmup:
            ctx.set_warmup(True)
            assert ctx.memory_seq_pos_max(0) == -1 and (ctx.kv.caches[0].pos < 0).all()
        ctx.decode(Batch.from_tokens(tokens[:5]))
        reused = ctx.n_graphs_reused
        ctx.decode(Batch.from_tokens(tokens[5:6], pos0=5))
        assert ctx.n_graphs_reused == reused + (1 if warmup else 0)
        logits.append(ctx.get_logits()[0].copy())
    np.testing.assert_array_equal(logits[1], logits[0])
