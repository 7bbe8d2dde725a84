"""Everything ggmlpy reaches in numba and llvmlite beyond their public API, in one place, so a
new numba is checked here (pyproject.toml pins the versions this was written against, and
`missing()` names what a numba lacks; tests/test_startup.py runs it):

- the compile event a front end hooks before anything compiles, and a count of compiles
  (compile-ahead starts when a plan's step compiles) (event API);
- numba's lowering registries loaded without the packages it probes for unused features;
- the thread-count setter without numba's checks and lock (the executor switches often);
- serialised cache saves and a dispatcher that compiles instead of running (compile-ahead's
  child, backend/cpu/plan/compile_ahead.py);
- LLVM's bfloat type, which llvmlite's IR builder does not name (ggmlpy/llvmir/emit.py);
- the code libraries of parallel kernels linked without compiling their bodies four times.

Each user degrades to the public path when what it needs is missing (slower, never wrong).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any


def on_first_compile(callback: Callable[[], None]) -> None:
    """Call `callback` once, when numba starts compiling a kernel in this process (not when it
    loads one from its on-disk cache): a front end can say why the first run is slow exactly
    when it is. Uses numba's event API ("numba:compile" fires on cache misses only)."""
    from numba.core import event

    pid = os.getpid()

    class FirstCompile(event.Listener):
        def on_start(self, ev: event.Event) -> None:
            if os.getpid() == pid:  # not in a compile-ahead child
                event.unregister("numba:compile", self)
                callback()

        def on_end(self, ev: event.Event) -> None:
            pass

    event.register("numba:compile", FirstCompile())


_COMPILES = [0]
_COUNTING: list[bool] = []


def compile_count() -> Callable[[], int]:
    """A function giving how many kernels numba has started compiling in this process (cache
    misses; loads from the on-disk cache do not count). Registers the listener once."""
    if not _COUNTING:
        from numba.core import event

        class Count(event.Listener):
            def on_start(self, ev: event.Event) -> None:
                _COMPILES[0] += 1

            def on_end(self, ev: event.Event) -> None:
                pass

        event.register("numba:compile", Count())
        _COUNTING.append(True)
    return lambda: _COMPILES[0]


# What numba imports when its registries load, for features no ggmlpy kernel uses: scipy's
# BLAS (np.dot in njit code; products call BLAS through backend/cpu/products/gemm.py) and cffi's
# C parser (cffi functions called from njit code).
_UNUSED_BY_KERNELS = ("scipy.linalg", "cffi")


def start_numba_registries() -> None:
    """Load numba's lowering registries (what its first compile or cache load does) with
    scipy.linalg and cffi hidden: numba imports them at that moment for features no ggmlpy
    kernel uses (_UNUSED_BY_KERNELS), 70 ms of every command's start where they are
    installed (bench/RESULTS.md, twelfth session). For processes that run only ggmlpy's
    kernels (the command-line tools): those numba features stay off in them, the packages
    themselves import normally afterwards.
    Does nothing once the registries are loaded; a package already imported stays seen."""
    if "numba.np.arraymath" in sys.modules:
        return
    from numba.core.registry import cpu_target

    hidden = [name for name in _UNUSED_BY_KERNELS if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # importing it fails at once: numba's probe finds nothing
    try:
        cpu_target.target_context.refresh()
    finally:
        for name in hidden:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]


def _lean_parfor_names() -> list[tuple[Any, str]]:
    """numba's names lean_parfor_libraries replaces or calls."""
    from numba.core import codegen
    from numba.np.ufunc import parallel, ufuncbuilder
    return [(parallel, "build_gufunc_wrapper"), (ufuncbuilder, "build_gufunc_wrapper")] + [
        (codegen.CPUCodeLibrary, name) for name in ("_optimize_final_module", "_finalize_final_module",
                                                     "_finalize_dynamic_globals", "_verify_declare_only_symbols")]


