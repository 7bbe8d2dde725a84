"""Loss on the answers only, and packing (instruction and chat finetuning).

A sample is tokens and a train mask; positions whose prediction does not count carry the
label IGNORE. Checked against references that do not use masks at all: the inference
path's logits for the loss, and, for gradients, causality (the answers' summed loss is
the whole window's minus its prompt prefix's, each an unmasked window). Packed samples
train as if each were alone in a window, whatever n_ubatch, across ranks and through a
checkpoint.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import llamapy
from ggmlpy import GGMLType
from ggmlpy.opt import Result
from llamapy.chat import ChatTemplate
from llamapy.checkpoint import data_fingerprint
from llamapy.dataset import IGNORE, PackedWindows, pack_samples, token_windows, window_layout
from llamapy.errors import InputError
from llamapy.train_params import TrainParams

from conftest import REPO_ROOT, Killed, kill_after, shared_path

N_CTX = 64
PAD = 0


@pytest.fixture(scope="module")
def story_tokens(stories_path) -> np.ndarray:
    text = shared_path("data", "tinystories_sample.txt").read_text(encoding="utf-8")[:6000]
    return np.asarray(llamapy.load_model(stories_path).vocab.tokenize(text), dtype=np.int32)


@pytest.fixture(scope="module")
def samples(story_tokens) -> list[tuple[np.ndarray, np.ndarray]]:
    """Ten prompt/answer samples of 8 to 36 tokens: the first ~40% is the prompt."""
    rng = np.random.default_rng(5)
    out, start = [], 0
    for n in rng.integers(8, 37, 10):
        tokens = story_tokens[start:start + n]
        mask = np.arange(n) >= int(0.4 * n)
        out.append((tokens, mask))
        start += n
    return out


def context(stories_path, n_ubatch: int, n_batch: int = N_CTX, n_ctx: int = N_CTX) -> llamapy.Context:
    """A trainer on windows of n_ctx tokens, n_batch tokens (whole windows) per step."""
    ctx = llamapy.Context(llamapy.load_model(stories_path), n_ctx=max(n_ctx, n_batch), n_batch=n_batch,
                          n_ubatch=n_ubatch, n_threads=1)
    ctx.opt_init(TrainParams(n_ctx_train=n_ctx))
    return ctx


def grads(ctx) -> dict[str, np.ndarray]:
    tr = ctx.trainer
    return {name: tr.grad(name).astype(np.float64) for name in tr.trained}


def one_step(stories_path, ds, n_ubatch: int) -> tuple[Result, dict[str, np.ndarray]]:
    """The training result and gradients of one optimizer step over all of `ds`'s windows."""
    ctx = context(stories_path, n_ubatch, n_batch=ds.ndata * N_CTX)
    result = Result()
    ctx.opt_epoch(ds, result, None, idata_split=ds.ndata)
    assert ctx.trainer.n_steps == 1
    return result, grads(ctx)


def assert_grads_close(got: dict, expect: dict, rel: float) -> None:
    assert got.keys() == expect.keys()
    for name, ref in expect.items():
        scale = np.abs(ref).max()
        assert scale > 0, name
        np.testing.assert_allclose(got[name], ref, atol=rel * scale, rtol=0, err_msg=name)


def sample_places(ds) -> list[tuple[int, int]]:
    """(window, sequence) of each packed sample, in sample order."""
    return [(w, s) for w in range(ds.ndata) for s in range(int(ds.seq[w].max()) + 1)]


# ---- (a) loss on the answers only --------------------------------------------------------------------
@pytest.mark.parametrize("n_ubatch", [32, 64])
def test_masked_prompt_gives_the_answers_loss_and_gradients(stories_path, story_tokens, n_ubatch):
    tokens = story_tokens[:N_CTX + 1]
    mask = np.arange(N_CTX + 1) >= 33  # the answer: tokens 33..64, predicted at positions 32..63
    ds = pack_samples([(tokens, mask)], N_CTX, PAD)
    assert ds.ndata == 1 and np.array_equal(ds.labels[0] == IGNORE, np.arange(N_CTX) < 32)
    result, got = one_step(stories_path, ds, n_ubatch)

    # the loss: float64 cross entropy of the inference path's logits over the answer positions
    model = llamapy.load_model(stories_path)
    inf = llamapy.Context(model, n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, type_k=GGMLType.F32,
                          type_v=GGMLType.F32, flash_attn=False, n_threads=1)
    inf.decode(llamapy.Batch.from_tokens(tokens[:N_CTX], all_outputs=True))
    logits = inf.get_logits().astype(np.float64)[32:]
    mx = logits.max(axis=1, keepdims=True)
    nll = np.log(np.exp(logits - mx).sum(axis=1)) + mx[:, 0] - logits[np.arange(32), tokens[33:]]
    assert result.loss()[0] == pytest.approx(nll.mean(), rel=2e-6)
    assert result.steps[0] == pytest.approx(nll.mean(), rel=2e-6)
    assert result.ndata == 32 and len(result.preds) == 32  # prompt positions are no predictions
    assert result.ncorrect == np.count_nonzero(logits.argmax(axis=1) == tokens[33:])

    # the gradients: position i sees tokens 0..i only, so the answers' summed loss is the
    # 64-position window's minus the 32-position prompt prefix's, both unmasked:
    # mean over the 32 answers = (64 g64 - 32 g32) / 32
    whole = context(stories_path, 32)
    whole.trainer.window(tokens[:N_CTX], tokens[1:N_CTX + 1], True)
    prefix = context(stories_path, 32, n_batch=32, n_ctx=32)
    prefix.trainer.window(tokens[:32], tokens[1:33], True)
    g64, g32 = grads(whole), grads(prefix)
    assert_grads_close(got, {n: 2 * g64[n] - g32[n] for n in g64}, 2e-5)


