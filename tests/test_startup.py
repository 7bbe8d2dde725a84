"""Start-up: compile-ahead, numba's private names, what the tools load of numba."""
from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO_ROOT

AHEAD = """
import mmap, os
import numpy as np
from ggmlpy.backend.cpu.rows import kernels as K
from ggmlpy.backend.cpu.plan.compile_ahead import CompileAhead

x = np.linspace(-3, 3, 64, dtype=np.float32).reshape(1, 1, 4, 16)
shared = np.frombuffer(mmap.mmap(-1, x.nbytes), dtype=np.float32).reshape(x.shape)  # seen by both processes
norm = np.empty_like(x)
steps = [lambda: K.rms_norm_f32(x, norm, 1e-5), lambda: K.silu_f32(x, shared)]
ahead = CompileAhead(steps)
_, status = os.waitpid(ahead.pid, 0)  # the child compiles the last step and stops before the first
assert os.WEXITSTATUS(status) == 0
assert not shared.any(), "the child ran a kernel"
assert not K.silu_f32.signatures and not K.rms_norm_f32.signatures
for step in steps:
    step()
assert sum(K.silu_f32._cache_hits.values()) == 1, "silu was not loaded from the child's cache entry"
assert sum(K.rms_norm_f32._cache_misses.values()) == 1, "rms_norm should have been left to this process"
np.testing.assert_allclose(shared, x / (1 + np.exp(-x.astype(np.float64))), rtol=1e-6)
print("ok")
"""


def test_compile_ahead_child_compiles_the_last_steps_into_the_cache_without_running_them(tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", AHEAD], capture_output=True, text=True, cwd=REPO_ROOT, env=env,
                          timeout=300)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]


LEAN = """
import numpy as np
from numba import guvectorize, njit, prange
from numba.core import codegen
from ggmlpy.numba_compat import lean_parfor_libraries

lean_parfor_libraries()
lean_parfor_libraries()  # idempotent
made_code = []
emit = codegen.JITCodeLibrary._finalize_specific
codegen.JITCodeLibrary._finalize_specific = lambda lib: made_code.append(lib.name) or emit(lib)


@njit(parallel=True, cache=True)
def twice(a, out):
    for i in prange(a.shape[0]):
        out[i] = 2.0 * a[i] + a[i] * a[i]


@guvectorize(["void(float64[:], float64[:])"], "(n)->(n)", target="parallel")
def cumulative(a, out):  # numba's own parallel gufunc: its wrappers are run, so still compiled
    t = 0.0
    for i in range(a.shape[0]):
        t += a[i]
        out[i] = t


a = np.linspace(-1, 1, 1000)
out = np.empty_like(a)
twice(a, out)
assert np.array_equal(out, 2.0 * a + a * a)
assert np.array_equal(cumulative(a.reshape(10, 100)), np.cumsum(a.reshape(10, 100), axis=1))
print(sum(n == "parallelgufuncwrapper" for n in made_code), len(twice.stats.cache_hits))
"""


def test_parallel_kernels_compile_their_wrappers_as_ir_only_and_still_cache(tmp_path):
    """numba_compat.lean_parfor_libraries: a prange kernel's wrappers make no machine code of
    their own (the kernel links their IR), its results and its cache entry are numba's, and
    numba's @guvectorize(target="parallel"), whose wrappers do run, is left alone."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    script = tmp_path / "lean.py"  # numba caches kernels of files only
    script.write_text(LEAN)
    numba_way = {**env, "NUMBA_CACHE_DIR": str(tmp_path / "cache-numba"), "GGMLPY_LEAN_PARFOR": "0"}
    runs = [subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, env=e,
                           timeout=300) for e in (env, env, numba_way)]
    # machine code of the thread-launch wrapper: guvectorize's only (numba's way: the kernel's too)
    assert [r.stdout.split() for r in runs] == [["1", "0"], ["1", "1"], ["2", "0"]], runs[-1].stderr[-2000:]


def test_compile_ahead_serialises_numba_cache_saves(tmp_path):
    """Two processes saving signatures of one function at once must not mix index and data."""
    from numba.core.caching import IndexDataCacheFile
    from ggmlpy import numba_compat
    original = IndexDataCacheFile.save
    try:
        # numba's own save, also where an earlier test's compile-ahead locked it in this process
        numba_save = IndexDataCacheFile.save = getattr(original, "__wrapped__", original)
        numba_compat.lock_cache_saves()
        numba_compat.lock_cache_saves()  # idempotent: one lock, not two nested
        assert IndexDataCacheFile.save.locked and IndexDataCacheFile.save.__wrapped__ is numba_save
        cache = IndexDataCacheFile(str(tmp_path), "f", ("stamp", 1))
        cache.save("key", b"data")
        assert cache.load("key") == b"data"
        assert (tmp_path / ".ggmlpy-save.lock").exists()
    finally:
        IndexDataCacheFile.save = original


def test_a_command_starts_numba_without_what_its_kernels_never_use(stories_path, tmp_path):
    """The tools load numba's registries with scipy.linalg and cffi hidden (numba's probes for
    np.dot and cffi calls cost 70 ms of every start); the kernels need neither, and both
    packages import afterwards as usual."""
    script = f"""
