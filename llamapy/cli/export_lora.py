"""llamapy-export-lora: merge LoRA adapters into a base model and write a full GGUF
(llama.cpp's export-lora: W' = W + scale * alpha / r * B A per adapted matrix)."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from ggmlpy import GGMLType
from llamapy.errors import InputError
from llamapy.lora import merge_adapters
from llamapy.model import load_model
from llamapy.save import save_model_to_file

from .common import guarded, join_pairs, load_adapters, log

cli = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

OUTTYPES = {"f16": GGMLType.F16, "f32": GGMLType.F32, "q8_0": GGMLType.Q8_0, "q4_k": GGMLType.Q4_K, "same": None}


@cli.command()
def run(
    model: Annotated[Path, typer.Option("-m", "--model", help="base GGUF model")],
    output: Annotated[Path, typer.Option("-o", "--output", help="merged GGUF to write")],
    lora: Annotated[Optional[list[Path]], typer.Option("--lora", help="LoRA adapter (repeatable)")] = None,
    lora_scaled: Annotated[Optional[list[str]], typer.Option("--lora-scaled", help="FILE SCALE (repeatable)")] = None,
    outtype: Annotated[str, typer.Option("--outtype", help="f16|f32|q8_0|q4_k|same: type of the merged matrices")] = "same",
) -> None:
    """Merge the adapters into MODEL and write the result to -o."""
    if outtype.lower() not in OUTTYPES:
        raise InputError(f"unknown --outtype {outtype!r}: use one of {', '.join(OUTTYPES)}")
    if not lora and not lora_scaled:
        raise InputError("give at least one adapter with --lora FILE or --lora-scaled FILE SCALE")
    t0 = time.perf_counter()
    m = load_model(model)
    log(f"model: {m.path.name}: {m.describe()}")
    adapters = load_adapters(m, lora, lora_scaled)
    merged = merge_adapters(m, adapters, OUTTYPES[outtype.lower()])
    save_model_to_file(m, output)
    log(f"export-lora: merged {len(merged)} matrices, wrote {output} in {time.perf_counter() - t0:.1f} s")


def main() -> None:
    sys.argv[1:] = join_pairs(sys.argv[1:], "--lora-scaled")
    guarded(cli)()


if __name__ == "__main__":
    main()