def lean_parfor_libraries() -> None:
    """Compile each `parallel=True` kernel's loop body through LLVM twice instead of four times.

    numba lowers a prange loop into three code libraries besides the kernel's own: the loop
    body (a gufunc), a gufunc wrapper and a thread-launch wrapper, each linking the one
    before it, and it optimises every library at -O3 as a whole module and makes machine
    code of it, so the body (with every function it calls) goes through LLVM four times.
    Only the kernel's own library runs and is cached: it links the others' IR. Here the two
    wrappers are linked as IR only (no module passes, no machine code); the body's library
    keeps its module passes (without them the kernel's library vectorises its loops less
    well: a Q8_K quantizer ran 2.7x slower). Other gufuncs (numba's @guvectorize) are built
    as before. Idempotent; numba's own way where it lacks these names, or with
    GGMLPY_LEAN_PARFOR=0 (to compare: bench/lean_parfor.py)."""
    from numba.core import codegen
    from numba.np.ufunc import parallel, ufuncbuilder
    if (os.environ.get("GGMLPY_LEAN_PARFOR") == "0"
            or not all(hasattr(owner, name) for owner, name in _lean_parfor_names())
            or getattr(parallel.build_gufunc_wrapper, "lean", False)):
        return
    build, build_inner = parallel.build_gufunc_wrapper, ufuncbuilder.build_gufunc_wrapper
    optimize, finalize = codegen.CPUCodeLibrary._optimize_final_module, codegen.CPUCodeLibrary._finalize_final_module

    def ir_only(info):
        info.library.ggmlpy_ir_only = True
        return info

    def build_parfor_wrappers(py_func, cres, sin, sout, cache, is_parfors):
        if not is_parfors:
            return build(py_func, cres, sin, sout, cache, is_parfors)
        ufuncbuilder.build_gufunc_wrapper = lambda *a, **k: ir_only(build_inner(*a, **k))
        try:  # numba's compiler lock is held: no other thread sees the swap
            return ir_only(build(py_func, cres, sin, sout, cache, is_parfors))
        finally:
            ufuncbuilder.build_gufunc_wrapper = build_inner

    def optimize_unless_ir_only(self: codegen.CPUCodeLibrary) -> None:
        if not getattr(self, "ggmlpy_ir_only", False):
            optimize(self)

    def finalize_ir_only(self: codegen.CPUCodeLibrary) -> None:
        if not getattr(self, "ggmlpy_ir_only", False):
            return finalize(self)
        self._finalize_dynamic_globals()
        self._verify_declare_only_symbols()
        self._finalized = True

    build_parfor_wrappers.lean = True
    parallel.build_gufunc_wrapper = build_parfor_wrappers
    codegen.CPUCodeLibrary._optimize_final_module = optimize_unless_ir_only
    codegen.CPUCodeLibrary._finalize_final_module = finalize_ir_only


def fast_thread_setter() -> Callable[[int], None]:
    """numba.set_num_threads checks and locks on every call; the private function it ends in,
    reached once the pool is launched, only sets (bench/RESULTS.md has the difference). Used
    where it exists and is seen to set the count, else the public setter."""
    import numba

    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)  # launches the pool
    from numba.np.ufunc import parallel
    fast = getattr(parallel, "_set_num_threads", None)
    try:
        fast(1)
        works = numba.get_num_threads() == 1
    except Exception:  # noqa: BLE001 -- any failure of a private API means: do not use it
        works = False
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    return fast if works else numba.set_num_threads


def cache_saves_lockable() -> bool:
    """Whether numba saves its cache through the method lock_cache_saves wraps."""
    from numba.core.caching import IndexDataCacheFile
    return hasattr(IndexDataCacheFile, "save")


def lock_cache_saves() -> None:
    """Make numba's cache saves exclusive between processes (one lock file per cache folder):
    numba writes a function's index before its data, so two processes saving two signatures
    of one function at once could otherwise pair one's index entry with the other's code."""
    import fcntl

    from numba.core.caching import IndexDataCacheFile
    save = IndexDataCacheFile.save
    if getattr(save, "locked", False):
        return

    def locked_save(self: IndexDataCacheFile, key, data) -> None:
        with open(os.path.join(self._cache_path, ".ggmlpy-save.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            save(self, key, data)

    locked_save.locked = True
    locked_save.__wrapped__ = save
    IndexDataCacheFile.save = locked_save


def compile_instead_of_running(compiled: type[BaseException]) -> None:
    """From now on in this process (compile-ahead's child), a call of any numba kernel
    compiles (or loads) it for the arguments' types, drops every dispatcher's compiled code
    from memory again and raises `compiled` instead of running."""
    import gc

    from numba.core.dispatcher import Dispatcher
    dispatchers = [obj for obj in gc.get_objects() if isinstance(obj, Dispatcher)]

    def forget_all() -> None:
        for d in dispatchers:
            if d.overloads:
                d._reset_overloads()

    def compile_only(self: Dispatcher, *args, **kws):
        self.compile(tuple(self.typeof_pyval(a) for a in args))
        forget_all()
        raise compiled

    Dispatcher._compile_for_args = compile_only
    forget_all()


def bfloat_type() -> Any:
    """LLVM's bfloat as an llvmlite IR type (llvmlite's builder has none; its types print
    themselves through _to_string)."""
    from llvmlite import ir

    class BFloat(ir.Type):
        def _to_string(self) -> str:
            return "bfloat"

        def __eq__(self, other) -> bool:
            return isinstance(other, BFloat)

        def __hash__(self) -> int:
            return hash("bfloat")

    return BFloat()


def missing() -> list[str]:
    """The private names this module uses that the installed numba / llvmlite lack (launches
    numba's thread pool: the thread setter exists from then on)."""
    import numba
    from llvmlite import ir
    from numba.core import caching, dispatcher, event
    from numba.np.ufunc import parallel
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    wanted = [(parallel, "_set_num_threads"), (caching.IndexDataCacheFile, "save"),
              (dispatcher.Dispatcher, "_compile_for_args"), (dispatcher.Dispatcher, "_reset_overloads"),
              (dispatcher.Dispatcher, "typeof_pyval"), (caching, "IndexDataCacheFile"), (ir.Type, "_to_string"),
              (event, "Listener"), (event, "register"), *_lean_parfor_names()]
    return [f"{getattr(owner, '__name__', owner)}.{name}" for owner, name in wanted if not hasattr(owner, name)]
