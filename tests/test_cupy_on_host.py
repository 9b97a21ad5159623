"""The CuPy backend end to end through the public API, without a GPU.

``fake_cupy`` stands in for CuPy: device arrays in host memory that keep CuPy's rules (a current
device, no implicit host copies), and kernel launches that run the backend's CUDA C source
compiled for the host. So everything between ``arrayrope.rotate(cupy_array)`` and the kernel is
exercised here: dispatch, position checks on device positions, the per-device tables, the
launcher's packing and device caches, outputs and errors. tests/test_gpu.py repeats the
numerical checks with the real CuPy on a GPU.
"""

import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from conftest import BF16, DTYPES, GPU_PRESENT, assert_matches, bits, oracle, random_array

import arrayrope as ar
from arrayrope.scaling import DynamicNTK, YaRN

if GPU_PRESENT:
    pytest.skip(
        "a GPU is present: tests/test_gpu.py runs the CuPy backend on it", allow_module_level=True
    )

import fake_cupy  # noqa: E402


@pytest.fixture
def cp(host_kernels):
    with fake_cupy.installed(host_kernels) as cupy:
        yield cupy


def _launches(cp):
    return [name for module in cp.modules for name in module.launches]


@pytest.mark.parametrize("backend", ["cupy", "numpy"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", ["interleaved", "half"])
@pytest.mark.parametrize("rotary_dim", [16, 12])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("positions", ["int", "array", "large", "float", "none", "device"])
def test_matches_oracle(cp, rng, backend, dtype, style, rotary_dim, inverse, positions):
    x = random_array(rng, (2, 3, 5, 16), dtype)
    pos = {
        "int": int(rng.integers(0, 10**6)),
        "array": rng.integers(0, 4096, 5),
        "large": rng.integers(0, 2**31 - 1, (2, 1, 5)),  # past the cache: exact rows
        "float": rng.random(5) * 1e5,
        "none": None,
        "device": cp.asarray(rng.integers(0, 10**6, (5,))),
    }[positions]
    kw = {"style": style, "rotary_dim": rotary_dim, "inverse": inverse}
    dx = cp.asarray(x)
    out = cp.full(x.shape, np.nan, dtype=dtype)  # poisoned: unwritten elements stay nan
    y = ar.rotate(dx, pos, out=out, backend=backend, **kw)
    assert y is out
    host_pos = pos.get() if isinstance(pos, cp.ndarray) else pos
    assert_matches(y.get(), oracle(x, host_pos, **kw), x)
    np.testing.assert_array_equal(bits(y.get()[..., rotary_dim:]), bits(x[..., rotary_dim:]))
    np.testing.assert_array_equal(bits(dx.get()), bits(x))  # x untouched
    fresh = ar.rotate(dx, pos, backend=backend, **kw)
    assert isinstance(fresh, cp.ndarray) and fresh.dtype == dtype and fresh.device.id == 0
    np.testing.assert_array_equal(bits(fresh.get()), bits(y.get()))
    launched = _launches(cp)
    assert len(launched) == (2 if backend == "cupy" else 0)
    assert all(name.startswith(f"rope_{dtype.name}_{style}") for name in launched)


def test_half_types_round_like_the_cpu_kernel(cp, rng):
    for dtype in (np.dtype(np.float16), BF16):
        x = random_array(rng, (4, 7, 16), dtype)
        pos = rng.integers(0, 10**5, 7)
        got = ar.rotate(cp.asarray(x), pos, style="half").get()
        np.testing.assert_array_equal(bits(got), bits(ar.rotate(x, pos, style="half")))


def test_fused_qkv_views_in_place_in_one_launch(cp, rng):
    qkv = rng.standard_normal((2, 17, 3, 8, 16)).astype(np.float32)
    d = cp.asarray(qkv)
    q, k = d[:, :, 0], d[:, :, 1]
    pos = np.arange(17)[:, None]
    qr, kr = ar.rotate_qk(q, k, pos, out=(q, k), style="half")
    assert qr is q and kr is k
    assert _launches(cp) == ["rope_float32_half"]  # q and k in one launch (d=16: element-wise)
    np.testing.assert_allclose(q.get(), oracle(qkv[:, :, 0], pos, style="half"), atol=2e-6)
    np.testing.assert_allclose(k.get(), oracle(qkv[:, :, 1], pos, style="half"), atol=2e-6)
    np.testing.assert_array_equal(d[:, :, 2].get(), qkv[:, :, 2])  # v untouched


def test_grouped_query_heads_and_any_strides(cp, rng):
    q = cp.asarray(rng.standard_normal((2, 8, 9, 16)).astype(np.float32))
    k = cp.asarray(rng.standard_normal((2, 2, 9, 16)).astype(np.float32))
    pos = rng.integers(0, 5000, (2, 1, 9))
    qr, kr = ar.rotate_qk(q, k, pos)
    np.testing.assert_allclose(qr.get(), ar.rotate(q.get(), pos), rtol=0, atol=2e-6)
    np.testing.assert_allclose(kr.get(), ar.rotate(k.get(), pos), rtol=0, atol=2e-6)
    big = cp.asarray(rng.standard_normal((3, 4, 6, 32)).astype(np.float32))
    for view in (big[::-1, 1:, ::2, :16], big[:, :, :, 16:], big[0, :, :, ::2]):
        host = np.ascontiguousarray(view.get())
        got = ar.rotate(view, np.arange(view.shape[-2]))
        np.testing.assert_allclose(got.get(), ar.rotate(host), rtol=0, atol=2e-6)


def test_multi_axis_and_scaled_ropes(cp, rng):
    rope = ar.RoPE.sectioned(16, (2, 3, 3), style="half")
    x = rng.standard_normal((5, 16)).astype(np.float32)
    pos = rng.integers(0, 1000, (5, 3))
    got = rope.rotate(cp.asarray(x), cp.asarray(pos))
    np.testing.assert_allclose(got.get(), rope.rotate(x, pos), rtol=0, atol=2e-6)
    x = rng.standard_normal((3, 80, 16)).astype(np.float32)
    for rule in (YaRN(4.0, 64), DynamicNTK(2.0, 32)):  # the second's tables follow the length
        scaled = ar.RoPE(16, scaling=rule)
        got = scaled.rotate(cp.asarray(x))
        np.testing.assert_allclose(got.get(), scaled.rotate(x), rtol=0, atol=2e-6)


def test_cos_sin_on_the_device(cp, rng):
    rope = ar.RoPE(16)
    pos = rng.integers(0, 3000, (2, 5))
    like = cp.zeros((1, 16), np.float32)
    cos, sin = rope.cos_sin(pos, like=like)
    assert isinstance(cos, cp.ndarray) and cos.dtype == np.float32 and cos.shape == (2, 5, 8)
    expected_cos, expected_sin = rope.cos_sin(pos)
    np.testing.assert_array_equal(cos.get(), expected_cos)
    np.testing.assert_array_equal(sin.get(), expected_sin)


def test_second_device_keeps_its_own_tables_kernels_and_results(cp, rng):
    x = rng.standard_normal((4, 3, 16)).astype(np.float32)
    rope = ar.RoPE(16)
    with cp.cuda.Device(1):
        on_one = cp.asarray(x)
    # Called with device 0 current: the work must follow x to device 1.
    y = rope.rotate(on_one, np.arange(3))
    assert y.device.id == 1
    np.testing.assert_allclose(y.get(), rope.rotate(x, np.arange(3)), rtol=0, atol=2e-6)
    assert [m.device for m in cp.modules] == [1]
    assert (1, np.dtype(np.float32)) in rope._freq_set(None).tables._tables
    y0 = rope.rotate(cp.asarray(x), np.arange(3))
    assert y0.device.id == 0 and [m.device for m in cp.modules] == [1, 0]
    with pytest.raises(ar.RopeValueError, match="q is on device 0, k on device 1"):
        rope.rotate_qk(cp.asarray(x), on_one)
    with pytest.raises(ar.RopeValueError, match="out is on device 0, x on device 1"):
        rope.rotate(on_one, out=cp.empty(x.shape, np.float32))


def test_cos_sin_on_another_device(cp, rng):
    rope = ar.RoPE(16)
    with cp.cuda.Device(1):
        like = cp.zeros((1, 16), np.float32)
        x = cp.asarray(rng.standard_normal((3, 16)).astype(np.float32))
    cos, sin = rope.cos_sin(np.arange(3), like=like)  # device 0 current
    assert cos.device.id == 1 and sin.device.id == 1
    assert rope.rotate(x, np.arange(3)).device.id == 1  # the tables it kept are on device 1


@pytest.mark.parametrize("backend", ["cupy", "numpy"])
def test_steps_copy_nothing_to_the_device(cp, rng, backend):
    # Decode steps (a new int position each) and repeated default positions find everything
    # they need on the device already: a copy from the host would cost microseconds and wait.
    rope = ar.RoPE(128)
    x = cp.asarray(rng.standard_normal((1, 32, 1, 128)).astype(np.float32))
    out = cp.empty(x.shape, np.float32)
    rope.rotate(x, 0, out=out, backend=backend)
    rope.rotate(x, out=out, backend=backend)
    rope.rotate_qk(x, x, 0, out=(out, cp.empty_like(x)), backend=backend)
    cp.transfers.clear()
    for step in range(1, 40):
        y = rope.rotate(x, step, out=out, backend=backend)
        np.testing.assert_allclose(y.get(), oracle(x.get(), step), rtol=0, atol=3e-6)
        rope.rotate(x, out=out, backend=backend)
        rope.rotate_qk(x, x, step, out=(out, cp.empty_like(x)), backend=backend)
    assert cp.transfers == []
    rope.rotate(x, np.array([7]), out=out, backend=backend)  # one host position: a table row
    assert cp.transfers == []
    rows = cp.asarray(rng.standard_normal((1, 32, 2, 128)).astype(np.float32))
    rope.rotate(rows, np.array([1, 2]), backend=backend)  # the layout's geometry goes once
    cp.transfers.clear()
    rope.rotate(rows, np.array([7, 9]), backend=backend)  # a host array: one queued copy
    assert cp.transfers == [((2, 1), np.dtype(np.int64), "pinned")]


BAD_POSITIONS = [
    np.array([-1, 2]),
    np.array([2**31, 2]),
    np.array([np.nan, 2.0]),
    np.array([-0.5, 2.0]),
    np.array([np.inf, 2.0]),
]


@pytest.mark.parametrize("pos", BAD_POSITIONS, ids=str)
def test_bad_device_positions_give_nan_rows_and_raise_at_the_next_call(cp, pos):
    # Checked on the device, by the kernel: the host never waits for a range check. The rows
    # of an invalid position are NaN at once, the error comes with the next call on the device.
    x = random_array(np.random.default_rng(0), (2, 3, 8), np.float32)
    out = cp.full(x.shape, 7.0, dtype=np.float32)
    dx, dpos = cp.asarray(x), cp.asarray(pos)[:, None]
    ar.rotate(dx, cp.asarray(np.zeros_like(pos))[:, None])  # compiled, tables, error flag
    cp.transfers.clear()
    assert ar.rotate(dx, dpos, out=out) is out
    assert cp.transfers == [] and cp.to_host == []  # nothing went either way
    got = out.get()
    assert np.isnan(got[0]).all()
    np.testing.assert_allclose(got[1], oracle(x[1], 2), rtol=0, atol=3e-6)
    with pytest.raises(ar.RopeValueError, match="earlier call on CUDA device 0"):
        ar.rotate(cp.asarray(x), 1, out=out)
    np.testing.assert_array_equal(out.get(), got)  # the call that raised did nothing
    ar.rotate(cp.asarray(x), 1, out=out)  # raised once: the flag is cleared
    np.testing.assert_allclose(out.get(), oracle(x, 1), rtol=0, atol=3e-6)


def test_bad_multi_axis_device_positions_give_nan_rows(cp):
    rope = ar.RoPE.axial((4, 4))
    x = random_array(np.random.default_rng(0), (3, 8), np.float32)
    pos = cp.asarray(np.array([[1, 2], [3, -4], [5, 6]]))
    got = rope.rotate(cp.asarray(x), pos).get()
    assert not np.isnan(got[[0, 2]]).any()
    assert np.isnan(got[1, 4:]).all() and not np.isnan(got[1, :4]).any()  # axis 1's pairs
    np.testing.assert_allclose(got[[0, 2]], rope.rotate(x[[0, 2]], pos.get()[[0, 2]]), atol=3e-6)
    with pytest.raises(ar.RopeValueError, match="earlier call"):
        rope.rotate(cp.asarray(x), pos)
    real = rope.rotate(cp.asarray(x), pos.astype(np.float64)).get()  # exact rows: the same
    np.testing.assert_array_equal(np.isnan(real), np.isnan(got))


@pytest.mark.parametrize("pos", BAD_POSITIONS, ids=str)
def test_bad_device_positions_for_the_reference_raise_at_once(cp, pos):
    # backend="numpy" indexes tables with array operations, which would wrap or clamp a bad
    # index: it reads the positions' range on the host first, and writes nothing on an error.
    x = cp.ones((2, 8), np.float32)
    out = cp.full((2, 8), 7.0, dtype=np.float32)
    with pytest.raises(ar.RopeValueError, match="pos must"):
        ar.rotate(x, cp.asarray(pos), out=out, backend="numpy")
    assert (out.get() == 7.0).all() and (x.get() == 1.0).all()
    assert _launches(cp) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_axes", [1, 2])
def test_device_positions_past_the_table_are_computed_by_the_kernel(cp, rng, dtype, n_axes):
    # A table of 16 rows; device positions far past it, up to 2**31 - 1: the kernel makes
    # those rows from the level tables as the CPU does, so the results are the CPU's bits.
    if n_axes == 1:
        rope = ar.RoPE(16, rotary_dim=12, max_positions=16)
    else:
        rope = ar.RoPE.axial((8, 8), max_positions=16)
    x = random_array(rng, (2, 4, 7, 16), dtype)
    values = np.array([0, 5, 15, 16, 1000, 123456789, 2**31 - 1])
    values = values if n_axes == 1 else np.stack([values, values[::-1]], -1)
    pos = cp.asarray(values)
    cp.to_host.clear()
    got = rope.rotate(cp.asarray(x), pos).get()
    assert cp.to_host == [(x.shape, x.dtype)]  # the result, fetched by the test
    cpu = rope.rotate(x, values)
    if n_axes == 1:
        assert_matches(got, oracle(x, values, rotary_dim=12), x)
    np.testing.assert_array_equal(bits(got), bits(cpu))


def test_device_positions_copy_nothing_and_wait_for_nothing(cp, rng):
    rope = ar.RoPE(128)
    x = cp.asarray(rng.standard_normal((1, 32, 1, 128)).astype(np.float32))
    out = cp.empty_like(x)
    pos = cp.asarray(np.array([4000]))
    rope.rotate(x, pos, out=out)
    rope.rotate_qk(x, x, pos)
    cp.transfers.clear()
    for step in range(4000, 4010):
        pos[...] = step  # a device-side update, as a decode loop makes
        rope.rotate(x, pos, out=out)
        rope.rotate_qk(x, x, pos)
    assert cp.transfers == [] and cp.to_host == []
    np.testing.assert_allclose(out.get(), oracle(x.get(), 4009), rtol=0, atol=3e-6)


def test_graph_capture_takes_device_and_int_positions_and_refuses_host_arrays(cp, rng):
    # A captured graph replays its copies: a host array would be copied again from a buffer
    # arrayrope reuses. Device positions are read when the graph runs; an int is a constant.
    rope = ar.RoPE(16)
    x = cp.asarray(rng.standard_normal((2, 3, 16)).astype(np.float32))
    out = cp.empty_like(x)
    pos = cp.asarray(np.array([5, 6, 7]))
    for p in (pos, 3, np.array([5, 6, 7])):
        rope.rotate(x, p, out=out)  # warm, as before any capture: tables on the device
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        rope.rotate(x, pos, out=out)
        with pytest.raises(ar.RopeValueError, match="capturing a CUDA graph"):
            rope.rotate(x, np.array([5, 6, 7]), out=out)
        graph = stream.end_capture()
    pos[...] = cp.asarray(np.array([40, 50, 60]))
    graph.launch()
    np.testing.assert_allclose(out.get(), oracle(x.get(), np.array([40, 50, 60])), atol=3e-6)


def test_staging_buffers_are_not_refilled_while_their_copy_is_queued(cp):
    # A pinned buffer goes back into use only once the copy out of it has run: with every
    # copy still queued, each upload takes a buffer of its own, up to the limit, where the
    # host waits for the oldest.
    from arrayrope.backends.cuda import _staging

    fake_cupy.Event.pending = True
    seen, waited = [], []
    for i in range(_staging._STAGED + 3):
        slots = _staging._buffers.get(0, [])
        oldest = slots[0][2] if len(slots) == _staging._STAGED else None
        got = _staging.upload(cp, 0, np.full(3, i))
        np.testing.assert_array_equal(got.get(), [i] * 3)
        seen.append(id(_staging._buffers[0][-1][0]))  # the newest copy's buffer comes last
        waited.append(oldest is not None and oldest.waited)
    slots = _staging._buffers[0]
    assert len(slots) == _staging._STAGED
    assert len(set(seen[: _staging._STAGED])) == _staging._STAGED  # a buffer each
    assert seen[_staging._STAGED :] == seen[:3]  # then the oldest, after waiting for it
    assert waited == [False] * _staging._STAGED + [True] * 3
    fake_cupy.Event.pending = False
    _staging.upload(cp, 0, np.arange(1000))  # larger than a buffer: a larger one
    assert max(slot[1] for slot in slots) == 8192
    cp.transfers.clear()
    _staging.upload(cp, 0, np.zeros(_staging._STAGE_LIMIT // 8 + 1))  # past the limit: plain
    assert cp.transfers == [((_staging._STAGE_LIMIT // 8 + 1,), np.dtype(np.float64))]


def test_decode_step(cp, rng):
    # The CPU's small-input path must not take device arrays.
    x = rng.standard_normal((1, 32, 1, 128)).astype(np.float32)
    dx = cp.asarray(x)
    got = ar.rotate(dx, 4095)
    assert isinstance(got, cp.ndarray)
    np.testing.assert_allclose(got.get(), oracle(x, 4095), rtol=0, atol=3e-6)
    assert ar.rotate(dx, 4095, out=dx) is dx
    np.testing.assert_array_equal(dx.get(), got.get())


def test_gpu_benchmark_script_runs(cp, monkeypatch):
    # bench/gpu_check.py's benchmark and table, on the stand-in: a device session must not be
    # lost to a slip in the script. A case that fails must cost its own row only: numba-cuda,
    # which cannot take the stand-in's arrays, is made to fail here on purpose.
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1]))
    from arrayrope import backends
    from bench.bench import gpu_rows
    from bench.gpu_check import table

    def broken(*args, **kwargs):
        raise RuntimeError("numba-cuda is not run on the stand-in")

    monkeypatch.setitem(backends._loaded, "numba-cuda", types.SimpleNamespace(launch=broken))
    rows = gpu_rows([(1, 2, 4, 128)], [np.float32, np.float16, BF16], repeats=2)
    assert len(rows) == 3 * 2 * 3 + 2
    for row in rows:
        if "numba-cuda" in row["op"]:
            assert row["error"] == "RuntimeError: numba-cuda is not run on the stand-in"
            assert row["ms"] is None
        else:
            assert "error" not in row and row["ms"] > 0 and row["host us"] > 0
            assert row["op"].startswith("decode") or row["of ceiling"] > 0
    entries = {
        (row["dtype"], row["style"]): row["entry"]
        for row in rows
        if row["op"] == "cupy rotate out="
    }
    assert entries == {
        (dtype, style): f"rope_{dtype}_{style}_v2"  # head_dim 128: two pairs a lane
        for dtype in ("float32", "float16", "bfloat16")
        for style in ("interleaved", "half")
    }
    text = table(rows)
    assert text.count("\n| cupy rotate out= |") == 6
    assert text.count("\nFAILED ") == 7 and "FAILED decode numba-cuda" in text


GPU_TESTS_ON_THE_STAND_IN = """
import ctypes, sys
import conftest  # the simulator switch, as in any test process
import fake_cupy
import pytest

with fake_cupy.installed(ctypes.CDLL(sys.argv[1])):
    selected = "not numba and not agree and not torch"  # numba-cuda and torch need a device
    args = ["-q", "-p", "no:cacheprovider", "-k", selected, sys.argv[2]]
    sys.exit(pytest.main(args))
"""


def test_gpu_test_file_passes_on_the_stand_in(host_kernels):
    # tests/test_gpu.py runs only where a GPU is; its CuPy-only tests run here on the
    # stand-in, so that the file itself is known to work before a device session depends on it.
    tests = Path(__file__).parent
    done = subprocess.run(
        [sys.executable, "-c", GPU_TESTS_ON_THE_STAND_IN, host_kernels._name, "test_gpu.py"],
        cwd=tests,
        env={**os.environ, "PYTHONPATH": str(tests)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout


def test_misaligned_arrays_go_through_aligned_copies(cp, rng):
    # CuPy allows a float32 view two bytes off its allocation, and int64 positions four bytes
    # off; a device's typed loads fault on them (the stand-in does too, and loses the context)
    # (CuPy's own copies fault there too, so the arrays are filled and read as bytes)
    x = rng.standard_normal((3, 4, 16)).astype(np.float32)
    pos = np.array([5, 900, 17])
    odd, odd_pos = _off_grid(cp, x, 2), _off_grid(cp, pos, 4)
    assert odd.data.ptr % 4 == 2 and odd_pos.data.ptr % 8 == 4
    expected = oracle(x, pos[:, None])
    for backend in ("cupy", "numpy"):
        got = ar.rotate(odd, odd_pos[:, None], backend=backend)
        np.testing.assert_allclose(got.get(), expected, rtol=0, atol=3e-6)
        out = _off_grid(cp, np.zeros_like(x), 2)
        assert ar.rotate(odd, odd_pos[:, None], out=out, backend=backend) is out
        np.testing.assert_allclose(_read(out), expected, rtol=0, atol=3e-6)
    in_place = _off_grid(cp, x, 2)
    ar.rotate(in_place, odd_pos[:, None], out=in_place)
    np.testing.assert_allclose(_read(in_place), expected, rtol=0, atol=3e-6)
    with pytest.raises(fake_cupy.MisalignedAddress, match="CuPy's copy"):
        odd.copy()  # the stand-in faults where a device's typed loads do
    fake_cupy._lost.clear()


def _off_grid(cp, values, shift):
    """A CuPy view of ``values`` ``shift`` bytes into its allocation, filled as bytes."""
    raw = cp.zeros(values.nbytes + shift, np.uint8)
    raw[shift:] = cp.asarray(np.ascontiguousarray(values).view(np.uint8).reshape(-1))
    return raw[shift:].view(values.dtype).reshape(values.shape)


def _read(a):
    """A contiguous CuPy array's values, read as bytes (a copy to the host, as CuPy's get)."""
    return a.view(np.uint8).get().view(a.dtype).reshape(a.shape)


def test_the_stand_in_fails_a_misaligned_launch_like_a_device(cp):
    from arrayrope.backends.cuda import cupy as backend

    function = backend._function(cp, 0, "rope_float32_interleaved")
    odd = cp.zeros(66, np.uint8)[2:].view(np.float32)
    with pytest.raises(fake_cupy.MisalignedAddress, match="MISALIGNED"):
        function(grid=(1,), block=(32, 8), args=(odd,) * 6)
    with pytest.raises(fake_cupy.MisalignedAddress, match="context is lost"):
        ar.rotate(cp.ones((2, 8), np.float32), 1)  # sticky, as on a device


def test_launches_run_on_the_current_stream(cp, rng):
    x = cp.asarray(rng.standard_normal((2, 4, 3, 16)).astype(np.float32))
    out = cp.empty_like(x)
    ar.rotate(x, 1, out=out)
    (module,) = cp.modules
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        ar.rotate(x, 2, out=out)
        ar.rotate_qk(x, x, 3)
    ar.rotate(x, 4)
    assert module.streams == [0, stream.ptr, stream.ptr, 0]


def test_operands_with_their_own_rows_past_the_cache(cp, rng):
    # q one token, k ten, past a cache of four rows: exact rows, each operand its own
    rope = ar.RoPE(8, max_positions=4)
    q = rng.standard_normal((1, 1, 8)).astype(np.float32)
    k = rng.standard_normal((1, 10, 8)).astype(np.float32)
    for backend in ("cupy", "numpy"):
        q_rot, k_rot = rope.rotate_qk(cp.asarray(q), cp.asarray(k), backend=backend)
        np.testing.assert_allclose(q_rot.get(), oracle(q), rtol=0, atol=3e-6)
        np.testing.assert_allclose(k_rot.get(), oracle(k), rtol=0, atol=3e-6)


def test_gpu_check_counts_the_traffic_of_a_decode_call(cp, monkeypatch):
    # bench/gpu_check.py's decode table, on the stand-in: every path that copies nothing
    # captures in a graph; two host positions are one queued copy, refused during capture.
    # numba-cuda cannot take the stand-in's arrays: its rows report an error.
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1]))
    from bench.gpu_check import decode_traffic

    found = decode_traffic(cp, np, calls=5)
    for name in (
        "int position, out=",
        "default positions",
        "one host position",
        "device position array",
        "device position past the table",
    ):
        assert found[name] == {"graph capture": "yes"}, (name, found[name])
    assert found["two host positions"] == {
        "to device (queued)": 1.0,
        "graph capture": "no (RopeValueError)",
    }
    assert all("error" in found[name] for name in found if name.startswith("numba-cuda"))


def test_gpu_check_times_the_fused_step(cp, monkeypatch):
    # bench/gpu_check.py's fused-step rows, on the stand-in: both steps run, write the same
    # bits, and a failing case costs its own entry
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1]))
    from bench.gpu_check import fused_steps

    found = fused_steps(cp, np, [np.float32, BF16], steps=(("prefill", 20), ("decode", 3)),
                        repeats=1)  # fmt: skip
    assert list(found) == [(s, t) for s in ("prefill", "decode") for t in ("float32", "bfloat16")]
    for times in found.values():
        assert times.get("same") == "yes", times
        assert min(times[k] for k in ("fused", "unfused", "copy")) > 0
    found = fused_steps(cp, np, [np.int32], steps=(("decode", 3),), repeats=1)
    assert "error" in found["decode", "int32"]


