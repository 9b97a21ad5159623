"""RoPE.rotate_into_cache: q rotated, k rotated into a paged cache, v copied into it, in one
pass.

Without norm and float8 the results and the cache are rotate_qk's and a NumPy scatter's, bit for
bit, over layouts, slots with padding, positions inside and past the cache, multi-axis and
scaled RoPEs; with norm, within float32 rounding of a float64 oracle; with float8, within one
float8 rounding. Refusals write nothing.
"""

import os

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from oracles import DTYPES, assert_matches, bits, oracle, random_array

import arrayrope as ar
from arrayrope import _arrays

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def _qkv(rng, n, hq, hkv, d, dtype, fused):
    """q, k and v of n tokens: views of one fused projection, or arrays of their own."""
    if fused:
        qkv = random_array(rng, (n, (hq + 2 * hkv) * d), dtype)
        q = qkv[:, : hq * d].reshape(n, hq, d)
        k = qkv[:, hq * d : (hq + hkv) * d].reshape(n, hkv, d)
        v = qkv[:, (hq + hkv) * d :].reshape(n, hkv, d)
        return q, k, v
    return tuple(random_array(rng, (n, h, d), dtype) for h in (hq, hkv, hkv))


def _caches(rng, blocks, block, hkv, d, dtype, layout):
    shape = (blocks, block, hkv, d) if layout == "NHD" else (blocks, hkv, block, d)
    return random_array(rng, shape, dtype), random_array(rng, shape, dtype)


def _rows(cache, layout):
    """The cache as (slot, head, d): one row per slot."""
    if layout == "HND":
        cache = cache.transpose(0, 2, 1, 3)
    return cache.reshape(-1, *cache.shape[2:])


