"""A Hugging Face checkpoint folder: config.json and the safetensors weights, single-file or
sharded, in the order llama.cpp's converter reads them (shards by file name, each shard's
tensors by name)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llamapy.errors import CheckpointError

from .safetensors import StTensor, read_safetensors
from .special_tokens import read_json

INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    config: dict  # config.json as written (text_config not merged)
    tensors: dict[str, StTensor]


def open_checkpoint(path: Path) -> Checkpoint:
    """The checkpoint in folder `path`; CheckpointError with one line for a missing or broken part."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a folder: give the folder of a Hugging Face checkpoint")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} has no config.json: not a Hugging Face checkpoint")
    config = read_json(path / "config.json")
    if not isinstance(config, dict):
        raise CheckpointError(f"{path / 'config.json'} is not a JSON object")
    return Checkpoint(path, config, _tensors(path))


def _tensors(path: Path) -> dict[str, StTensor]:
    named: set[str] = set()
    if (path / INDEX).is_file():
        weight_map = read_json(path / INDEX).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{path / INDEX} has no weight_map of tensor names to files")
        parts = sorted(set(weight_map.values()))
        missing = [p for p in parts if not (path / p).is_file()]
        if missing:
            raise CheckpointError(f"{path}: missing shard{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                                  f"(named by {INDEX})")
        named = set(weight_map)
    else:
        parts = sorted(f.name for f in path.iterdir() if f.name.startswith("model") and f.name.endswith(".safetensors"))
        if not parts:
            bins = sorted(f.name for f in path.glob("pytorch_model*.bin"))
            raise CheckpointError(f"{path} has PyTorch weights ({bins[0]}) only: convert them to safetensors first"
                                  if bins else f"{path} has no model*.safetensors weights")
    tensors: dict[str, StTensor] = {}
    for part in parts:
        for t in sorted(read_safetensors(path / part), key=lambda t: t.name):
            if t.name in tensors:
                raise CheckpointError(f"{path}: tensor {t.name!r} is in both {tensors[t.name].path.name} and {part}")
            tensors[t.name] = t
    if named and named != set(tensors):
        lost, extra = sorted(named - set(tensors)), sorted(set(tensors) - named)
        raise CheckpointError(f"{path}: {INDEX} and the shards disagree: "
                              + "; ".join(filter(None, [lost and f"{', '.join(lost[:5])} named but in no shard",
                                                        extra and f"{', '.join(extra[:5])} in a shard but not named"])))
    return tensors
