"""apply_cos_sin and apply_cos_sin_qk: rotation by the caller's tables.

Judged against a float64 oracle of the pair arithmetic on the tables as the kernels take them
(rounded once to the compute dtype), and, with arrayrope's own tables, against rotate bit for
bit; every layout of the tables, broadcasting as positions do, the four dtypes, out= and in
place, and the refusals.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import DTYPES, assert_matches, bits, poisoned, random_array

import arrayrope as ar


def _pairs(style, rotary_dim):
    if style == "interleaved":
        return np.arange(0, rotary_dim, 2), np.arange(1, rotary_dim, 2)
    return np.arange(rotary_dim // 2), np.arange(rotary_dim // 2, rotary_dim)


def _oracle(x, cos, sin, style, rotary_dim, dtype, inverse=False):
    """x's pairs turned by the per-pair tables (C + (rotary_dim / 2,)), in float64, the tables
    first rounded to the compute dtype of ``dtype`` as the kernels take them."""
    table = np.float64 if dtype == np.float64 else np.float32
    c = cos.astype(table).astype(np.float64)
    s = sin.astype(table).astype(np.float64) * (-1.0 if inverse else 1.0)
    x64 = x.astype(np.float64)
    a_idx, b_idx = _pairs(style, rotary_dim)
    a, b = x64[..., a_idx], x64[..., b_idx]
    out = x64.copy()
    out[..., a_idx] = a * c - b * s
    out[..., b_idx] = b * c + a * s
    return out


def _duplicated(t, style):
    """transformers' layout of a per-pair table: each pair's value at both of its features."""
    if style == "half":
        return np.concatenate([t, t], axis=-1)
    return np.repeat(t, 2, axis=-1)


LEADS = {
    # name: (x's leading shape, the table's leading shape, head_axis)
    "per token": ((2, 3, 5), (5,), None),
    "per sequence and token": ((2, 3, 5), (2, 1, 5), None),
    "position_ids with head_axis": ((2, 3, 5), (2, 5), 1),
    "(B, T, H) with head_axis": ((2, 5, 3), (2, 5), 2),
    "one row for all": ((2, 3, 5), (), None),
    "per head and token": ((2, 3, 5), (1, 3, 5), None),
    "packed": ((7, 3), (7, 1), None),
}


@given(
    dtype=st.sampled_from(DTYPES),
    style=st.sampled_from(["interleaved", "half"]),
    half_d=st.integers(1, 40),
    data=st.data(),
    lead=st.sampled_from(sorted(LEADS)),
    duplicated=st.booleans(),
    table_dtype=st.sampled_from([np.float16, np.float32, np.float64]),
    inverse=st.booleans(),
    mode=st.sampled_from(["new", "out", "in place", "qk"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_matches_the_oracle(
    dtype, style, half_d, data, lead, duplicated, table_dtype, inverse, mode, seed
):
    d = 2 * half_d
    rotary_dim = 2 * data.draw(st.integers(1, half_d), label="rotary pairs")
    x_lead, table_lead, head_axis = LEADS[lead]
    rng = np.random.default_rng(seed)
    x = random_array(rng, x_lead + (d,), dtype)
    angles = rng.uniform(-10, 10, size=table_lead + (rotary_dim // 2,))
    scale = rng.uniform(0.5, 2.0, size=angles.shape)  # any per-pair table, not only rotations
    cos, sin = (
        (scale * np.cos(angles)).astype(table_dtype),
        (scale * np.sin(angles)).astype(table_dtype),
    )
    given_cos, given_sin = (
        (_duplicated(cos, style), _duplicated(sin, style)) if duplicated else (cos, sin)
    )
    kw = dict(style=style, rotary_dim=rotary_dim, inverse=inverse, head_axis=head_axis)
    placed = (cos, sin)
    if head_axis is not None:
        placed = tuple(np.expand_dims(t, head_axis) for t in placed)
    want = _oracle(x, *placed, style, rotary_dim, dtype, inverse)
    if mode == "qk":  # grouped-query: k with one head where tables do not vary by head
        gqa = lead in ("per token", "per sequence and token", "position_ids with head_axis")
        k_lead = (x_lead[0], 1) + x_lead[2:] if gqa else x_lead
        k = random_array(rng, k_lead + (d,), dtype)
        want_k = _oracle(k, *placed, style, rotary_dim, dtype, inverse)
        outs = (poisoned(x.shape, dtype), poisoned(k.shape, dtype))
        got_q, got_k = ar.apply_cos_sin_qk(x, k, given_cos, given_sin, out=outs, **kw)
        assert got_q is outs[0] and got_k is outs[1]
        assert_matches(got_k, want_k, 4.0 * k.astype(np.float64))
        got = got_q
    elif mode == "out":
        out = poisoned(x.shape, dtype)
        got = ar.apply_cos_sin(x, given_cos, given_sin, out=out, **kw)
        assert got is out
    elif mode == "in place":
        y = x.copy()
        got = ar.apply_cos_sin(y, given_cos, given_sin, out=y, **kw)
        assert got is y
    else:
        before = x.copy()
        got = ar.apply_cos_sin(x, given_cos, given_sin, **kw)
        assert np.array_equal(bits(x), bits(before))  # x is never written
    # tables up to 2 in size turn a row into one up to 4 times as large: the bound scales so
    assert_matches(got, want, 4.0 * x.astype(np.float64))
    assert np.array_equal(bits(got[..., rotary_dim:]), bits(x[..., rotary_dim:]))


@pytest.mark.parametrize("style", ["interleaved", "half"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_arrayropes_own_tables_rotate_bit_for_bit(style, dtype, rng):
    rope = ar.RoPE(64, style=style, base=500000.0, scaling=ar.scaling.YaRN(4.0, 1024))
    x = random_array(rng, (2, 4, 33, 64), dtype)
    pos = rng.integers(0, 2**31, size=(2, 1, 33))
    cos, sin = rope.cos_sin(pos, like=x)
    assert np.array_equal(
        bits(ar.apply_cos_sin(x, cos, sin, style=style, rotary_dim=64)), bits(rope.rotate(x, pos))
    )


def test_large_tables_take_the_parallel_kernels(rng):
    x = random_array(rng, (1, 8, 4096, 128), np.float32)  # past the one-thread threshold
    cos, sin = ar.RoPE(128, style="half").cos_sin(np.arange(4096))
    got = ar.apply_cos_sin(x, cos, sin, style="half", rotary_dim=128)
    assert np.array_equal(bits(got), bits(ar.rotate(x, None, style="half")))


def test_refusals_name_the_argument():
    x = np.ones((2, 4, 8), np.float32)
    cos = sin = np.ones((4, 4), np.float32)
    kw = dict(style="half", rotary_dim=8)
    with pytest.raises(TypeError, match="style"):
        ar.apply_cos_sin(x, cos, sin)  # the style is required
    with pytest.raises(ar.RopeValueError, match="of width 4 for x of 8 features need rotary_dim"):
        ar.apply_cos_sin(x, cos, sin, style="half")  # one value per pair, or a partial layout?
    with pytest.raises(
        ar.RopeValueError, match=r"end in rotary_dim \(8: .*\) or rotary_dim / 2 \(4: "
    ):
        ar.apply_cos_sin(x, np.ones((4, 6)), np.ones((4, 6)), **kw)
    with pytest.raises(ar.RopeValueError, match="cos and sin must have one shape"):
        ar.apply_cos_sin(x, cos, np.ones((4, 8)), **kw)
    with pytest.raises(ar.RopeValueError, match=r"cos\[..., :r/2\] and \[..., r/2:\] equal"):
        ar.apply_cos_sin(x, np.arange(32.0).reshape(4, 8), np.ones((4, 8)), style="half")
    with pytest.raises(ar.RopeValueError, match=r"cos\[..., 0::2\] and \[..., 1::2\] equal"):
        table = np.tile(np.arange(4.0), (4, 2))  # a "half" table: cat(f, f)
        ar.apply_cos_sin(x, table, table, style="interleaved")
    leading = r"cos and sin of shape \(3, 4\) have the leading shape \(3,\), which does not"
    with pytest.raises(ar.RopeValueError, match=leading):
        ar.apply_cos_sin(x, np.ones((3, 4)), np.ones((3, 4)), **kw)
    # only the rotary_dims that fit are offered: even, at most d
    with pytest.raises(ar.RopeValueError, match=r"need rotary_dim: 6 for one value per pair of a "
                       r"partial rotation$"):  # fmt: skip
        ar.apply_cos_sin(x, np.ones((4, 3)), np.ones((4, 3)), style="half")
    with pytest.raises(ar.RopeValueError, match="width 10 fit no rotation of x of 8 features"):
        ar.apply_cos_sin(x, np.ones((4, 10)), np.ones((4, 10)), style="half")
    with pytest.raises(ar.RopeTypeError, match="cos must be float16, .* got dtype int64"):
        ar.apply_cos_sin(x, np.ones((4, 4), np.int64), np.ones((4, 4), np.int64), **kw)
    with pytest.raises(ar.RopeTypeError, match="cos must be an array"):
        ar.apply_cos_sin(x, [[1.0] * 4] * 4, [[0.0] * 4] * 4, **kw)
    with pytest.raises(ar.RopeTypeError, match="cos must be float16, bfloat16"):
        ar.apply_cos_sin(x, np.ones((4, 4), np.int32), np.ones((4, 4), np.int32), **kw)
    with pytest.raises(ar.RopeValueError, match="rotary_dim must be even"):
        ar.apply_cos_sin(x, cos, sin, style="half", rotary_dim=5)
    with pytest.raises(ar.RopeTypeError, match="rotary_dim must be an int"):
        ar.apply_cos_sin(x, cos, sin, style="half", rotary_dim=8.0)
    with pytest.raises(ar.RopeValueError, match="style must be"):
        ar.apply_cos_sin(x, cos, sin, style="neox", rotary_dim=8)
    with pytest.raises(ar.RopeTypeError, match="inverse must be a bool"):
        ar.apply_cos_sin(x, cos, sin, inverse="no", **kw)
    with pytest.raises(ar.RopeValueError, match="head_axis must be an axis of x's leading shape"):
        ar.apply_cos_sin(x, cos, sin, head_axis=-1, **kw)  # the feature axis
    out = np.zeros((2, 4, 8), np.float64)
    with pytest.raises(ar.RopeValueError, match="out"):
        ar.apply_cos_sin(x, cos, sin, out=out, **kw)
    assert not out.any()  # nothing written on a refusal


def test_an_out_over_the_tables_reads_them_first(rng):
    x = random_array(rng, (4, 8), np.float32)
    store = random_array(rng, (64,), np.float32)
    table = store[:16].reshape(4, 4)  # contiguous, of the compute dtype: taken as it is
    want = ar.apply_cos_sin(x, table.copy(), table.copy(), style="half", rotary_dim=8)
    out = store[8:40].reshape(4, 8)  # over the table's second half
    got = ar.apply_cos_sin(x, table, table, style="half", rotary_dim=8, out=out)
    assert np.array_equal(got, want)


def test_framework_arrays_come_back_as_their_own_type(rng):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    x = random_array(rng, (2, 4, 5, 8), np.float32)
    cos, sin = ar.RoPE(8, style="half").cos_sin(np.arange(5))
    kw = dict(style="half", rotary_dim=8)
    got = ar.apply_cos_sin(torch.from_numpy(x), torch.from_numpy(cos), torch.from_numpy(sin), **kw)
    assert isinstance(got, torch.Tensor)
    assert np.array_equal(bits(got.numpy()), bits(ar.apply_cos_sin(x, cos, sin, **kw)))
    learned = torch.from_numpy(cos).requires_grad_()  # the operator, which autograd records
    y = ar.apply_cos_sin(torch.from_numpy(x), learned, torch.from_numpy(sin), **kw)
    y.sum().backward()
    assert learned.grad is not None and learned.grad.shape == learned.shape


@settings(max_examples=20)  # each builds and computes four graphs
@given(
    chunks=st.tuples(*[st.integers(1, 4)] * 3),
    style=st.sampled_from(["interleaved", "half"]),
    duplicated=st.booleans(),
    per_sequence=st.booleans(),
    lazy_tables=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_dask_arrays_chunk_by_chunk(chunks, style, duplicated, per_sequence, lazy_tables, seed):
    da = pytest.importorskip("dask.array", reason="dask is not installed")
    rng = np.random.default_rng(seed)
    x = random_array(rng, (2, 3, 5, 8), np.float32)
    angle = rng.uniform(-10, 10, (2, 5, 4) if per_sequence else (5, 4))
    if duplicated:
        angle = np.concatenate([angle, angle], -1) if style == "half" else angle.repeat(2, -1)
    cos, sin = np.cos(angle), np.sin(angle)
    kw = dict(style=style, rotary_dim=8, head_axis=1 if per_sequence else None)
    want = ar.apply_cos_sin(x, cos, sin, **kw)
    lazy = da.from_array(x, chunks=chunks + (3,))  # the feature axis split too: made whole
    if lazy_tables:
        cos, sin = da.from_array(cos, chunks=2), da.from_array(sin, chunks=2)
    got = ar.apply_cos_sin(lazy, cos, sin, **kw)
    assert isinstance(got, da.Array)
    assert np.array_equal(bits(got.compute()), bits(want))
    q, k = ar.apply_cos_sin_qk(lazy, lazy[:, :1], cos, sin, **kw)
    assert np.array_equal(bits(q.compute()), bits(want))
    assert np.array_equal(bits(k.compute()), bits(want[:, :1]))
    with pytest.raises(ar.RopeValueError, match="out is not supported for dask"):
        ar.apply_cos_sin(lazy, cos, sin, out=lazy, **kw)
    with pytest.raises(ar.RopeValueError, match="does not broadcast|lines up as"):
        ar.apply_cos_sin(lazy, cos[..., :3, :], sin[..., :3, :], **kw)


def _torch_reference(torch, x, cos, sin, style, rotary_dim, head_axis):
    """transformers' formula on per-feature tables (duplicated layout)."""
    if head_axis is not None:
        cos, sin = cos.unsqueeze(head_axis), sin.unsqueeze(head_axis)
    h = rotary_dim // 2
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if style == "half":
        turned = torch.cat([-rot[..., h:], rot[..., :h]], -1)
    else:
        turned = torch.stack([-rot[..., 1::2], rot[..., 0::2]], -1).flatten(-2)
    return torch.cat([rot * cos + turned * sin, rest], -1)


