"""The general row loop and the general path's one-thread entry points: for each way of
storing results (see ``launch``), a kernel that rotates a range of rows (all of them, or one
parallel task's: see _parallel).

One row body serves every dtype and pair style: the dtype of the flat views picks the element
conversion at compile time (see _convert), and in place is a compile-time case too (x passed as
None). Operand geometry ``g`` is an int64 array of shape (2, 4, L + 1), one block per operand
(q, k; see ``backends._geometry``); ``rotate`` passes an empty second operand. Results are
written one of four ways: plain stores, the scratch path (rows rotated into an in-cache block,
then copied with streaming stores), or the direct path (see _direct) with streaming or plain
stores.
"""

import numpy as np
from numba import njit, types
from numba.extending import overload

from ._config import DISK_CACHE
from ._convert import load, store
from ._direct import (
    direct_runs_chunked,
    direct_runs_chunked_plain,
    direct_runs_plain,
    direct_runs_plain_ahead,
    direct_runs_streaming,
    direct_runs_unaligned,
)
from ._runs import run_start
from ._simd import address, store_fence, stream_line

# how a launch stores results (see launch); 0: plain stores
SCRATCH, DIRECT, VECTOR, UNALIGNED, CHUNKED, CHUNKED_PLAIN, VECTOR_AHEAD = 1, 2, 3, 4, 5, 6, 7
# Rows rotated into an in-cache scratch block before each streaming copy.
_STREAM_BLOCK_BYTES = 8192


def _row_views(x, o, xb, ob):
    """(``x[xb:]``, ``o[ob:]``), or the one view ``o[ob:]`` twice where ``x`` is None (in place).

    In place is a compile-time case, not a flag, and one view object plays both roles: two views
    of one address (or a runtime flag choosing between two inlined loops) fail or complicate
    LLVM's aliasing checks, which then keep the loops scalar. Reading through ``o`` also lets a
    read-only ``x`` compile.
    """


@overload(_row_views)
def _row_views_impl(x, o, xb, ob):
    if isinstance(x, types.NoneType):

        def in_place(x, o, xb, ob):
            row = o[ob:]
            return row, row

        return in_place
    return lambda x, o, xb, ob: (x[xb:], o[ob:])


# Every index is uint64: Numba adds a negative-index wraparound select to signed indices, which
# stops LLVM from vectorizing. And every index counts from 0 in a view that starts where the loop
# starts: with a runtime start offset in the index, LLVM leaves the interleaved (stride-2) loops
# scalar.
@njit(inline="always")
def _pairs(x, o, half, n, cos, sin, inverse):
    """Rotate pairs (j, j + half) for j < n: the "half" layout."""
    h = np.uint64(half)
    for j in range(n):
        k = np.uint64(j)
        c = cos[k]
        s = -sin[k] if inverse else sin[k]  # the transpose: rotate by -angle
        a = load(x, k)
        b = load(x, k + h)
        store(o, k, a * c - b * s)
        store(o, k + h, b * c + a * s)


@njit(inline="always")
def _interleaved_pairs(x, o, n, cos, sin, inverse):
    """Rotate pairs (2j, 2j + 1) for j < n: the "interleaved" layout."""
    one = np.uint64(1)
    for j in range(n):
        k = np.uint64(j)
        c = cos[k]
        s = -sin[k] if inverse else sin[k]
        a = load(x, 2 * k)
        b = load(x, 2 * k + one)
        store(o, 2 * k, a * c - b * s)
        store(o, 2 * k + one, b * c + a * s)


# Each layout's pairs are a function of their own, and each direction its own loop in it, with
# ``inverse`` a constant there: a runtime sign select left in the loop costs every element a
# select, and a runtime layout test would compile every layout's loops at each call site.
@njit(inline="always")
def rotate_half_pairs(x, o, half, n, cos, sin, inverse):
    """n pairs (j, j + half): the "half" layout."""
    if inverse:
        _pairs(x, o, half, n, cos, sin, True)
    else:
        _pairs(x, o, half, n, cos, sin, False)


@njit(inline="always")
def rotate_interleaved_pairs(x, o, n, cos, sin, inverse):
    """n pairs (2j, 2j + 1): the "interleaved" layout."""
    if inverse:
        _interleaved_pairs(x, o, n, cos, sin, True)
    else:
        _interleaved_pairs(x, o, n, cos, sin, False)