ROPES = {
    "half": lambda d: ar.RoPE(d, style="half"),
    "interleaved, partial": lambda d: ar.RoPE(d, rotary_dim=d // 2),
    "half, quarter, YaRN": lambda d: ar.RoPE(
        d, style="half", rotary_dim=max(2, d // 4 // 2 * 2), scaling=ar.scaling.YaRN(4.0, 64)
    ),
    "sectioned (3 axes)": lambda d: ar.RoPE.sectioned(d, (d // 4 - 1, 1, d // 4)),
}


@given(
    dtype=st.sampled_from(DTYPES),
    rope_kind=st.sampled_from(sorted(ROPES)),
    half_d=st.sampled_from([4, 8, 16, 32, 40]),
    n=st.integers(0, 40),
    heads=st.sampled_from([(1, 1), (4, 2), (8, 1), (6, 3)]),
    layout=st.sampled_from(["NHD", "HND"]),
    block=st.sampled_from([1, 4, 16]),
    fused=st.booleans(),
    where=st.sampled_from(["new", "out", "in place"]),
    positions=st.sampled_from(["small", "past the cache", "real"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_matches_rotate_qk_and_a_scatter(
    dtype, rope_kind, half_d, n, heads, layout, block, fused, where, positions, seed
):
    d = 2 * half_d
    hq, hkv = heads
    rng = np.random.default_rng(seed)
    rope = ROPES[rope_kind](d)
    q, k, v = _qkv(rng, n, hq, hkv, d, dtype, fused)
    blocks = max(1, -(-n // block) + 1)
    k_cache, v_cache = _caches(rng, blocks, block, hkv, d, dtype, layout)
    before_k, before_v = k_cache.copy(), v_cache.copy()
    slots = rng.permutation(blocks * block)[:n].astype(np.int64)
    slots[rng.random(n) < 0.2] = -1  # padding
    high = {"small": 1000, "past the cache": 2**31 - 1, "real": 10**6}[positions]
    shape = (n,) if rope.n_axes == 1 else (n, rope.n_axes)
    pos = rng.integers(0, high, size=shape)
    if positions == "real":
        pos = pos + rng.random(shape)
    q_original, k_before, v_before = q.copy(), k.copy(), v.copy()
    want_q, want_k = rope.rotate_qk(q, k, pos[:, None])  # every head at its token's position
    kw = dict(cache_layout=layout)
    if where == "new":
        got = rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots, **kw)
        assert np.array_equal(bits(q), bits(q_original))
    elif where == "out":
        out = np.full(q.shape, np.nan, dtype)
        got = rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots, out=out, **kw)
        assert got is out
    else:
        got = rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots, out=q, **kw)
        assert got is q
    assert np.array_equal(bits(got), bits(want_q))
    if where != "in place":
        assert np.array_equal(bits(q), bits(q_original))
    assert np.array_equal(bits(k), bits(k_before)) and np.array_equal(bits(v), bits(v_before))
    expected_k, expected_v = _rows(before_k, layout).copy(), _rows(before_v, layout).copy()
    used = slots >= 0
    expected_k[slots[used]] = want_k[used]
    expected_v[slots[used]] = v[used]
    assert np.array_equal(bits(_rows(k_cache, layout)), bits(expected_k))
    assert np.array_equal(bits(_rows(v_cache, layout)), bits(expected_v))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_aligned_rows_take_the_vector_steps(dtype, layout, rng):
    # the test above judges both row paths by their bits; this one, that the vector steps serve
    # the common case (views of a fused projection into aligned caches), normed rows too
    from arrayrope.backends.cpu import HARDWARE_F16, _fused_launch

    rope = ar.RoPE(128, style="half")
    q, k, v = _qkv(rng, 4, 8, 2, 128, dtype, fused=True)
    k_cache, v_cache = _caches(rng, 3, 16, 2, 128, dtype, layout)
    cos = sin = np.zeros((10, 64), np.float64 if dtype == np.float64 else np.float32)
    expected = dtype != np.float16 or HARDWARE_F16
    out = np.empty_like(q)
    steps = 3 if expected else 0  # bit 0: q's rows; bit 1: k's and v's
    args = (rope._spec, q, out, k, v, k_cache, v_cache)
    assert _fused_launch.layout_vector(*args, cos, sin) == steps
    fp8 = np.zeros(k_cache.shape, FP8)
    assert _fused_launch.layout_vector(*args[:5], fp8, fp8, cos, sin) == steps & 1
    # a target off the 16-byte grid takes the row loop
    assert _fused_launch.vector_steps(steps, 0, 64, 32, 48) == steps
    assert _fused_launch.vector_steps(steps, 0, 4, 32, 48) == steps & 2
    assert _fused_launch.vector_steps(steps, 0, 64, 32, 40) == steps & 1
    # a large step's bits (see large_step_bits): the prefetch whatever the targets' alignment,
    # each streaming bit with its vector steps; where out is q (in place), Q_IN_PLACE for q's
    prefetch, stream_q, stream_kv = (
        _fused_launch.PREFETCH,
        _fused_launch.STREAM_Q,
        _fused_launch.STREAM_KV,
    )
    large = steps | prefetch | stream_q | stream_kv
    assert _fused_launch.vector_steps(large, 0, 4, 32, 40) == prefetch
    expected = large if steps else prefetch
    assert _fused_launch.vector_steps(large, 0, 64, 32, 48) == expected
    in_place = expected & ~stream_q | (_fused_launch.Q_IN_PLACE if steps else 0)
    assert _fused_launch.vector_steps(large, 64, 64, 32, 48) == in_place
    assert _fused_launch.vector_steps(steps, 64, 64, 32, 48) == steps | (in_place & 32)
    q_only, kv_only = (1 | prefetch | stream_q, 2 | prefetch | stream_kv) if steps else (4, 4)
    assert _fused_launch.vector_steps(large, 0, 64, 32, 40) == q_only
    assert _fused_launch.vector_steps(large, 0, 4, 32, 48) == kv_only


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "case",
    [
        "forward",
        "partial, interleaved",
        "partial, in place",
        "partial, QK-norm",
        "partial, interleaved, QK-norm",
        "reversed",
        "threads, QK-norm",
    ],
)
def test_steps_too_large_for_the_cache_prefetch_and_stream_with_the_same_bits(dtype, case, rng):
    # A large step's bits (prefetch and, on x86-64, streaming stores) are set for inputs of
    # _config.streams_from's bytes (stream_above, times a factor for the 2-byte types); at 0
    # every step sets them. Partial: d = 72, whose rows' tails and v's rows stream in 64- and
    # 16-byte copies (q's not where it is rotated in place).
    # Reversed: tokens at a negative stride (the rows asked for lie below each token's) into an
    # HND cache. QK-norm: normalized rows, made in a scratch row, stream from it where they
    # keep its dtype (float32, float64), tails included, and so do v's rows beside them; on
    # Numba's threads, ranges of one or two tokens, each with its own scratch row. Token 4 is
    # padding: token 2 asks for no k and v rows.
    from arrayrope.backends.cpu import _config, _fused_launch

    reverse, in_place, threads = case == "reversed", "in place" in case, case.startswith("thr")
    normed = case.endswith("QK-norm")
    layout = "HND" if reverse else "NHD"
    d = 72 if case.startswith("partial") else 64
    style = "interleaved" if "interleaved" in case else "half"
    rope = ar.RoPE(d, style=style, rotary_dim=32 if d == 72 else None)
    q, k, v = _qkv(rng, 6, 4, 2, d, dtype, fused=True)
    if reverse:
        q, k, v = q[::-1], k[::-1], v[::-1]
    pos, slots = rng.integers(0, 5000, 6), rng.permutation(48)[:6]
    slots[4] = -1
    weight = rng.uniform(0.5, 1.5, d).astype(np.float32)
    options = {"q_norm": weight, "k_norm": weight} if normed else {}
    streams = _fused_launch.STREAM_Q | _fused_launch.STREAM_KV if _config.STREAMING else 0
    found = []
    # the step of one thread that stores plainly, then the large step (on Numba's threads)
    for stream_above, serial_below in ((1 << 62, 1 << 16), (0, 0 if threads else 1 << 16)):
        with _config.override(stream_above=stream_above, serial_below=serial_below):
            large = _fused_launch.large_step_bits(q, k, v)
            assert large == (0 if stream_above else _fused_launch.PREFETCH | streams)
            k_cache, v_cache = _caches(np.random.default_rng(1), 3, 16, 2, d, dtype, layout)
            results = []
            for _ in range(2):  # without norm, the second call takes the decode loop's way
                out = q.copy() if in_place else np.full_like(q, np.nan)
                got = rope.rotate_into_cache(q if not in_place else out, k, v, pos, k_cache,
                                             v_cache, slots, cache_layout=layout, out=out,
                                             **options)  # fmt: skip
                assert got is out
                results.append(bits(out))
            assert np.array_equal(results[0], results[1])
            found.append((results[0], bits(k_cache), bits(v_cache)))
    for a, b in zip(*found):
        assert np.array_equal(a, b)


def _off_the_grid(a):
    """A copy of ``a`` one element past an aligned start: off the 16-byte grid."""
    memory = np.empty(a.size + 1, a.dtype)[1:]
    memory[...] = a.reshape(-1)
    return memory.reshape(a.shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", ["interleaved", "half"])
@pytest.mark.parametrize("d, rotary_dim", [(128, 128), (128, 64), (40, 32), (36, 32), (6, 4)])
@pytest.mark.parametrize("norms", ["q and k", "q", "k"])
def test_normed_rows_in_vector_steps_have_the_row_loops_bits(dtype, style, d, rotary_dim,
                                                             norms, rng):  # fmt: skip
    # A normed row takes the vector steps where its target is on the 16-byte grid (the sum of
    # squares in vectors of eight, its last group masked where d is not a multiple of 8), the
    # row loop where it is not: the same bits either way.
    from arrayrope.backends.cpu import HARDWARE_F16, _fused_launch

    n, hq, hkv = 11, 4, 2
    rope = ar.RoPE(d, style=style, rotary_dim=rotary_dim)
    q, k, v = _qkv(rng, n, hq, hkv, d, dtype, True)
    q *= rng.uniform(0.1, 100.0, (n, hq, 1)).astype(dtype)  # rows of every scale
    weights = [rng.uniform(0.5, 1.5, d) if name in norms else None for name in "qk"]
    k_cache, v_cache = _caches(rng, 4, 4, hkv, d, dtype, "NHD")
    slots, pos = rng.permutation(16)[:n], rng.integers(0, 10**6, n)
    results = []
    for place in (np.copy, _off_the_grid):
        out, kc, vc = np.full(q.shape, np.nan, dtype), place(k_cache), place(v_cache)
        out = place(out)
        table = np.zeros((1, rotary_dim), np.float32)  # unit-stride rows, as the launch's are
        steps = _fused_launch.layout_vector(rope._spec, q, out, k, v, kc, vc, table, table)
        at = [_arrays.address(a) for a in (q, out, kc, vc)]
        results.append((_fused_launch.vector_steps(steps, *at), out, kc, vc))
        rope.rotate_into_cache(q, k, v, pos, kc, vc, slots, out=out, q_norm=weights[0],
                               k_norm=weights[1], norm_eps=1e-5)  # fmt: skip
    (vector, *aligned), (loop, *shifted) = results
    assert loop == 0
    eligible = (
        (d, rotary_dim) in ((128, 128), (128, 64), (40, 32))
        or ((d, rotary_dim) == (36, 32) and dtype in (np.float32, np.float64))
        or ((d, rotary_dim) == (6, 4) and dtype == np.float64)
    )
    assert vector == (3 if eligible and (dtype != np.float16 or HARDWARE_F16) else 0)
    for a, b in zip(aligned, shifted):
        assert np.array_equal(bits(a), bits(b))


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=str)
def test_strided_norm_weights_are_read_by_their_elements(dtype, rng):
    # weights as views of a larger array (every other element, reversed, a column): the same
    # bits as the same weights made contiguous
    n, hq, hkv, d = 5, 4, 2, 64
    rope = ar.RoPE(d, style="half")
    q, k, v = _qkv(rng, n, hq, hkv, d, dtype, True)
    table = rng.uniform(0.5, 1.5, (2 * d, 3)).astype(np.float32)
    slots, pos = rng.permutation(12)[:n], rng.integers(0, 10**6, n)
    for q_w, k_w in ((table[::2, 0], table[::-2, 1]), (table[:d, 2], table[d:, 0][::-1])):
        results = []
        for weights in ((q_w, k_w), (q_w.copy(), k_w.copy())):
            k_cache, v_cache = np.zeros((3, 4, hkv, d), dtype), np.zeros((3, 4, hkv, d), dtype)
            got = rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots,
                                         q_norm=weights[0], k_norm=weights[1])  # fmt: skip
            results.append((got, k_cache))
        for a, b in zip(*results):
            assert np.array_equal(bits(a), bits(b))


def _rms64(x, weight, eps):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight.astype(np.float64)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", ["interleaved", "half"])
def test_qk_norm_before_the_rotation(dtype, style, rng):
    n, hq, hkv, d = 9, 4, 2, 64
    rope = ar.RoPE(d, style=style, rotary_dim=48)
    q, k, v = _qkv(rng, n, hq, hkv, d, dtype, True)
    q_w, k_w = rng.uniform(0.5, 1.5, d), rng.uniform(0.5, 1.5, d)
    k_cache, v_cache = _caches(rng, 3, 4, hkv, d, dtype, "NHD")
    slots, pos = rng.permutation(12)[:n], rng.integers(0, 10**6, n)
    got = rope.rotate_into_cache(
        q, k, v, pos, k_cache, v_cache, slots, q_norm=q_w, k_norm=k_w, norm_eps=1e-5
    )
    compute = np.float64 if dtype == np.float64 else np.float32  # the weights as taken
    norm_q = _rms64(q, q_w.astype(compute), 1e-5)
    norm_k = _rms64(k, k_w.astype(compute), 1e-5)
    kw = dict(style=style, rotary_dim=48)
    assert_matches(got, oracle(norm_q, pos[:, None], **kw), norm_q)
    assert_matches(_rows(k_cache, "NHD")[slots], oracle(norm_k, pos[:, None], **kw), norm_k)
    assert np.array_equal(bits(_rows(v_cache, "NHD")[slots]), bits(v))


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=str)
@pytest.mark.parametrize("d", [4, 14, 22, 30, 70])
def test_the_sum_of_squares_takes_its_documented_order(d, dtype, rng):
    # rows normalized bit for bit as _fused._inverse_rms documents: element j into partial sum
    # j % 8, the eight added pairwise; the tail past a one-pair rotary part is then
    # x * factor * weight, rounded at each step (d = 4: only the pairwise additions)
    n, hq, hkv = 5, 3, 2
    rope = ar.RoPE(d, rotary_dim=2)
    q, k, v = _qkv(rng, n, hq, hkv, d, dtype, True)
    q *= rng.uniform(0.1, 100.0, (n, hq, 1)).astype(dtype)  # rows of every scale
    weight = rng.uniform(0.5, 1.5, d).astype(dtype)
    k_cache, v_cache = _caches(rng, 2, 4, hkv, d, dtype, "NHD")
    got = rope.rotate_into_cache(q, k, v, np.arange(n), k_cache, v_cache, np.arange(n),
                                 q_norm=weight, norm_eps=1e-5)  # fmt: skip
    squares = q * q
    parts = [np.zeros(q.shape[:-1], dtype) for _ in range(8)]
    for j in range(d):  # in order along the row (numpy's own sum is pairwise)
        parts[j % 8] = parts[j % 8] + squares[..., j]
    total = ((parts[0] + parts[1]) + (parts[2] + parts[3])) + (
        (parts[4] + parts[5]) + (parts[6] + parts[7])
    )
    factor = dtype(1) / np.sqrt(total / dtype(d) + dtype(1e-5))
    want = q[..., 2:] * factor[..., None] * weight[2:]
    assert want.size and np.array_equal(bits(got[..., 2:]), bits(want))


def test_float8_caches_are_scaled_rounded_once_and_saturated(rng):
    n, hq, hkv, d = 16, 2, 2, 32
    rope = ar.RoPE(d, style="half")
    q, k, v = _qkv(rng, n, hq, hkv, d, np.float32, False)
    v[0, 0, :4] = [1e6, -1e6, np.nan, 0.0]  # saturated, saturated, nan, zero
    k_cache = np.zeros((4, 8, hkv, d), FP8)
    v_cache = np.zeros((4, 8, hkv, d), FP8)
    slots, pos = rng.permutation(32)[:n], rng.integers(0, 5000, n)
    rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots, k_scale=0.05, v_scale=2.0)
    k_rot = rope.rotate(k, pos[:, None]).astype(np.float64)

    def float8(values):
        return np.clip(values, -448, 448).astype(FP8)

    got_k = _rows(k_cache, "NHD")[slots].astype(np.float64)
    want_k = float8(k_rot / 0.05).astype(np.float64)
    # k is rotated in float32, then scaled and rounded: at most one float8 step from rounding
    # the exact value once
    step = np.maximum(np.abs(want_k), 2.0**-6) * 2.0**-3
    assert (np.abs(got_k - want_k) <= step).all()
    got_v = _rows(v_cache, "NHD")[slots]
    assert np.array_equal(
        got_v.view(np.uint8), float8(v.astype(np.float32) * np.float32(0.5)).view(np.uint8)
    )
    assert float(got_v[0, 0, 0]) == 448 and float(got_v[0, 0, 1]) == -448
    assert np.isnan(float(got_v[0, 0, 2]))


def test_no_tokens_still_checks_positions(rng):
    rope = ar.RoPE(16)
    q, k, v = _qkv(rng, 0, 2, 1, 16, np.float32, False)
    k_cache, v_cache = _caches(rng, 2, 4, 1, 16, np.float32, "NHD")
    with pytest.raises(ar.RopeValueError, match="pos is required"):
        rope.rotate_into_cache(q, k, v, None, k_cache, v_cache, np.zeros(0, np.int64))


def test_float8_bits_are_the_float32_values_times_the_reciprocal_rounded(rng):
    n, hkv, d = 16, 2, 32
    rope = ar.RoPE(d)
    q, k, v = _qkv(rng, n, 2, hkv, d, np.float32, True)
    k *= 100  # across the float8 range, saturated included
    k_cache, v_cache = (np.zeros((4, hkv, 8, d), FP8) for _ in "kv")
    slots, pos = rng.permutation(32)[:n], rng.integers(0, 10**6, n)
    rope.rotate_into_cache(
        q, k, v, pos, k_cache, v_cache, slots, cache_layout="HND", k_scale=3.0, v_scale=0.7
    )
    k_rot = rope.rotate(k, pos[:, None])

    def float8(values, scale):
        scaled = values * np.float32(1 / scale)  # float32 arithmetic
        return np.clip(scaled, -448, 448).astype(FP8).view(np.uint8)

    assert np.array_equal(_rows(k_cache, "HND")[slots].view(np.uint8), float8(k_rot, 3.0))
    assert np.array_equal(_rows(v_cache, "HND")[slots].view(np.uint8), float8(v, 0.7))


def test_views_that_start_between_their_owners_elements(rng):
    # a float32 view 3 bytes into its owner: the launcher must not address it through the owner
    n, hq, d = 10, 3, 16
    buffer = bytearray(4 * n * 2 * hq * d + 8)
    owner = np.frombuffer(buffer, np.float32, count=n * 2 * hq * d + 1, offset=1)
    shifted = owner.view(np.uint8)[3 : 3 + 4 * n * 2 * hq * d].view(np.float32)
    q = shifted.reshape(n, 2 * hq, d)[:, ::2]
    q[...] = rng.standard_normal(q.shape)
    assert q.base is owner and q.ctypes.data % 4 == 0
    rope = ar.RoPE(d, style="half")
    k, v = _qkv(rng, n, hq, 1, d, np.float32, False)[1:]
    k_cache, v_cache = _caches(rng, 3, 4, 1, d, np.float32, "NHD")
    pos, slots = rng.integers(0, 5000, n), rng.permutation(12)[:n]
    got = rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots)
    assert np.array_equal(bits(got), bits(rope.rotate(q.copy(), pos[:, None])))


def test_seq_len_gives_a_length_dependent_rule_its_length(rng):
    rope = ar.RoPE(32, scaling=ar.scaling.DynamicNTK(2.0, 64))
    q, k, v = _qkv(rng, 5, 4, 2, 32, np.float32, True)
    k_cache, v_cache = _caches(rng, 2, 4, 2, 32, np.float32, "NHD")
    pos, slots = np.array([3, 9, 1, 0, 40]), np.array([7, 0, 3, -1, 2])
    got = rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots, seq_len=500)
    want_q, want_k = rope.rotate_qk(q, k, pos[:, None], seq_len=500)
    assert np.array_equal(bits(got), bits(want_q))
    assert np.array_equal(bits(_rows(k_cache, "NHD")[[7, 0, 3, 2]]), bits(want_k[[0, 1, 2, 4]]))
    default = rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots)
    assert np.array_equal(bits(default), bits(rope.rotate(q, pos[:, None])))  # max(pos) + 1
    assert not np.array_equal(bits(default), bits(got))


