"""The graph allocator (ggmlpy/alloc.py): memory reuse by lifetime, in-place reuse, pinned
inputs/outputs, views that keep their source alive, the free list, and graph re-use.

Besides hand-made graphs, random DAGs are checked two ways: numerically against numpy, and
structurally by `assert_no_live_overlap`, which re-derives every tensor's lifetime from the
graph (independently of the allocator) and fails if two tensors share bytes while both live.
Numeric tolerance for composed graphs: 1e-5 relative to the largest magnitude of a result
(float32 through ~20 ops); overwritten memory shows up as O(1) errors.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import ggmlpy as gg
from test_ggml_ops import _gelu_ggml_ref
from ggmlpy import GGMLType as T
from ggmlpy.alloc import ALIGNMENT, FreeList, GraphAllocator
from ggmlpy.tensor import Flag, Op

MB = 1 << 20


# ---- helpers ----------------------------------------------------------------------------------
def placed(alloc: GraphAllocator, graph: gg.Graph):
    """Tensors the allocator placed, with their byte ranges in the arena."""
    by_id = {id(t): t for t in graph.leafs + graph.nodes}
    return [(by_id[i], off, off + by_id[i].nbytes()) for i, off in alloc.offsets.items()]


def lifetimes(graph: gg.Graph) -> dict[int, tuple[float, float]]:
    """[first step written, last step read] of every tensor, derived from the graph alone.

    Step i is graph.nodes[i]; leafs and inputs live from -1. A tensor is read by each node that
    has it, or a view of it, as a source; tensors nobody reads (results) and tensors flagged
    input/output live to the end.
    """
    step = {id(n): i for i, n in enumerate(graph.nodes)}
    last_read: dict[int, int] = {}
    for i, node in enumerate(graph.nodes):
        for s in node.src:
            base = s.view_src or s
            last_read[id(base)] = i
    out = {}
    for t in graph.leafs + graph.nodes:
        start = -1 if (t.op == Op.NONE or t.flags & Flag.INPUT) else step[id(t)]
        end = last_read.get(id(t), math.inf)
        if t.flags & (Flag.INPUT | Flag.OUTPUT) or t.op == Op.NONE:
            end = math.inf
        out[id(t)] = (start, end)
    return out


def assert_no_live_overlap(alloc: GraphAllocator, graph: gg.Graph) -> None:
    """No two placed tensors share bytes while both are live, except an element-wise node
    writing over the source it reads for the last time (same offset, same size)."""
    life = lifetimes(graph)
    spans = placed(alloc, graph)
    for (t, t0, t1), (u, u0, u1) in itertools.combinations(spans, 2):
        if t0 >= u1 or u0 >= t1:
            continue  # disjoint bytes
        (ts, te), (us, ue) = life[id(t)], life[id(u)]
        if te < us or ue < ts:
            continue  # disjoint lifetimes
        for a, b, (a_s, a_e), (b_s, b_e) in ((t, u, life[id(t)], life[id(u)]), (u, t, life[id(u)], life[id(t)])):
            # b written at the step where a is read for the last time, in place
            if (a_e == b_s and gg.OPS[b.op].inplace and any(s is a for s in b.src)
                    and alloc.offsets[id(a)] == alloc.offsets[id(b)] and a.nbytes() == b.nbytes()):
                break
        else:
            raise AssertionError(f"{t!r} (steps {life[id(t)]}) and {u!r} (steps {life[id(u)]}) share bytes "
                                 f"[{max(t0, u0)}, {min(t1, u1)}) while both are live")


def assert_placement_sane(alloc: GraphAllocator, graph: gg.Graph) -> None:
    for t, lo, hi in placed(alloc, graph):
        assert lo % ALIGNMENT == 0, f"{t!r} at unaligned offset {lo}"
        assert hi <= alloc.peak_bytes, f"{t!r} ends at {hi} past the peak {alloc.peak_bytes}"


def close(got, ref, rtol=1e-5):
    ref = np.asarray(ref, dtype=np.float64)
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), ref, rtol=0, atol=rtol * max(np.abs(ref).max(), 1e-30))


# ---- memory reuse --------------------------------------------------------------------------------
N_1MB = MB // 4  # float32 elements in 1 MB


def _chain_steps(ctx, x):
    """20 element-wise ops (all eligible for in-place), as (ggml builder, float64 reference)."""
    def rms(v):
        return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + 1e-5)
    xs = x.array()[0, 0].astype(np.float64)
    step = [
        (lambda h: gg.scale(ctx, h, 0.5, 0.1), lambda v: v * 0.5 + 0.1),
        (lambda h: gg.silu(ctx, h), lambda v: v / (1 + np.exp(-v))),
        (lambda h: gg.add(ctx, h, x), lambda v: v + xs),
        (lambda h: gg.mul(ctx, h, x), lambda v: v * xs),
        (lambda h: gg.rms_norm(ctx, h, 1e-5), rms),
    ]
    return step * 4


def test_elementwise_chain_runs_in_place_in_1mb():
    rng = np.random.default_rng(0)
    ctx = gg.Context()
    x = ctx.from_numpy(rng.uniform(-1, 1, (256, 1024)).astype(np.float32))  # 1 MB, has its own data
    h, ref, nodes = x, x.array()[0, 0].astype(np.float64), []
    for build, fn in _chain_steps(ctx, x):
        h, ref = build(h), fn(ref)
        nodes.append(h)
    assert len(nodes) == 20
    graph = gg.new_graph(h)
    alloc = GraphAllocator()
    peak = alloc.plan(graph)
    assert peak == MB  # every step writes over the previous one: one 1 MB block for 20 tensors
    assert len({alloc.offsets[id(n)] for n in nodes}) == 1
    assert_no_live_overlap(alloc, graph)
    gg.compute(graph, allocator=alloc)
    close(h.array()[0, 0], ref)


def test_chain_without_in_place_ping_pongs_between_two_blocks():
    """CONT cannot run in place: each copy needs its source alive, then the source's block is reused."""
    rng = np.random.default_rng(1)
    ctx = gg.Context()
    x_vals = rng.standard_normal((512, 512)).astype(np.float32)
    x = ctx.new_tensor_2d(T.F32, 512, 512).set_input()  # 1 MB placed by the allocator
    h, nodes = x, []
    for _ in range(20):
        h = gg.cont(ctx, gg.transpose(ctx, h))
        nodes.append(h)
    graph = gg.new_graph(h)
    alloc = GraphAllocator()
    peak = alloc.plan(graph)
    assert peak == 3 * MB  # the pinned input + two blocks in turn, instead of 21 MB
    assert len({alloc.offsets[id(n)] for n in nodes}) == 2
    assert_no_live_overlap(alloc, graph)
    alloc.alloc_graph(graph)
    x.set(x_vals)
    gg.compute(graph, allocator=alloc)
    np.testing.assert_array_equal(h.array()[0, 0], x_vals)  # an even number of transposes
    np.testing.assert_array_equal(x.array()[0, 0], x_vals)  # the input kept its bytes


