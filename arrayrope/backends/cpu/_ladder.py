"""One row's rotary part in vector steps, widest first: the ladder the direct path and the row
kernel of the half types share.

A ladder is made for one pair style, a tuple of step widths and a kind of store. The widest
step repeats while a row has that many bytes left; each narrower one, half the one before it,
runs at most once; a last width of None (one pair) repeats to the row's end. The row's rotary
part must be a whole number of the narrowest step.
"""

import numpy as np
from numba import types
from numba.extending import overload

from ._simd import row_step


def variant(fn, *parts):
    """``fn`` (a function a factory makes for Numba) with ``parts`` (the factory's arguments)
    added to its qualified name, returned. Numba names compiled code by the qualified name, the
    argument types and a counter that each process numbers in its own order of compilation;
    kernels loaded from the disk cache and kernels compiled afresh share one JIT, which takes
    two functions of one name for one and may run either's code for both. Two variants of a
    factory's function differ in name only by their parts."""
    words = ("x".join(map(str, p)) if isinstance(p, tuple) else str(p) for p in parts)
    fn.__qualname__ = f"{fn.__qualname__}_{'_'.join(words)}"
    return fn


def ladder(half, widths, nontemporal, aligned=True):
    """A function ``rotate(x, xr, o, orow, n, cos, sin, t, inverse)`` for Numba: rotate the
    ``n`` rotary elements of the row of o at flat offset ``orow`` from the row of x at ``xr``
    (pairs (j, j + n/2) where ``half``, else (2j, 2j + 1)), by the table row at offset ``t`` of
    cos and sin, in steps of ``widths`` bytes (two or three: see the module). The offsets and
    ``n`` share one integer type, signed or unsigned, which the ladder keeps."""
    if len(widths) not in (2, 3):
        raise ValueError(f"a ladder has two or three steps, got widths {widths}")
    first, *rest = (row_step(half, w, nontemporal, aligned) for w in widths)
    has_middle = len(rest) == 2
    middle = rest[0] if has_middle else first  # typed, never run
    last = rest[-1]
    last_repeats = widths[-1] is None

    def rotate(x, xr, o, orow, n, cos, sin, t, inverse):
        """Rotate one row's rotary part (see :func:`ladder`)."""

    # compiled once per signature and inlined by LLVM: inlined in Numba's IR at every call
    # site instead, it doubled the direct path's compile time
    @overload(rotate)
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
                first(x, xr, o, orow, h, cos, sin, t, j, inverse)
                j += wide
            if has_middle and j + mid <= limit:
                middle(x, xr, o, orow, h, cos, sin, t, j, inverse)
                j += mid
            if last_repeats:
                while j < limit:
                    last(x, xr, o, orow, h, cos, sin, t, j, inverse)
                    j += narrow
            elif j < limit:
                last(x, xr, o, orow, h, cos, sin, t, j, inverse)

        return variant(impl, "half" if half else "pairs", widths, nontemporal, aligned)

    return rotate