@pytest.mark.parametrize("n_ubatch", [32, 64])
def test_ignored_positions_contribute_exactly_nothing(stories_path, story_tokens, n_ubatch):
    """Other tokens (inputs and labels) behind the counted positions change no bit: the
    ignored rows get exactly zero gradient and nothing counted attends to them."""
    tokens = story_tokens[:N_CTX + 1].copy()
    mask = np.arange(N_CTX + 1) < 33  # tokens 1..32 learned, at positions 0..31
    other = tokens.copy()
    other[33:] = np.random.default_rng(1).integers(1, 512, N_CTX - 32)
    runs = [one_step(stories_path, pack_samples([(t, mask)], N_CTX, PAD), n_ubatch) for t in (tokens, other)]
    (r0, g0), (r1, g1) = runs
    assert r0.losses == r1.losses and r0.ncorrect == r1.ncorrect and r0.ndata == r1.ndata == 32
    for name in g0:
        assert np.array_equal(g0[name], g1[name]), name
    # counted, the same positions do change the gradients
    _, g_all = one_step(stories_path, pack_samples([(other, np.ones(N_CTX + 1, bool))], N_CTX, PAD), n_ubatch)
    assert not np.array_equal(g_all["output.weight"], g1["output.weight"])


def test_plain_text_windows_are_unchanged_by_the_mask_path(stories_path, story_tokens):
    """A sample whose every prediction counts is a text window: bit for bit the same step."""
    tokens = story_tokens[:N_CTX + 1]
    r0, g0 = one_step(stories_path, token_windows(tokens, N_CTX), 32)
    r1, g1 = one_step(stories_path, pack_samples([(tokens, np.ones(N_CTX + 1, bool))], N_CTX, PAD), 32)
    assert r0.losses == r1.losses and r0.steps == r1.steps and r0.ncorrect == r1.ncorrect
    for name in g0:
        assert np.array_equal(g0[name], g1[name]), name


# ---- (b) packing ------------------------------------------------------------------------------------------
def test_packing_is_greedy_in_order_with_positions_from_zero(samples):
    ds = pack_samples(samples, N_CTX, PAD)
    places = sample_places(ds)
    assert len(places) == len(samples) and ds.n_samples == len(samples) and ds.n_truncated == 0
    assert ds.ndata < len(samples)
    fill = {}
    for (tokens, mask), (w, s) in zip(samples, places):
        at = np.flatnonzero(ds.seq[w] == s)
        assert np.array_equal(at, np.arange(fill.get(w, 0), fill.get(w, 0) + len(tokens) - 1))
        fill[w] = at[-1] + 1
        assert np.array_equal(ds.pos[w, at], np.arange(len(tokens) - 1))
        assert np.array_equal(ds.data[w, at], tokens[:-1])
        assert np.array_equal(ds.labels[w, at], np.where(mask[1:], tokens[1:], IGNORE))
    for w in range(ds.ndata):  # padding: pad_id, ignored; the next sample did not fit
        pad = ds.seq[w] < 0
        assert np.all(ds.data[w, pad] == PAD) and np.all(ds.labels[w, pad] == IGNORE)
        if w + 1 < ds.ndata:
            next_len = np.count_nonzero(ds.seq[w + 1] == 0)
            assert np.count_nonzero(pad) < next_len


