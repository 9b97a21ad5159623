"""The numba.cuda kernels: under Numba's CUDA simulator here, on the GPU where there is one.

Small shapes: the simulator runs every GPU thread as a Python thread.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import BF16, DTYPES, GPU_PRESENT, assert_matches, oracle, poisoned, run_launcher

import arrayrope as ar

cuda = pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")
if not GPU_PRESENT and not cuda.is_available():
    pytest.skip("numba.cuda is neither simulated nor backed by a GPU", allow_module_level=True)

from arrayrope.backends.cuda import numba as cuda_numba  # noqa: E402

if GPU_PRESENT:
    xp = pytest.importorskip("cupy", reason="GPU numba-cuda tests take CuPy arrays")
else:
    xp = np


def _to_host(a):
    return a if xp is np else a.get()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", ["interleaved", "half"])
@pytest.mark.parametrize("rotary_dim", [8, 12])
@pytest.mark.parametrize("inverse", [False, True])
def test_matches_oracle(dtype, style, rotary_dim, inverse):
    rng = np.random.default_rng()
    x = rng.standard_normal((2, 3, 12)).astype(dtype)
    pos = rng.integers(0, 10**6, size=3)
    rope = ar.RoPE(12, style=style, rotary_dim=rotary_dim)
    out = xp.asarray(poisoned(x.shape, dtype))
    (y,) = run_launcher(
        cuda_numba.launch, rope, (xp.asarray(x),), pos, inverse=inverse, outs=(out,), xp=xp
    )
    expected = oracle(x, pos, style=style, rotary_dim=rotary_dim, inverse=inverse)
    assert_matches(_to_host(y), expected, x)
    reference = ar.rotate(x, pos, style=style, rotary_dim=rotary_dim, inverse=inverse)
    tail = _to_host(y)[..., rotary_dim:]
    np.testing.assert_array_equal(tail.view(np.uint8), x[..., rotary_dim:].view(np.uint8))
    if dtype != np.float64:  # float32 arithmetic either way: at most one rounding apart
        got = _to_host(y).astype(np.float64)
        np.testing.assert_allclose(
            got, reference.astype(np.float64), rtol=0, atol=float(np.abs(x).max()) * 2.0**-7
        )


@pytest.mark.parametrize("layout", ["reverse", "fused", "features", "inplace", "float-pos"])
def test_layouts(layout):
    rng = np.random.default_rng()
    big = rng.standard_normal((3, 4, 5, 16)).astype(np.float32)
    pos = rng.integers(0, 5000, size=(4, 1))
    rope = ar.RoPE(8, style="half")
    if layout == "reverse":
        view = big[1, ::-1, ::-2, :8]
    elif layout == "fused":
        view = big[:2, :, 1, 8:]
        pos = rng.integers(0, 5000, size=(1, 4))
    elif layout == "features":
        view = big[0, :, :3, ::2]
    else:
        view = big[2, :, :2, :8]
    if layout == "float-pos":
        pos = rng.random((4, 1)) * 1e5
    host = np.ascontiguousarray(view)
    expected = ar.rotate(host, pos, style="half")
    device = xp.asarray(big)
    dview = {
        "reverse": lambda b: b[1, ::-1, ::-2, :8],
        "fused": lambda b: b[:2, :, 1, 8:],
        "features": lambda b: b[0, :, :3, ::2],
    }.get(layout, lambda b: b[2, :, :2, :8])(device)
    outs = (dview,) if layout == "inplace" else None
    (y,) = run_launcher(cuda_numba.launch, rope, (dview,), pos, outs=outs, xp=xp)
    np.testing.assert_allclose(_to_host(y), expected, rtol=0, atol=2e-6)


def test_rotate_qk_grouped_heads_in_one_launch():
    rng = np.random.default_rng()
    q = rng.standard_normal((4, 3, 8)).astype(np.float32)
    k = rng.standard_normal((2, 3, 8)).astype(np.float32)
    pos = rng.integers(0, 10**5, size=3)
    rope = ar.RoPE(8)
    qr, kr = run_launcher(cuda_numba.launch, rope, (xp.asarray(q), xp.asarray(k)), pos, xp=xp)
    np.testing.assert_allclose(_to_host(qr), ar.rotate(q, pos), rtol=0, atol=2e-6)
    np.testing.assert_allclose(_to_host(kr), ar.rotate(k, pos), rtol=0, atol=2e-6)


def test_multi_axis_positions():
    rng = np.random.default_rng()
    rope = ar.RoPE.sectioned(16, (2, 3, 3), style="half")
    x = rng.standard_normal((5, 16)).astype(np.float32)
    pos = rng.integers(0, 1000, size=(5, 3))
    (y,) = run_launcher(
        cuda_numba.launch, rope, (xp.asarray(x),), xp.asarray(pos) if xp is not np else pos, xp=xp
    )
    np.testing.assert_allclose(_to_host(y), rope.rotate(x, pos), rtol=0, atol=2e-6)


# The simulator runs the kernels as Python, so it cannot show that Numba's CUDA compiler takes
# them. This compiles each one to PTX in a process without the simulator, where NVRTC and NVVM
# can be found (a CUDA toolkit, or the nvidia-* wheels of numba-cuda[cu12]/[cu13]).
COMPILE_EVERY_KERNEL = """
import sys
import numpy as np
from numba import cuda, types
from arrayrope.backends.cuda import numba as cuda_numba

