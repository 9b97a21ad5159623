"""One test per bad input: a clear RopeError subclass naming the argument, x and out untouched."""

import numpy as np
import pytest

import arrayrope as ar
from arrayrope import BackendUnavailableError, RopeTypeError, RopeValueError


@pytest.fixture
def x():
    return np.random.default_rng().standard_normal((2, 3, 8)).astype(np.float32)


CASES = [
    # (keyword arguments, exception, words the message must hold)
    ({"pos": np.arange(4)}, RopeValueError, ["pos", "(4,)", "(2, 3)"]),
    ({"pos": -1}, RopeValueError, ["pos", "-1"]),
    ({"pos": np.array([0, -5, 1])}, RopeValueError, ["non-negative", "-5"]),
    ({"pos": np.array([0.0, np.nan, 1.0])}, RopeValueError, ["finite"]),
    ({"pos": np.array([0.0, np.inf, 1.0])}, RopeValueError, ["finite"]),
    ({"pos": 2**31}, RopeValueError, ["2**31", str(2**31)]),
    ({"pos": np.array([0, 2**31, 1])}, RopeValueError, ["2**31"]),
    ({"pos": np.array([True, False, True])}, RopeTypeError, ["pos", "bool"]),
    ({"pos": "abc"}, RopeTypeError, ["pos"]),
    ({"rotary_dim": 5}, RopeValueError, ["rotary_dim", "even", "(8)", "5"]),
    ({"rotary_dim": 10}, RopeValueError, ["rotary_dim", "<= head_dim (8)", "10"]),
    ({"rotary_dim": 2.5}, RopeTypeError, ["rotary_dim", "2.5"]),
    ({"style": "neox"}, RopeValueError, ["style", "'neox'"]),
    ({"style": ["half"]}, RopeValueError, ["style", "['half']"]),  # unhashable
    ({"rotary_dim": [4]}, RopeTypeError, ["rotary_dim", "[4]"]),
    ({"backend": "torch"}, RopeValueError, ["backend", "'torch'"]),
    ({"backend": "cupy"}, RopeValueError, ["backend='cupy'", "NumPy"]),
    ({"backend": "numba-cuda"}, RopeValueError, ["backend='numba-cuda'", "NumPy"]),
    ({"base": -3.0}, RopeValueError, ["base", "-3.0"]),
    ({"base": "x"}, RopeTypeError, ["base"]),
    ({"base": "1e4"}, RopeTypeError, ["base", "'1e4'"]),
    ({"base": True}, RopeTypeError, ["base", "True"]),
    ({"inverse": "yes"}, RopeTypeError, ["inverse", "'yes'"]),
    ({"out": np.zeros((2, 3, 6), np.float32)}, RopeValueError, ["out", "(2, 3, 8)", "(2, 3, 6)"]),
    ({"out": np.zeros((2, 3, 8), np.float64)}, RopeValueError, ["out", "float32", "float64"]),
    ({"out": [1, 2]}, RopeTypeError, ["out", "list"]),
]


@pytest.mark.parametrize("kwargs, error, words", CASES, ids=[str(c[0])[:40] for c in CASES])
def test_bad_argument(x, kwargs, error, words):
    out = kwargs.get("out")
    arrays = [x] + ([out] if isinstance(out, np.ndarray) else [])
    before = [a.copy() for a in arrays]
    ar.rotate(x.copy(), 1)  # the default configuration's fast path is live: bad input must pass it
    with pytest.raises(error) as info:
        ar.rotate(x, **kwargs)
    for word in words:
        assert word in str(info.value), f"{word!r} not in {str(info.value)!r}"
    # The family lets callers catch by built-in type.
    assert isinstance(info.value, (ValueError, TypeError))
    for a, b in zip(arrays, before, strict=True):  # x and out are untouched
        np.testing.assert_array_equal(a, b)


def test_odd_feature_size():
    with pytest.raises(RopeValueError, match=r"x.shape\[-1\] must be even, got 7"):
        ar.rotate(np.zeros((3, 7), np.float32))


def test_odd_head_dim():
    with pytest.raises(RopeValueError, match="head_dim must be even, got 9"):
        ar.RoPE(9)


def test_head_dim_mismatch():
    with pytest.raises(RopeValueError, match=r"x.shape\[-1\] must equal head_dim \(16\), got 8"):
        ar.RoPE(16).rotate(np.zeros((3, 8), np.float32))


