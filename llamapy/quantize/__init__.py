"""Quantizing a GGUF model: llama-quantize's result, byte for byte.

`quantize_model(in_path, out_path, "Q4_K_M")` writes what `llama-quantize IN OUT Q4_K_M`
writes (without an importance matrix): the input's metadata in its order, less
general.quantization_version, general.file_type and the split keys, which follow it
(quantization version 2, the file type), then the --override-kv values; the tensors in
llama.cpp's order (by layer, then by name), each in the type llama.cpp picks for it
(rules.py) made by ggml's reference quantizers (bit-identical kernels, parallel over rows);
32-byte alignment and zero padding as ggml's gguf writer lays them out.

The output is written atomically and never onto the input, and read back before it replaces
anything (llamapy.read_back: a model of an architecture llamapy runs through the model
loader's checks), so no quantization ends with a file llamapy cannot load. Bad input is one
LlamapyError: not a GGUF file, a model llamapy cannot load, a block count its tensors cannot
hold, layers to prune that it does not have (or all of them), an unknown or unwritable type,
an already quantized tensor without `allow_requantize`, a NaN or infinity in a tensor, an
unwritable destination.
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Union

import numba
import numpy as np
from pydantic import Field, model_validator

from ggmlpy import GGMLType
from ggmlpy.cores import FreeCores
from ggmlpy.quants import KERNELS
from ggmlpy.records import Bool, Int, Record, Str
from ggmlpy.types import traits

from ..atomic import replace_atomically
from ..errors import InputError, UnsupportedModelError
from ..gguf_file import GGUFFile, MetaValue, ValueType, typed_scalar
from ..gguf_writer import TensorOut, write_gguf
from ..read_back import check_model_structure, is_runnable_model, read_back_written
from .rows import convert_rows
from .ftypes import DEFAULT_TYPE, GUESS_FROM_TYPE, GUESSED, QUANT_OPTIONS, FileType, QuantOption, parse_option
from .rules import Fallback, ModelFacts, TypeChooser, ggml_n_dims, layer_of, parse_tensor_type, tensor_order

__all__ = ["QUANT_OPTIONS", "FileType", "KvOverride", "QuantizeParams", "QuantizeResult", "TensorReport",
           "parse_tensor_type", "quantize_model"]

QUANTIZATION_VERSION = 2  # GGML_QNT_VERSION
_SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
_MIB = 1024 * 1024
_PARALLEL_BYTES = 1 * _MIB  # tensors smaller than this are converted on one thread


class KvOverride(Record):
    """One --override-kv KEY=TYPE:VALUE (int, float, bool or str), as llama-quantize writes it:
    an int as a UINT32 of its magnitude, a float as FLOAT32, a string of at most 127 bytes."""

    key: Str = Field(min_length=1, max_length=127)
    kind: Literal["int", "float", "bool", "str"]
    value: Union[Bool, Int, float, Str]

    @classmethod
    def parse(cls, text: str) -> KvOverride:
        key, sep, rest = text.partition("=")
        kind, colon, value = rest.partition(":")
        if not sep or not key or not colon or kind not in ("int", "float", "bool", "str"):
            raise InputError(f"--override-kv {text!r}: expected KEY=TYPE:VALUE with TYPE int, float, bool or str")
        try:
            typed = {"int": int, "float": float, "str": str,
                     "bool": lambda v: {"true": True, "false": False}[v]}[kind](value)
        except (ValueError, KeyError):
            raise InputError(f"--override-kv {text!r}: {value!r} is not a {kind}") from None
        if kind == "str" and len(value.encode("utf-8", "surrogateescape")) > 127:
            raise InputError(f"--override-kv {text!r}: a string value cannot exceed 127 bytes")
        if len(key) > 127:
            raise InputError(f"--override-kv {text!r}: the key cannot exceed 127 characters")
        return cls(key=key, kind=kind, value=typed)

    def meta_value(self) -> MetaValue:
        if self.kind == "int":
            return MetaValue(ValueType.UINT32, None, abs(int(self.value)) & 0xFFFFFFFF)
        if self.kind == "float":
            return MetaValue(ValueType.FLOAT32, None, float(self.value))
        if self.kind == "bool":
            return MetaValue(ValueType.BOOL, None, bool(self.value))
        return MetaValue(ValueType.STRING, None, str(self.value))


class QuantizeParams(Record):
    """llama_model_quantize_params, as far as llamapy implements them (no importance matrix,
    no split files)."""

    allow_requantize: Bool = False        # quantize tensors that are already quantized (dequantized first)
    quantize_output_tensor: Bool = True   # False: output.weight keeps its type (--leave-output-tensor)
    pure: Bool = False                    # every tensor in the file type's own type: no mix
    output_tensor_type: GGMLType | None = None
    token_embedding_type: GGMLType | None = None
    tensor_types: tuple[tuple[Str, GGMLType], ...] = ()  # (regex searched in a name, type): the first match wins
    prune_layers: tuple[Int, ...] = ()   # blocks left out; the others renumbered
    kv_overrides: tuple[KvOverride, ...] = ()
    dry_run: Bool = False                # sizes only, no file
    n_threads: Int | None = Field(default=None, ge=1)  # None: the cores
    slab_bytes: Int = Field(default=64 * _MIB, ge=1)    # rows converted at once (memory, not results)

    @model_validator(mode="after")
    def _check(self) -> QuantizeParams:
        for t in (self.output_tensor_type, self.token_embedding_type, *(t for _, t in self.tensor_types)):
            if t is not None:
                parse_tensor_type(traits(t).name, "tensor type")
        for pattern, _ in self.tensor_types:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"tensor type pattern {pattern!r}: {e}") from None
        if any(layer < 0 for layer in self.prune_layers):
            raise ValueError("prune_layers: layer numbers must be >= 0")
        return self


@dataclass(frozen=True)
class TensorReport:
    """One tensor as written: llama-quantize's progress line (`str(report)`)."""

    index: int
    count: int
    name: str
    ne: tuple[int, ...]
    type_in: GGMLType
    type_out: GGMLType
    bytes_in: int
    bytes_out: int

    def __str__(self) -> str:
        ne = (tuple(self.ne) + (1, 1, 1, 1))[:4]
        shape = ", ".join(f"{n:6d}" for n in ne)
        head = f"[{self.index:4d}/{self.count:4d}] {self.name:<36} - [{shape}], type = {traits(self.type_in).name:>6}, "
        if self.type_in == self.type_out:
            return head + f"size = {self.bytes_in / _MIB:8.3f} MiB"
        return head + (f"converting to {traits(self.type_out).name} .. size = {self.bytes_in / _MIB:8.2f} MiB -> "
                       f"{self.bytes_out / _MIB:8.2f} MiB")


