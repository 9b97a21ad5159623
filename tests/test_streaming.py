"""The write paths (streaming stores, the direct path's vector loop) and the bfloat16 store's
nan handling.

Streaming starts at megabytes of output, too large for many hypothesis examples, so these tests
lower the threshold to zero and compare against the general row loop's plain stores bit for bit,
with outputs placed at every alignment inside poisoned buffers so that a stray or missing write
shows. The direct path's plain-store mode (VECTOR) is compared with the general loop likewise.
"""

import numpy as np
import pytest
from conftest import BF16, DTYPES, assert_matches, bits, oracle, poisoned, run_launcher
from hypothesis import given
from hypothesis import strategies as st

import arrayrope as ar

cpu = pytest.importorskip("arrayrope.backends.cpu", reason="the CPU kernels need Numba")
from arrayrope.backends.cpu import _config  # noqa: E402
from arrayrope.backends.cpu._ladder import takes_paired_row  # noqa: E402

PLAIN = {"stream_above": 1 << 62, "vector_rows": False}  # the general row loop's plain stores


def _general(rope, xs, pos, outs, inverse=False, modes=None):
    """Rotate through the general strategy's launcher; the store mode of each launch (0, or
    cpu.SCRATCH, DIRECT, VECTOR, VECTOR_AHEAD, UNALIGNED, CHUNKED, CHUNKED_PLAIN) is appended
    to ``modes``."""

    def launch(*args):
        mode = cpu.launch(*args)
        if modes is not None:
            modes.append(mode)

    return run_launcher(launch, rope, tuple(xs), pos, inverse=inverse, outs=tuple(outs))


def _streaming(threads, vector_rows=True):
    """Streaming stores for every output, on one thread or on all; with ``vector_rows`` off,
    outputs off the 16-byte grid stream from the scratch block (as multi-axis tables do)."""
    if not _config.STREAMING:
        pytest.skip("streaming stores are used on x86-64 only")
    return _config.override(
        stream_above=0,
        serial_below=0 if threads == "parallel" else 1 << 62,
        vector_rows=vector_rows,
    )


def _vector(threads):
    """The direct path's plain stores (VECTOR) for every output it can write: streaming off,
    on one thread or on all."""
    if not _config.STREAMING:
        pytest.skip("the direct path is used on x86-64 only")
    return _config.override(
        stream_above=1 << 62,
        vector_rows=True,
        serial_below=0 if threads == "parallel" else 1 << 62,
    )


def _window(shape, dtype, shift, gap):
    """A poisoned buffer and a view of ``shape`` inside it, ``shift`` elements from its start
    (every alignment against 64-byte lines) and ``gap`` elements between rows."""
    n, d = int(np.prod(shape[:-1])), shape[-1]
    buffer = poisoned((shift + n * (d + gap) + 16,), dtype)
    rows = buffer[shift : shift + n * (d + gap)].reshape(n, d + gap)[:, :d]
    return buffer, rows.reshape(shape)


