"""ggmlpy runs on any numpy: the BLAS sgemm is looked up in the libraries loaded, and where
none has a 64-bit-integer one, products go through numpy.matmul (gemm.py)."""
from __future__ import annotations

import ctypes.util
import subprocess
import sys
import textwrap

import numpy as np

from ggmlpy import GGMLType
from ggmlpy.backend.cpu.products import gemm


def _libc() -> str:
    """A loaded library that is no BLAS: stands in for one without the symbol."""
    return ctypes.util.find_library("c") or "libc.so.6"


def test_find_sgemm_skips_a_blas_without_the_symbol():
    """A BLAS library that exports no 64-bit-integer cblas_sgemm (MKL's LP64, a system
    libblas) is passed over; with nothing else, there is no sgemm and numpy.matmul is used."""
    class Library:  # threadpoolctl's view of a loaded library
        internal_api, filepath = "openblas", _libc()

        def set_num_threads(self, n):
            raise AssertionError("a library that is not used keeps its threads")

    class Controller:
        def select(self, **kwargs):
            return type("Selection", (), {"lib_controllers": [Library()]})()

    assert gemm.find_sgemm(Controller()) is None


NO_BLAS_DECODE = textwrap.dedent("""
    import sys
    import numpy as np
    import threadpoolctl

    class NoSgemm:  # numpy's BLAS as if built without cblas_sgemm64_: a library that lacks it
        internal_api, filepath = "openblas", "{libc}"
        def set_num_threads(self, n): pass

    class Controller:
        def select(self, **kwargs):
            return type("Selection", (), {{"lib_controllers": [NoSgemm()]}})()

    threadpoolctl.ThreadpoolController = Controller
    import ggmlpy
    from ggmlpy.backend.cpu.products import gemm
    assert gemm.BLAS == "numpy.matmul", gemm.BLAS
    import llamapy
    model = llamapy.load_model(sys.argv[1])
    ctx = llamapy.Context(model, n_ctx=64, type_k=ggmlpy.GGMLType.F32, type_v=ggmlpy.GGMLType.F32)
    ctx.decode(llamapy.Batch.from_tokens(model.vocab.tokenize("Once upon a time, there was"), all_outputs=True))
    np.save(sys.argv[2], ctx.get_logits())
""")


def test_import_and_decode_without_a_usable_blas(stories_path, tmp_path):
    """`import ggmlpy` and a decode work where numpy's BLAS has no cblas_sgemm64_ (conda's
    MKL, Accelerate), giving the logits of the BLAS path to float32 rounding. (An F32 KV
    cache: an F16 one turns the two paths' 1-ulp differences into half ulps now and then.)"""
    import llamapy
    script = NO_BLAS_DECODE.format(libc=_libc())
    out = tmp_path / "logits.npy"
    run = subprocess.run([sys.executable, "-c", script, str(stories_path), str(out)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    model = llamapy.load_model(stories_path)
    ctx = llamapy.Context(model, n_ctx=64, type_k=GGMLType.F32, type_v=GGMLType.F32)
    ctx.decode(llamapy.Batch.from_tokens(model.vocab.tokenize("Once upon a time, there was"), all_outputs=True))
    np.testing.assert_allclose(np.load(out), ctx.get_logits(), rtol=1e-4, atol=1e-4)