@pytest.mark.parametrize("dtype", [np.int32, np.complex64, np.bool_, np.float16])
def test_non_float_x(dtype):
    x = np.zeros((3, 8), dtype)
    if dtype is np.float16:
        assert ar.rotate(x).dtype == np.float16  # the control: float16 is accepted
        return
    with pytest.raises(
        RopeTypeError,
        match=f"x must be float16, bfloat16, float32 or float64, got dtype {np.dtype(dtype)}",
    ):
        ar.rotate(x)


@pytest.mark.parametrize("dtype", [">f4", ">f8", ">f2"])
def test_foreign_byte_order_x(dtype):
    x = np.zeros((3, 8), dtype)
    with pytest.raises(RopeTypeError, match=f"x must be in native byte order, got dtype {dtype}"):
        ar.rotate(x)
    with pytest.raises(RopeTypeError, match="native byte order"):
        ar.rotate(x, backend="numpy")
    with pytest.raises(RopeTypeError, match=r"k must be in native byte order, .*k\.astype"):
        ar.rotate_qk(np.zeros((3, 8), np.dtype(dtype).newbyteorder("=")), x)


def _masked_calls():
    """(argument name, call) for each way a masked array can go in."""
    x, q, kv = np.ones((2, 3, 8), np.float32), np.ones((3, 4, 8), np.float32), np.ones((3, 2, 8))
    kv = kv.astype(np.float32)
    rope, pos, m = ar.RoPE(8), np.arange(3), np.ma.masked_array

    def cache():
        return np.zeros((2, 4, 2, 8), np.float32)

    def step(**changed):
        arrays = dict(q=q, k=kv, v=kv, pos=pos, k_cache=cache(), v_cache=cache(), slots=pos)
        options = {name: changed.pop(name) for name in ("q_norm", "k_norm") if name in changed}
        return lambda: rope.rotate_into_cache(**(arrays | changed), **options)

    calls = [
        ("x", lambda: ar.rotate(m(x))),
        ("pos", lambda: ar.rotate(x, m(pos))),
        ("out", lambda: ar.rotate(x, out=m(np.empty_like(x)))),
        ("k", lambda: ar.rotate_qk(x, m(x))),
        ("x", lambda: rope.rotate(m(x), backend="numpy")),
        ("pos", lambda: rope.cos_sin(m(pos))),
    ]
    given = dict(q=q, k=kv, v=kv, pos=pos, k_cache=cache(), v_cache=cache(), slots=pos)
    for name, a in given.items():
        calls.append((name, step(**{name: m(a)})))
    for name in ("q_norm", "k_norm"):
        calls.append((name, step(**{name: m(np.ones(8, np.float32))})))
    return calls


@pytest.mark.parametrize("name, call", _masked_calls())
def test_masked_arrays_are_refused_by_name(name, call):
    # numpy.ma arrays convert to their data, mask dropped, which would silently rotate (or
    # write into, or take positions from) the elements the mask hides
    with pytest.raises(RopeTypeError, match=rf"^{name} is a masked array .*np\.ma\.getdata"):
        call()


def test_zero_d_x():
    with pytest.raises(RopeValueError, match="0-d"):
        ar.rotate(np.float32(3.0))
    with pytest.raises(RopeValueError, match="0-d"):
        ar.RoPE(2).rotate(np.zeros((), np.float32))


def test_not_an_array():
    with pytest.raises(
        RopeTypeError,
        match="x must be an array: NumPy, CuPy, Dask, or any DLPack producer .*, got builtins.list",
    ):
        ar.rotate([[1.0, 2.0]])


def test_partial_overlap_of_out_and_x(x):
    buffer = np.zeros((2, 3, 9), np.float32)
    shifted_in, shifted_out = buffer[..., :8], buffer[..., 1:]
    shifted_in[...] = x
    before = buffer.copy()
    with pytest.raises(RopeValueError, match="overlaps x partially"):
        ar.rotate(shifted_in, out=shifted_out)
    np.testing.assert_array_equal(buffer, before)


def test_exact_alias_is_in_place(x):
    expected = ar.rotate(x, 3)
    alias = x[...]  # another view object on the same memory
    assert ar.rotate(x, 3, out=alias) is alias
    np.testing.assert_array_equal(x, expected)


