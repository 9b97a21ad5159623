"""The CPU backend: Numba kernels for NumPy arrays, and the policy that picks how each call runs.

Two launch strategies, chosen by the plan:
- rows (:func:`rows_plan`, the plan of ``_rows_plan`` around ``_decode``'s row kernels): one
  thread, the arrays taken as they are, for decode- and prefill-sized inputs with one position
  axis and positions in a row pattern;
- general (:func:`launch`): flat views and operand geometry, q and k in one call, on one thread
  or in parallel tasks, with streaming or plain stores, multi-axis tables gathered per entry;
  :func:`launch_filled` is its direct path for positions past the cache, each position's row
  made in the kernel.
"""

import numba
import numpy as np

from ... import _arrays
from ..._arrays import NUMPY
from ..._cache import Bounded
from .._geometry import flat_view, geometry
from . import (
    _angles,
    _config,
    _convert,
    _decode,
    _direct,
    _disk_cache,
    _fused,
    _fused_launch,
    _gather,
    _parallel,
    _rows,
    _runs,
    _step_checks,
)
from ._config import HARDWARE_F16, STREAMING, threads_usable
from ._fused_launch import launch as launch_fused
from ._gather import GATHER_ABOVE, ONE_RUN, SHARED_BY, entries, per_entry
from ._ladder import takes_paired_row
from ._parallel import launch_parallel, scratch_blocks
from ._rows import (
    CHUNKED,
    CHUNKED_PLAIN,
    DIRECT,
    FILLED_KERNELS,
    KERNELS,
    SCRATCH,
    UNALIGNED,
    VECTOR,
    VECTOR_AHEAD,
)
from ._rows_plan import rows_plan

_disk_cache.guard(
    _angles, _convert, _decode, _direct, _fused, _fused_launch, _gather, _parallel, _rows, _runs,
    _step_checks,
)  # fmt: skip

__all__ = ["launch", "launch_filled", "launch_fused", "replay", "rows_plan"]

_F16 = np.dtype(np.float16)


def launch(spec, operands, cos, sin, inverse):
    """Rotate one or two operands (q and k) in one kernel call: the general strategy. Returns
    how the results were stored (0: plain stores; SCRATCH, DIRECT, VECTOR, VECTOR_AHEAD,
    UNALIGNED, CHUNKED or CHUNKED_PLAIN).

    ``operands`` holds (x, out, idx) triples: x and out of shape (L leading..., d), addressable
    (see ``_arrays.addressable``), ``out is x`` for in place; idx int64 of shape (L axes of
    size 1 or matching..., n_axes or 1), rows of ``cos``/``sin``.
    """
    parallel = _parallel_launch(operands)
    if spec.segments.shape[0] == 1:
        key = _recipe_key(spec, operands, cos, sin, parallel)
        recipe = _recipes.get(key)
        if recipe is None:
            recipe = _recipes.put(key, _Recipe(spec, operands, cos, sin, parallel))
        return recipe.run(spec, operands, cos, sin, inverse, parallel)
    return _launch_entries(spec, operands, cos, sin, inverse, parallel)


def replay(spec, operands, cos, sin):
    """The kernel calls :func:`launch` made for these operands (after it), to make again for
    operands of the same layout without working them out anew: a function ``run(operands,
    cos, sin, inverse)`` that launches them and returns True, or returns False where the new
    operands' outputs stand elsewhere on the 16-byte grid, or threads may no longer be used
    (a forked child), which launch would decide otherwise. None where launch keeps nothing to
    replay (multi-axis tables), or no longer keeps it (its recipe dropped from the bounded
    store). ``cos`` and ``sin`` must have the recorded ones' layout."""
    if spec.segments.shape[0] != 1:
        return None
    parallel = _parallel_launch(operands)
    recipe = _recipes.get(_recipe_key(spec, operands, cos, sin, parallel))
    if recipe is None:
        return None
    grid = tuple(_arrays.pointer(out, NUMPY) % 16 for _, out, _ in operands)

    def run(operands, cos, sin, inverse):
        if parallel and not threads_usable():
            return False
        for (_, out, _), at in zip(operands, grid):
            if _arrays.pointer(out, NUMPY) % 16 != at:
                return False
        recipe.run(spec, operands, cos, sin, inverse, parallel)
        return True

    return run


def _recipe_key(spec, operands, cos, sin, parallel):
    key = (spec.rotary_dim, spec.half_style, parallel, cos.shape, cos.strides, cos.dtype)
    return key + (sin.strides,) + tuple(map(_operand_key, operands))