import sys
from llamapy.cli.quantize import main
sys.argv = ["llamapy-quantize", {str(stories_path)!r}, {str(tmp_path / 'q.gguf')!r}, "Q4_0"]
try:
    main()
except SystemExit as e:
    assert not e.code, e.code
print("scipy.linalg" in sys.modules, "cffi" in sys.modules, sys.modules["numba.np.arraymath"]._HAVE_BLAS)
for name in ("scipy.linalg", "cffi"):
    try:
        __import__(name)
        print(name, "imports")
    except ImportError:
        print(name, "not installed")
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stderr
    state, scipy_after, cffi_after = r.stdout.splitlines()[-3:]
    assert state == "False False False"  # neither imported; numba's np.dot off in this process
    assert scipy_after in ("scipy.linalg imports", "scipy.linalg not installed")
    assert cffi_after in ("cffi imports", "cffi not installed")


def test_the_numba_this_runs_on_has_every_private_name_ggmlpy_uses():
    """ggmlpy/numba_compat.py holds every use of numba's and llvmlite's private API; with a
    numba outside the pinned range this names what moved (each use falls back to the public
    path, slower, so nothing else would fail)."""
    from ggmlpy import numba_compat
    assert numba_compat.missing() == []
    setter = numba_compat.fast_thread_setter()
    import numba
    assert setter is not numba.set_num_threads  # the fast one works on this numba


def test_compile_ahead_starts_when_a_plans_step_compiles(monkeypatch):
    """A plan's first run forks the compiling child from the step after the first one that
    compiled (a first run after installing, a model of another shape), never when nothing
    compiles, in a plan's later runs or while another thread runs."""
    import threading

    from ggmlpy.backend import cpu
    from ggmlpy.backend.cpu.plan import compile_ahead

    started = []

    class FakePlan:  # what the backend reads of a plan
        pass

    class Recorder:
        def __init__(self, steps, first=0):
            started.append(first)

        def at(self, i):
            pass

        def close(self):
            pass
    monkeypatch.setattr(compile_ahead, "CompileAhead", Recorder)
    count = [0]
    monkeypatch.setattr(cpu, "compile_count", lambda: lambda: count[0])

    def plan_compiling_at(step: int | None):
        def call(i):
            def run():
                if i == step:
                    count[0] += 1
            return run
        plan = FakePlan()
        plan.steps = [(f"s{i}", call(i), False) for i in range(5)]
        plan.runs, plan.n_runs = [(False, tuple(r for _, r, _ in plan.steps))], 0
        return plan

    backend = cpu.CpuBackend(1)
    backend._compile_ahead = True
    backend._run(plan_compiling_at(None))
    assert started == []
    backend._run(plan_compiling_at(1))
    assert started == [2]
    plan = plan_compiling_at(1)
    backend._run(plan)
    backend._run(plan)  # a plan's later runs never fork
    assert started == [2, 2]
    backend._run(plan_compiling_at(0))
    assert started == [2, 2, 1]
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        backend._run(plan_compiling_at(1))
        assert started == [2, 2, 1]
    finally:
        stop.set()
        other.join()
