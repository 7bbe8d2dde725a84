"""The one emitter of ggmlpy's LLVM IR: the types, loads and stores, vector arithmetic, lane
sums in ggml's orders, intrinsic declarations and CPU features every kernel module of this
package builds on, so that an alignment, a summation order or a feature test is written once.

A kernel is a function body(e, *args) turned into a numba intrinsic by `kernel`: e is an
Emit over the builder, arrays arrive as data pointers (their shapes and strides through e),
integers as i64, floats and booleans as they are.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils, config
from numba.extending import intrinsic

from ..numba_compat import bfloat_type

W = 16  # float32 lanes of one AVX-512 register: the width of the kernels' tiles

F32 = ir.FloatType()
F64 = ir.DoubleType()
HALF = ir.HalfType()
BFLOAT = bfloat_type()
I8 = ir.IntType(8)
I16 = ir.IntType(16)
I32 = ir.IntType(32)
I64 = ir.IntType(64)


def vec(elem: ir.Type, n: int = W) -> ir.VectorType:
    return ir.VectorType(elem, n)


# llvm.prefetch is overloaded on its pointer: mangled for i8* before LLVM 17's opaque pointers
PREFETCH = "llvm.prefetch.p0" if llvm.llvm_version_info >= (17,) else "llvm.prefetch.p0i8"

VF = vec(F32)  # the kernels' registers: 16 float32, 16 float64 (exact sums), 16 int32
VD = vec(F64)
VI = vec(I32)


def _target_features() -> dict[str, bool]:
    """The CPU features numba compiles for: the host's, or NUMBA_CPU_FEATURES when set (as
    numba itself decides; NUMBA_CPU_NAME=generic means none)."""
    if config.CPU_FEATURES is not None:
        return {f[1:]: f[0] == "+" for f in config.CPU_FEATURES.split(",") if f[:1] in "+-" and len(f) > 1}
    return dict(llvm.get_host_cpu_features())


def target_has(*features: str) -> bool:
    """Whether numba's target has all of `features` (LLVM's names: "avx512vnni", "f16c")."""
    have = _target_features()
    return all(have.get(f, False) for f in features)


def kernel(returns: types.Type = types.void, params: tuple[types.Type, ...] | None = None
           ) -> Callable[[Callable], Callable]:
    """A numba intrinsic of `body(e, *args)` returning `returns`. Without `params` it takes any
    argument types (a float other than float32 is refused: the kernels are float32 code) and
    the body gets them as Emit.arguments makes them; with `params` (scalar intrinsics) numba
    converts the arguments to those types and the body gets their values as they are. The
    body returns the result's value, or nothing for void."""
    def make(body: Callable) -> Callable:
        names = list(inspect.signature(body).parameters)[1:]

        def typer(typingctx, *args):
            if params is None and any(isinstance(a, types.Float) and a != types.float32 for a in args):
                return None

            def codegen(context, builder, signature, values):
                e = Emit(context, builder)
                out = body(e, *(values if params else e.arguments(signature.args, values)))
                return context.get_dummy_value() if out is None else out
            return returns(*(params or args)), codegen

        typer.__name__ = typer.__qualname__ = body.__name__
        typer.__doc__, typer.__module__ = body.__doc__, body.__module__
        typer.__signature__ = inspect.Signature(  # numba folds call arguments by it
            [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in ["typingctx", *names]])
        return intrinsic(typer)
    return make


