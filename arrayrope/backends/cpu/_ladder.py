"""One row's rotary part in vector steps, widest first: the ladder the direct path and the row
kernel of the half types share.

A ladder is made for one pair style, a tuple of step widths and a kind of store. The widest
step repeats while a row has that many bytes left; each narrower one, half the one before it,
runs at most once; a last width of None (one pair) repeats to the row's end. The row's rotary
part must be a whole number of the narrowest step.

A chunk walk (:func:`chunk_walk`) takes the same arguments for rows on the 16-byte grid whose
pair blocks are not: it writes the row in chunks on the grid instead of pair blocks (the half
style's 2-byte rows with AVX-512 through _paired.paired_row, which computes each pair once).
"""

import warnings

import numpy as np
from numba import types
from numba.core.errors import NumbaIRAssumptionWarning
from numba.extending import overload

from ._config import PAIRED_ROWS
from ._paired import PAIRED_BLOCKS, paired_row
from ._simd import address, chunk_step, row_step

# Bytes of a cache line: the grid of line_walk's wide chunks
LINE_BYTES = 64

# Numba's IR inlining of the chunk walk renames its loops' variables, which a pedantic check
# of Numba's parallel kernels then reports as out of scope, once per variable and kernel
# compiled; the code compiled is right (the tests), so the report is left out for that
# function's variables only.
warnings.filterwarnings("ignore", r"variable 'chunk_walk__locals__", NumbaIRAssumptionWarning)


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