def _launch_entries(spec, operands, cos, sin, inverse, parallel):
    """launch for multi-axis tables: rows gathered per position entry where that reads less."""
    segments = spec.segments
    if operands[0][2].shape[-1] == 1:
        segments = ONE_RUN[spec.rotary_dim // 2]  # per-entry tables already
    elif segments.shape[0] > GATHER_ABOVE or all(
        entries(idx) * SHARED_BY <= x.size // x.shape[-1] for x, _, idx in operands
    ):
        operands, cos, sin = per_entry(spec.pair_axis, operands, cos, sin)
        segments = ONE_RUN[spec.rotary_dim // 2]
    d = operands[0][0].shape[-1]
    stream = _stream(spec, operands, segments, cos, sin)
    copy_tail = spec.rotary_dim < d and not all(out is x for x, out, _ in operands)
    pairs = [operands]
    block = max(1, _TABLE_BLOCK_BYTES // (2 * cos.shape[-1] * cos.itemsize))
    if segments.shape[0] == 1 and any(idx.size >= 2 * block for _, _, idx in operands):
        parts = [part for operand in operands for part in _chunked(operand, block, False)]
        pairs = [parts[at : at + 2] for at in range(0, len(parts), 2)]
    for pair in pairs:
        g = geometry(pair, flat=True)
        args = _flat_operands(pair, stream) + (g, cos, sin, segments)
        args += (spec.rotary_dim, d, spec.half_style, inverse, copy_tail)
        rows = _rows_of(pair)
        scratch = scratch_blocks(None if parallel else 1, rows, d, args[1].dtype, stream == SCRATCH)
        _run(KERNELS[stream][bool(spec.half_style)], args, scratch, rows, parallel)
    return stream


def _operand_key(operand):
    """What a launch's decisions read of one operand: its layout, whether it is rotated in
    place, and where its output stands on the 16-byte grid."""
    x, out, idx = operand
    at = _arrays.pointer(out, NUMPY) % 16
    return x.shape, x.strides, x.dtype, out is x, out.strides, at, idx.shape, idx.strides


# (what _operand_key and the tables' layout say of a launch) -> its _Recipe
_recipes = Bounded(256)


class _Recipe:
    """What :func:`launch` works out from a call's layout alone, once per layout: the way its
    results are stored, its kernel calls (one per pair of operands or of their table blocks:
    see _chunked) with their geometry and scratch size. Each call then takes flat views of its
    arrays and runs those kernel calls.

    A table block is addressed in the flat view of the whole operand: its geometry's offsets
    are shifted by where the block starts in it."""

    __slots__ = ("stream", "copy_tail", "calls")

    def __init__(self, spec, operands, cos, sin, parallel):
        segments = spec.segments
        d = operands[0][0].shape[-1]
        self.stream = stream = _stream(spec, operands, segments, cos, sin)
        self.copy_tail = spec.rotary_dim < d and not all(out is x for x, out, _ in operands)
        parts = list(enumerate(operands))
        block = max(1, _TABLE_BLOCK_BYTES // (2 * cos.shape[-1] * cos.itemsize))
        if any(idx.size >= 2 * block for _, _, idx in operands):
            parts = [(k, p) for k, operand in parts for p in _chunked(operand, block, False)]
        dtype = _flat_operands(operands[:1], stream)[1].dtype
        self.calls = []
        for at in range(0, len(parts), 2):
            pair = parts[at : at + 2]
            views = [view for _, view in pair]
            g = geometry(views, flat=True)
            shifts = [_shift(a, base) for k, view in pair for a, base in zip(view, operands[k])]
            if any(shifts):
                g = g.copy()
                g[: len(pair), 1:, -1] += np.array(shifts, np.int64).reshape(len(pair), 3)
            rows = _rows_of(views)
            blocks = scratch_blocks(None if parallel else 1, rows, d, dtype, stream == SCRATCH)
            members = (pair[0][0], pair[-1][0])
            self.calls.append((members, g, rows, blocks.shape))

    def run(self, spec, operands, cos, sin, inverse, parallel):
        stream, d = self.stream, operands[0][0].shape[-1]
        flats = [_flat_operands([operand], stream)[:3] for operand in operands]
        tail = (cos, sin, spec.segments, spec.rotary_dim, d, spec.half_style, inverse)
        tail += (self.copy_tail,)
        kernel = KERNELS[stream][bool(spec.half_style)]
        for (first, second), g, rows, shape in self.calls:
            args = flats[first] + flats[second] + (g,) + tail
            _run(kernel, args, np.empty(shape, args[1].dtype), rows, parallel)
        return stream


def _shift(a, base):
    """Elements from the first address of ``base``'s memory to the first of ``a``'s."""
    start = _arrays.pointer(a, NUMPY) + _arrays.span(a)[0]
    return (start - _arrays.pointer(base, NUMPY) - _arrays.span(base)[0]) // a.itemsize


def launch_filled(spec, operands, levels, inv_freq, scale, dtype, inverse):
    """Rotate one or two operands (as :func:`launch`) by the direct path with each position's
    row filled from the level tables (see ``_angles``) in the kernel: no per-call table.
    ``operands`` hold (x, out, positions) with positions as launch's idx, int64 in [0, 2**31),
    one axis. Each task (one per thread) fills the rows of a chunk of positions into a buffer
    of at most ``_FILL_BYTES`` and rotates every row at those positions before the next chunk
    (see :func:`_chunked`); a task that starts or ends inside a chunk fills its part of it.
    Returns the way results were stored (DIRECT, VECTOR, VECTOR_AHEAD, CHUNKED or
    CHUNKED_PLAIN), or 0, with nothing written, where the direct path cannot take the
    operands."""
    parallel = _parallel_launch(operands)
    tasks = numba.get_num_threads() if parallel else 1  # one per thread: a buffer each
    row_bytes = 2 * inv_freq.size * dtype.itemsize
    rows = max(1, min(_FILL_BYTES, _ALL_FILL_BYTES // tasks) // row_bytes)
    rows = min(rows, max(idx.size // idx.shape[-1] for _, _, idx in operands))
    scratch = np.empty((tasks, 2, rows, inv_freq.size), dtype)
    segments = spec.segments
    stream = _filled_stream(spec, operands, segments, scratch[0, 0], scratch[0, 1])
    if not stream:
        return 0
    parts = [part for operand in operands for part in _chunked(operand, rows)]
    for at in range(0, len(parts), 2):
        pair = parts[at : at + 2]
        g = geometry(pair, flat=True)
        args = _flat_operands(pair, stream) + (g, levels, inv_freq, segments)
        args += (spec.rotary_dim, pair[0][0].shape[-1], spec.half_style, inverse, scale)
        _run(FILLED_KERNELS[stream][bool(spec.half_style)], args, scratch, _rows_of(pair), parallel)
    return stream


def _filled_stream(spec, operands, segments, cos, sin):
    """How :func:`launch_filled` stores results: DIRECT, VECTOR, VECTOR_AHEAD, CHUNKED or
    CHUNKED_PLAIN (as :func:`_stream` chooses among them, whatever Config.vector_rows says), or
    0 where none of those takes the operands."""
    if not STREAMING:
        return 0
    large = _streams(operands)
    if direct_path(spec, operands, segments, cos, sin):
        return DIRECT if _streams(operands, direct=True) else _plain(operands)
    steps = vector_steps(spec, operands, segments, cos, sin)
    if steps and _rows_on_grid(operands) and _chunks_hold(spec, operands):
        return CHUNKED if large else CHUNKED_PLAIN
    return 0


# Bytes of a task's buffer of filled rows (see launch_filled). Its rows are a chunk's positions,
# and each head's rows at them are one run in memory: the longer the runs, the closer the loop
# comes to a copy's streaming (runs of tens of KiB per head, a buffer in the first-level cache,
# fall well short of it). Half a megabyte stays in the core's second-level cache beside the
# rows streaming through it, where a buffer of a megabyte or more is partly evicted before the
# last head has read it; on many threads, the buffers together take at most _ALL_FILL_BYTES.
_FILL_BYTES = 512 << 10
_ALL_FILL_BYTES = 16 << 20


# Bytes of cos/sin table rows that a table call (see launch) takes through every head before the
# next positions' rows, where the heads are outer in memory: they stay in the core's
# second-level cache while the heads read them. A call over all its positions per head reads
# each row once per head from farther out, which on CPUs whose cores are bound by the memory
# requests each keeps in flight costs nearly as much as reading x (a float32 cos/sin row holds
# as many bytes as a float32 row of x, twice a float16 or bfloat16 row's). Blocks of a few
# hundred rows keep each head's run long enough to stream.
_TABLE_BLOCK_BYTES = 256 << 10


def _chunked(operand, rows, filled=True):
    """An operand (x, out, positions) as views in the order the filled direct path takes its
    rows: along the longest axis on which the positions vary, chunks of ``rows`` rows, each
    chunk's rows at every index of the axes along which the positions broadcast (the heads,
    mostly) before the next chunk; then the rows past the last whole chunk, the broadcast axes
    innermost. Each position's row is then filled once, and each run of rows is read and
    written in address order. Where the broadcast axes are the inner ones in memory already
    (tokens by heads: (T, H, d), (B, T, H, d)), the operand as it is: each position's rows are
    one run, its row filled once for them.

    Not ``filled`` (table rows, which launch reads rather than fills): chunks along the
    innermost axis on which the positions vary (so that each head's rows of a chunk are one run
    in address order), the rows past the last whole chunk in the operand's order, and the
    operand as it is where that axis holds fewer than two chunks (its rows stay in cache as
    they are)."""
    x, out, idx = operand
    lead = range(x.ndim - 1)
    shared = [a for a in lead if idx.shape[a] == 1 and x.shape[a] > 1]
    varying = [a for a in lead if a not in shared]
    if not shared or not varying or _inner(shared, varying, x) and _inner(shared, varying, out):
        return [operand]
    if filled:
        axis = max(varying, key=lambda a: (x.shape[a], a))
    else:
        axis = min((a for a in varying if x.shape[a] > 1), key=lambda a: abs(x.strides[a]))
    chunks = x.shape[axis] // rows if rows > 1 else 0
    if not filled and chunks < 2:
        return [operand]
    cut = chunks * rows
    arrays = (x, out, idx) if out is not x else (x, idx)
    parts = []
    if chunks:
        shift = [a + (a > axis) for a in lead]
        order = [shift[a] for a in varying if a != axis] + [axis]
        order += [shift[a] for a in shared] + [axis + 1, x.ndim]
        split = [_split(a[_along(axis, 0, cut)], axis, rows).transpose(order) for a in arrays]
        parts.append(_operand(split))
    if cut < x.shape[axis]:
        order = varying + shared + [x.ndim - 1] if filled else list(range(x.ndim))
        parts.append(_operand([a[_along(axis, cut, None)].transpose(order) for a in arrays]))
    return parts


def _inner(shared, varying, a):
    """Whether every axis of ``shared`` steps through less of ``a``'s memory than every axis of
    ``varying`` with more than one index."""
    steps = [abs(a.strides[v]) for v in varying if a.shape[v] > 1]
    return not steps or max(abs(a.strides[v]) for v in shared) < min(steps)


def _along(axis, start, stop):
    return (slice(None),) * axis + (slice(start, stop),)


def _split(a, axis, rows):
    """``a`` with ``axis`` split into (chunks, rows): a view."""
    shape = a.shape[:axis] + (a.shape[axis] // rows, rows) + a.shape[axis + 1 :]
    step = a.strides[axis]
    strides = a.strides[:axis] + (step * rows, step) + a.strides[axis + 1 :]
    return np.lib.stride_tricks.as_strided(a, shape, strides, writeable=a.flags.writeable)


def _operand(arrays):
    """(x, out, idx) from views of x, out and idx, or of x and idx in place."""
    return tuple(arrays) if len(arrays) == 3 else (arrays[0], arrays[0], arrays[1])


def _stream(spec, operands, segments, cos, sin):
    """How :func:`launch` stores results: 0 (plain stores), SCRATCH, DIRECT, VECTOR,
    VECTOR_AHEAD, UNALIGNED, CHUNKED or CHUNKED_PLAIN."""
    if not STREAMING:
        return 0
    large = _streams(operands)
    if (large or _config.CONFIG.vector_rows) and direct_path(spec, operands, segments, cos, sin):
        return DIRECT if _streams(operands, direct=True) else _plain(operands)
    steps = vector_steps(spec, operands, segments, cos, sin)
    chunks = _rows_on_grid(operands) and _chunks_hold(spec, operands)
    if (large or _config.CONFIG.vector_rows) and steps and chunks:
        # rows on the grid, pair blocks off it: chunks on the grid (see _direct), which stream
        return CHUNKED if large else CHUNKED_PLAIN
    if _config.CONFIG.vector_rows and steps:
        # rows off the 16-byte grid: the vector steps with plain stores, which beat the general
        # loop's per-element pairs streamed out of a scratch block
        return UNALIGNED
    return SCRATCH if large else 0


def _plain(operands):
    """The direct path with plain stores: VECTOR_AHEAD where the operands (in place, say) hold
    at least as many bytes as the direct path streams from (see _config.streams_from), too
    large for the cache, else VECTOR."""
    size = sum(x.nbytes for x, _, _ in operands)
    return VECTOR_AHEAD if size >= _config.streams_from(operands[0][1].itemsize) else VECTOR


def _streams(operands, direct=False):
    """Whether the results are large enough for streaming stores: Config.stream_above bytes,
    or on the ``direct`` path (the vector steps) _config.streams_from's."""
    written = sum(out.nbytes for x, out, _ in operands if out is not x)
    itemsize = operands[0][1].itemsize
    limit = _config.streams_from(itemsize) if direct else _config.CONFIG.stream_above
    return written > 0 and written >= limit


def _flat_operands(operands, stream):
    """The kernels' (x, out, idx) arguments of both operands: flat views, the 2-byte dtypes as
    their bits, None for x in place (see below); one operand passed twice (the second has
    zero rows in the geometry)."""
    args = []
    for x, out, idx in operands:
        xf = flat_view(x)[0]
        of = xf if out is x else flat_view(out)[0]
        # float16 as int16 bits, bfloat16 (the only other 2-byte dtype that gets here) as uint16
        view = None if x.itemsize != 2 else np.int16 if x.dtype == _F16 else np.uint16
        if view is not None:
            xf = xf.view(view)
            of = xf if out is x else of.view(view)
        # In place, x is passed as None (a compile-time case), except to VECTOR, VECTOR_AHEAD
        # and UNALIGNED: their vector steps load a block before they store it, so in place and
        # other outputs share one compiled kernel there. (The general row loop needs None: see
        # _rows._row_views; DIRECT keeps an in-place operand of rotate_qk on plain stores by
        # it.)
        shared = out is x and stream in (VECTOR, VECTOR_AHEAD, UNALIGNED)
        args += (None if out is x and not shared else xf, of, flat_view(idx)[0])
    return tuple(args + args if len(operands) == 1 else args)


def _rows_of(operands):
    return sum(x.size // x.shape[-1] for x, _, _ in operands if x.shape[-1])


def _parallel_launch(operands):
    size = sum(x.size for x, _, _ in operands)
    return size >= _config.CONFIG.serial_below and threads_usable()


def _run(kernel, args, scratch, rows, parallel):
    if parallel:
        launch_parallel(kernel, args, scratch, rows)
    else:
        kernel(*args, scratch[0], 0, rows)


def vector_steps(spec, operands, segments, cos, sin):
    """Whether the direct path's vector steps can rotate these operands' rows with plain stores
    anywhere on the element grid (UNALIGNED): one run of pairs per row, table rows of unit
    stride with cos and sin laid out alike, and float16 converted by the CPU."""
    x = operands[0][0]
    if segments.shape[0] != 1 or (x.dtype == _F16 and not HARDWARE_F16):
        return False
    return cos.strides[-1] == cos.itemsize and sin.strides == cos.strides


def _rows_on_grid(operands):
    """Whether every output row starts on a 16-byte boundary and holds whole 16 bytes, with
    no output written in place (CHUNKED streams whole rows)."""
    for x, out, _ in operands:
        if out is x or (x.shape[-1] * x.itemsize) % 16 or _arrays.pointer(out, NUMPY) % 16:
            return False
        if any(s % 16 for n, s in zip(out.shape[:-1], out.strides[:-1]) if n > 1):
            return False
    return True


def _chunks_hold(spec, operands):
    """Whether the chunk walk takes these rows: all but the half style's 2-byte rows with more
    rotary elements than _paired.paired_row holds, where it takes them (see
    _ladder.takes_paired_row), which take the vector steps with plain stores instead."""
    item = operands[0][0].itemsize
    if not takes_paired_row(spec.half_style, item):
        return True
    return takes_paired_row(spec.half_style, item, spec.rotary_dim)


def direct_path(spec, operands, segments, cos, sin):
    """Whether the direct path (DIRECT, VECTOR or VECTOR_AHEAD) can write these outputs (in
    place too): one run of pairs per row, table rows of unit stride (its vector loads assume
    it) with cos and sin laid out alike (one offset addresses a row of both), a pair block, tail
    and every output row starting on a 16-byte boundary, and float16 converted by the CPU
    (F16C)."""
    x = operands[0][0]
    item = x.itemsize
    if segments.shape[0] != 1 or (x.dtype == _F16 and not HARDWARE_F16):
        return False
    if cos.strides[-1] != cos.itemsize or sin.strides != cos.strides:
        return False
    rotary_dim, d = spec.rotary_dim, x.shape[-1]
    block = rotary_dim // 2 if spec.half_style else rotary_dim
    if (block * item) % 16 or ((d - rotary_dim) * item) % 16:
        return False
    for _, out, _ in operands:
        if _arrays.pointer(out, NUMPY) % 16:
            return False
        if any(s % 16 for n, s in zip(out.shape[:-1], out.strides[:-1]) if n > 1):
            return False
    return True
