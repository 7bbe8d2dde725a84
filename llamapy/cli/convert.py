"""llamapy-convert: a Hugging Face checkpoint to GGUF, as llama.cpp's convert_hf_to_gguf.py
(the same tensors and metadata), without PyTorch or transformers."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from llamapy.convert import OUTTYPES, convert_checkpoint, outtype_of
from llamapy.errors import InputError

from .args import OUTPUT, Tool, flag
from .common import log, paths

tool = Tool("llamapy-convert", llama_cpp=["convert"])

Folder = Annotated[Path, typer.Argument(metavar="HF_DIR", show_default=False,
                                        help="the checkpoint's folder: config.json, *.safetensors (one file or "
                                             "shards with model.safetensors.index.json), tokenizer files")]
OutFile = Annotated[Optional[Path], flag("-o", "--outfile", "--output", metavar="FNAME", group=OUTPUT, path="write",
                                         show_default=False,
                                         help="the GGUF file to write ({ftype} in the name becomes the type)")]
OutType = Annotated[str, flag("--outtype", metavar="TYPE", group=OUTPUT,
                              help="type of the matrices: f32, f16, bf16, q8_0, or auto (bf16 for a BF16 "
                                   "checkpoint, else f16); norms, biases and vectors stay F32")]
ModelName = Annotated[Optional[str], flag("--model-name", metavar="NAME", group=OUTPUT, show_default=False,
                                          help="general.name (default: from the folder's name)")]


@tool.command
def run(hf_dir: Folder, outfile: OutFile = None, outtype: OutType = "auto", model_name: ModelName = None) -> None:
    """Convert the Hugging Face checkpoint in HF_DIR (llama, qwen2, qwen3, gemma3) to a GGUF file."""
    outtype = outtype.lower()
    if outtype not in (*OUTTYPES, "auto"):
        raise InputError(f"unknown --outtype {outtype!r}: use one of {', '.join(OUTTYPES)} or auto")
    if outfile is None:
        raise InputError("give the GGUF file to write with -o FNAME")
    if outtype == "auto":
        outtype = outtype_of(hf_dir)
    outfile = outfile.with_name(outfile.name.replace("{ftype}", outtype))
    paths().write("-o", outfile)
    paths().read("HF_DIR", hf_dir if hf_dir.is_dir() else None)
    t0 = time.perf_counter()
    convert_checkpoint(hf_dir, outfile, outtype, log=log, name=model_name)
    log(f"convert: wrote {outfile} in {time.perf_counter() - t0:.1f} s")


main = tool.main

if __name__ == "__main__":
    main()
