"""The direct path: rows rotated in vector registers and stored straight into the output.

Large outputs take streaming stores with no scratch block: whole cache lines of a row in
aligned stores (see _ladder.line_walk), the rest, and the half style's float16 and bfloat16
rows, in 16-byte pieces, which the CPU's write-combining buffers join, so a line split between
two rows streams whole too.
Smaller outputs, and arrays rotated in place, take the same loop with plain stores. Calls too
large for the cache (DIRECT, CHUNKED, VECTOR_AHEAD) ask for each row's input ahead. Every store
address must be 16-byte aligned (the launcher checks: see ``direct_path``); outputs off that
grid take the same steps with plain stores that assume no alignment (UNALIGNED: see
``vector_steps``), and the rest (multi-axis tables, float16 without F16C) the general row loop.

Outputs whose rows are on that grid but whose pair blocks are not (rotary_dim 50 at d = 128,
say), not in place, are written in chunks on the grid instead (CHUNKED, streaming, and
CHUNKED_PLAIN): each chunk of a row computed whole in registers (see _ladder.chunk_walk and
_paired.paired_row), so that even large outputs stream. Plain stores would first read every line
they write, a third more memory traffic.
"""

import numpy as np
from numba import types
from numba.core.errors import TypingError
from numba.extending import overload

from ._angles import chunk_rows, fill_chunk, table_row
from ._config import HARDWARE_F16, VECTOR_BYTES
from ._ladder import LINE_BYTES, chunk_walk, ladder, line_walk, variant
from ._runs import run_start
from ._simd import address, copy_bytes, copy_element, prefetch_row, store_fence, stream_line

# Bytes per step of a tail copied with plain stores while the tail has that many left (then
# 16); streamed tails go by whole lines (see copy_tail)
_TAIL_STEP_BYTES = 64

# How far ahead of the row being rotated a large call asks for its input (``ahead``): as many
# rows on as this many bytes of row data fill (at least the next row). The CPU's own
# prefetchers leave the rows of large arrays waiting on memory, the 2-byte types' most.
_AHEAD_BYTES = 4096


def _same(x, o):
    """Whether x and o start at one address: in place (see launch; the plan refuses partial
    overlap, so distinct operands never do)."""


@overload(_same)
def _same_impl(x, o):
    return lambda x, o: address(x, 0) == address(o, 0)


