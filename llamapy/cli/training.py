"""What llamapy-finetune and llamapy-train share: the optimizer, schedule and checkpoint
flags (declared once, as typed option aliases), turning them into TrainParams, and the
run itself: windows, Context.opt_fit with checkpoints, timing lines, saving. What a run
reports as it goes (--metrics, --plot, --save-best, --eval-task) is the library's
(llamapy/fit_watch.py); these flags only pass it on.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

from pydantic import ValidationError

from ggmlpy.opt import loss_and_accuracy
from ggmlpy.records import explain
from llamapy.atomic import special_kind
from llamapy.checkpoint import data_fingerprint
from llamapy.context import Context
from llamapy.dataset import split_too_small, validation_windows
from llamapy.distributed import Setting, oversubscription_warning
from llamapy.errors import InputError, LlamapyError, TrainingInterrupted
from llamapy.save import save_model_to_file
from llamapy.train import TrainingDivergedError
from llamapy.train_params import (
    DEFAULT_LORA_MODULES,
    SGD,
    AdamW,
    LRSchedule,
    TrainParams,
    has_quantized_matrices,
)

from . import common
from .args import (
    CHECKPOINTS,
    DATA,
    OUTPUT,
    SCHEDULE,
    TRAINING,
    as_flag,
    flag,
    flag_field,
)
from .common import draw_seed, fail, job, log, progress_stream, random_seed, thread_count, warn
from .flags import ChatTemplate
from .training_data import DataOptions, TrainingData, load_training_data

# ---- the shared flags (llama-finetune's names where it has the flag) ---------------------------
File = Annotated[Optional[Path], flag("-f", "--file", "--train-data", metavar="FNAME", group=DATA, show_default=False,
                                      path="read",
                                      help="text to train on, or a .jsonl file of samples")]
WindowSize = Annotated[int, flag("-c", "--ctx-size", "--ctx", metavar="N", env="LLAMA_ARG_CTX_SIZE", group=TRAINING, min=2,
                                 help="tokens per training window (windows overlap by half)")]
BatchSize = Annotated[Optional[int], flag("-b", "--batch-size", metavar="N", env="LLAMA_ARG_BATCH", group=TRAINING, min=1,
                                          show_default=False,
                                          help="tokens per optimizer step, whole windows (default: -c)")]
UbatchSize = Annotated[int, flag("-ub", "--ubatch-size", metavar="N", env="LLAMA_ARG_UBATCH", group=TRAINING, min=1,
                                 help="tokens computed at once (memory against speed; the gradients stay exact)")]
Epochs = Annotated[int, flag("-epochs", "--epochs", metavar="N", group=TRAINING, min=1, help="passes over the training windows")]
OptimizerName = Annotated[str, flag("-opt", "--optimizer", metavar="adamw|sgd", group=TRAINING, help="the optimizer")]
WeightDecay = Annotated[float, flag("-wd", "--weight-decay", metavar="WD", group=TRAINING, min=0, help="decoupled weight decay")]
GradClip = Annotated[Optional[float], flag("--grad-clip", metavar="NORM", group=TRAINING, show_default=False,
                                           help="clip the global gradient L2 norm to NORM (default: off)")]
GradCheckpoint = Annotated[bool, flag("--grad-checkpoint", group=TRAINING, show_default=False,
                                      help="keep the activations only at layer boundaries and recompute the rest in "
                                           "the backward pass: less memory, same gradients, more time")]
BackwardBf16 = Annotated[Optional[bool], flag("--backward-bf16/--backward-f32", group=TRAINING, show_default=False,
                                              help="the backward pass's products through frozen quantized weights on "
                                                   "bf16 operands (about twice as fast, each product within 2^-8) or "
                                                   "in float32 (default: bf16 where the CPU has AVX512-BF16)")]
Seed = Annotated[int, flag("-s", "--seed", metavar="SEED", group=TRAINING,
                           help="seed of the LoRA or new weights' initialisation and of --shuffle "
                                "(-1: a random one, printed)")]
Shuffle = Annotated[bool, flag("--shuffle/--no-shuffle", group=TRAINING,
                               help="shuffle the training windows at every epoch (llamapy-finetune: off, as "
                                    "llama-finetune; llamapy-train: on, as train-text-from-scratch)")]
Threads = Annotated[Optional[int], flag("-t", "--threads", metavar="N", env="LLAMA_ARG_THREADS", show_default=False,
                                        min=1, max=512,
                                        help="CPU threads (default: the cores, at most 4)")]
Plot = Annotated[Optional[Path], flag("--plot", metavar="PNG", group=OUTPUT, show_default=False, path="write",
                                      help="write the loss curves to this PNG")]
Lr = Annotated[Optional[float], flag("-lr", "--learning-rate", metavar="ALPHA", group=SCHEDULE, show_default=False,
                                     help="learning rate (default: 1e-5 for a full finetune, 3e-4 for LoRA, 1e-3 "
                                          "from scratch)")]
LrMin = Annotated[float, flag("-lr-min", "--learning-rate-min", metavar="ALPHA", group=SCHEDULE,
                              help="the exp schedule decays, the cosine one falls, to this rate")]
DecayEpochs = Annotated[float, flag("-decay-epochs", "--learning-rate-decay-epochs", metavar="N", group=SCHEDULE,
                                    help="epochs over which -lr-min is reached (exp schedule; -1: all)")]
LrHalf = Annotated[Optional[float], flag("-lr-half", metavar="[HALFLIFE]", group=SCHEDULE, bare="1",
                                         show_default=False,
                                         help="halve the learning rate every HALFLIFE epochs (1 when bare)")]
LrHalvings = Annotated[Optional[int], flag("-lr-halvings", metavar="N", group=SCHEDULE, show_default=False,
                                           help="halve at most N times")]
LrSchedule = Annotated[str, flag("--lr-schedule", metavar="constant|exp|cosine", group=SCHEDULE,
                                 help="constant, exp (-lr-min/-lr-half decays) or cosine (down to -lr-min)")]
Warmup = Annotated[int, flag("--warmup", metavar="STEPS", group=SCHEDULE, min=0, help="optimizer steps of linear warmup")]
CosRestart = Annotated[Optional[int], flag("--cos-restart", metavar="EPOCHS", group=SCHEDULE, show_default=False,
                                           help="restart the cosine every EPOCHS epochs")]
ValSplit = Annotated[float, flag("-val-split", "--val-split", metavar="FRACTION", group=DATA, min=0, max=0.99,
                                 help="fraction of the windows held out for validation (llama.cpp's rule: the last "
                                      "ndata - int(ndata * (1 - FRACTION)) windows)")]
Data = Annotated[Optional[Path], flag("--data", metavar="DIR", group=DATA, show_default=False, path="read",
                                      help="token shards made by llamapy-tokenize (read as they train: a corpus "
                                           "larger than memory), or a directory of train.jsonl (and "
                                           "valid.jsonl, test.jsonl)")]
DataFormat = Annotated[Optional[str], flag("--data-format", metavar="text|completions|chat", group=DATA,
                                           show_default=False, help="the samples' format (default: seen per file)")]
MaskPrompt = Annotated[bool, flag("--mask-prompt/--no-mask-prompt", group=DATA,
                                  help="learn only the answers of chat and prompt/completion samples")]
SampleStart = Annotated[Optional[str], flag("--sample-start", metavar="STRING", group=DATA, show_default=False,
                                            help="cut a text into samples at each occurrence of STRING")]
IncludeSampleStart = Annotated[bool, flag("--include-sample-start", group=DATA, show_default=False,
                                          help="keep the --sample-start string at the start of each sample")]
Escape = Annotated[bool, flag("-e", "--escape/--no-escape", group=DATA, show_default=False,
                              help="read \\n, \\t and the like in --sample-start as escapes")]
Truncate = Annotated[bool, flag("--truncate/--no-truncate", group=DATA,
                                help="cut samples longer than -c (--no-truncate: refuse them)")]
ValFile = Annotated[Optional[Path], flag("--val-file", metavar="FNAME", group=DATA, show_default=False, path="read",
                                         help="validate on this file instead of -val-split")]
EvalEvery = Annotated[Optional[int], flag("--eval-every", "--steps-per-eval", metavar="N", group=DATA, show_default=False,
                                          min=1, help="validate also every N optimizer steps (default: at epoch ends "
                                                      "only)")]
EvalTask = Annotated[Optional[Path], flag("--eval-task", metavar="FNAME", group=DATA, show_default=False, path="read",
                                          help="score this HellaSwag, Winogrande or multiple-choice task file (as "
                                               "llamapy-perplexity does) at every validation")]
EvalTaskCount = Annotated[Optional[int], flag("--eval-task-count", metavar="N", group=DATA, show_default=False, min=0,
                                              help="tasks of --eval-task to score (default: llama-perplexity's, 400 "
                                                   "HellaSwag tasks, all others)")]
Metrics = Annotated[Optional[Path], flag("--metrics", metavar="FNAME", group=OUTPUT, show_default=False, path="append",
                                         help="write a JSON line per optimizer step and per validation to this file "
                                              "as they happen (a run resumed with --checkpoint-in continues it)")]
SaveBest = Annotated[Optional[Path], flag("--save-best", metavar="FNAME", group=OUTPUT, show_default=False, path="write",
                                          help="keep the model (the adapter when a LoRA trains) with the lowest "
                                               "validation loss so far in this file")]
CheckpointOut = Annotated[Optional[Path], flag("--checkpoint-out", metavar="FNAME", group=CHECKPOINTS,
                                               show_default=False, path="write",
                                               help="write a checkpoint here every --save-every steps, at each "
                                                    "epoch's end and on Ctrl-C")]
SaveEvery = Annotated[Optional[int], flag("--save-every", metavar="STEPS", group=CHECKPOINTS, show_default=False, min=1,
                                          help="optimizer steps between checkpoints (default: at epoch ends and "
                                               "on Ctrl-C only)")]
CheckpointIn = Annotated[Optional[Path], flag("--checkpoint-in", metavar="FNAME", group=CHECKPOINTS,
                                              show_default=False, path="read", replaced_by="--checkpoint-out", help="resume from this checkpoint")]
ForceResume = Annotated[bool, flag("--force-resume", group=CHECKPOINTS, show_default=False,
                                   help="resume even from a checkpoint of another model or text")]


@dataclass
class TrainingArgs:
    """The shared flags' values (a command gets them as a parameter annotated with this class);
    each field declares its flag and its default once."""

    ctx_size: int = flag_field(WindowSize, 256)
    batch_size: int | None = flag_field(BatchSize, None)
    ubatch_size: int = flag_field(UbatchSize, 512)
    epochs: int = flag_field(Epochs, 2, sets=("LRSchedule.epochs",))
    optimizer: str = flag_field(OptimizerName, "adamw")
    wd: float = flag_field(WeightDecay, 0.0, sets=("AdamW.wd", "SGD.wd"))
    grad_clip: float | None = flag_field(GradClip, None, sets=("TrainParams.grad_clip",))
    grad_checkpoint: bool = flag_field(GradCheckpoint, False)
    backward_bf16: bool | None = flag_field(BackwardBf16, None)
    seed: int = flag_field(Seed, 0)
    shuffle: bool = flag_field(Shuffle, False)
    threads: int | None = flag_field(Threads, None)
    lr: float | None = flag_field(Lr, None, sets=("LRSchedule.lr0",))
    lr_min: float = flag_field(LrMin, 0.0, sets=("LRSchedule.lr_min",))
    decay_epochs: float = flag_field(DecayEpochs, -1.0, sets=("LRSchedule.decay_epochs",))
    lr_half: float | None = flag_field(LrHalf, None, sets=("LRSchedule.half_life",))
    lr_halvings: int | None = flag_field(LrHalvings, None, sets=("LRSchedule.halvings",))
    lr_schedule: str = flag_field(LrSchedule, "exp", sets=("LRSchedule.kind",))
    warmup: int = flag_field(Warmup, 0, sets=("LRSchedule.warmup",))
    cos_restart: int | None = flag_field(CosRestart, None, sets=("LRSchedule.cos_restart",))
    val_split: float = flag_field(ValSplit, 0.05)
    data: Path | None = flag_field(Data, None)
    data_format: str | None = flag_field(DataFormat, None)
    chat_template: str | None = flag_field(ChatTemplate, None)
    mask_prompt: bool = flag_field(MaskPrompt, True)
    sample_start: str | None = flag_field(SampleStart, None)
    include_sample_start: bool = flag_field(IncludeSampleStart, False)
    escape: bool = flag_field(Escape, False)
    truncate: bool = flag_field(Truncate, True)
    val_file: Path | None = flag_field(ValFile, None)
    eval_every: int | None = flag_field(EvalEvery, None)
    eval_task: Path | None = flag_field(EvalTask, None)
    eval_task_count: int | None = flag_field(EvalTaskCount, None)
    checkpoint_out: Path | None = flag_field(CheckpointOut, None)
    save_every: int | None = flag_field(SaveEvery, None)
    checkpoint_in: Path | None = flag_field(CheckpointIn, None)
    force_resume: bool = flag_field(ForceResume, False)
    plot: Path | None = flag_field(Plot, None)
    metrics: Path | None = flag_field(Metrics, None)
    save_best: Path | None = flag_field(SaveBest, None)

    def check(self) -> None:
        """What the flags' types cannot say; `--seed -1` becomes a random seed, printed. Under
        MPI, first (once) that every rank was given the flags rank 0 was (`check_flags_agree`),
        and a random seed is rank 0's."""
        shared_seed = check_flags_agree()
        if self.seed == -1:
            self.seed = random_seed(shared_seed)
        elif self.seed < 0:
            raise InputError(f"--seed must be >= 0, or -1 for a random one, not {self.seed}")
        if self.optimizer.lower() not in ("adamw", "sgd"):
            raise InputError(f"unknown optimizer {self.optimizer!r}: use adamw or sgd")
        if self.lr_schedule not in ("constant", "exp", "cosine"):
            raise InputError(f"unknown --lr-schedule {self.lr_schedule!r}: use constant, exp or cosine")
        if not 0.0 <= self.val_split < 1.0:
            raise InputError(f"-val-split must be in [0, 1), got {self.val_split}")
        if self.save_every is not None and self.save_every <= 0:
            raise InputError(f"--save-every must be a positive number of optimizer steps, got {self.save_every}")
        if self.save_every is not None and self.checkpoint_out is None:
            raise InputError("--save-every needs --checkpoint-out FILE")
        if self.checkpoint_in is not None and not self.checkpoint_in.is_file():
            raise InputError(f"checkpoint not found: {self.checkpoint_in}")
        if self.checkpoint_out is not None and self.checkpoint_in is None and _is_checkpoint(self.checkpoint_out):
            raise InputError(f"--checkpoint-out {self.checkpoint_out} holds the checkpoint of an earlier run, which "
                             f"this run would overwrite: resume it with --checkpoint-in {self.checkpoint_out}, or "
                             "give another path (delete the file to start over)")
        if self.eval_every is not None and self.eval_every <= 0:
            raise InputError(f"--eval-every must be a positive number of optimizer steps, got {self.eval_every}")
        if self.eval_task_count is not None and self.eval_task is None:
            raise InputError("--eval-task-count counts the tasks of --eval-task FILE: give the file")

    def data_options(self, window_bos: bool) -> DataOptions:
        return DataOptions(self.ctx_size, window_bos, self.data_format, self.chat_template, self.mask_prompt,
                           self.sample_start, self.include_sample_start, self.escape, self.truncate)

    def load_data(self, model, window_bos: bool, file: Path | None, default_text: str | None = None) -> TrainingData:
        """The windows to train, validate and test on, from -f / --data / --val-file and the data flags."""
        return load_training_data(model, self.data_options(window_bos), file, self.data, self.val_file, default_text)

    def train_params(self, model, default_lr: float | None = None, **policy) -> TrainParams:
        """TrainParams for `model` by llamapy's policy (TrainParams.for_model) and these flags."""
        lr = self.lr if self.lr is not None else default_lr
        try:
            schedule = LRSchedule(**({"lr0": lr} if lr is not None else {}), lr_min=self.lr_min,
                                  decay_epochs=self.decay_epochs, half_life=self.lr_half, halvings=self.lr_halvings,
                                  epochs=self.epochs, kind=self.lr_schedule, warmup=self.warmup,
                                  cos_restart=self.cos_restart)
            opt = AdamW(wd=self.wd) if self.optimizer.lower() == "adamw" else SGD(wd=self.wd)
            return TrainParams.for_model(model, seed=self.seed, schedule=schedule, optimizer=opt,
                                         grad_clip=self.grad_clip, grad_checkpoint=self.grad_checkpoint,
                                         backward_bf16=self.backward_bf16, **policy)
        except ValidationError as e:
            raise InputError(as_flag(TrainingArgs, *explain(e))) from None
        except ValueError as e:
            raise InputError(str(e)) from None


