"""Training checkpoints: one GGUF file from which an interrupted run resumes exactly.

A checkpoint holds, as tensors, the trained tensors (the model's weights or a LoRA
adapter's matrices, `param.<name>`), the optimizer state (`opt.m.<name>`, `opt.v.<name>`)
and the shuffled window order (`data.permutation`); as metadata (`llamapy.checkpoint.*`)
the optimizer's step count, the position in the run (epoch, next window, whether that
epoch is shuffled), the shuffle RNG's state, the training result of the epoch so far, the
training parameters, fingerprints of the model and of the data, and a checksum of every
tensor byte. It is written atomically (a temp file renamed over the old checkpoint), so a
kill or a full disk while writing leaves the previous checkpoint intact.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

from ggmlpy.opt import Dataset, FitPosition, Result
from ggmlpy.records import Int, Record, explain

from .dataset import PackedWindows
from .errors import InputError, LlamapyError
from .gguf_file import GGUFFile, MetaValue, ValueType
from .gguf_writer import array_out
from .save import write_atomically
from .train_params import TrainParams

VERSION = 2  # 2: params is RunParams' JSON; 1: a flat dict (still read)
PREFIX = "llamapy.checkpoint."
_ARCH = "llamapy-checkpoint"


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

    @classmethod
    def from_version_1(cls, old: dict[str, Any]) -> "RunParams":
        """A version-1 checkpoint's flat params dict (its TrainParams fields in part)."""
        train = TrainParams(optimizer=old["optimizer"], schedule=old["schedule"], lora=old["lora"],
                            grad_clip=old["grad_clip"], window_bos=old["window_bos"])
        return cls(train=train, n_ctx=old["n_ctx"], n_batch=old["n_batch"], n_ubatch=old["n_ubatch"],
                   trained=old["trained"], shuffle_seed=old["shuffle_seed"])


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


def save_checkpoint(ckpt: Checkpoint, path: str | os.PathLike) -> Path:
    """Write `ckpt` to `path` atomically (SaveError with one line when it cannot)."""
    digest = hashlib.blake2b(digest_size=16)
    arrays: list[tuple[str, np.ndarray]] = [(f"param.{n}", a) for n, a in ckpt.tensors.items()]
    arrays += [(n, a) for n, a in ckpt.optimizer.items() if n != "opt.n_steps"]
    arrays.append(("data.permutation", ckpt.permutation.astype(np.int64)))
    tensors = []
    for name, a in arrays:
        t = array_out(name, a)
        digest.update(name.encode())
        digest.update(t.data)
        tensors.append(t)
    meta = {
        "version": VERSION,
        "n_steps": int(np.asarray(ckpt.optimizer.get("opt.n_steps", [0])).reshape(-1)[0]),
        "position": [ckpt.position.epoch, ckpt.position.ibatch, int(ckpt.position.shuffled)],
        "rng_state": ckpt.rng_state,
        "epoch_result": ckpt.epoch_result.to_dict(),
        "model_fingerprint": ckpt.model_fingerprint,
        "data_fingerprint": ckpt.data_fingerprint,
    }
    strings = {"general.architecture": _ARCH, "general.type": "checkpoint"}
    strings.update((PREFIX + key, json.dumps(value, sort_keys=True)) for key, value in meta.items())
    strings[PREFIX + "params"] = ckpt.params.model_dump_json()
    strings[PREFIX + "checksum"] = digest.hexdigest()
    return write_atomically({k: MetaValue(ValueType.STRING, None, v) for k, v in strings.items()}, tensors,
                            Path(path), "checkpoint")


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read and verify a checkpoint; InputError with one line when it is missing, not a
    checkpoint, truncated or corrupt."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"checkpoint not found: {path}")
    try:
        f = GGUFFile(path)
    except LlamapyError as e:
        raise InputError(f"{path}: not a readable checkpoint (truncated or corrupt: {e})") from None
    try:
        meta = {k[len(PREFIX):]: json.loads(v.value) for k, v in f.metadata.items()
                if k.startswith(PREFIX) and k not in (PREFIX + "checksum", PREFIX + "params")}
    except (ValueError, TypeError) as e:
        raise InputError(f"{path}: checkpoint is corrupt ({e})") from None
    checksum = f.get(PREFIX + "checksum")
    if "version" not in meta or checksum is None:
        raise InputError(f"{path}: not a llamapy checkpoint")
    if meta["version"] not in (1, VERSION):
        raise InputError(f"{path}: checkpoint version {meta['version']} is not supported (this llamapy writes {VERSION})")
    try:
        saved = f.get(PREFIX + "params") or "null"
        params = (RunParams.model_validate_json(saved) if meta["version"] == VERSION
                  else RunParams.from_version_1(json.loads(saved)))
    except ValidationError as e:
        raise InputError(f"{path}: the checkpoint's training parameters are not valid ({explain(e)[1]})") from None
    except (ValueError, TypeError, KeyError) as e:
        raise InputError(f"{path}: checkpoint is corrupt (training parameters: {e})") from None
    digest = hashlib.blake2b(digest_size=16)
    arrays: dict[str, np.ndarray] = {}
    for name, t in f.tensors.items():
        a = t.numpy().reshape(t.ne[:f.tensor_n_dims[name]][::-1])  # a copy off the map, in its saved shape
        digest.update(name.encode())
        digest.update(a.view(np.uint8).reshape(-1))
        arrays[name] = a
    if digest.hexdigest() != checksum:
        raise InputError(f"{path}: checkpoint is corrupt (checksum mismatch)")
    epoch, ibatch, shuffled = meta["position"]
    optimizer = {n: a for n, a in arrays.items() if n.startswith("opt.")}
    optimizer["opt.n_steps"] = np.array([meta["n_steps"]], dtype=np.int64)
    return Checkpoint(
        tensors={n[len("param."):]: a for n, a in arrays.items() if n.startswith("param.")},
        optimizer=optimizer, position=FitPosition(int(epoch), int(ibatch), bool(shuffled)),
        rng_state=meta["rng_state"], permutation=arrays["data.permutation"].astype(np.int64).reshape(-1),
        epoch_result=Result.from_dict(meta["epoch_result"]), params=params,
        model_fingerprint=meta["model_fingerprint"], data_fingerprint=meta["data_fingerprint"])


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
    for packed samples each token's position and sequence): the same data cut the same way."""
    digest = hashlib.blake2b(digest_size=16)
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
