"""The dispatch layer: which plan a call's layout gets, that one plan serves every call of that
layout, and that what depends on values (table growth) is decided per call.

The results themselves are the contract tests' business (test_properties, test_api): here the
question is only which way a call goes and what is cached.
"""

import numpy as np
import pytest
from oracles import assert_matches, oracle, poisoned, random_array

import arrayrope as ar
from arrayrope import _api, _dispatch, _positions
from arrayrope._plan import GeneralPlan
from arrayrope.backends.cpu._rows_plan import RowsPlan


def _plan_of(rope, call):
    """The class of the plan ``call()`` builds on ``rope``, which starts with no plans."""
    rope._engine.plans.clear()
    call()
    (plan,) = rope._engine.plans.values()
    return type(plan)


def test_each_layout_gets_its_strategy():
    rope = ar.RoPE(8)
    x = np.ones((2, 8), np.float32)

    def rows(*args, **kwargs):
        return _plan_of(rope, lambda: rope.rotate(*args, **kwargs)) is RowsPlan

    assert rows(x, 3)
    assert rows(x, np.int64(3)) and rows(x, np.uint16(3))  # NumPy integer scalars too
    assert rows(x, np.array([3])) and rows(x, np.array([3, 4]))
    assert not rows(x, 3.0) and not rows(x, np.array([1.5, 2.0]))  # real-valued: general
    assert not rows(x[:, ::-1], 3)  # the feature axis is not contiguous: general
    assert rows(x[::-1], 3)  # any leading strides
    odd = np.ndarray((2, 8), np.float32, np.zeros(80, np.uint8), offset=2, strides=(34, 4))
    assert not rows(odd, 3)  # a misaligned start and a stride of part elements: general
    cache = np.zeros((1, 4, 16, 8), np.float32)
    step = np.ones((1, 4, 1, 8), np.float32)
    assert rows(step, 3, out=cache[:, :, 5:6])  # a KV-cache slice
    batch = np.ones((2, 4, 1, 8), np.float32)  # (B, H, 1, d): batched decode
    assert rows(batch, np.array([[[5]], [[9]]])) and rows(batch, np.array([5, 9])[:, None, None])
    prefill = np.ones((2, 4, 3, 8), np.float32)
    assert not rows(prefill, np.array([[[0, 1, 2]], [[5, 6, 7]]]))  # (B, 1, T): general
    assert rows(x, 3, out=np.empty_like(x)) and rows(x, 3, out=x)
    frozen = np.empty_like(x)
    frozen.flags.writeable = False
    with pytest.raises(ar.RopeValueError, match="read-only"):
        rope.rotate(x, 3, out=frozen)
    k = np.ones((1, 8), np.float32)
    assert _plan_of(rope, lambda: rope.rotate_qk(x, k, 3)) is RowsPlan
    assert _plan_of(rope, lambda: rope.rotate_qk(x, k, 3, out=(x, k))) is RowsPlan
    assert _plan_of(rope, lambda: rope.rotate(x, 3, backend="numpy")) is GeneralPlan
    sectioned = ar.RoPE.sectioned(8, (2, 2))
    assert _plan_of(sectioned, lambda: sectioned.rotate(x, np.zeros((2, 2), int))) is GeneralPlan


