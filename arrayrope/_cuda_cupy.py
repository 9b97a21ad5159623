"""CUDA C kernels compiled through CuPy (RawModule), and their launcher.

Entry points per storage dtype and pair style, built once per device and fetched by name:
``rope_<dtype>_<style>`` loads element by element, ``rope_<dtype>_<style>_v<P>`` loads P pairs
per lane as one aligned access of up to 16 bytes, where the launcher finds every row aligned
(:func:`launch_plan`). Operands are addressed from their element 0 with signed element strides,
so any leading layout (negative steps, fused QKV views, broadcast positions) runs without a copy.

Launch geometry: ``block=(32, WARPS_PER_BLOCK)``. The 32 lanes of a warp walk the pairs of one
row at a time, so neighbouring lanes touch neighbouring memory, and each warp takes
ROWS_PER_WARP consecutive rows, decoding the row coordinates once for them. q and k rows share
one grid (one launch for rotate_qk).
"""

import numpy as np

from ._device import on_device
from ._errors import BackendUnavailableError
from ._layout import geometry, rows

LANES = 32
WARPS_PER_BLOCK = 8
ROWS_PER_WARP = 4
ROWS_PER_BLOCK = WARPS_PER_BLOCK * ROWS_PER_WARP

_KERNELS = r"""
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

// N consecutive storage elements: one 4-, 8- or 16-byte access where the address is aligned.
template <typename T, int N> struct alignas(sizeof(T) * N) Pack { T v[N]; };

// N elements at p, widened to the compute type (VECTOR: one aligned access; else one each)
template <typename T, int N, bool VECTOR>
__device__ __forceinline__ void load_n(const T* p, typename Elem<T>::compute* out) {
    if (VECTOR) {
        const Pack<T, N> pack = *reinterpret_cast<const Pack<T, N>*>(p);
        for (int k = 0; k < N; ++k) out[k] = Elem<T>::load(&pack.v[k]);
    } else {
        for (int k = 0; k < N; ++k) out[k] = Elem<T>::load(p + k);
    }
}

template <typename T, int N, bool VECTOR>
__device__ __forceinline__ void store_n(T* p, const typename Elem<T>::compute* values) {
    if (VECTOR) {
        Pack<T, N> pack;
        for (int k = 0; k < N; ++k) Elem<T>::store(&pack.v[k], values[k]);
        *reinterpret_cast<Pack<T, N>*>(p) = pack;
    } else {
        for (int k = 0; k < N; ++k) Elem<T>::store(p + k, values[k]);
    }
}

// g: per operand t, rows of nlead + 1 int64 (sizes | idx axis stride; x strides | 0;
// out strides | 0; idx strides | 0), strides in elements from element 0.
//
// Each warp rotates ROWS_PER_WARP consecutive rows (q's, then k's). It decodes the first row's
// coordinates with one division per leading axis, and the next rows by stepping the innermost
// axis, decoding again only where that axis wraps (k's rows begin at such a wrap): index
// arithmetic would otherwise cost more instructions than the rotation. Lanes take P
// consecutive pairs each (VECTOR: as one aligned access, which the launcher checks; else
// element by element). All of a warp's rows are loaded before any is stored, so each thread
// keeps ROWS_PER_WARP loads in flight (x and out may be one array, so a load cannot move past
// a store); the tables, g, idx and pair_axis are never written, hence __restrict__.
template <typename T, bool HALF_STYLE, int P, bool VECTOR>
__device__ __forceinline__ void rope_rows(
    const T* x1, T* o1, const i64* __restrict__ i1, const T* x2, T* o2,
    const i64* __restrict__ i2, const i64* __restrict__ g, int nlead,
    const typename Elem<T>::compute* __restrict__ cos_table,
    const typename Elem<T>::compute* __restrict__ sin_table, const int* __restrict__ pair_axis,
    int rotary_dim, int d, typename Elem<T>::compute sign, int copy_tail, i64 n1, i64 n2)
{
    typedef typename Elem<T>::compute C;
    const int R = ROWS_PER_WARP;
    const int w = nlead + 1;
    const int half = rotary_dim / 2;
    const i64 first = ((i64)blockIdx.x * blockDim.y + threadIdx.y) * R;
    if (first >= n1 + n2) return;
    const int count = first + R <= n1 + n2 ? R : (int)(n1 + n2 - first);

    // The rows' addresses
    const T* xr[R];
    T* orow[R];
    const i64* pr[R];
    i64 axis_stride = 0;
    {
        const T* x = x1;
        T* o = o1;
        const i64* idx = i1;
        i64 xb = 0, ob = 0, pb = 0, inner = 0, inner_n = 0, xs = 0, os = 0, ps = 0;
        for (int r = 0; r < R; ++r) {
            if (r >= count) {  // past the end: repeat the last row, never stored
                xr[r] = xr[r - 1];
                orow[r] = orow[r - 1];
                pr[r] = pr[r - 1];
                continue;
            }
            if (r == 0 || inner == inner_n) {
                const i64 row = first + r;
                const int t = row >= n1;
                x = t ? x2 : x1;
                o = t ? o2 : o1;
                idx = t ? i2 : i1;
                const i64* gt = g + (i64)t * 4 * w;
                i64 rem = t ? row - n1 : row;
                xb = ob = pb = 0;
                for (int ax = nlead - 1; ax >= 0; --ax) {
                    const i64 n = gt[ax];
                    const i64 i = rem % n;
                    rem /= n;
                    xb += i * gt[w + ax];
                    ob += i * gt[2 * w + ax];
                    pb += i * gt[3 * w + ax];
                    if (ax == nlead - 1) inner = i;
                }
                inner_n = gt[nlead - 1];
                xs = gt[w + nlead - 1];
                os = gt[2 * w + nlead - 1];
                ps = gt[3 * w + nlead - 1];
                axis_stride = gt[nlead];  // the same for q and k: one RoPE
            }
            xr[r] = x + xb;
            orow[r] = o + ob;
            pr[r] = idx + pb;
            ++inner;
            xb += xs;
            ob += os;
            pb += ps;
        }
    }

    for (int j = threadIdx.x * P; j < half; j += blockDim.x * P) {
        C a[R][P], b[R][P], c[R][P], s[R][P];
        for (int r = 0; r < R; ++r) {
            if (HALF_STYLE) {
                load_n<T, P, VECTOR>(xr[r] + j, a[r]);
                load_n<T, P, VECTOR>(xr[r] + j + half, b[r]);
            } else {
                C ab[2 * P];
                load_n<T, 2 * P, VECTOR>(xr[r] + 2 * j, ab);
                for (int k = 0; k < P; ++k) {
                    a[r][k] = ab[2 * k];
                    b[r][k] = ab[2 * k + 1];
                }
            }
            if (axis_stride == 0) {  // one position axis: one table row for all pairs
                const i64 row_start = *pr[r] * half + j;
                load_n<C, P, VECTOR>(cos_table + row_start, c[r]);
                load_n<C, P, VECTOR>(sin_table + row_start, s[r]);
            } else {  // multi-axis positions: each pair reads its own axis
                for (int k = 0; k < P; ++k) {
                    const i64 at = pr[r][pair_axis[j + k] * axis_stride] * half + j + k;
                    c[r][k] = cos_table[at];
                    s[r][k] = sin_table[at];
                }
            }
        }
        for (int r = 0; r < R; ++r) {
            if (r >= count) break;
            C ra[P], rb[P];
            for (int k = 0; k < P; ++k) {
                // FMA contraction is allowed: one rounding fewer, inside the same error bound.
                const C sk = s[r][k] * sign;
                ra[k] = a[r][k] * c[r][k] - b[r][k] * sk;
                rb[k] = b[r][k] * c[r][k] + a[r][k] * sk;
            }
            if (HALF_STYLE) {
                store_n<T, P, VECTOR>(orow[r] + j, ra);
                store_n<T, P, VECTOR>(orow[r] + j + half, rb);
            } else {
                C out[2 * P];
                for (int k = 0; k < P; ++k) {
                    out[2 * k] = ra[k];
                    out[2 * k + 1] = rb[k];
                }
                store_n<T, 2 * P, VECTOR>(orow[r] + 2 * j, out);
            }
        }
    }
    if (copy_tail) {
        for (int r = 0; r < R; ++r) {
            if (r >= count) break;
            for (int j = rotary_dim + threadIdx.x; j < d; j += blockDim.x) orow[r][j] = xr[r][j];
        }
    }
}

#define ROPE_ENTRY(NAME, T, HALF_STYLE, P, VECTOR)                                           \
extern "C" __global__ void NAME(                                                             \
    const T* x1, T* o1, const i64* i1, const T* x2, T* o2, const i64* i2, const i64* g,      \
    int nlead, const Elem<T>::compute* cos_table, const Elem<T>::compute* sin_table,         \
    const int* pair_axis, int rotary_dim, int d, Elem<T>::compute sign, int copy_tail,       \
    i64 n1, i64 n2)                                                                          \
{                                                                                            \
    rope_rows<T, HALF_STYLE, P, VECTOR>(x1, o1, i1, x2, o2, i2, g, nlead, cos_table,         \
                                        sin_table, pair_axis, rotary_dim, d, sign,           \
                                        copy_tail, n1, n2);                                  \
}

"""

