"""Batches and their split into ubatches (llamapy/batch.py).

split_simple serves the unified KV cache (one stream); split_equal serves the cache with
one stream per sequence, so each of its ubatches must be a contiguous range of sequences
with the same number of tokens each, laid out stream-major. Either way every token of the
batch is computed exactly once, a sequence's tokens keep their order, and no ubatch holds
more than n_ubatch tokens.
"""
from __future__ import annotations

import numpy as np
import pytest

from llamapy.batch import Batch, UBatch, split_equal, split_simple
from llamapy.errors import InputError, LlamapyError


def random_batch(rng: np.random.Generator, n: int, n_seq: int, p_out: float = 0.3) -> Batch:
    """n tokens spread over n_seq sequences in random interleaving, positions per sequence."""
    seq = rng.integers(0, n_seq, n).astype(np.int32)
    pos = np.empty(n, dtype=np.int32)
    for s in range(n_seq):
        sel = np.flatnonzero(seq == s)
        pos[sel] = 5 * s + np.arange(len(sel))
    return Batch(rng.integers(0, 1000, n), pos, seq, rng.random(n) < p_out)


def check_cover(batch: Batch, ubatches: list[UBatch], n_ubatch: int) -> None:
    """Every token exactly once; fields carried over from the batch through idx; sizes."""
    idx = np.concatenate([ub.idx for ub in ubatches])
    assert sorted(idx.tolist()) == list(range(len(batch)))
    for ub in ubatches:
        assert 0 < ub.n_tokens <= n_ubatch
        assert ub.n_tokens == ub.n_seq_tokens * ub.n_seqs
        np.testing.assert_array_equal(ub.tokens, batch.tokens[ub.idx])
        np.testing.assert_array_equal(ub.pos, batch.pos[ub.idx])
        np.testing.assert_array_equal(ub.seq_id, batch.seq_id[ub.idx])
        np.testing.assert_array_equal(ub.output, batch.output[ub.idx])
        assert ub.n_outputs == int(batch.output[ub.idx].sum())
    assert sum(ub.n_outputs for ub in ubatches) == int(batch.output.sum())


def check_sequence_order(batch: Batch, ubatches: list[UBatch]) -> None:
    """Within each sequence, tokens are computed in batch order."""
    order = np.concatenate([ub.idx for ub in ubatches])
    for s in np.unique(batch.seq_id):
        seen = [i for i in order if batch.seq_id[i] == s]
        assert seen == sorted(seen)


# ---- Batch ----------------------------------------------------------------------------------
def test_batch_defaults():
    b = Batch([5, 6, 7])
    assert len(b) == 3
    assert b.tokens.dtype == np.int32 and b.seq_id.dtype == np.int32 and b.output.dtype == bool
    assert b.pos is None  # the context continues each sequence
    np.testing.assert_array_equal(b.seq_id, [0, 0, 0])
    np.testing.assert_array_equal(b.output, [False, False, True])


def test_batch_from_tokens():
    b = Batch.from_tokens([1, 2, 3, 4], pos0=10, seq_id=2)
    np.testing.assert_array_equal(b.pos, [10, 11, 12, 13])
    np.testing.assert_array_equal(b.seq_id, [2, 2, 2, 2])
    np.testing.assert_array_equal(b.output, [False, False, False, True])
    b = Batch.from_tokens([1, 2, 3], all_outputs=True)
    assert b.output.all()


def test_batch_empty_has_no_outputs():
    b = Batch(np.zeros(0, dtype=np.int32))
    assert len(b) == 0 and len(b.output) == 0
    assert split_simple(b, 4) == [] and split_equal(b, 4) == []


@pytest.mark.parametrize("field", ["pos", "seq_id", "output"])
def test_batch_length_mismatch(field):
    kwargs = {field: np.zeros(2, dtype=bool if field == "output" else np.int32)}
    with pytest.raises(InputError, match=field):
        Batch([1, 2, 3], **kwargs)
    assert issubclass(InputError, LlamapyError)