@njit(inline="always")
def _row(
    x, o, idx, xb, ob, pb, axis_stride, cos, sin, seg, rotary_dim, d, half_style, inverse, copy_tail
):
    """Rotate the row at offsets ``xb`` (x) and ``ob`` (o), one run of pairs (a segment) per
    position axis, converting each element in registers on its way in and out. ``x`` is None in
    place (see :func:`_row_views`)."""
    half = rotary_dim // 2
    for s in range(seg.shape[0]):
        p = idx[pb + seg[s, 2] * axis_stride]
        first, stop = seg[s, 0], seg[s, 1]
        if half_style:
            xv, ov = _row_views(x, o, xb + np.uint64(first), ob + np.uint64(first))
            rotate_half_pairs(xv, ov, half, stop - first, cos[p, first:], sin[p, first:], inverse)
        else:
            xv, ov = _row_views(x, o, xb + np.uint64(2 * first), ob + np.uint64(2 * first))
            rotate_interleaved_pairs(xv, ov, stop - first, cos[p, first:], sin[p, first:], inverse)
    if copy_tail:
        xv, ov = _row_views(x, o, xb + np.uint64(rotary_dim), ob + np.uint64(rotary_dim))
        for j in range(d - rotary_dim):
            ov[np.uint64(j)] = xv[np.uint64(j)]


def _written_unread(x):
    """Whether o's lines are written without being read first: False in place (``x`` None),
    where streaming stores would gain nothing."""


@overload(_written_unread)
def _written_unread_impl(x):
    flag = not isinstance(x, types.NoneType)
    return lambda x: flag


@njit(inline="always")
def _stream_copy(src, dst, start, n):
    """dst[start:start + n] = src[:n], the whole 64-byte lines of it with streaming stores.

    Lines only partly inside (where dst is not 64-byte aligned) take plain stores, so that no
    line gets both kinds."""
    item = np.uint64(dst.itemsize)
    per_line = np.uint64(64) // item
    addr = address(dst, start)
    head = ((np.uint64(64) - addr % np.uint64(64)) % np.uint64(64)) // item
    if addr % item != 0 or head > n:
        head = n
    lines = (n - head) // per_line
    for j in range(head):
        dst[start + np.uint64(j)] = src[np.uint64(j)]
    for k in range(lines):
        j = head + np.uint64(k) * per_line
        stream_line(dst, start + j, src, j)
    for j in range(head + lines * per_line, n):
        dst[start + np.uint64(j)] = src[np.uint64(j)]


@njit
def _rows(
    x,
    o,
    idx,
    g,
    first,
    stop,
    cos,
    sin,
    seg,
    rotary_dim,
    d,
    half_style,
    inverse,
    copy_tail,
    scratch,
):
    """Rows first..stop-1 of the operand whose geometry block is ``g`` (``g[t]`` of the launch's
    g), by the general row loop: plain stores, or (a non-empty ``scratch`` of o's dtype, ignored
    in place) rotated into that in-cache block a block of rows at a time and copied to o with
    streaming stores.

    Both calls pass arguments of one set of types (no literal operand number or first row), so
    that q's and k's share one compiled function: each type set costs seconds of compilation."""
    if first >= stop:
        return
    inner = g.shape[1] - 2
    sx, so, sp = g[1, inner], g[2, inner], g[3, inner]
    axis_stride = g[0, inner + 1]
    streaming = _written_unread(x) and scratch.shape[0] >= d
    block = scratch.shape[0] // d
    row = first
    while row < stop:
        xb, ob, pb, left = run_start(g, row)
        run = min(left, stop - row)
        # Where the run's rows are contiguous in o and streaming pays, a block of them at a
        # time is rotated into scratch (in cache) and then streamed to o; else the run is one
        # block rotated straight into o. One call site of _row: each is inlined, and a second
        # would double the kernels' compile time.
        buffered = streaming and so == d
        step = block if buffered else run
        for start in range(0, run, step):
            rows = min(step, run - start)
            for i in range(rows):
                r = start + i
                target = scratch if buffered else o
                tb = i * d if buffered else ob + r * so
                _row(
                    x,
                    target,
                    idx,
                    np.uint64(xb + r * sx),
                    np.uint64(tb),
                    pb + r * sp,
                    axis_stride,
                    cos,
                    sin,
                    seg,
                    rotary_dim,
                    d,
                    half_style,
                    inverse,
                    copy_tail or buffered,
                )
            if buffered:
                _stream_copy(scratch, o, np.uint64(ob + start * so), np.uint64(rows * d))
        row += run
    if streaming:
        store_fence()


@njit(inline="always")
def _count_rows(g):
    total = 1
    for ax in range(g.shape[1] - 1):
        total *= g[0, ax]
    return total


@njit(inline="always")
def _shares(g, first, stop):
    """(first, stop) in q's rows and in k's of the range first..stop-1 of q's rows followed by
    k's: a range may end q and begin k, so that equal ranges are equal work."""
    n1 = _count_rows(g[0])
    return first, min(stop, n1), max(first, n1) - n1, stop - n1


# The general path's one-thread entry points, one per way of storing results (see launch) and,
# on the direct path, per pair style, each compiled only when a call needs it. All take the
# same arguments (the direct ones ignore copy_tail and scratch, and the style, which each holds
# as a constant): the operands (x, out, idx) of q and k, the launch geometry g, the
# tables, the layout, the scratch block (see _parallel.scratch_blocks), and the range
# first..stop-1 of q's rows followed by k's that they rotate. ``x`` None means in place (the
# direct path's plain-store kernel is given x itself there: see launch). They allocate nothing:
# the parallel kernel calls them through their C wrapper, which would print an error rather
# than raise it.


