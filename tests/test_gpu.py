"""Both GPU backends on a real GPU, against the float64 oracle and each other.

Skipped, with the reason, where CuPy or a GPU is missing (CI has neither).
"""

import numpy as np
import pytest
from conftest import BF16, DTYPES, assert_matches, oracle

import arrayrope as ar

cupy = pytest.importorskip("cupy", reason="GPU tests need CuPy")
try:
    _usable = cupy.is_available()
except Exception:  # a broken driver install reads as no GPU
    _usable = False
if not _usable:
    pytest.skip("no usable CUDA GPU", allow_module_level=True)

pytestmark = pytest.mark.gpu
BACKENDS = ["cupy", "numba-cuda"]


def _device(x):
    if x.dtype == BF16:  # CuPy may not know bfloat16: carry the bits, view them back
        return cupy.asarray(x.view(np.uint16)).view(x.dtype)
    return cupy.asarray(x)


def _host(y, dtype):
    if dtype == BF16:
        return y.view(cupy.uint16).get().view(BF16)
    return y.get()


def _bf16_supported():
    try:
        cupy.zeros(2, dtype=BF16)
        return True
    except Exception:
        return False


def _dtypes():
    return [d for d in DTYPES if d != BF16 or _bf16_supported()]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
@pytest.mark.parametrize("style", ["interleaved", "half"])
@pytest.mark.parametrize("rotary_dim", [64, 48])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("positions", ["int", "large", "float", "none", "device"])
def test_matches_oracle(backend, dtype, style, rotary_dim, inverse, positions):
    rng = np.random.default_rng()
    x = rng.standard_normal((2, 4, 33, 64)).astype(dtype)
    pos = {
        "int": rng.integers(0, 4096, 33),
        "large": rng.integers(0, 2**31 - 1, (2, 1, 33)),
        "float": rng.random(33) * 1e5,
        "none": None,
        "device": cupy.asarray(rng.integers(0, 10**6, 33)),
    }[positions]
    kw = {"style": style, "rotary_dim": rotary_dim, "inverse": inverse}
    out = cupy.full(x.shape, np.nan, dtype=x.dtype) if dtype != BF16 else None
    y = ar.rotate(_device(x), pos, out=out, backend=backend, **kw)
    assert isinstance(y, cupy.ndarray) and y.dtype == x.dtype
    host_pos = pos.get() if isinstance(pos, cupy.ndarray) else pos
    assert_matches(_host(y, dtype), oracle(x, host_pos, **kw), x)