def test_refusals_write_nothing(rng):
    n, hq, hkv, d = 4, 2, 1, 16
    rope = ar.RoPE(d)
    q, k, v = _qkv(rng, n, hq, hkv, d, np.float32, False)
    k_cache, v_cache = _caches(rng, 2, 4, hkv, d, np.float32, "NHD")
    before = k_cache.copy(), v_cache.copy()
    pos, slots = np.arange(n), np.array([0, 1, 2, 3])
    cases = [
        ({"slots": np.array([0, 1, 2, 8])}, ar.RopeValueError, r"below .* \(8\), got 8"),
        ({"slots": np.array([0, 1, 1, 2])}, ar.RopeValueError, "distinct .* slot 1 2 times"),
        ({"slots": np.array([0, 1.0, 2, 3])}, ar.RopeTypeError, "slots must hold integers"),
        ({"slots": np.array([0, 1, 2])}, ar.RopeValueError, r"shape \(4,\), one per token"),
        ({"cache_layout": "THD"}, ar.RopeValueError, "cache_layout must be"),
        ({"k_scale": 2.0}, ar.RopeValueError, "k_scale scales a float8 cache"),
        ({"v": v[:, :, :8]}, ar.RopeValueError, r"v must have shape \(4, 1, 16\)"),
        ({"v": np.repeat(v, 2, 1)}, ar.RopeValueError, r"one number of heads, .* v \(4, 2, 16\)"),
        (
            {"k": np.repeat(k, 2, 1), "v": np.repeat(v, 2, 1)},
            ar.RopeValueError,
            r"has Hkv=1 and head_dim=16; k has Hkv=2",
        ),
        ({"k": k.astype(np.float64)}, ar.RopeTypeError, "k must have dtype float32"),
        ({"v_cache": v_cache[:1]}, ar.RopeValueError, "v_cache must have shape"),
        ({"q_norm": np.ones(8)}, ar.RopeValueError, r"q_norm must be a float array of shape"),
        ({"pos": np.arange(3)}, ar.RopeValueError, "pos of shape"),
        ({"pos": -1}, ar.RopeValueError, "non-negative"),
        ({"k_cache": k_cache, "v_cache": k_cache}, ar.RopeValueError, "share memory"),
        (
            {"out": k_cache.reshape(-1)[: n * hq * d].reshape(n, hq, d)},
            ar.RopeValueError,
            "share memory",
        ),  # fmt: skip
        (
            {
                "out": np.lib.stride_tricks.as_strided(
                    np.empty((1, hq, d), np.float32), (n, hq, d), (0, 4 * d, 4), writeable=True
                )
            },
            ar.RopeValueError,
            "out has elements that share memory",
        ),  # fmt: skip
        ({"slots": np.array([0, 1, 2, 2**63 + 5], np.uint64)}, ar.RopeValueError, "below"),
        ({"v_cache": None}, ar.RopeTypeError, "v_cache must be a NumPy array"),
        ({"q": q.tolist()}, ar.RopeTypeError, "q must be a NumPy array"),
        ({"norm_eps": "small"}, ar.RopeTypeError, "norm_eps must be a number"),
        ({"seq_len": 10}, ar.RopeValueError, "seq_len applies to length-dependent"),
        ({"pos": None}, ar.RopeValueError, "pos is required"),
        ({"pos": np.array([0, -1, 2, 3])}, ar.RopeValueError, "non-negative"),
        ({"pos": np.array([0, 1, 2**31, 3])}, ar.RopeValueError, "below 2\\*\\*31"),
        ({"slots": np.array([0, 1, 1, 2], np.int32)}, ar.RopeValueError, "slot 1 2 times"),
    ]
    for change, error, message in cases:
        args = dict(q=q, k=k, v=v, pos=pos, k_cache=k_cache, v_cache=v_cache, slots=slots)
        args.update(change)
        with pytest.raises(error, match=message):
            rope.rotate_into_cache(
                args.pop("q"), args.pop("k"), args.pop("v"), args.pop("pos"),
                args.pop("k_cache"), args.pop("v_cache"), args.pop("slots"), **args,
            )  # fmt: skip
        assert np.array_equal(bits(k_cache), bits(before[0]))
        assert np.array_equal(bits(v_cache), bits(before[1]))


