"""What llamapy-finetune and llamapy-train share: the optimizer, schedule and checkpoint
flags (declared once, as typed option aliases), turning them into TrainParams, and the
run itself: windows, Context.opt_fit with checkpoints, timing lines, saving, the plot.
"""
from __future__ import annotations

import functools
import inspect
import math
import os
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from pydantic import ValidationError

from ggmlpy.records import explain
from llamapy.context import Context, validation_windows
from llamapy.distributed import oversubscription_warning
from llamapy.errors import InputError, TrainingInterrupted
from llamapy.save import save_model_to_file
from llamapy.train import TrainingDivergedError
from llamapy.train_params import DEFAULT_LORA_MODULES, SGD, AdamW, LRSchedule, TrainParams, has_quantized_matrices

from .common import ChatTemplateOption, default_threads, fail, job, log
from .training_data import DataOptions, TrainingData, load_training_data

# ---- the shared flags -------------------------------------------------------------------------
File = Annotated[Optional[Path], typer.Option("-f", "--file", "--train-data", help="text to train on")]
CtxSize = Annotated[int, typer.Option("-c", "--ctx-size", "--ctx", help="tokens per training window")]
BatchSize = Annotated[Optional[int], typer.Option("-b", "--batch-size", help="tokens per optimizer step (whole windows; default -c)")]
UbatchSize = Annotated[int, typer.Option("-ub", "--ubatch-size", help="tokens computed at once")]
Lr = Annotated[Optional[float], typer.Option("-lr", "--learning-rate", help="learning rate (default 1e-5 for a full finetune, 3e-4 for LoRA, 1e-3 from scratch)")]
LrMin = Annotated[float, typer.Option("-lr-min", help="the exp schedule decays, the cosine one falls, to this rate")]
DecayEpochs = Annotated[float, typer.Option("-decay-epochs", help="epochs over which -lr-min is reached (exp schedule)")]
LrHalf = Annotated[Optional[float], typer.Option("-lr-half", help="halve the learning rate every HALFLIFE epochs (1 if bare)")]
LrHalvings = Annotated[Optional[int], typer.Option("-lr-halvings", help="halve at most N times")]
LrSchedule = Annotated[str, typer.Option("--lr-schedule", help="constant, exp (-lr-min/-lr-half decays) or cosine (to -lr-min)")]
Warmup = Annotated[int, typer.Option("--warmup", help="optimizer steps of linear warmup")]
CosRestart = Annotated[Optional[int], typer.Option("--cos-restart", help="restart the cosine every N epochs")]
GradClip = Annotated[Optional[float], typer.Option("--grad-clip", help="clip the global gradient L2 norm to this (off by default)")]
GradCheckpoint = Annotated[bool, typer.Option("--grad-checkpoint", help="keep the activations only at layer boundaries and recompute the rest during the backward pass: less memory, same gradients, more time")]
BackwardBf16 = Annotated[Optional[bool], typer.Option("--backward-bf16/--backward-f32", help="the backward pass's products through frozen quantized weights on bf16-rounded operands (about twice as fast, each product within 2^-8) or in float32 (default: bf16 where the CPU has AVX512-BF16)")]
WeightDecay = Annotated[float, typer.Option("-wd", "--weight-decay", help="decoupled weight decay")]
OptimizerName = Annotated[str, typer.Option("-opt", "--optimizer", help="adamw or sgd")]
ValSplit = Annotated[float, typer.Option("-val-split", "--val-split", help="fraction of windows held out")]
Epochs = Annotated[int, typer.Option("--epochs", "-epochs", help="passes over the training windows")]
Seed = Annotated[int, typer.Option("--seed", "-s", help="seed for shuffling the training windows each epoch")]
Threads = Annotated[Optional[int], typer.Option("-t", "--threads", help="CPU threads")]
Plot = Annotated[Optional[Path], typer.Option("--plot", help="write the loss curves to this PNG")]
CheckpointOut = Annotated[Optional[Path], typer.Option("--checkpoint-out", help="write a checkpoint here every --save-every steps, at each epoch's end and on Ctrl-C")]
SaveEvery = Annotated[Optional[int], typer.Option("--save-every", help="optimizer steps between checkpoints (default: only at epoch ends and on Ctrl-C)")]
CheckpointIn = Annotated[Optional[Path], typer.Option("--checkpoint-in", help="resume from this checkpoint")]
ForceResume = Annotated[bool, typer.Option("--force-resume", help="resume even from a checkpoint of another model or text")]
Data = Annotated[Optional[Path], typer.Option("--data", help="directory of train.jsonl (and valid.jsonl, test.jsonl)")]
DataFormat = Annotated[Optional[str], typer.Option("--data-format", help="text, completions or chat (default: detected per file)")]
MaskPrompt = Annotated[bool, typer.Option("--mask-prompt/--no-mask-prompt", help="learn only the answers of chat and prompt/completion samples")]
SampleStart = Annotated[Optional[str], typer.Option("--sample-start", help="cut a text into samples at each occurrence of this string")]
IncludeSampleStart = Annotated[bool, typer.Option("--include-sample-start", help="keep the --sample-start string at the start of each sample")]
Escape = Annotated[bool, typer.Option("--escape", help="read \\n, \\t, ... in --sample-start as escapes")]
Truncate = Annotated[bool, typer.Option("--truncate/--no-truncate", help="cut samples longer than -c (--no-truncate: refuse them)")]
ValFile = Annotated[Optional[Path], typer.Option("--val-file", help="validate on this file instead of -val-split")]
StepsPerEval = Annotated[Optional[int], typer.Option("--steps-per-eval", help="validate also every N optimizer steps")]


