"""The first run after installing says it is compiling (numba's cache is empty), later ones do not."""
from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO_ROOT

PROBE = "from ggmlpy.backend.cpu import kernels_cached; print(kernels_cached())"


def probe(env: dict) -> str:
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=REPO_ROOT, env=env,
                          timeout=120).stdout.strip()


def test_an_empty_numba_cache_is_seen_and_a_filled_one_is_not(tmp_path):
    import numpy as np
    from ggmlpy.backend.cpu.kernels import rms_norm_f32
    x = np.ones((1, 1, 2, 8), np.float32)
    rms_norm_f32(x, np.empty_like(x), 1e-5)  # compiled (and cached) by now, if not before
    assert probe({**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}) == "False"
    assert probe(dict(os.environ)) == "True"