@pytest.mark.parametrize("n", [5, 200])  # slots compared pairwise, and sorted
def test_slots_checked_at_every_length(n, rng):
    rope = ar.RoPE(16)
    q, k, v = _qkv(rng, n, 2, 1, 16, np.float32, False)
    k_cache, v_cache = _caches(rng, n // 4 + 2, 4, 1, 16, np.float32, "NHD")
    pos = rng.integers(0, 1000, n)
    slots = rng.permutation(k_cache.shape[0] * 4)[:n].astype(np.int64)
    slots[:3] = -1  # padding: repeated, and never a duplicate
    before = k_cache.copy()
    rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots)
    assert not np.array_equal(k_cache, before)
    twice = slots.copy()
    twice[-1] = twice[3]
    with pytest.raises(ar.RopeValueError, match=f"slot {twice[3]} 2 times"):
        rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, twice)
    past = slots.copy()
    past[n // 2] = k_cache.shape[0] * 4
    with pytest.raises(ar.RopeValueError, match=f"got {past[n // 2]}"):
        rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, past)


def test_checks_kept_per_layout_still_see_each_call(rng):
    # the layout checks are kept per layout (shapes, strides, dtypes, flags): a later call whose
    # arrays differ in any of those is checked again
    rope = ar.RoPE(16)
    q, k, v = _qkv(rng, 4, 2, 1, 16, np.float32, True)
    k_cache, v_cache = _caches(rng, 2, 4, 1, 16, np.float32, "NHD")
    pos, slots = np.arange(4), np.array([0, 1, 2, 3])
    rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots)
    before = k_cache.copy()
    k_cache.flags.writeable = False
    with pytest.raises(ar.RopeValueError, match="k_cache is read-only"):
        rope.rotate_into_cache(q, k, v, pos + 1, k_cache, v_cache, slots)
    k_cache.flags.writeable = True
    with pytest.raises(ar.RopeValueError, match="out must have shape"):
        rope.rotate_into_cache(q, k, v, pos + 1, k_cache, v_cache, slots, out=q[:2])
    for layout in (["NHD"], np.array("NHD"), np.array(["NHD", "HND"])):
        with pytest.raises(ar.RopeValueError, match="cache_layout must be"):
            rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots, cache_layout=layout)
    assert np.array_equal(k_cache, before)


