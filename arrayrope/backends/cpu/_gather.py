"""Multi-axis layouts on the CPU: cos/sin rows gathered once per position entry.

A layout whose pairs change position axis every pair or two (Qwen3-VL) leaves the row loops no
length to vectorize, and short runs leave vector remainders. Entries are position tuples
(tokens), shared by every head, so gathering one table row per entry costs a fraction of the
rotation, which then reads one row per entry as one run.
"""

import numpy as np
from numba import njit, prange

from . import _config
from ._config import DISK_CACHE, run_parallel, threads_usable

# Gather when a layout has more runs of pairs than this, or when at least _SHARED_BY rows share
# each position entry (heads sharing a token's positions).
GATHER_ABOVE = 4
SHARED_BY = 8


def entries(idx):
    """The number of distinct position entries of idx: its non-broadcast leading extent."""
    count = 1
    for n, s in zip(idx.shape[:-1], idx.strides[:-1]):
        if s != 0:
            count *= n
    return count


@njit(inline="always")
def _gather_row(cos, sin, idx, pair_axis, row_cos, row_sin, r):
    """Fill row r of the per-entry tables."""
    for j in range(pair_axis.shape[0]):
        p = idx[r, pair_axis[j]]
        row_cos[r, j] = cos[p, j]
        row_sin[r, j] = sin[p, j]


@njit(cache=DISK_CACHE)
def gather_tables(cos, sin, idx, pair_axis):
    """Per-entry tables: row r holds, for every pair j, ``cos[idx[r, pair_axis[j]], j]``.

    One thread; :func:`gather_tables_parallel` for many entries.
    """
    row_cos = np.empty((idx.shape[0], pair_axis.shape[0]), dtype=cos.dtype)
    row_sin = np.empty((idx.shape[0], pair_axis.shape[0]), dtype=sin.dtype)
    for r in range(idx.shape[0]):
        _gather_row(cos, sin, idx, pair_axis, row_cos, row_sin, r)
    return row_cos, row_sin


@njit(cache=DISK_CACHE, parallel=True)
def gather_tables_parallel(cos, sin, idx, pair_axis):
    """:func:`gather_tables` on every thread."""
    row_cos = np.empty((idx.shape[0], pair_axis.shape[0]), dtype=cos.dtype)
    row_sin = np.empty((idx.shape[0], pair_axis.shape[0]), dtype=sin.dtype)
    for r in prange(idx.shape[0]):
        _gather_row(cos, sin, idx, pair_axis, row_cos, row_sin, r)
    return row_cos, row_sin


class _OneRun(dict):
    """The segment table of a single run of ``pairs`` pairs, built once per size: read-only,
    as a RoPE's own (``Spec.segments``), so that the kernels take one build for both."""

    def __missing__(self, pairs):
        run = self[pairs] = np.array([[0, pairs, 0]], dtype=np.int64)
        run.flags.writeable = False
        return run


ONE_RUN = _OneRun()


def per_entry(pair_axis, operands, cos, sin):
    """The operands re-pointed at per-entry tables gathered from (cos, sin), and those tables.

    Entries are the compact position entries: axes along which positions are broadcast (size 1
    or stride 0) are read once. q and k passing one position array share its tables.
    """
    cos_parts, sin_parts, entries_of, result = [], [], {}, []
    count = 0
    for x, out, idx in operands:
        if id(idx) not in entries_of:
            compact = idx[tuple(slice(0, 1) if s == 0 else slice(None) for s in idx.strides)]
            flat = np.ascontiguousarray(compact).reshape(-1, idx.shape[-1])
            # one thread for a few entries (a decode step), as for the rotation itself
            many = flat.shape[0] * pair_axis.shape[0] >= _config.CONFIG.serial_below
            if many and threads_usable():
                tables = run_parallel(gather_tables_parallel, cos, sin, flat, pair_axis)
            else:
                tables = gather_tables(cos, sin, flat, pair_axis)
            row_cos, row_sin = tables
            cos_parts.append(row_cos)
            sin_parts.append(row_sin)
            entries = np.arange(count, count + flat.shape[0], dtype=np.int64)
            entries_of[id(idx)] = entries.reshape(compact.shape[:-1] + (1,))
            count += flat.shape[0]
        result.append((x, out, entries_of[id(idx)]))
    if len(cos_parts) == 1:
        return result, cos_parts[0], sin_parts[0]
    return result, np.concatenate(cos_parts), np.concatenate(sin_parts)