def test_peak_is_known_before_compute_and_bounds_every_tensor():
    ctx = gg.Context()
    x = ctx.from_numpy(np.ones((64, 64), np.float32))
    a = gg.exp(ctx, x)
    b = gg.mul_mat(ctx, a, x)           # a stays alive for the add below
    c = gg.add(ctx, gg.silu(ctx, b), a)
    graph = gg.new_graph(gg.soft_max(ctx, c))
    alloc = GraphAllocator()
    peak = alloc.plan(graph)
    assert peak == alloc.peak_bytes > 0
    assert all(n.buffer is None for n in graph.nodes)  # planning binds nothing
    assert peak <= 2 * 64 * 64 * 4  # at most two 16 KB tensors are live at once
    assert_placement_sane(alloc, graph)
    alloc.alloc_graph(graph)
    assert alloc.arena.nbytes >= peak
    gg.compute(graph, allocator=alloc)


# ---- lifetimes: diamonds and views -----------------------------------------------------------------
def test_diamond_keeps_shared_operand_until_last_use():
    rng = np.random.default_rng(2)
    xv = rng.uniform(-1, 1, (8, 32)).astype(np.float32)
    ctx = gg.Context()
    x = ctx.from_numpy(xv)
    a = gg.exp(ctx, x)            # read by b and by d
    b = gg.scale(ctx, a, 2.0)     # a still has a consumer: not in place
    c = gg.sqr(ctx, b)            # b's last use: in place over b
    d = gg.add(ctx, c, a)         # a must still hold exp(x)
    graph = gg.new_graph(d)
    alloc = GraphAllocator()
    alloc.plan(graph)
    off = alloc.offsets
    assert off[id(b)] != off[id(a)]
    assert off[id(c)] == off[id(b)]
    assert_no_live_overlap(alloc, graph)
    gg.compute(graph, allocator=alloc)
    e = np.exp(xv.astype(np.float64))
    close(d.array()[0, 0], (2 * e) ** 2 + e)


