"""The server's decode loop: `-np N` slots share one Context, one thread advances them all.

Each slot is a sequence of the Context (its own KV stream of n_ctx / N cells, as
llama-server's slots without --kv-unified). A step of the loop:

1. takes waiting jobs into free slots (the free slot whose cached tokens share the longest
   prefix with the job's prompt, so a conversation's next turn decodes only its new tokens)
   and drops cancelled jobs, freeing their slots;
2. decodes one token for every generating slot in one batch (continuous batching: a job
   admitted at step k generates from step k+1 on, a finished one stops taking a row),
   one batch per set of LoRA scales, and samples each slot's next token from its row;
3. decodes up to `n_batch` prompt tokens of the slots still reading their prompts (a long
   prompt takes several steps, between which the other slots keep generating); an embedding
   job's prompt is decoded whole in one step, with the Context's embeddings on, and its
   embeddings (per token, or pooled and normalized) end the job.

A job may ask for one slot (`id_slot`: it waits until that one is free) and not to reuse a
slot's cache (`cache_prompt` false); an embedding job never reuses one (llama-server's
stateless tasks).

Jobs come from the HTTP threads through `submit`, and their results go back through each
job's `emit` callback (the app turns them into asyncio queue items). A job's text follows
llamapy.generate's rules (`TextRun`: stop strings, UTF-8 pieces, finish reasons), so a slot's
greedy text is what `llamapy.generate` gives for the same prompt.
"""
from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from llamapy.batch import Batch
from llamapy.context import Context
from llamapy.errors import InputError
from llamapy.generate import TextRun
from llamapy.pooling import Pooling, normalize

# what a log-probability that is not a number becomes: JSON has no -inf (llama-server's choice:
# float's lowest for a probability of 0)
LOWEST_LOGPROB = float(np.finfo(np.float32).min)


class QueueFull(Exception):
    """Every slot is busy and the queue holds its maximum: the client should retry later."""


@dataclass
class TokenOut:
    """One sampled token as the client sees it: its text (maybe held back and released with
    a later token), and with n_probs its log-probability and the most likely alternatives.
    `eog`: an end-of-generation token (no text); `complete`: its text ends on a whole UTF-8
    character (llama-server reports a token cut inside one with the token that completes it)."""
    token: int
    text: str
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None
    eog: bool = False
    complete: bool = True


@dataclass
class Done:
    finish_reason: str   # OpenAI's: "stop" or "length"
    n_prompt: int        # prompt tokens
    n_cached: int        # of them, found in the slot's cache (not decoded again)
    n_generated: int     # tokens of the text (an end-of-generation token is not one)
    t_prompt: float      # seconds from admission to the first token
    t_generate: float    # seconds from the first token to the end
    n_decoded: int = 0   # tokens sampled, an end-of-generation token included (llama-server's n_decoded)
    stop_type: str = "limit"   # llama-server's: "eos", "word" or "limit"
    stopping_word: str = ""
    tokens_cached: int = 0     # tokens the slot's cache holds at the end
    id_slot: int = -1
    truncated: bool = False    # ended because the slot's context was full


@dataclass
class Embedded:
    """An embedding job's result: one vector per prompt token (pooling none) or one pooled,
    normalized vector."""
    vectors: list[np.ndarray]
    n_tokens: int
    id_slot: int


@dataclass
class Failed:
    message: str
    code: int = 500


Event = TokenOut | Done | Embedded | Failed


@dataclass
class Job:
    """A request reduced to what the loop needs."""
    tokens: list[int]
    max_tokens: int
    stop: tuple[str, ...]
    chain: object                      # its own sampler chain (llamapy.generate.sampler_chain), made by the caller
    lora: tuple[float, ...]            # a scale per loaded adapter (0: not applied)
    emit: Callable[[Event], None]
    n_probs: int = 0
    special: bool = False
    cache_prompt: bool = True          # reuse the slot's cached prefix
    id_slot: int = -1                  # the slot to run in (-1: the engine's choice)
    embed: bool = False                # an embedding job: its prompt's embeddings, nothing generated
    embd_normalize: int = 2            # how a pooled embedding is normalized (llamapy.pooling.normalize)
    settings: dict = field(default_factory=dict)  # its generation settings, as /slots reports them
    slot: int = -1                     # the slot it runs in, once admitted
    cancelled: threading.Event = field(default_factory=threading.Event)
    id: int = 0


