"""The one-thread row kernels for decode- and prefill-sized inputs.

They take the arrays as they are, with any number of axes and any leading strides (the plan has
checked that the kernels can address them): flat views and operand geometry cost more Python than
the whole rotation of a decode step. Row r (in C order) sits at position
``positions[(r // repeat) % len(positions)]``; ``positions`` may be one int, which is cheaper
to hand over than an array.
"""

import numpy as np
from numba import njit, types
from numba.extending import overload

from ._config import DISK_CACHE, HARDWARE_F16
from ._ladder import ladder
from ._rows import rotate_half_pairs, rotate_interleaved_pairs
from ._simd import contiguous, copy_element

# The status a row kernel returns. It writes nothing unless it returns DONE.
DONE, POSITION_OUTSIDE_TABLE, SPANS_OVERLAP = 0, 1, 2


def settings(rotary_dim, half_style, inverse, repeat):
    """The row kernels' ``settings``: every argument costs the call its unboxing, so the scalars
    travel packed in one int (kept below 2**62), unpacked by _unpack."""
    return (repeat - 1) << 32 | rotary_dim << 2 | half_style << 1 | inverse


def rows_kernel(dtype):
    """The row kernel for outputs of ``dtype`` (float16 and bfloat16 as their int16 and uint16
    bits): :func:`rotate_rows_in_steps` for the half types where the CPU converts float16,
    :func:`rotate_rows` for the rest."""
    if dtype == np.uint16 or (dtype == np.int16 and HARDWARE_F16):
        return rotate_rows_in_steps
    return rotate_rows


# Each kernel is one function, its row loop written out in it rather than called: a function
# Numba compiles on its own is optimized and emitted by LLVM once more in each caller's library.


@njit(cache=DISK_CACHE)
def rotate_rows(x, o, positions, tables, settings):
    """Rotate the rows of ``x`` into those of ``o`` (``x`` None: in place) by the rows of
    ``tables`` (cos and sin stacked, shape (2, rows, pairs)) at ``positions``; see
    :func:`settings` for the rest. The only checks are the ones that depend on values and
    addresses, made before anything is written: every position is a row of the table, and the
    memory of x and o do not overlap (the caller tells exact aliasing from partial overlap).

    The rows go through the general row body, a row view at a time: float32 and float64, and
    float16 where the CPU has no F16C (see :func:`rows_kernel`)."""
    repeat, rotary_dim, half_style, inverse = _unpack(settings)
    cos = tables[0]
    sin = tables[1]
    refused = _refused(x, o, positions, cos.shape[0])
    if refused != DONE:
        return refused
    d = o.shape[o.ndim - 1]
    n = rotary_dim // 2
    period = _count(positions)
    entry = 0
    left = repeat
    for idx in np.ndindex(o.shape[:-1]):
        p = _entry(positions, entry)
        xv, ov = _row_at(x, o, idx)
        if half_style:
            rotate_half_pairs(xv, ov, n, n, cos[p], sin[p], inverse)
        else:
            rotate_interleaved_pairs(xv, ov, n, cos[p], sin[p], inverse)
        for j in range(rotary_dim, d):  # the tail past rotary_dim, copied
            ov[np.uint64(j)] = xv[np.uint64(j)]
        left -= 1
        if left == 0:  # a counter, not r // repeat % period: divisions cost more than a row
            left = repeat
            entry += 1
            if entry == period:
                entry = 0
    return DONE


@njit(inline="always")
def _unpack(settings):
    """(repeat, rotary_dim, half_style, inverse) from :func:`settings`'s packed int."""
    repeat = (settings >> 32) + 1
    return repeat, (settings >> 2) & 0x3FFFFFFF, (settings & 2) != 0, (settings & 1) != 0


@njit(inline="always")
def _refused(x, o, positions, rows):
    """DONE, or why the kernel may not write: a position outside the table's ``rows``, or x and
    o overlapping."""
    for i in range(_count(positions)):
        if _entry(positions, i) < 0 or _entry(positions, i) >= rows:
            return POSITION_OUTSIDE_TABLE
    if _overlap(x, o):
        return SPANS_OVERLAP
    return DONE


def _count(positions):
    """len(positions), or 1 where ``positions`` is a single int."""


@overload(_count)
def _count_impl(positions):
    if isinstance(positions, types.Integer):
        return lambda positions: 1
    return lambda positions: positions.shape[0]


