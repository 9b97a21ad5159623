"""The CUDA C source of the CuPy backend: it compiles for Ampere and Hopper, warnings as
errors, and, compiled for the host, it runs and matches the oracle.

nvcc is on the build machines, g++ on most; where either is missing its tests skip, naming it.
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

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
from host_cuda import run_kernel
from hypothesis import given, settings
from hypothesis import strategies as st

import arrayrope as ar
from arrayrope.backends.cuda.cupy import FUSED_NAMES, KERNEL_NAMES, OPTIONS, SOURCE
from arrayrope.scaling import YaRN

ENTRIES = set(KERNEL_NAMES) | set(FUSED_NAMES)  # the rotation's and the fused step's
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
    assert entries == ENTRIES
    # And to machine code, which checks register and resource limits too (the same on both
    # architectures: one build of it is enough)
    if arch == "sm_90":
        cubin = _nvcc(arch, "--cubin", source, tmp_path / "rope.cubin")
        assert cubin.returncode == 0, cubin.stderr


def _nvrtc():
    """cuda.bindings' NVRTC, or a skip naming what is missing."""
    try:
        from cuda.bindings import nvrtc

        nvrtc.nvrtcVersion()
    except Exception as error:  # the module, or the library it loads
        pytest.skip(f"NVRTC is not available: {type(error).__name__}: {str(error)[:150]}")
    return nvrtc


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_compiles_with_nvrtc_as_cupy_does(arch):
    # CuPy's RawModule compiles the source with NVRTC and the launcher's options, not nvcc,
    # and appends -ftz=true to them: no float arithmetic may be flushed all the same
    nvrtc = _nvrtc()
    _, program = nvrtc.nvrtcCreateProgram(SOURCE.encode(), b"rope.cu", 0, [], [])
    options = [o.encode() for o in (*OPTIONS, f"--gpu-architecture={arch}", "-ftz=true")]
    (result,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
    _, size = nvrtc.nvrtcGetProgramLogSize(program)
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(program, log)
    assert result == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode()
    assert log.strip(b" \x00\n") == b"", log.decode()  # not even a warning
    _, size = nvrtc.nvrtcGetPTXSize(program)
    ptx = b" " * size
    nvrtc.nvrtcGetPTX(program, ptx)
    assert set(re.findall(r"\.visible \.entry (\w+)", ptx.decode())) == ENTRIES
    flushed = sorted(set(re.findall(r"\b\w+(?:\.\w+)*\.ftz\.f32\b", ptx.decode())))
    assert not flushed, f"float arithmetic flushed to zero: {flushed}"


def test_entry_points_per_dtype_and_style():
    names = set(KERNEL_NAMES)
    for dtype in ("float32", "float64", "float16", "bfloat16"):
        for style in ("interleaved", "half"):
            assert f"rope_{dtype}_{style}" in names  # element-wise: any alignment
    # Vector entry points: P pairs a lane, one access of at most 16 bytes
    assert {"rope_float32_interleaved_v2", "rope_float32_half_v4", "rope_float16_half_v4"} <= names
    assert not {"rope_float32_interleaved_v4", "rope_float64_half_v4"} & names
    for name in KERNEL_NAMES:
        assert f"ROPE_ENTRY({name}," in SOURCE
    for dtype in ("float32", "float64", "float16", "bfloat16"):  # the fused step's
        for style in ("interleaved", "half"):
            assert {f"fused_{dtype}_{style}", f"fused_{dtype}_{style}_fp8"} <= set(FUSED_NAMES)
    for name in FUSED_NAMES:
        assert f"FUSED_ENTRY({name}," in SOURCE


def _host_place(key, host):
    return host() if callable(host) else host


def _host_launcher(library, launched=None):
    """The CuPy launcher's packing (launch_plan), run by the host build of the source; the
    names of the entry points it ran are appended to ``launched``."""
    from arrayrope.backends.cuda.cupy import launch_plan

    def launch(spec, operands, cos, sin, inverse, freqs=None):
        tables = (np.ascontiguousarray(cos), np.ascontiguousarray(sin))
        flag = np.zeros(1, np.int32)
        name, grid, block, args = launch_plan(
            spec, operands, tables, inverse, freqs, flag, _host_place
        )
        run_kernel(library, name, grid, block, args, lambda a: a.ctypes.data)
        if launched is not None:
            launched.append(name)
        if flag[0]:
            raise ar.RopeValueError("pos holds values that are negative or 2**31 or more")

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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", ["interleaved", "half"])
@pytest.mark.parametrize("d, rotary_dim", [(64, 64), (128, 128), (256, 256), (160, 128)])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "unaligned", "sectioned"])
def test_source_on_the_host_vector_entry_points(host_kernels, dtype, style, d, rotary_dim, layout):
    # Lanes take P pairs as one access where every row is aligned: each vector entry point
    # against the oracle, and the element-wise one where a row is not aligned.
    rng = np.random.default_rng()
    big = random_array(rng, (3, 6, d + 2), dtype)
    x = {
        "contiguous": big[..., :d],  # rows d + 2 apart: aligned only for some dtypes
        "strided": big[::-2, ::-1, 2:],  # starts 4 bytes in at least
        "unaligned": big[:, :, 1 : d + 1],  # odd element offset: element-wise
        "sectioned": big[..., :d],
    }[layout]
    x = np.ascontiguousarray(x) if layout == "contiguous" else x
    if layout == "sectioned":
        quarter = rotary_dim // 8  # sections that end inside a lane's P pairs
        sections = (quarter + 1, quarter - 1, 2 * quarter)
        rope = ar.RoPE.sectioned(d, sections, style=style, rotary_dim=rotary_dim)
        pos = rng.integers(0, 10**5, size=(6, 3))
        expected = rope.rotate(x.astype(np.float64), pos)
    else:
        rope = ar.RoPE(d, style=style, rotary_dim=rotary_dim)
        pos = rng.integers(0, 10**6, size=6)
        expected = oracle(x, pos, style=style, rotary_dim=rotary_dim)
    out = poisoned(x.shape, dtype)
    launched = []
    (y,) = run_launcher(_host_launcher(host_kernels, launched), rope, (x,), pos, outs=(out,))
    assert_matches(y, expected, x)
    np.testing.assert_array_equal(bits(y[..., rotary_dim:]), bits(x[..., rotary_dim:]))
    (name,) = launched
    if layout == "unaligned":
        assert name == f"rope_{dtype.name}_{style}"
    elif layout == "contiguous":
        # The widest access of at most 16 bytes that leaves no lane without pairs
        per_pair = 1 if style == "half" else 2
        p = max(
            p
            for p in (1, 2, 4)
            if p * per_pair * dtype.itemsize <= 16 and (p == 1 or rotary_dim // 2 >= 32 * p)
        )
        assert name == f"rope_{dtype.name}_{style}" + ("" if p * per_pair == 1 else f"_v{p}")


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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", ["interleaved", "half"])
@pytest.mark.parametrize("layout", ["one axis", "sectioned"])
def test_source_on_the_host_rows_past_the_table_and_invalid_positions(
    host_kernels, dtype, style, layout
):
    # Device positions reach the kernel unchecked: past the table's rows it makes a row itself
    # from the level tables, operation for operation as the CPU does (the same bits, float64
    # too); an invalid one gives NaN for the pairs that read it, and sets the error flag.
    rng = np.random.default_rng()
    if layout == "one axis":
        rope = ar.RoPE(16, rotary_dim=12, style=style, max_positions=8)
        idx = np.array([[3], [8], [123456], [2**31 - 1]])
        bad = np.array([[3], [-1], [2**31], [5]])
    else:
        rope = ar.RoPE.sectioned(16, (2, 3, 3), style=style, max_positions=8)
        idx = np.array([[3, 9, 1], [8, 2, 70000], [123456, 0, 7], [2**31 - 1, 5, 6]])
        bad = np.array([[3, 1, 2], [3, -1, 2], [3, 2**31, 2], [1, 2, 3]])
    x = random_array(rng, (4, 16), dtype)
    freqs = rope._engine.freq_set(None).tables
    compute = np.float64 if dtype == np.float64 else np.float32
    table = freqs.cached(np, None, compute, 7)
    launch = _host_launcher(host_kernels)
    out = poisoned(x.shape, x.dtype)
    launch(rope._spec, [(x, out, idx)], table[0], table[1], False, freqs=freqs)
    cpu = rope.rotate(x, idx if layout == "sectioned" else idx[:, 0])
    np.testing.assert_array_equal(bits(out), bits(cpu))
    out = poisoned(x.shape, x.dtype)
    with pytest.raises(ar.RopeValueError, match="negative or 2\\*\\*31"):
        launch(rope._spec, [(x, out, bad)], table[0], table[1], False, freqs=freqs)
    nan, r = np.isnan(out.astype(np.float32)), rope.rotary_dim
    assert not nan[[0, 3]].any() and nan[1:3].any() and not nan[:, r:].any()
    reads_bad = nan[1:3].any(axis=0)  # the same features in both rows: an axis's pairs
    assert (nan[1:3] == reads_bad).all()
    if layout == "sectioned":
        assert reads_bad.sum() == 6  # axis 1's three pairs
    else:
        assert reads_bad[:r].all()


DIGIT_EDGES = [0, 2047, 2048, 2**22 - 1, 2**22, 2**22 + 2047, 2**31 - 1]


@settings(max_examples=15)
@given(
    st.lists(st.one_of(st.sampled_from(DIGIT_EDGES), st.integers(0, 2**31 - 1)), min_size=1,
             max_size=9),
    st.sampled_from(DTYPES),
    st.sampled_from(["interleaved", "half"]),
    st.sampled_from([None, YaRN(8.0, 4096)]),
    st.integers(0, 2**32 - 1),
)  # fmt: skip
def test_source_on_the_host_rows_past_the_table_are_the_cpus(
    host_kernels, positions, dtype, style, rule, seed
):
    # Positions across the whole range, at the level tables' digit edges and anywhere: the
    # device's rows past its table are the CPU's rows, to the bit, in every dtype.
    rng = np.random.default_rng(seed)
    rope = ar.RoPE(16, style=style, scaling=rule, max_positions=8)
    x = random_array(rng, (len(positions), 16), dtype)
    idx = np.array(positions)[:, None]
    freqs = rope._engine.freq_set(None).tables
    table = freqs.cached(np, None, np.float64 if dtype == np.float64 else np.float32, 7)
    out = poisoned(x.shape, x.dtype)
    _host_launcher(host_kernels)(
        rope._spec, [(x, out, idx)], table[0], table[1], False, freqs=freqs
    )
    np.testing.assert_array_equal(bits(out), bits(rope.rotate(x, idx[:, 0])))


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


@st.composite
def kernel_calls(draw):
    """A rotate or rotate_qk call on strided views, as the CuPy launcher would get it."""
    d = draw(st.sampled_from([4, 16, 64, 128, 256]))  # vector entry points from 64 on
    lead = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    return {
        "dtype": draw(st.sampled_from(DTYPES)),
        "style": draw(st.sampled_from(["interleaved", "half"])),
        "d": d,
        "rotary_dim": draw(st.one_of(st.just(d), st.integers(1, d // 2).map(lambda n: 2 * n))),
        "lead": lead,
        "steps": [draw(st.sampled_from([1, 2, -1, -3])) for _ in lead],
        "pad": (pad := draw(st.sampled_from([0, 8]))),  # rows of d + pad elements
        "offset": draw(st.integers(0, min(pad, 3))),  # where the features start in each row
        "positions": draw(st.sampled_from(["int", "last axis", "every row", "float"])),
        "inverse": draw(st.booleans()),
        "out": draw(st.sampled_from(["fresh", "in place", "strided"])),
        "k_heads": draw(st.integers(0, 3)),  # 0: rotate; else rotate_qk with k of these heads
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


def _strided_view(rng, c, poison=False):
    """An array of shape lead + (d,) viewing a larger one (random, or all nan) with the call's
    steps and offset."""
    base_shape = [n * abs(s) for n, s in zip(c["lead"], c["steps"])] + [c["d"] + c["pad"]]
    if poison:
        base = poisoned(base_shape, c["dtype"])
    else:
        base = random_array(rng, base_shape, c["dtype"])
    view = base[tuple(slice(None, None, s) for s in c["steps"])]
    return view[..., c["offset"] : c["offset"] + c["d"]]


@given(kernel_calls())
def test_source_on_the_host_matches_the_cpu_kernel_on_any_layout(host_kernels, c):
    # The CUDA source's entry points (element-wise and vector), row decoding and q/k split,
    # over random strides, alignments, head dims, positions and outputs: within the dtype's
    # bound of the float64 oracle, and half types bit for bit with the CPU kernel.
    rng = np.random.default_rng(c["seed"])
    lead, kw = c["lead"], {"style": c["style"], "rotary_dim": c["rotary_dim"]}
    xs = [_strided_view(rng, c)]
    if c["k_heads"]:
        k_lead = [c["k_heads"], *lead[1:]] if len(lead) > 1 else lead
        xs.append(random_array(rng, k_lead + [c["d"]], c["dtype"]))
    pos = {
        "int": int(rng.integers(0, 2**31 - 1)),
        "last axis": rng.integers(0, 10**6, lead[-1:]),
        "every row": rng.integers(0, 10**6, lead) if len(xs) == 1 else rng.integers(0, 9, 1),
        "float": rng.random(lead[-1:]) * 1e5,
    }[c["positions"]]
    originals = [x.copy() for x in xs]
    if c["out"] == "in place":
        outs = tuple(xs)
    elif c["out"] == "strided":
        outs = tuple(
            _strided_view(rng, c, poison=True) if i == 0 else poisoned(x.shape, x.dtype)
            for i, x in enumerate(xs)
        )
    else:
        outs = tuple(poisoned(x.shape, x.dtype) for x in xs)
    rope = ar.RoPE(c["d"], **kw)
    got = run_launcher(_host_launcher(host_kernels), rope, xs, pos, inverse=c["inverse"], outs=outs)
    for x, y in zip(originals, got):
        expected = oracle(x, pos, inverse=c["inverse"], **kw)
        assert_matches(y, expected, x)
        np.testing.assert_array_equal(
            bits(y[..., c["rotary_dim"] :]), bits(x[..., c["rotary_dim"] :])
        )
        if c["dtype"].itemsize == 2:  # one rounding of the same float32 value as the CPU's
            cpu = ar.rotate(x, pos, inverse=c["inverse"], **kw)
            np.testing.assert_array_equal(bits(y), bits(cpu))


MISALIGNED_LAUNCH = """
import ctypes, sys
import numpy as np
from host_cuda import run_kernel

library = ctypes.CDLL(sys.argv[1])
raw = np.zeros(4096, np.uint8)
odd = raw[2:2 + 64 * 4].view(np.float32)  # float32 two bytes off
table = np.zeros((4, 32), np.float32)
g = np.zeros((2, 4, 2), np.int64)
g[0, 0, 0], g[0, 1, 0], g[0, 2, 0] = 1, 64, 64
args = (odd, odd, np.zeros(1, np.int64), odd, odd, np.zeros(1, np.int64), g, np.int32(1),
        table, table, np.int64(4), np.zeros(32, np.int32), np.zeros(32), np.zeros((2, 1, 1)),
        np.float64(1.0),
        np.zeros(1, np.int32), np.int32(64), np.int32(64), np.float32(1.0), np.int32(0),
        np.int64(1), np.int64(0))
run_kernel(library, "rope_float32_interleaved", (1,), (32, 8), args, lambda a: a.ctypes.data)
print("no fault")
"""


def test_the_host_build_faults_on_a_misaligned_access(host_kernels):
    # what a device raises (CUDA_ERROR_MISALIGNED_ADDRESS) the host build's sanitizer does too
    done = subprocess.run(
        [sys.executable, "-c", MISALIGNED_LAUNCH, host_kernels._name],
        cwd=Path(__file__).parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "no fault" not in done.stdout
    assert "misaligned address" in done.stderr