# Storage type in the source and item size, by dtype name
_STORAGE = {
    "float32": ("float", 4),
    "float64": ("double", 8),
    "float16": ("f16_bits", 2),
    "bfloat16": ("bf16_bits", 2),
}


def _variants():
    """(name, storage type, half style, P, vector) of every entry point: per dtype and style,
    one element-wise (``rope_<dtype>_<style>``) and one per P pairs a lane loads as one access
    of at most 16 bytes (``..._v<P>``)."""
    for dtype, (ctype, size) in _STORAGE.items():
        for style in ("interleaved", "half"):
            name = f"rope_{dtype}_{style}"
            yield name, ctype, style == "half", 1, False
            elements = 1 if style == "half" else 2  # per pair and access
            for p in (1, 2, 4):
                if 1 < p * elements and p * elements * size <= 16:
                    yield f"{name}_v{p}", ctype, style == "half", p, True


KERNEL_NAMES = tuple(v[0] for v in _variants())
SOURCE = (
    f"#define ROWS_PER_WARP {ROWS_PER_WARP}\n"
    + _KERNELS
    + "".join(
        f"ROPE_ENTRY({name}, {ctype}, {str(half).lower()}, {p}, {str(vector).lower()})\n"
        for name, ctype, half, p, vector in _variants()
    )
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
_functions = {}
last_entry = None  # the entry point of the latest launch, for benchmarks and debugging


def _function(cupy, device, name):
    """Entry point ``name`` of the module on device ``device`` (an id; the current one):
    compiled once per device (all entry points together), each looked up once (a lookup is a
    driver call)."""
    function = _functions.get((device, name))
    if function is None:
        module = _modules.get(device)
        if module is None:
            module = _modules[device] = cupy.RawModule(code=SOURCE, options=("--std=c++14",))
        function = _functions[(device, name)] = module.get_function(name)
    return function


def _address(a):
    return a.__array_interface__["data"][0] if isinstance(a, np.ndarray) else a.data.ptr


def _alignment(arrays):
    """The largest power of two, at most 16, dividing the byte address of every row of every
    array (the start and the strides of axes longer than 1; negative strides alike)."""
    bits = 16
    for a in arrays:
        bits |= _address(a)
        for n, s in zip(a.shape[:-1], a.strides[:-1]):
            if n > 1:
                bits |= s
    return bits & -bits


def _pairs_per_access(rope, operands, tables):
    """P of the ``_v<P>`` entry point to launch, or 0 for the element-wise one: the largest P
    whose access (P pairs, at most 16 bytes) is aligned in every row of every x and out and
    in the tables, and which leaves no lane idle where a row has 32 pairs or more."""
    itemsize = operands[0][0].itemsize
    half = rope.rotary_dim // 2
    per_pair = 1 if rope._half_style else 2  # elements of a pair in one access
    data = _alignment([a for x, out, _ in operands for a in (x, out)])
    table = _alignment(tables)
    for p in (4, 2, 1):
        if (
            p * per_pair > 1
            and p * per_pair * itemsize <= data
            and p * tables[0].itemsize <= table
            and half % p == 0
            and (p == 1 or half >= LANES * p)
        ):
            return p
    return 0


_ENTRY_PREFIX = {}  # "rope_<dtype>_<style>" by (dtype, style): dtype.name is slow to build


def launch_plan(rope, operands, tables, inverse):
    """What one launch takes, host side: (kernel name, grid, block, the six operand arrays,
    geometry g, nlead, and the scalars after the tables: rotary_dim, d, sign, copy_tail, n1,
    n2). The kernel's arguments are the arrays, g, nlead, cos, sin (``tables``, C-contiguous),
    pair_axis (int32), then those scalars. Shared by :func:`launch` and the tests, which run the
    same source on the host."""
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
    p = _pairs_per_access(rope, operands, tables)
    prefix = _ENTRY_PREFIX.get((x0.dtype, rope.style))
    if prefix is None:
        prefix = _ENTRY_PREFIX[(x0.dtype, rope.style)] = f"rope_{x0.dtype.name}_{rope.style}"
    name = prefix + (f"_v{p}" if p else "")
    block = (LANES, WARPS_PER_BLOCK)
    return name, grid, block, tuple(arrays), g, np.int32(g.shape[2] - 1), scalars


def launch(rope, operands, cos, sin, inverse):
    """Rotate one or two operands in one launch; same contract as :func:`arrayrope._cpu.launch`."""
    cupy = require_cupy()
    device = operands[0][0].device
    with device:
        device = device.id
        tables = (cupy.ascontiguousarray(cos), cupy.ascontiguousarray(sin))
        name, grid, block, arrays, g_host, nlead, scalars = launch_plan(
            rope, operands, tables, inverse
        )
        g = on_device(cupy, device, ("g", g_host.shape, g_host.tobytes()), g_host)
        axes = rope._pair_axis
        pair_axis = on_device(
            cupy, device, ("axes", "int32", axes.tobytes()), lambda: axes.astype(np.int32)
        )
        _function(cupy, device, name)(
            grid=grid, block=block, args=(*arrays, g, nlead, *tables, pair_axis, *scalars)
        )
    global last_entry
    last_entry = name