def test_view_of_intermediate_stays_alive_until_its_consumer_ran():
    rng = np.random.default_rng(3)
    xv = rng.uniform(-1, 1, (32, 32)).astype(np.float32)
    ctx = gg.Context()
    x = ctx.from_numpy(xv)
    a = gg.exp(ctx, x)
    v = gg.transpose(ctx, a)            # a's only direct consumer is this view
    w = gg.view_2d(ctx, v, 16, 32, v.nb[1], 0)  # a view of the view (same base a)
    h = gg.silu(ctx, x)
    for _ in range(4):                  # new tensors are placed while a must stay put
        h = gg.cont(ctx, gg.transpose(ctx, gg.scale(ctx, h, 0.5)))
    late = gg.add(ctx, gg.view_2d(ctx, h, 16, 32, h.nb[1], 0), w)
    graph = gg.new_graph(late)
    alloc = GraphAllocator()
    alloc.plan(graph)
    assert_no_live_overlap(alloc, graph)
    gg.compute(graph, allocator=alloc)
    x64 = xv.astype(np.float64)
    hv = x64 / (1 + np.exp(-x64))
    for _ in range(4):
        hv = (hv * 0.5).T
    close(late.array()[0, 0], hv[:, :16] + np.exp(x64).T[:, :16])


def test_in_place_is_refused_for_a_source_with_views():
    ctx = gg.Context()
    x = ctx.from_numpy(np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8))
    a = gg.exp(ctx, x)
    r = gg.reshape_1d(ctx, a, 64)
    b = gg.sqr(ctx, a)           # would be a's last direct consumer, but r still reads a
    out = gg.add(ctx, gg.reshape_1d(ctx, b, 64), r)
    graph = gg.new_graph(out)
    alloc = GraphAllocator()
    alloc.plan(graph)
    assert alloc.offsets[id(b)] != alloc.offsets[id(a)]
    assert_no_live_overlap(alloc, graph)
    gg.compute(graph, allocator=alloc)
    e = np.exp(np.linspace(-1, 1, 64))
    close(out.numpy(), e ** 2 + e)


# ---- pinned inputs and outputs -------------------------------------------------------------------------
@pytest.mark.parametrize("flag_output", [False, True])
def test_output_flag_keeps_a_result_that_would_be_overwritten(flag_output):
    xv = np.linspace(-2, 2, 256, dtype=np.float32).reshape(16, 16)
    ctx = gg.Context()
    x = ctx.from_numpy(xv)
    a = gg.exp(ctx, x)
    b = gg.sqr(ctx, a)  # a's last use: b may take a's bytes
    if flag_output:
        a.set_output()
    graph = gg.new_graph(a, b)
    alloc = GraphAllocator()
    alloc.plan(graph)
    assert_no_live_overlap(alloc, graph)
    gg.compute(graph, allocator=alloc)
    e = np.exp(xv.astype(np.float64))
    close(b.array()[0, 0], e ** 2)
    if flag_output:
        assert alloc.offsets[id(a)] != alloc.offsets[id(b)]
        close(a.array()[0, 0], e)
    else:  # ggml semantics: an unflagged intermediate is scratch memory
        assert alloc.offsets[id(a)] == alloc.offsets[id(b)]


