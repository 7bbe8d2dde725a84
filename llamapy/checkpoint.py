"""Training checkpoints: one GGUF file from which an interrupted run resumes exactly.

A checkpoint holds, as tensors, the trained tensors (the model's weights or a LoRA
adapter's matrices, `param.<name>`), the optimizer state (`opt.m.<name>`, `opt.v.<name>`)
and the shuffled window order (`data.permutation`); as metadata (`llamapy.checkpoint.*`,
JSON strings) the optimizer's step count, the position in the run (epoch, next window,
whether that epoch is shuffled), the shuffle RNG's state, the training result of the epoch
so far, the training parameters and fingerprints of the model and of the data. It is
written atomically (a temp file renamed over the old checkpoint), so a kill or a full disk
while writing leaves the previous checkpoint intact.

Its first metadata entry, `llamapy.checkpoint.checksum`, is a BLAKE2b-256 digest of every
byte of the file as written (header, every key and value, tensor infos, padding, every
tensor's bytes), computed with the digest's own 64 characters written as zeros. Reading
checks it before anything else is believed: any changed, added, lost or truncated byte is
one line ("truncated or corrupt"). What the digest cannot catch, a file crafted with a
valid one (or written by a faulty program), is refused by the checks that follow: every
key present with its type, values in range (counts not negative and within int64, a
position inside its epoch, an RNG state numpy accepts, a permutation of the right length
that is one), counters that agree (the step count and the steps the epoch's result records
with the position), the tensors those of the trained tensors and the optimizer the
parameters name, every value of them finite and no second moment negative. What depends on
the data resumed on (the position inside its epoch, the step count an epoch takes) is
checked when a run resumes (resume.py). Each refusal is an InputError naming the file and
the problem.

Checkpoints of earlier versions (1 and 2) had a checksum over the tensors only, so their
metadata (step count, position, RNG state) cannot be verified: they are refused with one
line saying so; the run is started again (or finished with the llamapy that wrote it).

Resuming restores all of that into a trainer built with the same structure (same
trained tensors, optimizer, window size and batch); the run then continues with tensors
bit-identical to an uninterrupted run. A checkpoint of another model or another text is
refused unless forced; hyper-parameters that may change on resume (learning rate,
schedule, epochs, clipping) are reported when they differ.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import Field, ValidationError, field_validator, model_validator

from ggmlpy import GGMLType
from ggmlpy.opt import Dataset, FitPosition, Result
from ggmlpy.records import Bool, Int, Record, Str, explain

from .dataset import PackedWindows
from .errors import InputError, LlamapyError
from .gguf_file import GGUFFile, MetaValue, ValueType
from .gguf_writer import TensorOut, array_out, write_gguf
from .save import write_atomically
from .train_params import TrainParams

VERSION = 3  # 3: the checksum covers the whole file; 2 and 1 (tensors only) are refused
PREFIX = "llamapy.checkpoint."
CHECKSUM_KEY = PREFIX + "checksum"
_ARCH = "llamapy-checkpoint"
_DIGEST_CHARS = 64  # BLAKE2b-256 in hex
# the file's first bytes up to the checksum's value: GGUF magic, version, tensor and key
# counts, then the first key (its length and name), its type (string) and the value's length
_HEAD = struct.Struct(f"<4sIQQQ{len(CHECKSUM_KEY)}sIQ")
_CHUNK = 1 << 24
_CHECK_CHUNK = 1 << 22  # values checked at once for NaN and infinities


class RunParams(Record):
    """What a checkpoint records of the run that wrote it: its TrainParams (without the
    parameter filter, a function; `trained` says what it chose) and what the context and
    the fit added."""

    train: TrainParams
    n_ctx: Int                         # tokens per window
    n_batch: Int                       # tokens per optimizer step, all ranks
    n_ubatch: Int
    trained: tuple[tuple[str, tuple[Int, ...]], ...]  # (name, ne) of every trained tensor
    shuffle_seed: Int | None = None

    def summary(self) -> dict[str, Any]:
        """The run as compare_params weighs it: structure (STRUCTURE) and hyper-parameters."""
        p = self.train
        return {"kind": "lora" if p.lora else "full", "optimizer_kind": p.optimizer.kind,
                "n_ctx": self.n_ctx, "n_batch": self.n_batch,
                "lora": p.lora.model_dump(mode="json", exclude={"seed"}) if p.lora else None,
                "trained": [[n, list(ne)] for n, ne in self.trained],
                **p.model_dump(mode="json", exclude={"lora", "n_ctx_train"}),  # n_ctx is the one that counts
                "shuffle_seed": self.shuffle_seed, "n_ubatch": self.n_ubatch}


@dataclass
class Checkpoint:
    """A checkpoint's contents (see the module docstring)."""

    tensors: dict[str, np.ndarray]         # trained tensors by name (numpy shape of the tensor)
    optimizer: dict[str, np.ndarray]       # OptimizerState.to_arrays()
    position: FitPosition
    rng_state: dict[str, Any] | None       # numpy bit generator state of the shuffle, None: no shuffle
    permutation: np.ndarray
    epoch_result: Result
    params: RunParams                      # training parameters (structure and hyper-parameters)
    model_fingerprint: str
    data_fingerprint: str