@pytest.mark.parametrize("mode", ["streaming", "scratch"])
@pytest.mark.parametrize("threads", ["serial", "parallel"])
@given(
    outer=st.lists(st.integers(1, 6), max_size=2),
    rows=st.integers(1, 300),  # along the innermost axis: several scratch blocks of 8 KiB
    d=st.integers(1, 80).map(lambda h: 2 * h),
    dtype=st.sampled_from(DTYPES),
    style=st.sampled_from(["interleaved", "half"]),
    partial=st.booleans(),
    inverse=st.booleans(),
    shift=st.integers(0, 33),
    gap=st.sampled_from([0, 0, 1, 3]),
    seed=st.integers(0, 2**32 - 1),
)
def test_streamed_output_matches_plain_stores(
    mode, threads, outer, rows, d, dtype, style, partial, inverse, shift, gap, seed
):
    rng = np.random.default_rng(seed)
    shape = tuple(outer) + (rows, d)
    x = (rng.standard_normal(shape) * 3).astype(dtype)
    x_before = x.copy()
    rotary_dim = 2 * int(rng.integers(1, d // 2 + 1)) if partial else d
    rope = ar.RoPE(d, style=style, rotary_dim=rotary_dim)
    pos = rng.integers(0, 4096, size=rows)
    buffer, out = _window(shape, dtype, shift, gap)
    _assert_streams_plain_bits(threads, rope, x, pos, inverse, buffer, out, mode)
    np.testing.assert_array_equal(bits(x), bits(x_before))
    assert_matches(out, oracle(x, pos, style=style, rotary_dim=rotary_dim, inverse=inverse), x)


def _direct_case(dtype, style, rotary_dim, layout):
    """The direct-path tests' case: x (3, 2, 37, 48); the (pos, inverse) calls to make, integer
    positions both ways and real ones (exact tables, computed per call); the RoPE; the output's
    place in its buffer, (shift, gap) for ``layout``; and which way it should be stored with
    the vector steps on: the direct path (pair blocks, tail and rows on 16-byte boundaries),
    "chunked" (rows on that grid, pair blocks off it: chunks on the grid), "unaligned" (the
    direct path's steps with plain stores, rows off that grid), or neither (float16 where the
    CPU does not convert it)."""
    rng = np.random.default_rng()
    x = (rng.standard_normal((3, 2, 37, 48)) * 3).astype(dtype)
    integer = rng.integers(0, 60_000, size=37)  # in the cache (past it: test_long_positions)
    calls = ((integer, False), (integer, True), (rng.uniform(0, 100_000, size=37), False))
    rope = ar.RoPE(48, style=style, rotary_dim=rotary_dim)
    item = x.itemsize
    place = {"aligned": (0, 0), "shifted": (1, 0), "strided": (0, 16 // item)}[layout]
    block = rotary_dim // 2 if style == "half" else rotary_dim
    steps = dtype != np.float16 or _config.HARDWARE_F16
    on_grid = layout != "shifted"
    kind = "chunked" if on_grid else "unaligned"
    if on_grid and (block * item) % 16 == 0:
        kind = "direct"
    return x, calls, rope, place, kind if steps else None


@pytest.mark.parametrize("mode", ["streaming", "vector"])
@pytest.mark.parametrize("threads", ["serial", "parallel"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", ["interleaved", "half"])
@pytest.mark.parametrize("rotary_dim", [48, 40, 24])
@pytest.mark.parametrize("layout", ["aligned", "shifted", "strided"])
def test_direct_path_writes_what_the_general_loop_writes(
    mode, threads, dtype, style, rotary_dim, layout
):
    # The direct path (rows rotated in registers, stored with 16-byte streaming stores for
    # large outputs, plain stores for others) takes outputs whose pair blocks, tail and rows
    # all start on 16-byte boundaries; the others take the scratch path (large) or the general
    # row loop. All must write the general loop's plain-store bits and nothing else.
    x, calls, rope, place, kind = _direct_case(dtype, style, rotary_dim, layout)
    x_before = x.copy()
    buffer, out = _window(x.shape, dtype, *place)
    assert buffer.__array_interface__["data"][0] % 16 == 0
    modes = []
    for pos, inverse in calls:
        buffer[:] = np.nan
        _assert_streams_plain_bits(threads, rope, x, pos, inverse, buffer, out, mode, modes)
    direct = cpu.DIRECT if mode == "streaming" else cpu.VECTOR
    chunked = cpu.CHUNKED if mode == "streaming" else cpu.CHUNKED_PLAIN
    other = cpu.SCRATCH if mode == "streaming" else 0
    way = {"direct": direct, "chunked": chunked, "unaligned": cpu.UNALIGNED, None: other}[kind]
    assert modes == [way] * 3
    np.testing.assert_array_equal(bits(x), bits(x_before))


@pytest.mark.parametrize("mode", ["streaming", "vector"])
@pytest.mark.parametrize("threads", ["serial", "parallel"])
@given(
    rows=st.integers(1, 40),
    heads=st.integers(1, 3),
    grid_steps=st.integers(1, 40),
    dtype=st.sampled_from(DTYPES),
    style=st.sampled_from(["interleaved", "half"]),
    data=st.data(),
    inverse=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_rows_on_the_grid_write_what_the_general_loop_writes(
    mode, threads, rows, heads, grid_steps, dtype, style, data, inverse, seed
):
    # Rows on the 16-byte grid take the direct path whatever the grid of their pair blocks:
    # off it, in chunks on the grid (CHUNKED, streaming; CHUNKED_PLAIN), each chunk across the
    # pair blocks' edge or the rotary part's end read with masked loads. Every head size on
    # the grid, every rotary_dim, rows and buffers on it anywhere: the general loop's bits.
    if dtype == np.float16 and not _config.HARDWARE_F16:
        pytest.skip("float16 takes the general loop where the CPU does not convert it")
    item = np.dtype(dtype).itemsize
    per = 16 // item  # elements in 16 bytes
    d = per * grid_steps if per % 2 == 0 else 2 * grid_steps
    rotary_dim = 2 * data.draw(st.integers(1, d // 2), label="pairs")
    shift = per * data.draw(st.integers(0, 4), label="16-byte steps before the output")
    gap = per * data.draw(st.sampled_from([0, 0, 1]), label="16-byte steps between rows")
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((heads, rows, d)) * 3).astype(dtype)
    x_before = x.copy()
    rope = ar.RoPE(d, style=style, rotary_dim=rotary_dim)
    pos = rng.integers(0, 60_000, size=rows)
    buffer, out = _window(x.shape, dtype, shift, gap)
    modes = []
    _assert_streams_plain_bits(threads, rope, x, pos, inverse, buffer, out, mode, modes)
    block = rotary_dim // 2 if style == "half" else rotary_dim
    on_grid = (block * item) % 16 == 0 and ((d - rotary_dim) * item) % 16 == 0
    streaming = mode == "streaming"
    if on_grid:
        assert modes == [cpu.DIRECT if streaming else cpu.VECTOR]
    else:
        assert modes == [cpu.CHUNKED if streaming else cpu.CHUNKED_PLAIN]
    np.testing.assert_array_equal(bits(x), bits(x_before))
    assert_matches(out, oracle(x, pos, style=style, rotary_dim=rotary_dim, inverse=inverse), x)


def _line_window(shape, dtype, line_offset):
    """A poisoned buffer and a C-contiguous view of ``shape`` in it that starts
    ``line_offset`` bytes past a 64-byte boundary."""
    item = np.dtype(dtype).itemsize
    buffer = poisoned((int(np.prod(shape)) + 256 // item,), dtype)
    start = (-buffer.__array_interface__["data"][0] % 64 + line_offset) // item
    return buffer, buffer[start : start + int(np.prod(shape))].reshape(shape)


# (dtype, d, rotary_dim): rows and tails shorter than a line among them (d = 8; d = 100 of 96);
# for the 2-byte types, pair blocks and tails on the 16-byte grid, tails of whole lines too
LINE_CASES = [
    (dtype, d, rotary_dim)
    for dtype in (np.float32, np.float64)
    for d, rotary_dim in [(8, 8), (24, 24), (128, 128), (160, 96), (100, 96), (72, 64)]
] + [
    (dtype, d, rotary_dim)
    for dtype in (np.float16, BF16)
    for d, rotary_dim in [(16, 16), (128, 128), (160, 96), (256, 128), (192, 64)]
]


@pytest.mark.parametrize("threads", ["serial", "parallel"])
@pytest.mark.parametrize("dtype, d, rotary_dim", LINE_CASES, ids=str)
@pytest.mark.parametrize("style", ["interleaved", "half"])
@pytest.mark.parametrize("line_offset", [0, 16, 32, 48])
@pytest.mark.parametrize("mode", ["vector", "streaming"])
def test_vector_rows_at_every_place_in_a_line_write_the_general_loops_bits(
    mode, threads, dtype, style, d, rotary_dim, line_offset, rng
):
    # The plain-store steps of a row (VECTOR), its widest steps across line boundaries or not,
    # and the streaming ones (DIRECT: whole lines, 16-byte chunks before and after them, the
    # tail copied so too): rows starting at each 16-byte place in a cache line must write the
    # general loop's bits and nothing else.
    if dtype == np.float16 and not _config.HARDWARE_F16:
        pytest.skip("float16 takes the general loop where the CPU does not convert it")
    if not _config.STREAMING:
        pytest.skip("the direct path is used on x86-64 only")
    x = (rng.standard_normal((2, 3, 21, d)) * 3).astype(dtype)
    x_before = x.copy()
    rope = ar.RoPE(d, style=style, rotary_dim=rotary_dim)
    pos = rng.integers(0, 60_000, size=21)
    buffer, out = _line_window(x.shape, dtype, line_offset)
    assert out.__array_interface__["data"][0] % 64 == line_offset
    for inverse in (False, True):
        modes = []
        buffer[:] = np.nan
        _assert_streams_plain_bits(threads, rope, x, pos, inverse, buffer, out, mode, modes)
        assert modes == [cpu.VECTOR if mode == "vector" else cpu.DIRECT]
    assert_matches(out, oracle(x, pos, style=style, rotary_dim=rotary_dim, inverse=True), x)
    np.testing.assert_array_equal(bits(x), bits(x_before))


@pytest.mark.parametrize("mode", ["streaming", "vector"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", ["interleaved", "half"])
@pytest.mark.parametrize(
    "d, rotary_dim",
    [
        (128, 50),
        (96, 38),
        (64, 30),
        (80, 34),
        (80, 76),
        (128, 94),
        (112, 98),
        (128, 100),
        (16, 6),
        (16, 2),
        (256, 150),
        (512, 202),
        (400, 330),
        (1040, 1022),
        (1040, 1030),
    ],
)
def test_every_kind_of_chunk_writes_what_the_general_loop_writes(mode, dtype, style, d, rotary_dim):
    # Pair blocks off the grid whose chunk walks take every step (for one dtype or another):
    # the widest, 32 and 16 bytes on each side of the edge h, the chunk across the edge, the
    # chunk across the rotary part's end, and one chunk holding both (16/6, 16/2). The half
    # style's 2-byte rows with AVX-512 take _paired.paired_row: in registers, one block of
    # pairs of 16 lanes (rotary_dim up to 30: 30, 6, 2) or of 32 (up to 62: 34, 38, 50), and two
    # blocks, the second of 16 lanes (up to 94: 76, three chunks; 94) or 32 (98; 100, four
    # chunks); in stack slots, three (150), four (202), six (330) and as many as it holds
    # (1022); one more (1030) takes the vector steps with plain stores.
    if not _config.STREAMING:
        pytest.skip("the direct path is used on x86-64 only")
    rng = np.random.default_rng()
    x = (rng.standard_normal((2, 3, 21, d)) * 3).astype(dtype)
    rope = ar.RoPE(d, style=style, rotary_dim=rotary_dim)
    pos = rng.integers(0, 60_000, size=21)
    buffer, out = _window(x.shape, dtype, 16 // x.itemsize, 0)
    modes = []
    for inverse in (False, True):
        buffer[:] = np.nan
        _assert_streams_plain_bits("serial", rope, x, pos, inverse, buffer, out, mode, modes)
        expected = oracle(x, pos, style=style, rotary_dim=rotary_dim, inverse=inverse)
        assert_matches(out, expected, x)
    block = rotary_dim // 2 if style == "half" else rotary_dim
    half = style == "half"
    if takes_paired_row(half, x.itemsize) and not takes_paired_row(half, x.itemsize, rotary_dim):
        assert modes == [cpu.UNALIGNED] * 2
    elif (block * x.itemsize) % 16:
        assert modes == [cpu.CHUNKED if mode == "streaming" else cpu.CHUNKED_PLAIN] * 2


@pytest.mark.parametrize("size", ["in cache", "large"])
@pytest.mark.parametrize("threads", ["serial", "parallel"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", ["interleaved", "half"])
@pytest.mark.parametrize("rotary_dim", [48, 40, 24])
@pytest.mark.parametrize("layout", ["aligned", "shifted", "strided"])
def test_direct_path_in_place_writes_what_the_general_loop_writes(
    size, threads, dtype, style, rotary_dim, layout
):
    # In place, the direct path's vector loop reads and writes the same rows (plain stores) where
    # they start on 16-byte boundaries: the general loop's bits, the tail past rotary_dim and
    # every element outside the array left as they were. (Chunks read partners that an earlier
    # chunk of the row has written: in place takes the unaligned steps instead.) As large as
    # streaming starts at (VECTOR_AHEAD), the same loop asks for rows ahead.
    x, calls, rope, place, kind = _direct_case(dtype, style, rotary_dim, layout)
    modes = []
    for pos, inverse in calls:
        buffer, y = _window(x.shape, dtype, *place)
        y[...] = x
        words = buffer.view(f"u{x.itemsize}")
        outside = words.copy()
        with _vector(threads) if size == "in cache" else _streaming(threads):
            _general(rope, (y,), pos, (y,), inverse, modes)
        with _config.override(**PLAIN):
            expected = x.copy()
            _general(rope, (expected,), pos, (expected,), inverse)
        np.testing.assert_array_equal(bits(y), bits(expected))
        mask = np.ones(buffer.size, bool)
        mask[_offsets(buffer, y)] = False
        np.testing.assert_array_equal(words[mask], outside[mask])
    vector = cpu.VECTOR if size == "in cache" else cpu.VECTOR_AHEAD
    way = {"direct": vector, "chunked": cpu.UNALIGNED, "unaligned": cpu.UNALIGNED, None: 0}
    assert modes == [way[kind]] * 3


@pytest.mark.parametrize("heads", [(3, 2), (1, 5), (4, 4)])
@pytest.mark.parametrize("style", ["interleaved", "half"])
def test_parallel_tasks_cut_q_and_k_rows_together(heads, style, cpu_config, rng):
    # The parallel kernel cuts q's and k's rows together into equal tasks, so a task may end q
    # and begin k: each row of both must come out as the one-thread kernel writes it.
    q = rng.standard_normal((2, heads[0], 37, 16)).astype(np.float32)
    k = rng.standard_normal((2, heads[1], 37, 16)).astype(np.float32)
    pos = rng.integers(0, 5000, 37)
    rope = ar.RoPE(16, style=style)
    results = []
    for serial_below in (1 << 62, 0):  # one thread, then the parallel kernel
        cpu_config(serial_below=serial_below, small_below=0)
        out = (poisoned(q.shape, q.dtype), poisoned(k.shape, k.dtype))
        rope.rotate_qk(q, k, pos, out=out)
        results.append(out)
    for serial, parallel in zip(*results):
        np.testing.assert_array_equal(bits(parallel), bits(serial))
    assert_matches(results[1][0], oracle(q, pos, style=style), q)


def test_direct_path_needs_unit_stride_tables_laid_out_alike():
    # its vector loads read a table row as contiguous memory, at one offset in cos and sin
    rope = ar.RoPE(64)
    x = np.zeros((4, 64), np.float32)
    operands = [(x, np.zeros_like(x), np.zeros((4, 1), np.int64))]
    tables = np.zeros((8, 32), np.float32)
    spec = rope._spec
    assert cpu.direct_path(spec, operands, spec.segments, tables, tables)
    strided = np.zeros((32, 8), np.float32).T
    assert not cpu.direct_path(spec, operands, spec.segments, strided, tables)
    assert not cpu.direct_path(spec, operands, spec.segments, tables, strided)
    wider = np.zeros((8, 40), np.float32)[:, :32]  # rows 40 apart, against 32 in tables
    assert cpu.direct_path(spec, operands, spec.segments, wider, wider)
    assert not cpu.direct_path(spec, operands, spec.segments, tables, wider)


@pytest.mark.parametrize("stream_above", [0, 1 << 62], ids=["streaming", "vector"])
@pytest.mark.parametrize("style", ["interleaved", "half"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_direct_path_reads_table_rows_at_their_stride(style, dtype, stream_above, cpu_config, rng):
    # The direct path addresses table row p at p * (row stride): tables whose rows are 48
    # elements apart must give the bits of packed ones.
    if not _config.STREAMING or (dtype == np.float16 and not _config.HARDWARE_F16):
        pytest.skip("the direct path needs x86-64 (and F16C for float16)")
    cpu_config(stream_above=stream_above, vector_rows=True)
    rope = ar.RoPE(64, style=style)
    x = rng.standard_normal((4, 8, 64)).astype(dtype)
    idx = rng.integers(0, 8, size=(4, 8, 1))
    table_dtype = np.float64 if dtype == np.float64 else np.float32
    packed = [rng.uniform(-1, 1, size=(8, 32)).astype(table_dtype) for _ in range(2)]
    spread = [np.full((8, 48), np.nan, table_dtype)[:, :32] for _ in range(2)]
    for table, values in zip(spread, packed):
        table[...] = values
    results = []
    for cos, sin in (packed, spread):
        assert cpu.direct_path(rope._spec, [(x, x, idx)], rope._spec.segments, cos, sin)
        out = poisoned(x.shape, x.dtype)
        cpu.launch(rope._spec, [(x, out, idx)], cos, sin, False)
        results.append(bits(out))
    np.testing.assert_array_equal(results[1], results[0])


def _assert_streams_plain_bits(
    threads, rope, x, pos, inverse, buffer, out, mode="streaming", modes=None
):
    """Rotate x into ``out`` (a view of the poisoned ``buffer``) with streaming on (``mode``
    "scratch": with the vector steps only on the 16-byte grid; "vector": the direct path's
    plain stores): the bits of the general row loop's plain stores, and no write outside
    ``out``."""
    if mode == "vector":
        config = _vector(threads)
    else:
        config = _streaming(threads, vector_rows=mode == "streaming")
    with config:
        _general(rope, (x,), pos, (out,), inverse, modes)
    with _config.override(**PLAIN):
        (expected,) = _general(rope, (x,), pos, (poisoned(x.shape, x.dtype),), inverse)
    np.testing.assert_array_equal(bits(out), bits(expected))
    mask = np.ones(buffer.size, bool)
    mask[_offsets(buffer, out)] = False
    assert np.isnan(buffer[mask].astype(np.float32)).all(), "a write outside the output"


def _offsets(buffer, view):
    """The element offsets of ``view`` inside ``buffer``."""
    start = (view.__array_interface__["data"][0] - buffer.__array_interface__["data"][0]) // (
        buffer.itemsize
    )
    steps = [s // buffer.itemsize for s in view.strides]
    grids = np.meshgrid(*[np.arange(n) * s for n, s in zip(view.shape, steps)], indexing="ij")
    return (start + sum(grids)).reshape(-1)


@pytest.mark.parametrize("threads", ["serial", "parallel"])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_streamed_rotate_qk_with_one_operand_in_place(threads, rotary_dim, rng):
    # rotate_qk streams the operand that has its own output and not the one rotated in place,
    # whose tail past rotary_dim is left as it was
    rope = ar.RoPE(64, rotary_dim=rotary_dim)
    q = rng.standard_normal((2, 8, 64, 64)).astype(np.float32)
    k = rng.standard_normal((2, 2, 64, 64)).astype(np.float32)
    expected = rope.rotate(q, backend="numpy"), rope.rotate(k, backend="numpy")
    q_out, k_in_place = poisoned(q.shape, q.dtype), k.copy()
    modes = []
    with _streaming(threads):
        got = _general(rope, (q, k_in_place), None, (q_out, k_in_place), modes=modes)
    assert got[0] is q_out and got[1] is k_in_place and modes == [cpu.DIRECT]
    for result, ref, source in zip(got, expected, (q, k)):
        assert_matches(result, ref.astype(np.float64), source)
    np.testing.assert_array_equal(bits(k_in_place[..., rotary_dim:]), bits(k[..., rotary_dim:]))


def test_large_outputs_stream_and_smaller_ones_take_plain_stores(cpu_config):
    cpu_config(stream_above=1 << 20)
    rope = ar.RoPE(128)
    big = np.ones((1, 8, 256, 128), np.float32)  # 1 MiB
    q, k = np.ones((1, 4, 256, 128), np.float32), np.ones((1, 4, 256, 128), np.float32)
    shifted = np.empty((1, 4, 256, 129), np.float32)[..., 1:]  # rows off 16-byte boundaries
    modes = []
    _general(rope, (big,), None, (np.empty_like(big),), modes=modes)
    _general(rope, (q, k), None, (np.empty_like(q), np.empty_like(k)), modes=modes)  # 1 MiB
    # in place: plain stores, whatever the size (as large, rows asked for ahead)
    _general(rope, (big,), None, (big,), modes=modes)
    _general(rope, (q, k), None, (q, np.empty_like(k)), modes=modes)  # 0.5 MiB written, 1 read
    _general(rope, (big[:, :4],), None, (np.empty_like(big[:, :4]),), modes=modes)  # 0.5 MiB
    _general(rope, (big[:, :4],), None, (shifted,), modes=modes)  # 0.5 MiB, off the grid
    if _config.STREAMING:  # the direct path, with streaming stores or (smaller outputs) plain ones
        assert modes == [cpu.DIRECT] * 2 + [cpu.VECTOR_AHEAD] * 2 + [cpu.VECTOR, cpu.UNALIGNED]
    else:
        assert modes == [0] * 6


def test_two_byte_results_stream_from_a_multiple_of_the_threshold(cpu_config):
    # The vector steps' float16 and bfloat16 results stream, and their calls ask for rows
    # ahead, from HALF_STREAM_FACTOR times stream_above (see _config.streams_from), and so do
    # the fused step's; rows written in chunks on the grid stream from stream_above itself, as
    # float32 results do.
    if not _config.STREAMING:
        pytest.skip("the direct path is used on x86-64 only")
    from arrayrope.backends.cpu import _fused_launch

    factor = _config.HALF_STREAM_FACTOR
    assert factor > 1
    cpu_config(stream_above=1 << 20)
    rope, chunked = ar.RoPE(128), ar.RoPE(128, rotary_dim=50)  # pair blocks off the grid
    dtypes = [BF16] if BF16 is not None else []
    dtypes += [np.float16] if _config.HARDWARE_F16 else []  # else the general row loop
    for dtype in dtypes:
        modes = []
        for mib in (1, factor - 1, factor):  # results of that many MiB
            x = np.ones((1, 8 * mib, 512, 128), dtype)
            _general(rope, (x,), None, (np.empty_like(x),), modes=modes)  # out=
            _general(rope, (x,), None, (x,), modes=modes)  # in place
        plain, ahead = [cpu.VECTOR] * 2, [cpu.DIRECT, cpu.VECTOR_AHEAD]
        assert modes == plain * 2 + ahead, dtype
        x = np.ones((1, 8, 512, 128), dtype)  # 1 MiB
        modes = []
        _general(chunked, (x,), None, (np.empty_like(x),), modes=modes)
        assert modes == [cpu.CHUNKED], dtype
        # the fused step: q, k and v together below, then at, the 2-byte threshold
        for mib, expected in ((factor - 1, 0), (factor, _fused_launch.PREFETCH)):
            q = np.ones((128 * mib, 32, 128), dtype)  # mib MiB
            k = np.ones((128 * mib, 0, 128), dtype)
            large = _fused_launch.large_step_bits(q, k, k)
            assert large & _fused_launch.PREFETCH == expected, (dtype, mib)
            assert bool(large & _fused_launch.STREAM_Q) == bool(expected)
    x = np.ones((1, 4, 512, 128), np.float32)  # 1 MiB of float32: stream_above itself
    modes = []
    _general(rope, (x,), None, (np.empty_like(x),), modes=modes)
    assert modes == [cpu.DIRECT]
    q = np.ones((64, 32, 128), np.float32)  # 1 MiB
    assert _fused_launch.large_step_bits(q, q[:, :0], q[:, :0]) & _fused_launch.STREAM_Q


@pytest.mark.parametrize(
    "cache, cpus, share",
    [(480 << 20, 2, 32 << 20), (32 << 20, 2, 32 << 20), (256 << 20, 64, 256 << 20)],
    ids=["vm-reporting-its-socket", "whole-cache", "many-cpus"],
)
def test_streaming_starts_at_half_the_cache_share(monkeypatch, cache, cpus, share):
    monkeypatch.setattr(_config, "_last_level_cache", lambda: cache)
    monkeypatch.setattr(
        _config.os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False
    )
    monkeypatch.delenv("ARRAYROPE_STREAM_ABOVE", raising=False)
    assert _config._cache_share() == share
    assert _config.Config.from_environment().stream_above == share // 2
    monkeypatch.setenv("ARRAYROPE_STREAM_ABOVE", "12345")
    assert _config.Config.from_environment().stream_above == 12345
    for name, text in (("ARRAYROPE_STREAM_ABOVE", "16MiB"), ("ARRAYROPE_SERIAL_BELOW", "-5")):
        monkeypatch.setenv(name, text)
        with pytest.raises(ValueError, match=f"{name} must be a whole number .* got '{text}'"):
            _config.Config.from_environment()


def test_the_cache_share_counts_every_cpu_where_affinity_is_unknown(monkeypatch):
    monkeypatch.setattr(_config, "_last_level_cache", lambda: 480 << 20)
    monkeypatch.delattr(_config.os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(_config.os, "cpu_count", lambda: 4)
    assert _config._cache_share() == 64 << 20
    monkeypatch.setattr(_config.os, "cpu_count", lambda: None)  # unknown: one
    assert _config._cache_share() == 16 << 20


def test_in_place_takes_the_plain_store_kernel_of_smaller_outputs(cpu_config, rng):
    # The direct path's plain-store kernel takes x itself in place (its steps load a block before
    # they store it): an in-place call compiles nothing an out= call has not, no signature of it
    # takes None for x, and the tail past rotary_dim is left as it was.
    if not _config.STREAMING:
        pytest.skip("the direct path is used on x86-64 only")
    from numba import types

    from arrayrope.backends.cpu import _rows

    cpu_config(stream_above=1 << 62, serial_below=1 << 62)
    rope = ar.RoPE(128, rotary_dim=96)
    x = rng.standard_normal((1, 4, 64, 128))
    with _config.override(**PLAIN):
        expected = x.copy()
        _general(rope, (expected,), None, (expected,))
    modes = []
    _general(rope, (x,), None, (np.empty_like(x),), modes=modes)
    compiled = set(_rows.KERNELS[cpu.VECTOR][False].signatures)
    y = x.copy()
    _general(rope, (y,), None, (y,), modes=modes)
    assert modes == [cpu.VECTOR] * 2
    assert set(_rows.KERNELS[cpu.VECTOR][False].signatures) == compiled
    assert not any(isinstance(sig[i], types.NoneType) for sig in compiled for i in (0, 3))
    np.testing.assert_array_equal(bits(y), bits(expected))


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast")  # the oracle's nans
@pytest.mark.parametrize("style", ["interleaved", "half"])
@pytest.mark.parametrize("large", [False, True])
def test_bfloat16_nan_and_inf_inputs_give_nan_and_inf(style, large, cpu_config):
    # The bfloat16 store rounds with no nan test (see _convert.f32_to_bf16_result): every nan
    # and infinity a bfloat16 array can hold must still come out where the float64 formula has
    # one.
    if large:  # the parallel kernel with streaming stores
        cpu_config(stream_above=0, serial_below=0, small_below=0)
    codes = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    special = codes[~np.isfinite(codes.view(BF16).astype(np.float32))]  # 254 nans, 2 infs
    rng = np.random.default_rng(0)
    x = rng.standard_normal((special.size, 2, 16)).astype(BF16)
    x[:, 0, 0] = special.view(BF16)  # each special value in the first pair of some row
    x[:, 1, 3] = special.view(BF16)  # and in a second pair's other element
    pos = rng.integers(0, 1000, size=(special.size, 2))
    for inverse in (False, True):
        expected = oracle(x, pos, style=style, inverse=inverse)
        for out in (None, poisoned(x.shape, x.dtype)):
            got = ar.rotate(x, pos, style=style, inverse=inverse, out=out).astype(np.float64)
            assert (np.isnan(got) == np.isnan(expected)).all()
            finite = np.isfinite(expected)
            assert (got[np.isinf(expected)] == expected[np.isinf(expected)]).all()
            assert np.isfinite(got[finite]).all()


def test_bfloat16_result_rounding_matches_ml_dtypes():
    from numba import njit

    from arrayrope.backends.cpu._convert import f32_to_bf16_result

    @njit
    def narrow(values, out):
        for i in range(values.size):
            out[i] = f32_to_bf16_result(values[i])

    rng = np.random.default_rng(1)
    values = rng.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32)
    # what reaches the store: any finite or infinite value, and nans whose low 16 bits are zero
    # (quieted bfloat16 nans, or the CPU's default nan)
    every_bf16 = (np.arange(2**16, dtype=np.uint32) << 16).view(np.float32)
    quiet = (np.arange(2**16, dtype=np.uint32) << 16 | 0x00400000).view(np.float32)
    values = np.concatenate([values[~np.isnan(values)], every_bf16, quiet])
    with np.errstate(over="ignore", invalid="ignore"):
        expected = values.astype(BF16).astype(np.float32)
    got = np.empty(values.size, np.uint16)
    narrow(values, got)
    got = got.view(BF16).astype(np.float32)
    nan = np.isnan(expected)
    assert (np.isnan(got) == nan).all()
    np.testing.assert_array_equal(got[~nan].view(np.uint32), expected[~nan].view(np.uint32))


WIDTH_CHECK = """
import numpy as np, ml_dtypes, arrayrope as ar
from arrayrope.backends.cpu import _config
assert _config.VECTOR_BYTES == {width} and not _config.DISK_CACHE
rng = np.random.default_rng(0)
dtype = {dtype}
for stream_above in (0, 1 << 62):  # streaming stores, then plain ones (the direct path's both)
    with _config.override(stream_above=stream_above, small_below=0, serial_below=0):
        for style in ("interleaved", "half"):
            # rotary dims whose pair blocks leave every mix of 64-, 32- and 16-byte steps,
            # and (streaming: the chunk steps' widths are the same in both modes) pair
            # blocks off the grid, rows written in chunks on it
            dims = (128, 112, 96, 80, 64, 48, 32, 16)
            dims += (50, 38, 2) if stream_above == 0 else ()
            for rotary_dim in dims:
                x = rng.standard_normal((2, 4, 9, 128)).astype(dtype)
                rope = ar.RoPE(128, style=style, rotary_dim=rotary_dim)
                want = rope.rotate(x, 7, backend="numpy").view(np.uint8)
                buffer = np.full((2, 4, 9, 128 + 16), np.nan, dtype)
                out = buffer[..., 8:136]
                rope.rotate(x, 7, out=out)
                assert (out.view(np.uint8) == want).all(), (dtype, style, rotary_dim)
                assert np.isnan(buffer[..., :8].astype(np.float32)).all()
                assert np.isnan(buffer[..., 136:].astype(np.float32)).all()
                y = x.copy()  # in place: plain stores, the tail left as it is
                rope.rotate(y, 7, out=y)
                assert (y.view(np.uint8) == want).all(), ("in place", style, rotary_dim)
print("widths ok")
"""


# float64 takes float32's loop; one process per dtype, so that workers share the compiling
@pytest.mark.parametrize("dtype", ["np.float16", "ml_dtypes.bfloat16", "np.float32"])
def test_the_other_vector_width_writes_the_reference_bits(dtype):
    # Steps are sized from the host (64 bytes with AVX-512, 32 otherwise): the rest of the suite
    # runs the host's width, and this forces the other one. A vector wider than the hardware's
    # runs in legal pieces, so both run on any x86-64; on a host with AVX-512 the 32-byte run
    # compiles for a CPU without it, as an AVX2 machine would.
    if not _config.STREAMING:
        pytest.skip("the direct path is used on x86-64 only")
    import os
    import subprocess
    import sys

    width = 32 if _config.VECTOR_BYTES == 64 else 64
    env = {**os.environ, "ARRAYROPE_VECTOR_BYTES": str(width)}
    if width == 32:  # and compiled as for a CPU without AVX-512, whose registers hold 32 bytes
        import llvmlite.binding as ll

        features = ll.get_host_cpu_features().flatten().split(",")
        off = [f"-{f[1:]}" if f.startswith("+avx512") else f for f in features]
        env.update(NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES=",".join(off))
    done = subprocess.run(
        [sys.executable, "-c", WIDTH_CHECK.format(width=width, dtype=dtype)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "widths ok" in done.stdout


def test_streaming_steps_store_with_streaming_stores_only():
    # A streaming step's narrowing (float32 to bfloat16 or float16 bits) must not fold into a
    # narrowing store (vpmovdw to memory): that has no streaming form, LLVM drops the streaming
    # mark, and each line written partly by plain stores and partly by streaming ones costs a
    # read and two partial writes: tens of times the time of the streamed row.
    if not _config.STREAMING:
        pytest.skip("streaming stores are x86-64's")
    import re

    from numba import njit

    from arrayrope.backends.cpu._simd import chunk_step, copy_bytes, row_step

    steps = [row_step(half, w, True) for half in (True, False) for w in (16, 32, 64)]
    steps += [chunk_step(True, kind, w, True) for kind in ("first", "second") for w in (16, 32, 64)]
    steps += [chunk_step(half, "mixed", 16, True) for half in (True, False)]
    copies = [copy_bytes(True, w) for w in (16, 32, 64)]  # tails, v's rows
    # one function calling every step (row 64, element 48 of it, h = 40: every read inside),
    # and the line walk's pair step (see _ladder.line_walk) at element 64 of the row: on a line
    # where o starts on one
    calls = "".join(
        f"    s{i}(x, at, o, at, h, cos, sin, zero, k, False)\n" for i in range(len(steps))
    )
    calls += "    line(x, at, o, at, h, cos, sin, zero, at, False)\n"
    calls += "".join(f"    c{i}(x, at, o, at)\n" for i in range(len(copies)))
    source = "def every_step(x, o, cos, sin):\n    at, h, k, zero = u(64), u(40), u(48), u(0)\n"
    names = {"line": row_step(False, 64, True, 64)}
    names |= {f"s{i}": step for i, step in enumerate(steps)}
    names |= {f"c{i}": copy for i, copy in enumerate(copies)}
    exec(source + calls, namespace := {"u": np.uint64, **names})
    every_step = njit(cache=False)(namespace["every_step"])

    # a memory destination (AT&T: the last operand), the stack's aside
    store = re.compile(r"^\s+(v\w+)\s.*,\s*(-?\d*\(%(?!rsp|rbp)[^)]*\))\s*$")
    dtypes = [np.uint16, np.float32] + ([np.int16] if _config.HARDWARE_F16 else [])
    for bits_dtype in dtypes:
        # o on a line, so that the line walk's step (element 64 on) stores where it may
        raw = np.zeros(256 + 64, bits_dtype)
        skip = -raw.__array_interface__["data"][0] % 64 // raw.itemsize
        x, o = np.zeros(256, bits_dtype), raw[skip : skip + 256]
        table = np.zeros(256, np.float32)
        every_step(x, o, table, table)
        asm = every_step.inspect_asm(every_step.signatures[-1])
        found = [m.group(1) for m in map(store.match, asm.splitlines()) if m]
        assert found, bits_dtype
        assert all(name.startswith("vmovnt") for name in found), (bits_dtype, set(found))


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=str)
@pytest.mark.parametrize("stream_above", [0, 1 << 62], ids=["streaming", "plain"])
def test_half_rows_longer_than_a_paired_row_holds_take_another_path(dtype, stream_above):
    # The half style's 2-byte rows with pair blocks off the grid take _paired.paired_row, which
    # holds up to 1024 rotary elements: longer ones take another path on both routes, rows from
    # the cache of cos/sin rows and rows made per position past it (positions to 2**30).
    if dtype == np.float16 and not _config.HARDWARE_F16:
        pytest.skip("float16 takes the general loop where the CPU does not convert it")
    rng = np.random.default_rng(7)
    for rotary_dim, d in ((2046, 2048), (1030, 1040)):
        x = rng.standard_normal((2, 9, d)).astype(dtype)
        rope = ar.RoPE(d, style="half", rotary_dim=rotary_dim)
        for pos in (rng.integers(0, 5000, 9), rng.integers(0, 2**30, 9)):
            want = rope.rotate(x, pos, backend="numpy")
            out = np.empty_like(x)
            with _config.override(stream_above=stream_above, serial_below=1 << 62, small_below=0):
                rope.rotate(x, pos, out=out)
            np.testing.assert_array_equal(bits(out), bits(want))


def _stores(stores, threads):
    """The configuration of a way of storing results, by name, on one thread or on all."""
    return {
        "direct, streaming": lambda: _streaming(threads),
        "scratch, streaming": lambda: _streaming(threads, vector_rows=False),
        "vector": lambda: _vector(threads),
        "plain": lambda: _config.override(
            **PLAIN, serial_below=0 if threads == "parallel" else 1 << 62
        ),
    }[stores]()


def _assert_written_inside(buffers, outs):
    """Every element of each poisoned buffer outside its output still poison."""
    for buffer, out in zip(buffers, outs):
        mask = np.ones(buffer.size, bool)
        mask[_offsets(buffer, out)] = False
        assert np.isnan(buffer[mask].astype(np.float32)).all(), "a write outside the output"


@pytest.mark.parametrize("threads", ["serial", "parallel"])
@given(
    batch=st.integers(1, 3),
    heads=st.integers(2, 5),
    length=st.integers(2, 60),
    block_rows=st.integers(1, 9),
    d=st.sampled_from([16, 40, 64]),
    dtype=st.sampled_from(DTYPES),
    style=st.sampled_from(["interleaved", "half"]),
    partial=st.booleans(),
    way=st.sampled_from(["out", "in place", "rotate_qk", "positions per sequence"]),
    stores=st.sampled_from(["direct, streaming", "scratch, streaming", "vector", "plain"]),
    shift=st.integers(0, 9),
    seed=st.integers(0, 2**32 - 1),
)
def test_table_blocks_taken_through_every_head_write_what_one_pass_writes(
    threads, batch, heads, length, block_rows, d, dtype, style, partial, way, stores, shift, seed
):
    # Heads outer in memory: a block of positions' table rows through every head before the
    # next block (see cpu.launch), the rows past the last whole block after them; the same bits
    # as one pass over each head, and nothing written outside the outputs.
    rng = np.random.default_rng(seed)
    rotary_dim = 2 * int(rng.integers(1, d // 2 + 1)) if partial else d
    rope = ar.RoPE(d, style=style, rotary_dim=rotary_dim)
    shape = (batch, heads, length, d)
    xs = [(rng.standard_normal(shape) * 3).astype(dtype)]
    if way == "rotate_qk":
        xs.append((rng.standard_normal((batch, heads - 1, length, d)) * 3).astype(dtype))
    pos = rng.integers(0, 4096, length)
    if way == "positions per sequence":
        pos = rng.integers(0, 4096, (batch, 1, length))
    table_row = 2 * (rotary_dim // 2) * (8 if dtype == np.float64 else 4)
    reordered = []

    def recorded(operand, rows, filled=True):
        parts = chunked(operand, rows, filled)
        reordered.append(parts[0] is not operand)
        return parts

    chunked = cpu._chunked
    results = []
    for block_bytes in (block_rows * table_row, 1 << 62):
        buffers, outs = zip(*(_window(x.shape, dtype, shift, 0) for x in xs))
        given_xs = xs
        if way == "in place":
            outs[0][...] = xs[0]
            given_xs = outs
        config = _stores(stores, threads)
        with config, pytest.MonkeyPatch.context() as patch:
            patch.setattr(cpu, "_TABLE_BLOCK_BYTES", block_bytes)
            patch.setattr(cpu, "_chunked", recorded)
            _general(rope, tuple(given_xs), pos, outs)
        _assert_written_inside(buffers, outs)
        results.append(outs)
    if length >= 2 * block_rows and block_rows > 1:
        assert any(reordered)  # the blocked order was taken
    for blocked, whole in zip(*results):
        np.testing.assert_array_equal(bits(blocked), bits(whole))
    assert_matches(results[0][0], oracle(xs[0], pos, style=style, rotary_dim=rotary_dim), xs[0])


def test_table_blocks_leave_short_operands_and_the_last_rows_as_they_are():
    x = np.zeros((2, 4, 50, 16), np.float32)
    operand = (x, np.zeros_like(x), np.zeros((1, 1, 50, 1), np.int64))
    (whole,) = cpu._chunked(operand, 32, False)  # fewer than two blocks of rows
    assert whole is operand
    blocks, last = cpu._chunked(operand, 16, False)
    assert blocks[0].shape == (3, 2, 4, 16, 16)  # each block through every batch and head
    assert last[0].shape == (2, 4, 2, 16) and last[2].shape == (1, 1, 2, 1)  # in x's order
    assert np.shares_memory(last[1], operand[1]) and last[1].strides == operand[1].strides
    # positions per sequence and token, (B, 1, T): blocks along T, the innermost in memory,
    # whatever B's size; a T of fewer than two blocks leaves the operand as it is
    x = np.zeros((64, 4, 40, 16), np.float32)
    operand = (x, np.zeros_like(x), np.zeros((64, 1, 40, 1), np.int64))
    (blocks, last) = cpu._chunked(operand, 16, False)
    assert blocks[0].shape == (64, 2, 4, 16, 16) and last[0].shape == (64, 4, 8, 16)
    (whole,) = cpu._chunked(operand, 32, False)
    assert whole is operand


@pytest.mark.parametrize("threads", ["serial", "parallel"])
@given(
    heads=st.integers(2, 4),
    length=st.integers(2, 40),
    d=st.sampled_from([16, 40, 64]),
    dtype=st.sampled_from(DTYPES),
    style=st.sampled_from(["interleaved", "half"]),
    partial=st.booleans(),
    way=st.sampled_from(["out", "in place", "rotate_qk"]),
    stores=st.sampled_from(["direct, streaming", "vector", "plain"]),
    shifts=st.lists(st.integers(0, 9), min_size=2, max_size=4),
    read_only=st.lists(st.booleans(), min_size=4, max_size=4),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_launch_layout_worked_out_once_serves_every_call_of_it(
    threads, heads, length, d, dtype, style, partial, way, stores, shifts, read_only, seed
):
    # cpu.launch works out a layout's store mode, table blocks and geometry once (_Recipe) and
    # takes them for every later call of that layout: calls with the same shapes and strides,
    # their outputs at other places against the 16-byte grid (another recipe) or the same, x
    # read-only or not, write what a call that works them out afresh writes, and only there.
    rng = np.random.default_rng(seed)
    rotary_dim = 2 * int(rng.integers(1, d // 2 + 1)) if partial else d
    rope = ar.RoPE(d, style=style, rotary_dim=rotary_dim)
    shapes = [(1, heads, length, d)] + ([(1, heads - 1, length, d)] if way == "rotate_qk" else [])
    pos = rng.integers(0, 4096, length)
    block_bytes = 4 * 2 * (rotary_dim // 2) * (8 if dtype == np.float64 else 4)  # 4 rows
    with _stores(stores, threads), pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu, "_TABLE_BLOCK_BYTES", block_bytes)
        for shift, frozen in zip(shifts, read_only):
            xs = [(rng.standard_normal(shape) * 3).astype(dtype) for shape in shapes]
            results = []
            for fresh in (False, True):
                if fresh:
                    cpu._recipes.clear()
                buffers, outs = zip(*(_window(x.shape, dtype, shift, 0) for x in xs))
                given_xs = list(xs)
                if way == "in place":
                    outs[0][...] = xs[0]
                    given_xs[0] = outs[0]
                elif frozen:
                    given_xs[0] = xs[0].copy()
                    given_xs[0].flags.writeable = False
                _general(rope, tuple(given_xs), pos, outs)
                _assert_written_inside(buffers, outs)
                results.append(outs)
            for reused, fresh in zip(*results):
                np.testing.assert_array_equal(bits(reused), bits(fresh))
            want = oracle(xs[0], pos, style=style, rotary_dim=rotary_dim)
            assert_matches(results[0][0], want, xs[0])