def _direct_runs_for(nontemporal, in_place_runs=None, aligned=True, chunked=False, ahead=False):
    """The direct path's loop over rows first..stop-1 of one operand (``g``: its geometry
    block), rotated straight into o with streaming stores or (``nontemporal`` False) plain ones:
    a function ``runs(x, o, idx, g, first, stop, cos, sin, seg, rotary_dim, d, half, inv,
    source)`` for Numba. ``source`` None: idx holds table rows of cos and sin. Else idx holds
    positions, and ``source`` (see ``_angles.fill_chunk``) fills the rows of each chunk of a
    run into its buffer (cos and sin), one per row, or one where the run's rows share a
    position; a chunk whose rows the buffer holds already (the same positions, at the next
    head) is not filled again.

    In place, x is o (the tail past rotary_dim is then left as it is), or None for an in-place
    operand of rotate_qk beside one whose result streams: that operand's lines are read before
    they are written, so it goes to ``in_place_runs`` (the plain-store loop) with x as o.

    ``aligned`` False (plain stores only) takes rows, pair blocks and tails anywhere on the
    element grid: its stores assume no alignment, and what a row has left under 16 bytes goes
    one pair (one element of the tail) at a time.

    ``chunked`` (rows on the 16-byte grid, pair blocks anywhere on the element grid): each row
    is written in chunks on the grid (see _ladder.chunk_walk), the tail from the first
    boundary past the rotary part on; results stream where ``nontemporal``.

    ``ahead`` (calls too large for the cache): before each row, a row _AHEAD_BYTES of row data
    on is asked for (see _simd.prefetch_row; a request past the operand's rows is harmless).

    ``half``, the pair style, is a compile-time constant (a literal True or False: see
    _rows.KERNELS), so that a kernel holds one style's steps, which compiles faster.
    """
    if aligned:
        # Steps of VECTOR_BYTES of output while a row has that many left, then 32 and 16 (rows
        # and pair blocks are whole multiples of 16 bytes here: see direct_path in cpu/__init__;
        # chunked, the rows only).
        widths = (VECTOR_BYTES, 32, 16) if VECTOR_BYTES > 32 else (32, 16)
        narrow_widths = widths
    else:
        # Steps of 32 bytes (16 for the 2-byte types: eight elements either way, four of
        # float64), then one pair at a time. Two steps, not three: a ladder with a middle step
        # grows past what LLVM inlines into the row loop, and a call per row costs more than
        # the pairs it saves.
        widths, narrow_widths = (32, None), (16, None)  # 4- and 8-byte types; 2-byte types
    if chunked:  # every dtype: chunks of VECTOR_BYTES, then 32 and 16 (see chunk_walk)
        walks = tuple(chunk_walk(half, widths, nontemporal) for half in (True, False))
        ladders = {True: walks, False: walks}
    else:
        ladders = {
            wide: (ladder(True, w, nontemporal, aligned), ladder(False, w, nontemporal, aligned))
            for wide, w in ((True, widths), (False, narrow_widths))
        }
    # The half style's 4- and 8-byte rows in address order: with plain stores by the split
    # ladder (see ladder's split); with streaming stores by the line walk below, the split
    # ladder's two passes having run no faster there (chunk walks are in that order already).
    split_ladder = (
        None if chunked or nontemporal else ladder(True, widths, False, aligned, split=True)
    )
    # Rows with streaming stores: in whole cache lines (see line_walk), but for the half style's
    # 2-byte rows, which keep the ladder: its walk converts each element twice (as itself and as
    # its partner), and a walk computing each pair once where both halves stand alike on the
    # line grid ran no faster (a 64-element row's halves, one line each, then go in 16-byte
    # steps). On the line grid a 2-byte pair step stores its 64 bytes in aligned stores as wide
    # as the vectors (bfloat16) or in two 32-byte pieces (float16: see _simd._store_streaming),
    # where a ladder's step, whose address is known to 16 bytes only, takes four.
    streams_lines = nontemporal and aligned and not chunked
    lines = line_walk(True, True) if streams_lines else None
    if streams_lines:
        pairs_by_lines = line_walk(False, True)
        ladders = {wide: (half_row, pairs_by_lines) for wide, (half_row, _) in ladders.items()}
    copy_16 = copy_bytes(nontemporal, 16, aligned)
    copy_step = copy_bytes(nontemporal, _TAIL_STEP_BYTES, aligned)

    def copy_tail(x, xr, o, orow, start, end):
        """Copy elements start..end-1 of the row of x at ``xr`` to the row of o at ``orow``.
        Compiled once per signature and inlined by LLVM, as the ladders are (inlined in Numba's
        IR, its loops make Numba warn of variables out of scope)."""

    @overload(copy_tail)
    def copy_tail_impl(x, xr, o, orow, start, end):
        item = o.dtype.bitwidth // 8
        step, step_16, one = (np.uint64(w // item) for w in (_TAIL_STEP_BYTES, 16, item))

        line, per_line = np.uint64(LINE_BYTES), np.uint64(LINE_BYTES // item)

        def impl(x, xr, o, orow, start, end):
            # unsigned while loops: LLVM keeps a range with a runtime step here as a loop that
            # spills its registers
            t = start
            if nontemporal and aligned:
                # on the line grid, as _ladder.line_walk writes rows: 16 bytes at a time to the
                # first line boundary, then one aligned streaming store per whole line
                while t + step_16 <= end and address(o, orow + t) % line:
                    copy_16(x, xr + t, o, orow + t)
                    t += step_16
                while t + per_line <= end:
                    stream_line(o, orow + t, x, xr + t)
                    t += per_line
            while t + step <= end:
                copy_step(x, xr + t, o, orow + t)
                t += step
            while t + step_16 <= end:
                copy_16(x, xr + t, o, orow + t)
                t += step_16
            if not aligned:
                while t < end:
                    copy_element(x, xr + t, o, orow + t)
                    t += one

        return variant(impl, "tail", nontemporal, aligned)

    def direct_runs(x, o, idx, g, first, stop, cos, sin, seg, rotary_dim, d, half, inv, source):
        """Rows first..stop-1 of one operand straight to o, rotated in vector registers."""

    in_place_loop = direct_runs if in_place_runs is None else in_place_runs
    # the variant's name (see _ladder.variant): what differs between the factory's calls
    parts = (nontemporal, aligned, chunked, in_place_runs is None, ahead)

    @overload(direct_runs, prefer_literal=True)
    def direct_runs_impl(
        x, o, idx, g, first, stop, cos, sin, seg, rotary_dim, d, half, inv, source
    ):
        if not isinstance(half, types.BooleanLiteral):
            raise TypingError(f"half (the pair style) must be a literal True or False, got {half}")
        style = half.literal_value
        named = (*parts, "half" if style else "pairs")
        # launch passes None only to the streaming loop (see launch), which hands it on
        if isinstance(x, types.NoneType):

            def in_place(
                x, o, idx, g, first, stop, cos, sin, seg, rotary_dim, d, half, inv, source
            ):
                in_place_loop(
                    o, o, idx, g, first, stop, cos, sin, seg, rotary_dim, d, half, inv, source
                )

            return variant(in_place, *named)

        # float16 without F16C takes the general loop (direct_path refuses it): its vector
        # conversions would call runtime helpers that Numba's JIT may not link.
        if o.dtype == types.int16 and not HARDWARE_F16:

            def nothing(x, o, idx, g, first, stop, cos, sin, seg, rotary_dim, d, half, inv, source):
                return None

            return variant(nothing, *named)

        # Each row's rotary part is a ladder, inlined into this function by Numba or LLVM (see
        # _ladder): a helper called per row would take its arrays, and table rows taken as views
        # (cos[p]), with reference-count calls per row. The table row starts at the flat offset tb
        # (cos and sin alike). One loop per layout (with the layout test inside the row loop, LLVM
        # keeps the loop's registers on the stack); the test whether rows have a tail stays inside
        # it, costing full rotary nothing measurable. A row's tail is copied right after its
        # rotated part, in the same iteration: x and o are then read and written in address order,
        # and a line split between a rotated part and its tail leaves the write-combining buffer
        # whole. (Over a block of rows, the rotated parts would skip lines that the tails come back
        # for, which the memory system serves poorly out of cache.) The loop over runs is in the
        # same function: a function Numba compiles on its own is optimized and emitted by LLVM once
        # more in each caller's library.
        half_row, pair_row = ladders[o.dtype.bitwidth > 16]
        # the half style's rows not in place, of 4- and 8-byte types, in address order
        if split_ladder is not None:
            split_row, splits = split_ladder, o.dtype.bitwidth > 16
        elif lines is not None and o.dtype.bitwidth > 16:  # the line walk (streaming stores)
            split_row, splits = lines, True
        else:
            split_row, splits = half_row, False
        per = np.uint64(16 // (o.dtype.bitwidth // 8))

        def runs(x, o, idx, g, first, stop, cos, sin, seg, rotary_dim, d, half, inv, source):
            if first >= stop:
                return
            inner = g.shape[1] - 2
            sx, so, sp = g[1, inner], g[2, inner], g[3, inner]
            axis = seg[0, 2] * g[0, inner + 1]  # one run of pairs: see direct_path
            same = _same(x, o)
            width = rotary_dim if same else d
            stride = np.uint64(cos.strides[0] // cos.itemsize)  # sin's too: see direct_path
            n = np.uint64(rotary_dim)
            # where the tail's copy starts (chunked: past the walk's last chunk, on the grid)
            tail_at = (n + per - np.uint64(1)) // per * per if chunked else n
            end = np.uint64(width)
            tails = width > rotary_dim
            # rows ahead, as an element offset (ahead is a constant: the branches on it are
            # compiled only where it is True)
            skip = np.uint64(0)
            if ahead:
                skip = np.uint64(max(1, _AHEAD_BYTES // (d * o.itemsize)) * sx)
            held, held_rows = np.int64(-1), np.int64(0)  # the chunk ``source`` holds
            row_at = first
            while row_at < stop:
                xb, ob, pb, left = run_start(g, row_at)
                run = min(left, stop - row_at)
                row_at += run
                chunk = chunk_rows(source, run)
                for c0 in range(0, run, chunk):
                    c1 = min(c0 + chunk, run)
                    at = pb + c0 * sp + axis
                    held, held_rows = fill_chunk(source, idx, at, sp, c1 - c0, held, held_rows)
                    # style is a constant: Numba drops the other style's loops before typing
                    if style and (same or not splits):  # in place: one pass (see ladder)
                        for r in range(c0, c1):
                            tb = table_row(source, idx, at + (r - c0) * sp, r - c0, sp, stride)
                            xr, orow = np.uint64(xb + r * sx), np.uint64(ob + r * so)
                            if ahead:
                                prefetch_row(x, xr + skip, np.uint64(d))
                            half_row(x, xr, o, orow, n, cos, sin, tb, inv)
                            if tails:
                                copy_tail(x, xr, o, orow, tail_at, end)
                    elif style:
                        for r in range(c0, c1):
                            tb = table_row(source, idx, at + (r - c0) * sp, r - c0, sp, stride)
                            xr, orow = np.uint64(xb + r * sx), np.uint64(ob + r * so)
                            if ahead:
                                prefetch_row(x, xr + skip, np.uint64(d))
                            split_row(x, xr, o, orow, n, cos, sin, tb, inv)
                            if tails:
                                copy_tail(x, xr, o, orow, tail_at, end)
                    else:
                        for r in range(c0, c1):
                            tb = table_row(source, idx, at + (r - c0) * sp, r - c0, sp, stride)
                            xr, orow = np.uint64(xb + r * sx), np.uint64(ob + r * so)
                            if ahead:
                                prefetch_row(x, xr + skip, np.uint64(d))
                            pair_row(x, xr, o, orow, n, cos, sin, tb, inv)
                            if tails:
                                copy_tail(x, xr, o, orow, tail_at, end)
            if nontemporal:
                store_fence()

        return variant(runs, *named)

    return direct_runs


direct_runs_plain = _direct_runs_for(False)
direct_runs_plain_ahead = _direct_runs_for(False, ahead=True)
direct_runs_streaming = _direct_runs_for(True, direct_runs_plain_ahead, ahead=True)
direct_runs_unaligned = _direct_runs_for(False, aligned=False)
direct_runs_chunked = _direct_runs_for(True, direct_runs_unaligned, chunked=True, ahead=True)
direct_runs_chunked_plain = _direct_runs_for(False, direct_runs_unaligned, chunked=True)