@dataclass(frozen=True)
class QuantizeResult:
    """What was written: the file type, every tensor, the fallbacks, the totals."""

    path: Path | None
    ftype: int
    tensors: list[TensorReport]
    fallbacks: list[Fallback]
    n_elements: int

    @property
    def bytes_in(self) -> int:
        return sum(t.bytes_in for t in self.tensors)

    @property
    def bytes_out(self) -> int:
        return sum(t.bytes_out for t in self.tensors)

    def totals(self) -> list[str]:
        """llama-quantize's closing lines: the sizes in MiB and bits per weight."""
        lines = []
        for what, nbytes in (("model size ", self.bytes_in), ("quant size ", self.bytes_out)):
            bpw = nbytes * 8.0 / self.n_elements if self.n_elements else 0.0
            lines.append(f"{what} = {nbytes / _MIB:8.2f} MiB ({bpw:.2f} BPW)")
        if self.fallbacks:
            lines.append(f"WARNING: {len(self.fallbacks)} of {len(self.tensors)} tensor(s) required fallback "
                         "quantization")
        return lines


@dataclass(frozen=True)
class _Planned:
    name: str      # as written (renumbered when layers are pruned)
    source: str    # in the input
    ne: tuple[int, ...]
    type_in: GGMLType
    type_out: GGMLType


