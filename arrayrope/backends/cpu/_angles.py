"""cos/sin rows at any integer position below 2**31, from three small tables by angle addition.

A position m splits into 11-bit digits, m = h * 2**22 + k * 2**11 + l, and so does its angle:
m * theta = A + B + C with A = h * (theta * 2**22), B = k * (theta * 2**11), C = l * theta, each
a float64 product. The level tables hold cos and sin of every A, B and C (2048 + 2048 + 512 rows
per pair, float64), so a row costs two angle additions in float64 and no call of cos or sin.

What the tables give is the rotation by A + B + C, the exact sum; the cache's rows are rotations
by phi = fl(m * theta), the float64 product, which differs from it by delta, up to about one
float64 ulp of phi (5e-7 rad at 2**31 for theta = 1, four float32 ulps of a cosine). delta is
computed exactly ((phi - A) - B) - C: each subtraction takes two floats within a factor of two
of each other (Sterbenz), and folded in with cos(delta) = 1 - delta**2 / 2, sin(delta) = delta
(the terms left out are below 1e-19). A row is then phi's cos and sin to a few float64 ulps,
and rounded once to the table dtype: the cache's own values, at every position.
"""

import numba
import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ._config import DISK_CACHE

DIGIT_BITS = 11
DIGIT = 1 << DIGIT_BITS  # rows of the two lower levels
TOP = 1 << (31 - 2 * DIGIT_BITS)  # rows of the top level: positions below 2**31
MID_ROW, TOP_ROW = DIGIT, 2 * DIGIT  # where each level starts in the stacked table
LEVEL_ROWS = 2 * DIGIT + TOP
LIMIT = 1 << 31


def level_tables(inv_freq):
    """cos and sin of the three levels' angles, stacked: float64 of shape (2, LEVEL_ROWS,
    n_pairs), rows [0, DIGIT) for l * theta, [MID_ROW, TOP_ROW) for k * theta * 2**11 and
    [TOP_ROW, LEVEL_ROWS) for h * theta * 2**22 (the products the kernel forms again)."""
    inv_freq = np.asarray(inv_freq, dtype=np.float64)
    digits = np.arange(DIGIT, dtype=np.float64)
    angles = np.concatenate(
        [
            np.multiply.outer(digits, inv_freq),
            np.multiply.outer(digits, inv_freq * DIGIT),
            np.multiply.outer(digits[:TOP], inv_freq * (DIGIT * DIGIT)),
        ]
    )
    return np.ascontiguousarray(np.stack((np.cos(angles), np.sin(angles))))


@njit(inline="always")
def _correct(c, s, delta, exact):
    """cos and sin of angle + delta from those of the angle: to second order where ``exact``
    (float64 tables), to first order otherwise (delta**2 / 2 is below 2**-42, far under a
    float32 ulp)."""
    if exact:
        half = 0.5 * delta * delta
        return c - (s * delta + c * half), s + (c * delta - s * half)
    return c - s * delta, s + c * delta


@njit(inline="always")
def _row(m, j0, j1, inv_freq, levels, scale, out, r, exact):
    """Pairs j0..j1-1 of row r of ``out``, all at position m. The arrays are indexed whole,
    with unsigned indices: a row view would cost a reference count, and a signed index a
    wraparound test, more than the pairs of a row."""
    h = np.uint64(m >> (2 * DIGIT_BITS))
    k = np.uint64((m >> DIGIT_BITS) & (DIGIT - 1))
    low = np.uint64(m & (DIGIT - 1))
    fm, fk, fl = np.float64(m), np.float64(k), np.float64(low)
    mid = k + np.uint64(MID_ROW)
    cos, sin = np.uint64(0), np.uint64(1)
    if h == 0:  # positions below 2**22: one angle addition
        for jj in range(j0, j1):
            j = np.uint64(jj)
            theta = inv_freq[j]
            c2, s2 = levels[cos, mid, j], levels[sin, mid, j]
            c3, s3 = levels[cos, low, j], levels[sin, low, j]
            c = c2 * c3 - s2 * s3
            s = s2 * c3 + c2 * s3
            delta = (fm * theta - fk * (theta * DIGIT)) - fl * theta
            c, s = _correct(c, s, delta, exact)
            out[cos, r, j] = c * scale
            out[sin, r, j] = s * scale
    else:
        fh = np.float64(h)
        top = h + np.uint64(TOP_ROW)
        for jj in range(j0, j1):
            j = np.uint64(jj)
            theta = inv_freq[j]
            c1, s1 = levels[cos, top, j], levels[sin, top, j]
            c2, s2 = levels[cos, mid, j], levels[sin, mid, j]
            c3, s3 = levels[cos, low, j], levels[sin, low, j]
            c12 = c1 * c2 - s1 * s2
            s12 = s1 * c2 + c1 * s2
            c = c12 * c3 - s12 * s3
            s = s12 * c3 + c12 * s3
            a = fh * (theta * (DIGIT * DIGIT))
            delta = ((fm * theta - a) - fk * (theta * DIGIT)) - fl * theta
            c, s = _correct(c, s, delta, exact)
            out[cos, r, j] = c * scale
            out[sin, r, j] = s * scale


def _float64(out):
    """Whether ``out`` holds float64: a compile-time constant in the kernels."""


@overload(_float64)
def _float64_impl(out):
    exact = out.dtype == types.float64
    return lambda out: exact