@pytest.mark.parametrize("limit", [1024, 4096])
def test_the_row_kernel_takes_inputs_below_small_below(limit, cpu_config, rng):
    cpu_config(small_below=limit)
    rope = ar.RoPE(16, style="half")
    for rows in (limit // 16 - 1, limit // 16):
        x = rng.standard_normal((rows, 16)).astype(np.float32)
        pos = rng.integers(0, 5000, rows)
        taken = _plan_of(rope, lambda x=x, pos=pos: rope.rotate(x, pos)) is RowsPlan
        assert taken == (x.size < limit)
    q = rng.standard_normal((limit // 32, 16)).astype(np.float32)  # q and k: limit // 2 each
    for k_rows in (limit // 32 - 1, limit // 32):
        k = rng.standard_normal((k_rows, 16)).astype(np.float32)
        taken = _plan_of(rope, lambda k=k: rope.rotate_qk(q, k, 7)) is RowsPlan
        assert taken == (q.size + k.size < limit)


def test_one_plan_serves_every_call_of_a_layout(rng):
    rope = ar.RoPE(16)
    x = rng.standard_normal((1, 4, 1, 16)).astype(np.float32)
    k = rng.standard_normal((1, 2, 1, 16)).astype(np.float32)
    plans = rope._engine.plans
    plans.clear()
    rope.rotate(x, 5)  # NumPy x, int position: the inline key
    rope.rotate(x, np.int64(9))  # a NumPy integer goes the general way to the same key
    rope.rotate(x.copy(), 11)  # another array of the same layout
    assert len(plans) == 1
    rope.rotate(x, np.array([3]))
    rope.rotate(x, np.array([4]))
    assert len(plans) == 2
    rope.rotate_qk(x, k, 5)
    rope.rotate_qk(x, k, np.int32(5))
    assert len(plans) == 3
    for key in plans:  # the general way builds the keys the inline ones look up
        assert isinstance(key, tuple)
    kind, value = _positions.resolve(np.int64(9), 1)
    assert _dispatch.plan_key((x,), kind, value, None, "auto") in plans


def test_module_level_functions_share_a_rope_and_its_plans(rng):
    x = rng.standard_normal((1, 4, 1, 16)).astype(np.float32)
    for base in range(1000, 1070):  # more configurations than the shared RoPEs keep
        ar.rotate(x, 1, base=float(base))
    expected = ar.rotate(x, 9, base=500.0)
    rope = _api.shared_rope(16, 500.0, "interleaved", None, None)
    assert rope is _api.shared_rope(16, 500.0, "interleaved", None, None)
    assert len(_api._shared) <= _api._shared.limit
    plans = dict(rope._engine.plans)
    np.testing.assert_array_equal(ar.rotate(x, 9, base=500.0), expected)
    assert dict(rope._engine.plans) == plans  # found, not built again
    np.testing.assert_array_equal(rope.rotate(x, 9), expected)


def test_the_cache_grows_to_a_position_past_it_and_stays_put(rng):
    rope = ar.RoPE(8)
    x = rng.standard_normal((2, 8)).astype(np.float32)
    rope.rotate(x, 1)
    (plan,) = rope._engine.plans.values()
    rows = plan.rows
    rope.rotate(x, rows)  # one past the cached rows: the table at least doubles
    assert plan.rows >= 2 * rows
    grown = plan.rows
    rope.rotate(x, np.array([grown - 1, 0]))
    rope.rotate(x, grown - 1)
    assert {p.rows for p in rope._engine.plans.values()} == {grown}
    rope.rotate(x, np.array([grown, 0]))  # an array past it grows it too
    assert max(p.rows for p in rope._engine.plans.values()) > grown


def test_changing_the_config_drops_plans(cpu_config):
    rope = ar.RoPE(8)
    x = np.ones((4, 8), np.float32)
    rope.rotate(x, 1)
    assert rope._engine.plans
    cpu_config(small_below=0)
    assert not rope._engine.plans
    assert _plan_of(rope, lambda: rope.rotate(x, 1)) is GeneralPlan


def test_positions_of_equal_dtypes_share_a_plan_safely(rng):
    # 'q' and 'l' are one int64 dtype by equality (one key) but not by identity
    rope = ar.RoPE(8)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    base = rng.integers(0, 1000, 6)
    for p in (base.astype("q")[::2], base.astype(np.int64)[::2], base.astype("q")[::2]):
        np.testing.assert_array_equal(rope.rotate(x, p), rope.rotate(x, p, backend="numpy"))


@pytest.mark.parametrize("max_positions", [None, 10])
def test_default_positions_of_a_longer_k_are_checked_before_q_is_written(max_positions, rng):
    rope = ar.RoPE(8, max_positions=max_positions)
    q = rng.standard_normal((1, 1, 2, 8)).astype(np.float32)
    k = rng.standard_normal((1, 1, 300, 8)).astype(np.float32)
    want_q, want_k = ar.RoPE(8).rotate(q), ar.RoPE(8).rotate(k)
    got = rope.rotate_qk(q, k, out=(q, k))
    np.testing.assert_array_equal(got[0], want_q)
    np.testing.assert_array_equal(got[1], want_k)


@pytest.mark.parametrize("kernel", ["rotate_rows", "rotate_rows_in_steps"])
def test_empty_operands_never_overlap(kernel):
    # rotate_qk of zero tokens, k a view of one fused projection and its result a fresh empty
    # array: two allocations of a few bytes, whose whole spans (an empty axis extends them
    # backwards by a stride) could meet wherever the allocator put them near each other
    from numpy.lib.stride_tricks import as_strided

    from arrayrope.backends.cpu import _decode

    dtype = np.float32 if kernel == "rotate_rows" else np.uint16
    buf = np.zeros(400, dtype)

    def empty_at(i):
        return as_strided(
            buf[i:], shape=(0, 2, 8), strides=(80 * buf.itemsize, 8 * buf.itemsize, buf.itemsize)
        )

    tables = np.zeros((2, 4, 4), np.float32)
    run = getattr(_decode, kernel)
    settings = _decode.settings(8, False, False, 1)
    for x_at, o_at in ((40, 50), (50, 40), (40, 40 + 80)):
        status = run(empty_at(x_at), empty_at(o_at), np.zeros(0, np.int64), tables, settings)
        assert status == _decode.DONE


def _only_plan(rope):
    (plan,) = rope._engine.plans.values()
    assert isinstance(plan, GeneralPlan)
    return plan


def _view(rng, shape, at=0, values=True):
    """A view (so that every array of a test has one set of flags, and one plan) of ``shape``
    float32 elements, ``at`` elements into a fresh buffer: random, or NaN (an output)."""
    size = int(np.prod(shape))
    buffer = random_array(rng, size + 4, np.float32) if values else poisoned(size + 4, np.float32)
    return buffer[at : at + size].reshape(shape)


@pytest.mark.parametrize("stores", ["plain", "streaming, parallel"])
@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_a_replayed_launch_still_decides_per_call_what_addresses_decide(
    style, stores, cpu_config, rng
):
    # Calls of positions 0..T-1 replay their plan's first launch; overlap and the outputs'
    # place on the 16-byte grid are still the call's own.
    if stores == "plain":
        cpu_config(small_below=0)
    else:
        cpu_config(small_below=0, serial_below=0, stream_above=0)
    rope = ar.RoPE(16, style=style)
    shape = (2, 3, 40, 16)

    def check(x, out):
        want, given = oracle(x, style=style), x.copy()
        assert rope.rotate(x, out=out) is out
        assert_matches(out, want, given)

    check(_view(rng, shape), _view(rng, shape, values=False))
    plan = _only_plan(rope)
    assert plan.replay is not None
    for at in (0, 0, 1, 0, 2, 0):  # fresh arrays; outputs 4 bytes apart: elsewhere on the grid
        check(_view(rng, shape), _view(rng, shape, at, values=False))
    x = _view(rng, shape)
    check(x, x[...])  # another view of x's memory: in place
    buffer = np.zeros(x.size + 16, np.float32)
    first, second = buffer[:-16].reshape(shape), buffer[16:].reshape(shape)
    with pytest.raises(ar.RopeValueError, match="partially"):
        rope.rotate(first, out=second)
    assert np.all(buffer == 0)  # refused before anything was written
    assert len(rope._engine.plans) == 1 and plan.replay is not None


def test_a_replay_follows_the_table_and_rotate_qk_checks_its_outs(cpu_config, rng):
    cpu_config(small_below=0)
    rope = ar.RoPE(16)
    shapes = (1, 4, 24, 16), (1, 2, 24, 16)

    def check():
        q, k = (_view(rng, shape) for shape in shapes)
        outs = tuple(_view(rng, shape, values=False) for shape in shapes)
        got = rope.rotate_qk(q, k, out=outs)
        assert got[0] is outs[0] and got[1] is outs[1]
        assert_matches(got[0], oracle(q), q)
        assert_matches(got[1], oracle(k), k)

    check()
    plan = _only_plan(rope)
    recorded = plan.replay
    assert recorded is not None
    rows = rope._engine.freq_set(None).tables.existing(None, np.dtype(np.float32)).shape[1]
    rope.rotate(np.ones((1, 16), np.float32), rows)  # a position past the table: it grows
    for _ in range(2):  # the replay gives way to the full call, which records it anew
        check()
    assert plan.replay is not None and plan.replay is not recorded
    q, k = (_view(rng, shape) for shape in shapes)
    shared = np.zeros(q.size, np.float32)
    with pytest.raises(ar.RopeValueError, match="overlap"):
        rope.rotate_qk(q, k, out=(shared.reshape(q.shape), shared[: k.size].reshape(k.shape)))
    assert np.all(shared == 0)


@pytest.mark.parametrize("vector_rows", [True, False])
def test_a_launch_made_in_place_through_a_view_is_not_replayed_for_a_separate_out(
    vector_rows, cpu_config, rng
):
    # out=x[...] has the layout of a separate out but is x's memory: the full way rotates it in
    # place (the tail past rotary_dim left as it is), which a later separate out must not repeat
    cpu_config(small_below=0, vector_rows=vector_rows)
    rope = ar.RoPE(16, rotary_dim=8, style="half")
    shape = (2, 3, 40, 16)
    x = _view(rng, shape)
    want, given = oracle(x, style="half", rotary_dim=8), x.copy()
    rope.rotate(x, out=x[...])
    assert_matches(x, want, given)
    plan = _only_plan(rope)
    assert plan.replay is None
    for _ in range(2):
        x, out = _view(rng, shape), _view(rng, shape, values=False)
        assert rope.rotate(x, out=out) is out
        assert_matches(out, oracle(x, style="half", rotary_dim=8), x)
    assert plan.replay is not None


def test_a_replayed_call_skips_the_full_way(cpu_config, rng, monkeypatch):
    cpu_config(small_below=0)
    rope = ar.RoPE(16)
    shape = (2, 3, 40, 16)
    rope.rotate(_view(rng, shape), out=_view(rng, shape, values=False))
    plan = _only_plan(rope)

    def refused(*args):
        raise AssertionError("the full way ran")

    monkeypatch.setattr(plan, "_tables", refused)
    x, out = _view(rng, shape), _view(rng, shape, values=False)
    rope.rotate(x, out=out)
    assert_matches(out, oracle(x), x)