def test_chat_masks_count_exactly_the_assistant_tokens(stories_path):
    """ChatTemplate.tokenize marks the tokens to learn; packed, those are the counted labels."""
    vocab = llamapy.load_model(stories_path).vocab
    template = ChatTemplate.named("chatml", vocab)
    conversations = [[("user", "Hi there"), ("assistant", "Hello!")],
                     [("user", "Two and two?"), ("assistant", "Four."), ("user", "And three?"), ("assistant", "Five.")]]
    samples = [template.tokenize(vocab, [{"role": r, "content": c} for r, c in conv]) for conv in conversations]
    ds = pack_samples(samples, 4 * N_CTX, PAD)
    assert ds.ndata == 1
    for (ids, mask), (w, s) in zip(samples, sample_places(ds)):
        labels = ds.labels[w, ds.seq[w] == s]
        assert not mask[0] and mask.any()
        assert np.array_equal(labels[labels != IGNORE], ids[mask])


def test_packed_samples_have_the_losses_they_have_alone(stories_path, samples):
    ds = pack_samples(samples, N_CTX, PAD)
    assert any(ds.seq[w].max() >= 2 for w in range(ds.ndata))
    tr = context(stories_path, 32).trainer
    for k, (w, s) in enumerate(sample_places(ds)):
        only_k = np.where(ds.seq[w] == s, ds.labels[w], IGNORE)  # the others stay in the window, uncounted
        packed, alone = Result(), Result()
        tr.window(ds.data[w], only_k, False, packed, layout=window_layout(ds, w))
        single = pack_samples([samples[k]], N_CTX, PAD)
        tr.window(single.data[0], single.labels[0], False, alone, layout=window_layout(single, 0))
        assert packed.ndata == alone.ndata == np.count_nonzero(samples[k][1][1:])
        assert packed.loss()[0] == pytest.approx(alone.loss()[0], rel=2e-6), k


def test_a_packed_step_equals_the_step_over_samples_alone(stories_path, samples):
    """One step over all samples, packed or one per window: the step's loss is the mean over
    the same counted positions and the gradients agree."""
    singles = [pack_samples([s], N_CTX, PAD) for s in samples]
    one_per_window = PackedWindows(N_CTX, len(samples), len(samples), 0)
    for k, single in enumerate(singles):
        for name in ("data", "labels", "pos", "seq"):
            getattr(one_per_window, name)[k] = getattr(single, name)[0]
    r0, g0 = one_step(stories_path, pack_samples(samples, N_CTX, PAD), 32)
    r1, g1 = one_step(stories_path, one_per_window, 32)
    assert r0.ndata == r1.ndata == sum(np.count_nonzero(m[1:]) for _, m in samples)
    assert r0.steps[0] == pytest.approx(r1.steps[0], rel=2e-6)
    assert r0.loss()[0] == pytest.approx(r1.loss()[0], rel=2e-6)
    assert_grads_close(g0, g1, 2e-5)


# ---- (c) ubatch splits ---------------------------------------------------------------------------------------
def test_packed_step_does_not_depend_on_n_ubatch(stories_path, samples):
    ds = pack_samples(samples, N_CTX, PAD)
    assert any(ds.seq[w, 31] == ds.seq[w, 32] >= 0 for w in range(ds.ndata))  # a sample crosses the ubatch edge
    (r64, g64), (r32, g32) = one_step(stories_path, ds, 64), one_step(stories_path, ds, 32)
    assert r32.steps[0] == pytest.approx(r64.steps[0], rel=1e-6)
    assert_grads_close(g32, g64, 2e-5)


# ---- (d) truncation and bad samples ---------------------------------------------------------------------------
def test_long_samples_are_truncated_and_counted_or_refused(story_tokens):
    lengths = (10, N_CTX + 6, N_CTX + 1, 100)  # 69 and 99 positions do not fit; 64 do
    samples = []
    for i, n in enumerate(lengths):
        samples.append((story_tokens[i * 100:i * 100 + n], np.ones(n, bool)))
    ds = pack_samples(samples, N_CTX, PAD)
    assert ds.n_truncated == 2 and ds.ndata == 4
    tokens = samples[1][0]
    assert np.array_equal(ds.data[1], tokens[:N_CTX]) and np.array_equal(ds.labels[1], tokens[1:N_CTX + 1])
    assert np.array_equal(ds.data[2], samples[2][0][:N_CTX])  # exactly a window: not truncated
    with pytest.raises(InputError, match=f"sample 1 has {N_CTX + 6} tokens: it needs {N_CTX + 5} positions, "
                                         f"the window has {N_CTX}"):
        pack_samples(samples, N_CTX, PAD, truncate=False)
    assert pack_samples(samples[2:3], N_CTX, PAD, truncate=False).n_truncated == 0


