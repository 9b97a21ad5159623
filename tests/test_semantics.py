"""What rotate, inverse, shift and unrotate mean under every scaling rule, and where positions
go (head_axis, and the layouts that broadcast only by accident)."""

import numpy as np
import pytest
from conftest import assert_matches, oracle
from hypothesis import given
from hypothesis import strategies as st

import arrayrope as ar
from arrayrope import scaling

RULES = {
    "none": None,
    "linear": scaling.Linear(4.0),
    "ntk": scaling.NTK(2.0),
    "yarn": scaling.YaRN(4.0, 256),
    "llama3": scaling.Llama3(8.0, 1.0, 4.0, 256),
    "dynamic": scaling.DynamicNTK(2.0, 256),
    "longrope": scaling.LongRoPE(
        tuple(np.linspace(1.0, 2.0, 8)), tuple(np.linspace(1.0, 6.0, 8)), 256
    ),
}
STATIC = [name for name, rule in RULES.items() if rule is None or not rule.dynamic]


def _static_oracle(rope, x, pos, inverse=False):
    return oracle(
        x,
        pos,
        style=rope.style,
        freqs=rope.inv_freq,
        scale=rope.attention_scaling,
        inverse=inverse,
    )


@pytest.mark.parametrize("rule", STATIC)
@given(
    m=st.integers(0, 100_000),
    delta=st.integers(-50_000, 50_000),
    style=st.sampled_from(["interleaved", "half"]),
    dtype=st.sampled_from([np.float32, np.float64]),
    seed=st.integers(0, 2**32 - 1),
)
def test_shift_moves_rotated_rows_exactly(rule, m, delta, style, dtype, seed):
    # shift(rotate(k, m), delta) is rotate(k, m + delta), attention scaling included once
    rope = ar.RoPE(16, style=style, scaling=RULES[rule])
    x = np.random.default_rng(seed).standard_normal((3, 5, 16)).astype(dtype)
    m = max(m, -delta)  # m + delta stays a position
    got = rope.shift(rope.rotate(x, m), delta)
    want = _static_oracle(rope, x, m + delta)
    # Two rotations, each rounded: a few float32 ulps; in float64, the angles' own rounding
    # (an ulp of m * theta, growing with the position) shows through cos and sin.
    if dtype == np.float32:
        bound = 2e-6
    else:
        bound = 4.5e-16 * (16 + m + abs(delta))
    np.testing.assert_allclose(got, want, rtol=0, atol=bound * np.abs(want).max())


@pytest.mark.parametrize("rule", ["dynamic", "longrope"])
@pytest.mark.parametrize("length", [100, 1000])  # below and past the original length
def test_shift_under_length_dependent_rules_keeps_the_length(rule, length, rng):
    rope = ar.RoPE(16, scaling=RULES[rule])
    x = rng.standard_normal((4, 16))
    m = rng.integers(0, 300, size=4)
    rotated = rope.rotate(x, m, seq_len=length)
    got = rope.shift(rotated, 37, seq_len=length)
    np.testing.assert_allclose(got, rope.rotate(x, m + 37, seq_len=length), rtol=0, atol=1e-12)
    with pytest.raises(ar.RopeValueError, match="shift needs seq_len"):
        rope.shift(rotated, 37)


@pytest.mark.parametrize("rule", list(RULES))
def test_unrotate_is_the_exact_undo_and_inverse_the_transpose(rule, rng):
    rope = ar.RoPE(16, scaling=RULES[rule])
    x = rng.standard_normal((6, 16))
    m = rng.integers(0, 2000, size=6)
    rotated = rope.rotate(x, m)
    np.testing.assert_allclose(rope.unrotate(rotated, m), x, rtol=0, atol=1e-12)
    # inverse=True is the transpose: <R y, z> = <y, R^T z> for any y, z
    z = rng.standard_normal((6, 16))
    lhs = np.sum(rope.rotate(x, m) * z, axis=-1)
    rhs = np.sum(x * rope.rotate(z, m, inverse=True), axis=-1)
    np.testing.assert_allclose(lhs, rhs, rtol=1e-12, atol=1e-12)
    round_trip = rope.rotate(rotated, m, inverse=True)
    np.testing.assert_allclose(round_trip, rope.attention_scaling**2 * x, rtol=0, atol=1e-12)


def test_shift_by_an_array_of_one_sign_and_refuses_mixed_signs(rng):
    rope = ar.RoPE(8, scaling=RULES["yarn"])
    x = rng.standard_normal((2, 3, 8))
    m = np.array([100, 200, 300])
    rotated = rope.rotate(x, m)
    back = np.array([-10, -20, -30])
    np.testing.assert_allclose(rope.shift(rotated, back), rope.rotate(x, m + back), atol=1e-12)
    with pytest.raises(ar.RopeValueError, match="one way"):
        rope.shift(rotated, np.array([-1, 0, 1]))


@pytest.mark.parametrize("layout", ["BHTd", "BTHd"])
def test_hugging_face_position_ids_take_head_axis(layout, rng):
    position_ids = np.array([[0, 1, 2, 3], [10, 11, 12, 13]])  # (B, T), one sequence per row
    if layout == "BHTd":
        x = rng.standard_normal((2, 2, 4, 8)).astype(np.float32)  # B == H: the trap's case
        axis, explicit = 1, position_ids[:, None, :]
    else:
        x = rng.standard_normal((2, 4, 2, 8)).astype(np.float32)
        axis, explicit = 2, position_ids[:, :, None]
    got = ar.rotate(x, position_ids, head_axis=axis, style="half")
    np.testing.assert_array_equal(got, ar.rotate(x, explicit, style="half"))
    assert_matches(got, oracle(x, explicit, style="half"), x)
    q_rot, k_rot = ar.rotate_qk(x, x[:, :1] if axis == 1 else x[:, :, :1], position_ids,
                                head_axis=axis)  # fmt: skip
    np.testing.assert_array_equal(q_rot, ar.rotate(x, explicit))
    with pytest.raises(ar.RopeValueError, match="head_axis"):
        ar.rotate(x, position_ids)  # (B, T) against (B, H, T): broadcasts only by accident
    with pytest.raises(ar.RopeValueError, match="head_axis"):
        ar.rotate(x, position_ids[0], head_axis=axis)  # (T,) is not (B, T)
    with pytest.raises(ar.RopeValueError, match="head_axis must be an axis"):
        ar.rotate(x, position_ids, head_axis=3)


def test_explicit_broadcasts_stay_accepted(rng):
    x = rng.standard_normal((2, 3, 5, 8)).astype(np.float32)
    for pos in (np.arange(5), np.arange(5)[None, None], np.zeros((2, 1, 5), int), 7):
        assert ar.rotate(x, pos).shape == x.shape
    single = rng.standard_normal((1, 2, 2, 8)).astype(np.float32)  # B == 1: no other reading
    per_head = np.array([[42, 31], [25, 13]])
    np.testing.assert_array_equal(ar.rotate(single, per_head), ar.rotate(single, per_head[None]))
    packed = rng.standard_normal((6, 3, 8)).astype(np.float32)  # (N, H, d)
    assert ar.rotate(packed, np.arange(6)[:, None]).shape == packed.shape