@pytest.mark.parametrize("alias", ["q", "out"])
def test_out_at_qs_address_reached_another_way_is_in_place(alias, rng):
    # out and q one layout at one address, one a view through its contiguous owner and the
    # other an as_strided alias (addressed through flat_view): in place, and nothing written
    # past the region
    rope = ar.RoPE(16)
    n, hq, d = 3, 2, 16
    k_cache, v_cache = _caches(rng, 2, 4, 1, 16, np.float32, "NHD")
    k = rng.standard_normal((n, 1, d)).astype(np.float32)
    v = k.copy()
    pos, slots = np.array([1, 2, 3]), np.array([0, 1, 2])
    size = n * (hq + 1) * d
    big = np.full(size + 64, np.nan, np.float32)
    big[:size] = rng.standard_normal(size)
    region = big[:size].reshape(n, (hq + 1) * d)
    view = region[:, d:].reshape(n, hq, d)
    other = np.lib.stride_tricks.as_strided(region[:, d:], view.shape, view.strides)
    q, out = (other, view) if alias == "q" else (view, other)
    want = rope.rotate(np.array(q), pos[:, None])
    rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots, out=out)
    assert np.array_equal(bits(view), bits(want))
    assert np.isnan(big[size:]).all()


def test_the_layers_of_a_step_past_the_cap_make_its_rows_once(monkeypatch, rng):
    # a decode step's layers rotate at one step's positions: past the cap, the rows made for a
    # step serve its other layers and the next step at the same positions; new positions (in
    # the same array too) make new rows
    rope = ar.RoPE(16, style="half", max_positions=64)
    n, hq, hkv, d = 4, 3, 2, 16
    k_cache, v_cache = _caches(rng, 4, 4, hkv, d, np.float32, "NHD")
    tables = rope._engine.freq_set(None).tables
    made = []  # per step, how many times rotate_into_cache made rows
    integer_rows = tables.integer_rows
    counting = [False]

    def counted(*args):
        made[-1] += counting[0]
        return integer_rows(*args)

    monkeypatch.setattr(tables, "integer_rows", counted)
    pos = rng.integers(64, 2**31, n)
    for step in range(3):
        made.append(0)
        if step == 2:
            pos[1] += 1  # the same array, another position
        for _layer in range(3):
            q, k, v = _qkv(rng, n, hq, hkv, d, np.float32, True)
            slots = rng.permutation(16)[:n].astype(np.int64)
            want_q, want_k = rope.rotate_qk(q, k, pos[:, None])
            counting[0] = True
            got = rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots)
            counting[0] = False
            assert np.array_equal(bits(got), bits(want_q))
            assert np.array_equal(bits(k_cache.reshape(-1, hkv, d)[slots]), bits(want_k))
            assert np.array_equal(bits(v_cache.reshape(-1, hkv, d)[slots]), bits(v))
    assert tables.past_the_cap
    assert made[1:] == [0, 1]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("where", ["new", "out", "in place"])
