"""The CUDA C source of the CuPy backend: it compiles for Ampere and Hopper, warnings as
errors, and, compiled for the host, it runs and matches the oracle.

nvcc is on the build machines, g++ on most; where either is missing its tests skip, naming it.
"""

import ctypes
import re
import shutil
import subprocess

import numpy as np
import pytest
from conftest import (
    BF16,
    DTYPES,
    assert_matches,
    bits,
    oracle,
    poisoned,
    random_array,
    run_launcher,
)

import arrayrope as ar
from arrayrope._cuda_cupy import KERNEL_NAMES, SOURCE

NVCC = shutil.which("nvcc")


def _nvcc(arch, output_kind, source, output):
    """nvcc with warnings as errors, from the front end through ptxas."""
    command = [
        NVCC,
        "-std=c++14",
        f"-arch={arch}",
        "-Werror",
        "all-warnings",
        "-Xptxas",
        "-Werror",
        output_kind,
        str(source),
        "-o",
        str(output),
    ]
    return subprocess.run(command, capture_output=True, text=True)


@pytest.mark.skipif(NVCC is None, reason="nvcc (CUDA toolkit) is not on PATH")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_compiles_without_warnings(tmp_path, arch):
    source = tmp_path / "rope.cu"
    source.write_text(SOURCE)
    ptx = tmp_path / "rope.ptx"
    result = _nvcc(arch, "--ptx", source, ptx)
    assert result.returncode == 0, result.stderr
    entries = set(re.findall(r"\.visible \.entry (\w+)", ptx.read_text()))
    assert entries == set(KERNEL_NAMES)
    # And to machine code, which checks register and resource limits too.
    cubin = _nvcc(arch, "--cubin", source, tmp_path / "rope.cubin")
    assert cubin.returncode == 0, cubin.stderr


def test_one_entry_point_per_dtype_and_style():
    assert len(KERNEL_NAMES) == 8
    for name in KERNEL_NAMES:
        assert f"ROPE_ENTRY({name}," in SOURCE


# The same source, executed: compiled as host C++ with a small prelude (CUDA's qualifiers as
# nothing, blockIdx/threadIdx as globals, the device intrinsics and float16 conversions as host
# functions) and a runner that walks the launch's grid thread by thread. Each GPU thread owns
# its pairs, so walking them in order is a faithful schedule. The launches take their arguments
# from launch_plan, the CuPy launcher's own packing, so geometry, strides and q/k rows are the
# ones a GPU would get.
HOST_PRELUDE = r"""
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
#define HOST_RUN(NAME, T)                                                                    \
extern "C" void host_##NAME(                                                                 \
    const T* x1, T* o1, const i64* i1, const T* x2, T* o2, const i64* i2, const i64* g,      \
    int nlead, const Elem<T>::compute* cos_table, const Elem<T>::compute* sin_table,         \
    const int* pair_axis, int rotary_dim, int d, Elem<T>::compute sign, int copy_tail,       \
    i64 n1, i64 n2, unsigned grid, unsigned lanes, unsigned rows_per_block)                  \
{                                                                                            \
    blockDim.x = lanes; blockDim.y = rows_per_block; blockDim.z = 1;                         \
    for (unsigned b = 0; b < grid; ++b)                                                      \
        for (unsigned ty = 0; ty < rows_per_block; ++ty)                                     \
            for (unsigned tx = 0; tx < lanes; ++tx) {                                        \
                blockIdx.x = b; threadIdx.x = tx; threadIdx.y = ty;                          \
                NAME(x1, o1, i1, x2, o2, i2, g, nlead, cos_table, sin_table, pair_axis,      \
                     rotary_dim, d, sign, copy_tail, n1, n2);                                \
            }                                                                                \
}
"""

