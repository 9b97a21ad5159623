"""Behaviour of the public API beyond the maths: layouts, caching, threads, cos_sin, imports."""

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from conftest import BF16, DTYPES, assert_matches, oracle, poisoned

import arrayrope as ar


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape, pos_shape",
    [
        ((2, 3, 5, 8), (5,)),  # (B, H, T, d) with (T,)
        ((2, 3, 5, 8), (2, 1, 5)),  # (B, H, T, d) with (B, 1, T)
        ((2, 5, 3, 8), (5, 1)),  # (B, T, H, d) with (T, 1)
        ((2, 5, 3, 8), (2, 5, 1)),  # (B, T, H, d) with (B, T, 1)
        ((7, 3, 8), (7, 1)),  # packed variable-length (N, H, d)
        ((8,), ()),  # one vector
    ],
)
def test_position_layouts(rng, dtype, shape, pos_shape):
    x = rng.standard_normal(shape).astype(dtype)
    pos = rng.integers(0, 10**5, size=pos_shape)
    out = poisoned(shape, dtype)
    ar.rotate(x, pos, out=out)
    assert_matches(out, oracle(x, pos), x)


@pytest.mark.parametrize(
    "pos_dtype",
    [np.int8, np.uint16, ">i4", np.uint64, ">u8", np.float16, np.float32, ">f8", np.longdouble],
    ids=str,
)
@pytest.mark.parametrize("backend", ["numba", "numpy"])
def test_every_real_position_dtype(rng, pos_dtype, backend):
    x = rng.standard_normal((2, 3, 5, 8)).astype(np.float32)
    pos = rng.integers(0, 100, size=5)
    expected = ar.rotate(x, pos, backend=backend)
    out = poisoned(x.shape, x.dtype)
    ar.rotate(x, pos.astype(pos_dtype), out=out, backend=backend)
    np.testing.assert_array_equal(out, expected)
    if np.dtype(pos_dtype).kind == "f":
        with pytest.raises(ValueError, match="finite"):
            ar.rotate(x, np.array([0, 1, np.inf, 2, 3]).astype(pos_dtype), backend=backend)
    if np.dtype(pos_dtype).kind in "if":
        with pytest.raises(ValueError, match="non-negative"):
            ar.rotate(x, (-pos - 1).astype(pos_dtype), backend=backend)


def test_default_positions_run_along_axis_minus_2(rng):
    x = rng.standard_normal((2, 3, 6, 8)).astype(np.float32)
    np.testing.assert_array_equal(ar.rotate(x), ar.rotate(x, np.arange(6)))
    one = rng.standard_normal(8).astype(np.float32)
    np.testing.assert_array_equal(ar.rotate(one), one)  # a lone vector sits at position 0


def test_scalar_position_puts_every_row_there(rng):
    x = rng.standard_normal((4, 5, 8))
    np.testing.assert_array_equal(ar.rotate(x, 17), ar.rotate(x, np.full((4, 5), 17)))


