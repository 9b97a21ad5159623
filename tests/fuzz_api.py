"""A crash-free fuzz of the public API: hypothesis drives rotate, rotate_qk, RoPE and cos_sin
with arbitrary, mostly invalid, arguments.

Run in a subprocess by ``test_fuzz_api.py`` (``python tests/fuzz_api.py EXAMPLES SEED``, the
seed of the test run), so that a crash shows as the process dying. For every call: the process
survives; a rejection is a ``RopeError`` subclass, or ``MemoryError`` where the result itself
cannot be allocated; every array argument keeps its bits after a rejection; an accepted call
returns x's shape and dtype, and never writes through a self-overlapping ``out``.
Hypothesis prints the falsifying example of a failure; the same seed draws the same calls.
"""

import math
import os
import sys

import numpy as np
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from oracles import BF16  # noqa: E402

import arrayrope as ar  # noqa: E402
from arrayrope import scaling  # noqa: E402

FLOATS = [np.float16, BF16, np.float32, np.float64]
OTHER_DTYPES = [
    np.int32,
    np.uint8,
    np.bool_,
    np.complex64,
    np.object_,
    np.dtype([("a", np.float32), ("b", np.float32)]),
    np.dtype(">f4"),
    np.dtype("U3"),
    np.longdouble,
]


class Foreign:
    """An object that looks a little like an array."""

    shape = (2, 8)
    dtype = np.dtype(np.float32)
    ndim = 2


def _array_from(draw, dtype, shape):
    size = math.prod(shape)
    if dtype == np.object_:
        return np.array([object()] * size, dtype=object).reshape(shape)
    if np.dtype(dtype).kind in "US":
        return np.full(shape, "ab", dtype=dtype)
    if np.dtype(dtype).names:
        return np.zeros(shape, dtype=dtype)
    values = np.arange(size, dtype=np.float64).reshape(shape) % 7 - 3
    return values.astype(dtype)


try:
    import torch
except ImportError:
    torch = None


def _torch_from(draw, a):
    """A torch tensor of ``a``'s values, plain, requiring grad, with a lazy negation, or on the
    meta device (where torch is installed; ``a`` itself otherwise)."""
    if (
        torch is None
        or not isinstance(a, np.ndarray)
        or a.dtype not in (np.float16, np.float32, np.float64)
    ):
        return a
    if a.size > 2**16:
        return a
    t = torch.from_numpy(np.ascontiguousarray(a).copy())
    kind = draw(st.sampled_from(["plain", "grad", "negative bit", "meta"]))
    if kind == "grad":
        return t.requires_grad_()
    if kind == "negative bit":  # the values of t, held as -t with torch's negative bit
        return torch.complex(torch.zeros_like(t), -t).conj().imag if t.dtype != torch.float16 else t
    return t.to("meta") if kind == "meta" else t


@st.composite
def arrays(draw, d=None):
    """Arrays of any dtype, shape and layout: zero-size axes, 0-d, read-only, reversed, strided
    views, huge broadcast views, torch tensors of several kinds."""
    kind = draw(
        st.sampled_from(
            ["float"] * 4 + ["other", "broadcast", "broadcast", "0-d", "foreign", "torch"]
        )
    )
    if kind == "torch":
        return _torch_from(draw, draw(arrays(d)))
    if kind == "foreign":
        return draw(st.sampled_from([Foreign(), object(), [1.0, 2.0], "x", None, 3.5]))
    if kind == "0-d":
        return np.array(1.0, dtype=draw(st.sampled_from(FLOATS)))
    dtype = draw(st.sampled_from(FLOATS if kind != "other" else OTHER_DTYPES))
    lead = draw(st.lists(st.integers(0, 4), max_size=3))
    last = d if d is not None else draw(st.sampled_from([0, 1, 2, 7, 8, 8, 16]))
    if kind == "broadcast":
        big = draw(st.sampled_from([(3, 4), (5,), (1, 3), (2**20, 2**20), (2**40,)]))
        base = _array_from(draw, dtype, (last,))
        return np.lib.stride_tricks.as_strided(
            base, shape=big + (last,), strides=(0,) * len(big) + base.strides
        )
    a = _array_from(draw, dtype, tuple(lead) + (last,))
    layout = draw(st.sampled_from(["plain", "reversed", "strided", "read-only", "transposed"]))
    if layout == "reversed" and a.ndim > 1:
        a = a[::-1]
    elif layout == "strided":
        a = a[..., ::2] if draw(st.booleans()) else a[::2]
    elif layout == "read-only":
        a.flags.writeable = False
    elif layout == "transposed":
        a = a.T
    return a


positions = st.one_of(
    st.none(),
    st.integers(-(2**40), 2**40),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.lists(st.integers(-3, 2**32), max_size=4).map(np.array),
    st.lists(st.floats(allow_nan=True), max_size=4).map(np.array),
    st.sampled_from(["3", object(), [[0, 1]], np.array(["a"]), np.array([1 + 1j])]),
    st.integers(0, 3).map(lambda n: np.arange(n)),
    st.integers(0, 3).map(lambda n: np.zeros((n, 3), np.int64)),
)

rules = st.one_of(
    st.none(),
    st.builds(scaling.Linear, st.floats(0.5, 8)),
    st.builds(scaling.DynamicNTK, st.floats(1, 8), st.integers(1, 4096)),
    st.builds(scaling.YaRN, st.floats(1, 8), st.integers(1, 4096)),
    st.sampled_from(["linear", 2.0, object()]),
)