# ---- the metadata as read back: every value checked ----------------------------------------------
INT64_MAX = 2**63 - 1  # counts are int64 in the optimizer state and numpy
Count = Annotated[Int, Field(ge=0, le=INT64_MAX)]
Fingerprint = Annotated[Str, Field(pattern=r"^([0-9a-f]{32})?$")]  # empty: saved before any data


class SavedResult(Record):
    """`epoch_result`: Result.to_dict() of the epoch so far."""

    ndata: Count
    losses: list[Annotated[float, Field(strict=True)]]  # NaN and inf allowed: a diverged run is a run
    counts: list[Count]
    steps: list[Annotated[float, Field(strict=True)]]
    ncorrect: Annotated[Int, Field(ge=-1, le=INT64_MAX)]  # -1: not counted
    loss_per_datapoint: Bool

    @model_validator(mode="after")
    def _one_count_per_loss(self) -> SavedResult:
        if len(self.counts) != len(self.losses):
            raise ValueError(f"{PREFIX}epoch_result has {len(self.losses)} losses but {len(self.counts)} counts")
        return self


class SavedState(Record):
    """The `llamapy.checkpoint.*` keys other than the checksum and the parameters."""

    version: Literal[3]
    n_steps: Count
    position: tuple[Count, Count, Literal[0, 1]]  # epoch, next batch of the epoch, shuffled
    rng_state: dict[str, Any] | None
    epoch_result: SavedResult
    model_fingerprint: Fingerprint
    data_fingerprint: Fingerprint

    @field_validator("rng_state")
    @classmethod
    def _numpy_accepts(cls, state: dict[str, Any] | None) -> dict[str, Any] | None:
        if state is not None:
            try:
                np.random.PCG64().state = state
            except (ValueError, TypeError, KeyError, OverflowError):
                raise ValueError(f"{PREFIX}rng_state is not the state of numpy's PCG64 generator") from None
        return state

    @model_validator(mode="after")
    def _epoch_start_is_unshuffled(self) -> SavedState:
        _, ibatch, shuffled = self.position
        if not shuffled and ibatch:
            raise ValueError(f"{PREFIX}position {list(self.position)} is inside an epoch whose windows were not "
                             "shuffled")
        return self

    @model_validator(mode="after")
    def _steps_agree(self) -> SavedState:
        """Each optimizer step of the epoch so far adds one entry to epoch_result.steps (which
        starts empty with each epoch), and counts in n_steps with those of earlier epochs."""
        recorded = len(self.epoch_result.steps)
        if self.n_steps < recorded:
            raise ValueError(f"{PREFIX}n_steps {self.n_steps} is fewer than the {recorded} steps its epoch_result "
                             "records")
        if self.position[1] == 0 and recorded:
            raise ValueError(f"{PREFIX}position {list(self.position)} is the start of an epoch, but its epoch_result "
                             f"records {recorded} steps")
        if self.position[1] and not recorded:
            raise ValueError(f"{PREFIX}position {list(self.position)} is inside an epoch, but its epoch_result "
                             "records no step")
        return self


_STATE_KEYS = tuple(SavedState.model_fields)
_KEYS = {"general.architecture", "general.type", CHECKSUM_KEY, PREFIX + "params"} | {PREFIX + k for k in _STATE_KEYS}