@njit(inline="always")
def _fill(positions, r, pair_axis, inv_freq, levels, scale, out):
    exact = _float64(out)
    n = inv_freq.shape[0]
    row = np.uint64(r)
    if positions.shape[1] == 1:  # one position per row: the pairs' loop is a vector loop
        _row(positions[row, 0], 0, n, inv_freq, levels, scale, out, row, exact)
    else:
        for j in range(n):
            m = positions[row, pair_axis[np.uint64(j)]]
            _row(m, j, j + 1, inv_freq, levels, scale, out, row, exact)


def filling(source):
    """Whether ``source`` is a row source for :func:`fill_row`, not None: a compile-time
    constant in the kernels."""


@overload(filling)
def _filling_impl(source):
    found = not isinstance(source, types.NoneType)
    return lambda source: found


def fill_row(source, m, slot):
    """Row ``slot`` of ``buf`` from ``source = (levels, inv_freq, scale, buf)``: the row of
    position m (in [0, 2**31), checked by the caller), as :func:`fill_rows` makes it; buf of
    shape (2, rows, n_pairs). Nothing where ``source`` is None."""


@overload(fill_row)
def _fill_row_impl(source, m, slot):
    if isinstance(source, types.NoneType):
        return lambda source, m, slot: None

    def fill(source, m, slot):
        levels, inv_freq, scale, buf = source
        n = inv_freq.shape[0]
        _row(m, 0, n, inv_freq, levels, scale, buf, np.uint64(slot), _float64(buf))

    return fill


def chunk_rows(source, run):
    """Rows of a run that the direct path rotates between fills of ``source``'s buffer: its
    rows (each row of a chunk has a slot), or the whole run where ``source`` is None."""


@overload(chunk_rows)
def _chunk_rows_impl(source, run):
    if isinstance(source, types.NoneType):
        return lambda source, run: max(run, 1)
    return lambda source, run: source[3].shape[1]


@njit(inline="always")
def fill_chunk(source, idx, start, step, count, held, held_rows):
    """Fill ``source``'s buffer with the rows of the chunk of ``count`` rows whose positions
    are idx[start + i * step] (one row where ``step`` is 0: they share a position), unless it
    holds them already: ``held`` is the start of the chunk it holds, ``held_rows`` how many
    rows. Returns the new (held, held_rows). Nothing where ``source`` is None."""
    if not filling(source):
        return held, held_rows
    rows = count if step != 0 else 1
    if start == held and rows <= held_rows:
        return held, held_rows
    for i in range(rows):
        fill_row(source, idx[np.uint64(start + i * step)], i)
    return start, rows


@njit(inline="always")
def table_row(source, idx, at, i, step, stride):
    """Flat offset of the table row of row ``i`` of a chunk: with ``source`` None, the row
    idx[at] of a table of row stride ``stride``; else the chunk's slot in source's buffer
    (see :func:`fill_chunk`)."""
    if filling(source):
        return np.uint64(i) * stride if step != 0 else np.uint64(0)
    return np.uint64(idx[np.uint64(at)]) * stride


@njit(inline="always")
def _valid(positions):
    """Whether every position is in [0, 2**31)."""
    for r in range(positions.shape[0]):
        for a in range(positions.shape[1]):
            if not 0 <= positions[r, a] < LIMIT:
                return False
    return True


@njit(cache=DISK_CACHE, nogil=True)
def fill_rows(positions, pair_axis, inv_freq, levels, scale, out):
    """``out[0, r, j]`` and ``out[1, r, j]``: ``scale`` times the cos and sin of the angle
    ``positions[r, pair_axis[j]] * inv_freq[j]``, rounded once to out's dtype, for int64
    ``positions`` of shape (R, n_axes). False, with nothing written, where a position is
    outside [0, 2**31)."""
    if not _valid(positions):
        return False
    for r in range(positions.shape[0]):
        _fill(positions, r, pair_axis, inv_freq, levels, scale, out)
    return True


@njit(cache=DISK_CACHE, parallel=True)
def fill_rows_parallel(positions, pair_axis, inv_freq, levels, scale, out):
    """:func:`fill_rows` on Numba's threads, for many rows."""
    if not _valid(positions):
        return False
    for r in prange(positions.shape[0]):
        _fill(positions, np.int64(r), pair_axis, inv_freq, levels, scale, out)
    return True


@njit(cache=DISK_CACHE, nogil=True)
def fill_column(first, inv_freq, levels, scale, out):
    """:func:`fill_rows` of positions first, first + 1, ... (one per row of ``out``) of a
    one-axis RoPE: the cache's rows, and a decode step's row past it. The caller checks that
    they are in [0, 2**31)."""
    exact = _float64(out)
    n = inv_freq.shape[0]
    for r in range(out.shape[1]):
        _row(first + r, 0, n, inv_freq, levels, scale, out, np.uint64(r), exact)


_column_entries = {}  # finite store: fill_column's entry point by dtype


def column_entry(dtype):
    """:func:`fill_column`'s compiled entry point for tables of ``dtype``: a call skips the
    dispatcher's type resolution, which costs more than a decode step's row."""
    found = _column_entries.get(dtype)
    if found is None:
        c = types.Array
        signature = (
            types.int64,
            c(types.float64, 1, "C"),
            c(types.float64, 3, "C"),
            types.float64,
            c(numba.from_dtype(dtype), 3, "C"),
        )
        found = _column_entries.setdefault(dtype, fill_column.compile(signature))
    return found