def _entry(positions, i):
    """positions[i], or ``positions`` itself where it is a single int."""


@overload(_entry)
def _entry_impl(positions, i):
    if isinstance(positions, types.Integer):
        return lambda positions, i: positions
    return lambda positions, i: positions[i]


def _row_at(x, o, idx):
    """(``x[idx]``, ``o[idx]``) as contiguous views, or ``o[idx]`` twice where ``x`` is None."""


@overload(_row_at)
def _row_at_impl(x, o, idx):
    if isinstance(x, types.NoneType):

        def in_place(x, o, idx):
            row = contiguous(o[idx])
            return row, row

        return in_place
    return lambda x, o, idx: (contiguous(x[idx]), contiguous(o[idx]))


def _overlap(x, o):
    """Whether the memory spans of x and o intersect (False where x is None: in place): the
    bounds test of np.may_share_memory, which costs a call from Python more than the kernel."""


@overload(_overlap)
def _overlap_impl(x, o):
    if isinstance(x, types.NoneType):
        return lambda x, o: False

    def overlap(x, o):
        if x.size == 0 or o.size == 0:  # no memory (memory_span is a whole span's)
            return False
        x_lo, x_hi = memory_span(x)
        o_lo, o_hi = memory_span(o)
        return x_lo < o_hi and o_lo < x_hi

    return overlap


@njit(inline="always")
def memory_span(a):
    """[first byte, past the last byte) of the memory a spans (its whole span: empty or not)."""
    lo = np.int64(a.ctypes.data)
    hi = lo + a.itemsize
    for k in range(a.ndim):
        extent = (a.shape[k] - 1) * a.strides[k]
        if extent < 0:
            lo += extent
        else:
            hi += extent
    return lo, hi


# float16 and bfloat16 rows go through the direct path's vector steps, with plain stores that
# need only element alignment, rows addressed by offset: LLVM's own loop over a row view converts
# these types less well. float32 and float64 keep that loop, which the steps do not beat.
_half_row = ladder(True, (32, 16, None), False, aligned=False)
_pair_row = ladder(False, (32, 16, None), False, aligned=False)


def _source(x, o):
    """x, or o where x is None (in place)."""


@overload(_source)
def _source_impl(x, o):
    if isinstance(x, types.NoneType):
        return lambda x, o: o
    return lambda x, o: x


def _copies(x):
    """Whether rows have a tail to copy: not in place (``x`` None)."""


@overload(_copies)
def _copies_impl(x):
    copies = not isinstance(x, types.NoneType)
    return lambda x: copies


@njit(inline="always")
def _offset(a, idx):
    """The flat element offset of row ``idx`` of ``a`` from its first element."""
    offset = 0
    for k in range(len(idx)):
        offset += idx[k] * a.strides[k]
    return offset // a.itemsize


@njit(cache=DISK_CACHE)
def rotate_rows_in_steps(x, o, positions, tables, settings):
    """:func:`rotate_rows` for float16 and bfloat16, x and o as their bits (int16 and uint16;
    x None: in place): the rows in vector steps, each addressed by its flat offsets (no row
    views), 32 bytes at a time, then 16, then a pair at a time; tails are copied afterwards."""
    repeat, rotary_dim, half_style, inverse = _unpack(settings)
    cos = tables[0]
    sin = tables[1]
    refused = _refused(x, o, positions, cos.shape[0])
    if refused != DONE:
        return refused
    src = _source(x, o)
    stride = cos.strides[0] // cos.itemsize  # sin's too: both are views of one table
    period = _count(positions)
    entry = 0
    left = repeat
    for idx in np.ndindex(o.shape[:-1]):
        t = _entry(positions, entry) * stride
        xr, orow = _offset(src, idx), _offset(o, idx)
        if half_style:
            _half_row(src, xr, o, orow, rotary_dim, cos, sin, t, inverse)
        else:
            _pair_row(src, xr, o, orow, rotary_dim, cos, sin, t, inverse)
        left -= 1
        if left == 0:
            left = repeat
            entry += 1
            if entry == period:
                entry = 0
    d = o.shape[o.ndim - 1]
    if d > rotary_dim and _copies(x):
        for idx in np.ndindex(o.shape[:-1]):
            xr = _offset(src, idx)
            orow = _offset(o, idx)
            for j in range(rotary_dim, d):
                copy_element(src, xr + j, o, orow + j)
    return DONE
