"""Shared oracles, tolerances and options.

``oracle`` is written from the paper, independently of arrayrope: float64 angles m * theta_i,
float64 arithmetic, pairs chosen by style. ``matrix_oracle`` builds R^d_{Theta,m} of Eq. 15.
"""

import os
import shutil

# Without a GPU, numba.cuda kernels run under Numba's CUDA simulator. The switch is read when
# Numba is first imported, so it is set here, before any test module imports it.
GPU_PRESENT = os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") is not None
if not GPU_PRESENT:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 tests need ml_dtypes")


def run_launcher(launch, rope, xs, pos=None, *, inverse=False, outs=None, xp=np):
    """Rotate ``xs`` through one backend's launcher, on the API's own position and table path.

    For kernels the API cannot route NumPy arrays to (numba.cuda under the simulator).
    """
    from arrayrope import _api

    outs = tuple(xp.empty_like(x) for x in xs) if outs is None else outs
    values, is_int, high = _api._positions(rope, pos, [x.shape[:-1] for x in xs])
    dtype = _api._table_dtype(xs[0].dtype)
    device = None if xp is np else xs[0].device.id
    cos, sin, idx = _api._tables(rope, values, is_int, high, xp, device, dtype, None)
    operands, write_back = _api._kernel_operands(
        xs, outs, idx, xp, "numpy" if xp is np else "cupy", (None,) * len(xs)
    )
    launch(rope, operands, cos, sin, inverse)
    for temp, out in write_back:
        out[...] = temp
    return outs


BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]
# Bound on |result - float64 oracle| relative to the row's largest |x|: float32 and float64
# compute in their own precision (a few ulps); half types round once at the store (half an ulp).
REL_TOL = {
    np.dtype(np.float16): 2.0**-10,
    BF16: 2.0**-7,
    np.dtype(np.float32): 2.0**-21,
    np.dtype(np.float64): 2.0**-48,
}
ABS_TOL = {
    np.dtype(np.float16): 2.0**-24,
    BF16: 2.0**-126,
    np.dtype(np.float32): 1e-30,
    np.dtype(np.float64): 1e-300,
}

settings.register_profile(
    "default", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "slow", max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="run long hypothesis searches")


def pytest_configure(config):
    settings.load_profile("slow" if config.getoption("--slow") else "default")


def inv_freq(rotary_dim, base=10000.0):
    return base ** (-2.0 * np.arange(rotary_dim // 2) / rotary_dim)


def default_positions(shape):
    lead = shape[:-1]
    return np.arange(lead[-1]) if lead else np.zeros(())


def oracle(
    x,
    pos=None,
    *,
    base=10000.0,
    style="interleaved",
    rotary_dim=None,
    inverse=False,
    scale=1.0,
    freqs=None,
):
    """The float64 rotation of x (..., d) at positions broadcastable to x.shape[:-1]."""
    x64 = np.asarray(x).astype(np.float64)
    d = x64.shape[-1]
    rot = d if rotary_dim is None else rotary_dim
    theta = inv_freq(rot, base) if freqs is None else np.asarray(freqs, np.float64)
    p = default_positions(x64.shape) if pos is None else np.asarray(pos, dtype=np.float64)
    angle = np.broadcast_to(p, x64.shape[:-1])[..., None] * theta
    if inverse:
        angle = -angle
    c, s = scale * np.cos(angle), scale * np.sin(angle)
    if style == "interleaved":
        first, second = np.arange(0, rot, 2), np.arange(1, rot, 2)
    else:
        first, second = np.arange(rot // 2), np.arange(rot // 2, rot)
    a, b = x64[..., first], x64[..., second]
    out = x64.copy()
    out[..., first] = a * c - b * s
    out[..., second] = b * c + a * s
    return out


def matrix_oracle(x, m, base=10000.0):
    """R^d_{Theta,m} x for one vector, the explicit block-diagonal matrix of Eq. 15 (float64)."""
    d = x.shape[-1]
    r = np.zeros((d, d))
    for i, theta in enumerate(inv_freq(d, base)):
        c, s = np.cos(m * theta), np.sin(m * theta)
        r[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = [[c, -s], [s, c]]
    return r @ np.asarray(x, np.float64)


def assert_matches(result, expected, x):
    """result (any dtype) is within the dtype's tolerance of the float64 ``expected``."""
    dtype = np.dtype(result.dtype)
    got = np.asarray(result).astype(np.float64)
    assert not np.isnan(got).any(), "unwritten (poisoned) or nan elements in the result"
    scale = np.abs(np.asarray(x).astype(np.float64)).max(axis=-1, keepdims=True)
    bound = REL_TOL[dtype] * scale + ABS_TOL[dtype]
    err = np.abs(got - expected)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), (
        f"{dtype}: error {err[worst]:.3g} > bound {bound[worst[:-1]][0]:.3g} at {worst}"
    )


def random_array(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def poisoned(shape, dtype):
    out = np.empty(shape, dtype)
    out[...] = np.nan
    return out


def bits(a):
    """The bytes of a, for bit-exact comparisons (nan payloads included)."""
    return np.ascontiguousarray(a).view(np.uint8)


@pytest.fixture
def rng(request):
    # A fresh seed per test run; printed on failure through the test id's parameter.
    seed = np.random.SeedSequence().entropy % (2**32)
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def host_kernels(tmp_path_factory):
    """The CuPy backend's CUDA C source built for the host (see host_cuda.py)."""
    import host_cuda

    if host_cuda.GXX is None:
        pytest.skip("g++ is not on PATH: the CUDA C source's host run needs a C++ compiler")
    return host_cuda.compile_host_kernels(tmp_path_factory.mktemp("host_kernels"))
