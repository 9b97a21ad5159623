"""Positions past the cos/sin cache, up to 2**31 - 1: rows from the level tables by angle
addition, on every route (decode steps, batches of rows, the general kernels, blocks of
positions), judged by the float64 oracle and by the cache's own values."""

import numpy as np
import pytest
from conftest import DTYPES, assert_matches, bits, oracle, poisoned, random_array
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import arrayrope as ar
from arrayrope import _past_cap
from arrayrope.backends import cpu
from arrayrope.backends.cpu import _config
from arrayrope.backends.cpu._angles import DIGIT, LEVEL_ROWS
from arrayrope.scaling import Linear, Llama3, YaRN

# digit edges of the level tables, the top of the range, and anything between
EDGES = [0, 1, DIGIT - 1, DIGIT, DIGIT**2 - 1, DIGIT**2, DIGIT**2 + DIGIT - 1, 2**31 - 1]
large_positions = st.one_of(st.sampled_from(EDGES), st.integers(0, 2**31 - 1))


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of a few positions, so that small arrays cross many block edges; on the filled
    route, buffers of a few rows (7 of float32 at rotary_dim 16), so that they cross chunk
    edges and leave rows past the last whole chunk."""
    monkeypatch.setattr(_past_cap, "BLOCK_BYTES", 256)
    monkeypatch.setattr(cpu, "_FILL_BYTES", 7 * 2 * 8 * 4)


def _ulps(a, b, dtype):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b) / float(np.finfo(dtype).eps)


rules = st.sampled_from([None, Linear(4.0), YaRN(8.0, 4096), Llama3(8.0, 1.0, 4.0, 8192)])


@given(
    st.lists(large_positions, min_size=1, max_size=12),
    st.sampled_from([8, 64, 80, 128]),
    rules,
    st.sampled_from([np.float32, np.float64]),
)
def test_level_rows_are_the_cache_values_at_any_position(positions, rotary_dim, rule, dtype):
    rope = ar.RoPE(rotary_dim, style="half", scaling=rule)
    tables = rope._default.tables
    values = np.array(positions, np.int64)[:, None]
    rows = tables.integer_rows(dtype, values)
    exact = tables.exact(np, dtype, values.astype(np.float64))  # numpy's cos of fl(m * theta)
    assert rows.shape == exact.shape == (2, len(positions), rotary_dim // 2)
    assert rows.dtype == dtype
    # rounded once from a float64 value a few float64 ulps from numpy's: float32 agrees to
    # the bit but where the two sit on either side of a rounding boundary
    assert _ulps(rows, exact, dtype).max() <= (1 if dtype == np.float32 else 8)


def test_level_rows_refuse_positions_outside_the_range():
    tables = ar.RoPE(16)._default.tables
    for bad in (-1, 2**31, -(2**40)):
        assert tables.integer_rows(np.float32, np.array([[5], [bad]])) is None
    assert tables.level_bytes() == 2 * LEVEL_ROWS * 8 * 8  # 8 pairs, float64


def test_level_rows_of_a_multi_axis_rope():
    rope = ar.RoPE.axial((8, 12, 12))
    tables = rope._default.tables
    values = np.array([[0, 2**31 - 1, 5], [DIGIT**2, DIGIT, 70000], [3, 4, 2**30]], np.int64)
    rows = tables.integer_rows(np.float32, values)
    exact = tables.exact(np, np.float32, values.astype(np.float64))
    assert _ulps(rows, exact, np.float32).max() <= 1


def _rotated(rope, x, pos, inverse, mode):
    """``rope.rotate`` of x into a new array, into a poisoned ``out`` or in place (a copy)."""
    if mode == "fresh":
        return rope.rotate(x, pos, inverse=inverse)
    if mode == "out":
        got = poisoned(x.shape, x.dtype)
        assert rope.rotate(x, pos, inverse=inverse, out=got) is got
        return got
    got = x.copy()
    rope.rotate(got, pos, inverse=inverse, out=got)
    return got


@given(
    large_positions,
    st.sampled_from(DTYPES),
    st.sampled_from(["interleaved", "half"]),
    st.sampled_from([64, 16]),
    st.sampled_from(["fresh", "out", "in place"]),
    st.booleans(),
)
def test_decode_steps_past_the_cache(pos, dtype, style, rotary_dim, mode, inverse):
    rng = np.random.default_rng(pos)
    rope = ar.RoPE(64, style=style, rotary_dim=rotary_dim)
    x = random_array(rng, (1, 4, 1, 64), dtype)
    want = oracle(x, pos, style=style, rotary_dim=rotary_dim, inverse=inverse)
    for _ in range(2):  # the first call past the cap, then the plan's own route for it
        got = _rotated(rope, x, pos, inverse, mode)
        assert_matches(got, want, x)
        np.testing.assert_array_equal(bits(got[..., rotary_dim:]), bits(x[..., rotary_dim:]))


@given(
    st.lists(large_positions, min_size=1, max_size=4),
    st.sampled_from(DTYPES),
    st.sampled_from(["interleaved", "half"]),
    st.sampled_from(["fresh", "out", "in place"]),
    st.booleans(),
)
def test_decode_steps_at_one_entry_position_arrays(positions, dtype, style, mode, inverse):
    """A loop that passes each step's position as an array: once one went past the cap, every
    later step (small positions too) rotates by the row made for its position."""
    rng = np.random.default_rng(positions[0])
    rope = ar.RoPE(64, style=style, rotary_dim=32)
    x = random_array(rng, (1, 4, 1, 64), dtype)
    for pos in [2**31 - 1, *positions]:
        p = np.array([[pos]])
        want = oracle(x, pos, style=style, rotary_dim=32, inverse=inverse)
        assert_matches(_rotated(rope, x, p, inverse, mode), want, x)
    out = poisoned(x.shape, x.dtype)
    for bad, match in ((-1, "non-negative"), (2**31, "below 2\\*\\*31")):
        with pytest.raises(ar.RopeValueError, match=match):
            rope.rotate(x, np.array([[bad]]), out=out)
        assert np.isnan(out.astype(np.float64)).all()


@given(
    st.lists(large_positions, min_size=1, max_size=6),
    st.sampled_from(DTYPES),
    st.sampled_from(["interleaved", "half"]),
    st.integers(0, 2**32 - 1),
)
def test_batches_of_rows_past_the_cache(positions, dtype, style, seed):
    rng = np.random.default_rng(seed)
    rope = ar.RoPE(32, style=style)
    pos = np.array(positions)[:, None, None]  # one position per sequence: (B, 1, 1)
    q = random_array(rng, (len(positions), 4, 1, 32), dtype)
    k = random_array(rng, (len(positions), 2, 1, 32), dtype)
    for _ in range(2):
        q_rot, k_rot = rope.rotate_qk(q, k, pos)
        assert_matches(q_rot, oracle(q, pos, style=style), q)
        assert_matches(k_rot, oracle(k, pos, style=style), k)
        assert_matches(rope.rotate(q, pos), oracle(q, pos, style=style), q)
    # after positions past the cap, bad ones are still refused, with nothing written
    out = poisoned(q.shape, q.dtype)
    with pytest.raises(ar.RopeValueError, match="non-negative"):
        rope.rotate(q, -pos - 1, out=out)
    assert np.isnan(out.astype(np.float64)).all()
    with pytest.raises(ar.RopeValueError, match="below 2\\*\\*31"):
        rope.rotate(q, pos + 2**31)


LAYOUTS = [
    # (x's shape, positions' shape): (B, H, T, d) with (T,) and (B, 1, T); (B, T, H, d) with
    # (T, 1); packed (N, H, d) with (N, 1)
    ((2, 3, 40, 16), (40,)),
    ((2, 3, 40, 16), (2, 1, 40)),
    ((2, 40, 3, 16), (40, 1)),
    ((70, 3, 16), (70, 1)),
]


@pytest.fixture(params=["filled", "blocks"])
def route(request, monkeypatch):
    """Large calls past the cap: rows filled inside the direct path's kernel, or (multi-axis
    RoPEs, layouts the direct path refuses) per-call rows a block of positions at a time.
    Returns the list of what each call of the filled route returned, or None for the blocks."""
    calls = []
    filled = _past_cap.filled
    if request.param == "blocks":
        monkeypatch.setattr(_past_cap, "filled", lambda *args: False)
        return None
    else:

        def counted(*args):
            calls.append(filled(*args))
            return calls[-1]

        monkeypatch.setattr(_past_cap, "filled", counted)
    return calls


# (serial_below, stream_above): one thread or parallel tasks (split inside runs of rows at one
# position), plain or streaming stores
THREADS_AND_STORES = [(1 << 40, 1 << 40), (0, 1 << 40), (0, 0)]


@pytest.mark.usefixtures("small_blocks")
# route is reset per example; 20 examples: each new combination compiles a kernel variant
@settings(max_examples=20, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.sampled_from(LAYOUTS),
    st.sampled_from(DTYPES),
    st.sampled_from(["interleaved", "half"]),
    st.sampled_from([16, 10, 8]),
    st.sampled_from(["fresh", "out", "in place", "rotate_qk"]),
    st.sampled_from(THREADS_AND_STORES),
    st.booleans(),
    st.integers(0, 2**32 - 1),
)
def test_large_calls_past_the_cache(
    route, layout, dtype, style, rotary_dim, mode, config, inverse, seed
):
    shape, pos_shape = layout
    rng = np.random.default_rng(seed)
    rope = ar.RoPE(16, style=style, rotary_dim=rotary_dim, max_positions=8)  # cap: 8 rows
    x = random_array(rng, shape, dtype)
    k = random_array(rng, shape, dtype)
    pos = rng.integers(0, 2**31, size=pos_shape)
    pos.flat[0] = 2**31 - 1
    want = oracle(x, pos, style=style, rotary_dim=rotary_dim, inverse=inverse)
    serial_below, stream_above = config
    if route is not None:
        del route[:]
    # the general kernels, not the row kernel
    with _config.override(small_below=0, serial_below=serial_below, stream_above=stream_above):
        if mode == "fresh":
            got = rope.rotate(x, pos, inverse=inverse)
        elif mode == "out":
            got = poisoned(x.shape, x.dtype)
            rope.rotate(x, pos, inverse=inverse, out=got)
        elif mode == "rotate_qk":
            got, k_got = poisoned(x.shape, x.dtype), poisoned(k.shape, k.dtype)
            rope.rotate_qk(x, k, pos, inverse=inverse, out=(got, k_got))
            k_want = oracle(k, pos, style=style, rotary_dim=rotary_dim, inverse=inverse)
            assert_matches(k_got, k_want, k)
        else:
            got = x.copy()
            rope.rotate(got, pos, inverse=inverse, out=got)
    assert_matches(got, want, x)
    reference = rope.rotate(x, pos.astype(np.float64), inverse=inverse, backend="numpy")
    assert_matches(got, reference.astype(np.float64), x)  # exact float64 angles
    # the filled route takes every layout here whose rows the direct path stores: pair blocks
    # and tails on the 16-byte grid, or off it in chunks on the grid (not in place; every
    # output here is a new array, whose rows of 16 elements are on the grid)
    direct = (
        _config.STREAMING
        and (rotary_dim if style == "interleaved" else rotary_dim // 2) * (x.itemsize) % 16 == 0
        and (16 - rotary_dim) * x.itemsize % 16 == 0
    )
    chunked = _config.STREAMING and mode != "in place"
    if route is not None:
        assert route == [direct or chunked]


def test_filled_route_takes_grouped_heads_temporaries_and_positions_per_head(rng):
    # rotate_qk with fewer k heads, an out the kernels reach through a temporary (its feature
    # axis strided) and written back, and positions that vary along the heads (no axis to
    # move innermost): every row its own fill
    rope = ar.RoPE(16, style="half", rotary_dim=8, max_positions=8)
    q = rng.standard_normal((2, 4, 50, 16)).astype(np.float32)
    k = rng.standard_normal((2, 1, 50, 16)).astype(np.float32)
    pos = rng.integers(0, 2**31, 50)
    q_out = np.full((2, 4, 16, 50), np.nan, np.float32).transpose(0, 1, 3, 2)
    k_out = poisoned(k.shape, k.dtype)
    per_head = rng.integers(0, 2**31, (2, 4, 50))
    with _config.override(small_below=0):
        rope.rotate_qk(q, k, pos, out=(q_out, k_out))
        by_head = rope.rotate(q, per_head)
    assert_matches(q_out, oracle(q, pos, style="half", rotary_dim=8), q)
    assert_matches(k_out, oracle(k, pos, style="half", rotary_dim=8), k)
    assert_matches(by_head, oracle(q, per_head, style="half", rotary_dim=8), q)


def test_filled_rows_follow_memory_order():
    # Heads outer in memory ((B, H, T, d)): chunks of positions, each chunk's rows at every head
    # before the next chunk, so that a position's row is filled once for all heads. Heads inner
    # ((T, H, d), (B, T, H, d)): the operand as it is, each token's heads one run of rows, its
    # row filled once for them (reordered, every head's pass strode through all the tokens).
    x = np.zeros((2, 4, 64, 16), np.float32)
    operand = (x, np.zeros_like(x), np.zeros((2, 1, 64, 1), np.int64))
    parts = cpu._chunked(operand, 16)
    assert len(parts) == 1 and parts[0] is not operand
    for shape, positions in (((64, 4, 16), (64, 1, 1)), ((2, 64, 4, 16), (2, 64, 1, 1))):
        x = np.zeros(shape, np.float32)
        operand = (x, np.zeros_like(x), np.zeros(positions, np.int64))
        parts = cpu._chunked(operand, 16)
        assert len(parts) == 1 and parts[0] is operand
    # heads inner in x but outer in out: reordered
    x = np.zeros((64, 4, 16), np.float32)
    out = np.zeros((4, 64, 16), np.float32).transpose(1, 0, 2)
    assert cpu._chunked((x, out, np.zeros((64, 1, 1), np.int64)), 16)[0][0] is not x


@pytest.mark.usefixtures("small_blocks")
def test_blocks_match_one_call_bit_for_bit(monkeypatch, rng):
    rope = ar.RoPE(64, style="half", max_positions=100)
    q = rng.standard_normal((2, 8, 300, 64)).astype(np.float32)
    k = rng.standard_normal((2, 2, 300, 64)).astype(np.float32)
    # positions 0..299, past the cap of 100 rows, in blocks of two positions
    blocked = rope.rotate_qk(q, k)
    single = rope.rotate(q[:, :, ::-1].copy(), np.arange(300)[::-1].copy())[:, :, ::-1]
    monkeypatch.setattr(_past_cap, "BLOCK_BYTES", 1 << 30)
    whole = rope.rotate_qk(q, k)
    np.testing.assert_array_equal(bits(blocked[0]), bits(whole[0]))
    np.testing.assert_array_equal(bits(blocked[1]), bits(whole[1]))
    np.testing.assert_array_equal(bits(blocked[0]), bits(single))
    # strided views, a layout the kernels reach through a temporary, and in place
    view = q[:, ::2, :, ::-1]
    want = oracle(view, np.arange(300), style="half")
    assert_matches(rope.rotate(view, np.arange(300)), want, view)
    inplace = q.copy()
    rope.rotate(inplace, out=inplace)
    np.testing.assert_array_equal(bits(inplace), bits(whole[0]))


def test_the_level_tables_are_bounded_whatever_the_position():
    rope = ar.RoPE(128)
    x = np.ones((1, 1, 1, 128), np.float32)
    for pos in (10**5, 10**7, 2**31 - 1):
        rope.rotate(x, pos)
    tables = rope._default.tables
    assert tables.level_bytes() <= 5 << 20  # 64 pairs
    assert sum(t.nbytes for t in tables._tables.values()) <= 32 << 20


def test_ropes_of_the_same_frequencies_share_their_level_tables():
    x = np.ones((1, 2, 3, 64), np.float32)
    first, again, other = ar.RoPE(64), ar.RoPE(64), ar.RoPE(64, base=500_000.0)
    for rope in (first, again, other):
        rope.rotate(x, 10**6)
    levels = [rope._default.tables.level_arrays()[2] for rope in (first, again, other)]
    assert levels[0] is levels[1] and levels[2] is not levels[0]
    # the values of the frequencies they were built for
    want = ar.RoPE(64, base=500_000.0)._default.tables.inv_freq
    np.testing.assert_array_equal(levels[2][1, 1], np.sin(want))  # sin(1 * theta_j)


def test_ropes_building_their_level_tables_at_once_share_one_build(rng):
    import threading

    base = float(rng.uniform(20_000, 30_000))  # frequencies no other test has built
    ropes = [ar.RoPE(256, base=base) for _ in range(4)]
    start, found = threading.Barrier(len(ropes)), [None] * len(ropes)

    def build(i):
        start.wait()
        found[i] = ropes[i]._default.tables.level_arrays()[2]

    threads = [threading.Thread(target=build, args=(i,)) for i in range(len(ropes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(levels is found[0] for levels in found)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", ["interleaved", "half"])
def test_large_in_place_calls_past_the_cache_ask_for_rows_ahead(monkeypatch, dtype, style, rng):
    # In place, rows made per position take the direct path's plain stores (VECTOR), and from
    # _config.streams_from's bytes on the same loop asking for each row's input ahead
    # (VECTOR_AHEAD): the same bits.
    if not _config.STREAMING or (dtype == np.float16 and not _config.HARDWARE_F16):
        pytest.skip("the direct path is used on x86-64 only (float16 where the CPU converts it)")
    kinds = []
    launch = cpu.launch_filled

    def recorded(*args):
        kinds.append(launch(*args))
        return kinds[-1]

    monkeypatch.setattr(cpu, "launch_filled", recorded)
    rope = ar.RoPE(16, style=style, max_positions=8)  # cap: 8 rows
    x = random_array(rng, (2, 3, 40, 16), dtype)
    pos = rng.integers(0, 2**31, 40)
    results = []
    for stream_above in (1 << 40, 0):
        y = x.copy()
        with _config.override(small_below=0, serial_below=0, stream_above=stream_above):
            rope.rotate(y, pos, out=y)
        results.append(y)
    assert kinds == [cpu.VECTOR, cpu.VECTOR_AHEAD]
    np.testing.assert_array_equal(bits(results[1]), bits(results[0]))
    assert_matches(results[1], oracle(x, pos, style=style), x)