# flags each rank may set its own way: its threads and logging, and what only rank 0 writes
RANK_LOCAL = frozenset({"threads", "output", "lora_out", "plot", "metrics", "save_best", "eval_task",
                        "eval_task_count", "predict", "prompt", "verbose", "verbosity", "log_disable", "log_file"})
# flags compared by whether they are given: files every rank reads (Context.opt_fit compares
# their contents once read: the model, the windows, a resumed checkpoint's state; another
# machine may mount them elsewhere) and --checkpoint-out (every rank joins its stop check)
GIVEN_OR_NOT = frozenset({"model", "file", "data", "val_file", "checkpoint_in", "vocab_model", "checkpoint_out"})
_flags_agreed: list[int | None] = []  # once checked: rank 0's random seed


def check_flags_agree() -> int | None:
    """Stop (one line, on every rank) when some rank was given other training flags than rank
    0: `error: rank 1's --epochs (3) differs from rank 0's (2)`. Every flag counts except
    RANK_LOCAL, and GIVEN_OR_NOT by whether it is given. It is the ranks' first meeting
    (common.meet), right after parsing and before anything rank-dependent, so that no rank
    can enter a collective the others never reach. Returns rank 0's random seed draw (for
    `--seed -1`), None outside MPI."""
    comm = job()
    if comm.size == 1:
        return None
    if not _flags_agreed:
        settings = {}
        for name, (label, value) in common.parsed_flags.items():
            if name in RANK_LOCAL:
                continue
            if name in GIVEN_OR_NOT:
                settings[name] = Setting(label, value is not None, text="given" if value is not None else "not given")
            else:
                settings[name] = Setting(label, value, text=_shown(value))
        draws = common.meet(settings, payload=draw_seed())
        _flags_agreed.append(draws[0])
    return _flags_agreed[0]