def ladder(half, widths, nontemporal, aligned=True, one_dtype=False, split=False):
    """A function ``rotate(x, xr, o, orow, n, cos, sin, t, inverse)`` for Numba: rotate the
    ``n`` rotary elements of the row of o at flat offset ``orow`` from the row of x at ``xr``
    (pairs (j, j + n/2) where ``half``, else (2j, 2j + 1)), by the table row at offset ``t`` of
    cos and sin, in steps of ``widths`` bytes (two or three: see the module). The offsets and
    ``n`` share one integer type, signed or unsigned, which the ladder keeps. ``one_dtype``:
    where x's and o's dtypes differ, the ladder does nothing (for a call its caller skips at
    run time there, which then costs no compiled steps).

    ``split`` (never for rows rotated in place: the second pass reads the first half, which
    the first pass has overwritten there; the direct path takes it with plain stores only):
    the half style's rows of 4- and 8-byte elements are written in address order, the ladder
    over the pairs storing the first half's results, then again storing the second's (each
    step reads its x and table elements again, from the first-level cache by then). Stores
    alternating between the two halves, h elements apart, keep two runs of lines half written
    at once, which the caches take more slowly than one run. The 2-byte types keep one pass:
    converting each element twice costs them more than the order saves."""
    if len(widths) not in (2, 3):
        raise ValueError(f"a ladder has two or three steps, got widths {widths}")
    split = split and half
    both = _steps(half, widths, nontemporal, aligned, None)
    firsts = _steps(half, widths, nontemporal, aligned, "first") if split else both
    last_repeats = widths[-1] is None

    def rotate(x, xr, o, orow, n, cos, sin, t, inverse):
        """Rotate one row's rotary part (see :func:`ladder`)."""

    # compiled once per signature and inlined by LLVM: inlined in Numba's IR at every call
    # site instead, it doubled the direct path's compile time
    @overload(rotate)
    def rotate_impl(x, xr, o, orow, n, cos, sin, t, inverse):
        if one_dtype and x.dtype != o.dtype:

            def nothing(x, xr, o, orow, n, cos, sin, t, inverse):
                return None

            return variant(nothing, "none", half, widths, nontemporal, aligned, split)
        passes = 2 if split and o.dtype.bitwidth >= 32 else 1
        first, middle, last = firsts if passes == 2 else both
        has_middle = len(widths) == 3
        kind = np.uint64 if isinstance(n, types.Integer) and not n.signed else np.int64
        item = o.dtype.bitwidth // 8
        # elements per step along the loop's j, which counts pairs where half, else elements
        wide, *mid, narrow = (kind((1 if half else 2) if w is None else w // item) for w in widths)
        mid = mid[0] if mid else wide
        two = kind(2)

        def impl(x, xr, o, orow, n, cos, sin, t, inverse):
            h = n // two
            limit = h if half else n
            zero = n - n  # of the offsets' type
            for p in range(passes):
                # The second of two passes writes the pairs' second halves by the steps that
                # write first halves: each element at j + h, its partner h before it (the
                # offset wraps where unsigned), sin's sign turned: b c - a (-s) is b c + a s,
                # bit for bit (a NaN result's sign aside).
                shift = h if p else zero
                partner = zero - h if p else h
                flip = inverse != (p == 1)
                xp, op = xr + shift, orow + shift
                j = zero
                while j + wide <= limit:
                    first(x, xp, o, op, partner, cos, sin, t, j, flip)
                    j += wide
                if has_middle and j + mid <= limit:
                    middle(x, xp, o, op, partner, cos, sin, t, j, flip)
                    j += mid
                if last_repeats:
                    while j < limit:
                        last(x, xp, o, op, partner, cos, sin, t, j, flip)
                        j += narrow
                elif j < limit:
                    last(x, xp, o, op, partner, cos, sin, t, j, flip)

        name = "split" if passes == 2 else "half" if half else "pairs"
        return variant(impl, name, widths, nontemporal, aligned, split)

    return rotate


def _steps(half, widths, nontemporal, aligned, part):
    """A ladder's steps (the widest, the middle one, the last; the widest again where there
    are two widths: typed, never run), storing ``part`` (see _simd._half_step)."""
    first, *rest = (row_step(half, w, nontemporal, aligned, part) for w in widths)
    return first, rest[0] if len(rest) == 2 else first, rest[-1]


# The rotary parts _paired.paired_row holds, in elements of a 2-byte type (see takes_paired_row)
PAIRED_ROTARY = 2 * PAIRED_BLOCKS * 32


def takes_paired_row(half, item, rotary_dim=0):
    """Whether the chunk walk's rows of ``item``-byte elements take _paired.paired_row, which
    computes each pair once where the walk reads each element twice (as itself and as its
    partner): the half style's 2-byte types, where _config.PAIRED_ROWS (the wider types keep
    the walk, which writes their rows as fast). The launcher gives it rows whose
    ``rotary_dim`` it holds (at most PAIRED_ROTARY) and others another path."""
    return half and PAIRED_ROWS and item == 2 and rotary_dim <= PAIRED_ROTARY


def chunk_walk(half, widths, nontemporal):
    """A function with a ladder's arguments for Numba that writes the row of o at ``orow``
    (16-byte aligned) in chunks on the 16-byte grid whatever the grid of its pair blocks, up to
    the first boundary at or past the rotary part's end (elements past it copied from x). Each
    chunk takes the step for what it holds (see _simd.chunk_step). Where all of its elements
    have their partners on one side (plain loads), steps of ``widths[0]`` bytes, then one of 32
    where ``widths`` has it, then of 16; the 16 bytes across the pair blocks' edge h and the 16
    across the rotary part's end take masked loads (one chunk where both fall in the same 16
    bytes). In the half layout that is the walk 0..h, then h..n, then the end. Rows that
    :func:`takes_paired_row` says take _paired.paired_row instead."""
    wide, *mid, narrow = widths
    if narrow != 16 or mid not in ([], [32]):
        raise ValueError(f"a chunk walk takes widths (widest, [32,] 16), got {widths}")
    has_middle = bool(mid)
    if half:
        first_w, second_w = (chunk_step(True, k, wide, nontemporal) for k in ("first", "second"))
        first_32, second_32 = (chunk_step(True, k, 32, nontemporal) for k in ("first", "second"))
        first_16, second_16 = (chunk_step(True, k, 16, nontemporal) for k in ("first", "second"))
    else:  # one pair step for every chunk inside the rotary part
        first_w, first_16 = row_step(False, wide, nontemporal), row_step(False, 16, nontemporal)
        first_32 = row_step(False, 32, nontemporal)
        second_w, second_32, second_16 = first_w, first_32, first_16
    mixed_16 = chunk_step(half, "mixed", 16, nontemporal)
    paired = paired_row(nontemporal) if half and PAIRED_ROWS else None

    def rotate(x, xr, o, orow, n, cos, sin, t, inverse):
        """Rotate one row's rotary part in aligned chunks (see :func:`chunk_walk`)."""

    # Inlined in Numba's IR: compiled on its own, LLVM calls it once per row, with every
    # array's fields as arguments, at a quarter of the loop's time. One loop per kind of chunk
    # rather than one loop that branches on the kind: LLVM merges the branches' stores into
    # one, and the merged store loses its streaming mark.
    @overload(rotate, inline="always")
    def rotate_impl(x, xr, o, orow, n, cos, sin, t, inverse):
        kind = np.uint64 if isinstance(n, types.Integer) and not n.signed else np.int64
        item = o.dtype.bitwidth // 8
        w, per = kind(wide // item), kind(narrow // item)
        m = kind(32 // item)
        two = kind(2)

        if takes_paired_row(half, item):

            def paired_impl(x, xr, o, orow, n, cos, sin, t, inverse):
                paired(x, xr, o, orow, n, cos, sin, t, inverse)

            return variant(paired_impl, "paired", widths, nontemporal)

        def impl(x, xr, o, orow, n, cos, sin, t, inverse):
            h = n // two
            edge = h if half else n - n  # interleaved: no edge inside the rotary part
            # Where the chunks wholly on one side end, and so where the mixed chunks start,
            # in closed form from n: the masks of a mixed chunk then depend on n alone, and
            # LLVM computes them once per call rather than once per row.
            first_end = edge // per * per
            end = n // per * per
            k = n - n
            while k + w <= first_end:
                first_w(x, xr, o, orow, h, cos, sin, t, k, inverse)
                k += w
            if has_middle and k + m <= first_end:
                first_32(x, xr, o, orow, h, cos, sin, t, k, inverse)
                k += m
            while k < first_end:
                first_16(x, xr, o, orow, h, cos, sin, t, k, inverse)
                k += per
            if first_end < edge:  # the chunk across the edge h
                mixed_16(x, xr, o, orow, h, cos, sin, t, first_end, inverse)
                k = first_end + per
            while k + w <= end:
                second_w(x, xr, o, orow, h, cos, sin, t, k, inverse)
                k += w
            if has_middle and k + m <= end:
                second_32(x, xr, o, orow, h, cos, sin, t, k, inverse)
                k += m
            while k < end:
                second_16(x, xr, o, orow, h, cos, sin, t, k, inverse)
                k += per
            if end < n and k <= end:  # the chunk across the end n, unless the edge's holds it
                mixed_16(x, xr, o, orow, h, cos, sin, t, end, inverse)

        return variant(impl, "chunks", "half" if half else "pairs", widths, nontemporal)

    return rotate


def line_walk(half, nontemporal, narrow=None):
    """A function with a ladder's arguments for Numba that rotates a row (pair blocks of whole
    16 bytes, the row of o at ``orow`` on the 16-byte grid; the half style's not in place) in
    chunks on the grid of cache lines of the row's addresses: chunks of 16 bytes up to the
    row's first line boundary, whole lines, each stored at once (2-byte results in aligned
    pieces: see _simd._store_streaming), then chunks of 16 bytes to the rotary part's end
    (see _simd.chunk_step; the interleaved style's chunks are its row steps). The half style's
    line across its edge h goes in 16-byte chunks too, one after another. A row 16 bytes
    past a line (where NumPy's large arrays start) otherwise stores each vector step's results
    across two lines, in 16-byte pieces; with streaming stores, whole aligned lines keep fewer
    lines partly written at once, which the half style's two runs of stores (j and j + h)
    need most. ``narrow``: a ladder that rows of 2-byte elements take instead."""
    if half:
        first_w, second_w = (
            chunk_step(True, kind, LINE_BYTES, nontemporal, LINE_BYTES)
            for kind in ("first", "second")
        )
        first_16, second_16 = (
            chunk_step(True, kind, 16, nontemporal) for kind in ("first", "second")
        )
    else:  # the pair steps, with no edge inside the rotary part
        first_w = second_w = row_step(False, LINE_BYTES, nontemporal, LINE_BYTES)
        first_16 = second_16 = row_step(False, 16, nontemporal)

    def rotate(x, xr, o, orow, n, cos, sin, t, inverse):
        """Rotate one row's rotary part in chunks on the line grid (see :func:`line_walk`)."""

    # Compiled once per signature and inlined by LLVM, which would call it once per row for
    # its size (with every array's fields as arguments) but for forceinline. Inlined in Numba's
    # IR instead, as the chunk walk is, it took about a second longer to compile per kernel.
    @overload(rotate, jit_options={"forceinline": True})
    def rotate_impl(x, xr, o, orow, n, cos, sin, t, inverse):
        kind = np.uint64 if isinstance(n, types.Integer) and not n.signed else np.int64
        item = o.dtype.bitwidth // 8
        if item == 2 and narrow is not None:

            def narrow_impl(x, xr, o, orow, n, cos, sin, t, inverse):
                narrow(x, xr, o, orow, n, cos, sin, t, inverse)

            return variant(narrow_impl, "narrow", "half" if half else "pairs", nontemporal)
        w, per, two = kind(LINE_BYTES // item), kind(16 // item), kind(2)
        line, size = np.uint64(LINE_BYTES), np.uint64(item)

        def impl(x, xr, o, orow, n, cos, sin, t, inverse):
            h = n // two if half else n  # interleaved: every chunk a "first" one
            # elements to the first line boundary (a whole number of 16 bytes: orow is on
            # that grid), or the whole rotary part where it ends before one
            lead = min(kind((line - address(o, orow) % line) % line // size), n)
            k = n - n
            while k < lead and k < h:
                first_16(x, xr, o, orow, h, cos, sin, t, k, inverse)
                k += per
            while k < lead:
                second_16(x, xr, o, orow, h, cos, sin, t, k, inverse)
                k += per
            while k + w <= h:
                first_w(x, xr, o, orow, h, cos, sin, t, k, inverse)
                k += w
            # the line across h (and a row's end before the next line) in 16-byte chunks
            while k < h:
                first_16(x, xr, o, orow, h, cos, sin, t, k, inverse)
                k += per
            while k < n and (k - lead) % w:
                second_16(x, xr, o, orow, h, cos, sin, t, k, inverse)
                k += per
            while k + w <= n:
                second_w(x, xr, o, orow, h, cos, sin, t, k, inverse)
                k += w
            while k < n:
                second_16(x, xr, o, orow, h, cos, sin, t, k, inverse)
                k += per

        return variant(impl, "lines", "half" if half else "pairs", nontemporal)

    return rotate
