"""ggmlpy's kernels written as LLVM IR, exposed to numba as intrinsics (the numba kernels
that call them stay with their ops in backend/cpu): emit.py is the one emitter, every other
module a family of kernels built only through it. Outside backend/cpu so that half.py's
conversions load without the CPU backend."""
