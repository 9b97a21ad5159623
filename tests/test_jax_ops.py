"""JAX code under jit, grad, vjp, jvp, vmap and eval_shape, through arrayrope's JAX primitive
(arrayrope/_jax_ops.py). Every result is compared with the eager NumPy call on the same
values, which the rest of the suite checks against the float64 oracle."""

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import arrayrope as ar
from arrayrope import RopeTypeError, RopeValueError
from arrayrope.scaling import YaRN

jax = pytest.importorskip("jax", reason="JAX is not installed")
jnp = jax.numpy

ROPE = ar.RoPE(16, style="half", rotary_dim=12, scaling=YaRN(4.0, 64))


def _expected(rope, x, pos, **kwargs):
    pos = np.asarray(pos) if hasattr(pos, "shape") else pos
    return rope.rotate(np.asarray(x), pos, **kwargs)


def _data(seed=0, shape=(2, 3, 5, 16), dtype=np.float32):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(shape).astype(dtype)), jnp.asarray(
        rng.integers(0, 2**31 - 1, shape[-2]).astype(np.int32)
    )


def test_jit_matches_the_eager_call_for_each_entry():
    x, pos = _data()

    @jax.jit
    def step(x, pos):
        q_rot, k_rot = ar.rotate_qk(x, x[:, :1], pos, style="half")
        return (
            ar.rotate(x, pos, style="half"),
            q_rot,
            k_rot,
            ROPE.rotate(x, 7),
            ROPE.unrotate(ROPE.rotate(x, pos), pos),
        )

    y, q_rot, k_rot, fixed, undone = step(x, pos)
    want = ar.rotate(np.asarray(x), np.asarray(pos), style="half")
    np.testing.assert_array_equal(np.asarray(y), want)
    np.testing.assert_array_equal(np.asarray(q_rot), want)
    np.testing.assert_array_equal(np.asarray(k_rot), want[:, :1])
    np.testing.assert_array_equal(np.asarray(fixed), _expected(ROPE, x, 7))
    np.testing.assert_allclose(np.asarray(undone), np.asarray(x), rtol=1e-5, atol=1e-5)
    shape = jax.eval_shape(lambda x: ROPE.rotate(x, pos), x)
    assert shape.shape == x.shape and shape.dtype == x.dtype


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_jit_for_other_dtypes(dtype):
    import contextlib

    # float64 arrays exist in JAX with x64 on (here for this test only)
    with jax.enable_x64(True) if dtype == "float64" else contextlib.nullcontext():
        x, pos = _data()
        x = x.astype(dtype)
        assert x.dtype.name == dtype
        got = jax.jit(lambda x, p: ROPE.rotate(x, p))(x, pos)
        assert got.dtype == x.dtype
        np.testing.assert_array_equal(
            np.asarray(got).view(np.uint16), _expected(ROPE, x, pos).view(np.uint16)
        )