def test_bad_samples_are_refused_in_one_line(story_tokens):
    t = story_tokens[:10]
    with pytest.raises(InputError, match="sample 1: tokens and train mask must be 1-D and of one length"):
        pack_samples([(t, np.ones(10, bool)), (t, np.ones(9, bool))], N_CTX, PAD)
    with pytest.raises(InputError, match="sample 0: a sample needs at least 2 tokens"):
        pack_samples([(t[:1], np.ones(1, bool))], N_CTX, PAD)
    with pytest.raises(InputError, match="non-negative int32 ids"):
        pack_samples([(np.array([1, -2]), np.ones(2, bool))], N_CTX, PAD)
    with pytest.raises(InputError, match="no samples"):
        pack_samples([], N_CTX, PAD)


# ---- checkpoints and ranks -------------------------------------------------------------------------------------
def test_the_data_fingerprint_covers_masks_and_sequences(samples):
    ds = pack_samples(samples, N_CTX, PAD)
    base = data_fingerprint(ds, ds.ndata)
    flipped = [(t, m.copy()) for t, m in samples]
    flipped[3][1][-1] = not flipped[3][1][-1]
    assert data_fingerprint(pack_samples(flipped, N_CTX, PAD), ds.ndata) != base
    for name in ("pos", "seq"):
        other = pack_samples(samples, N_CTX, PAD)
        getattr(other, name)[0, 5] += 1
        assert data_fingerprint(other, ds.ndata) != base, name


def test_a_packed_run_resumes_bit_identically(stories_path, story_tokens, tmp_path):
    rng = np.random.default_rng(8)
    samples, start = [], 0
    for n in rng.integers(8, 30, 40):
        samples.append((story_tokens[start:start + n], np.arange(n) >= n // 3))
        start += n

    def run(ckpt=None, resume=None, die_at=None):
        ctx = context(stories_path, 32, n_batch=2 * N_CTX)
        if die_at is not None:
            kill_after(ctx, die_at)
        ctx.opt_fit(pack_samples(samples, N_CTX, PAD), epochs=2, val_split=0.2, seed=4, silent=True,
                    checkpoint=ckpt, save_every=1 if ckpt else None, resume=resume)
        return {n: t.numpy().copy() for n, t in ctx.trainer.trained.items()}

    expect = run()
    ckpt = tmp_path / "packed.ckpt.gguf"
    with pytest.raises(Killed):
        run(ckpt, die_at=5)
    got = run(ckpt, resume=ckpt)
    for name in expect:
        assert np.array_equal(got[name], expect[name]), name


MPIRUN = shutil.which("mpirun") or shutil.which("mpiexec")


@pytest.mark.skipif(MPIRUN is None, reason="no mpirun")
def test_two_ranks_normalise_over_the_whole_step(samples, tmp_path):
    """Windows with different counted positions on the two ranks: the step is the mean over
    both ranks' counted positions, as one process taking both windows."""
    pytest.importorskip("mpi4py", reason="the mpi extra")
    outs = {}
    for ranks in (2, 1):
        out = tmp_path / f"weights{ranks}.npz"
        script = tmp_path / f"job{ranks}.py"
        script.write_text(textwrap.dedent(f"""
            import numpy as np, llamapy
            from llamapy.dataset import pack_samples
            from llamapy.distributed import world
            from llamapy.train_params import TrainParams
            comm = world()
            samples = {[(t.tolist(), m.tolist()) for t, m in samples]!r}
            ds = pack_samples([(np.array(t), np.array(m)) for t, m in samples], {N_CTX}, {PAD})
            model = llamapy.load_model({str(shared_path("models", "stories260K.gguf"))!r})
            n_batch = {N_CTX * (3 - ranks)}  # tokens per step and rank: two windows per step in all
            ctx = llamapy.Context(model, n_ctx=n_batch, n_batch=n_batch, n_ubatch=32, n_threads=1)
            ctx.opt_init(TrainParams(n_ctx_train={N_CTX}), comm)
            history = ctx.opt_fit(ds, epochs=1, val_split=0.0, silent=True)
            if comm.rank == 0:
                np.savez({str(out)!r}, steps=np.array(history[0].train.steps),
                         **{{n: t.numpy() for n, t in ctx.trainer.trained.items()}})
        """))
        cmd = [sys.executable, str(script)]
        r = subprocess.run([MPIRUN, "-n", "2", *cmd] if ranks == 2 else cmd, capture_output=True, text=True,
                           cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=120)
        assert r.returncode == 0, r.stderr
        outs[ranks] = np.load(out)
    two, one = outs[2], outs[1]
    assert len(one["steps"]) >= 2
    np.testing.assert_allclose(two["steps"], one["steps"], rtol=1e-6)
    for name in one.files:
        scale = np.abs(one[name]).max()
        np.testing.assert_allclose(two[name], one[name], atol=1e-6 * scale, rtol=0, err_msg=name)