def quantize_model(in_path: str | os.PathLike, out_path: str | os.PathLike | None, ftype: str | int | FileType,
                   params: QuantizeParams | None = None, *, on_tensor: Callable[[TensorReport], None] | None = None,
                   on_warning: Callable[[str], None] | None = None) -> QuantizeResult:
    """Quantize the GGUF model `in_path` to `ftype` (llama-quantize's names, "Q4_K_M", or
    numbers, 15) into `out_path`, as llama-quantize does (module docstring). `on_tensor`
    hears of each tensor when it is written, `on_warning` of each fallback and override."""
    params = params or QuantizeParams()
    option = ftype if isinstance(ftype, QuantOption) else parse_option(ftype)
    only_copy = option.name == "COPY"
    if out_path is None and not params.dry_run:
        raise InputError("give the output file")
    src = GGUFFile(in_path)
    if out_path is not None and not params.dry_run:
        _refuse_same_file(Path(in_path), Path(out_path))
    if is_runnable_model(src.metadata):  # what llamapy loads stays loadable: refused now, not after the work
        check_model_structure(src)
    metadata = dict(src.metadata)
    for o in params.kv_overrides:
        metadata[o.key] = o.meta_value()
    facts = ModelFacts.from_metadata(metadata, str(src.path), len(src.tensors))
    order = tensor_order(list(src.tensors))
    _check_prune(params.prune_layers, order, facts.n_layer)
    names, n_blocks = _renamed(order, params.prune_layers)
    kept = [(name, source) for name, source in zip(names, order) if name]
    file_type = _file_type(src, order) if only_copy else int(option.ftype)

    chooser = TypeChooser(facts, FileType(option.ftype), DEFAULT_TYPE[option.ftype], [n for n, _ in kept],
                          pure=params.pure, quantize_output=params.quantize_output_tensor, only_copy=only_copy,
                          output_tensor_type=params.output_tensor_type,
                          token_embedding_type=params.token_embedding_type, tensor_types=params.tensor_types,
                          on_override=on_warning)
    plan = []
    for name, source in kept:
        t = src.tensors[source]
        ne = tuple(t.ne[:ggml_n_dims(t.ne)])
        plan.append(_Planned(name, source, ne, t.type, chooser.choose(name, t.ne, t.type)))
    for f in chooser.fallbacks:
        if on_warning is not None:
            on_warning(str(f))
    for p in plan:
        _check_convertible(p, params.allow_requantize)

    out_meta = {key: v for key, v in metadata.items()
                if key not in ("general.quantization_version", "general.file_type", *_SPLIT_KEYS)
                and key not in {o.key for o in params.kv_overrides}}
    out_meta["general.quantization_version"] = MetaValue(ValueType.UINT32, None, QUANTIZATION_VERSION)
    out_meta["general.file_type"] = MetaValue(ValueType.UINT32, None, file_type)
    for o in params.kv_overrides:
        out_meta[o.key] = o.meta_value()
    if params.prune_layers:
        key = f"{facts.arch}.block_count"
        out_meta.pop(key, None)
        out_meta[key] = MetaValue(ValueType.UINT32, None, n_blocks)

    reports: list[TensorReport] = []

    def report(i: int, p: _Planned) -> TensorReport:
        r = TensorReport(i + 1, len(plan), p.name, p.ne, p.type_in, p.type_out, src.tensors[p.source].nbytes(),
                         _nbytes(p.type_out, p.ne))
        reports.append(r)
        if on_tensor is not None:
            on_tensor(r)
        return r

    n_elements = sum(src.tensors[p.source].nelements() for p in plan)
    if params.dry_run:
        for i, p in enumerate(plan):
            report(i, p)
        return QuantizeResult(None, file_type, reports, chooser.fallbacks, n_elements)

    n_threads = min(params.n_threads or os.cpu_count() or 1, numba.config.NUMBA_NUM_THREADS)
    free_cores = FreeCores()  # fewer threads while other processes keep cores busy

    def pieces(i: int, p: _Planned) -> Callable[[], Iterator[np.ndarray]]:
        def make() -> Iterator[np.ndarray]:
            t = src.tensors[p.source]
            # a small tensor on one thread: waking the others costs more than they save
            numba.set_num_threads(free_cores.threads(n_threads) if t.nbytes() >= _PARALLEL_BYTES else 1)
            yield from convert_rows(p.source, fd, t.offset, p.type_in, p.type_out, p.ne[0], t.nrows(),
                                    params.slab_bytes)
            report(i, p)
        return make

    tensors = [TensorOut(p.name, p.type_out, p.ne, pieces(i, p)) for i, p in enumerate(plan)]
    threads = numba.get_num_threads()
    fd = os.open(src.path, os.O_RDONLY)
    try:
        path = replace_atomically(Path(out_path), lambda out: write_gguf(out, out_meta, tensors), "the quantized model",
                                  validate=read_back_written)
    finally:
        os.close(fd)
        numba.set_num_threads(threads)
    return QuantizeResult(path, file_type, reports, chooser.fallbacks, n_elements)


