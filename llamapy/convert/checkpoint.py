"""A Hugging Face checkpoint folder: config.json and the safetensors weights, single-file or
sharded, in the order llama.cpp's converter reads them (shards by file name, each shard's
tensors by name). Only the headers are read here; the shards are files of the folder, never
a path the index makes up (absolute, "..", a link out)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

from llamapy.errors import CheckpointError

from .config import check_layout
from .json_file import read_json
from .safetensors import StTensor, read_safetensors

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
    check_layout(config, path / "config.json")
    return Checkpoint(path, config, _tensors(path))


def _tensors(path: Path) -> dict[str, StTensor]:
    named: set[str] = set()
    if (path / INDEX).is_file():
        weight_map = _weight_map(path / INDEX)
        parts = _shards(path, weight_map.values(), f"named by {INDEX}")
        named = set(weight_map)
    else:
        found = sorted(f.name for f in path.iterdir() if f.name.startswith("model") and f.name.endswith(".safetensors"))
        if not found:
            bins = sorted(f.name for f in path.glob("pytorch_model*.bin"))
            raise CheckpointError(f"{path} has PyTorch weights ({bins[0]}) only: convert them to safetensors first"
                                  if bins else f"{path} has no model*.safetensors weights")
        parts = _shards(path, found, "a broken link")
    tensors: dict[str, StTensor] = {}
    for part in parts:
        for t in sorted(read_safetensors(path / part), key=lambda t: t.name):
            if t.name in tensors:
                raise CheckpointError(f"{path}: tensor {t.name!r} is in both {tensors[t.name].path.name} and {part}")
            tensors[t.name] = t
    if named and named != set(tensors):
        lost, extra = sorted(map(_printed, named - set(tensors))), sorted(map(_printed, set(tensors) - named))
        raise CheckpointError(f"{path}: {INDEX} and the shards disagree: "
                              + "; ".join(filter(None, [lost and f"{', '.join(lost[:5])} named but in no shard",
                                                        extra and f"{', '.join(extra[:5])} in a shard but not named"])))
    return tensors


def _weight_map(index: Path) -> dict[str, str]:
    """The index's tensor name -> shard file; a tensor named twice is refused (which shard
    holds it would depend on the JSON reader)."""
    content = read_json(index, unique=True)
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index} has no weight_map of tensor names to files")
    return weight_map


def _shards(folder: Path, names, why: str) -> list[str]:
    """The shard files `names` (index order: by name), each a file inside `folder`: a relative
    path without "..", which stays inside once links are followed (or, in a Hugging Face
    cache snapshot, leads into the cache's blobs). A file named twice is read once."""
    root = folder.resolve()
    blobs = root.parent.parent / "blobs" if root.parent.name == "snapshots" else None
    parts, seen, missing = [], set(), []
    for name in sorted(set(names)):
        if not _relative_inside(name):
            raise CheckpointError(f"{folder / INDEX}: shard {name!r} is not a file name inside the checkpoint's folder")
        target = (folder / name).resolve()
        if not (target.is_relative_to(root) or (blobs is not None and target.is_relative_to(blobs))):
            raise CheckpointError(f"{folder}: shard {name} leads out of the checkpoint's folder "
                                  f"(to {_printed(str(target))})")
        if not target.is_file():
            missing.append(name)
        elif target not in seen:
            seen.add(target)
            parts.append(name)
    if missing:
        raise CheckpointError(f"{folder}: missing shard{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                              f"({why})")
    return parts


def _relative_inside(name: str) -> bool:
    """`name` is a relative path that stays below the folder it is read from (on POSIX and
    Windows alike: no root, no drive, no backslash, no "..", nothing unprintable)."""
    pure = PurePosixPath(name)
    return (bool(name) and name.isprintable() and "\\" not in name and not pure.is_absolute()
            and not PureWindowsPath(name).drive and ".." not in pure.parts)


def _printed(text: str) -> str:
    """A name from a file as one line shows it (quoted and escaped when it holds a newline or the like)."""
    return text if text.isprintable() else repr(text)