# ---- writing -----------------------------------------------------------------------------------
class _Digest:
    """A write-only file that hashes what is written to it."""

    def __init__(self) -> None:
        self.hash = hashlib.blake2b(digest_size=_DIGEST_CHARS // 2)

    def write(self, data: bytes | memoryview) -> int:
        self.hash.update(data)
        return len(data)


def write_checkpoint_file(metadata: dict[str, MetaValue], tensors: list[TensorOut], path: str | os.PathLike) -> Path:
    """Write a checkpoint's metadata (its checksum entry excluded) and tensors to `path`,
    atomically, sealed with the checksum of every byte (SaveError with one line)."""
    metadata = {CHECKSUM_KEY: MetaValue(ValueType.STRING, None, "0" * _DIGEST_CHARS), **metadata}
    digest = _Digest()
    write_gguf(digest, metadata, tensors)  # the very bytes the file gets, the checksum written as zeros
    metadata[CHECKSUM_KEY] = MetaValue(ValueType.STRING, None, digest.hash.hexdigest())
    return write_atomically(metadata, tensors, Path(path), "checkpoint")


def save_checkpoint(ckpt: Checkpoint, path: str | os.PathLike) -> Path:
    """Write `ckpt` to `path` atomically (SaveError with one line when it cannot)."""
    arrays: list[tuple[str, np.ndarray]] = [(f"param.{n}", a) for n, a in ckpt.tensors.items()]
    arrays += [(n, a) for n, a in ckpt.optimizer.items() if n != "opt.n_steps"]
    arrays.append(("data.permutation", ckpt.permutation.astype(np.int64)))
    state = {
        "version": VERSION,
        "n_steps": int(np.asarray(ckpt.optimizer.get("opt.n_steps", [0])).reshape(-1)[0]),
        "position": [ckpt.position.epoch, ckpt.position.ibatch, int(ckpt.position.shuffled)],
        "rng_state": ckpt.rng_state,
        "epoch_result": ckpt.epoch_result.to_dict(),
        "model_fingerprint": ckpt.model_fingerprint,
        "data_fingerprint": ckpt.data_fingerprint,
    }
    strings = {"general.architecture": _ARCH, "general.type": "checkpoint"}
    strings.update((PREFIX + key, json.dumps(value, sort_keys=True)) for key, value in state.items())
    strings[PREFIX + "params"] = ckpt.params.model_dump_json()
    return write_checkpoint_file({k: MetaValue(ValueType.STRING, None, v) for k, v in strings.items()},
                                 [array_out(name, a) for name, a in arrays], path)


# ---- reading -----------------------------------------------------------------------------------
def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read and verify a checkpoint (see the module docstring); InputError with one line
    when it is missing, not a checkpoint, of an older version, truncated, corrupt or invalid."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"checkpoint not found: {path}")
    _verify_checksum(path)
    try:
        f = GGUFFile(path)
    except LlamapyError as e:
        raise InputError(f"{path}: not a readable checkpoint ({e})") from None
    strings = _metadata_strings(f, path)
    try:
        state = SavedState.model_validate({k: json.loads(strings[PREFIX + k]) for k in _STATE_KEYS})
        params = RunParams.model_validate_json(strings[PREFIX + "params"])
    except ValidationError as e:
        line = explain(e)[1].replace("SavedState.", PREFIX).replace("SavedResult.", PREFIX + "epoch_result.")
        raise InputError(f"{path}: the checkpoint is invalid: {line}") from None
    except (ValueError, RecursionError) as e:  # json
        raise InputError(f"{path}: the checkpoint is invalid: a value is not JSON ({e})") from None
    arrays = _tensors(f, path, params)
    optimizer = {n: a for n, a in arrays.items() if n.startswith("opt.")}
    optimizer["opt.n_steps"] = np.array([state.n_steps], dtype=np.int64)
    epoch, ibatch, shuffled = state.position
    return Checkpoint(
        tensors={n[len("param."):]: a for n, a in arrays.items() if n.startswith("param.")},
        optimizer=optimizer, position=FitPosition(epoch, ibatch, bool(shuffled)), rng_state=state.rng_state,
        permutation=arrays["data.permutation"], epoch_result=Result.from_dict(state.epoch_result.model_dump()),
        params=params, model_fingerprint=state.model_fingerprint, data_fingerprint=state.data_fingerprint)


def _verify_checksum(path: Path) -> None:
    """Hash the file as written (its checksum as zeros) and compare; nothing of it is
    believed before. A file without the checksum in front is an older checkpoint or none."""
    try:
        with open(path, "rb") as f:
            head = f.read(_HEAD.size + _DIGEST_CHARS)
            if len(head) < _HEAD.size + _DIGEST_CHARS:
                raise InputError(f"{path}: not a llamapy checkpoint, or truncated ({len(head)} bytes)")
            magic, _, _, _, key_len, key, value_type, value_len = _HEAD.unpack_from(head)
            if (magic, key_len, key) != (b"GGUF", len(CHECKSUM_KEY), CHECKSUM_KEY.encode()):
                raise _not_current(path, magic)
            saved = head[_HEAD.size:]
            if value_type != ValueType.STRING or value_len != _DIGEST_CHARS:
                raise InputError(f"{path}: checkpoint is truncated or corrupt (its checksum entry is damaged)")
            digest = hashlib.blake2b(head[:_HEAD.size], digest_size=_DIGEST_CHARS // 2)
            digest.update(b"0" * _DIGEST_CHARS)
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    except OSError as e:
        raise InputError(f"cannot read checkpoint {path}: {e.strerror or e}") from None
    if digest.hexdigest().encode() != saved:
        raise InputError(f"{path}: checkpoint is truncated or corrupt (its checksum does not match its contents: "
                         "the file was damaged or changed after it was written)")


def _not_current(path: Path, magic: bytes) -> InputError:
    """Why a file without the checksum in front is refused: an older checkpoint, a damaged
    one, or none."""
    if magic != b"GGUF":
        return InputError(f"{path}: not a llamapy checkpoint (not a GGUF file)")
    try:
        f = GGUFFile(path)
    except LlamapyError as e:
        return InputError(f"{path}: not a readable checkpoint ({e})")
    version = f.get(PREFIX + "version")
    if version not in ("1", "2"):
        if any(key.startswith(PREFIX) for key in f.metadata):
            return InputError(f"{path}: checkpoint is truncated or corrupt (its checksum entry is damaged)")
        return InputError(f"{path}: not a llamapy checkpoint")
    return InputError(f"{path}: checkpoint version {version} was written by an older llamapy, whose "
                      "checksum does not cover the step count, position and RNG state: it cannot be verified and "
                      f"is not resumed (this llamapy writes version {VERSION}); start the run again")


def _metadata_strings(f: GGUFFile, path: Path) -> dict[str, str]:
    """The metadata, exactly the keys a checkpoint has, each a string."""
    missing, extra = sorted(_KEYS - set(f.metadata)), sorted(set(f.metadata) - _KEYS)
    if missing or extra:
        what = f"has no {missing[0]}" if missing else f"has an unexpected key {extra[0][:80]!r}"
        raise InputError(f"{path}: the checkpoint is invalid: it {what}")
    for key, mv in f.metadata.items():
        if mv.type != ValueType.STRING:
            raise InputError(f"{path}: the checkpoint is invalid: {key} is a {ValueType(mv.type).name}, not a string")
    if (f.get("general.architecture"), f.get("general.type")) != (_ARCH, "checkpoint"):
        raise InputError(f"{path}: the checkpoint is invalid: it is not marked as one (general.architecture "
                         f"{_ARCH!r}, general.type 'checkpoint')")
    return {key: mv.value for key, mv in f.metadata.items()}


def _tensors(f: GGUFFile, path: Path, params: RunParams) -> dict[str, np.ndarray]:
    """The tensors (copies, in their saved shapes), checked: exactly the trained tensors of
    `params` with their sizes, their optimizer moments (AdamW) and a permutation."""
    trained = {name: int(np.prod(ne, dtype=np.int64)) for name, ne in params.trained}
    moments = ("opt.m.", "opt.v.") if params.train.optimizer.kind == "adamw" else ()
    expected = {f"param.{n}": (GGMLType.F32, size) for n, size in trained.items()}
    expected.update((f"{m}{n}", (GGMLType.F32, size)) for m in moments for n, size in trained.items())
    found = set(f.tensors)
    if found != set(expected) | {"data.permutation"}:
        missing, extra = sorted(set(expected) - found), sorted(found - set(expected) - {"data.permutation"})
        what = (f"has no tensor {missing[0]}" if missing else "has no window order (data.permutation)"
                if "data.permutation" not in found else f"has an unexpected tensor {extra[0][:80]!r}")
        raise InputError(f"{path}: the checkpoint is invalid: it {what}")
    arrays = {}
    for name, t in f.tensors.items():
        want_type, size = expected.get(name, (GGMLType.I64, None))
        if t.type != want_type or (size is not None and t.nelements() != size):
            raise InputError(f"{path}: the checkpoint is invalid: tensor {name} is {t.type.name} with "
                             f"{t.nelements()} values, not {want_type.name}" + (f" with {size}" if size else ""))
        arrays[name] = t.numpy().reshape(t.ne[:f.tensor_n_dims[name]][::-1])  # a copy off the map
    for name, values in arrays.items():
        if name != "data.permutation":
            _check_finite(values, name, path, nonnegative=name.startswith("opt.v."))
    perm = arrays["data.permutation"].reshape(-1)
    if not np.array_equal(np.sort(perm), np.arange(perm.size)):
        raise InputError(f"{path}: the checkpoint is invalid: its window order (data.permutation) is not a "
                         f"permutation of 0..{perm.size - 1}")
    arrays["data.permutation"] = perm
    return arrays


def _check_finite(values: np.ndarray, name: str, path: Path, nonnegative: bool) -> None:
    """Refuse a trained tensor or optimizer moment holding a NaN or an infinity (a run that
    had diverged, or damage: resuming would only spread it), or a negative second moment
    (AdamW divides by its square root). One float64 sum per chunk finds any of them (float32
    values cannot overflow it; NaN and infinities survive it); the index is looked for only
    then. Chunks bound the temporary memory."""
    flat = values.reshape(-1)
    for start in range(0, flat.size, _CHECK_CHUNK):
        chunk = flat[start:start + _CHECK_CHUNK]
        if np.isfinite(chunk.sum(dtype=np.float64)) and not (nonnegative and chunk.min() < 0):
            continue
        bad = np.flatnonzero(~np.isfinite(chunk))
        what = "non-finite"
        if not bad.size:
            bad, what = np.flatnonzero(chunk < 0), "negative"
        i = start + int(bad[0])
        raise InputError(f"{path}: the checkpoint is invalid: tensor {name} has a {what} value "
                         f"({float(flat[i]):.7g}) at index {i}"
                         + (" (a second moment is never negative)" if what == "negative" else ""))


# ---- fingerprints ------------------------------------------------------------------------------
def model_fingerprint(model, trained: set[str] = frozenset()) -> str:
    """The model a run trains. A model as loaded: a digest of its GGUF file (which training
    never changes). One built in memory or with replaced tensors: of its architecture,
    tensor shapes and the bytes of the tensors that do not train (`trained` names those
    that do: the checkpoint restores them anyway)."""
    cached = getattr(model, "_checkpoint_fingerprint", None)
    if cached is not None and cached[0] == model.revision:
        return cached[1]
    digest = hashlib.blake2b(digest_size=16)
    if model.revision == 0 and isinstance(model.file, GGUFFile):
        with open(model.path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    else:
        hp = model.hparams
        tensors = sorted(model.tensors.items())
        digest.update(json.dumps([hp.arch, hp.n_vocab, [(n, list(t.ne), int(t.type)) for n, t in tensors]]).encode())
        for name, t in tensors:
            if name not in trained:
                digest.update(np.ascontiguousarray(t.array()).view(np.uint8).reshape(-1))
    model._checkpoint_fingerprint = (model.revision, digest.hexdigest())
    return model._checkpoint_fingerprint[1]


def data_fingerprint(dataset: Dataset, idata_split: int) -> str:
    """The windows a run trains on (tokens, labels with their ignored positions, split, and
    for packed samples each token's position and sequence): the same data cut the same way.
    Windows read from token shards are known by their shards' index and cut (hashing a
    corpus larger than memory at every checkpoint would cost minutes)."""
    digest = hashlib.blake2b(digest_size=16)
    fingerprint = getattr(dataset, "fingerprint", None)
    if fingerprint is not None:
        digest.update(fingerprint().encode())
        digest.update(f"{dataset.ndata}:{dataset.ndata_shard}:{idata_split}".encode())
        return digest.hexdigest()
    arrays = [dataset.data] + ([dataset.labels] if dataset.labels is not None else [])
    if isinstance(dataset, PackedWindows):
        arrays += [dataset.pos, dataset.seq]
    for a in arrays:
        digest.update(np.ascontiguousarray(a).view(np.uint8).reshape(-1))
    digest.update(f"{dataset.ndata}:{dataset.ndata_shard}:{idata_split}".encode())
    return digest.hexdigest()


# ---- comparing a checkpoint's parameters with a run's -----------------------------------------
STRUCTURE = ("kind", "optimizer_kind", "n_ctx", "n_batch", "lora", "trained")


def compare_params(saved_run: RunParams, current_run: RunParams, path: Path) -> list[str]:
    """Refuse a checkpoint whose structure differs from the run's (InputError); return one
    line per hyper-parameter that differs (the run's value is used)."""
    saved, current = saved_run.summary(), current_run.summary()
    for key in STRUCTURE:
        if saved.get(key) != current.get(key):
            raise InputError(f"{path}: the checkpoint's {key} is {_short(saved.get(key))}, this run's is "
                             f"{_short(current.get(key))}: it cannot resume this run")
    notes = []
    for key in sorted(set(saved) | set(current)):
        if key not in STRUCTURE and saved.get(key) != current.get(key):
            notes.append(f"{key}: {_short(current.get(key))} (the checkpoint had {_short(saved.get(key))})")
    return notes


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 120 else text[:117] + "..."
