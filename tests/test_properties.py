"""Hypothesis property tests: the invariants of the rotation, on every dtype, style and layout."""

import numpy as np
import pytest
from conftest import (
    DTYPES,
    assert_matches,
    bits,
    matrix_oracle,
    oracle,
    poisoned,
    random_array,
)
from hypothesis import given
from hypothesis import strategies as st

import arrayrope as ar

BACKENDS = ["numba", "numpy"]


@st.composite
def configs(draw, dtypes=DTYPES, max_lead=3):
    lead = tuple(draw(st.lists(st.integers(1, 5), min_size=0, max_size=max_lead)))
    d = 2 * draw(st.integers(1, 24))
    rotary_dim = 2 * draw(st.integers(1, d // 2))
    return {
        "lead": lead,
        "d": d,
        "rotary_dim": rotary_dim,
        "style": draw(st.sampled_from(["interleaved", "half"])),
        "dtype": draw(st.sampled_from(dtypes)),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


positions = st.one_of(
    st.integers(0, 100),
    st.integers(0, 2**31 - 1),
    st.floats(0, 1e7, allow_nan=False),
)


def _setup(cfg):
    rng = np.random.default_rng(cfg["seed"])
    x = random_array(rng, cfg["lead"] + (cfg["d"],), cfg["dtype"])
    kw = {"style": cfg["style"], "rotary_dim": cfg["rotary_dim"]}
    return rng, x, kw


def _positions_for(rng, lead, large):
    top = 2**31 - 1 if large else 4096
    return rng.integers(0, top, size=lead)


@given(configs(), st.booleans(), st.sampled_from(BACKENDS))
def test_matches_float64_oracle(cfg, large, backend):
    rng, x, kw = _setup(cfg)
    pos = _positions_for(rng, cfg["lead"], large)
    out = poisoned(x.shape, x.dtype)
    y = ar.rotate(x, pos, out=out, backend=backend, **kw)
    assert y is out and y.dtype == x.dtype
    assert_matches(y, oracle(x, pos, **kw), x)


@given(configs(), st.floats(0, 1e6, allow_nan=False))
def test_real_valued_positions_are_exact(cfg, offset):
    rng, x, kw = _setup(cfg)
    pos = rng.random(cfg["lead"]) * 1000 + offset
    assert_matches(ar.rotate(x, pos, **kw), oracle(x, pos, **kw), x)


@given(configs(dtypes=[np.dtype(np.float64), np.dtype(np.float32)]), positions)
def test_pair_norms_are_preserved(cfg, m):
    _, x, kw = _setup(cfg)
    y = ar.rotate(x, m, **kw).astype(np.float64)
    x64 = x.astype(np.float64)
    rot = kw["rotary_dim"]
    if kw["style"] == "interleaved":
        first, second = np.arange(0, rot, 2), np.arange(1, rot, 2)
    else:
        first, second = np.arange(rot // 2), np.arange(rot // 2, rot)
    before = np.hypot(x64[..., first], x64[..., second])
    after = np.hypot(y[..., first], y[..., second])
    tol = 1e-12 if x.dtype == np.float64 else 2e-6
    np.testing.assert_allclose(after, before, rtol=tol, atol=tol)


@given(
    configs(dtypes=[np.dtype(np.float64)], max_lead=1),
    st.integers(0, 10**6),
    st.integers(0, 10**6),
    st.integers(0, 10**6),
)
def test_relative_position(cfg, m, n, shift):
    rng, q, kw = _setup(cfg)
    k = random_array(rng, q.shape, q.dtype)

    def score(a, b):
        return np.sum(ar.rotate(q, a, **kw) * ar.rotate(k, b, **kw), axis=-1)

    base = score(m, n)
    np.testing.assert_allclose(score(m + shift, n + shift), base, rtol=1e-9, atol=1e-9)
    # It depends only on m - n: the same gap anchored at zero gives the same score.
    low = min(m, n)
    np.testing.assert_allclose(score(m - low, n - low), base, rtol=1e-9, atol=1e-9)


@given(configs(), positions, st.sampled_from(BACKENDS))
def test_inverse_undoes(cfg, m, backend):
    _, x, kw = _setup(cfg)
    back = ar.rotate(ar.rotate(x, m, backend=backend, **kw), m, inverse=True, backend=backend, **kw)
    # Two roundings of the dtype at most (one per rotation).
    rel = {np.float16: 2**-9, np.float32: 2**-20, np.float64: 2**-47}.get(x.dtype.type, 2**-6)
    scale = np.abs(x.astype(np.float64)).max(axis=-1, keepdims=True)
    assert (np.abs(back.astype(np.float64) - x.astype(np.float64)) <= rel * scale + 1e-7).all()
    # The inverse is the rotation by -angle: the oracle's transpose.
    assert_matches(ar.rotate(x, m, inverse=True, **kw), oracle(x, m, inverse=True, **kw), x)


@given(configs(dtypes=[np.dtype(np.float64)]), st.integers(0, 10**6), st.integers(0, 10**6))
def test_composition_adds_positions(cfg, m, n):
    _, x, kw = _setup(cfg)
    twice = ar.rotate(ar.rotate(x, m, **kw), n, **kw)
    np.testing.assert_allclose(twice, ar.rotate(x, m + n, **kw), rtol=0, atol=1e-9)


@given(configs())
def test_position_zero_is_identity(cfg):
    _, x, kw = _setup(cfg)
    np.testing.assert_array_equal(bits(ar.rotate(x, 0, **kw)), bits(x))


@given(st.integers(1, 16), st.integers(0, 10**5), st.integers(0, 2**32 - 1), st.floats(2.0, 1e6))
def test_equals_the_block_diagonal_matrix_of_eq15(pairs, m, seed, base):
    x = np.random.default_rng(seed).standard_normal(2 * pairs)
    y = ar.rotate(x, m, base=base)
    np.testing.assert_allclose(y, matrix_oracle(x, m, base), rtol=0, atol=1e-11)


@given(configs())
def test_half_equals_interleaved_under_permutation(cfg):
    rng, x, kw = _setup(cfg)
    rot = kw["rotary_dim"]
    pos = _positions_for(rng, cfg["lead"], False)
    # "half" pairs (i, i + rot/2); feature i to 2i and i + rot/2 to 2i + 1 gives "interleaved".
    perm = np.concatenate(
        [
            np.stack([np.arange(rot // 2), np.arange(rot // 2, rot)], 1).ravel(),
            np.arange(rot, x.shape[-1]),
        ]
    )
    half = ar.rotate(x, pos, style="half", rotary_dim=rot)
    inter = ar.rotate(np.ascontiguousarray(x[..., perm]), pos, style="interleaved", rotary_dim=rot)
    np.testing.assert_array_equal(bits(half[..., perm]), bits(inter))


@given(configs(), st.sampled_from(BACKENDS))
def test_tail_is_bit_identical(cfg, backend):
    rng, x, kw = _setup(cfg)
    x.reshape(-1, x.shape[-1])[:, -1:] = np.nan  # nan payloads must pass through too
    y = ar.rotate(x, _positions_for(rng, cfg["lead"], True), backend=backend, **kw)
    rot = kw["rotary_dim"]
    np.testing.assert_array_equal(bits(y[..., rot:]), bits(x[..., rot:]))


@given(
    configs(),
    st.sampled_from(["reverse", "step", "fused", "features"]),
    st.sampled_from(["new", "out", "inplace"]),
)
def test_strided_views_match_contiguous(cfg, layout, mode):
    rng, _, kw = _setup(cfg)
    lead, d = cfg["lead"] or (1,), cfg["d"]
    big = random_array(rng, (3,) + tuple(2 * n for n in lead) + (2 * d,), cfg["dtype"])

    def window(buffer):
        if layout == "reverse":
            return buffer[1][tuple(slice(None, None, -2) for _ in lead)][..., :d]
        if layout == "step":
            return buffer[0][tuple(slice(1, None, 2) for _ in lead)][..., d:]
        if layout == "fused":  # q in a fused buffer: leading strides step over other heads
            return buffer[2][tuple(slice(0, n) for n in lead)][..., :d]
        # a feature axis that is not contiguous: correct through a temporary
        return buffer[0][tuple(slice(0, n) for n in lead)][..., ::2]

    view = window(big)
    pos = _positions_for(rng, view.shape[:-1], False)
    expected = ar.rotate(np.ascontiguousarray(view), pos, **kw)
    before = big.copy()
    if mode == "new":
        got = ar.rotate(view, pos, **kw)
        np.testing.assert_array_equal(bits(big), bits(before))
    elif mode == "out":
        got = ar.rotate(view, pos, out=poisoned(view.shape, view.dtype), **kw)
    else:
        got = ar.rotate(view, pos, out=view, **kw)
        assert got is view
        # Everything outside the view is untouched.
        window(before)[...] = expected
        np.testing.assert_array_equal(bits(big), bits(before))
    np.testing.assert_array_equal(bits(got), bits(expected))


@given(configs(max_lead=2), st.integers(1, 4), st.sampled_from(BACKENDS))
def test_rotate_qk_matches_rotate(cfg, group, backend):
    rng, q, kw = _setup(cfg)
    lead = cfg["lead"] or (1,)
    q = random_array(rng, lead + (cfg["d"],), cfg["dtype"])
    # Grouped-query attention: k has fewer heads on the axis before the positions.
    k_lead = lead[:-2] + (max(1, lead[-2] // group),) + lead[-1:] if len(lead) > 1 else lead
    k = random_array(rng, k_lead + (cfg["d"],), cfg["dtype"])
    pos = rng.integers(0, 10**6, size=lead[-1])
    qr, kr = ar.rotate_qk(q, k, pos, backend=backend, **kw)
    np.testing.assert_array_equal(bits(qr), bits(ar.rotate(q, pos, **kw)))
    np.testing.assert_array_equal(bits(kr), bits(ar.rotate(k, pos, **kw)))


@given(configs(), st.booleans())
def test_backends_agree(cfg, inverse):
    rng, x, kw = _setup(cfg)
    pos = _positions_for(rng, cfg["lead"], True)
    kernel = ar.rotate(x, pos, inverse=inverse, backend="numba", **kw)
    reference = ar.rotate(x, pos, inverse=inverse, backend="numpy", **kw)
    # Same float32/float64 operations in the same order: the results agree bit for bit.
    np.testing.assert_array_equal(bits(kernel), bits(reference))


@pytest.mark.parametrize("m", [10, 1000, 10**5, 10**6, 2**24 - 1, 2**31 - 1])
def test_float32_is_exact_at_large_positions(m):
    x = np.random.default_rng(m).standard_normal((4, 128)).astype(np.float32)
    y = ar.rotate(x, m)
    err = np.abs(y.astype(np.float64) - oracle(x, m)).max()
    ulp = np.spacing(np.float32(np.abs(x).max()))
    assert err <= 4 * ulp, f"position {m}: error {err:.3g} is {err / ulp:.1f} float32 ulps"


def _reference(rope, xs, pos, inverse):
    """The reference backend's results: array operations in float32 (float64), the same
    operations in the same order as the kernels, so the same bits."""
    return tuple(rope.rotate(x, pos, inverse=inverse, backend="numpy") for x in xs)


def _every_call_agrees(rope, x, k, pos, inverse, kw):
    """Every way to call on x (and k) gives the reference's bits: allocating, into out=, in
    place, into a strided out, through the module-level functions, and rotate_qk."""
    (want,) = _reference(rope, (x,), pos, inverse)
    new = rope.rotate(x, pos, inverse=inverse)
    given_out = rope.rotate(x, pos, inverse=inverse, out=poisoned(x.shape, x.dtype))
    inplace = x.copy()
    assert rope.rotate(inplace, pos, inverse=inverse, out=inplace) is inplace
    # strided: x and out every other row of a larger buffer (a KV-cache slice, a fused QKV view)
    buffer = poisoned(x.shape[:-1] + (2, x.shape[-1]), x.dtype)
    buffer[..., 0, :] = x
    strided = rope.rotate(buffer[..., 0, :], pos, inverse=inverse, out=buffer[..., 1, :])
    np.testing.assert_array_equal(bits(buffer[..., 0, :]), bits(x))  # x is untouched
    for result in (new, given_out, inplace, strided):
        np.testing.assert_array_equal(bits(result), bits(want))
    assert_matches(new, oracle(x, pos, inverse=inverse, **kw), x)
    np.testing.assert_array_equal(bits(ar.rotate(x, pos, inverse=inverse, **kw)), bits(want))
    qk_want = _reference(rope, (x, k), pos, inverse)
    q_new, k_new = rope.rotate_qk(x, k, pos, inverse=inverse)
    q_in, k_in = x.copy(), k.copy()
    rope.rotate_qk(q_in, k_in, pos, inverse=inverse, out=(q_in, k_in))
    for q_result, k_result in ((q_new, k_new), (q_in, k_in)):
        np.testing.assert_array_equal(bits(q_result), bits(qk_want[0]))
        np.testing.assert_array_equal(bits(k_result), bits(qk_want[1]))


@given(
    configs(),
    st.one_of(
        st.none(),
        st.integers(0, 2**31 - 1),
        st.integers(0, 2**31 - 1).map(np.int64),
        st.integers(0, 255).map(np.uint8),
    ),
    st.booleans(),
)
def test_every_way_to_call_gives_the_same_bits(cfg, pos, inverse):
    # an int, a NumPy integer scalar or default positions; allocating, into out=, in place
    rng, x, kw = _setup(cfg)
    k = random_array(rng, x.shape, x.dtype)
    _every_call_agrees(ar.RoPE(cfg["d"], **kw), x, k, pos, inverse, kw)


@st.composite
def array_positions(draw, lead):
    """Integer positions for a leading shape: one contiguous block of its axes varies, the
    others broadcast (size 1, or dropped on the left), as decode and prefill pass them; or,
    sometimes, a pattern the one-thread row kernel leaves to the general strategy."""
    n = len(lead)
    first = draw(st.integers(0, n))
    stop = draw(st.integers(first, n))
    shape = [lead[k] if first <= k < stop else 1 for k in range(n)]
    if draw(st.booleans()) and n >= 3:
        shape[n - 2] = 1  # a broadcast axis inside the varying block: not a row pattern
    if draw(st.booleans()):
        drop = draw(st.integers(0, n))
        kept = shape[drop:]
        # Dropping axes is refused where it could be (B, T) position_ids against (B, H, T)
        # (test_semantics.py), so there the dropped axes stay, as explicit axes of 1.
        accidental = len(kept) >= 2 and 1 not in kept and any(m > 1 for m in lead[:drop])
        shape = [1] * drop + kept if accidental else kept
    dtype = draw(st.sampled_from([np.int64, np.int32, np.uint16]))
    top = draw(st.sampled_from([50, 4096, 2**31 - 1]))
    seed = draw(st.integers(0, 2**32 - 1))
    return np.random.default_rng(seed).integers(0, top, size=tuple(shape)).astype(dtype)


@given(configs(), st.data(), st.booleans())
def test_every_way_to_call_with_array_positions_gives_the_same_bits(cfg, data, inverse):
    rng, x, kw = _setup(cfg)
    k = random_array(rng, x.shape, x.dtype)
    pos = data.draw(array_positions(cfg["lead"]))
    _every_call_agrees(ar.RoPE(cfg["d"], **kw), x, k, pos, inverse, kw)


@pytest.mark.parametrize("dtype", DTYPES)
def test_small_inputs_with_strided_features_are_rotated_once(dtype, rng):
    # A feature axis that is not contiguous goes through a temporary: each array is rotated
    # exactly once, in place included, and rotate_qk never writes q before it knows k goes too.
    rope = ar.RoPE(8, style="half")
    x = random_array(rng, (3, 8), dtype)
    k = random_array(rng, (2, 8), dtype)
    want_x, want_k = oracle(x, 5, style="half"), oracle(k, 5, style="half")

    def strided(a):
        buffer = poisoned(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
        view = buffer[..., ::2]
        view[...] = a
        return view

    assert_matches(rope.rotate(strided(x), 5), want_x, x)
    out = strided(np.empty_like(x))
    assert rope.rotate(x, 5, out=out) is out
    assert_matches(out, want_x, x)
    in_place = strided(x)
    rope.rotate(in_place, 5, out=in_place)
    assert_matches(in_place, want_x, x)
    for q_in, k_in in ((x.copy(), strided(k)), (strided(x), k.copy())):
        q_view, k_view = q_in, k_in
        got = rope.rotate_qk(q_in, k_in, 5, out=(q_in, k_in))
        assert got[0] is q_in and got[1] is k_in
        assert_matches(q_view, want_x, x)
        assert_matches(k_view, want_k, k)
    q_in = x.copy()
    k_out = strided(np.empty_like(k))
    rope.rotate_qk(q_in, k, 5, out=(q_in, k_out))
    assert_matches(q_in, want_x, x)
    assert_matches(k_out, want_k, k)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", ["interleaved", "half"])
@pytest.mark.parametrize("rotary_dim", [128, 96, 48, 40, 6, 2])
def test_decode_sized_calls_write_the_reference_bits(dtype, style, rotary_dim, rng):
    # The one-thread row kernel rotates float16 and bfloat16 in vector steps (32 bytes, 16,
    # then a pair at a time: these rotary dims take each mix, in both layouts), rows addressed
    # by offset; other types take the row-view loop. Every layout must give the reference's bits
    # and write nothing outside the result: allocated, into out= inside a poisoned buffer (the
    # tail too), into a KV-cache slice from reversed rows, and in place.
    rope = ar.RoPE(128, style=style, rotary_dim=rotary_dim, max_positions=4096)
    x = random_array(rng, (2, 5, 3, 128), dtype)
    for pos, inverse in ((int(rng.integers(0, 4096)), False), (rng.integers(0, 4096, 3), True)):
        (want,) = _reference(rope, (x,), pos, inverse)
        np.testing.assert_array_equal(bits(rope.rotate(x, pos, inverse=inverse)), bits(want))
        buffer = poisoned((2, 5, 3, 130), dtype)
        out = buffer[..., 1:129]  # one element off the buffer's alignment
        rope.rotate(x, pos, inverse=inverse, out=out)
        np.testing.assert_array_equal(bits(out), bits(want))
        np.testing.assert_array_equal(
            bits(buffer[..., [0, 129]]), bits(poisoned((2, 5, 3, 2), dtype))
        )
        cache = poisoned((2, 5, 8, 128), dtype)
        reversed_x = x[::-1, :, ::-1].copy()[::-1, :, ::-1]  # x's values, reversed strides
        rope.rotate(reversed_x, pos, inverse=inverse, out=cache[:, :, 4:7])
        np.testing.assert_array_equal(bits(cache[:, :, 4:7]), bits(want))
        np.testing.assert_array_equal(bits(cache[:, :, :4]), bits(poisoned((2, 5, 4, 128), dtype)))
        np.testing.assert_array_equal(bits(cache[:, :, 7:]), bits(poisoned((2, 5, 1, 128), dtype)))
        in_place = x.copy()
        rope.rotate(in_place, pos, inverse=inverse, out=in_place)
        np.testing.assert_array_equal(bits(in_place), bits(want))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strides_of_part_elements_are_rotated_through_a_copy(dtype, rng):
    # A leading stride that is not a whole number of elements (a view built on raw bytes)
    # cannot be addressed by element offsets: such an array (or out) goes through a copy.
    rope = ar.RoPE(8, style="half")
    x = random_array(rng, (3, 8), dtype)
    buffer = np.zeros(1024, np.uint8)
    odd = np.ndarray((3, 8), dtype, buffer, offset=1, strides=(8 * x.itemsize + 1, x.itemsize))
    odd[...] = x
    want = oracle(x, 5, style="half")
    assert_matches(rope.rotate(odd, 5), want, x)
    np.testing.assert_array_equal(bits(odd), bits(x))  # x untouched
    rope.rotate(odd, 5, out=odd)
    assert_matches(odd, want, x)
    # rotate_qk writes q before it rotates k: such a k (or k's out) must be seen before that
    odd[...] = x
    q_rot, k_rot = rope.rotate_qk(x, odd, 5)
    np.testing.assert_array_equal(bits(k_rot), bits(q_rot))
    assert_matches(q_rot, want, x)
    k_out = np.ndarray((3, 8), dtype, buffer, offset=301, strides=odd.strides)
    q_out = poisoned(x.shape, x.dtype)
    rope.rotate_qk(x, x.copy(), 5, out=(q_out, k_out))
    np.testing.assert_array_equal(bits(k_out), bits(q_out))
    assert_matches(q_out, want, x)
    # an axis of length 1 reaches no second element: its stride does not count
    single = np.ndarray((1, 8), dtype, buffer, offset=600, strides=(17, x.itemsize))
    single[...] = x[:1]
    q_rot, k_rot = rope.rotate_qk(x, single, 5)
    np.testing.assert_array_equal(bits(k_rot), bits(q_rot[:1]))


def test_positions_past_the_cache_or_negative_in_an_array(rng):
    rope = ar.RoPE(8)
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)
    with pytest.raises(ar.RopeValueError, match="non-negative"):
        rope.rotate(x, np.array([[-1], [2]]))
    far = np.array([[100_000], [7]])
    assert_matches(rope.rotate(x, far), oracle(x, far), x)
    assert_matches(rope.rotate(x, far, inverse=True), oracle(x, far, inverse=True), x)