def flag(option: Any, default: Any) -> Any:
    """A TrainingArgs field: its command-line option (a typed alias above) and its default."""
    return field(default=default, metadata={"option": option})


@dataclass
class TrainingArgs:
    """The shared flags' values (a command gets them as its `args` parameter); each field
    declares its option and its default (which a command may change) once."""

    ctx_size: int = flag(CtxSize, 256)
    batch_size: int | None = flag(BatchSize, None)
    ubatch_size: int = flag(UbatchSize, 512)
    lr: float | None = flag(Lr, None)
    lr_min: float = flag(LrMin, 0.0)
    decay_epochs: float = flag(DecayEpochs, -1.0)
    lr_half: float | None = flag(LrHalf, None)
    lr_halvings: int | None = flag(LrHalvings, None)
    lr_schedule: str = flag(LrSchedule, "exp")
    warmup: int = flag(Warmup, 0)
    cos_restart: int | None = flag(CosRestart, None)
    grad_clip: float | None = flag(GradClip, None)
    grad_checkpoint: bool = flag(GradCheckpoint, False)
    backward_bf16: bool | None = flag(BackwardBf16, None)
    wd: float = flag(WeightDecay, 0.0)
    optimizer: str = flag(OptimizerName, "adamw")
    val_split: float = flag(ValSplit, 0.05)
    epochs: int = flag(Epochs, 2)
    seed: int = flag(Seed, 0)
    threads: int | None = flag(Threads, None)
    plot: Path | None = flag(Plot, None)
    checkpoint_out: Path | None = flag(CheckpointOut, None)
    save_every: int | None = flag(SaveEvery, None)
    checkpoint_in: Path | None = flag(CheckpointIn, None)
    force_resume: bool = flag(ForceResume, False)
    data: Path | None = flag(Data, None)
    data_format: str | None = flag(DataFormat, None)
    chat_template: str | None = flag(ChatTemplateOption, None)
    mask_prompt: bool = flag(MaskPrompt, True)
    sample_start: str | None = flag(SampleStart, None)
    include_sample_start: bool = flag(IncludeSampleStart, False)
    escape: bool = flag(Escape, False)
    truncate: bool = flag(Truncate, True)
    val_file: Path | None = flag(ValFile, None)
    steps_per_eval: int | None = flag(StepsPerEval, None)

    def check(self) -> None:
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
        if self.steps_per_eval is not None and self.steps_per_eval <= 0:
            raise InputError(f"--steps-per-eval must be a positive number of optimizer steps, got {self.steps_per_eval}")

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
            raise InputError(_as_flag(*explain(e))) from None
        except ValueError as e:
            raise InputError(str(e)) from None