def test_a_decode_loop_checks_each_step(dtype, where, rng):
    # From the second step on, a loop's layouts are known (kept per layout): each step still
    # gets rotate_qk's and a scatter's bits, and what a step's own values get wrong is refused
    # with nothing written
    rope = ar.RoPE(16, style="half", max_positions=64)
    n, hq, hkv, d = 4, 3, 2, 16
    k_cache, v_cache = _caches(rng, 4, 4, hkv, d, dtype, "HND")
    for step in range(8):
        q, k, v = _qkv(rng, n, hq, hkv, d, dtype, True)
        # positions inside the table, then past it (64 rows), then inside it again (rows made
        # for the call once a loop has gone past the cap)
        pos = rng.integers(64, 2**31, n) if 4 <= step < 6 else rng.integers(0, 60, n)
        slots = rng.permutation(16)[:n].astype(np.int64)
        want_q, want_k = rope.rotate_qk(q, k, pos[:, None])
        expected_k, expected_v = _rows(k_cache, "HND").copy(), _rows(v_cache, "HND").copy()
        expected_k[slots], expected_v[slots] = want_k, v
        out = {"new": None, "out": np.full(q.shape, np.nan, dtype), "in place": q}[where]
        got = rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots, out=out,
                                     cache_layout="HND")  # fmt: skip
        assert out is None or got is out
        assert np.array_equal(bits(got), bits(want_q))
        assert np.array_equal(bits(_rows(k_cache, "HND")), bits(expected_k))
        assert np.array_equal(bits(_rows(v_cache, "HND")), bits(expected_v))
        # past the cap once, this RoPE's steps make their rows first
        assert bool(rope._engine.freq_set(None).tables.past_the_cap) == (step >= 4)
    q, k, v = _qkv(rng, n, hq, hkv, d, dtype, True)
    before = k_cache.copy(), v_cache.copy(), q.copy()
    bad = {
        "slots must be distinct": (np.arange(n), np.array([1, 5, 1, 2])),
        "slots must be below": (np.arange(n), np.array([1, 5, 16, 2])),
        "pos must": (np.array([1, -2, 3, 4]), np.arange(n)),
    }
    for message, (pos, slots) in bad.items():
        with pytest.raises(ar.RopeValueError, match=message):
            rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots, cache_layout="HND")
    for a, b in zip(before, (k_cache, v_cache, q)):
        assert np.array_equal(bits(a), bits(b))