def test_gpu_check_sweeps_device_positions_past_the_table(cp, monkeypatch):
    # bench/gpu_check.py's position sweep, on the stand-in, and what it times is right
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1]))
    from bench.gpu_check import position_sweep

    found = position_sweep(cp, np, 8, repeats=1)
    assert list(found) == [0, 10**5, 10**6, 10**7, 2**31 - 8]
    assert all(us > 0 for us in found.values())
    rope = ar.RoPE(128)
    x = np.random.default_rng(0).standard_normal((1, 8, 8, 128), np.float32)
    pos = np.arange(2**31 - 8, 2**31)
    got = rope.rotate(cp.asarray(x), cp.asarray(pos)).get()
    np.testing.assert_array_equal(bits(got), bits(rope.rotate(x, pos)))


def test_calls_that_cannot_be_captured_are_refused_with_the_reason(cp, rng):
    # A captured graph keeps addresses: a device temporary would be freed under it, and a
    # read of the host cannot be captured at all. Such calls are refused during capture, and
    # what a capturable call reads is held for the life of the process.
    from arrayrope.backends.cuda import _capture, _flag

    rope = ar.RoPE(16)
    x = cp.asarray(rng.standard_normal((3, 16)).astype(np.float32))
    out = cp.empty_like(x)
    pos64 = cp.asarray(np.array([1, 2, 3]))
    rope.rotate(x, pos64, out=out)
    stream = cp.cuda.Stream(non_blocking=True)
    cases = [
        (lambda: rope.rotate(x, pos64.astype(np.int32), out=out), "give int64 positions"),
        (lambda: rope.rotate(x, pos64.astype(np.float64), out=out), "give int64 positions"),
        (lambda: rope.rotate(x, pos64, out=out, backend="numpy"), "backend='numpy'"),
        (lambda: rope.rotate(x, pos64, out=out, backend="numba-cuda"), "numba-cuda synchron"),
        (lambda: rope.rotate(x, pos64, out=out[:, ::-1]), "through a temporary"),
        (lambda: rope.rotate(x, 10**6, out=out), "past the table's cap"),
        (lambda: ar.RoPE(16, base=500.0).rotate(x, pos64, out=out), "make the same call once"),
        (lambda: rope.rotate(x, np.array([1, 2, 3]), out=out), "copy from the host"),
        (lambda: rope.shift(x, pos64, out=out), "shift with device deltas"),
        (lambda: rope.cos_sin(pos64, like=x), "cos_sin on a device"),
        (lambda: rope.cos_sin(np.arange(3), like=x), "cos_sin on a device"),
    ]
    with stream:
        stream.begin_capture()
        for call, message in cases:
            with pytest.raises(ar.RopeValueError, match=message):
                call()
        rope.rotate(x, pos64, out=out)
        stream.end_capture()
    # arrayrope's arrays that the graph reads are kept; the caller's are the caller's
    held = {a.data.ptr for a in _capture._held}
    table = rope._engine.freq_set(None).tables.existing(0, np.dtype(np.float32))
    assert table[0].data.ptr in held and table[1].data.ptr in held
    assert _flag.error_flag(cp, 0)[0].data.ptr in held
    assert len(held) == 7  # and the geometry, pair axes, frequencies and level tables
    assert not {x.data.ptr, out.data.ptr, pos64.data.ptr} & held
    with stream:  # a layout not seen outside capture: its geometry is not on the device
        stream.begin_capture()
        with pytest.raises(ar.RopeValueError, match="has not copied to the device"):
            rope.rotate(x[:2], pos64[:2], out=out[:2])
        stream.end_capture()