def test_inputs_keep_their_place_and_values():
    rng = np.random.default_rng(4)
    ctx = gg.Context()
    inp = ctx.new_tensor_2d(T.F32, 64, 32).set_input()
    h = inp
    for _ in range(6):
        h = gg.silu(ctx, gg.scale(ctx, h, 0.9))
    graph = gg.new_graph(h)
    alloc = GraphAllocator()
    alloc.plan(graph)
    assert alloc.offsets[id(inp)] == 0  # inputs are placed first
    assert_no_live_overlap(alloc, graph)
    alloc.alloc_graph(graph)
    vals = rng.standard_normal((32, 64)).astype(np.float32)
    inp.set(vals)
    gg.compute(graph, allocator=alloc)
    np.testing.assert_array_equal(inp.array()[0, 0], vals)
    ref = vals.astype(np.float64)
    for _ in range(6):
        ref = ref * np.float32(0.9)
        ref = ref / (1 + np.exp(-ref))
    close(h.array()[0, 0], ref)


# ---- re-use of a planned graph ----------------------------------------------------------------------
def _reuse_graph(ctx):
    """A graph whose inputs change between runs, read through views that must not be snapshotted."""
    inp = ctx.new_tensor_3d(T.F32, 64, 4, 6, "inp").set_input()    # [64, 4 heads, 6 tokens]
    pos = ctx.new_tensor_1d(T.I32, 6, "pos").set_input()
    ids = ctx.new_tensor_1d(T.I32, 5, "ids").set_input()
    mask = ctx.new_tensor_2d(T.F16, 6, 6, "mask").set_input()
    table = ctx.from_numpy(np.random.default_rng(5).standard_normal((10, 64)).astype(np.float32))
    bias = ctx.from_numpy(np.random.default_rng(6).standard_normal(16).astype(np.float32))
    q = gg.rope_ext(ctx, inp, pos, None, 64, gg.ROPE_TYPE_NEOX, 64, 10000.0, 1.0)
    qp = gg.permute(ctx, q, 0, 2, 1, 3)                              # [64, 6 tokens, 4 heads]
    kq = gg.mul_mat(ctx, qp, qp)                                     # [6, 6, 4]
    att = gg.soft_max_ext(ctx, kq, mask, 0.125)
    rows = gg.get_rows(ctx, table, ids)                              # [64, 5]
    split = gg.add(ctx, gg.transpose(ctx, gg.cont(ctx, gg.transpose(ctx, rows))), bias)  # ne0 64 vs 16
    return (inp, pos, ids, mask), (att, split)


def _reuse_inputs(rng):
    mask = np.triu(np.full((6, 6), -np.inf, np.float32), 1) + rng.uniform(-1, 0, (6, 6)).astype(np.float32)
    return (rng.standard_normal((6, 4, 64)).astype(np.float32), rng.permutation(100)[:6].astype(np.int32),
            rng.integers(0, 10, 5).astype(np.int32), mask)


def test_graph_computed_twice_gives_the_same_result_and_follows_new_inputs():
    rng = np.random.default_rng(7)
    ctx = gg.Context()
    inputs, outputs = _reuse_graph(ctx)
    for o in outputs:
        o.set_output()
    graph = gg.new_graph(*outputs)
    alloc = GraphAllocator()
    alloc.plan(graph)
    assert_no_live_overlap(alloc, graph)
    alloc.alloc_graph(graph)
    backend = gg.CpuBackend()

    def run(values):
        for t, v in zip(inputs, values):
            t.set(v)
        backend.compute(graph)
        return [np.array(o.array()) for o in outputs]

    first_values, second_values = _reuse_inputs(rng), _reuse_inputs(rng)
    first = run(first_values)
    plan = backend.plan(graph)
    again = run(first_values)
    assert backend.plan(graph) is plan  # the compiled plan was reused
    for x, y in zip(first, again):
        np.testing.assert_array_equal(x, y)
    second = run(second_values)

    # the same graph built fresh and computed once on the new inputs
    ctx2 = gg.Context()
    inputs2, outputs2 = _reuse_graph(ctx2)
    graph2 = gg.new_graph(*outputs2)
    GraphAllocator().alloc_graph(graph2)
    for t, v in zip(inputs2, second_values):
        t.set(v)
    gg.CpuBackend().compute(graph2)
    for x, o in zip(second, outputs2):
        np.testing.assert_array_equal(x, o.array())
    assert not np.array_equal(first[0], second[0])


