"""CUDA C kernels compiled through CuPy (RawModule), and their launcher.

One entry point per storage dtype and pair style, ``rope_<dtype>_<style>``, built once per device
and fetched by name. Operands are addressed from their element 0 with signed element strides, so
any leading layout (negative steps, fused QKV views, broadcast positions) runs without a copy.

Launch geometry: ``block=(32, ROWS_PER_BLOCK)``. The 32 lanes of a warp walk the pairs of one row,
so loads and stores of neighbouring pairs coalesce and the warp decodes its row index once; each
block covers ROWS_PER_BLOCK rows, and q and k rows share one grid (one launch for rotate_qk).
"""

import numpy as np

from ._errors import BackendUnavailableError
from ._layout import geometry, rows

ROWS_PER_BLOCK = 8
LANES = 32

SOURCE = r"""
typedef long long i64;

// Storage types: float and double as they are; float16 and bfloat16 as their 16 bits, so that
// the source needs no fp16 headers (NVRTC and nvcc alike) and the conversions are explicit.
struct f16_bits { unsigned short v; };
struct bf16_bits { unsigned short v; };

template <typename T> struct Elem;
template <> struct Elem<float> {
    typedef float compute;
    static __device__ __forceinline__ float load(const float* p) { return *p; }
    static __device__ __forceinline__ void store(float* p, float v) { *p = v; }
};
template <> struct Elem<double> {
    typedef double compute;
    static __device__ __forceinline__ double load(const double* p) { return *p; }
    static __device__ __forceinline__ void store(double* p, double v) { *p = v; }
};
// Half types compute in float32 and round once, at the store, half to even.
template <> struct Elem<f16_bits> {
    typedef float compute;
    static __device__ __forceinline__ float load(const f16_bits* p) {
#ifdef __CUDA_ARCH__
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(p->v));
        return f;
#else  // the tests run this source on the host too, where host_f16_to_f32 is defined
        return host_f16_to_f32(p->v);
#endif
    }
    static __device__ __forceinline__ void store(f16_bits* p, float f) {
#ifdef __CUDA_ARCH__
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
        p->v = h;
#else
        p->v = host_f32_to_f16(f);
#endif
    }
};
template <> struct Elem<bf16_bits> {
    typedef float compute;
    static __device__ __forceinline__ float load(const bf16_bits* p) {
        return __uint_as_float(((unsigned int)p->v) << 16);
    }
    static __device__ __forceinline__ void store(bf16_bits* p, float f) {
        unsigned int u = __float_as_uint(f);
        if ((u & 0x7fffffffu) > 0x7f800000u) {  // nan stays a quiet nan
            p->v = (unsigned short)((u >> 16) | 0x40u);
        } else {
            p->v = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        }
    }
};

// g: per operand t, rows of nlead + 1 int64 (sizes | idx axis stride; x strides | 0;
// out strides | 0; idx strides | 0), strides in elements from element 0.
template <typename T, bool HALF_STYLE>
__device__ __forceinline__ void rope_rows(
    const T* x1, T* o1, const i64* i1, const T* x2, T* o2, const i64* i2, const i64* g,
    int nlead, const typename Elem<T>::compute* cos_table,
    const typename Elem<T>::compute* sin_table, const int* pair_axis, int rotary_dim, int d,
    typename Elem<T>::compute sign, int copy_tail, i64 n1, i64 n2)
{
    typedef typename Elem<T>::compute C;
    i64 row = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    int t = 0;
    if (row >= n1) {
        row -= n1;
        t = 1;
        if (row >= n2) return;
    }
    const T* x = t ? x2 : x1;
    T* o = t ? o2 : o1;
    const i64* idx = t ? i2 : i1;
    const i64* gt = g + (i64)t * 4 * (nlead + 1);
    const int w = nlead + 1;
    i64 xb = 0, ob = 0, pb = 0, rem = row;
    for (int ax = nlead - 1; ax >= 0; --ax) {
        const i64 n = gt[ax];
        const i64 i = rem % n;
        rem /= n;
        xb += i * gt[w + ax];
        ob += i * gt[2 * w + ax];
        pb += i * gt[3 * w + ax];
    }
    const i64 axis_stride = gt[nlead];
    const int half = rotary_dim / 2;
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
        const i64 p = idx[pb + pair_axis[j] * axis_stride];
        const C c = cos_table[p * half + j];
        const C s = sin_table[p * half + j] * sign;
        const i64 ia = HALF_STYLE ? j : 2 * j;
        const i64 ib = HALF_STYLE ? j + half : 2 * j + 1;
        const C a = Elem<T>::load(x + xb + ia);
        const C b = Elem<T>::load(x + xb + ib);
        // FMA contraction is allowed: one rounding fewer, inside the same error bound.
        Elem<T>::store(o + ob + ia, a * c - b * s);
        Elem<T>::store(o + ob + ib, b * c + a * s);
    }
    if (copy_tail) {
        for (int j = rotary_dim + threadIdx.x; j < d; j += blockDim.x) o[ob + j] = x[xb + j];
    }
}

#define ROPE_ENTRY(NAME, T, HALF_STYLE)                                                      \
extern "C" __global__ void NAME(                                                             \
    const T* x1, T* o1, const i64* i1, const T* x2, T* o2, const i64* i2, const i64* g,      \
    int nlead, const Elem<T>::compute* cos_table, const Elem<T>::compute* sin_table,         \
    const int* pair_axis, int rotary_dim, int d, Elem<T>::compute sign, int copy_tail,       \
    i64 n1, i64 n2)                                                                          \
{                                                                                            \
    rope_rows<T, HALF_STYLE>(x1, o1, i1, x2, o2, i2, g, nlead, cos_table, sin_table,         \
                             pair_axis, rotary_dim, d, sign, copy_tail, n1, n2);             \
}

ROPE_ENTRY(rope_float32_interleaved, float, false)
ROPE_ENTRY(rope_float32_half, float, true)
ROPE_ENTRY(rope_float64_interleaved, double, false)
ROPE_ENTRY(rope_float64_half, double, true)
ROPE_ENTRY(rope_float16_interleaved, f16_bits, false)
ROPE_ENTRY(rope_float16_half, f16_bits, true)
ROPE_ENTRY(rope_bfloat16_interleaved, bf16_bits, false)
ROPE_ENTRY(rope_bfloat16_half, bf16_bits, true)
"""

