"""One row's rotary part in vector steps, widest first: the ladder the direct path and the row
kernel of the half types share.

A ladder is made for one pair style, a tuple of step widths and a kind of store. The widest
step repeats while a row has that many bytes left; each narrower one, half the one before it,
runs at most once; a last width of None (one pair) repeats to the row's end. The row's rotary
part must be a whole number of the narrowest step.
"""

import numpy as np
from numba import njit, types
from numba.extending import overload

from ._simd import half_step, pair_step


def ladder(half, widths, nontemporal, aligned=True):
    """A function ``rotate(x, xr, o, orow, n, cos, sin, t, inverse)`` for Numba: rotate the
    ``n`` rotary elements of the row of o at flat offset ``orow`` from the row of x at ``xr``
    (pairs (j, j + n/2) where ``half``, else (2j, 2j + 1)), by the table row at offset ``t`` of
    cos and sin, in steps of ``widths`` bytes (two or three: see the module). The offsets and
    ``n`` share one integer type, signed or unsigned, which the ladder keeps."""
    if len(widths) not in (2, 3):
        raise ValueError(f"a ladder has two or three steps, got widths {widths}")
    make = half_step if half else pair_step
    calls = tuple(_call(make(w, nontemporal, aligned), half) for w in widths)
    first, last = calls[0], calls[-1]
    has_middle = len(calls) == 3
    middle = calls[1] if has_middle else first  # typed, never run
    last_repeats = widths[-1] is None

    def rotate(x, xr, o, orow, n, cos, sin, t, inverse):
        """Rotate one row's rotary part (see :func:`ladder`)."""

    @overload(rotate, inline="always")
    def rotate_impl(x, xr, o, orow, n, cos, sin, t, inverse):
        kind = np.uint64 if isinstance(n, types.Integer) and not n.signed else np.int64
        item = o.dtype.bitwidth // 8
        # elements per step along the loop's j, which counts pairs where half, else elements
        wide, *mid, narrow = (kind((1 if half else 2) if w is None else w // item) for w in widths)
        mid = mid[0] if mid else wide
        two = kind(2)

        def impl(x, xr, o, orow, n, cos, sin, t, inverse):
            h = n // two
            limit = h if half else n
            j = n - n  # zero, of the offsets' type
            while j + wide <= limit:
                first(x, xr + j, o, orow + j, h, cos, sin, t + _table(j, half, two), inverse)
                j += wide
            if has_middle and j + mid <= limit:
                middle(x, xr + j, o, orow + j, h, cos, sin, t + _table(j, half, two), inverse)
                j += mid
            if last_repeats:
                while j < limit:
                    last(x, xr + j, o, orow + j, h, cos, sin, t + _table(j, half, two), inverse)
                    j += narrow
            elif j < limit:
                last(x, xr + j, o, orow + j, h, cos, sin, t + _table(j, half, two), inverse)

        return impl

    return rotate


@njit(inline="always")
def _table(j, half, two):
    """The table offset of element j: one table entry per pair."""
    return j if half else j // two


def _call(step, half):
    """``step`` (an intrinsic of ``_simd``) in one signature for both styles:
    ``call(x, xa, o, oa, h, cos, sin, t, inverse)``, h unused by the interleaved steps."""
    if half:
        return step

    @njit(inline="always")
    def call(x, xa, o, oa, h, cos, sin, t, inverse):
        step(x, xa, o, oa, cos, sin, t, inverse)

    return call