class Emit:
    """IR for one kernel call: `b` is the llvmlite builder, for what needs nothing shared."""

    def __init__(self, context, builder: ir.IRBuilder):
        self.context, self.b = context, builder
        self._arrays: list[tuple[ir.Value, types.Array, object]] = []

    def arguments(self, tys, values) -> list[ir.Value]:
        """Arrays as their data pointers, integers as i64 (sign-extended), others unchanged."""
        out = []
        for ty, v in zip(tys, values):
            if isinstance(ty, types.Array):
                ary = self.context.make_array(ty)(self.context, self.b, v)
                data = ary.data  # each read of a field is a load
                self._arrays.append((data, ty, ary))
                out.append(data)
            elif isinstance(ty, types.Integer):
                out.append(self.i64(v))
            else:
                out.append(v)
        return out

    def _array(self, ptr):
        return next((ty, ary) for p, ty, ary in self._arrays if p is ptr)

    def shape(self, ptr, dim: int) -> ir.Value:
        """Dimension `dim` of the array argument whose data pointer is `ptr`."""
        return self.b.extract_value(self._array(ptr)[1].shape, dim)

    def stride(self, ptr, dim: int) -> ir.Value:
        """Stride `dim` of the array argument at `ptr`, in elements (any layout)."""
        ty, ary = self._array(ptr)
        size = self.context.get_abi_sizeof(self.context.get_data_type(ty.dtype))
        return self.b.sdiv(self.b.extract_value(ary.strides, dim), self.const(size))

    # ---- values and addresses ----
    def i64(self, x):
        return x if x.type == I64 else self.b.sext(x, I64)

    def const(self, n, ty: ir.Type = I64) -> ir.Constant:
        """n as a constant of `ty`; of every lane for a vector type."""
        return ir.Constant(ty, [n] * ty.count if isinstance(ty, ir.VectorType) else n)

    def gep(self, ptr, idx):
        return self.b.gep(ptr, [idx])

    def rows(self, base, r0, stride, count: int) -> list:
        """Pointers to rows r0 .. r0 + count - 1 of a matrix at base with `stride` elements a row."""
        b = self.b
        return [self.gep(base, b.mul(b.add(r0, self.const(r)), stride)) for r in range(count)]

    # ---- memory ----
    def at(self, ptr, idx):
        """The element ptr[idx]."""
        return self.b.load(self.gep(ptr, idx))

    def load(self, ptr, idx, ty: ir.Type = VF, align: int = 4):
        """A `ty` from ptr[idx] on, at an address aligned to `align` bytes (4: any float's)."""
        return self.b.load(self.b.bitcast(self.gep(ptr, idx), ty.as_pointer()), align=align)

    def store(self, ptr, idx, value, align: int = 4) -> None:
        self.b.store(value, self.b.bitcast(self.gep(ptr, idx), value.type.as_pointer()), align=align)

    def prefetch(self, ptr) -> None:
        """A hint to read the cache line at ptr into every cache level (prefetcht0)."""
        p = self.b.bitcast(ptr, ir.IntType(8).as_pointer())
        self.call(PREFETCH, ir.VoidType(), p, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1))

    def half(self, ptr, idx):
        """The float32 value of the IEEE half at byte ptr[idx] (any alignment)."""
        return self.b.fpext(self.load(ptr, idx, HALF, align=1), F32)

    def slot(self, value):
        """A stack slot holding `value` (LLVM keeps it in a register when it can)."""
        return cgutils.alloca_once_value(self.b, value)

    def array(self, ty: ir.Type, n: int):
        """A stack array of n `ty`, for values a loop index picks."""
        return cgutils.alloca_once(self.b, ir.ArrayType(ty, n))

    def acc(self, ty: ir.Type = VF):
        """A slot holding float zeros: an accumulator."""
        return self.slot(self.const(0.0, ty))

    # ---- arithmetic ----
    def splat(self, x, n: int = W):
        """<n x T> of every lane x."""
        vt = vec(x.type, n)
        v = self.b.insert_element(ir.Constant(vt, ir.Undefined), x, ir.Constant(I32, 0))
        return self.b.shuffle_vector(v, ir.Constant(vt, ir.Undefined), ir.Constant(vec(I32, n), [0] * n))

    def mul(self, a, b):
        return self.b.fmul(a, b)

    def add(self, a, b):
        return self.b.fadd(a, b)

    def call(self, name: str, returns: ir.Type, *args):
        """A call of the LLVM intrinsic `name` (declared once per module, by its arguments' types)."""
        fn = cgutils.get_or_insert_function(self.b.module, ir.FunctionType(returns, [a.type for a in args]), name)
        return self.b.call(fn, list(args))

    def fma(self, a, b, c):
        """a * b + c rounded once (llvm.fma: vfmadd), of scalars or vectors."""
        ty = a.type
        name = ty.intrinsic_name if not isinstance(ty, ir.VectorType) else f"v{ty.count}{ty.element.intrinsic_name}"
        return self.call(f"llvm.fma.{name}", ty, a, b, c)

    def to_half_bits(self, x):
        """IEEE half bits (i16) of a float32, to nearest even (vcvtps2ph)."""
        return self.b.bitcast(self.b.fptrunc(x, HALF), I16)

    def from_half_bits(self, h):
        return self.b.fpext(self.b.bitcast(h, HALF), F32)

    def lanes(self, v) -> list:
        return [self.b.extract_element(v, ir.Constant(I32, i)) for i in range(v.type.count)]

    def hsum(self, values: list):
        """The sum of 16, 8 or 4 values as ggml adds SIMD lanes: the upper half onto the lower
        until 4 remain, then (0 + 2) + (1 + 3) (8: AVX's hsum_float_8; 16: GCC's
        _mm512_reduce_add_ps)."""
        while len(values) > 4:
            half = len(values) // 2
            values = [self.add(values[i], values[i + half]) for i in range(half)]
        return self.add(self.add(values[0], values[2]), self.add(values[1], values[3]))

    # ---- control ----
    @contextmanager
    def loop(self, stop, start=None) -> Iterator[ir.Value]:
        """for i in range(start or 0, stop): yields i (i64)."""
        if start is None:
            with cgutils.for_range(self.b, stop) as lp:
                yield lp.index
        else:
            with cgutils.for_range_slice(self.b, start, stop, self.const(1)) as (i, _):
                yield i