settings_ = st.fixed_dictionaries(
    {},
    optional={
        "base": st.one_of(st.floats(allow_nan=True), st.integers(-5, 10**6), st.just("x")),
        "style": st.sampled_from(["interleaved", "half", "neox", None, ["half"]]),
        "rotary_dim": st.one_of(st.integers(-2, 20), st.just(2.0), st.just(True)),
        "scaling": rules,
    },
)
calls = st.fixed_dictionaries(
    {},
    optional={
        "inverse": st.sampled_from([True, False, 1, "yes", np.True_]),
        "backend": st.sampled_from(["auto", "numba", "numpy", "cupy", "numba-cuda", "torch"]),
        "seq_len": st.one_of(st.none(), st.integers(-3, 10**6), st.just(2.5)),
    },
)


def _snapshot(objects):
    """The bytes of every array among ``objects`` (nested in tuples and lists too)."""
    found = []
    for a in objects:
        if isinstance(a, (tuple, list)):
            found += _snapshot(a)
        elif isinstance(a, np.ndarray) and a.dtype != object and a.size and a.size < 2**24:
            found.append((a, np.ascontiguousarray(a).copy()))
        elif torch is not None and isinstance(a, torch.Tensor) and not a.is_meta:
            found.append((a, a.detach().clone()))
    return found


def _unchanged(snapshot):
    for a, before in snapshot:
        if torch is not None and isinstance(a, torch.Tensor):
            assert torch.equal(a.detach(), before), (
                "a torch argument was written by a rejected call"
            )
            continue
        same = np.ascontiguousarray(a).view(np.uint8) == before.view(np.uint8)
        assert same.all(), f"an array argument was written by a rejected call: {a.shape}"


def _call(fn, arrays_in, *args, **kwargs):
    snapshot = _snapshot(list(arrays_in) + list(args) + list(kwargs.values()))
    try:
        result = fn(*args, **kwargs)
    except ar.RopeError:
        _unchanged(snapshot)
        return None
    except MemoryError:
        _unchanged(snapshot)  # a result too large to allocate: NumPy's own error
        return None
    return result


def _self_overlapping(a):
    """Whether two elements of ``a`` share memory through a zero stride."""
    return a.size > 0 and any(n > 1 and s == 0 for n, s in zip(a.shape, a.strides))


def _out_for(draw, x):
    kind = draw(st.sampled_from(["none", "none", "fresh", "self", "other", "overlap"]))
    if kind == "none" or not isinstance(x, np.ndarray) or x.size > 2**24:
        return None
    if kind == "fresh":
        return np.full(x.shape, np.nan, x.dtype) if x.dtype.kind == "f" else np.empty_like(x)
    if kind == "self":
        return x
    if kind == "overlap" and x.ndim and x.shape[0] > 1:
        return x[::-1]
    return draw(arrays())


@st.composite
def scenario(draw):
    which = draw(st.sampled_from(["rotate", "rotate_qk", "rope", "cos_sin"]))
    x = draw(arrays())
    config = draw(settings_)
    call = draw(calls)
    pos = draw(positions)
    return which, x, config, call, pos, draw(st.data())


def fuzz(case):
    which, x, config, call, pos, data = case
    if which == "rotate":
        out = _out_for(data.draw, x)
        result = _call(ar.rotate, [x, out], x, pos, out=out, **config, **call)
        if result is not None:
            assert result.shape == x.shape and result.dtype == x.dtype
            assert out is None or result is out
            assert out is None or not _self_overlapping(out), "a self-overlapping out accepted"
    elif which == "rotate_qk":
        k = data.draw(st.one_of(arrays(), st.just(x)))
        out = data.draw(
            st.sampled_from([None, (x, k), [x], "out", (np.empty_like(x), None)])
            if isinstance(x, np.ndarray) and x.size <= 2**24
            else st.just(None)
        )
        result = _call(ar.rotate_qk, [x, k], x, k, pos, out=out, **config, **call)
        if result is not None:
            assert result[0].shape == x.shape and result[1].shape == k.shape
    else:
        head_dim = data.draw(st.one_of(st.integers(-2, 20), st.just(8.0), st.just("8")))
        rope = _call(ar.RoPE, [], head_dim, **config)
        if rope is None:
            return
        if which == "rope":
            out = _out_for(data.draw, x)
            result = _call(rope.rotate, [x, out], x, pos, out=out, **call)
            if result is not None:
                assert result.shape == x.shape and result.dtype == x.dtype
                assert out is None or not _self_overlapping(out), "a self-overlapping out"
        else:
            like = data.draw(st.one_of(st.none(), arrays()))
            seq_len = call.get("seq_len")
            tables = _call(rope.cos_sin, [like], pos, like=like, seq_len=seq_len)
            if tables is not None:
                cos, sin = tables
                assert cos.shape == sin.shape and cos.shape[-1] == rope.rotary_dim // 2


def main():
    examples = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    run_seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    test = seed(run_seed)(
        settings(
            max_examples=examples,
            deadline=None,
            database=None,
            print_blob=True,
            suppress_health_check=list(HealthCheck),
        )(given(scenario())(fuzz))
    )
    test()
    print(f"fuzzed {examples} calls", flush=True)


if __name__ == "__main__":
    main()
