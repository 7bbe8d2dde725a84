"""llamapy-export-lora: merge LoRA adapters into a base model and write a full GGUF
(llama.cpp's export-lora: W' = W + scale * alpha / r * B A per adapted matrix)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

from ggmlpy import GGMLType
from llamapy.errors import InputError
from llamapy.lora import merge_adapters
from llamapy.model import load_model
from llamapy.save import save_model_to_file

from . import flags as F
from .args import OUTPUT, Tool, flag
from .common import adapter_list, load_adapters, log

tool = Tool("llamapy-export-lora", llama_cpp=["export-lora"])

# llama.cpp's export-lora writes a merged matrix as F32 if the base's is F32, else as F16 ("auto")
OUTTYPES = {"auto": "auto", "same": None, "f16": GGMLType.F16, "f32": GGMLType.F32, "q8_0": GGMLType.Q8_0,
            "q4_k": GGMLType.Q4_K}

Output = Annotated[Path, flag("-o", "--output", "--output-file", metavar="FNAME", group=OUTPUT, path="write",
                              help="the merged GGUF to write")]
OutType = Annotated[str, flag("--outtype", metavar="TYPE", group=OUTPUT,
                              help="type of the merged matrices: auto (llama.cpp's: F32 stays F32, others become F16), "
                                   "same (each keeps its type, quantized ones are quantized again), f16, f32, q8_0, "
                                   "q4_k")]


@tool.command
def run(model: F.Model, lora: F.Lora = None, lora_scaled: F.LoraScaled = None,
        output: Output = Path("ggml-lora-merged-f16.gguf"), outtype: OutType = "auto",
        threads: F.Threads = None) -> None:
    """Merge the adapters into MODEL and write the result to -o."""
    if outtype.lower() not in OUTTYPES:
        raise InputError(f"unknown --outtype {outtype!r}: use one of {', '.join(OUTTYPES)}")
    if not adapter_list(lora, lora_scaled):
        raise InputError("give at least one adapter with --lora FNAME or --lora-scaled FNAME:SCALE")
    t0 = time.perf_counter()
    m = load_model(model)
    log(f"model: {m.path.name}: {m.describe()}")
    adapters = load_adapters(m, lora, lora_scaled)
    merged = merge_adapters(m, adapters, OUTTYPES[outtype.lower()])
    save_model_to_file(m, output)
    log(f"export-lora: merged {len(merged)} matrices, wrote {output} in {time.perf_counter() - t0:.1f} s")


main = tool.main

if __name__ == "__main__":
    main()