GXX = shutil.which("g++")


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory):
    if GXX is None:
        pytest.skip("g++ is not on PATH: the CUDA C source's host run needs a C++ compiler")
    folder = tmp_path_factory.mktemp("host_kernels")
    source = folder / "rope_host.cpp"
    storage = {
        "float32": "float",
        "float64": "double",
        "float16": "f16_bits",
        "bfloat16": "bf16_bits",
    }
    runners = "".join(f"HOST_RUN({name}, {storage[name.split('_')[1]]})\n" for name in KERNEL_NAMES)
    source.write_text(HOST_PRELUDE + SOURCE + HOST_RUNNER + runners)
    library = folder / "rope_host.so"
    command = [GXX, "-std=c++14", "-O1", "-Wall", "-Werror", "-shared", "-fPIC", str(source)]
    result = subprocess.run([*command, "-o", str(library)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return ctypes.CDLL(str(library))


def _host_launcher(library):
    from arrayrope._cuda_cupy import LANES, ROWS_PER_BLOCK, launch_plan

    def launch(rope, operands, cos, sin, inverse):
        name, grid, arrays, g, nlead, scalars = launch_plan(rope, operands, inverse)
        g = np.ascontiguousarray(g)
        cos, sin = np.ascontiguousarray(cos), np.ascontiguousarray(sin)
        pair_axis = rope._pair_axis.astype(np.int32)
        rotary_dim, d, sign, copy_tail, n1, n2 = scalars
        compute = ctypes.c_double if sign.dtype == np.float64 else ctypes.c_float

        def address(a):  # element 0, as CuPy passes an array
            return ctypes.c_void_p(a.ctypes.data)

        getattr(library, f"host_{name}")(
            *(address(a) for a in arrays),
            address(g),
            ctypes.c_int(int(nlead)),
            address(cos),
            address(sin),
            address(pair_axis),
            ctypes.c_int(int(rotary_dim)),
            ctypes.c_int(int(d)),
            compute(float(sign)),
            ctypes.c_int(int(copy_tail)),
            ctypes.c_int64(int(n1)),
            ctypes.c_int64(int(n2)),
            ctypes.c_uint(grid[0]),
            ctypes.c_uint(LANES),
            ctypes.c_uint(ROWS_PER_BLOCK),
        )

    return launch


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", ["interleaved", "half"])
@pytest.mark.parametrize("rotary_dim", [8, 12])
@pytest.mark.parametrize("inverse", [False, True])
def test_source_runs_on_the_host_and_matches_the_oracle(
    host_kernels, dtype, style, rotary_dim, inverse
):
    rng = np.random.default_rng()
    x = random_array(rng, (2, 3, 9, 12), dtype)
    pos = rng.integers(0, 10**6, size=9)
    rope = ar.RoPE(12, style=style, rotary_dim=rotary_dim)
    out = poisoned(x.shape, dtype)
    (y,) = run_launcher(_host_launcher(host_kernels), rope, (x,), pos, inverse=inverse, outs=(out,))
    assert y is out
    assert_matches(y, oracle(x, pos, style=style, rotary_dim=rotary_dim, inverse=inverse), x)
    np.testing.assert_array_equal(bits(y[..., rotary_dim:]), bits(x[..., rotary_dim:]))
    if dtype.itemsize == 2:  # one rounding of the same float32 value as the CPU kernel's
        cpu = ar.rotate(x, pos, style=style, rotary_dim=rotary_dim, inverse=inverse)
        np.testing.assert_array_equal(bits(y), bits(cpu))


@pytest.mark.parametrize("layout", ["reverse", "fused", "features", "inplace", "float-pos"])
def test_source_on_the_host_takes_any_layout(host_kernels, layout):
    rng = np.random.default_rng()
    big = rng.standard_normal((3, 4, 5, 16)).astype(np.float32)
    pos = rng.integers(0, 5000, size=(4, 1))
    view = {
        "reverse": lambda b: b[1, ::-1, ::-2, :8],
        "fused": lambda b: b[:2, :, 1, 8:],
        "features": lambda b: b[0, :, :3, ::2],
    }.get(layout, lambda b: b[2, :, :2, :8])(big)
    if layout == "fused":
        pos = rng.integers(0, 5000, size=(1, 4))
    if layout == "float-pos":
        pos = rng.random((4, 1)) * 1e5
    rope = ar.RoPE(8, style="half")
    expected = rope.rotate(np.ascontiguousarray(view), pos)
    before = big.copy()
    outs = (view,) if layout == "inplace" else None
    (y,) = run_launcher(_host_launcher(host_kernels), rope, (view,), pos, outs=outs)
    np.testing.assert_allclose(y, expected, rtol=0, atol=2e-6)
    if layout != "inplace":
        np.testing.assert_array_equal(big, before)  # x untouched


def test_source_on_the_host_rotates_q_and_k_in_one_launch(host_kernels):
    rng = np.random.default_rng()
    q = rng.standard_normal((4, 3, 8)).astype(np.float32)
    k = rng.standard_normal((2, 3, 8)).astype(np.float32)
    pos = rng.integers(0, 10**5, size=3)
    rope = ar.RoPE(8)
    outs = (poisoned(q.shape, q.dtype), poisoned(k.shape, k.dtype))
    qr, kr = run_launcher(_host_launcher(host_kernels), rope, (q, k), pos, outs=outs)
    np.testing.assert_allclose(qr, ar.rotate(q, pos), rtol=0, atol=2e-6)
    np.testing.assert_allclose(kr, ar.rotate(k, pos), rtol=0, atol=2e-6)


def test_source_on_the_host_takes_multi_axis_positions(host_kernels):
    rng = np.random.default_rng()
    rope = ar.RoPE.sectioned(16, (2, 3, 3), style="half")
    x = rng.standard_normal((5, 16)).astype(np.float32)
    pos = rng.integers(0, 1000, size=(5, 3))
    (y,) = run_launcher(_host_launcher(host_kernels), rope, (x,), pos)
    np.testing.assert_allclose(y, rope.rotate(x, pos), rtol=0, atol=2e-6)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the oracle's
@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16], ids=str)
def test_source_on_the_host_keeps_nan_and_inf(host_kernels, dtype):
    # Every nan and infinity the half type can hold, in both elements of some pair: the device
    # store must give nan and infinity where the float64 formula does (bfloat16's store has a
    # nan branch of its own), and a finite value everywhere else.
    bits16 = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    special = bits16[~np.isfinite(bits16.view(dtype).astype(np.float32))]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((special.size, 2, 16)).astype(dtype)
    x[:, 0, 0] = special.view(dtype)
    x[:, 1, 3] = special.view(dtype)
    pos = rng.integers(0, 1000, size=(special.size, 2))
    for style in ("interleaved", "half"):
        rope = ar.RoPE(16, style=style)
        out = poisoned(x.shape, dtype)
        (y,) = run_launcher(_host_launcher(host_kernels), rope, (x,), pos, outs=(out,))
        got, expected = y.astype(np.float64), oracle(x, pos, style=style)
        assert (np.isnan(got) == np.isnan(expected)).all()
        assert (got[np.isinf(expected)] == expected[np.isinf(expected)]).all()
        assert np.isfinite(got[np.isfinite(expected)]).all()