@given(
    dtype=st.sampled_from(DTYPES),
    layout=st.sampled_from(["NHD", "HND"]),
    tokens=st.sampled_from(["fused", "reversed", "own arrays"]),
    where=st.sampled_from(["new", "out", "strided out", "in place"]),
    every_other_block=st.booleans(),
    far=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_decode_loop_over_any_layout(dtype, layout, tokens, where, every_other_block, far,
                                       seed):  # fmt: skip
    # After the first step a loop's layouts are known, and the compiled launch makes the flat
    # views of arrays of any strides (descending, every other block of a cache), at positions
    # in the table or past it: each step has rotate_qk's and a scatter's bits, and nothing
    # outside the arrays is written
    from arrayrope import _kv_step

    rng = np.random.default_rng(seed)
    rope = ar.RoPE(32, style="half", rotary_dim=16)
    n, hq, hkv, d = 5, 3, 2, 32
    blocks, block = 4, 4
    spare = 2 if every_other_block else 1
    k_all, v_all = _caches(rng, spare * blocks, block, hkv, d, dtype, layout)
    k_cache, v_cache = k_all[::spare], v_all[::spare]
    for _ in range(3):
        q, k, v = _qkv(rng, n, hq, hkv, d, dtype, tokens != "own arrays")
        if tokens == "reversed":
            q, k, v = q[::-1], k[::-1], v[::-1]
        pos = rng.integers(0, 2**31 - 1 if far else 1000, n)  # far: rows made for the call
        slots = rng.permutation(blocks * block)[:n].astype(np.int64)
        slots[rng.random(n) < 0.2] = -1
        want_q, want_k = rope.rotate_qk(q, k, pos[:, None])
        expected_k, expected_v = _rows(k_cache, layout).copy(), _rows(v_cache, layout).copy()
        between = slice(1, None, 2) if every_other_block else slice(0)  # blocks not in use
        skipped = k_all[between].copy(), v_all[between].copy()
        used = slots >= 0
        expected_k[slots[used]], expected_v[slots[used]] = want_k[used], v[used]
        outer = np.full((n, hq + 1, d + 8), np.nan, dtype)
        out = {
            "new": None, "out": np.full(q.shape, np.nan, dtype),
            "strided out": outer[:, 1:, 4 : d + 4], "in place": q,
        }[where]  # fmt: skip
        got = rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots, out=out,
                                     cache_layout=layout)  # fmt: skip
        assert out is None or got is out
        assert np.array_equal(bits(got), bits(want_q))
        assert np.array_equal(bits(_rows(k_cache, layout)), bits(expected_k))
        assert np.array_equal(bits(_rows(v_cache, layout)), bits(expected_v))
        assert np.array_equal(bits(k_all[between]), bits(skipped[0]))
        assert np.array_equal(bits(v_all[between]), bits(skipped[1]))
        if where == "strided out":
            outer[:, 1:, 4 : d + 4] = 0
            assert np.isnan(outer.astype(np.float32)).sum() == outer.size - got.size
        key = _kv_step.step_key(rope._spec, q, k, v, pos, k_cache, v_cache, slots, out, layout)
        assert _kv_step._steps.get(key) is not None  # the next step of this layout: short


def test_ropes_that_share_a_loops_layouts_each_keep_their_own(rng):
    # layers of two RoPEs (another rotary part, another style, another base) take turns on one
    # loop's arrays: each step is its own RoPE's rotation
    ropes = [
        ar.RoPE(32, style="half"), ar.RoPE(32, rotary_dim=16), ar.RoPE(32, base=10**6),
        ar.RoPE(32, style="half", rotary_dim=8),
    ]  # fmt: skip
    n, hq, hkv, d = 4, 2, 1, 32
    k_cache, v_cache = _caches(rng, 2, 8, hkv, d, np.float32, "NHD")
    for _ in range(3):
        for rope in ropes:
            q, k, v = _qkv(rng, n, hq, hkv, d, np.float32, True)
            pos, slots = rng.integers(0, 500, n), rng.permutation(16)[:n]
            want_q, want_k = rope.rotate_qk(q, k, pos[:, None])
            got = rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots)
            assert np.array_equal(got, want_q)
            assert np.array_equal(_rows(k_cache, "NHD")[slots], want_k)


def test_a_decode_loop_still_sees_arrays_that_share_memory(rng):
    # out of the layout of an earlier step's out, now inside k's cache: refused
    rope = ar.RoPE(8)
    n, d = 2, 8
    memory = np.zeros(2 * n * d, np.float32)
    k_cache = memory[: n * d].reshape(n, 1, 1, d)  # n blocks of one slot
    v_cache = np.zeros_like(k_cache)
    q, k, v = _qkv(rng, n, 1, 1, d, np.float32, True)
    pos, slots = np.arange(n), np.arange(n)
    elsewhere = np.zeros(2 * n * d, np.float32)
    for _ in range(2):
        rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots,
                               out=elsewhere[n * d :].reshape(n, 1, d))  # fmt: skip
    inside = memory[: n * d].reshape(n, 1, d)  # the same layout and flags, in k_cache
    with pytest.raises(ar.RopeValueError, match="share memory"):
        rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots, out=inside)
    # and a RoPE of another kind with the same layouts takes its own way
    dynamic = ar.RoPE(8, scaling=ar.scaling.DynamicNTK(2.0, 4))
    far = np.array([10, 50])
    got = dynamic.rotate_into_cache(q, k, v, far, k_cache, v_cache, slots,
                                    out=elsewhere[n * d :].reshape(n, 1, d))  # fmt: skip
    assert np.array_equal(bits(got), bits(dynamic.rotate(q, far[:, None])))


@given(
    stride=st.integers(1, 24),
    shapes=st.tuples(*[st.integers(1, 4)] * 6),
    steps=st.tuples(*[st.integers(1, 6)] * 4),
    offsets=st.tuples(st.integers(0, 40), st.integers(0, 40)),
)
def test_the_launch_sees_every_shared_byte_of_token_rows(stride, shapes, steps, offsets):
    # The compiled launch tells out from q, k and v of one projection by their tokens' rows:
    # it may call arrays that share no element overlapping where a row has gaps (then the
    # general way decides), but never misses an element they share, and tells rows without
    # gaps apart exactly
    from arrayrope.backends.cpu._fused_launch import _extent, _rows_meet

    memory = np.zeros(400, np.float32)
    views = []
    for (n, h, d), (s1, s2), at in zip(
        (shapes[:3], shapes[3:]), (steps[:2], steps[2:]), offsets
    ):  # fmt: skip
        strides = (stride * 4, s1 * 4, s2 * 4)
        views.append(np.lib.stride_tricks.as_strided(memory[at:], (n, h, d), strides))
    a, b = views
    met = _rows_meet(a, a.ctypes.data, _extent(a), b, b.ctypes.data, _extent(b))
    shared = np.shares_memory(a, b, max_work=None)
    assert met or not shared
    rows = [v.shape[2] == 1 or v.strides[2] == 4 for v in views]
    rows = [r and (v.shape[1] == 1 or v.strides[1] == v.shape[2] * 4) for r, v in zip(rows, views)]
    fits = all((v.shape[1] * v.shape[2]) * 4 <= v.strides[0] for v in views)
    if all(rows) and fits:  # each token's row one run of elements, inside the token stride
        assert met == shared


