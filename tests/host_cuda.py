"""The CUDA C source of the CuPy backend, compiled and run on the host.

The source is compiled as host C++ with a small prelude (CUDA's qualifiers as nothing,
blockIdx/threadIdx as globals, the device intrinsics and float16 conversions as host functions)
and a runner per entry point that walks a launch's grid thread by thread. Each GPU thread owns
its pairs, so walking them in order is a faithful schedule. ``run_kernel`` takes a kernel's
arguments in the order a CuPy launch passes them, so the tests drive it with the launcher's own
packing (``launch_plan``) or through a stand-in for CuPy (``fake_cupy``).
"""

import ctypes
import shutil
import subprocess

import numpy as np

from arrayrope.backends.cuda.cupy import FUSED_NAMES, FUSED_VARIANTS, KERNEL_NAMES, SOURCE  # noqa: F401 - FUSED_NAMES: fake_cupy

GXX = shutil.which("g++")

HOST_PRELUDE = r"""
#include <cmath>
#include <cstring>
#define __global__
#define __device__
#define __forceinline__ inline
struct host_dim3 { unsigned x, y, z; };
static host_dim3 blockIdx, blockDim, threadIdx;
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) {
    unsigned int u; std::memcpy(&u, &f, 4); return u;
}
// IEEE conversions, round to nearest even, as PTX's cvt.f32.f16 and cvt.rn.f16.f32
static inline float host_f16_to_f32(unsigned short h) {
    _Float16 v; std::memcpy(&v, &h, 2); return (float)v;
}
static inline unsigned short host_f32_to_f16(float f) {
    _Float16 v = (_Float16)f; unsigned short h; std::memcpy(&h, &v, 2); return h;
}
"""

HOST_RUNNER = r"""
// Every thread of the grid in turn, each running CALL
#define HOST_GRID(CALL)                                                                      \
    blockDim.x = lanes; blockDim.y = rows_per_block; blockDim.z = 1;                         \
    for (unsigned b = 0; b < grid; ++b)                                                      \
        for (unsigned ty = 0; ty < rows_per_block; ++ty)                                     \
            for (unsigned tx = 0; tx < lanes; ++tx) {                                        \
                blockIdx.x = b; threadIdx.x = tx; threadIdx.y = ty;                          \
                CALL;                                                                        \
            }

#define HOST_RUN(NAME, T)                                                                    \
extern "C" void host_##NAME(                                                                 \
    const T* x1, T* o1, const i64* i1, const T* x2, T* o2, const i64* i2, const i64* g,      \
    int nlead, const Elem<T>::compute* cos_table, const Elem<T>::compute* sin_table,         \
    i64 n_table, const int* pair_axis, const double* inv_freq, const double* levels,         \
    double scale, int* flagged, int rotary_dim, int d, Elem<T>::compute sign, int copy_tail, \
    i64 n1, i64 n2, unsigned grid, unsigned lanes, unsigned rows_per_block)                  \
{                                                                                            \
    HOST_GRID(NAME(x1, o1, i1, x2, o2, i2, g, nlead, cos_table, sin_table, n_table,          \
                   pair_axis, inv_freq, levels, scale, flagged, rotary_dim, d, sign,         \
                   copy_tail, n1, n2))                                                       \
}

#define HOST_RUN_FUSED(NAME, T, K)                                                           \
extern "C" void host_##NAME(                                                                 \
    const T* q, T* out, const T* k, const T* v, K* k_cache, K* v_cache, const i64* g,        \
    const i64* slots, const i64* rows, const Elem<T>::compute* cos_table,                    \
    const Elem<T>::compute* sin_table, const Elem<T>::compute* q_weight, int n_q_weight,     \
    const Elem<T>::compute* k_weight, int n_k_weight, Elem<T>::compute eps,                  \
    Elem<T>::compute k_multiplier, Elem<T>::compute v_multiplier, int rotary_dim, int d,     \
    int hq, int hkv, i64 block, i64 n, unsigned grid, unsigned lanes, unsigned rows_per_block)\
{                                                                                            \
    HOST_GRID(NAME(q, out, k, v, k_cache, v_cache, g, slots, rows, cos_table, sin_table,     \
                   q_weight, n_q_weight, k_weight, n_k_weight, eps, k_multiplier,            \
                   v_multiplier,                                                             \
                   rotary_dim, d, hq, hkv, block, n))                                        \
}
"""

_STORAGE = {"float32": "float", "float64": "double", "float16": "f16_bits", "bfloat16": "bf16_bits"}

# The C type of each scalar argument, by its NumPy type (as CuPy maps them)
_SCALARS = {
    np.int32: ctypes.c_int,
    np.int64: ctypes.c_int64,
    np.float32: ctypes.c_float,
    np.float64: ctypes.c_double,
}


def compile_host_kernels(folder):
    """The source and its runners as a shared library in ``folder`` (g++ warnings as errors),
    under the alignment sanitizer: a typed access at an address its type does not divide, which
    x86 forgives and a GPU faults on, aborts the process."""
    source = folder / "rope_host.cpp"
    runners = "".join(
        f"HOST_RUN({name}, {_STORAGE[name.split('_')[1]]})\n" for name in KERNEL_NAMES
    )
    runners += "".join(
        f"HOST_RUN_FUSED({name}, {ctype}, {cache})\n" for name, ctype, cache, _ in FUSED_VARIANTS
    )
    source.write_text(HOST_PRELUDE + SOURCE + HOST_RUNNER + runners)
    library = folder / "rope_host.so"
    command = [GXX, "-std=c++14", "-O1", "-Wall", "-Werror", "-shared", "-fPIC", str(source)]
    command += ["-fsanitize=alignment", "-fno-sanitize-recover=alignment"]
    result = subprocess.run([*command, "-o", str(library)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return ctypes.CDLL(str(library))


def run_kernel(library, name, grid, block, args, address):
    """Run entry point ``name`` over ``grid`` blocks of ``block`` threads.

    ``args`` are the kernel's arguments as a CuPy launch takes them: arrays (passed as
    ``address(array)``, the address of element 0) and NumPy scalars of the kernel's types.
    """
    (blocks,) = grid
    lanes, rows_per_block = block
    converted = []
    for a in args:
        scalar = _SCALARS.get(type(a))
        converted.append(ctypes.c_void_p(address(a)) if scalar is None else scalar(a))
    getattr(library, f"host_{name}")(
        *converted, ctypes.c_uint(blocks), ctypes.c_uint(lanes), ctypes.c_uint(rows_per_block)
    )