def signature(storage, compute):
    data, rows = types.Array(storage, 1, "C"), types.Array(types.int64, 1, "C")
    table = types.Array(compute, 2, "C")
    return (data, data, rows, data, data, rows, types.Array(types.int64, 3, "C"), table, table,
            rows, types.Array(types.float64, 1, "C"), types.Array(types.float64, 3, "C"),
            types.float64,
            types.Array(types.int32, 1, "C"), types.int64, types.int64, compute, types.int64,
            types.int64, types.int64)

cases = [(False, np.float32, types.float16, types.float32),
         (False, np.float32, types.float32, types.float32),
         (False, np.float64, types.float64, types.float64),
         (True, np.float32, types.uint16, types.float32)]
try:
    cuda.compile_ptx(lambda a: None, "void(float32[::1])", cc=(8, 0))
except Exception as error:  # no NVRTC or NVVM here
    print("MISSING", type(error).__name__, str(error).splitlines()[0][:200])
    sys.exit(0)
for bf16_bits, compute, storage, compute_type in cases:
    for half_style in (False, True):
        kernel = cuda_numba._kernel(bf16_bits, half_style, compute)
        for cc in ((8, 0), (9, 0)):
            ptx, _ = cuda.compile_ptx(kernel.py_func, signature(storage, compute_type), cc=cc)
            assert ".entry" in ptx
            # no product fused into a sum: the CPU's bits (see cuda_numba._products)
            assert "fma.rn.f" not in ptx, "a contracted FMA"
print("COMPILED", len(cases) * 2 * 2)
"""


def test_kernels_compile_for_ampere_and_hopper():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_EVERY_KERNEL],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    if done.stdout.startswith("MISSING"):
        pytest.skip(f"Numba's CUDA compiler cannot run here: {done.stdout.strip()}")
    assert "COMPILED 16" in done.stdout


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", ["interleaved", "half"])
def test_rows_past_the_table_and_invalid_positions(dtype, style):
    # Device positions reach the kernel unchecked: past the table it makes the rows itself
    # from the level tables, as the CPU does (the CPU's bits in every dtype: no product is
    # fused into a sum on a GPU either), and an invalid one gives NaN and sets the error flag
    # (raised here at once).
    rng = np.random.default_rng()
    rope = ar.RoPE(16, rotary_dim=12, style=style, max_positions=8)
    x = rng.standard_normal((4, 16)).astype(dtype)
    freqs = rope._engine.freq_set(None).tables
    compute = np.float64 if dtype == np.float64 else np.float32
    table = freqs.cached(np, None, compute, 7)
    idx = np.array([[3], [2**22 + 2047], [123456], [2**31 - 1]])
    out = poisoned(x.shape, x.dtype)
    operands = [(xp.asarray(x), xp.asarray(out), xp.asarray(idx))]
    cuda_numba.launch(
        rope._spec, operands, xp.asarray(table[0]), xp.asarray(table[1]), False, freqs=freqs
    )
    got, cpu = _to_host(operands[0][1]), rope.rotate(x, idx[:, 0])
    if xp is np:
        np.testing.assert_array_equal(got.view(np.uint8), cpu.view(np.uint8))
    else:
        ulp = 2.0**-7 if dtype == BF16 else float(np.finfo(dtype).eps)
        atol = 2 * ulp * float(np.abs(x.astype(np.float64)).max())
        np.testing.assert_allclose(got.astype(np.float64), cpu.astype(np.float64), atol=atol)
    if xp is np:
        bad = [(x, poisoned(x.shape, x.dtype), np.array([[3], [-1], [2**31], [5]]))]
        with pytest.raises(ar.RopeValueError, match="negative or 2\\*\\*31"):
            cuda_numba.launch(rope._spec, bad, table[0], table[1], False, freqs=freqs)
        got = bad[0][1]
        assert np.isnan(got[1:3, :12].astype(np.float32)).all()
        assert not np.isnan(got[[0, 3]].astype(np.float32)).any()