def _shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "default" if value is None else str(value)


def check_writable(path: Path) -> None:
    parent = path.resolve().parent
    if path.is_dir():
        raise InputError(f"cannot write {path}: it is a directory")
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise InputError(f"cannot write {path}: directory {parent} does not exist or is not writable")


def train(model, params: TrainParams, data: TrainingData, args: TrainingArgs, output: Path, tool: str) -> Context:
    """Train `model` on `data` and save the result to `output` (the adapter when params train
    one, else the model); returns the context (for a sample)."""
    args.check()
    comm = job()
    main_rank = comm.rank == 0
    if main_rank:  # only rank 0 writes
        for path in [output] + [p for p in (args.plot, args.checkpoint_out, args.save_best) if p]:
            check_writable(path)
        if args.metrics is not None and special_kind(args.metrics) is None:  # a pipe or /dev/stdout is written to as is
            check_writable(args.metrics)
    dataset = data.train
    if args.ctx_size > model.hparams.n_ctx_train:
        warn(f"windows of {args.ctx_size} tokens are longer than the {model.hparams.n_ctx_train} the model was "
             "trained on")
    n_batch = args.batch_size or args.ctx_size
    if data.val is not None:
        log(f"dataset: {dataset.ndata} windows for training, {data.val.ndata} for validation (the validation file; "
            "-val-split unused)")
    else:
        n_val = validation_windows(dataset.ndata, args.val_split)
        if split_too_small(dataset.ndata, args.val_split):
            log(f"dataset: {dataset.ndata} windows, all for training: too few to hold out {100 * args.val_split:g}% "
                f"for validation (-val-split {args.val_split:g}) without losing most of them; no validation loss "
                "(more data, or --val-file, gives one)")
        else:
            log(f"dataset: {dataset.ndata - n_val} windows for training, {n_val} for validation "
                f"(-val-split {args.val_split:g})")
    sched = params.schedule
    log(f"training: {args.optimizer.lower()}, lr {sched.lr0:g} ({sched.kind}"
        f"{f', warmup {sched.warmup}' if sched.warmup else ''}), {n_batch} tokens per step, "
        f"ubatch {min(args.ubatch_size, args.ctx_size)}, {args.epochs} epoch{'s' if args.epochs != 1 else ''}"
        f"{f', gradient norm clipped to {params.grad_clip:g}' if params.grad_clip else ''}"
        f"{', gradient checkpointing' if params.grad_checkpoint else ''}")
    n_threads = thread_count(args.threads)
    if n_batch > args.ctx_size:  # several windows per step: the context holds the step, windows stay -c long
        params = params.replace(n_ctx_train=args.ctx_size)
    ctx = Context(model, n_ctx=max(args.ctx_size, n_batch), n_batch=n_batch, n_ubatch=args.ubatch_size,
                  n_threads=n_threads)
    if comm.size > 1:
        log(f"distributed: {comm.size} ranks, {n_batch} tokens per step each ({n_batch * comm.size} per step in all)")
    ctx.opt_init(params, comm)
    adapter = ctx.trainer.adapter
    plan = ctx.trainer.memory_plan()
    log("memory: " + ", ".join(f"{name} {_mb(n)}" for name, n in plan.items() if n) +
        f"; {_mb(sum(plan.values()))} in all, planned before the first step")
    if ctx.trainer.backward_bf16 and has_quantized_matrices(model, params.lora.modules if params.lora else
                                                            DEFAULT_LORA_MODULES):
        log("backward: the products through quantized weights on bf16 operands, float32 sums (--backward-f32: "
            "float32 throughout)")
    if params.grad_checkpoint:
        every = " or ".join("every layer" if k == 1 else f"every {k} layers" for k in ctx.trainer.checkpoint_strides())
        log(f"gradient checkpointing: the residual stream kept at {every} (the least planned memory), "
            "the rest recomputed in the backward pass")
    if adapter:
        log(f"lora: rank {adapter.rank}, alpha {adapter.alpha:g}, {len(adapter.tensors)} matrices "
            f"({', '.join(params.lora.modules)})")
    if comm.size > 1:
        # the setup's last meeting (a rank that failed setting up says so here); opt_fit then
        # compares the model, windows and parameters; the test set is the CLI's own
        test = data_fingerprint(data.test, data.test.ndata) if data.test is not None else None
        common.meet({"test": Setting("test data (test.jsonl of --data)", test, hidden=True)}, last=True)
        warning = oversubscription_warning(comm, n_threads)
        if warning:
            log(f"warning: {warning}")
    eval_tasks = None
    if args.eval_task is not None and main_rank:  # only rank 0 validates with the tasks
        from llamapy.task_scores import TaskScores
        eval_tasks = TaskScores(model, args.eval_task, args.eval_task_count, n_threads=n_threads)
        log(f"eval task: {len(eval_tasks.tasks.tasks)} {eval_tasks.kind} tasks of {args.eval_task}, scored at every "
            "validation")
    start = time.perf_counter()
    try:
        history = ctx.opt_fit(dataset, epochs=args.epochs, val_split=args.val_split,
                              seed=args.seed if args.shuffle else None,
                              checkpoint=args.checkpoint_out, save_every=args.save_every,
                              resume=args.checkpoint_in, force_resume=args.force_resume, val_data=data.val,
                              eval_every=args.eval_every, stream=progress_stream(),
                              silent=progress_stream() is None, metrics=args.metrics, plot=args.plot,
                              save_best=args.save_best, eval_tasks=eval_tasks)
    except TrainingDivergedError as e:
        if main_rank:
            where = adapter.save(output) if adapter else save_model_to_file(model, output)
            log(f"saved the last good weights to {where}")
        raise InputError(str(e)) from None
    except TrainingInterrupted as e:  # click would swallow a KeyboardInterrupt's message
        fail(str(e), 130, every_rank=e.on_every_rank)
    elapsed = time.perf_counter() - start
    n_trained = sum(len(h.train.losses) for h in history) * ctx.trainer.n_ubatch
    timing = ctx.trainer.timing
    if n_trained == 0:  # opt_fit refuses a finished run's checkpoint and data with nothing to learn: never here
        raise InputError(f"{tool}: no window was trained: nothing to save")
    log(f"{tool}: {n_trained} training tokens in {elapsed:.1f} s (validation included); training: "
        f"{timing.tokens_per_second * comm.size:.0f} tokens/s after the first window's "
        f"{timing.startup_seconds:.2f} s of start-up (graphs built, kernels loaded)"
        f"{f' ({comm.size} ranks)' if comm.size > 1 else ''}")
    if comm.size > 1 and ctx.trainer.n_steps:
        opt = ctx.trainer.opt
        log(f"distributed: summing the gradients took {1e3 * opt.reduce_seconds / ctx.trainer.n_steps:.2f} ms per step "
            f"({4 * opt.optimizer.grad_flat.size / 1e6:.2f} MB of gradients)")
    if data.test is not None:
        result = ctx.opt_evaluate(data.test)
        log(f"test: {loss_and_accuracy(result)} (perplexity {math.exp(min(result.loss()[0], 700)):.3f}) "
            f"over {data.test.ndata} windows")
    if not main_rank:
        return ctx
    if adapter:
        adapter.save(output)
        log(f"{tool}: saved the LoRA adapter to {output}")
    else:
        save_model_to_file(model, output)
        log(f"{tool}: saved the trained model to {output}")
    if args.plot:
        log(f"{tool}: the loss curves are in {args.plot} (redrawn at every validation)")
    if args.metrics:
        log(f"{tool}: the metrics of every step and validation are in {args.metrics}")
    return ctx


def _is_checkpoint(path: Path) -> bool:
    """True when `path` is a llamapy checkpoint (its header says so; the file is not verified)."""
    from llamapy.gguf_file import GGUFFile
    if not path.is_file():
        return False
    try:
        return GGUFFile(path).get("general.type") == "checkpoint"
    except LlamapyError:
        return False


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB" if n < 1e9 else f"{n / 1e9:,.2f} GB"