def _refuse_same_file(a: Path, b: Path) -> None:
    try:
        same = a.resolve() == b.resolve() or (b.exists() and os.path.samefile(a, b))
    except OSError:
        same = False
    if same:
        raise InputError(f"input and output files are the same: {a}")


def _check_prune(prune: tuple[int, ...], order: list[str], n_layer: int) -> None:
    """The layers to prune are layers of the model, and not all of them (a model without
    layers loads nowhere)."""
    if not prune:
        return
    present = {layer for layer in map(layer_of, order) if layer is not None}
    missing = [layer for layer in prune if layer not in present]
    if missing:
        raise InputError(f"--prune-layers {missing[0]}: the model has {n_layer} layers (0 to {n_layer - 1})")
    if present <= set(prune):
        raise InputError(f"--prune-layers names every layer of the model ({n_layer}): nothing would be left to run")


def _renamed(order: list[str], prune: tuple[int, ...]) -> tuple[list[str], int]:
    """llama.cpp's remap_layer over the tensors in order: "" for a tensor of a pruned block, the
    blocks after the first pruned one renumbered in sequence; and the block count it sets."""
    if not prune:
        return list(order), 0
    prune = tuple(sorted(set(prune)))
    mapped: dict[int, str] = {}
    next_id = 0
    out = []
    for name in order:
        m = re.search(r"blk\.(\d+)\.", name)
        if m is None:
            out.append(name)
            continue
        blk = int(m.group(1))
        if blk not in mapped:
            if blk in prune:
                mapped[blk] = ""
            elif blk < prune[0]:
                mapped[blk], next_id = str(blk), blk + 1
            else:
                mapped[blk], next_id = str(next_id), next_id + 1
        out.append(mapped[blk] and name[:m.start(1)] + mapped[blk] + name[m.end(1):])
    return out, next_id


def _file_type(src: GGUFFile, order: list[str]) -> int:
    """The file type llama.cpp's loader gives the input (COPY writes it back): general.file_type,
    else guessed from the most common tensor type and marked as guessed."""
    given = typed_scalar(src.metadata, "general.file_type", int, src.path)
    if given is not None:
        return given
    counts: dict[GGMLType, int] = {}
    best, most = GGMLType.F32, 0
    for name in order:
        t = src.tensors[name].type
        counts[t] = counts.get(t, 0) + 1
        if counts[t] > most:
            best, most = t, counts[t]
    return int(GUESS_FROM_TYPE.get(best, FileType.ALL_F32)) | GUESSED


def _check_convertible(p: _Planned, allow_requantize: bool) -> None:
    if p.type_in == p.type_out:
        return
    block = traits(p.type_out).blck_size
    if p.ne[0] % block:  # a type asked for by name gets no fallback (llama-quantize aborts)
        raise InputError(f"tensor {p.source}: rows of {p.ne[0]} values do not fit {traits(p.type_out).name}'s blocks "
                         f"of {block}")
    tr = traits(p.type_in)
    if tr.is_quantized and not allow_requantize:
        raise InputError(f"requantizing from type {tr.name} is disabled (tensor {p.source}): allow it with "
                         "--allow-requantize")
    if tr.is_quantized and p.type_in not in KERNELS or not tr.is_quantized and p.type_in not in (
            GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        raise UnsupportedModelError(f"cannot dequantize/convert tensor type {tr.name} (tensor {p.source})")


def _nbytes(type: GGMLType, ne: tuple[int, ...]) -> int:
    tr = traits(type)
    n = ne[0] // tr.blck_size * tr.type_size
    for d in ne[1:]:
        n *= d
    return n
