"""ggmlpy's LLVM-IR kernels on a CPU without AVX-512: numba compiles for the CPU that
NUMBA_CPU_NAME / NUMBA_CPU_FEATURES name (here Haswell: AVX2 and FMA, no AVX-512), llvmir.vnni.VNNI
follows that target, and the products take their float32 integer-sum kernels. Those sum the
same exact integers in the same float order, so Gemma 3's greedy text is still llama.cpp's.
(test_ggml_numerics.py runs both kernels of every product against ggml's arithmetic.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

HASWELL = {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": ""}


def _host_has_avx512() -> bool:
    """What numba compiles for on this machine (the kernels follow its target, not /proc/cpuinfo)."""
    import llvmlite.binding as llvm
    return "+avx512f" in llvm.get_host_cpu_features().flatten()


def _env(tmp_path, **extra) -> dict[str, str]:
    env = {**os.environ, **extra, "NUMBA_CACHE_DIR": str(tmp_path / "numba-cache")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


@pytest.mark.parametrize("extra, vnni", [(HASWELL, False), ({"GGMLPY_NO_VNNI": "1"}, False)],
                         ids=["haswell", "no-vnni-env"])
def test_the_kernels_follow_numbas_target(tmp_path, extra, vnni):
    code = "from ggmlpy.llvmir import vnni; print(vnni.VNNI)"
    out = subprocess.run([sys.executable, "-c", code], env=_env(tmp_path, **extra), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(vnni)


@pytest.mark.slow
def test_gemma3_greedy_without_avx512_is_llama_cpps(gemma3_path, tmp_path):
    if not _host_has_avx512():
        pytest.skip("this CPU has no AVX-512: test_gemma3.py's greedy run already takes these kernels here")
    greedy = json.loads((REPO_ROOT / "tests" / "data" / "llama_cpp_gemma3_greedy.json").read_text(encoding="utf-8"))
    run = greedy["runs"][0]
    proc = subprocess.run([sys.executable, "-m", "llamapy.cli.completion", "-m", str(gemma3_path), "-p", run["prompt"],
                           "-n", str(greedy["n_predict"]), "--temp", "0", "-s", "1", "-t", "1"],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=1800, env=_env(tmp_path, **HASWELL))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip("\n") == run["text"]