UNRAISED_AT_EXIT = """
import ctypes, sys
import numpy as np
import conftest
import fake_cupy

stand_in = fake_cupy.installed(ctypes.CDLL(sys.argv[1]))
cp = stand_in.__enter__()  # left installed until exit
import arrayrope as ar  # after the stand-in, which it takes for CuPy
x = cp.ones((2, 8), np.float32)
ar.rotate(x, cp.asarray(np.array([1, 2])))  # a good call: no warning for it
if sys.argv[2] == "bad":
    ar.rotate(x, cp.asarray(np.array([1, -2])))  # the last call: no later one raises
"""


@pytest.mark.parametrize("last", ["good", "bad"])
def test_an_error_no_call_raised_is_a_warning_at_exit(host_kernels, last):
    tests = Path(__file__).parent
    done = subprocess.run(
        [sys.executable, "-c", UNRAISED_AT_EXIT, host_kernels._name, last],
        cwd=tests,
        env={**os.environ, "PYTHONPATH": str(tests)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    warned = "no later call on that device raised the error" in done.stderr
    assert warned == (last == "bad"), done.stderr[-3000:]


def test_device_positions_grow_the_table_by_their_longest_axis(cp, rng):
    # Batched (B, T) positions: the table grows to T rows (the kernel computes any row past
    # it), not to B * T, and not to its cap.
    rope = ar.RoPE(16)
    x = cp.asarray(rng.standard_normal((8, 2, 600, 16)).astype(np.float32))
    values = np.arange(600) + 600 * np.arange(8)[:, None]  # each sequence past the last
    got = rope.rotate(x, cp.asarray(values), head_axis=1).get()
    table = rope._engine.freq_set(None).tables.existing(0, np.dtype(np.float32))
    assert 600 <= table.shape[1] < 4800
    np.testing.assert_allclose(got, rope.rotate(x.get(), values, head_axis=1), atol=3e-6)


@pytest.mark.parametrize("backend", ["cupy", "numpy"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("duplicated", [False, True], ids=["pairs", "duplicated"])
def test_apply_cos_sin_on_the_device(cp, rng, backend, dtype, duplicated):
    """The caller's tables on the device: the host's bits, by the CUDA source."""
    x = random_array(rng, (2, 3, 5, 16), dtype)
    angles = rng.uniform(-10, 10, (2, 5, 6))
    cos, sin = np.cos(angles), np.sin(angles)
    if duplicated:
        cos, sin = np.concatenate([cos, cos], -1), np.concatenate([sin, sin], -1)
    kw = dict(style="half", rotary_dim=12, head_axis=1)
    want = ar.apply_cos_sin(x, cos, sin, **kw)
    got = ar.apply_cos_sin(cp.asarray(x), cp.asarray(cos), cp.asarray(sin), backend=backend, **kw)
    assert isinstance(got, cp.ndarray)
    np.testing.assert_array_equal(bits(got.get()), bits(want))
    with pytest.raises(ar.RopeTypeError, match="cos must be an array of x's kind"):
        ar.apply_cos_sin(cp.asarray(x), cos, sin, **kw)  # host tables for a device x
    on_device = cp.asarray(x), cp.asarray(cos), cp.asarray(sin)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        with pytest.raises(ar.RopeValueError, match="cannot be captured in a CUDA graph"):
            ar.apply_cos_sin(*on_device, **kw)
        stream.end_capture()


def test_transformers_angles_read_device_positions_on_the_host(cp, rng):
    # transformers' tables have no level tables for the kernels to make rows past the table
    # from: device positions are read on the host, rows past the table made there, and the
    # results are the CPU's bits at every position
    pytest.importorskip("torch", reason="PyTorch is not installed")
    rope = ar.RoPE(16, rotary_dim=12, max_positions=16, angles="transformers")
    x = random_array(rng, (2, 4, 7, 16), np.float32)
    values = np.array([0, 5, 15, 16, 1000, 123456789, 2**31 - 1])
    got = rope.rotate(cp.asarray(x), cp.asarray(values)).get()
    np.testing.assert_array_equal(bits(got), bits(rope.rotate(x, values)))
    assert not np.isnan(got).any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize(
    "rope_kind",
    ["half", "interleaved, partial, YaRN", "sectioned", "norm and float8", "q norm", "k norm"],
)
def test_rotate_into_cache_on_the_device_is_the_cpu_step(cp, rng, dtype, layout, rope_kind):
    # The fused step's CUDA source against the NumPy step on the same values, bit for bit:
    # results and caches, positions in the table and past it, padding, in place and new
    import ml_dtypes

    n, hq, hkv = 7, 3, 2
    # with a norm, head sizes on and off the eighth: off it, the last partial sums of the
    # squares take the rest (see _fused._inverse_rms)
    d = {"norm and float8": 38, "k norm": 38}.get(rope_kind, 32)
    rope = {
        "half": lambda: ar.RoPE(d, style="half"),
        "interleaved, partial, YaRN": lambda: ar.RoPE(d, rotary_dim=12, scaling=YaRN(4.0, 64)),
        "sectioned": lambda: ar.RoPE.sectioned(d, (4, 6, 6)),
        "norm and float8": lambda: ar.RoPE(d, style="half", rotary_dim=24),
        "q norm": lambda: ar.RoPE(d, rotary_dim=24),
        "k norm": lambda: ar.RoPE(d, rotary_dim=24),
    }[rope_kind]()
    options = {}
    cache_dtype = dtype
    if rope_kind == "norm and float8":
        options = dict(q_norm=rng.uniform(0.5, 1.5, d), k_norm=rng.uniform(0.5, 1.5, d),
                       norm_eps=1e-5)  # fmt: skip
        # float8 caches beside float32 and float64 values (the two ways to the float32 the
        # rounding starts from; the half types widen to float32 as they load): each pairing
        # is a CPU build of its own, over ten seconds
        if dtype in (np.float32, np.float64):
            options.update(k_scale=0.5, v_scale=2.0)
            cache_dtype = ml_dtypes.float8_e4m3fn
    elif rope_kind.endswith(" norm"):  # one of the two: each row reads its own weight or none
        options = {rope_kind.replace(" ", "_"): rng.uniform(0.5, 1.5, d)}
    qkv = random_array(rng, (n, hq + 2 * hkv, d), dtype)
    shape = (4, 4, hkv, d) if layout == "NHD" else (4, hkv, 4, d)
    caches = [random_array(rng, shape, np.float32).astype(cache_dtype) for _ in "kv"]
    axes = () if rope.n_axes == 1 else (rope.n_axes,)
    pos = rng.integers(0, 2**31 - 1, (n, *axes))
    pos[:3] = rng.integers(0, 100, (3, *axes))  # in the table
    slots = rng.permutation(16)[:n]
    slots[1] = -1
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    host_caches = [c.copy() for c in caches]
    want = rope.rotate_into_cache(q, k, v, pos, *host_caches, slots, cache_layout=layout,
                                  **options)  # fmt: skip
    device_qkv, device_caches = cp.asarray(qkv), [cp.asarray(c) for c in caches]
    dq, dk, dv = device_qkv[:, :hq], device_qkv[:, hq : hq + hkv], device_qkv[:, hq + hkv :]
    device_options = {
        name: cp.asarray(value) if name.endswith("norm") else value
        for name, value in options.items()
    }
    for where, device_pos in (("new", pos), ("in place", cp.asarray(pos))):
        out = dq if where == "in place" else None
        got = rope.rotate_into_cache(dq, dk, dv, device_pos, *device_caches, cp.asarray(slots),
                                     out=out, cache_layout=layout, **device_options)  # fmt: skip
        assert isinstance(got, cp.ndarray) and (out is None or got is out)
        assert np.array_equal(bits(got.get()), bits(want))
        for device_cache, host_cache in zip(device_caches, host_caches):
            assert np.array_equal(bits(device_cache.get()), bits(host_cache))
    assert [name for name in _launches(cp) if name.startswith("fused")]


def test_rotate_into_cache_on_the_device_refuses_before_writing(cp, rng):
    rope = ar.RoPE(16)
    q, k, v = (cp.asarray(random_array(rng, (3, h, 16), np.float32)) for h in (2, 1, 1))
    k_cache, v_cache = (cp.asarray(np.zeros((2, 4, 1, 16), np.float32)) for _ in "kv")
    pos = np.arange(3)
    for slots, message in (([0, 9, 1], "below"), ([2, 2, 1], "distinct")):
        with pytest.raises(ar.RopeValueError, match=f"slots must be {message}"):
            rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, cp.asarray(np.array(slots)))
    with pytest.raises(ar.RopeTypeError, match="k_cache must be a NumPy array like q"):
        rope.rotate_into_cache(
            q, k, v, pos, np.zeros((2, 4, 1, 16), np.float32), v_cache, [0, 1, 2]
        )
    import ml_dtypes

    float8 = cp.asarray(np.zeros((2, 4, 1, 16), ml_dtypes.float8_e4m3fn))
    with pytest.raises(ar.RopeTypeError, match="one dtype on a GPU"):
        rope.rotate_into_cache(q, k, v, pos, k_cache, float8, [0, 1, 2], v_scale=1.0)
    inside = k_cache.reshape(-1)[:96].reshape(3, 2, 16)  # out in the key cache's memory
    with pytest.raises(ar.RopeValueError, match="k_cache and out share memory"):
        rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, [0, 1, 2], out=inside)
    assert not k_cache.get().any() and not v_cache.get().any()
    assert not [name for name in _launches(cp) if name.startswith("fused")]


def test_rotate_into_cache_on_a_second_device(cp, rng):
    # with device 0 current, a step on device 1's arrays runs there and its result lives there;
    # an array on the other device is refused by name
    rope = ar.RoPE(16, style="half")
    qkv = random_array(rng, (3, 4, 16), np.float32)
    caches = [np.zeros((2, 4, 1, 16), np.float32) for _ in "kv"]
    q, k, v = qkv[:, :2], qkv[:, 2:3], qkv[:, 3:]
    want = rope.rotate_into_cache(q, k, v, np.arange(3), *caches, np.array([0, 5, 7]))
    with cp.cuda.Device(1):
        dqkv, dcaches = cp.asarray(qkv), [cp.asarray(np.zeros_like(c)) for c in caches]
        dq, dk, dv = dqkv[:, :2], dqkv[:, 2:3], dqkv[:, 3:]
    got = rope.rotate_into_cache(dq, dk, dv, np.arange(3), *dcaches, np.array([0, 5, 7]))
    assert got.device.id == 1 and [m.device for m in cp.modules] == [1]
    assert np.array_equal(bits(got.get()), bits(want))
    assert np.array_equal(bits(dcaches[0].get()), bits(caches[0]))
    with pytest.raises(ar.RopeValueError, match="k_cache is on .* and q on"):
        rope.rotate_into_cache(dq, dk, dv, np.arange(3), cp.asarray(caches[0]), dcaches[1],
                               [0, 5, 7])  # fmt: skip