def test_grad_vjp_and_jvp_are_the_transpose_and_the_rotation():
    x, pos = _data(1)
    ones = np.ones(x.shape, np.float32)
    transpose = _expected(ROPE, ones, pos, inverse=True)
    for grad in (jax.grad, lambda f: jax.jit(jax.grad(f))):
        got = grad(lambda t: ROPE.rotate(t, pos).sum())(x)
        np.testing.assert_allclose(np.asarray(got), transpose, rtol=1e-6, atol=1e-6)
    y, pull = jax.vjp(lambda t: ROPE.rotate(t, pos), x)
    np.testing.assert_array_equal(np.asarray(y), _expected(ROPE, x, pos))
    np.testing.assert_allclose(np.asarray(pull(jnp.ones_like(x))[0]), transpose, rtol=1e-6)
    tangent = jnp.asarray(np.random.default_rng(2).standard_normal(x.shape).astype(np.float32))
    _, dy = jax.jvp(lambda t: ROPE.rotate(t, pos), (x,), (tangent,))
    np.testing.assert_allclose(np.asarray(dy), _expected(ROPE, tangent, pos), rtol=1e-6)
    q_grad, k_grad = jax.grad(
        lambda q, k: sum(r.sum() for r in ROPE.rotate_qk(q, k, pos)), argnums=(0, 1)
    )(x, x[:, :1])
    np.testing.assert_allclose(np.asarray(q_grad), transpose, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(k_grad), transpose[:, :1], rtol=1e-6, atol=1e-6)
    # integer positions are inputs to grad too: their cotangent is float0
    g = jax.grad(lambda t, p: ROPE.rotate(t, p).sum(), argnums=(0, 1), allow_int=True)(x, pos)
    assert g[1].dtype == jax.dtypes.float0
    # forward over reverse: |R x|^2 has Hessian 2 s^2 on the rotated features, 2 on the tail
    hessian_vector = jax.jvp(jax.grad(lambda t: (ROPE.rotate(t, pos) ** 2).sum()), (x,), (x,))
    scale = np.where(np.arange(16) < ROPE.rotary_dim, ROPE.attention_scaling**2, 1.0)
    np.testing.assert_allclose(np.asarray(hessian_vector[1]), 2 * np.asarray(x) * scale, rtol=1e-4)


def test_vmap_with_shared_and_per_example_positions():
    x, pos = _data(3)
    per = jnp.asarray(np.random.default_rng(4).integers(0, 10**6, (2, 5)).astype(np.int32))
    np.testing.assert_array_equal(
        np.asarray(jax.vmap(lambda t: ROPE.rotate(t, pos))(x)), _expected(ROPE, x, pos)
    )
    np.testing.assert_array_equal(
        np.asarray(jax.vmap(lambda t, p: ROPE.rotate(t, p))(x, per)),
        _expected(ROPE, x, np.asarray(per)[:, None]),
    )
    rows = x[:, 0, 0]  # (2, 16): one row per example
    np.testing.assert_array_equal(
        np.asarray(jax.vmap(lambda t, p: ROPE.rotate(t, p))(rows, per[:, 0])),
        _expected(ROPE, rows, per[:, 0]),
    )
    np.testing.assert_array_equal(
        np.asarray(jax.vmap(lambda t: ROPE.rotate(t))(rows)), _expected(ROPE, rows, 0)
    )
    q_rot, k_rot = jax.vmap(lambda q, k, p: ROPE.rotate_qk(q, k, p))(x, x[:, :1], per)
    np.testing.assert_array_equal(np.asarray(q_rot), _expected(ROPE, x, np.asarray(per)[:, None]))
    np.testing.assert_array_equal(
        np.asarray(k_rot), _expected(ROPE, x[:, :1], np.asarray(per)[:, None])
    )
    batched_grad = jax.vmap(jax.grad(lambda t: ROPE.rotate(t, pos).sum()))(x[None].repeat(3, 0))
    np.testing.assert_allclose(
        np.asarray(batched_grad)[1],
        _expected(ROPE, np.ones(x.shape, np.float32), pos, inverse=True),
        rtol=1e-6,
        atol=1e-6,
    )


_UNAWAITED = """
import jax, jax.numpy as jnp
import arrayrope as ar
rope = ar.RoPE(64, style="half")
x = jnp.ones((2, 8, 16, 64), jnp.float32)
# its result never awaited: the program may still run as the interpreter exits
jax.jit(lambda x: rope.rotate(x, jnp.arange(16)).sum())(x)
print("dispatched", flush=True)
"""


