"""llamapy-convert: a Hugging Face checkpoint to GGUF, as llama.cpp's convert_hf_to_gguf.py
(the same tensors and metadata), or a PEFT LoRA adapter to a GGUF adapter (--lora, as its
convert_lora_to_gguf.py), without PyTorch or transformers."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from llamapy.arch import listing
from llamapy.convert import OUTTYPES, convert_checkpoint, outtype_of
from llamapy.convert.peft import adapter_outtype, peft_to_gguf
from llamapy.errors import InputError

from .args import OUTPUT, Tool, flag
from .common import log, paths

tool = Tool("llamapy-convert", llama_cpp=["convert", "convert-lora"])

Folder = Annotated[Optional[Path], typer.Argument(metavar="HF_DIR", show_default=False,
                                        help="the checkpoint's folder: config.json, *.safetensors (one file or "
                                             "shards with model.safetensors.index.json), tokenizer files")]
OutFile = Annotated[Optional[Path], flag("-o", "--outfile", "--output", metavar="FNAME", group=OUTPUT, path="write",
                                         show_default=False,
                                         help="the GGUF file to write ({ftype} in the name becomes the type)")]
OutType = Annotated[Optional[str], flag("--outtype", metavar="TYPE", group=OUTPUT, show_default=False,
                                        help="type of the matrices: f32, f16, bf16, q8_0, or auto (bf16 for a BF16 "
                                             "checkpoint, else f16; the default, f32 for --lora); norms, biases and "
                                             "vectors stay F32")]
Lora = Annotated[Optional[Path], flag("--lora", metavar="PEFT_DIR", show_default=False,
                                      help="convert the PEFT LoRA adapter in PEFT_DIR (adapter_config.json, "
                                           "adapter_model.safetensors) instead of a model; needs --base")]
Base = Annotated[Optional[Path], flag("--base", metavar="HF_DIR", show_default=False,
                                      help="with --lora: the folder of the checkpoint the adapter was trained on "
                                           "(its config.json and its weights' shapes are read)")]
ModelName = Annotated[Optional[str], flag("--model-name", metavar="NAME", group=OUTPUT, show_default=False,
                                          help="general.name (default: from the folder's name)")]


def _families(function):
    """The command's help names the families llamapy-convert converts (the registry's)."""
    function.__doc__ = function.__doc__.format(families=listing(converted=True))
    return function


@tool.command
@_families
def run(hf_dir: Folder = None, outfile: OutFile = None, outtype: OutType = None, model_name: ModelName = None,
        lora: Lora = None, base: Base = None) -> None:
    """Convert the Hugging Face checkpoint in HF_DIR ({families}) to a GGUF file,
    or the PEFT LoRA adapter in --lora PEFT_DIR to a GGUF adapter."""
    if lora is not None:
        if hf_dir is not None or model_name is not None:
            raise InputError("--lora converts an adapter: give its base with --base HF_DIR, not HF_DIR "
                             "or --model-name")
        if base is None:
            raise InputError("--lora needs the checkpoint the adapter was trained on: --base HF_DIR")
    elif hf_dir is None:
        raise InputError("give the checkpoint's folder HF_DIR (or a PEFT adapter with --lora PEFT_DIR --base HF_DIR)")
    elif base is not None:
        raise InputError("--base names the base of a PEFT adapter: use it with --lora PEFT_DIR")
    outtype = (outtype or ("f32" if lora is not None else "auto")).lower()
    if outtype not in (*OUTTYPES, "auto"):
        raise InputError(f"unknown --outtype {outtype!r}: use one of {', '.join(OUTTYPES)} or auto")
    if outfile is None:
        raise InputError("give the GGUF file to write with -o FNAME")
    if outtype == "auto":
        outtype = outtype_of(hf_dir) if lora is None else adapter_outtype(lora)
    outfile = outfile.with_name(outfile.name.replace("{ftype}", outtype))
    paths().write("-o", outfile)
    for name, folder in (("HF_DIR", hf_dir), ("--lora", lora), ("--base", base)):
        paths().read(name, folder if folder is not None and folder.is_dir() else None)
    t0 = time.perf_counter()
    if lora is not None:
        peft_to_gguf(lora, base, outfile, outtype, log=log)
    else:
        convert_checkpoint(hf_dir, outfile, outtype, log=log, name=model_name)
    log(f"convert: wrote {outfile} in {time.perf_counter() - t0:.1f} s")


main = tool.main

if __name__ == "__main__":
    main()