@pytest.mark.parametrize("style", ["interleaved", "half"])
@pytest.mark.parametrize("duplicated", [False, True], ids=["pairs", "duplicated"])
@pytest.mark.parametrize("head_axis", [None, 1])
def test_torch_gradients_reach_the_tables(style, duplicated, head_axis):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 12, dtype=torch.float64, generator=g)
    lead = (2, 5) if head_axis is not None else (5,)
    cos = torch.randn(*lead, 4, dtype=torch.float64, generator=g)
    sin = torch.randn(*lead, 4, dtype=torch.float64, generator=g)
    if duplicated:
        widen = (
            (lambda t: torch.cat([t, t], -1))
            if style == "half"
            else (lambda t: t.repeat_interleave(2, -1))
        )
        cos, sin = widen(cos), widen(sin)
    kw = dict(style=style, rotary_dim=8, head_axis=head_axis)
    full = (
        (lambda t: t)
        if duplicated
        else (
            (lambda t: torch.cat([t, t], -1))
            if style == "half"
            else (lambda t: t.repeat_interleave(2, -1))
        )
    )

    def f(x, c, s):
        return ar.apply_cos_sin(x, c, s, **kw)

    def reference(x, c, s):
        return _torch_reference(torch, x, full(c), full(s), style, 8, head_axis)

    inputs = tuple(t.clone().requires_grad_() for t in (x, cos, sin))
    assert torch.allclose(f(*inputs), reference(*inputs), atol=1e-12)
    if not duplicated:  # a duplicated table's halves must stay equal: no finite differences
        assert torch.autograd.gradcheck(f, inputs)
        assert torch.autograd.gradgradcheck(f, inputs)
    weights = torch.randn(x.shape, dtype=torch.float64, generator=g)
    got = torch.autograd.grad((f(*inputs) * weights).sum(), inputs)
    want = torch.autograd.grad((reference(*inputs) * weights).sum(), inputs)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-12)
    # torch.func and the compiler see the same operator
    tangents = tuple(torch.randn(t.shape, dtype=torch.float64, generator=g) for t in inputs)
    plain = tuple(t.detach() for t in inputs)
    assert torch.allclose(
        torch.func.jvp(f, plain, tangents)[1], torch.func.jvp(reference, plain, tangents)[1]
    )
    batched = torch.func.vmap(f, in_dims=(0, None, None))(
        torch.stack([plain[0]] * 3), plain[1], plain[2]
    )
    assert torch.allclose(batched, torch.stack([reference(*plain)] * 3))
    compiled = torch.compile(f, fullgraph=True)
    assert torch.allclose(compiled(*plain), reference(*plain))
    torch.library.opcheck(
        torch.ops.arrayrope.apply_cos_sin.default,
        (plain[0], plain[1], plain[2], style, 8, False, head_axis, "auto"),
    )


