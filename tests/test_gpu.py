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
