"""Multi-axis RoPE: axial (FLUX, 2-D ViT) and sectioned (Qwen2-VL, Qwen3-VL) layouts."""

import numpy as np
import pytest
from conftest import DTYPES, assert_matches, inv_freq, poisoned
from hypothesis import given
from hypothesis import strategies as st
from oracles import flux_oracle, qwen2_oracle, qwen3_oracle

import arrayrope as ar
from arrayrope import RopeValueError


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", ["numba", "numpy"])
def test_axial_matches_flux(rng, dtype, backend):
    dims = (16, 56, 56)
    rope = ar.RoPE.axial(dims, base=10000.0)
    # 3 heads: per-axis runs in the kernel; 12 heads share each token's positions: per-entry
    # tables (the CPU kernel's two paths)
    for heads in (3, 12):
        x = rng.standard_normal((2, heads, 10, 128)).astype(dtype)
        pos = rng.integers(0, 512, size=(2, 1, 10, 3))
        out = poisoned(x.shape, dtype)
        rope.rotate(x, pos, out=out, backend=backend)
        assert_matches(out, flux_oracle(x, pos, dims, 10000.0), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", ["numba", "numpy"])
def test_sectioned_matches_qwen2_vl(rng, dtype, backend):
    rope = ar.RoPE.sectioned(128, (16, 24, 24), base=1e6)
    x = rng.standard_normal((4, 9, 128)).astype(dtype)
    pos = rng.integers(0, 4096, size=(9, 3))
    out = poisoned(x.shape, dtype)
    rope.rotate(x, pos, out=out, backend=backend)
    assert_matches(out, qwen2_oracle(x, pos, (16, 24, 24), 1e6), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", ["numba", "numpy"])
def test_interleaved_assignment_matches_qwen3_vl(rng, dtype, backend):
    rope = ar.RoPE.sectioned(128, (24, 20, 20), base=5e6, assign="interleaved")
    x = rng.standard_normal((4, 9, 128)).astype(dtype)
    pos = rng.integers(0, 4096, size=(9, 3))
    out = poisoned(x.shape, dtype)
    rope.rotate(x, pos, out=out, backend=backend)
    assert_matches(out, qwen3_oracle(x, pos, (24, 20, 20), 5e6), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qwen3_vl_per_entry_tables_every_path(rng, dtype):
    """The many-run layout rotates from per-entry tables: heads sharing positions, q and k in one
    launch, in place, real-valued positions and a parallel-sized input all agree with the
    oracle, and nothing is left unwritten."""
    sections = (24, 20, 20)
    rope = ar.RoPE.sectioned(128, sections, base=5e6, assign="interleaved")
    q = rng.standard_normal((2, 8, 40, 128)).astype(dtype)
    k = rng.standard_normal((2, 2, 40, 128)).astype(dtype)
    pos = rng.integers(0, 4096, size=(2, 1, 40, 3))
    outs = (poisoned(q.shape, dtype), poisoned(k.shape, dtype))
    rope.rotate_qk(q, k, pos, out=outs)
    assert_matches(outs[0], qwen3_oracle(q, pos, sections, 5e6), q)
    assert_matches(outs[1], qwen3_oracle(k, pos, sections, 5e6), k)
    inplace = q.copy()
    rope.rotate(inplace, pos, out=inplace)
    assert_matches(inplace, qwen3_oracle(q, pos, sections, 5e6), q)
    real = pos + rng.random(pos.shape)
    assert_matches(rope.rotate(q, real), qwen3_oracle(q, real, sections, 5e6), q)
    # past the serial thresholds, of the rotation and of the gather (1200 entries x 64 pairs)
    big = rng.standard_normal((2, 8, 600, 128)).astype(dtype)
    big_pos = rng.integers(0, 4096, size=(2, 1, 600, 3))
    assert_matches(rope.rotate(big, big_pos), qwen3_oracle(big, big_pos, sections, 5e6), big)


def test_per_entry_tables_for_q_and_k_with_their_own_positions(rng):
    """At the launcher, q and k may carry different position arrays: each gets its own
    entries in the stacked per-entry tables."""
    from arrayrope.backends import cpu

    sections = (24, 20, 20)
    rope = ar.RoPE.sectioned(128, sections, assign="interleaved")
    q = rng.standard_normal((3, 5, 128)).astype(np.float32)
    k = rng.standard_normal((3, 7, 128)).astype(np.float32)
    pos_q = rng.integers(0, 300, size=(1, 5, 3))
    pos_k = rng.integers(0, 300, size=(1, 7, 3))
    cos, sin = rope._default.tables.cached(np, None, np.dtype(np.float32), 300)
    outs = (poisoned(q.shape, q.dtype), poisoned(k.shape, k.dtype))
    cpu.launch(rope._spec, [(q, outs[0], pos_q), (k, outs[1], pos_k)], cos, sin, False)
    assert_matches(outs[0], qwen3_oracle(q, pos_q, sections, 10000.0), q)
    assert_matches(outs[1], qwen3_oracle(k, pos_k, sections, 10000.0), k)


def test_vit_2d_fractional_coordinates_are_exact(rng):
    rope = ar.RoPE.axial((32, 32), base=100.0)
    x = rng.standard_normal((3, 49, 64)).astype(np.float32)
    rows, cols = np.meshgrid(np.linspace(0, 6.5, 7), np.linspace(0, 6.5, 7), indexing="ij")
    pos = np.stack([rows.ravel(), cols.ravel()], axis=-1)  # (49, 2), real-valued
    assert_matches(rope.rotate(x, pos), flux_oracle(x, pos, (32, 32), 100.0), x)


@given(
    st.lists(st.integers(1, 8), min_size=1, max_size=3),
    st.integers(0, 2**32 - 1),
    st.sampled_from(["interleaved", "half"]),
)
def test_each_axis_block_is_1d_rope(pairs, seed, style):
    rng = np.random.default_rng(seed)
    dims = tuple(2 * p for p in pairs)
    rope = ar.RoPE.axial(dims, style="interleaved")
    x = rng.standard_normal((5, sum(dims)))
    pos = rng.integers(0, 10**6, size=(5, len(dims)))
    y = rope.rotate(x, pos) if len(dims) > 1 else rope.rotate(x, pos[:, 0])
    start = 0
    for a, n in enumerate(dims):
        block = ar.rotate(np.ascontiguousarray(x[:, start : start + n]), pos[:, a])
        np.testing.assert_array_equal(y[:, start : start + n], block)
        start += n
    del style


@given(
    st.integers(0, 2**32 - 1),
    st.integers(0, 2),
    st.integers(0, 10**5),
    st.sampled_from(["axial", "sectioned", "qwen3"]),
)
def test_relative_position_per_axis(seed, axis, shift, layout):
    rng = np.random.default_rng(seed)
    rope = {
        "axial": lambda: ar.RoPE.axial((8, 12, 12)),
        "sectioned": lambda: ar.RoPE.sectioned(32, (4, 6, 6)),
        "qwen3": lambda: ar.RoPE.sectioned(32, (6, 5, 5), assign="interleaved"),
    }[layout]()
    q = rng.standard_normal((6, 32))
    k = rng.standard_normal((6, 32))
    pq = rng.integers(0, 10**5, size=(6, 3))
    pk = rng.integers(0, 10**5, size=(6, 3))
    before = np.sum(rope.rotate(q, pq) * rope.rotate(k, pk), axis=-1)
    pq[:, axis] += shift
    pk[:, axis] += shift
    after = np.sum(rope.rotate(q, pq) * rope.rotate(k, pk), axis=-1)
    np.testing.assert_allclose(after, before, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("style", ["interleaved", "half"])
def test_single_axis_is_plain_rope_bit_for_bit(rng, style):
    x = rng.standard_normal((3, 7, 64)).astype(np.float32)
    pos = rng.integers(0, 10**6, size=7)
    plain = ar.rotate(x, pos, style=style)
    for rope in (ar.RoPE.axial((64,), style=style), ar.RoPE.sectioned(64, (32,), style=style)):
        np.testing.assert_array_equal(rope.rotate(x, pos), plain)


def test_cos_sin_and_rotate_qk_take_axes(rng):
    rope = ar.RoPE.sectioned(16, (2, 3, 3))
    pos = rng.integers(0, 100, size=(5, 3))
    cos, sin = rope.cos_sin(pos)
    assert cos.shape == (5, 8)
    theta = inv_freq(16)
    angle = pos[:, rope._spec.pair_axis] * theta
    np.testing.assert_allclose(cos, np.cos(angle), atol=1e-7)
    np.testing.assert_allclose(sin, np.sin(angle), atol=1e-7)
    q = rng.standard_normal((4, 5, 16)).astype(np.float32)
    k = rng.standard_normal((2, 5, 16)).astype(np.float32)
    qr, kr = rope.rotate_qk(q, k, pos)
    np.testing.assert_array_equal(qr, rope.rotate(q, pos))
    np.testing.assert_array_equal(kr, rope.rotate(k, pos))


def test_errors():
    with pytest.raises(RopeValueError, match=r"dims\[1\] must be even and >= 2, got 7"):
        ar.RoPE.axial((16, 7))
    with pytest.raises(
        RopeValueError,
        match=r"sections \(16, 24, 20\) sum to 60 pairs; "
        r"rotary_dim 128 has 64",
    ):
        ar.RoPE.sectioned(128, (16, 24, 20))
    with pytest.raises(RopeValueError, match="assign must be"):
        ar.RoPE.sectioned(128, (16, 24, 24), assign="zigzag")
    with pytest.raises(RopeValueError, match="cannot be interleaved"):
        ar.RoPE.sectioned(16, (1, 1, 6), assign="interleaved")
    rope = ar.RoPE.axial((8, 8))
    x = np.zeros((3, 16), np.float32)
    with pytest.raises(
        RopeValueError,
        match=r"pos must end in an axis of size n_axes \(2\), "
        r"got shape \(3,\)",
    ):
        rope.rotate(x, np.arange(3))
    with pytest.raises(RopeValueError, match=r"got shape \(3, 3\)"):
        rope.rotate(x, np.zeros((3, 3), np.int64))
    with pytest.raises(RopeValueError, match="pos is required"):
        rope.rotate(x)
    with pytest.raises(RopeValueError, match="n_axes"):
        rope.rotate(x, 4)