@pytest.mark.parametrize("style", ["interleaved", "half"])
@pytest.mark.parametrize("duplicated", [False, True], ids=["pairs", "duplicated"])
def test_jax_transforms_reach_the_tables(style, duplicated):
    jax = pytest.importorskip("jax", reason="JAX is not installed")
    jnp = jax.numpy
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 3, 5, 12)), jnp.float32)
    cos, sin = (jnp.asarray(rng.standard_normal((2, 5, 4)), jnp.float32) for _ in range(2))
    widen = (
        (lambda t: jnp.concatenate([t, t], -1))
        if style == "half"
        else (lambda t: jnp.repeat(t, 2, -1))
    )
    if duplicated:
        cos, sin = widen(cos), widen(sin)
    full = (lambda t: t) if duplicated else widen

    def f(x, c, s):
        return ar.apply_cos_sin(x, c, s, style=style, rotary_dim=8, head_axis=1)

    def reference(x, c, s):
        c, s = full(c)[:, None], full(s)[:, None]
        rot = x[..., :8]
        if style == "half":
            turned = jnp.concatenate([-rot[..., 4:], rot[..., :4]], -1)
        else:
            turned = jnp.stack([-rot[..., 1::2], rot[..., 0::2]], -1).reshape(rot.shape)
        return jnp.concatenate([rot * c + turned * s, x[..., 8:]], -1)

    def close(a, b):
        assert float(jnp.abs(a - b).max()) <= 1e-5 * float(jnp.abs(b).max() + 1)

    close(jax.jit(f)(x, cos, sin), reference(x, cos, sin))
    weights = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    for got, want in zip(
        jax.jit(jax.grad(lambda *a: (f(*a) * weights).sum(), argnums=(0, 1, 2)))(x, cos, sin),
        jax.grad(lambda *a: (reference(*a) * weights).sum(), argnums=(0, 1, 2))(x, cos, sin),
    ):
        close(got, want)
    tangents = tuple(jnp.asarray(rng.standard_normal(t.shape), jnp.float32) for t in (x, cos, sin))
    close(jax.jvp(f, (x, cos, sin), tangents)[1], jax.jvp(reference, (x, cos, sin), tangents)[1])
    stacked = jnp.stack([cos, 2 * cos, 3 * cos])
    close(
        jax.vmap(f, (None, 0, None))(x, stacked, sin),
        jax.vmap(reference, (None, 0, None))(x, stacked, sin),
    )
    assert jax.eval_shape(f, x, cos, sin).shape == x.shape