def test_x_is_never_modified_without_out(rng):
    x = rng.standard_normal((3, 4, 16)).astype(np.float32)
    before = x.copy()
    y = ar.rotate(x, 5)
    assert y is not x and not np.shares_memory(x, y)
    np.testing.assert_array_equal(x, before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_in_place(rng, dtype):
    x = rng.standard_normal((3, 4, 16)).astype(dtype)
    expected = ar.rotate(x, 9, rotary_dim=8)
    assert ar.rotate(x, 9, rotary_dim=8, out=x) is x
    np.testing.assert_array_equal(x.view(np.uint8), expected.view(np.uint8))


def test_fused_qkv_views_in_place(rng):
    qkv = rng.standard_normal((2, 7, 3, 4, 16)).astype(np.float32)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    pos = np.arange(7)[:, None]
    expected_q, expected_k = ar.rotate(q.copy(), pos), ar.rotate(k.copy(), pos)
    v_before = v.copy()
    qr, kr = ar.rotate_qk(q, k, pos, out=(q, k))
    assert qr is q and kr is k
    np.testing.assert_array_equal(q, expected_q)
    np.testing.assert_array_equal(k, expected_k)
    np.testing.assert_array_equal(v, v_before)


def test_large_input_runs_the_parallel_kernel(rng):
    from arrayrope.backends.cpu import _config

    x = rng.standard_normal((2, 4, 3000, 32)).astype(np.float32)
    assert x.size >= _config.CONFIG.serial_below
    pos = rng.integers(0, 10**6, 3000)
    k = rng.standard_normal((2, 1, 3000, 32)).astype(np.float32)
    q_out, k_out = poisoned(x.shape, x.dtype), poisoned(k.shape, k.dtype)
    ar.rotate_qk(x, k, pos, style="half", out=(q_out, k_out))
    assert_matches(q_out, oracle(x, pos, style="half"), x)
    assert_matches(k_out, oracle(k, pos, style="half"), k)


@pytest.mark.parametrize("pointers", [True, False])
def test_parallel_launches_with_and_without_function_pointers(pointers, monkeypatch, rng):
    # The parallel entry point reaches the kernels through Numba internals; where they move,
    # each kernel gets a parallel entry of its own. Both give the one-thread kernel's bits.
    from arrayrope.backends.cpu import _config, _parallel

    monkeypatch.setattr(_parallel, "FUNCTION_POINTERS", pointers)
    rope = ar.RoPE(32, style="half", rotary_dim=16, max_positions=64)
    x = rng.standard_normal((2, 4, 300, 32)).astype(np.float32)
    k = rng.standard_normal((2, 1, 300, 32)).astype(np.float32)
    for pos in (rng.integers(0, 64, 300), rng.integers(0, 2**31, 300)):  # cached, past the cap
        with _config.override(serial_below=1 << 62, small_below=0):
            want = rope.rotate_qk(x, k, pos)
        with _config.override(serial_below=0, small_below=0):
            got = rope.rotate_qk(x, k, pos)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
        assert_matches(got[0], oracle(x, pos, style="half", rotary_dim=16), x)
    assert _parallel.FUNCTION_POINTERS is pointers


def test_cache_grows_geometrically_and_serves_large_positions():
    rope = ar.RoPE(16)
    x = np.ones((1, 16), np.float32)
    rope.rotate(x, 10)
    tables = rope._default.tables._tables
    (rows,) = {t.shape[1] for t in tables.values()}  # cos and sin stacked: (2, rows, pairs)
    rope.rotate(x, rows)  # one past the end: the table at least doubles, not +1
    (grown,) = {t.shape[1] for t in tables.values()}
    assert grown >= 2 * rows
    rope.rotate(x, rows + 1)
    assert {t.shape[1] for t in tables.values()} == {grown}  # no growth per call
    # Past the cap, positions are exact per call and the cache stays bounded.
    y = rope.rotate(x, 2**31 - 1)
    assert_matches(y, oracle(x, 2**31 - 1), x)
    assert max(t.nbytes for t in tables.values()) <= 32 << 20


def test_max_positions_builds_once():
    rope = ar.RoPE(8, max_positions=100)
    x = np.ones((1, 8), np.float32)
    rope.rotate(x, 3)
    (table,) = rope._default.tables._tables.values()
    assert table.shape[1] == 100
    assert_matches(rope.rotate(x, 100), oracle(x, 100), x)  # past it: exact, still right
    (same,) = rope._default.tables._tables.values()
    assert same is table


@pytest.mark.parametrize("value", [2**31 + 1, 2**40])
def test_max_positions_past_every_position_is_refused(value):
    # positions stop below 2**31: a larger cache could hold nothing more, and would fail to
    # allocate at the first call with NumPy's MemoryError, which names no argument
    with pytest.raises(ar.RopeValueError, match=rf"max_positions must be at most 2\*\*31.*{value}"):
        ar.RoPE(8, max_positions=value)
    assert ar.RoPE(8, max_positions=2**31).max_positions == 2**31  # built at first use only


def test_module_functions_share_one_rope():
    from arrayrope._api import shared_rope

    assert shared_rope(64, 10000.0, "half", None, None) is shared_rope(
        64, 10000.0, "half", None, None
    )


def test_concurrent_calls_during_growth():
    rope = ar.RoPE(32)
    x = np.random.default_rng(1).standard_normal((3, 32)).astype(np.float32)
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        for _ in range(30):
            p = int(rng.integers(0, 30000))
            y = rope.rotate(x, p)
            if np.abs(y.astype(np.float64) - oracle(x, p)).max() > 1e-5:
                errors.append(p)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@pytest.mark.parametrize("like", [None, np.zeros(1, np.float64), np.zeros(1, BF16)])
def test_cos_sin(like):
    rope = ar.RoPE(16, base=500.0)
    pos = np.array([[0, 3], [10**6, 7]])
    cos, sin = rope.cos_sin(pos, like=like)
    assert cos.shape == sin.shape == (2, 2, 8)
    assert cos.dtype == (
        np.float64 if like is not None and like.dtype == np.float64 else np.float32
    )
    angle = pos[..., None] * rope.inv_freq
    np.testing.assert_allclose(cos, np.cos(angle), atol=1e-7)
    np.testing.assert_allclose(sin, np.sin(angle), atol=1e-7)
    np.testing.assert_allclose(rope.inv_freq, 500.0 ** (-np.arange(0, 16, 2) / 16), rtol=1e-15)
    assert rope.inv_freq.dtype == np.float64 and rope.attention_scaling == 1.0


def test_empty_arrays():
    x = np.zeros((0, 4, 8), np.float32)
    assert ar.rotate(x).shape == (0, 4, 8)
    assert ar.rotate(x, np.zeros((0, 1), np.int64)).shape == (0, 4, 8)


def test_import_and_cpu_call_import_no_gpu_framework():
    code = (
        "import sys, numpy as np, arrayrope as ar\n"
        "ar.rotate(np.ones((2, 8), np.float32), 3)\n"
        "bad = [m for m in ('cupy', 'torch', 'jax', 'ml_dtypes', 'dask', 'numba.cuda')"
        " if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# A subprocess's opening: both parallel kernels (the rotation, and the gather of per-entry
# tables) have run once, their results kept in ``expected``.
_PARALLEL_CALLS = textwrap.dedent(
    """
    import os, numpy as np, arrayrope as ar
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8, 512, 64)).astype(np.float32)  # the parallel kernel's size
    axial = ar.RoPE.axial((32, 32))
    y = rng.standard_normal((1, 8, 4096, 64)).astype(np.float32)
    pos = rng.integers(0, 64, (4096, 2))  # 4096 entries: per-entry tables, gathered in parallel
    expected = ar.rotate(x), axial.rotate(y, pos)
    """
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="this platform has no fork()")
def test_forked_child_after_a_parallel_parent():
    # Numba kills a forked child that starts an OpenMP region after its parent did (the "omp"
    # threading layer); such a child must rotate on one thread instead, with the same results.
    code = _PARALLEL_CALLS + textwrap.dedent(
        """
        pid = os.fork()
        if pid == 0:
            same = np.array_equal(ar.rotate(x), expected[0])
            same &= np.array_equal(axial.rotate(y, pos), expected[1])
            os._exit(0 if same else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, os.waitstatus_to_exitcode(status)
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600)


def test_one_numba_thread_takes_no_parallel_launch():
    # With one Numba thread (NUMBA_NUM_THREADS=1, or one CPU) a parallel kernel would run its
    # tasks one after another, after a launch that costs more than a small call's rotation:
    # the calls take the one-thread kernels, with the reference's results.
    code = (
        textwrap.dedent(
            """
        import numpy as np, arrayrope as ar
        from arrayrope.backends.cpu import _config, _parallel

        def refuse(*args):
            raise AssertionError("a parallel launch on one thread")

        _parallel.launch_parallel = refuse
        import arrayrope.backends.cpu as cpu
        cpu.launch_parallel = refuse
        assert not _config.threads_usable()
        """
        )
        + _PARALLEL_CALLS
        + textwrap.dedent(
            """
        reference = ar.rotate(x, backend="numpy"), axial.rotate(y, pos, backend="numpy")
        for got, want in zip(expected, reference):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        """
        )
    )
    env = dict(os.environ, NUMBA_NUM_THREADS="1")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600, env=env)


def test_threads_calling_at_once_on_the_workqueue_layer():
    # Numba's fallback threading layer aborts the process when two threads launch parallel
    # kernels at once (Dask's threaded scheduler does): arrayrope's launches take turns there.
    code = _PARALLEL_CALLS + textwrap.dedent(
        """
        import threading, numba
        assert numba.threading_layer() == "workqueue"
        wrong = []

        def work():
            for _ in range(5):
                wrong.append(not np.array_equal(ar.rotate(x), expected[0]))
                wrong.append(not np.array_equal(axial.rotate(y, pos), expected[1]))

        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(wrong) == 40 and not any(wrong), wrong
        """
    )
    env = dict(os.environ, NUMBA_THREADING_LAYER="workqueue")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600, env=env)


def test_import_is_light():
    code = "import sys, arrayrope; assert 'numba' not in sys.modules, 'numba imported eagerly'"
    subprocess.run([sys.executable, "-c", code], check=True)