def test_in_place_on_a_fused_projection_takes_the_short_way(rng):
    # out=q on views of one projection: out's span meets k's and v's, but no row does
    from arrayrope import _kv_step

    rope = ar.RoPE(32, style="half")
    k_cache, v_cache = _caches(rng, 4, 4, 2, 32, np.float32, "NHD")
    for step in range(3):
        q, k, v = _qkv(rng, 5, 3, 2, 32, np.float32, True)
        pos, slots = rng.integers(0, 1000, 5), rng.permutation(16)[:5]
        want_q, want_k = rope.rotate_qk(q, k, pos[:, None])
        if step == 0:
            got = rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots, out=q)
        else:  # the layouts are known: the short way takes the step
            args = (q, k, v, pos, k_cache, v_cache, slots, q, "NHD")
            got = _kv_step.step(rope, *args, _kv_step.step_key(rope._spec, *args))
        assert got is q and np.array_equal(q, want_q)
        assert np.array_equal(_rows(k_cache, "NHD")[slots], want_k)
    # out over k's rows alone, or v's alone (each token's row: q, k, 32 spare features, v):
    # refused by the short way, named by the general way
    row = rng.standard_normal((5, 256)).astype(np.float32)
    q, k, v = (row[:, a:b].reshape(5, -1, 32) for a, b in ((0, 96), (96, 160), (192, 256)))
    rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots, out=q)  # out's layout known
    for out in (row[:, 96:192], row[:, 160:256]):
        out = out.reshape(5, 3, 32)
        key = _kv_step.step_key(rope._spec, q, k, v, pos, k_cache, v_cache, slots, out, "NHD")
        assert _kv_step._steps.get(key) is not None  # the layouts are known: the launch refuses
        assert _kv_step.step(rope, q, k, v, pos, k_cache, v_cache, slots, out, "NHD", key) is None
        with pytest.raises(ar.RopeValueError, match="share memory"):
            rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots, out=out)


def test_a_loop_on_read_only_inputs_takes_the_launchs_own_build(rng, monkeypatch):
    # read-only q, k, v and positions (np.asarray of a JAX array is read-only): from the second
    # step on, the short way aliases them before the launch, which then finds its build (a type
    # miss costs Numba's dispatcher more than the step)
    from arrayrope.backends.cpu import _fused_launch

    real = _fused_launch.fused_step

    def launch(*args):
        assert all(a.flags.writeable for a in args if isinstance(a, np.ndarray))
        return real(*args)

    rope = ar.RoPE(32, style="half")
    k_cache, v_cache = _caches(rng, 4, 4, 2, 32, np.float32, "NHD")
    for step in range(3):
        q, k, v = _qkv(rng, 5, 3, 2, 32, np.float32, True)
        pos, slots = rng.integers(0, 10**6, 5), rng.permutation(16)[:5]
        for a in (q, k, v, pos):
            a.flags.writeable = False
        if step == 1:
            monkeypatch.setattr(_fused_launch, "fused_step", launch)
        want_q, want_k = rope.rotate_qk(q, k, pos[:, None])
        got = rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots)
        assert np.array_equal(got, want_q)
        assert np.array_equal(_rows(k_cache, "NHD")[slots], want_k)
        assert np.array_equal(_rows(v_cache, "NHD")[slots], v)
    # the general way (a norm) aliases them before its launch too
    weight = rng.standard_normal(32).astype(np.float32)
    caches = k_cache.copy(), v_cache.copy()
    writable = (a.copy() for a in (q, k, v, pos))
    want = rope.rotate_into_cache(*writable, *caches, slots, k_norm=weight)
    got = rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots, k_norm=weight)
    assert np.array_equal(got, want) and np.array_equal(k_cache, caches[0])


def test_read_only_inputs_share_the_steps_disk_cache(tmp_path, seeded_kernel_cache):
    # q, k and v read-only in one process (JAX's buffers always are), writable in the others:
    # all run fused_step's one build, the read-only one loading it from the disk cache (it
    # saves no build of its own)
    import subprocess
    import sys

    script = (
        "import sys, numpy as np, arrayrope as ar\n"
        "rope = ar.RoPE(32, style='half')\n"
        "q, k = np.ones((3, 4, 32), np.float32), np.ones((3, 2, 32), np.float32)\n"
        "v, kc = k.copy(), np.zeros((2, 4, 2, 32), np.float32)\n"
        "if sys.argv[1] == 'read-only':\n"
        "    [a.setflags(write=False) for a in (q, k, v)]\n"
        "rope.rotate_into_cache(q, k, v, np.arange(3), kc, kc.copy(), np.arange(3))\n"
        "assert np.array_equal(kc[0, :3], rope.rotate(k, np.arange(3)[:, None]))\n"
    )
    cache = seeded_kernel_cache(tmp_path / "cache")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}

    def builds():  # a save rewrites the index and writes a build
        return sorted((p.name, p.stat().st_mtime_ns) for p in cache.rglob("*fused_step*.nb[ic]"))

    for i, kind in enumerate(("writable", "read-only", "writable")):
        saved = builds()
        done = subprocess.run([sys.executable, "-c", script, kind], env=env, timeout=600)
        assert done.returncode == 0, kind
        assert i == 0 or builds() == saved, kind  # the first run compiles what is missing