@pytest.mark.parametrize("vector_rows", [True, False])
@pytest.mark.parametrize("shape", [(2, 3, 8), (2, 8, 512, 64)], ids=["rows", "general"])
def test_read_only_view_of_the_out_is_rotated_in_place(shape, vector_rows, cpu_config):
    # x a read-only view of out's memory is in place: the result is written through out, on
    # every route
    cpu_config(vector_rows=vector_rows)
    out = np.random.default_rng(0).standard_normal(shape)
    expected = ar.rotate(out, 3, backend="numpy")
    view = out[...]
    view.flags.writeable = False
    assert ar.rotate(view, 3, out=out) is out
    np.testing.assert_array_equal(out, expected)


def test_read_only_out(x):
    x.flags.writeable = False
    with pytest.raises(RopeValueError, match="out is read-only"):
        ar.rotate(x, out=x)
    assert ar.rotate(x).shape == x.shape  # reading a read-only x is fine


def test_rotate_qk_errors(x):
    k = np.zeros((2, 3, 8), np.float64)
    with pytest.raises(RopeTypeError, match="q and k must share a dtype"):
        ar.rotate_qk(x, k)
    with pytest.raises(RopeValueError, match=r"k.shape\[-1\] must equal head_dim \(8\), got 4"):
        ar.rotate_qk(x, np.zeros((2, 3, 4), np.float32))
    with pytest.raises(RopeTypeError, match="out must be None or a pair"):
        ar.rotate_qk(x, x.copy(), out=x)
    k = x.copy()
    with pytest.raises(RopeValueError, match=r"out\[0\] is k"):
        ar.rotate_qk(x, k, out=(k, x))
    with pytest.raises(RopeValueError, match="pos of shape"):
        ar.rotate_qk(x, np.zeros((2, 5, 8), np.float32), np.arange(3))


def test_seq_len_checked():
    from arrayrope.scaling import DynamicNTK

    rope = ar.RoPE(8, scaling=DynamicNTK(2.0, 16))
    with pytest.raises(RopeValueError, match="seq_len must be >= 1, got 0"):
        rope.rotate(np.zeros((3, 8), np.float32), seq_len=0)


def test_unavailable_gpu_backend_names_the_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "cupy", None)
    from arrayrope.backends.cuda import cupy

    with pytest.raises(BackendUnavailableError, match="pip install"):
        cupy.require_cupy()


def test_outputs_whose_elements_share_memory_are_refused():
    # parallel rows would race to write one place; no answer would be the right one
    x = np.ones((4, 16), np.float32)
    shared = np.lib.stride_tricks.as_strided(np.zeros(16, np.float32), (4, 16), (0, 4))
    before = x.copy()
    with pytest.raises(RopeValueError, match="share memory"):
        ar.rotate(x, 1, out=shared)
    in_place = np.lib.stride_tricks.as_strided(np.ones(16, np.float32), (4, 16), (0, 4))
    with pytest.raises(RopeValueError, match="share memory"):
        ar.rotate(in_place, 1, out=in_place)
    np.testing.assert_array_equal(x, before)
    assert (shared == 0).all() and (in_place == 1).all()


def test_one_array_for_both_outs_is_refused():
    q, k = np.ones((1, 2, 1, 8), np.float32), np.ones((1, 2, 1, 8), np.float32)
    out = np.zeros_like(q)
    for backend in ("numba", "numpy"):
        with pytest.raises(RopeValueError, match=r"out\[0\] and out\[1\] are one array"):
            ar.rotate_qk(q, k, 5, out=(out, out), backend=backend)
    assert (out == 0).all()


def test_errors_do_not_depend_on_earlier_calls():
    x = np.ones((2, 8), np.float32)
    ar.rotate(x, rotary_dim=4)  # a float equal to it must not find this RoPE
    with pytest.raises(RopeTypeError, match="rotary_dim must be an int, got 4.0"):
        ar.rotate(x, rotary_dim=4.0)
    with pytest.raises(RopeTypeError, match="rotary_dim must be an int, got 4.0"):
        ar.rotate_qk(x, x, rotary_dim=4.0)
    for axis in ("0", 0.5, True):
        with pytest.raises(RopeValueError, match="head_axis must be an axis"):
            ar.rotate(x, np.arange(2), head_axis=axis)


def test_huge_unsigned_positions_are_named_as_given():
    x = np.ones((1, 8), np.float32)
    for backend in ("numba", "numpy"):
        with pytest.raises(RopeValueError, match=r"below 2\*\*31, got 9223372036854775813"):
            ar.rotate(x, np.array([2**63 + 5], np.uint64), backend=backend)
