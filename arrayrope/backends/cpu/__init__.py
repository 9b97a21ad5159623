"""The CPU backend: Numba kernels for NumPy arrays, and the policy that picks how each call runs.

Two launch strategies, chosen by the plan:
- rows (``_decode.rows_kernel``): one thread, the arrays taken as they are, for decode- and
  prefill-sized inputs with one position axis and positions in a row pattern;
- general (:func:`launch`): flat views and operand geometry, q and k in one call, on one thread
  or in parallel tasks, with streaming or plain stores, multi-axis tables gathered per entry.
"""

import numba
import numpy as np

from .._geometry import flat_view, geometry
from . import (
    _angles,
    _config,
    _convert,
    _decode,
    _direct,
    _disk_cache,
    _gather,
    _parallel,
    _rows,
    _runs,
)
from ._config import HARDWARE_F16, STREAMING, threads_usable
from ._decode import DONE, POSITION_OUTSIDE_TABLE, SPANS_OVERLAP, rows_kernel, settings
from ._gather import GATHER_ABOVE, ONE_RUN, SHARED_BY, entries, per_entry
from ._parallel import launch_parallel, scratch_blocks
from ._rows import DIRECT, KERNELS, SCRATCH, VECTOR

_disk_cache.guard(_angles, _convert, _decode, _direct, _gather, _parallel, _rows, _runs)

__all__ = [
    "DONE",
    "POSITION_OUTSIDE_TABLE",
    "SPANS_OVERLAP",
    "launch",
    "rows_entry",
    "settings",
    "small_below",
]

_F16 = np.dtype(np.float16)


def small_below():
    """Inputs (q and k together) below this many elements may take the rows strategy."""
    return _config.CONFIG.small_below


def rows_entry(*args):
    """The compiled entry point of the row kernel (see ``_decode.rows_kernel``) for the Numba
    types of ``args`` (compiled, or loaded from the disk cache, the first time): the caller
    promises every later call passes arguments of exactly these types, and skips the
    dispatcher's type resolution."""
    return rows_kernel(args[1].dtype).compile(tuple(numba.typeof(a) for a in args))


def launch(spec, operands, cos, sin, inverse):
    """Rotate one or two operands (q and k) in one kernel call: the general strategy. Returns
    how the results were stored (0: plain stores; SCRATCH, DIRECT or VECTOR).

    ``operands`` holds (x, out, idx) triples: x and out of shape (L leading..., d), addressable
    (see ``_arrays.addressable``), ``out is x`` for in place; idx int64 of shape (L axes of
    size 1 or matching..., n_axes or 1), rows of ``cos``/``sin``.
    """
    config = _config.CONFIG
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
    size = operands[0][0].size + (operands[1][0].size if len(operands) == 2 else 0)
    d = operands[0][0].shape[-1]
    written = sum(out.nbytes for x, out, _ in operands if out is not x)
    stream = 0
    if STREAMING:
        large = written > 0 and written >= config.stream_above
        if (large or config.vector_rows) and direct_path(spec, operands, segments, cos, sin):
            stream = DIRECT if large else VECTOR
        elif large:
            stream = SCRATCH
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
    if len(operands) == 1:
        args += args  # the second operand has zero rows in g
    copy_tail = spec.rotary_dim < d and not all(out is x for x, out, _ in operands)
    args += (g, cos, sin, segments, spec.rotary_dim, d, spec.half_style, inverse, copy_tail)
    rows = size // d if d else 0
    kernel = KERNELS[stream]
    parallel = size >= config.serial_below and threads_usable()
    scratch = scratch_blocks(None if parallel else 1, rows, d, args[1].dtype, stream == SCRATCH)
    if parallel:
        launch_parallel(kernel, tuple(args), scratch, rows)
    else:
        kernel(*args, scratch[0], 0, rows)
    return stream


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
        if out.__array_interface__["data"][0] % 16:
            return False
        if any(s % 16 for n, s in zip(out.shape[:-1], out.strides[:-1]) if n > 1):
            return False
    return True
