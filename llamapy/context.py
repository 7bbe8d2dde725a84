"""The inference context: a model, its KV cache, compute graphs and the logits they produce.

`decode(batch)` splits the batch into ubatches of at most n_ubatch tokens, finds KV
cells for each, builds (or reuses) the ubatch's graph, computes it and gathers the
requested logits. Graphs are cached by shape, so a run of equal-shaped ubatches
(perplexity, generation) plans memory and prepares kernels once.

With embeddings on (`embeddings=True` or `set_embeddings`), as llama.cpp's: every token of a
batch is an output, and each also gives its embedding (the last hidden state after the
output norm; `get_embeddings_ith`), and with a pooling type other than NONE each sequence
of a ubatch its pooled one (`get_embeddings_seq`; llamapy/pooling.py).
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict

import numpy as np

import ggmlpy as gg
from ggmlpy import GGMLType, GraphAllocator
from ggmlpy.backend import default_backend
from ggmlpy.opt import EpochResult, Result, evaluate_batches, opt_epoch

from .batch import Batch, all_within, split_equal, split_simple
from .errors import InputError
from .fit import FitOptions, fit
from .fit_watch import WatchOptions
from .graph_builder import GraphBuilder, GraphShape
from .kv_cache import KVMemory
from .model import Model
from .outputs import Outputs
from .pooling import Pooling, pool, pooling_of
from .resume import load_checkpoint_into, save_checkpoint_of
from .train import Trainer
from .train_params import TrainParams

MAX_CACHED_GRAPHS = 8


class Context:
    """llama.cpp's llama_context: a model, its KV cache, graphs and outputs, and training.
    (ggmlpy.Context is ggml's ggml_context, where tensors are created.)

    Defaults follow llama.cpp on the CPU: an F16 KV cache and fused (flash) attention."""

    def __init__(self, model: Model, n_ctx: int = 0, n_batch: int = 2048, n_ubatch: int = 512,
                 n_seq_max: int = 1, n_threads: int | None = None, kv_unified: bool | None = None,
                 type_k: GGMLType = GGMLType.F16, type_v: GGMLType = GGMLType.F16,
                 flash_attn: bool = True, embeddings: bool = False,
                 pooling_type: Pooling | str | int | None = None) -> None:
        hp = model.hparams
        self.model = model
        self.flash_attn = flash_attn
        self.n_ctx = n_ctx or hp.n_ctx_train
        self.n_seq_max = n_seq_max
        if not 1 <= n_seq_max <= 64:
            raise InputError(f"n_seq_max must be in 1..64, got {n_seq_max}")
        self.n_batch = min(n_batch, self.n_ctx)
        self.n_ubatch = min(n_ubatch, self.n_batch)
        if self.n_ubatch <= 0:
            raise InputError(f"n_batch and n_ubatch must be positive (got {n_batch}, {n_ubatch})")
        unified = n_seq_max == 1 if kv_unified is None else kv_unified
        if not unified and self.n_ctx % n_seq_max:
            raise InputError(f"n_ctx {self.n_ctx} must be a multiple of n_seq_max {n_seq_max}")
        kv_size = self.n_ctx if unified else self.n_ctx // n_seq_max
        self.kv = KVMemory(hp, kv_size, n_seq_max, unified, type_k, type_v, self.n_ubatch)
        self.backend = default_backend(n_threads)
        self._graphs: OrderedDict[tuple, tuple[GraphBuilder, GraphAllocator]] = OrderedDict()  # (shape, deps)
        self.n_graphs_reused = 0  # decodes that found their graph built (llama_perf's graphs reused)
        self.outputs = Outputs(hp.n_vocab)  # the last decode's
        self._samplers: dict[int, object] = {}  # seq id -> sampler chain run in the graph
        self._shift_graphs: dict[int, tuple] = {}  # cache index -> (graph, positions input, allocator)
        self.trainer = None  # set by opt_init
        self.adapters: list[tuple[object, float]] = []  # (LoraAdapter, scale), applied in every graph
        self.embeddings = bool(embeddings)
        self.pooling_type = pooling_of(pooling_type, model)  # None/-1: the model's (llama.cpp's rule)

    @property
    def n_vocab(self) -> int:
        return self.model.hparams.n_vocab

    def set_n_threads(self, n_threads: int) -> None:
        self.backend.set_n_threads(n_threads)

    def set_embeddings(self, enabled: bool) -> None:
        """Compute embeddings in the next decodes (llama_set_embeddings): every token is then
        an output. Graphs of both kinds stay cached."""
        self.embeddings = bool(enabled)

    # ---- decoding ------------------------------------------------------------------------
    def decode(self, batch: Batch) -> None:
        """Compute a batch; afterwards `get_logits()` holds the outputs it asked for."""
        batch = self._validate(batch)
        if self.embeddings and not batch.output.all():  # llama.cpp: with embeddings, every token is an output
            batch = dataclasses.replace(batch, output=np.ones(len(batch), dtype=bool))
        if self.kv.has_shift:
            self._apply_k_shift()
        ubatches = split_simple(batch, self.n_ubatch) if self.kv.unified else split_equal(batch, self.n_ubatch)
        slots = self._find_slots(ubatches)
        # one ubatch in batch order without samplers: its logits are read in place (a unified
        # cache's split keeps the batch order)
        in_place = (len(ubatches) == 1 and not self._samplers
                    and (self.kv.unified or bool(np.all(ubatches[0].idx == np.arange(len(batch))))))
        self.outputs.start(batch.output, in_place, self.model.hparams.n_embd if self.embeddings else 0)
        for ub, rows in zip(ubatches, slots):
            for cache, r in zip(self.kv.caches, rows):
                cache.apply(ub, r)
            n_kv = tuple(cache.n_kv(ub) for cache in self.kv.caches)
            chains = self._row_chains(ub)
            sigs = () if chains is None else tuple(None if c is None else c.backend_signature() for c in chains)
            shape = GraphShape(ub.n_tokens, ub.n_seq_tokens, ub.n_seqs, ub.stream0, n_kv, ub.n_outputs, sigs,
                               self.embeddings)
            builder = self._graph(shape, chains)
            builder.set_inputs(ub, rows)
            if chains is not None:
                for row, chain in zip(builder.sampler_rows, chains):
                    if row is not None:
                        row.fill_inputs(chain)
            self.backend.compute(builder.graph)
            if ub.n_outputs:
                self._collect_outputs(ub, builder, chains)
                if self.embeddings:
                    self._collect_embeddings(ub, builder)

    def _collect_embeddings(self, ub, builder: GraphBuilder) -> None:
        """Every token's embedding, and with pooling each sequence's pooled over its tokens of
        this ubatch (a later ubatch of the sequence replaces it, as llama.cpp's embd_seq)."""
        if builder.embd is None:
            raise InputError(f"{self.model.hparams.arch}: this architecture's graph gives no embeddings")
        embd = builder.embd_array()
        self.outputs.place_embeddings(ub.idx, embd)
        if self.pooling_type is Pooling.NONE:
            return
        for seq in np.unique(ub.seq_id):
            mine = ub.seq_id == seq
            self.outputs.set_pooled(int(seq), pool(embd[mine], ub.pos[mine], self.pooling_type))

    def _collect_outputs(self, ub, builder: GraphBuilder, chains: list | None) -> None:
        """Logits of the ubatch's output rows, and what the graph sampled for rows with a
        backend sampler chain, into the outputs."""
        logits = builder.output_array().reshape(ub.n_outputs, self.n_vocab)
        if chains is None:
            self.outputs.place(ub.idx, ub.output, logits)
            return
        batch_idx = ub.idx[ub.output]
        plain = np.array([r is None for r in builder.sampler_rows], dtype=bool)
        self.outputs.place(batch_idx[plain], None, logits[plain])
        for j, (row, chain) in enumerate(zip(builder.sampler_rows, chains)):
            if row is not None:
                self.outputs.record_sampled(int(batch_idx[j]), row.read(chain))

    def _row_chains(self, ub) -> list | None:
        """The chain to run in the graph for each output row of a ubatch (None: logits
        leave); None when no row of the ubatch has one."""
        if not self._samplers or not ub.n_outputs:
            return None
        chains = [self._samplers.get(int(s)) for s in ub.seq_id[ub.output]]
        chains = [c if c is not None and c.backend_prefix() > 0 else None for c in chains]
        return chains if any(chains) else None

    # ---- backend sampling (llama_set_sampler) ------------------------------------------------
    def set_sampler(self, seq_id: int, chain) -> None:
        """Run `chain`'s leading samplers that have a backend form inside the graph for the
        outputs of sequence seq_id (None detaches). Those outputs then leave the graph as a
        token (or a short candidate list), and `chain.sample(ctx, i)` picks them up."""
        if not 0 <= seq_id < self.n_seq_max:
            raise InputError(f"set_sampler: sequence id must be in [0, {self.n_seq_max})")
        if chain is None:
            self._samplers.pop(seq_id, None)
        else:
            self._samplers[seq_id] = chain

    def get_sampled_ith(self, i: int):
        """What the graph sampled for batch token i of the last decode (None if it did not)."""
        return self.outputs.sampled_ith(i)

    def get_sampled_token_ith(self, i: int) -> int:
        got = self.get_sampled_ith(i)
        if got is None or got.token is None:
            raise InputError(f"token {i} of the last batch has no token sampled in the graph")
        return got.token

    def _find_slots(self, ubatches) -> list[list[np.ndarray]]:
        """Cells for every ubatch in every cache, found before anything is computed (llama.cpp's
        prepare): if the batch does not fit, KVCacheFullError leaves the caches as they were."""
        if len(ubatches) == 1:  # nothing to place before the search: the caches stay untouched
            return [[cache.find_slot(ubatches[0]) for cache in self.kv.caches]]
        saved = self.kv.snapshot()
        try:
            slots = []
            for ub in ubatches:
                rows = [cache.find_slot(ub) for cache in self.kv.caches]
                for cache, r in zip(self.kv.caches, rows):
                    cache.apply(ub, r)
                slots.append(rows)
            return slots
        finally:
            self.kv.restore(saved)

    def _apply_k_shift(self) -> None:
        """Re-rope every cached K by its cell's pending shift (llama.cpp's K-shift).

        RoPE composes: rope(pos + delta) = rope(delta) . rope(pos), so rotating the stored
        keys by delta gives the keys of the moved positions. Cells without a shift rotate
        by 0, which leaves them unchanged. The rope kernel is F32, so each layer's K goes
        through an F32 copy (as llama.cpp does for quantized caches).
        """
        for ci, kv in enumerate(self.kv.caches):
            if not kv.has_shift:
                continue
            if ci not in self._shift_graphs:
                self._shift_graphs[ci] = self._build_shift_graph(kv)
            graph, inp_shift = self._shift_graphs[ci][:2]
            inp_shift.array().reshape(-1)[:] = kv.shift.reshape(-1)
            self.backend.compute(graph)
            kv.shift.fill(0)
            kv.has_shift = False

    def _build_shift_graph(self, kv):
        hp = self.model.hparams
        n_cells, hk = kv.kv_size * kv.n_stream, hp.n_embd_head_k
        c = gg.Context()
        graph = gg.Graph()
        inp_shift = c.new_tensor_1d(GGMLType.I32, n_cells, "inp_k_shift").set_input()
        scratch = None  # one F32 copy of a layer's K, reused by every layer in turn
        for il, cache_k in kv.k.items():
            k = gg.view_3d(c, cache_k, hk, hp.n_head_kv, n_cells,
                           gg.row_size(cache_k.type, hk), gg.row_size(cache_k.type, hp.n_embd_k_gqa))
            k32 = k
            if cache_k.type != GGMLType.F32:
                if scratch is None:
                    scratch = c.new_tensor_3d(GGMLType.F32, hk, hp.n_head_kv, n_cells, "k_shift_f32")
                k32 = gg.cpy(c, k, scratch)
            roped = gg.rope_ext(c, k32, inp_shift, None, hp.n_rot, hp.rope_type, hp.n_ctx_train,
                                hp.rope_base_of(il), hp.rope_freq_scale)
            graph.visit(gg.cpy(c, roped, k))
        allocator = GraphAllocator()
        allocator.alloc_graph(graph)
        return graph, inp_shift, allocator

    def _validate(self, batch: Batch) -> Batch:
        """Check the batch; a batch without positions gets a copy that continues each sequence."""
        n = len(batch)
        if n == 0:
            raise InputError("decode: empty batch")
        if n > self.n_batch:
            raise InputError(f"decode: batch of {n} tokens exceeds n_batch {self.n_batch}")
        if not all_within(batch.tokens, self.n_vocab):
            raise InputError(f"decode: token ids must be in [0, {self.n_vocab})")
        if not all_within(batch.seq_id, self.n_seq_max):
            raise InputError(f"decode: sequence ids must be in [0, {self.n_seq_max})")
        if batch.seq_shared is not None:
            if not self.kv.unified:
                raise InputError("decode: tokens shared by several sequences need a unified KV cache")
            if int(np.bitwise_or.reduce(batch.seq_shared)) >> self.n_seq_max:
                raise InputError(f"decode: sequence ids must be in [0, {self.n_seq_max})")
        if batch.pos is None:
            batch = Batch(batch.tokens, np.empty(n, dtype=np.int32), batch.seq_id, batch.output, batch.seq_shared)
            for s in np.unique(batch.seq_id):
                sel = np.flatnonzero(batch.seq_id == s)
                batch.pos[sel] = self.kv.seq_pos_max(int(s)) + 1 + np.arange(len(sel))
        return batch

    def _graph(self, shape: GraphShape, chains: list | None = None) -> GraphBuilder:
        """The graph for a ubatch of this shape, built on the model's current tensors and the
        adapters attached now: graphs built on others are dropped, never reused."""
        deps = (self.model.revision, tuple((id(a), s) for a, s in self.adapters) if self.adapters else ())
        key = (shape, deps)
        found = self._graphs.get(key)
        if found is not None:
            self._graphs.move_to_end(key)
            self.n_graphs_reused += 1
            return found[0]
        for stale in [k for k in self._graphs if k[1] != deps]:
            del self._graphs[stale]
        builder = GraphBuilder.for_cache(self.model, self.kv, shape, self.flash_attn, self.adapters)
        self.model.arch.build(builder, self.model)
        if chains and any(chains):
            from .sampling.backend import build_rows
            builder.sampler_rows = build_rows(builder, chains)
        allocator = GraphAllocator()
        allocator.alloc_graph(builder.graph)
        self._graphs[key] = (builder, allocator)
        if len(self._graphs) > MAX_CACHED_GRAPHS:
            self._graphs.popitem(last=False)
        return builder

    # ---- outputs ---------------------------------------------------------------------------
    def get_logits(self) -> np.ndarray:
        """Logits of the last decode's output tokens, in batch order: [n_outputs, n_vocab]."""
        return self.outputs.logits()

    def get_logits_ith(self, i: int) -> np.ndarray:
        """Logits of batch token i (negative i counts from the end)."""
        return self.outputs.logits_ith(i)

    def get_embeddings(self) -> np.ndarray:
        """Embeddings of the last decode's tokens, in batch order: [n_tokens, n_embd]."""
        return self.outputs.embeddings()

    def get_embeddings_ith(self, i: int) -> np.ndarray:
        """The embedding of batch token i of the last decode (negative i counts from the end)."""
        return self.outputs.embeddings_ith(i)

    def get_embeddings_seq(self, seq: int) -> np.ndarray | None:
        """Sequence `seq`'s pooled embedding from the last decode (None when it had no token
        there); InputError with pooling NONE, where only per-token embeddings exist."""
        if self.pooling_type is Pooling.NONE:
            raise InputError("get_embeddings_seq: pooling is none (one embedding per token): use get_embeddings_ith, "
                             "or a pooling type (mean, cls, last)")
        return self.outputs.embeddings_seq(seq)

    # ---- memory (llama_memory_*) --------------------------------------------------------------
    def memory_clear(self) -> None:
        self.kv.clear()

    def memory_seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        return self.kv.seq_rm(seq, p0, p1)

    def memory_seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        self.kv.seq_cp(src, dst, p0, p1)

    def memory_seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        """Shift seq's positions in [p0, p1) by delta; K is re-roped before the next decode."""
        self.kv.seq_add(seq, p0, p1, delta)

    def memory_seq_keep(self, seq: int) -> None:
        self.kv.seq_keep(seq)

    def memory_seq_pos_max(self, seq: int) -> int:
        return self.kv.seq_pos_max(seq)

    # ---- LoRA adapters ---------------------------------------------------------------------------
    def attach_lora(self, adapter, scale: float = 1.0) -> None:
        """Apply `adapter` (a llamapy.lora.LoraAdapter) with `scale` in every graph from now on
        (a finite scale within llamapy.lora.LORA_SCALE_LIMIT, as every front end takes)."""
        from .lora import check_lora_scale
        scale = check_lora_scale(scale)
        self.adapters = [(a, s) for a, s in self.adapters if a is not adapter] + [(adapter, scale)]

    def detach_lora(self, adapter=None) -> None:
        """Stop applying `adapter` (all adapters when None)."""
        self.adapters = [] if adapter is None else [(a, s) for a, s in self.adapters if a is not adapter]

    # ---- state (llama_state_*) ------------------------------------------------------------------
    def state_get_data(self) -> bytes:
        """The whole context: every KV cell and row, and the last decode's logits."""
        from . import state
        return state.get_data(self)

    def state_set_data(self, data: bytes) -> None:
        from . import state
        state.set_data(self, data)

    def state_save_file(self, path, tokens=()) -> int:
        from . import state
        return state.save_file(path, state.get_data(self), tokens)

    def state_load_file(self, path) -> list[int]:
        """Load a whole-context state; returns the tokens saved with it."""
        from . import state
        data, tokens = state.load_file(path)
        state.set_data(self, data)
        return tokens

    def state_seq_get_data(self, seq: int) -> bytes:
        """One sequence's KV cells (positions and K/V rows of every layer)."""
        from . import state
        return state.seq_get_data(self, seq)

    def state_seq_set_data(self, seq: int, data: bytes) -> int:
        """Restore a sequence state into `seq` (replacing what it held); returns bytes read."""
        from . import state
        return state.seq_set_data(self, seq, data)

    def state_seq_save_file(self, path, seq: int, tokens=()) -> int:
        from . import state
        return state.save_file(path, state.seq_get_data(self, seq), tokens)

    def state_seq_load_file(self, path, seq: int) -> list[int]:
        from . import state
        data, tokens = state.load_file(path)
        state.seq_set_data(self, seq, data)
        return tokens

    # ---- warmup ------------------------------------------------------------------------------
    def set_warmup(self, enabled: bool) -> None:
        """With `enabled`, run a warmup decode now (BOS and EOS through every layer, so kernels
        compile and graphs are planned), then one token after them (the shape of a generation
        step, so the first generated token does not pay for its graph and kernels), and forget
        both: nothing stays in the KV cache. Refused while tensors are marked trainable, since
        a warmup must not touch training state."""
        if not enabled:
            return
        if self.trainer is not None and self.trainer.trained:
            raise InputError("warmup is refused while parameters are marked trainable (after opt_init)")
        vocab = self.model.vocab
        tokens = [t for t in (vocab.bos_id, vocab.eos_id) if t is not None and t >= 0] or [0]
        if self.kv.has_shift:  # re-ropes K in place: done for good now, or restoring would ask for it again
            self._apply_k_shift()
        saved = self.kv.snapshot()
        samplers, self._samplers = self._samplers, {}  # a warmup must not draw from a sampler's RNG
        try:
            tokens = tokens[: self.n_batch]
            self.decode(Batch.from_tokens(tokens))
            if 1 < len(tokens) < min(c.kv_size for c in self.kv.caches):
                # and the shape of a generation step, one token after them: its graph is
                # planned and its kernels loaded now, not on the first generated token
                self.decode(Batch.from_tokens(tokens[:1], pos0=len(tokens)))
        finally:
            self._samplers = samplers
            self.kv.restore(saved)

    # ---- training (llama_opt_*) --------------------------------------------------------------------
    def opt_init(self, params: TrainParams | None = None, comm=None) -> None:
        """Mark the tensors the filter selects as trainable and create the optimizer state.
        With `params.lora`, a new LoRA adapter is attached first and trains instead of the
        weights (`trainer.adapter`). `comm` (an mpi4py communicator, or see
        llamapy.distributed) trains data-parallel over its ranks."""
        from .lora import LoraAdapter
        params = params or TrainParams()
        adapter = None
        if params.lora is not None:
            lo = params.lora
            adapter = LoraAdapter.new(self.model, lo.rank, lo.alpha, lo.modules, lo.seed)
            self.attach_lora(adapter)
        self.trainer = Trainer(self, params, adapter, comm)

    def opt_epoch(self, dataset, result_train=None, result_eval=None, idata_split: int = -1,
                  callback_train=None, callback_eval=None) -> None:
        """One pass: train on windows [0, idata_split), evaluate on the rest (llama_opt_epoch)."""
        if self.trainer is None:
            raise InputError("opt_epoch: call opt_init first")
        self.trainer.set_split(dataset, dataset.ndata if idata_split < 0 else idata_split)
        opt_epoch(self.trainer.opt, dataset, result_train, result_eval, idata_split, callback_train, callback_eval)

    def opt_fit(self, dataset, epochs: int | None = None, val_split: float = 0.05, params: TrainParams | None = None,
                silent: bool = False, stream=None, on_epoch=None, seed: int | None = None,
                checkpoint=None, save_every: int | None = None, resume=None, force_resume: bool = False,
                comm=None, val_data=None, eval_every: int | None = None,
                progress_interval: float | None = None, on_step=None, on_eval=None, metrics=None, plot=None,
                save_best=None, eval_tasks=None) -> list[EpochResult]:
        """Train for `epochs` epochs (default: the schedule's) on the first 1 - val_split of the
        windows, evaluating on the rest after each; prints ggml's progress lines unless silent.

        Returns one `ggmlpy.opt.EpochResult` per epoch (from the resumed one on). `on_epoch(epoch_result)`
        runs after each. With `seed`, the training windows are shuffled at the start of every epoch.
        `checkpoint`: a file written every `save_every` optimizer steps (None: never), at each
        epoch's end and on Ctrl-C (which stops after the current step). `resume`: a checkpoint
        to continue from (refused when it is of another model or text unless `force_resume`).
        `comm` (e.g. mpi4py's MPI.COMM_WORLD): train data-parallel, every optimizer step
        covering n_batch tokens on each rank; only rank 0 prints and writes checkpoints.
        `val_data`: a dataset to validate on instead of splitting val_split off `dataset`.
        `eval_every`: validate also after every that many optimizer steps (EpochResult.evals).
        Progress lines go to `stream` (stderr): redrawn in place on a terminal, else one line
        every `progress_interval` seconds (default 10, or $GGMLPY_PROGRESS_INTERVAL) and each
        pass's last line.

        As it runs (docs/finetune.md, "Watching a run"): `on_step(record)` after every optimizer
        step and `on_eval(record)` after every validation (llamapy.metrics' StepRecord and
        EvalRecord, `.to_dict()`); `metrics`: a JSONL file of those records (a resumed run keeps
        the records up to its checkpoint and appends); `plot`: a PNG of the loss curves redrawn
        at every validation; `save_best`: a file keeping the model (the adapter when a LoRA
        trains) of the lowest validation loss so far; `eval_tasks(ctx) -> {name: score}`:
        scores added to each validation's record. Over several ranks only rank 0 does these.
        """
        if self.trainer is None or params is not None:
            self.opt_init(params, comm)
        elif comm is not None and self.trainer.opt.params.comm is not comm:
            raise InputError("opt_fit: this context's trainer was made for another communicator; pass comm to opt_init")
        return fit(self.trainer, dataset, FitOptions(
            epochs=epochs, val_split=val_split, seed=seed, val_data=val_data, eval_every=eval_every,
            checkpoint=checkpoint, save_every=save_every, resume=resume, force_resume=force_resume,
            silent=silent, stream=stream, progress_interval=progress_interval, on_epoch=on_epoch,
            watch=WatchOptions(metrics=metrics, plot=plot, save_best=save_best, eval_tasks=eval_tasks, on_step=on_step,
                               on_eval=on_eval)))

    def opt_evaluate(self, dataset) -> Result:
        """The loss and accuracy of the trained model on every window of `dataset` (a test
        set): no gradients, no step; over several ranks the windows are shared out."""
        if self.trainer is None:
            raise InputError("opt_evaluate: call opt_init first")
        self.trainer.check_dataset(dataset)
        result = Result()
        evaluate_batches(self.trainer.opt, dataset, range(dataset.ndata // self.trainer.datapoints_per_batch), result)
        return result

    def opt_save_checkpoint(self, path) -> None:
        """Write the training state (trained tensors, optimizer state, position) to `path`."""
        if self.trainer is None:
            raise InputError("opt_save_checkpoint: call opt_init first")
        save_checkpoint_of(self.trainer, path)

    def opt_load_checkpoint(self, path, force: bool = False) -> list[str]:
        """Restore the trained tensors and optimizer state from `path`; the next opt_fit
        continues from its position. Returns the hyper-parameters that differ from the
        checkpoint's (this run's are used). Refused (InputError) for another model unless `force`."""
        if self.trainer is None:
            raise InputError("opt_load_checkpoint: call opt_init first (with the run's parameters)")
        return load_checkpoint_into(self.trainer, path, force)