def with_training_flags(**defaults: Any) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a typer command the shared training flags after its own (`defaults` overrides
    some defaults); the command receives their values as `args: TrainingArgs`."""
    def wrap(command: Callable[..., None]) -> Callable[..., None]:
        signature = inspect.signature(command, eval_str=True)
        own = [p for name, p in signature.parameters.items() if name != "args"]
        shared = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=f.metadata["option"],
                                    default=defaults.get(f.name, f.default))
                  for f in fields(TrainingArgs)]

        @functools.wraps(command)
        def with_flags(**values: Any) -> None:
            args = TrainingArgs(**{f.name: values.pop(f.name) for f in fields(TrainingArgs)})
            command(args=args, **values)
        with_flags.__signature__ = signature.replace(parameters=own + shared)
        with_flags.__annotations__ = {p.name: p.annotation for p in own + shared}
        return with_flags
    return wrap


def check_writable(path: Path) -> None:
    parent = path.resolve().parent
    if path.is_dir():
        raise InputError(f"cannot write {path}: it is a directory")
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise InputError(f"cannot write {path}: directory {parent} does not exist or is not writable")


# the TrainingArgs field whose flag sets each checked record field (ggmlpy.records.explain's field)
_ARG_OF_FIELD = {"LRSchedule.lr0": "lr", "LRSchedule.lr_min": "lr_min", "LRSchedule.decay_epochs": "decay_epochs",
                 "LRSchedule.half_life": "lr_half", "LRSchedule.halvings": "lr_halvings", "LRSchedule.epochs": "epochs",
                 "LRSchedule.kind": "lr_schedule", "LRSchedule.warmup": "warmup", "LRSchedule.cos_restart": "cos_restart",
                 "AdamW.wd": "wd", "SGD.wd": "wd", "TrainParams.grad_clip": "grad_clip"}


def _as_flag(field_name: str, message: str) -> str:
    """A parameter error as the command line's user knows it: the flag, not the field."""
    arg = _ARG_OF_FIELD.get(field_name)
    if arg is None or not message.startswith(field_name):
        return message
    option = typing.get_args(next(f for f in fields(TrainingArgs) if f.name == arg).metadata["option"])[1]
    # in an Annotated alias typer keeps the first name as the option's default
    flag = next(d for d in (option.default, *option.param_decls) if isinstance(d, str) and d.startswith("-"))
    return flag + message[len(field_name):]


