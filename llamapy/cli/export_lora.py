"""llamapy-export-lora: merge LoRA adapters into a base model and write a full GGUF
(llama.cpp's export-lora: W' = W + scale * alpha / r * B A per adapted matrix), or, with
--to-peft, write one adapter as a Hugging Face PEFT adapter for the checkpoint the base
was converted from."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

from ggmlpy import GGMLType
from llamapy.convert.peft import adapter_to_peft, check_peft_folder, peft_folder_files
from llamapy.errors import InputError
from llamapy.lora import merge_adapters
from llamapy.model import load_model
from llamapy.save import save_model_to_file

from . import flags as F
from .args import OUTPUT, Tool, flag
from .common import adapter_list, load_adapters, log, paths, warn

tool = Tool("llamapy-export-lora", llama_cpp=["export-lora"])

# llama.cpp's export-lora writes a merged matrix as F32 if the base's is F32, else as F16 ("auto")
OUTTYPES = {"auto": "auto", "same": None, "f16": GGMLType.F16, "f32": GGMLType.F32, "q8_0": GGMLType.Q8_0,
            "q4_k": GGMLType.Q4_K}

DEFAULT_OUTPUT = Path("ggml-lora-merged-f16.gguf")

Output = Annotated[Optional[Path], flag("-o", "--output", "--output-file", metavar="FNAME", group=OUTPUT, path="write",
                                        show_default=str(DEFAULT_OUTPUT), help="the merged GGUF to write")]
ToPeft = Annotated[Optional[Path], flag("--to-peft", metavar="DIR", group=OUTPUT, path="write",
                                        paths_of=peft_folder_files, show_default=False,
                                        help="instead of merging, write the adapter (one --lora) as a Hugging Face "
                                             "PEFT adapter in DIR (a new or empty folder): adapter_model.safetensors "
                                             "and adapter_config.json, for the checkpoint MODEL was converted from")]
Base = Annotated[Optional[str], flag("--base", metavar="HF_DIR|MODEL_ID", group=OUTPUT, show_default=False,
                                     help="with --to-peft: that checkpoint's folder or model id "
                                          "(base_model_name_or_path; a folder is checked against MODEL)")]
OutType = Annotated[str, flag("--outtype", metavar="TYPE", group=OUTPUT,
                              help="type of the merged matrices: auto (llama.cpp's: F32 stays F32, others become F16), "
                                   "same (each keeps its type, quantized ones are quantized again), f16, f32, q8_0, "
                                   "q4_k")]


@tool.command
def run(model: F.Model, lora: F.Lora = None, lora_scaled: F.LoraScaled = None, output: Output = None,
        outtype: OutType = "auto", to_peft: ToPeft = None, base: Base = None, threads: F.Threads = None) -> None:
    """Merge the adapters into MODEL and write the result to -o (or write one as a PEFT adapter: --to-peft)."""
    if outtype.lower() not in OUTTYPES:
        raise InputError(f"unknown --outtype {outtype!r}: use one of {', '.join(OUTTYPES)}")
    if not adapter_list(lora, lora_scaled):
        raise InputError("give at least one adapter with --lora FNAME or --lora-scaled FNAME:SCALE")
    if to_peft is not None:
        if output is not None:
            raise InputError("-o names a merged model, --to-peft a PEFT adapter's folder: give one")
        if len(adapter_list(lora, lora_scaled)) != 1 or adapter_list(lora, lora_scaled)[0][1] != 1.0:
            raise InputError("--to-peft writes one adapter as it is: give it with --lora FNAME (no scale)")
        check_peft_folder(to_peft)
        if base is None:
            warn("--to-peft without --base: adapter_config.json names no base model (base_model_name_or_path "
                 "null); peft.PeftModel.from_pretrained(model, DIR) loads it onto the model you give, but "
                 "AutoPeftModelForCausalLM cannot find one (--base HF_DIR|MODEL_ID names it)")
    elif base is not None:
        raise InputError("--base names the Hugging Face checkpoint of a PEFT adapter: use it with --to-peft DIR")
    else:
        output = output or DEFAULT_OUTPUT
        paths().write("-o", output)
    t0 = time.perf_counter()
    m = load_model(model)
    log(f"model: {m.path.name}: {m.describe()}")
    adapters = load_adapters(m, lora, lora_scaled)
    if to_peft is not None:
        adapter_to_peft(m, adapters[0][0], to_peft, base, log=log)
        return
    merged = merge_adapters(m, adapters, OUTTYPES[outtype.lower()])
    save_model_to_file(m, output)
    log(f"export-lora: merged {len(merged)} matrices, wrote {output} in {time.perf_counter() - t0:.1f} s")


main = tool.main

if __name__ == "__main__":
    main()