def test_a_process_exits_with_jitted_calls_still_in_flight():
    # A program that the last lines dispatch runs on XLA's threads while the interpreter exits;
    # a Python handler that asked for the GIL then would never get it, and XLA's shutdown would
    # wait for that thread forever (see _jax_ffi's entry).
    for _ in range(2):  # the hang it guards against came in most runs, not all
        done = subprocess.run(
            [sys.executable, "-c", _UNAWAITED],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip() == "dispatched"


def test_the_handler_entry_runs_no_python_once_closing(monkeypatch):
    from arrayrope import _jax_ffi, _jax_ops  # noqa: F401  (_jax_ops registers its runner)

    runs = []
    run = _jax_ffi.RUNNERS["rotate"]
    monkeypatch.setitem(_jax_ffi.RUNNERS, "rotate", lambda *a: runs.append(1) or run(*a))
    x, pos = _data()
    call = jax.jit(lambda x, pos: ROPE.rotate(x, pos))
    expected = _expected(ROPE, x, pos)
    np.testing.assert_array_equal(np.asarray(call(x, pos)), expected)
    assert len(runs) == 1 and _jax_ffi._STATE[1] == 0
    try:
        _jax_ffi._STATE[0] = 1  # as _close leaves it
        call(x, pos).block_until_ready()
        assert len(runs) == 1, "the entry ran Python after closing"
    finally:
        _jax_ffi._STATE[0] = 0
    np.testing.assert_array_equal(np.asarray(call(x, pos)), expected)
    assert len(runs) == 2 and _jax_ffi._STATE[1] == 0


def test_errors_under_jit():
    x, pos = _data()
    with pytest.raises(RopeValueError, match="head_dim"):
        jax.jit(lambda t: ROPE.rotate(t[..., :8], pos))(x)
    with pytest.raises(RopeTypeError, match="x must be float16"):
        jax.jit(lambda t: ROPE.rotate(t.astype(jnp.int32), pos))(x)
    with pytest.raises(RopeValueError, match="immutable"):
        jax.jit(lambda t: ROPE.rotate(t, pos, out=t))(x)
    with pytest.raises(RopeValueError, match="not to the positions"):
        jax.grad(lambda p: ROPE.rotate(x, p).sum())(pos.astype(jnp.float32))
    with pytest.raises(Exception, match="RopeValueError: pos"):  # a value only the run sees
        jax.jit(lambda t, p: ROPE.rotate(t, p))(x, -pos - 1).block_until_ready()
    for scalar in (-1, 2**31, 2**70, float("nan"), -0.5):  # values the trace sees: refused there
        with pytest.raises(RopeValueError, match="pos must be"):
            jax.jit(lambda t, s=scalar: ROPE.rotate(t, s))(x)


def test_arrays_of_another_framework_beside_traced_positions_are_refused():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    x, pos = _data()
    t = torch.from_numpy(np.asarray(x).copy())
    for call in (
        lambda p: ROPE.rotate(t, p),
        lambda p: ar.rotate(t, p),
        lambda p: ROPE.rotate_qk(t, t, p),
    ):
        with pytest.raises(RopeTypeError, match="traced JAX array and [xq] a torch"):
            jax.jit(call)(pos)


@settings(max_examples=30, deadline=None)
@given(
    style=st.sampled_from(["interleaved", "half"]),
    rotary=st.sampled_from([1.0, 0.5, 0.25]),
    shape=st.sampled_from([(5, 16), (2, 3, 5, 16), (1, 4, 1, 16)]),
    pos_kind=st.sampled_from(["array", "int", "float", "none"]),
    dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_jit_equals_the_eager_call(style, rotary, shape, pos_kind, dtype, seed):
    rope = ar.RoPE(16, style=style, rotary_dim=int(16 * rotary))
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(shape)).astype(dtype)
    draw = int(rng.integers(0, 2**31 - 1))
    pos = {
        "array": jnp.asarray(rng.integers(0, 2**31 - 1, shape[-2]).astype(np.int32)),
        "int": draw,
        "float": draw / 7.0,
        "none": None,
    }[pos_kind]
    got = jax.jit(lambda t: rope.rotate(t, pos))(x)
    want = rope.rotate(x, pos)  # eager: the direct path
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))


