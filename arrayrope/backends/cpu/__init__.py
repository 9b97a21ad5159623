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

import numpy as np

from ... import _arrays
from ..._arrays import NUMPY
from .._geometry import flat_view, geometry
from . import (
    _angles,
    _config,
    _convert,
    _decode,
    _direct,
    _disk_cache,
    _fused,
    _gather,
    _parallel,
    _rows,
    _runs,
)
from ._config import HARDWARE_F16, STREAMING, threads_usable
from ._fused import launch as launch_fused
from ._gather import GATHER_ABOVE, ONE_RUN, SHARED_BY, entries, per_entry
from ._parallel import launch_parallel, scratch_blocks
from ._rows import DIRECT, FILLED_KERNELS, KERNELS, SCRATCH, VECTOR
from ._rows_plan import rows_plan

_disk_cache.guard(_angles, _convert, _decode, _direct, _fused, _gather, _parallel, _rows, _runs)

__all__ = ["launch", "launch_filled", "launch_fused", "rows_plan"]

_F16 = np.dtype(np.float16)


def launch(spec, operands, cos, sin, inverse):
    """Rotate one or two operands (q and k) in one kernel call: the general strategy. Returns
    how the results were stored (0: plain stores; SCRATCH, DIRECT or VECTOR).

    ``operands`` holds (x, out, idx) triples: x and out of shape (L leading..., d), addressable
    (see ``_arrays.addressable``), ``out is x`` for in place; idx int64 of shape (L axes of
    size 1 or matching..., n_axes or 1), rows of ``cos``/``sin``.
    """
    segments = spec.segments
    if segments.shape[0] > 1:
        if operands[0][2].shape[-1] == 1:
            segments = ONE_RUN[spec.rotary_dim // 2]  # per-entry tables already
        elif segments.shape[0] > GATHER_ABOVE or all(
            entries(idx) * SHARED_BY <= x.size // x.shape[-1] for x, _, idx in operands
        ):
            operands, cos, sin = per_entry(spec.pair_axis, operands, cos, sin)
            segments = ONE_RUN[spec.rotary_dim // 2]
    g = geometry(operands, flat=True)
    d = operands[0][0].shape[-1]
    stream = _stream(spec, operands, segments, cos, sin)
    copy_tail = spec.rotary_dim < d and not all(out is x for x, out, _ in operands)
    args = _flat_operands(operands, stream) + (g, cos, sin, segments)
    args += (spec.rotary_dim, d, spec.half_style, inverse, copy_tail)
    rows = _rows_of(operands)
    parallel = _parallel_launch(operands)
    scratch = scratch_blocks(None if parallel else 1, rows, d, args[1].dtype, stream == SCRATCH)
    _run(KERNELS[stream], args, scratch, rows, parallel)
    return stream


def launch_filled(spec, operands, levels, inv_freq, scale, dtype, inverse):
    """Rotate one or two operands (as :func:`launch`) by the direct path with each position's
    row filled from the level tables (see ``_angles``) in the kernel, once per run of rows at
    that position, into a one-row block per task: no per-call table. ``operands`` hold
    (x, out, positions) with positions as launch's idx, int64 in [0, 2**31), one axis; the
    caller orders the leading axes so that rows at one position are adjacent. Returns the way
    results were stored (DIRECT or VECTOR), or 0, with nothing written, where the direct path
    cannot take the operands."""
    row = np.empty((2, 1, inv_freq.size), dtype)
    segments = spec.segments
    if not STREAMING or not direct_path(spec, operands, segments, row[0], row[1]):
        return 0
    g = geometry(operands, flat=True)
    stream = DIRECT if _streams(operands) else VECTOR
    args = _flat_operands(operands, stream) + (g, levels, inv_freq, segments)
    args += (spec.rotary_dim, operands[0][0].shape[-1], spec.half_style, inverse, scale)
    rows = _rows_of(operands)
    parallel = _parallel_launch(operands)
    tasks = scratch_blocks(None if parallel else 1, rows, 1, dtype, False).shape[0]
    _run(FILLED_KERNELS[stream], args, np.empty((tasks,) + row.shape, dtype), rows, parallel)
    return stream


def _stream(spec, operands, segments, cos, sin):
    """How :func:`launch` stores results: 0 (plain stores), SCRATCH, DIRECT or VECTOR."""
    if not STREAMING:
        return 0
    large = _streams(operands)
    if (large or _config.CONFIG.vector_rows) and direct_path(spec, operands, segments, cos, sin):
        return DIRECT if large else VECTOR
    return SCRATCH if large else 0


def _streams(operands):
    """Whether the results are large enough for streaming stores (see Config.stream_above)."""
    written = sum(out.nbytes for x, out, _ in operands if out is not x)
    return written > 0 and written >= _config.CONFIG.stream_above


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
        # In place, x is passed as None (a compile-time case), except to VECTOR: its vector
        # steps load a block before they store it, so in place and smaller outputs share one
        # compiled kernel there. (The general row loop needs None: see _rows._row_views; DIRECT
        # keeps an in-place operand of rotate_qk on plain stores by it.)
        shared = out is x and stream == VECTOR
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


def direct_path(spec, operands, segments, cos, sin):
    """Whether the direct path (DIRECT or VECTOR) can write these outputs (in place too): one
    run of pairs per row, table rows of unit stride (its vector loads assume it) with cos and
    sin laid out alike (one offset addresses a row of both), a pair block, tail and every output
    row starting on a 16-byte boundary, and float16 converted by the CPU (F16C)."""
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