def train(model, params: TrainParams, data: TrainingData, args: TrainingArgs, output: Path, lora_out: Path | None,
          tool: str) -> Context:
    """Train `model` on `data` and save the result (the adapter to `lora_out` when params
    train one, else the model to `output`); returns the context (for a sample)."""
    args.check()
    comm = job()
    main_rank = comm.rank == 0
    for path in ([lora_out] if params.lora else [output]) + [p for p in (args.plot, args.checkpoint_out) if p]:
        check_writable(path)
    dataset = data.train
    n_batch = args.batch_size or args.ctx_size
    if data.val is not None:
        log(f"dataset: {dataset.ndata} windows for training, {data.val.ndata} for validation (the validation file; "
            "-val-split unused)")
    else:
        n_val = validation_windows(dataset.ndata, args.val_split)
        log(f"dataset: {dataset.ndata - n_val} windows for training, {n_val} for validation (-val-split {args.val_split:g})")
    sched = params.schedule
    log(f"training: {args.optimizer.lower()}, lr {sched.lr0:g} ({sched.kind}"
        f"{f', warmup {sched.warmup}' if sched.warmup else ''}), {n_batch} tokens per step, "
        f"ubatch {min(args.ubatch_size, args.ctx_size)}, {args.epochs} epoch{'s' if args.epochs != 1 else ''}"
        f"{f', gradient norm clipped to {params.grad_clip:g}' if params.grad_clip else ''}"
        f"{', gradient checkpointing' if params.grad_checkpoint else ''}")
    n_threads = args.threads or default_threads()
    if n_batch > args.ctx_size:  # several windows per step: the context holds the step, windows stay -c long
        params = params.replace(n_ctx_train=args.ctx_size)
    ctx = Context(model, n_ctx=max(args.ctx_size, n_batch), n_batch=n_batch, n_ubatch=args.ubatch_size,
                  n_threads=n_threads)
    if comm.size > 1:
        log(f"distributed: {comm.size} ranks, {n_batch} tokens per step each ({n_batch * comm.size} per step in all)")
        warning = oversubscription_warning(comm, n_threads)
        if warning:
            log(f"warning: {warning}")
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
    start = time.perf_counter()
    try:
        history = ctx.opt_fit(dataset, epochs=args.epochs, val_split=args.val_split, seed=args.seed,
                              checkpoint=args.checkpoint_out, save_every=args.save_every,
                              resume=args.checkpoint_in, force_resume=args.force_resume, val_data=data.val,
                              eval_every=args.steps_per_eval)
    except TrainingDivergedError as e:
        if main_rank:
            where = adapter.save(lora_out) if adapter else save_model_to_file(model, output)
            log(f"saved the last good weights to {where}")
        raise InputError(str(e)) from None
    except TrainingInterrupted as e:  # click would swallow a KeyboardInterrupt's message
        fail(str(e), 130, every_rank=e.on_every_rank)
    elapsed = time.perf_counter() - start
    n_trained = sum(len(h.train.losses) for h in history) * ctx.trainer.n_ubatch
    timing = ctx.trainer.timing
    log(f"{tool}: {n_trained} training tokens in {elapsed:.1f} s (validation included); training: "
        f"{timing.tokens_per_second * comm.size:.0f} tokens/s after the first window's {timing.startup_seconds:.2f} s "
        f"of start-up (graphs built, kernels loaded){f' ({comm.size} ranks)' if comm.size > 1 else ''}")
    if comm.size > 1 and ctx.trainer.n_steps:
        opt = ctx.trainer.opt
        log(f"distributed: summing the gradients took {1e3 * opt.reduce_seconds / ctx.trainer.n_steps:.2f} ms per step "
            f"({4 * opt.optimizer.grad_flat.size / 1e6:.2f} MB of gradients)")
    if data.test is not None:
        result = ctx.opt_evaluate(data.test)
        (loss, loss_unc), (acc, acc_unc) = result.loss(), result.accuracy()
        log(f"test: loss={loss:.5f}±{loss_unc:.5f} (perplexity {math.exp(min(loss, 700)):.3f}) "
            f"acc={100 * acc:.2f}±{100 * acc_unc:.2f}% over {data.test.ndata} windows")
    if not main_rank:
        return ctx
    if adapter:
        adapter.save(lora_out)
        log(f"{tool}: saved the LoRA adapter to {lora_out}")
    else:
        save_model_to_file(model, output)
        log(f"{tool}: saved the trained model to {output}")
    if args.plot:
        plot_history(history, args.plot)
        log(f"{tool}: wrote the loss curves to {args.plot}")
    return ctx


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB" if n < 1e9 else f"{n / 1e9:,.2f} GB"


def plot_history(history, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("--plot needs matplotlib: pip install 'llamapy[plot]'") from None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps, train_loss, val_x, val_loss = [], [], [], []
    for h in history:
        train_loss += h.train.steps
        steps = list(range(1, len(train_loss) + 1))
        for n, result in h.evals:  # --steps-per-eval, after optimizer step n
            val_x.append(n)
            val_loss.append(result.loss()[0])
        if h.val.losses:
            val_x.append(len(train_loss))
            val_loss.append(h.val.loss()[0])
    ax.plot(steps, train_loss, lw=0.8, label="train (per step)")
    if val_loss:
        ax.plot(val_x, val_loss, "o-", label="validation")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)
    plt.close(fig)


def bare_lr_half(argv: list[str]) -> list[str]:
    """`-lr-half` may come without a value (halve every epoch): give it one for the parser."""
    out = []
    for i, arg in enumerate(argv):
        out.append(arg)
        if arg == "-lr-half":
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is None or not _is_number(nxt):
                out.append("1")
    return out


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False