# ---- random DAGs ---------------------------------------------------------------------------------------
N = 16  # every tensor is N x N so that any op can consume any earlier tensor


def _rms(v):
    return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + 1e-5)


def _softmax(v):
    e = np.exp(v - v.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def random_graph(seed: int):
    """A random DAG of N x N tensors mixing in-place, copying and view ops, with some outputs flagged.

    Returns (graph, [(input, values to set after allocation)], {id(tensor): float64 reference},
    flagged outputs, final node, its reference).
    """
    rng = np.random.default_rng(seed)
    ctx = gg.Context()
    ref: dict[int, np.ndarray] = {}
    pool: list[gg.Tensor] = []

    def add(t, value):
        ref[id(t)] = value
        pool.append(t)
        return t

    for _ in range(2):
        v = rng.uniform(-1, 1, (N, N)).astype(np.float32)
        add(ctx.from_numpy(v), v.astype(np.float64))
    late_inputs = []
    for _ in range(2):
        v = rng.uniform(-1, 1, (N, N)).astype(np.float32)
        t = add(ctx.new_tensor_2d(T.F32, N, N).set_input(), v.astype(np.float64))
        late_inputs.append((t, v))

    def pick():
        if rng.random() < 0.7:  # mostly recent tensors (chains), sometimes old ones (long lifetimes)
            return pool[int(rng.integers(max(0, len(pool) - 4), len(pool)))]
        return pool[int(rng.integers(len(pool)))]

    consumed: set[int] = set()
    for _ in range(int(rng.integers(15, 30))):
        a, b = pick(), pick()
        va, vb = ref[id(a)], ref[id(b)]
        kind = rng.choice(["add", "sub", "mul", "scale", "silu", "gelu", "rms", "softmax", "mul_mat",
                           "transpose_view", "cont_t", "reshape_view", "window_add", "cpy_leaf"])
        if kind in ("add", "sub", "mul"):
            t = getattr(gg, kind)(ctx, a, b)
            v = {"add": va + vb, "sub": va - vb, "mul": va * vb}[kind]
            consumed |= {id(a), id(b)}
        elif kind == "scale":
            t, v = gg.scale(ctx, a, 0.5, 0.25), va * 0.5 + 0.25
        elif kind == "silu":
            t, v = gg.silu(ctx, a), va / (1 + np.exp(-va))
        elif kind == "gelu":  # ggml's GELU: from its table of halves (test_ggml_ops checks the table)
            t, v = gg.gelu(ctx, a), _gelu_ggml_ref(va.astype(np.float32)).astype(np.float64)
        elif kind == "rms":
            t, v = gg.rms_norm(ctx, a, 1e-5), _rms(va)
        elif kind == "softmax":
            t, v = gg.soft_max(ctx, a), _softmax(va)
        elif kind == "mul_mat":
            t, v = gg.mul_mat(ctx, a, b), vb @ va.T
            consumed.add(id(b))
        elif kind == "transpose_view":
            t, v = gg.transpose(ctx, a), va.T
        elif kind == "cont_t":
            t, v = gg.cont(ctx, gg.transpose(ctx, a)), va.T
        elif kind == "reshape_view":  # flatten and back, only possible on contiguous tensors
            if not a.is_contiguous():
                continue
            t, v = gg.reshape_2d(ctx, gg.reshape_1d(ctx, a, N * N), N, N), va
        elif kind == "window_add":  # (top half of a + bottom half of b), through views, repeated over c
            c = pick()
            top = gg.view_2d(ctx, a, N, N // 2, a.nb[1], 0)
            bot = gg.view_2d(ctx, b, N, N // 2, b.nb[1], b.nb[1] * (N // 2))
            t = gg.add(ctx, c, gg.add(ctx, top, bot))  # ggml broadcast: rows repeat over ne1
            v = ref[id(c)] + np.tile(va[:N // 2] + vb[N // 2:], (2, 1))
            consumed |= {id(b), id(c)}
        else:  # cpy_leaf: copy into an allocator-placed leaf, then use the copy
            dst = ctx.new_tensor_2d(T.F32, N, N)
            t, v = gg.scale(ctx, gg.cpy(ctx, a, dst), 2.0), va * 2.0
        consumed.add(id(a))
        add(t, v)

    nodes = [t for t in pool if t.op != Op.NONE]
    # (an output flag on a view does not pin its source, in ggml either: flag owned tensors only)
    flagged = [t for t in nodes if t.view_src is None and rng.random() < 0.2]
    for t in flagged:
        t.set_output()
    sinks = [t for t in pool if id(t) not in consumed and t.op != Op.NONE] or nodes[-1:]
    final, fv = sinks[0], ref[id(sinks[0])]
    for s in sinks[1:]:
        final, fv = gg.add(ctx, final, s), fv + ref[id(s)]
    final = gg.rms_norm(ctx, final, 1e-5)
    fv = _rms(fv)
    graph = gg.new_graph(final, *flagged)
    late_inputs = [(t, v) for t, v in late_inputs if any(t is leaf for leaf in graph.leafs)]
    return graph, late_inputs, ref, flagged, final, fv


@pytest.mark.parametrize("seed", range(40))
def test_random_dag(seed):
    graph, late_inputs, ref, flagged, final, fv = random_graph(seed)
    alloc = GraphAllocator()
    alloc.plan(graph)
    assert_placement_sane(alloc, graph)
    assert_no_live_overlap(alloc, graph)
    alloc.alloc_graph(graph)
    for t, v in late_inputs:
        t.set(v)
    backend = gg.CpuBackend()
    backend.compute(graph)
    close(final.array()[0, 0], fv)
    for t in flagged:
        close(t.array()[0, 0], ref[id(t)])
    for t, v in late_inputs:
        np.testing.assert_array_equal(t.array()[0, 0], v)
    first = np.array(final.array())
    backend.compute(graph)
    np.testing.assert_array_equal(final.array(), first)
    owned = sum(t.nbytes() for t, _, _ in placed(alloc, graph))
    assert alloc.peak_bytes <= owned


# ---- FreeList --------------------------------------------------------------------------------------------
def test_freelist_rounds_to_alignment_and_tracks_peak():
    fl = FreeList()
    assert fl.alloc(1) == 0
    assert fl.alloc(ALIGNMENT + 1) == ALIGNMENT
    assert fl.alloc(0) == 3 * ALIGNMENT
    assert fl.top == fl.peak == 4 * ALIGNMENT


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))), ids=lambda o: "".join(map(str, o)))
def test_freelist_merges_neighbours_in_any_release_order(order):
    fl = FreeList()
    sizes = [64, 128, 192]
    offs = [fl.alloc(s) for s in sizes]
    assert offs == [0, 64, 192]
    for i in order:
        fl.release(offs[i], sizes[i])
    assert fl.free == [(0, 384)]
    assert fl.alloc(384) == 0  # the merged block serves a request of the whole size
    assert fl.peak == 384


def test_freelist_best_fit_split_and_growth_at_the_top():
    fl = FreeList()
    a, _, c, _ = fl.alloc(256), fl.alloc(64), fl.alloc(128), fl.alloc(64)  # 0, 256, 320, 448
    fl.release(a, 256)
    fl.release(c, 128)
    assert fl.alloc(128) == c            # best fit: the 128-byte hole, not the 256-byte one
    assert fl.alloc(64) == a             # split of the 256-byte hole ...
    assert fl.free == [(64, 192)]        # ... leaves its tail free
    top = fl.top
    fl.release(448, 64)                  # the block at the top is free again
    assert fl.alloc(256) == 448          # grows the top free block instead of leaving a hole
    assert fl.top == fl.peak == 448 + 256 and fl.top > top
    assert fl.free == [(64, 192)]


def test_freelist_release_merges_left_and_right_at_once():
    fl = FreeList()
    offs = [fl.alloc(64) for _ in range(5)]
    fl.release(offs[1], 64)
    fl.release(offs[3], 64)
    assert fl.free == [(64, 64), (192, 64)]
    fl.release(offs[2], 64)
    assert fl.free == [(64, 192)]