# ---- split_simple -------------------------------------------------------------------------------
@pytest.mark.parametrize("n,n_ubatch", [(1, 1), (10, 1), (10, 3), (10, 10), (10, 64), (64, 16)])
def test_split_simple(n, n_ubatch):
    b = random_batch(np.random.default_rng(n * 100 + n_ubatch), n, 3)
    ubs = split_simple(b, n_ubatch)
    check_cover(b, ubs, n_ubatch)
    check_sequence_order(b, ubs)
    assert len(ubs) == -(-n // n_ubatch)
    # consecutive runs in batch order, one stream
    np.testing.assert_array_equal(np.concatenate([ub.idx for ub in ubs]), np.arange(n))
    for ub in ubs[:-1]:
        assert ub.n_tokens == n_ubatch
    for ub in ubs:
        assert ub.n_seqs == 1 and ub.stream0 == 0 and ub.n_seq_tokens == ub.n_tokens


# ---- split_equal -------------------------------------------------------------------------------
def check_equal_layout(ub: UBatch) -> None:
    """Stream-major: rows j*n_seq_tokens .. (j+1)*n_seq_tokens all belong to sequence stream0+j."""
    expect = np.repeat(np.arange(ub.stream0, ub.stream0 + ub.n_seqs), ub.n_seq_tokens)
    np.testing.assert_array_equal(ub.seq_id, expect)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("n_ubatch", [1, 2, 5, 8, 64])
def test_split_equal_random(seed, n_ubatch):
    rng = np.random.default_rng(seed)
    b = random_batch(rng, int(rng.integers(1, 40)), int(rng.integers(1, 6)))
    ubs = split_equal(b, n_ubatch)
    check_cover(b, ubs, n_ubatch)
    check_sequence_order(b, ubs)
    for ub in ubs:
        check_equal_layout(ub)
        assert ub.n_seqs <= n_ubatch


def test_split_equal_equal_lengths_share_ubatches():
    # 4 sequences of 6 tokens, interleaved: with room for all, ubatches take every sequence
    n_seq, per = 4, 6
    seq = np.tile(np.arange(n_seq), per)
    pos = np.repeat(np.arange(per), n_seq)
    b = Batch(np.arange(n_seq * per), pos, seq)
    ubs = split_equal(b, 8)
    assert [(ub.n_seqs, ub.n_seq_tokens, ub.stream0) for ub in ubs] == [(4, 2, 0)] * 3
    for ub in ubs:
        check_equal_layout(ub)
    np.testing.assert_array_equal(ubs[0].pos, [0, 1] * 4)
    np.testing.assert_array_equal(ubs[2].pos, [4, 5] * 4)


def test_split_equal_unequal_lengths():
    # seq 0: 5 tokens, seq 1: 2 tokens -> [0,1] x 2, then seq 0's remaining 3
    seq = np.array([0, 0, 1, 0, 1, 0, 0])
    b = Batch(np.arange(7), np.array([0, 1, 0, 2, 1, 3, 4]), seq)
    ubs = split_equal(b, 16)
    assert [(ub.stream0, ub.n_seqs, ub.n_seq_tokens) for ub in ubs] == [(0, 2, 2), (0, 1, 3)]
    np.testing.assert_array_equal(ubs[0].idx, [0, 1, 2, 4])
    np.testing.assert_array_equal(ubs[1].idx, [3, 5, 6])


def test_split_equal_gap_in_sequence_ids():
    # sequences 0 and 2 are not a contiguous range of streams: separate ubatches
    b = Batch(np.arange(4), np.array([0, 0, 1, 1]), np.array([0, 2, 0, 2]))
    ubs = split_equal(b, 16)
    assert [(ub.stream0, ub.n_seqs) for ub in ubs] == [(0, 1), (2, 1)]
    for ub in ubs:
        check_equal_layout(ub)


def test_split_equal_more_sequences_than_n_ubatch():
    b = Batch(np.arange(5), np.zeros(5), np.arange(5))
    ubs = split_equal(b, 2)
    assert [(ub.stream0, ub.n_seqs, ub.n_seq_tokens) for ub in ubs] == [(0, 2, 1), (2, 2, 1), (4, 1, 1)]


# ---- what Context.decode accepts ------------------------------------------------------------------
def test_decode_rejects_bad_batches(stories_path):
    import llamapy

    model = llamapy.load_model(stories_path)
    ctx = llamapy.Context(model, n_ctx=32, n_batch=8, n_seq_max=2)
    assert ctx.n_batch == 8
    bad = {
        "empty": Batch(np.zeros(0, dtype=np.int32)),
        "exceeds n_batch": Batch(np.ones(9, dtype=np.int32)),
        "token ids": Batch([1, model.hparams.n_vocab]),
        "token ids ": Batch([-1, 2]),
        "sequence ids": Batch([1, 2], seq_id=[0, 2]),
        "sequence ids ": Batch([1, 2], seq_id=[-1, 0]),
    }
    for what, batch in bad.items():
        with pytest.raises(InputError, match=what.strip()):
            ctx.decode(batch)
    assert ctx.memory_seq_pos_max(0) == -1  # nothing was placed
    with pytest.raises(InputError, match="n_seq_max"):
        llamapy.Context(model, n_ctx=32, n_seq_max=65)
    with pytest.raises(InputError, match="multiple of n_seq_max"):
        llamapy.Context(model, n_ctx=30, n_seq_max=4, kv_unified=False)


def test_decode_continues_positions(stories_path):
    """pos=None continues every sequence after its last cell."""
    import llamapy

    model = llamapy.load_model(stories_path)
    ctx = llamapy.Context(model, n_ctx=32, n_seq_max=2)
    ctx.decode(Batch.from_tokens([1, 2, 3]))
    ctx.decode(Batch([4, 5, 6, 7], seq_id=[0, 1, 0, 1]))
    assert ctx.memory_seq_pos_max(0) == 4 and ctx.memory_seq_pos_max(1) == 1
