"""llamapy-quantize: llama.cpp's llama-quantize (same command line, same file, byte for byte).

    llamapy-quantize [flags] IN.gguf [OUT.gguf] TYPE [NTHREADS]

TYPE is a name (any case) or a number of llama-quantize's list; without OUT the model goes
to ggml-model-TYPE.gguf beside IN. One line per tensor and the totals go to stderr.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from pydantic import ValidationError

from ggmlpy.records import explain
from llamapy.errors import InputError
from llamapy.quantize import KvOverride, QuantizeParams, parse_tensor_type, quantize_model
from llamapy.quantize.ftypes import DEFAULT_TYPE, QUANT_OPTIONS, find_option, parse_option

from . import common
from . import flags as F
from .args import QUANTIZE, Tool, flag
from .common import log, thread_count, warn

tool = Tool("llamapy-quantize", llama_cpp=["quantize"])

AllowRequantize = Annotated[bool, flag("--allow-requantize", group=QUANTIZE, show_default=False,
                                       help="quantize tensors that are already quantized (dequantized first; "
                                            "quality suffers against quantizing from 16 or 32 bits)")]
LeaveOutput = Annotated[bool, flag("--leave-output-tensor", group=QUANTIZE, show_default=False,
                                   help="leave output.weight un(re)quantized")]
Pure = Annotated[bool, flag("--pure", group=QUANTIZE, show_default=False,
                            help="no k-quant mix: every tensor in the type's own type (fallbacks still apply)")]
OutputTensorType = Annotated[Optional[str], flag("--output-tensor-type", metavar="GGML_TYPE", group=QUANTIZE,
                                                 show_default=False, help="type of output.weight (e.g. q8_0, f16)")]
TokenEmbeddingType = Annotated[Optional[str], flag("--token-embedding-type", metavar="GGML_TYPE", group=QUANTIZE,
                                                   show_default=False, help="type of the token embeddings")]
TensorType = Annotated[Optional[list[str]], flag("--tensor-type", metavar="NAME=GGML_TYPE", group=QUANTIZE,
                                                 show_default=False,
                                                 help="quantize the tensors whose name NAME (a regular expression) "
                                                      "matches to this type, e.g. attn_q=q8_0 (repeatable)")]
TensorTypeFile = Annotated[Optional[Path], flag("--tensor-type-file", metavar="FNAME", group=QUANTIZE,
                                                show_default=False, path="read",
                                                help="NAME=GGML_TYPE entries separated by spaces or newlines")]
PruneLayers = Annotated[Optional[str], flag("--prune-layers", metavar="L0,L1,...", group=QUANTIZE,
                                            show_default=False,
                                            help="leave out these blocks (the others are renumbered)")]
OverrideKv = Annotated[Optional[list[str]], flag("--override-kv", metavar="KEY=TYPE:VALUE", group=QUANTIZE,
                                                 show_default=False,
                                                 help="set a metadata value in the output (TYPE int, float, bool or "
                                                      "str; repeatable)")]
DryRun = Annotated[bool, flag("--dry-run", group=QUANTIZE, show_default=False,
                              help="print the types and sizes without writing a file")]
MaxBufferSize = Annotated[int, flag("--max-buffer-size", metavar="MiB", group=QUANTIZE, min=1,
                                    help="rows converted at once, in MiB of buffers (memory only: the file is the "
                                         "same; llama.cpp's default is 8192)")]
def _types() -> str:
    """The type list of the help (click keeps the lines of a paragraph that starts with \\b)."""
    lines = ["\b", "Types (name in any case, or number; llamapy cannot write the ones with *):"]
    for option in QUANT_OPTIONS:
        number = "" if option.name == "COPY" else f"{int(option.ftype):2d} or "
        mark = " " if option.ftype in DEFAULT_TYPE and option.name != "Q2_K_S" else "*"
        lines.append(f"  {number:>6}{option.name:<9}{mark}: {option.description.strip()}")
    return "\n".join(lines)


Positional = Annotated[Optional[list[str]], typer.Argument(metavar="IN.gguf [OUT.gguf] TYPE [NTHREADS]",
                                                           show_default=False, hidden=True)]


def run(args: Positional = None, allow_requantize: AllowRequantize = False, leave_output_tensor: LeaveOutput = False,
        pure: Pure = False, output_tensor_type: OutputTensorType = None,
        token_embedding_type: TokenEmbeddingType = None, tensor_type: TensorType = None,
        tensor_type_file: TensorTypeFile = None, prune_layers: PruneLayers = None, override_kv: OverrideKv = None,
        dry_run: DryRun = False, max_buffer_size: MaxBufferSize = 64, threads: F.Threads = None) -> None:
    t_start = time.perf_counter()
    in_path, out_path, option, n_threads = _positional(args or [], dry_run)
    common.paths().read("IN", in_path)
    if out_path is not None:
        common.paths().write("OUT", out_path)
    entries = [*(tensor_type or []), *(_read_entries(tensor_type_file) if tensor_type_file else [])]
    try:
        params = QuantizeParams(
            allow_requantize=allow_requantize, quantize_output_tensor=not leave_output_tensor, pure=pure,
            output_tensor_type=output_tensor_type and parse_tensor_type(output_tensor_type, "--output-tensor-type"),
            token_embedding_type=token_embedding_type and parse_tensor_type(token_embedding_type,
                                                                            "--token-embedding-type"),
            tensor_types=tuple(_tensor_type(e) for e in entries), prune_layers=_layers(prune_layers),
            kv_overrides=tuple(KvOverride.parse(o) for o in override_kv or []), dry_run=dry_run,
            n_threads=n_threads or thread_count(threads), slab_bytes=max_buffer_size * 1024 * 1024)
    except ValidationError as e:
        raise InputError(explain(e)[1]) from None
    what = "calculating quantization size for" if dry_run else "quantizing"
    to = "" if dry_run else f" to '{out_path}'"
    log(f"llamapy-quantize: {what} '{in_path}'{to} as {option.name} using {params.n_threads} threads")
    t0 = time.perf_counter()
    result = quantize_model(in_path, out_path, option, params, on_tensor=lambda r: log(str(r)), on_warning=warn)
    for line in result.totals():
        (warn if line.startswith("WARNING") else log)(line.replace("WARNING: ", ""))
    t1 = time.perf_counter()
    log(f"llamapy-quantize: quantize time = {(t1 - t0) * 1000:8.2f} ms")
    log(f"llamapy-quantize:    total time = {(t1 - t_start) * 1000:8.2f} ms")


run.__doc__ = "Quantize the GGUF model IN to TYPE (a name or number below), as llama-quantize does.\n\n" + _types()
tool.command(run)


def _positional(args: list[str], dry_run: bool):
    """llama-quantize's positional arguments: IN [OUT] TYPE [NTHREADS]; OUT may be left out
    (ggml-model-TYPE.gguf beside IN) when the second is a type."""
    usage = "give IN.gguf [OUT.gguf] TYPE [NTHREADS] (llamapy-quantize -h lists the types)"
    if len(args) < 2:
        raise InputError(usage)
    in_path = Path(args[0])
    option = find_option(args[1])
    if option is not None:
        out_path = None if dry_run else in_path.parent / f"ggml-model-{option.name}.gguf"
        rest = args[2:]
    else:
        if len(args) < 3:
            raise InputError(f"missing TYPE after {args[1]}: {usage}")
        out_path, option, rest = Path(args[1]), find_option(args[2]), args[3:]
        if option is None:
            parse_option(args[2])  # raises: an unknown type, with the list
    parse_option(option.name)  # raises for a type llamapy cannot write
    if len(rest) > 1:
        raise InputError(f"unexpected argument {rest[1]!r}: {usage}")
    n_threads = None
    if rest:
        try:
            n_threads = int(rest[0])
        except ValueError:
            raise InputError(f"invalid NTHREADS {rest[0]!r}: expected a number") from None
    return in_path, out_path, option, (n_threads if n_threads and n_threads > 0 else None)


def _tensor_type(entry: str) -> tuple[str, object]:
    """--tensor-type NAME=GGML_TYPE (NAME lowercased, as llama-quantize does)."""
    name, sep, type_name = entry.partition("=")
    if not sep:
        raise InputError(f"--tensor-type {entry!r}: expected NAME=GGML_TYPE")
    if not name:
        raise InputError(f"--tensor-type {entry!r}: missing tensor name")
    if not type_name:
        raise InputError(f"--tensor-type {entry!r}: missing quantization type")
    return name.lower(), parse_tensor_type(type_name, f"--tensor-type {entry!r}:")


def _read_entries(path: Path) -> list[str]:
    return common.read_text(path, "tensor type file").split()


def _layers(text: str | None) -> tuple[int, ...]:
    if not text:
        return ()
    layers = []
    for item in text.split(","):
        try:
            layer = int(item)
        except ValueError:
            layer = -1
        if layer < 0:
            raise InputError(f"--prune-layers: invalid layer id {item!r}")
        layers.append(layer)
    return tuple(sorted(set(layers)))


main = tool.main

if __name__ == "__main__":
    main()
