"""Readers for llama.cpp's reference outputs in shared/golden/."""
from __future__ import annotations

import re
from pathlib import Path


def running_ppl(path: Path) -> dict[int, float]:
    """{chunk: running PPL} from a llama-perplexity stdout like `[1]75.2337,[2]64.4105,...`."""
    return {int(i): float(v) for i, v in re.findall(r"\[(\d+)\]([0-9.]+)", path.read_text())}