KERNEL_NAMES = tuple(
    f"rope_{dtype}_{style}"
    for dtype in ("float32", "float64", "float16", "bfloat16")
    for style in ("interleaved", "half")
)


def require_cupy():
    try:
        import cupy
    except ImportError:
        cupy = None
    if cupy is None:
        raise BackendUnavailableError(
            "backend 'cupy' needs CuPy: pip install 'arrayrope[cuda12]' (or [cuda13])"
        )
    return cupy


_modules = {}
_device_arrays = {}


def _module(cupy):
    device = cupy.cuda.Device().id
    module = _modules.get(device)
    if module is None:
        module = cupy.RawModule(code=SOURCE, options=("--std=c++14",))
        _modules[device] = module
    return module


def _on_device(cupy, key, host):
    """A small host array copied to the current device once and kept (geometry, pair axes)."""
    key = (cupy.cuda.Device().id, key)
    found = _device_arrays.get(key)
    if found is None:
        if len(_device_arrays) > 512:
            _device_arrays.clear()
        found = _device_arrays[key] = cupy.asarray(host)
    return found


def launch_plan(rope, operands, inverse):
    """What one launch takes, host side: (kernel name, grid, the six operand arrays, geometry g,
    nlead, and the scalars after the tables: rotary_dim, d, sign, copy_tail, n1, n2). The kernel's
    arguments are the arrays, g, nlead, cos, sin, pair_axis (int32), then those scalars. Shared
    by :func:`launch` and the tests, which run the same source on the host."""
    x0 = operands[0][0]
    g = geometry(operands, flat=False)
    arrays = []
    for x, out, idx in operands:
        arrays += (x, out, idx)  # arrays pass as the address of their element 0
    if len(operands) == 1:
        arrays += arrays  # the second operand has zero rows
    n1 = rows(g, 0)
    n2 = rows(g, 1) if len(operands) == 2 else 0
    d = x0.shape[-1]
    copy_tail = int(rope.rotary_dim < d and any(o is not x for x, o, _ in operands))
    compute = np.float64 if x0.dtype == np.float64 else np.float32
    scalars = (
        np.int32(rope.rotary_dim),
        np.int32(d),
        compute(-1.0 if inverse else 1.0),
        np.int32(copy_tail),
        np.int64(n1),
        np.int64(n2),
    )
    grid = ((n1 + n2 + ROWS_PER_BLOCK - 1) // ROWS_PER_BLOCK,)
    name = f"rope_{x0.dtype.name}_{rope.style}"
    return name, grid, tuple(arrays), g, np.int32(g.shape[2] - 1), scalars


def launch(rope, operands, cos, sin, inverse):
    """Rotate one or two operands in one launch; same contract as :func:`arrayrope._cpu.launch`."""
    cupy = require_cupy()
    with operands[0][0].device:
        name, grid, arrays, g_host, nlead, scalars = launch_plan(rope, operands, inverse)
        g = _on_device(cupy, ("g", g_host.shape, g_host.tobytes()), g_host)
        pair_axis = _on_device(
            cupy, ("axes", rope._pair_axis.tobytes()), rope._pair_axis.astype(np.int32)
        )
        _module(cupy).get_function(name)(
            grid=grid,
            block=(LANES, ROWS_PER_BLOCK),
            args=(
                *arrays,
                g,
                nlead,
                cupy.ascontiguousarray(cos),
                cupy.ascontiguousarray(sin),
                pair_axis,
                *scalars,
            ),
        )