@dataclass
class Slot:
    id: int                                         # its sequence id in the Context
    cached: list[int] = field(default_factory=list)  # the tokens its KV stream holds, in order
    lora: tuple[float, ...] = ()                    # the scales its cached K/V were computed with
    job: Job | None = None
    run: TextRun | None = None
    chain: object = None
    n_read: int = 0                                  # prompt tokens in the cache
    n_cached: int = 0                                # of them, reused from before
    pending: int | None = None                       # sampled, not yet decoded
    t_admit: float = 0.0
    t_first: float = 0.0
    n_decoded: int = 0                               # tokens this slot decoded (all jobs)
    t_used: float = 0.0                              # when its last job was admitted
    n_sampled: int = 0                               # tokens its job sampled (an end of generation included)
    truncated: bool = False                          # its job ran out of cells
    has_new_line: bool = False                       # its job's text has a newline
    last_job: Job | None = None                      # the job it runs or ran last

    @property
    def busy(self) -> bool:
        return self.job is not None


class Metrics:
    """llama-server's counters (its /metrics names)."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.prompt_seconds = 0.0
        self.predicted_tokens = 0
        self.predicted_seconds = 0.0
        self.n_decode = 0
        self.n_busy_slots = 0  # summed over decodes, for the average per decode
        self.requests = 0


class Engine:
    """The slots, the job queue and the thread that runs the decode loop."""

    def __init__(self, ctx: Context, adapters: list | None = None, scales: list[float] | None = None,
                 max_queue: int = 64, slot_similarity: float = 0.1) -> None:
        self.ctx = ctx
        self.vocab = ctx.model.vocab
        self.slots = [Slot(i) for i in range(ctx.n_seq_max)]
        self.n_ctx_slot = ctx.n_ctx if ctx.kv.unified else ctx.n_ctx // ctx.n_seq_max
        self.adapters: list = list(adapters or [])           # loaded LoraAdapters, by id
        self.scales: list[float] = list(scales or [1.0] * len(self.adapters))  # the default for a request
        self.max_queue = max_queue
        self.slot_similarity = slot_similarity
        self.metrics = Metrics()
        self._waiting: deque[Job] = deque()
        self._ids = itertools.count(1)
        self._wake = threading.Condition()
        self._stop = False
        self.lock = threading.Lock()  # held by the loop during a step, and by who changes adapters
        self._thread = threading.Thread(target=self._loop, name="llamapy-server-decode", daemon=True)

    # ---- the HTTP side -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=30)

    def submit(self, job: Job) -> Job:
        """Queue a job (raises QueueFull past max_queue waiting jobs, InputError for a prompt
        that leaves no room to generate in a slot)."""
        if not job.tokens:
            raise InputError("the prompt is empty and the model adds no BOS: nothing to continue")
        if not -1 <= job.id_slot < len(self.slots):
            raise InputError(f"id_slot {job.id_slot}: this server has slots 0..{len(self.slots) - 1} (-1: any)")
        if len(job.tokens) >= self.n_ctx_slot + job.embed:  # an embedding needs no cell to generate into
            raise InputError(f"the request ({len(job.tokens)} prompt tokens) exceeds the available context size "
                             f"({self.n_ctx_slot} tokens per slot), try increasing it")
        with self._wake:
            free = sum(not s.busy for s in self.slots)
            if len(self._waiting) >= free + self.max_queue:
                raise QueueFull(f"all {len(self.slots)} slots are busy and {len(self._waiting) - free} requests wait")
            job.id = next(self._ids)
            self._waiting.append(job)
            self._wake.notify()
        return job

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    def default_lora(self) -> tuple[float, ...]:
        return tuple(self.scales)

    # ---- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stop and not self._waiting and not any(s.busy for s in self.slots):
                    self._wake.wait()
                if self._stop:
                    return
            with self.lock:
                try:
                    self.step()
                except Exception as e:  # noqa: BLE001 -- a failed step ends its jobs, never the server
                    self._fail_all(f"{type(e).__name__}: {e}")

    def step(self) -> None:
        """One step: admit, generate a token for every generating slot, read prompt tokens."""
        self._admit()
        self._generate()
        self._read_prompts()

    def _admit(self) -> None:
        for slot in self.slots:
            if slot.busy and slot.job.cancelled.is_set():
                self._finish(slot, "cancelled")
        with self._wake:
            jobs = [j for j in self._waiting if not j.cancelled.is_set()]
            self._waiting.clear()
            free = [s for s in self.slots if not s.busy]
            waiting = []
            for job in jobs:
                candidates = free if job.id_slot < 0 else [s for s in free if s.id == job.id_slot]
                if not candidates:  # its slot is busy (or all are): it waits, in its place in the queue
                    waiting.append(job)
                    continue
                slot = self._slot_for(job, candidates)
                free.remove(slot)
                self._start(slot, job)
            self._waiting.extend(waiting)

    def _slot_for(self, job: Job, free: list[Slot]) -> Slot:
        """llama-server's choice: the free slot whose cache holds the longest prefix of the
        prompt when that is at least `slot_similarity` of it (a conversation's next turn), else
        the one used least recently (so the other conversations' caches stay)."""
        best = max(free, key=lambda s: self._reusable(s, job))
        if self._reusable(best, job) >= self.slot_similarity * len(job.tokens):
            return best
        return min(free, key=lambda s: s.t_used)

    def _reusable(self, slot: Slot, job: Job) -> int:
        """How many of the job's prompt tokens the slot's cache holds (at most all but the last,
        whose logits are needed); none for a job that asks not to reuse or for embeddings."""
        if slot.lora != job.lora or not job.cache_prompt or job.embed:
            return 0
        n, cached, tokens = 0, slot.cached, job.tokens
        limit = min(len(cached), len(tokens) - 1)
        while n < limit and cached[n] == tokens[n]:
            n += 1
        return n

    def _start(self, slot: Slot, job: Job) -> None:
        keep = self._reusable(slot, job)
        self.ctx.memory_seq_rm(slot.id, keep, -1)
        slot.cached = slot.cached[:keep]
        slot.lora = job.lora
        slot.job, slot.n_read, slot.n_cached, slot.pending = job, keep, keep, None
        slot.run = TextRun(self.vocab, job.max_tokens, job.stop, job.special)
        slot.chain = job.chain
        slot.t_admit, slot.t_first = time.perf_counter(), 0.0
        slot.n_sampled, slot.truncated, slot.has_new_line = 0, False, False
        slot.last_job, job.slot = job, slot.id
        slot.t_used = slot.t_admit
        self.metrics.requests += 1
        if job.max_tokens == 0 and not job.embed:
            self._finish(slot, "length")

    def _set_adapters(self, scales: tuple[float, ...]) -> None:
        want = [(a, s) for a, s in zip(self.adapters, scales) if s != 0.0]
        if [(id(a), s) for a, s in want] != [(id(a), s) for a, s in self.ctx.adapters]:
            self.ctx.detach_lora()
            for adapter, scale in want:
                self.ctx.attach_lora(adapter, scale)

    def _generate(self) -> None:
        generating = [s for s in self.slots if s.busy and s.pending is not None]
        for scales in sorted({s.lora for s in generating}):
            group = [s for s in generating if s.lora == scales]
            self._set_adapters(scales)
            t0 = time.perf_counter()
            self.ctx.decode(Batch(np.array([s.pending for s in group]), np.array([len(s.cached) for s in group]),
                                  np.array([s.id for s in group]), np.ones(len(group), bool)))
            dt = time.perf_counter() - t0
            self.metrics.n_decode += 1
            self.metrics.n_busy_slots += len(group)
            self.metrics.predicted_seconds += dt
            for row, slot in enumerate(group):
                slot.cached.append(slot.pending)
                slot.n_decoded += 1
                slot.pending = None
                self._sample(slot, row)

    def _read_prompts(self) -> None:
        budget = self.ctx.n_batch
        for slot in self.slots:
            if budget <= 0:
                return
            if not slot.busy or slot.n_read >= len(slot.job.tokens):
                continue
            if slot.job.embed:
                if len(slot.job.tokens) <= budget:  # whole, or at a later step
                    budget -= self._embed(slot)
                continue
            tokens = slot.job.tokens
            chunk = tokens[slot.n_read:slot.n_read + budget]
            last = slot.n_read + len(chunk) == len(tokens)
            output = np.zeros(len(chunk), bool)
            output[-1] = last
            self._set_adapters(slot.lora)
            t0 = time.perf_counter()
            self.ctx.decode(Batch(np.array(chunk), np.arange(slot.n_read, slot.n_read + len(chunk)),
                                  np.full(len(chunk), slot.id), output))
            self.metrics.prompt_seconds += time.perf_counter() - t0
            self.metrics.prompt_tokens += len(chunk)
            self.metrics.n_decode += 1
            self.metrics.n_busy_slots += 1
            slot.cached.extend(chunk)
            slot.n_read += len(chunk)
            slot.n_decoded += len(chunk)
            budget -= len(chunk)
            if last:
                self._sample(slot, len(chunk) - 1)

    def _embed(self, slot: Slot) -> int:
        """Decode an embedding job's whole prompt with embeddings on and end the job with
        them; returns the tokens decoded."""
        job, tokens = slot.job, slot.job.tokens
        if job.cancelled.is_set():
            self._finish(slot, "cancelled")
            return 0
        self._set_adapters(slot.lora)
        t0 = time.perf_counter()
        self.ctx.set_embeddings(True)
        try:
            self.ctx.decode(Batch(np.array(tokens), np.arange(len(tokens)), np.full(len(tokens), slot.id),
                                  np.ones(len(tokens), bool)))
        finally:
            self.ctx.set_embeddings(False)
        self.metrics.prompt_seconds += time.perf_counter() - t0
        self.metrics.prompt_tokens += len(tokens)
        self.metrics.n_decode += 1
        self.metrics.n_busy_slots += 1
        slot.cached = list(tokens)
        slot.n_read = slot.n_decoded = len(tokens)
        if self.ctx.pooling_type is Pooling.NONE:
            vectors = [self.ctx.get_embeddings_ith(i).copy() for i in range(len(tokens))]
        else:
            vectors = [normalize(self.ctx.get_embeddings_seq(slot.id), job.embd_normalize)]
        job.emit(Embedded(vectors, len(tokens), slot.id))
        slot.job, slot.run, slot.chain, slot.pending = None, None, None, None
        return len(tokens)

    def _sample(self, slot: Slot, row: int) -> None:
        """The slot's next token from the last decode's row, handed to its job."""
        job, run = slot.job, slot.run
        if job.cancelled.is_set():
            self._finish(slot, "cancelled")
            return
        logprob, top = None, None
        if job.n_probs:
            logits = np.asarray(self.ctx.get_logits_ith(row), np.float64)
            with np.errstate(all="ignore"):  # logits that are not finite give logprobs that are not (_finite)
                logp = logits - logits.max()
                logp -= np.log(np.exp(logp).sum())
        try:
            with np.errstate(all="ignore"):  # a request's extreme (in-range) values: its own text, not the log's
                token = slot.chain.sample(self.ctx, row)
        except Exception as e:  # noqa: BLE001 -- a request its sampler cannot serve fails alone
            self._fail_one(slot, f"sampling failed: {type(e).__name__}: {e}")
            return
        if job.n_probs:
            n = min(job.n_probs, len(logp))
            best = np.argpartition(-logp, n - 1)[:n]              # the n best of the whole vocabulary,
            best = best[np.argsort(-logp[best], kind="stable")]  # then only they are sorted
            logprob, top = _finite(logp[token]), [(int(t), _finite(logp[t])) for t in best]
        if not slot.t_first:
            slot.t_first = time.perf_counter()
        slot.n_sampled += 1
        text = run.push(token)
        if run.finish_reason is None and len(slot.cached) + 1 >= self.n_ctx_slot:
            text += run.end("length")  # no cell left for the token just sampled
            slot.truncated = True
        slot.has_new_line |= "\n" in text
        eog = self.vocab.is_eog(token)
        if not eog:
            self.metrics.predicted_tokens += 1
        complete = not run.decoder.getstate()[0]  # no bytes of a character left waiting
        job.emit(TokenOut(int(token), text, logprob, top, eog, complete))
        if run.finish_reason is not None:
            self._finish(slot, run.finish_reason)
        else:
            slot.pending = token

    def _finish(self, slot: Slot, reason: str) -> None:
        job, run = slot.job, slot.run
        now = time.perf_counter()
        t_first = slot.t_first or now
        if reason == "cancelled":
            job.emit(Failed("cancelled"))
        else:
            stop_type = "limit" if reason == "length" else "word" if run.stop_word is not None else "eos"
            job.emit(Done(reason, len(job.tokens), slot.n_cached, len(run.tokens), t_first - slot.t_admit,
                          now - t_first, slot.n_sampled, stop_type, run.stop_word or "", len(slot.cached), slot.id,
                          slot.truncated))
        slot.job, slot.run, slot.chain, slot.pending = None, None, None, None
        if slot.n_read < len(job.tokens):  # cancelled while reading its prompt: the cache holds a part
            slot.cached = slot.cached[:slot.n_read]

    def _fail_one(self, slot: Slot, message: str) -> None:
        """End the slot's job with an error; its cache (decoded before the failure) stays."""
        slot.job.emit(Failed(message))
        slot.job, slot.run, slot.chain, slot.pending = None, None, None, None

    def _fail_all(self, message: str) -> None:
        for slot in self.slots:
            if slot.busy:
                slot.job.emit(Failed(message))
                slot.job, slot.run, slot.chain, slot.pending = None, None, None, None
                self.ctx.memory_seq_rm(slot.id, -1, -1)
                slot.cached = []

    # ---- inspection ----------------------------------------------------------------------------
    def cells_used(self, slot: Slot) -> int:
        """Cells of the slot's KV stream holding tokens (memory_seq_pos_max + 1)."""
        return self.ctx.memory_seq_pos_max(slot.id) + 1


def _finite(logprob: float) -> float:
    """A log-probability as JSON can carry it (an adapter or a model with overflowing logits
    must not turn a response into a 500)."""
    value = float(logprob)
    return value if math.isfinite(value) else LOWEST_LOGPROB
