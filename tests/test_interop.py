"""Framework arrays through DLPack (PyTorch here; JAX where installed) and Dask on a cluster."""

import numpy as np
import pytest
from conftest import BF16, bits
from hypothesis import given, settings
from hypothesis import strategies as st

import arrayrope as ar
from arrayrope import RopeTypeError, RopeValueError


class ReadOnlyProducer:
    """A minimal DLPack producer over a read-only NumPy array (as JAX arrays are read-only)."""

    def __init__(self, array):
        self.array = array
        self.array.flags.writeable = False
        self.shape, self.dtype = array.shape, array.dtype

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


class BareProducer:
    """Nothing but the DLPack protocol: no shape, no dtype."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def test_a_bare_dlpack_producer_is_accepted(rng):
    x = rng.standard_normal((3, 4, 8)).astype(np.float32)
    k = rng.standard_normal((3, 2, 8)).astype(np.float32)
    expected = ar.rotate(x, 5)
    np.testing.assert_array_equal(ar.rotate(BareProducer(x), 5), expected)
    np.testing.assert_array_equal(ar.RoPE(8).rotate(BareProducer(x), 5), expected)
    q_rot, k_rot = ar.rotate_qk(BareProducer(x), BareProducer(k), 5)
    np.testing.assert_array_equal(q_rot, expected)
    np.testing.assert_array_equal(k_rot, ar.rotate(k, 5))
    cos, sin = ar.RoPE(8).cos_sin(np.arange(3), like=BareProducer(np.zeros(1)))
    assert cos.dtype == np.float64 and cos.shape == (3, 4)


def test_read_only_producer_is_read_not_written():
    x = np.random.default_rng().standard_normal((3, 8)).astype(np.float32)
    producer = ReadOnlyProducer(x.copy())
    y = ar.rotate(producer, 5)
    assert isinstance(y, np.ndarray)
    np.testing.assert_array_equal(y, ar.rotate(x, 5))
    with pytest.raises(RopeValueError, match="out is read-only"):
        ar.rotate(producer, 5, out=producer)
    np.testing.assert_array_equal(producer.array, x)


# ---------------------------------------------------------------- PyTorch (CPU)

torch_dtypes = ["float16", "bfloat16", "float32", "float64"]


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch", reason="PyTorch is not installed")


def _numpy_of(t):
    import torch as th

    if t.dtype == th.bfloat16:
        return t.view(th.uint16).numpy().view(BF16)
    return t.numpy()


@pytest.mark.parametrize("dtype", torch_dtypes)
@pytest.mark.parametrize("style", ["interleaved", "half"])
def test_torch_round_trip_is_bit_exact(torch, dtype, style):
    t = torch.randn(2, 4, 9, 16).to(getattr(torch, dtype))
    pos = torch.randint(0, 10**6, (9,))
    y = ar.rotate(t, pos, style=style, rotary_dim=12)
    assert isinstance(y, torch.Tensor) and y.dtype == t.dtype and y.device == t.device
    expected = ar.rotate(_numpy_of(t), pos.numpy(), style=style, rotary_dim=12)
    np.testing.assert_array_equal(bits(_numpy_of(y)), bits(expected))


def test_torch_in_place_writes_the_tensor_itself(torch):
    t = torch.randn(3, 5, 16)
    pointer = t.data_ptr()
    expected = ar.rotate(t.numpy().copy(), 7)
    assert ar.rotate(t, 7, out=t) is t
    assert t.data_ptr() == pointer
    np.testing.assert_array_equal(t.numpy(), expected)


def test_torch_views_are_not_copied(torch):
    qkv = torch.randn(2, 6, 3, 4, 16)
    q, k = qkv[:, :, 0], qkv[:, :, 1]
    out_q, out_k = torch.empty_like(q), torch.empty_like(k)
    pointers = (out_q.data_ptr(), out_k.data_ptr())
    pos = torch.arange(6)[:, None]
    rq, rk = ar.rotate_qk(q, k, pos, out=(out_q, out_k))
    assert rq is out_q and rk is out_k and (rq.data_ptr(), rk.data_ptr()) == pointers
    np.testing.assert_array_equal(rq.numpy(), ar.rotate(q.numpy(), pos.numpy()))
    np.testing.assert_array_equal(rk.numpy(), ar.rotate(k.numpy(), pos.numpy()))
    # The NumPy view the kernel wrote through is the tensor's own memory.
    assert np.from_dlpack(q).__array_interface__["data"][0] == q.data_ptr()


def test_torch_result_type_for_mixed_and_rope_methods(torch):
    rope = ar.RoPE(16, style="half")
    t = torch.randn(4, 16)
    assert isinstance(rope.rotate(t, torch.arange(4)), torch.Tensor)
    q, k = rope.rotate_qk(t, np.random.randn(4, 16).astype(np.float32))
    assert isinstance(q, torch.Tensor) and isinstance(k, np.ndarray)


def test_torch_tensors_on_the_cpu_share_numpy_memory(torch, rng):
    # decode-sized tensors go the NumPy way (a view in, a tensor over the result out)
    x = rng.standard_normal((1, 8, 1, 64)).astype(np.float32)
    t = torch.from_numpy(x.copy())
    k = torch.from_numpy(x[:, :2].copy())
    y = ar.rotate(t, 9)
    assert isinstance(y, torch.Tensor)
    np.testing.assert_array_equal(y.numpy(), ar.rotate(x, 9))
    q_rot, k_rot = ar.rotate_qk(t, k, 9)
    np.testing.assert_array_equal(q_rot.numpy(), y.numpy())
    np.testing.assert_array_equal(k_rot.numpy(), ar.rotate(x[:, :2], 9))
    pointer = t.data_ptr()
    assert ar.rotate(t, 9, out=t) is t and t.data_ptr() == pointer
    np.testing.assert_array_equal(t.numpy(), y.numpy())


def test_cos_sin_like_a_torch_tensor(torch):
    rope = ar.RoPE(8)
    cos, sin = rope.cos_sin(torch.arange(5), like=torch.zeros(1, dtype=torch.float64))
    assert isinstance(cos, torch.Tensor) and cos.dtype == torch.float64 and cos.shape == (5, 4)
    np.testing.assert_array_equal(sin.numpy(), rope.cos_sin(np.arange(5), like=np.zeros(1))[1])


@pytest.mark.parametrize("style", ["interleaved", "half"])
def test_torch_autograd_runs_the_transpose_backward(torch, style):
    from arrayrope.scaling import YaRN

    rope = ar.RoPE(8, style=style, rotary_dim=6, scaling=YaRN(4.0, 16))
    pos = torch.tensor([3, 40, 7])
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: rope.rotate(t, pos), (x,))
    assert torch.autograd.gradcheck(lambda t: rope.rotate(t, pos, inverse=True), (x,))
    k = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: rope.rotate_qk(a, b, pos), (x, k))
    y = ar.rotate(x, pos, style=style)  # the module-level function, and a value check
    (y * y).sum().backward()
    expected = 2 * ar.rotate(y.detach(), pos, style=style, inverse=True)
    np.testing.assert_allclose(x.grad.numpy(), expected.numpy(), rtol=1e-12, atol=1e-12)


def _lazily_negated(torch, values):
    """A tensor equal to ``values`` that holds -values in memory, with torch's negative bit
    set (as ``z.conj().imag`` is)."""
    t = torch.complex(torch.zeros_like(values), -values).conj().imag
    assert t.is_neg() and torch.equal(t, values)
    return t


@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from(["float32", "float64"]),
    negated=st.sets(st.sampled_from(["x", "k", "pos"])),
    style=st.sampled_from(["interleaved", "half"]),
    rows=st.integers(1, 40),
    seed=st.integers(0, 2**32 - 1),
)
def test_torch_lazy_negation_is_rotated_by_its_values(dtype, negated, style, rows, seed):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, rows, 16, generator=generator, dtype=getattr(torch, dtype))
    k = torch.randn(2, 1, rows, 16, generator=generator, dtype=q.dtype)
    pos = torch.randint(0, 10**5, (rows,), generator=generator).to(q.dtype)
    expected_q = ar.rotate(q.numpy(), pos.numpy(), style=style)
    expected_k = ar.rotate(k.numpy(), pos.numpy(), style=style)
    lazy_q = _lazily_negated(torch, q) if "x" in negated else q
    lazy_k = _lazily_negated(torch, k) if "k" in negated else k
    lazy_pos = _lazily_negated(torch, pos) if "pos" in negated else pos
    np.testing.assert_array_equal(ar.rotate(lazy_q, lazy_pos, style=style).numpy(), expected_q)
    q_rot, k_rot = ar.rotate_qk(lazy_q, lazy_k, lazy_pos, style=style)
    np.testing.assert_array_equal(q_rot.numpy(), expected_q)
    np.testing.assert_array_equal(k_rot.numpy(), expected_k)
    out = torch.empty_like(q)
    assert ar.rotate(lazy_q, lazy_pos, style=style, out=out) is out
    np.testing.assert_array_equal(out.numpy(), expected_q)


def test_torch_lazy_negation_is_not_written(torch):
    values = torch.randn(2, 5, 16)
    x = _lazily_negated(torch, values)
    memory = x.resolve_neg().neg().clone()  # what x's memory holds
    for call in (
        lambda: ar.rotate(x, 3, out=x),
        lambda: ar.rotate(values, 3, out=x),
        lambda: ar.rotate_qk(values, values.clone(), 3, out=(torch.empty_like(values), x)),
    ):
        with pytest.raises(RopeValueError, match="negative or conjugate bit.*resolve_neg"):
            call()
        assert torch.equal(x, values) and torch.equal(x.resolve_neg().neg(), memory)


def test_torch_errors(torch):
    with pytest.raises(RopeTypeError, match="x must be float16, bfloat16, float32 or float64"):
        ar.rotate(torch.zeros(3, 8, dtype=torch.int32))
    leaf = torch.zeros(3, 8, requires_grad=True)
    with pytest.raises(RopeValueError, match="requires grad"):
        ar.rotate(leaf, out=leaf)


def test_no_framework_is_imported_for_numpy_calls():
    import subprocess
    import sys

    code = (
        "import sys, numpy as np, arrayrope as ar; ar.rotate(np.ones((2, 8)), 1); "
        "assert not {'torch', 'jax', 'dask', 'cupy'} & set(sys.modules), sys.modules.keys()"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_jax_arrays_are_read_only():
    jnp = pytest.importorskip("jax.numpy", reason="JAX is not installed")
    x = jnp.ones((3, 8), dtype=jnp.float32)
    y = ar.rotate(x, 2)
    assert type(y).__module__.startswith("jax")
    np.testing.assert_allclose(np.asarray(y), ar.rotate(np.ones((3, 8), np.float32), 2))
    with pytest.raises(RopeValueError, match="read-only"):
        ar.rotate(x, 2, out=x)
    for dtype in ("float16", "bfloat16"):  # bfloat16 goes through JAX's own NumPy view
        half = jnp.ones((3, 8), dtype=dtype)
        y = ar.rotate(half, 2)
        assert type(y).__module__.startswith("jax") and y.dtype == half.dtype
        expected = ar.rotate(np.asarray(half), 2)
        np.testing.assert_array_equal(bits(np.asarray(y)), bits(expected))


# ---------------------------------------------------------------- Dask


@pytest.fixture(scope="module")
def client():
    distributed = pytest.importorskip("distributed", reason="dask.distributed is not installed")
    cluster = distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
    )
    with distributed.Client(cluster) as c:
        yield c
    cluster.close()


@pytest.mark.parametrize(
    "case", ["int", "float", "none", "multi-axis", "dask-pos", "chunked-d", "dynamic-scaling", "qk"]
)
def test_dask_on_a_cluster_matches_in_memory(client, case):
    import dask.array as da

    rng = np.random.default_rng()
    x = rng.standard_normal((3, 4, 40, 32)).astype(np.float32)
    rope, pos, kw = ar.RoPE(32, style="half", rotary_dim=24), rng.integers(0, 10**6, 40), {}
    chunks = (2, 3, 15, 32)
    if case == "float":
        pos = rng.random(40) * 1e5
    elif case == "none":
        pos = None
    elif case == "multi-axis":
        rope = ar.RoPE.sectioned(32, (4, 6, 6))
        pos = rng.integers(0, 500, (3, 1, 40, 3))
    elif case == "dask-pos":
        pos = da.from_array(pos, chunks=7)
    elif case == "chunked-d":
        chunks = (1, 4, 40, 8)
    elif case == "dynamic-scaling":
        rope = ar.RoPE(32, scaling=ar.scaling.DynamicNTK(2.0, 64))
        pos = np.arange(40) * 10  # max 390: every chunk must use L = 391, not its own max
    xd = da.from_array(x, chunks=chunks)
    if case == "qk":
        k = rng.standard_normal((3, 2, 40, 32)).astype(np.float32)
        rq, rk = rope.rotate_qk(xd, da.from_array(k, chunks=(1, 1, 20, 32)), pos)
        eq, ek = rope.rotate_qk(x, k, pos)
        np.testing.assert_array_equal(bits(rq.compute()), bits(eq))
        np.testing.assert_array_equal(bits(rk.compute()), bits(ek))
        return
    lazy = rope.rotate(xd, pos, **kw)
    assert isinstance(lazy, da.Array) and lazy.dtype == x.dtype
    host_pos = pos.compute() if hasattr(pos, "compute") else pos
    expected = rope.rotate(x, host_pos)
    np.testing.assert_array_equal(bits(client.compute(lazy).result()), bits(expected))


def test_dask_shift_unrotate_and_each_operands_own_default_positions():
    da = pytest.importorskip("dask.array", reason="dask is not installed")
    from arrayrope.scaling import YaRN

    rope = ar.RoPE(16, scaling=YaRN(4.0, 32))
    x = np.random.default_rng(0).standard_normal((2, 6, 16))
    lazy = da.from_array(x, chunks=(1, 3, 16))
    np.testing.assert_allclose(rope.shift(lazy, 5).compute(), rope.shift(x, 5), atol=1e-12)
    pos = np.arange(6)
    np.testing.assert_allclose(rope.unrotate(lazy, pos).compute(), rope.unrotate(x, pos))
    q, k = x[:, :1], x  # q one token, k six: pos=None gives each its own 0..T-1
    q_rot, k_rot = ar.rotate_qk(da.from_array(q), da.from_array(k, chunks=(1, 2, 16)))
    np.testing.assert_allclose(k_rot.compute(), ar.rotate(k), atol=1e-12)
    np.testing.assert_allclose(q_rot.compute(), ar.rotate(q), atol=1e-12)


def test_dask_errors():
    import dask.array as da

    xd = da.zeros((4, 8), chunks=2, dtype=np.float32)
    with pytest.raises(RopeValueError, match="out is not supported for dask"):
        ar.rotate(xd, out=xd)
    with pytest.raises(RopeValueError, match="pos of shape"):
        ar.rotate(xd, np.arange(5))
    with pytest.raises(RopeValueError, match="pos of shape"):
        ar.rotate(xd, da.arange(5, chunks=2))
    with pytest.raises(RopeTypeError, match="x must be float16"):
        ar.rotate(da.zeros((4, 8), chunks=2, dtype=np.int32))
    with pytest.raises(RopeTypeError, match="inverse must be a bool"):
        ar.rotate(xd, inverse="no")