def test_vmap_default_positions_of_operands_of_different_ranks():
    rope = ar.RoPE(16, style="half")
    q = jnp.asarray(np.random.default_rng(5).standard_normal((3, 16)).astype(np.float32))
    k = jnp.asarray(np.random.default_rng(6).standard_normal((3, 4, 16)).astype(np.float32))
    q_rot, k_rot = jax.vmap(lambda a, b: rope.rotate_qk(a, b))(q, k)
    np.testing.assert_array_equal(np.asarray(q_rot), rope.rotate(np.asarray(q), 0))
    np.testing.assert_array_equal(np.asarray(k_rot), rope.rotate(np.asarray(k)))  # 0..3 each
    halves = jnp.asarray(np.arange(4, dtype=np.float16))
    np.testing.assert_array_equal(
        np.asarray(jax.jit(lambda a, p: rope.rotate(a, p))(k, halves)),
        rope.rotate(np.asarray(k), np.arange(4, dtype=np.float16)),
    )


# rotate_into_cache: JAX arrays cannot be written, so the step returns (out, k_cache, v_cache)
STEP_ROPE = ar.RoPE(32, style="half", rotary_dim=24)


def _step_inputs(seed, n=6, dtype=np.float32, cache_dtype=None, layout="NHD"):
    """q, k, v (views of one projection), positions across the table's end, the caches (NumPy)
    and slots with one padding token."""
    rng = np.random.default_rng(seed)
    hq, hkv, d = 4, 2, 32
    qkv = rng.standard_normal((n, (hq + 2 * hkv) * d)).astype(dtype)
    q = qkv[:, : hq * d].reshape(n, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].reshape(n, hkv, d)
    v = qkv[:, (hq + hkv) * d :].reshape(n, hkv, d)
    shape = (3, 8, hkv, d) if layout == "NHD" else (3, hkv, 8, d)
    caches = rng.standard_normal((2, *shape)).astype(cache_dtype or dtype)
    pos = rng.integers(0, 2**31 - 1, n)
    pos[: n // 2] = rng.integers(0, 1000, n // 2)
    slots = rng.permutation(24)[:n]
    slots[n // 2] = -1
    return q, k, v, pos, caches[0], caches[1], slots


def _numpy_step(rope, q, k, v, pos, k_cache, v_cache, slots, **options):
    k_cache, v_cache = k_cache.copy(), v_cache.copy()
    out = rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots, **options)
    return out, k_cache, v_cache


def _same_bits(got, want):
    for a, b in zip(got, want):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@settings(max_examples=12, deadline=None)
@given(
    n=st.integers(1, 8),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    layout=st.sampled_from(["NHD", "HND"]),
    int_position=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_rotate_into_cache_under_jit_equals_the_numpy_step(n, dtype, layout, int_position, seed):
    q, k, v, pos, k_cache, v_cache, slots = _step_inputs(seed, n, jnp.dtype(dtype), layout=layout)
    if int_position:
        pos = int(pos[0])
    want = _numpy_step(STEP_ROPE, q, k, v, pos, k_cache, v_cache, slots, cache_layout=layout)
    given = [jnp.asarray(a) for a in (q, k, v, k_cache, v_cache, slots)]
    p = pos if int_position else jnp.asarray(pos.astype(np.int32))

    def step(q, k, v, k_cache, v_cache, slots):
        return STEP_ROPE.rotate_into_cache(q, k, v, p, k_cache, v_cache, slots, cache_layout=layout)

    _same_bits(jax.jit(step)(*given), want)
    _same_bits(given[3:5], (k_cache, v_cache))  # the caches given are not written
    _same_bits(step(*given), want)  # eager: on copies of the caches
    _same_bits(given[3:5], (k_cache, v_cache))


def test_rotate_into_cache_writes_donated_caches_in_place():
    q, k, v, pos, k_cache, v_cache, slots = _step_inputs(1)
    want = _numpy_step(STEP_ROPE, q, k, v, pos, k_cache, v_cache, slots)
    step = jax.jit(lambda *a: STEP_ROPE.rotate_into_cache(*a), donate_argnums=(4, 5))
    given = [jnp.asarray(a) for a in (q, k, v, pos.astype(np.int32), k_cache, v_cache, slots)]
    addresses = [a.unsafe_buffer_pointer() for a in given[4:6]]
    got = step(*given)
    _same_bits(got, want)
    assert [a.unsafe_buffer_pointer() for a in got[1:]] == addresses


def test_a_jit_decode_loop_takes_the_launchs_own_build(monkeypatch):
    # XLA's operand buffers reach the fused launch as writable views, which it takes as they
    # are: no operand is aliased on the way
    from arrayrope.backends.cpu import _fused_launch

    q, k, v, pos, k_cache, v_cache, slots = _step_inputs(2)
    step = jax.jit(lambda *a: STEP_ROPE.rotate_into_cache(*a), donate_argnums=(4, 5))
    given = [jnp.asarray(a) for a in (q, k, v, pos.astype(np.int32), k_cache, v_cache, slots)]
    given[4:6] = step(*given)[1:]  # the first step goes the general way and compiles

    def missed(a):
        raise AssertionError("a read-only operand reached the fused launch")

    monkeypatch.setattr(_fused_launch, "writable", missed)
    for _ in range(2):
        got = step(*given)
        given[4:6] = got[1:]
    got[0].block_until_ready()


def test_rotate_into_cache_with_norms_and_a_float8_cache():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, k, v, pos, k_cache, v_cache, slots = _step_inputs(
        2, dtype=ml_dtypes.bfloat16, cache_dtype=ml_dtypes.float8_e4m3fn, layout="HND"
    )
    rng = np.random.default_rng(3)
    weights = rng.standard_normal((2, 32)).astype(np.float32)
    options = dict(cache_layout="HND", q_norm=weights[0], k_norm=weights[1], norm_eps=1e-5,
                   k_scale=0.5, v_scale=2.0)  # fmt: skip
    want = _numpy_step(STEP_ROPE, q, k, v, pos, k_cache, v_cache, slots, **options)
    jax_options = options | {"q_norm": jnp.asarray(weights[0]), "k_norm": jnp.asarray(weights[1])}
    given = [jnp.asarray(a) for a in (q, k, v, pos.astype(np.int32), k_cache, v_cache, slots)]
    _same_bits(jax.jit(lambda *a: STEP_ROPE.rotate_into_cache(*a, **jax_options))(*given), want)
    shapes = jax.eval_shape(lambda *a: STEP_ROPE.rotate_into_cache(*a, **jax_options), *given)
    assert [(s.shape, s.dtype) for s in shapes] == [(a.shape, a.dtype) for a in want]


def test_rotate_into_cache_refusals():
    q, k, v, pos, k_cache, v_cache, slots = _step_inputs(4)
    given = [jnp.asarray(a) for a in (q, k, v, pos.astype(np.int32), k_cache, v_cache)]
    twice = jnp.asarray(np.r_[slots[:-1], slots[0]])  # two tokens in one slot
    with pytest.raises(RopeValueError, match="slots must be distinct"):
        STEP_ROPE.rotate_into_cache(*given, twice)
    with pytest.raises(Exception, match="RopeValueError: slots must be distinct"):  # at run
        jax.jit(lambda *a: STEP_ROPE.rotate_into_cache(*a))(*given, twice)[0].block_until_ready()
    with pytest.raises(RopeValueError, match="out is not supported for JAX arrays"):
        STEP_ROPE.rotate_into_cache(*given, jnp.asarray(slots), out=given[0])
    with pytest.raises(RopeTypeError, match="inference step"):
        jax.grad(lambda q: STEP_ROPE.rotate_into_cache(q, *given[1:], slots)[0].sum())(given[0])
    with pytest.raises(RopeTypeError, match="not batched by vmap"):
        jax.vmap(lambda q: STEP_ROPE.rotate_into_cache(q, *given[1:], slots)[0])(given[0][None])
    with pytest.raises(RopeTypeError, match="k_cache, v_cache are not"):  # left unwritten
        STEP_ROPE.rotate_into_cache(*given[:4], k_cache, v_cache, jnp.asarray(slots))
    with pytest.raises(RopeTypeError, match="k_scale must be a number"):
        STEP_ROPE.rotate_into_cache(*given, jnp.asarray(slots), k_scale=jnp.asarray(0.5))
    bad = {  # shapes and dtypes: refused before the call is traced, under jit too
        "k_cache of shape .* has Hkv=": dict(cache_layout="HND"),
        "k and v must have one number of heads": dict(v=given[2][:, :1]),
        "v_cache must have q's dtype": dict(v_cache=given[5].astype(jnp.float16)),
    }
    names = ("q", "k", "v", "pos", "k_cache", "v_cache")
    for message, change in bad.items():
        layout = change.pop("cache_layout", "NHD")
        args = [change.get(name, a) for name, a in zip(names, given)]
        with pytest.raises((RopeValueError, RopeTypeError), match=message):
            jax.jit(lambda *a, lay=layout: STEP_ROPE.rotate_into_cache(*a, cache_layout=lay))(
                *args, jnp.asarray(slots)
            )
    for layout in (["NHD"], "THD"):  # refused before the call is traced, under jit too
        with pytest.raises(RopeValueError, match="cache_layout must be"):
            jax.jit(lambda *a, lay=layout: STEP_ROPE.rotate_into_cache(*a, cache_layout=lay))(
                *given, jnp.asarray(slots)
            )


@pytest.mark.parametrize("tokens", [40, 1500])  # copied into XLA's memory; adopted by XLA
def test_eager_results_are_their_own_memory(tokens, monkeypatch):
    # An eager call's result, copied or adopted (_jax_results.ADOPTED_FROM): each its own, never
    # the input's, and unchanged by later calls; an adopted one is the memory it was written in.
    from arrayrope import _arrays

    made, empty_for_xla = [], _arrays.empty_for_xla
    monkeypatch.setattr(
        _arrays, "empty_for_xla", lambda *a: made.append(empty_for_xla(*a)) or made[-1]
    )
    x, pos = _data(shape=(2, 3, tokens, 16))
    first = ROPE.rotate(x, pos)
    q_rot, k_rot = ROPE.rotate_qk(x, x[:, :1], pos)
    adopted = {a.ctypes.data for a in made}
    assert (first.unsafe_buffer_pointer() in adopted) == (tokens == 1500)
    assert (q_rot.unsafe_buffer_pointer() in adopted) == (tokens == 1500)
    kept = [np.array(a) for a in (first, q_rot, k_rot)]
    for shift in range(1, 4):
        ROPE.rotate(x, pos + shift), ROPE.rotate_qk(x, x[:, :1], pos + shift)
    want = _expected(ROPE, x, pos)
    for a, copy, expected in zip((first, q_rot, k_rot), kept, (want, want, want[:, :1])):
        np.testing.assert_array_equal(np.asarray(a), copy)
        np.testing.assert_array_equal(copy, expected)
    pointers = {a.unsafe_buffer_pointer() for a in (x, first, q_rot, k_rot)}
    assert len(pointers) == 4
    grads = jax.grad(lambda t: ROPE.rotate(t, pos).sum())(x)  # the primitive's eager rule
    np.testing.assert_allclose(
        np.asarray(grads), _expected(ROPE, np.ones(x.shape, np.float32), pos, inverse=True),
        rtol=1e-6, atol=1e-6,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_the_gpu_route_gives_the_ffi_routes_bits_under_every_transform(dtype, monkeypatch):
    # On a GPU the primitives lower to jax.pure_callback of the CPU kernels (there is no CUDA
    # FFI handler). Put in place of the CPU's FFI lowering here, that route gives the same
    # bits under jit, grad, vmap and jvp, for rotate, rotate_qk and apply_cos_sin.
    from jax.interpreters import mlir

    from arrayrope import _jax_ffi, _jax_given, _jax_ops

    rope = ar.RoPE(16, style="half")
    rng = np.random.default_rng(11)
    x, k = (jnp.asarray(rng.standard_normal((2, 5, h, 16)), dtype) for h in (3, 1))
    c, s = (jnp.asarray(rng.standard_normal((2, 5, 8)), dtype) for _ in "cs")
    pos = jnp.arange(5)[:, None]

    def run():
        jax.clear_caches()  # no program lowered by the other route
        return [
            jax.jit(lambda x, p: rope.rotate_qk(x, k, p))(x, pos),
            jax.jit(jax.grad(lambda x: (rope.rotate(x, pos).astype(jnp.float32) ** 2).sum()))(x),
            jax.jit(jax.vmap(lambda x, p: rope.rotate(x, p)))(x, jnp.stack([pos, pos + 2])),
            jax.jit(lambda x: jax.jvp(lambda t: rope.rotate(t, 3), (x,), (x,)))(x),
            jax.jit(
                lambda x, c, s: ar.apply_cos_sin(x, c, s, style="half", rotary_dim=16, head_axis=-2)
            )(x, c, s),
        ]

    through_ffi = run()
    lowerings = mlir._platform_specific_lowerings["cpu"]
    for primitive, module, many in ((_jax_ops.rotate_p, _jax_ops, True),
                                    (_jax_given.apply_p, _jax_given, False)):  # fmt: skip
        monkeypatch.setitem(lowerings, primitive, lowerings[primitive])  # restored at the end
        lowering = mlir.lower_fun(module._through_host, multiple_results=many)
        mlir.register_lowering(primitive, lowering, platform="cpu")
    try:
        text = jax.jit(lambda x: rope.rotate(x, 3)).lower(x).as_text()
        assert "callback" in text and f"@{_jax_ffi.TARGET}" not in text
        through_host = run()
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    _same_bits(jax.tree.leaves(through_host), jax.tree.leaves(through_ffi))


def test_the_gpu_lowerings(monkeypatch):
    # The CUDA lowerings: rotate's and apply_cos_sin's reach jax.pure_callback (stopped there:
    # a callback cannot be lowered for a platform that is absent) with the results' shapes;
    # rotate_into_cache's refuses, as a callback would carry the caches both ways each step
    x, pos = _data(seed=3)
    cos = sin = jnp.ones((5, 8), jnp.float32)

    class Routed(Exception):
        pass

    def pure_callback(callback, results, *args):
        results = results if isinstance(results, list) else [results]
        raise Routed([(r.shape, r.dtype) for r in results], len(args))

    def lowered(f, *args):
        with pytest.raises(Routed) as routed:
            jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
        return routed.value.args

    q, k, v, p, k_cache, v_cache, slots = _step_inputs(2, 3, jnp.dtype("float32"))
    step = [jnp.asarray(a) for a in (q, k, v, k_cache, v_cache, slots)]
    with pytest.raises(ar.BackendUnavailableError, match="runs on the CPU"):
        jax.jit(lambda *a: STEP_ROPE.rotate_into_cache(*a[:3], 0, *a[3:])).trace(*step).lower(
            lowering_platforms=("cuda",)
        )
    monkeypatch.setattr(jax, "pure_callback", pure_callback)
    grad = jax.grad(lambda t: (ROPE.rotate(t, pos) ** 2).sum())
    assert lowered(grad, x) == ([(x.shape, x.dtype)], 2)
    assert lowered(lambda x, p: ROPE.rotate_qk(x, x[:, :1], p), x, pos) == (
        [(x.shape, x.dtype), (x[:, :1].shape, x.dtype)],
        3,
    )
    applied = lowered(lambda x: ar.apply_cos_sin(x, cos, sin, style="half", rotary_dim=16), x)
    assert applied == ([(x.shape, x.dtype)], 3)