@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
@pytest.mark.parametrize("style", ["interleaved", "half"])
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("offset", [0, 1, 2])
def test_vector_entry_points(dtype, style, d, offset):
    # The CuPy kernels' P-pairs-per-access entry points (rows 0, 1 or 2 elements in: aligned
    # for some dtypes, element-wise for the rest), against the oracle with a poisoned out.
    rng = np.random.default_rng()
    big = rng.standard_normal((3, 5, 7, d + 4)).astype(dtype)
    x = _device(big)[..., offset : offset + d]
    pos = rng.integers(0, 10**6, (5, 1))
    host_x = big[..., offset : offset + d]
    out = cupy.full(x.shape, np.nan, dtype=x.dtype) if dtype != BF16 else None
    y = ar.rotate(x, pos, style=style, out=out, backend="cupy")
    assert_matches(_host(y, dtype), oracle(host_x, pos, style=style), host_x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_inplace_and_qk(backend):
    rng = np.random.default_rng()
    qkv = rng.standard_normal((2, 17, 3, 8, 64)).astype(np.float32)
    d = cupy.asarray(qkv)
    q, k = d[:, :, 0], d[:, :, 1]
    pos = np.arange(17)[:, None]
    qr, kr = ar.rotate_qk(q, k, pos, out=(q, k), backend=backend, style="half")
    assert qr is q and kr is k
    np.testing.assert_allclose(q.get(), oracle(qkv[:, :, 0], pos, style="half"), atol=2e-5)
    np.testing.assert_allclose(k.get(), oracle(qkv[:, :, 1], pos, style="half"), atol=2e-5)
    np.testing.assert_array_equal(d[:, :, 2].get(), qkv[:, :, 2])
    rev = cupy.asarray(qkv)[::-1, ::2, 0]
    got = ar.rotate(rev, pos[::2], backend=backend)
    np.testing.assert_allclose(
        got.get(), ar.rotate(np.ascontiguousarray(rev.get()), pos[::2]), atol=2e-5
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_multi_axis_scaling_and_tables(backend):
    # The other RoPE kinds, against the CPU kernel (itself checked against the oracle).
    from arrayrope.scaling import DynamicNTK, YaRN

    rng = np.random.default_rng()
    x = rng.standard_normal((3, 80, 128)).astype(np.float32)
    ropes = [
        (ar.RoPE.sectioned(128, (16, 24, 24)), rng.integers(0, 1000, (80, 3))),
        (ar.RoPE.sectioned(128, (24, 20, 20), assign="interleaved"), rng.integers(0, 99, (80, 3))),
        (ar.RoPE(128, scaling=YaRN(4.0, 64)), None),
        (ar.RoPE(128, scaling=DynamicNTK(2.0, 32)), None),
    ]
    for rope, pos in ropes:
        device_pos = None if pos is None else cupy.asarray(pos)
        got = rope.rotate(cupy.asarray(x), device_pos, backend=backend)
        np.testing.assert_allclose(got.get(), rope.rotate(x, pos), rtol=0, atol=3e-6)
    rope = ar.RoPE(128)
    cos, sin = rope.cos_sin(np.arange(5), like=cupy.zeros(1, np.float32))
    assert isinstance(cos, cupy.ndarray)
    np.testing.assert_array_equal(cos.get(), rope.cos_sin(np.arange(5))[0])
    np.testing.assert_array_equal(sin.get(), rope.cos_sin(np.arange(5))[1])


def test_backends_agree():
    x = cupy.asarray(np.random.default_rng().standard_normal((4, 8, 64, 128)), dtype=np.float32)
    a = ar.rotate(x, backend="cupy")
    b = ar.rotate(x, backend="numba-cuda")
    cupy.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_mixing_host_and_device_is_an_error():
    x = cupy.zeros((2, 8), np.float32)
    with pytest.raises(ar.RopeTypeError, match="out must be a CuPy array"):
        ar.rotate(x, out=np.zeros((2, 8), np.float32))
    with pytest.raises(ar.RopeTypeError, match="q and k must be arrays of one kind"):
        ar.rotate_qk(x, np.zeros((2, 8), np.float32))
    with pytest.raises(ar.RopeTypeError, match="pos is a CuPy array"):
        ar.rotate(np.zeros((2, 8), np.float32), cupy.arange(2))
    with pytest.raises(ar.RopeValueError, match="backend='numba' takes NumPy arrays"):
        ar.rotate(x, backend="numba")


# ---------------------------------------------------------------- what only a device shows


@pytest.mark.parametrize("backend", BACKENDS)
def test_misaligned_views_are_rotated_not_faulted(backend):
    # a float32 view 2 bytes into an allocation, int64 positions 4 bytes in: a typed load at
    # such an address raises CUDA_ERROR_MISALIGNED_ADDRESS and loses the context (CuPy's own
    # copies too: the arrays are filled and read as bytes)
    rng = np.random.default_rng()
    x = rng.standard_normal((3, 4, 16)).astype(np.float32)
    pos = np.array([5, 900, 17])
    odd, odd_pos = _off_grid(x, 2), _off_grid(pos, 4)
    got = ar.rotate(odd, odd_pos[:, None], backend=backend)
    cupy.cuda.Device().synchronize()
    assert_matches(got.get(), oracle(x, pos[:, None]), x)
    out = _off_grid(np.zeros_like(x), 2)
    assert ar.rotate(odd, odd_pos[:, None], out=out, backend=backend) is out
    ar.rotate(odd, odd_pos[:, None], out=odd, backend=backend)
    cupy.cuda.Device().synchronize()
    for written in (out, odd):
        assert_matches(written.view(np.uint8).get().view(np.float32).reshape(x.shape),
                       oracle(x, pos[:, None]), x)  # fmt: skip


def _off_grid(values, shift):
    """A CuPy view of ``values`` ``shift`` bytes into its allocation, filled as bytes."""
    raw = cupy.zeros(values.nbytes + shift, np.uint8)
    raw[shift:] = cupy.asarray(np.ascontiguousarray(values).view(np.uint8).reshape(-1))
    return raw[shift:].view(values.dtype).reshape(values.shape)


@pytest.mark.parametrize("backend", BACKENDS)
def test_launches_follow_a_non_blocking_cupy_stream(backend):
    rng = np.random.default_rng()
    x = cupy.asarray(rng.standard_normal((2, 8, 64, 128)).astype(np.float32))
    out = cupy.zeros_like(x)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        ar.rotate(x, 7, out=out, backend=backend)
        seen = out.copy()  # queued behind the rotation on the same stream
    stream.synchronize()
    np.testing.assert_allclose(seen.get(), ar.rotate(x.get(), 7), rtol=0, atol=3e-6)


def test_torch_side_stream_out_is_ordered():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("this PyTorch has no CUDA")
    x = torch.randn(8, 32, 256, 128, device="cuda")
    out = torch.zeros_like(x)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        ar.rotate(x, 11, out=out)
        total = out.sum()  # torch's next operation on its current stream
    side.synchronize()
    expected = ar.rotate(x.cpu().numpy(), 11)
    np.testing.assert_allclose(total.item(), float(expected.sum()), rtol=1e-4)


def test_torch_cuda_graph_capture():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("this PyTorch has no CUDA")
    rope = ar.RoPE(128)
    x = torch.randn(1, 32, 1, 128, device="cuda")
    out = torch.empty_like(x)
    rope.rotate(x, 5, out=out)  # warm: kernels compiled, tables and index arrays on the device
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rope.rotate(x, 5, out=out)  # an int position: no host-device copy, no synchronization
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    np.testing.assert_allclose(out.cpu().numpy(), rope.rotate(x.cpu().numpy(), 5), atol=2e-6)


def test_device_positions_capture_in_a_cupy_graph():
    # Device positions are checked by the kernel: no copy to the host, no synchronization, so
    # the call can be captured, and a replay reads the positions as they are then. A host
    # position array is refused during capture with a clear error.
    rng = np.random.default_rng()
    rope = ar.RoPE(128)
    x = cupy.asarray(rng.standard_normal((1, 32, 2, 128)).astype(np.float32))
    out = cupy.empty_like(x)
    pos = cupy.asarray(np.array([5, 6]))
    rope.rotate(x, pos, out=out)  # warm: compiled, tables on the device
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            rope.rotate(x, pos, out=out)
            with pytest.raises(ar.RopeValueError, match="capturing a CUDA graph"):
                rope.rotate(x, np.array([5, 6]), out=out)
        finally:
            graph = stream.end_capture()
    for step in (70000, 123):  # past the table, then in it
        pos[...] = cupy.asarray(np.array([step, step + 1]))
        graph.launch(stream)
        stream.synchronize()
        expected = oracle(x.get(), np.array([step, step + 1]))
        np.testing.assert_allclose(out.get(), expected, rtol=0, atol=3e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_device_positions_give_nan_and_raise_at_the_next_call(backend):
    x = cupy.ones((3, 16), np.float32)
    pos = cupy.asarray(np.array([1, -1, 2**31]))
    got = ar.rotate(x, pos, backend=backend)
    cupy.cuda.Device().synchronize()
    host = got.get()
    assert np.isnan(host[1:]).all() and not np.isnan(host[0]).any()
    with pytest.raises(ar.RopeValueError, match="earlier call on CUDA device"):
        ar.rotate(x, 1, backend=backend)
    ar.rotate(x, 1, backend=backend)  # the flag was cleared


@pytest.mark.parametrize("backend", BACKENDS)
def test_device_positions_past_the_table(backend):
    rng = np.random.default_rng()
    rope = ar.RoPE(64, max_positions=16)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    values = np.array([3, 16, 70000, 123456789, 2**31 - 1])
    got = rope.rotate(cupy.asarray(x), cupy.asarray(values), backend=backend).get()
    np.testing.assert_array_equal(got.view(np.uint32), rope.rotate(x, values).view(np.uint32))


def test_writable_broadcast_outputs_are_refused():
    x = cupy.ones((4, 16), np.float32)
    shared = cupy.broadcast_to(cupy.zeros(16, np.float32), (4, 16))
    with pytest.raises(ar.RopeValueError, match="share memory"):
        ar.rotate(x, 1, out=shared)


def test_subnormals_and_the_cpu_bits():
    # compiled without flush-to-zero or FMA contraction: the CPU kernel's bits, subnormal
    # inputs included (nan payloads aside)
    rng = np.random.default_rng()
    x = rng.standard_normal((64, 128)).astype(np.float32)
    x[:, :8] = np.float32(1e-40)  # subnormal float32
    pos = rng.integers(0, 10**6, 64)
    for style in ("interleaved", "half"):
        gpu = ar.rotate(cupy.asarray(x), pos, style=style, backend="cupy").get()
        cpu = ar.rotate(x, pos, style=style)
        np.testing.assert_array_equal(gpu.view(np.uint32), cpu.view(np.uint32))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
def test_apply_cos_sin_matches_the_host(backend, dtype):
    rng = np.random.default_rng()
    x = rng.standard_normal((2, 4, 33, 64)).astype(dtype)
    angles = rng.uniform(-10, 10, (2, 33, 32))
    cos, sin = np.cos(angles), np.sin(angles)
    want = ar.apply_cos_sin(x, cos, sin, style="half", rotary_dim=64, head_axis=1)
    got = ar.apply_cos_sin(_device(x), cupy.asarray(cos), cupy.asarray(sin), style="half",
                           rotary_dim=64, head_axis=1, backend=backend)  # fmt: skip
    # the CuPy kernels give the host's bits; numba.cuda may contract into FMAs
    assert_matches(_host(got, dtype), want.astype(np.float64), x)


@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_rotate_into_cache_is_the_cpu_step(dtype, layout):
    # the fused step's kernel against the NumPy step's bits: q's result and both caches, with
    # a norm, positions in the table and past it, a padding token, in place
    rng = np.random.default_rng()
    n, hq, hkv, d = 9, 4, 2, 64
    rope = ar.RoPE(d, style="half", rotary_dim=48)
    qkv = rng.standard_normal((n, hq + 2 * hkv, d)).astype(dtype)
    shape = (4, 4, hkv, d) if layout == "NHD" else (4, hkv, 4, d)
    caches = [rng.standard_normal(shape).astype(dtype) for _ in "kv"]
    pos = np.concatenate([rng.integers(0, 100, 4), rng.integers(0, 2**31 - 1, n - 4)])
    slots = rng.permutation(16)[:n]
    slots[3] = -1
    weight = rng.uniform(0.5, 1.5, d)
    options = dict(cache_layout=layout, q_norm=weight, k_norm=weight[::-1].copy())
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    want = rope.rotate_into_cache(q, k, v, pos, *caches, slots, **options)
    device_qkv = _device(qkv)
    device_caches = [_device(c) for c in caches]
    dq = device_qkv[:, :hq]
    dk, dv = device_qkv[:, hq : hq + hkv], device_qkv[:, hq + hkv :]
    got = rope.rotate_into_cache(dq, dk, dv, cupy.asarray(pos), *device_caches, slots, out=dq,
                                 **options)  # fmt: skip
    assert got is dq
    assert np.array_equal(_host(got, dtype).view(np.uint8), want.view(np.uint8))
    for device_cache, host_cache in zip(device_caches, caches):
        assert np.array_equal(_host(device_cache, dtype).view(np.uint8), host_cache.view(np.uint8))