@njit(cache=DISK_CACHE, nogil=True)
def rotate_range(
    x1, o1, i1, x2, o2, i2, g, cos, sin, seg, rotary_dim, d, half, inv, copy_tail, scratch, first,
    stop,
):  # fmt: skip
    """The general row loop: plain stores, or SCRATCH (``scratch`` not empty)."""
    f1, s1, f2, s2 = _shares(g, first, stop)
    _rows(x1, o1, i1, g[0], f1, s1, cos, sin, seg, rotary_dim, d, half, inv, copy_tail, scratch)
    _rows(x2, o2, i2, g[1], f2, s2, cos, sin, seg, rotary_dim, d, half, inv, copy_tail, scratch)


def _direct_kernel(name, runs, filled, half, doc):
    """The one-thread entry point ``name`` of the direct path by ``runs`` (one of _direct's
    loops) for one pair style, ``half`` (a constant inside: see _direct); ``filled``: rows
    made per position from the level tables (see below), else taken from cos and sin."""
    if filled:

        def kernel(
            x1, o1, i1, x2, o2, i2, g, levels, inv_freq, seg, rotary_dim, d, style, inv, scale,
            buf, first, stop,
        ):  # fmt: skip
            f1, s1, f2, s2 = _shares(g, first, stop)
            src = (levels, inv_freq, scale, buf)
            c, s = buf[0], buf[1]
            runs(x1, o1, i1, g[0], f1, s1, c, s, seg, rotary_dim, d, half, inv, src)
            runs(x2, o2, i2, g[1], f2, s2, c, s, seg, rotary_dim, d, half, inv, src)

    else:

        def kernel(
            x1, o1, i1, x2, o2, i2, g, cos, sin, seg, rotary_dim, d, style, inv, copy_tail,
            scratch, first, stop,
        ):  # fmt: skip
            f1, s1, f2, s2 = _shares(g, first, stop)
            runs(x1, o1, i1, g[0], f1, s1, cos, sin, seg, rotary_dim, d, half, inv, None)
            runs(x2, o2, i2, g[1], f2, s2, cos, sin, seg, rotary_dim, d, half, inv, None)

    # the name tells the two styles' disk cache entries and compiled symbols apart
    kernel.__name__ = kernel.__qualname__ = f"{name}_{'half' if half else 'pairs'}"
    kernel.__doc__ = f"{doc}, rows made per position." if filled else f"{doc}."
    return njit(cache=DISK_CACHE, nogil=True)(kernel)


# The direct path's entry points by ``stream``: (name, loop, what it does). With rows made per
# position (see launch_filled), idx holds positions, and the arguments in the tables' and
# copy_tail's places are the level tables, the frequencies and the rows' scale; each task's
# scratch block is a buffer of rows.
_DIRECT = {
    DIRECT: ("rotate_range_direct", direct_runs_streaming, "streaming stores (DIRECT)"),
    VECTOR: ("rotate_range_vector", direct_runs_plain, "plain stores (VECTOR)"),
    VECTOR_AHEAD: (
        "rotate_range_vector_ahead",
        direct_runs_plain_ahead,
        "plain stores, each row's input asked for ahead (VECTOR_AHEAD)",
    ),
    UNALIGNED: (
        "rotate_range_unaligned",
        direct_runs_unaligned,
        "plain stores anywhere on the element grid (UNALIGNED)",
    ),
    CHUNKED: (
        "rotate_range_chunked",
        direct_runs_chunked,
        "rows streamed in chunks on the 16-byte grid (CHUNKED)",
    ),
    CHUNKED_PLAIN: (
        "rotate_range_chunked_plain",
        direct_runs_chunked_plain,
        "rows in chunks on the 16-byte grid, plain stores (CHUNKED_PLAIN)",
    ),
}
_FILLED = (DIRECT, VECTOR, VECTOR_AHEAD, CHUNKED, CHUNKED_PLAIN)


def _styles(name, runs, filled, doc):
    return {
        half: _direct_kernel(name, runs, filled, half, f"The direct path, {doc}")
        for half in (False, True)
    }


# By ``stream`` (see launch) and pair style (half_style): the one-thread kernel
KERNELS = {stream: _styles(name, runs, False, doc) for stream, (name, runs, doc) in _DIRECT.items()}
KERNELS[0] = KERNELS[SCRATCH] = {False: rotate_range, True: rotate_range}
FILLED_KERNELS = {
    stream: _styles(name.replace("range", "range_filled"), runs, True, doc)
    for stream, (name, runs, doc) in _DIRECT.items()
    if stream in _FILLED
}


def kernels():
    """Every one-thread entry point, once."""
    found = {rotate_range}
    for table in (KERNELS, FILLED_KERNELS):
        found.update(kernel for styles in table.values() for kernel in styles.values())
    return found
