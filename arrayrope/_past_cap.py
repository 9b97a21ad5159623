"""NumPy calls whose integer positions reach past the cos/sin cache's cap: rotated with no
per-call table as large as the call. Two routes, tried in order by ``GeneralPlan``:
:func:`filled` (each position's row made inside the CPU kernel) and :func:`in_blocks` (per-call
rows a block of positions at a time, for what the first cannot take)."""

import numpy as np

from . import _arrays
from ._tables import checked_rows

# The most bytes of per-call cos/sin rows a call makes at once (see in_blocks): they fit a
# core's share of the cache beside the data streaming by.
BLOCK_BYTES = 1 << 20


def filled(plan, xs, resolved, tables, inverse, results, in_place):
    """Rotate into ``results`` by the CPU's direct path with each position's row filled from
    the level tables inside the kernel (``backends.cpu.launch_filled``): no per-call rows, and
    each row made once per chunk of positions for all the rows at it (the heads). False, with
    nothing written, where that path cannot take the call (a multi-axis RoPE, transformers'
    tables, another backend, a layout the direct path refuses)."""
    if plan.launch_filled is None or plan.spec.n_axes != 1 or not tables.filled:
        return False
    operands, write_back = [], []
    for x, out, (values, _, _), same in zip(xs, results, resolved, in_place):
        if x.size:
            operands.append(plan.operand(x, out, values, same, write_back))
    if not operands:
        return True
    _, inv_freq, levels = tables.level_arrays()
    args = (levels, inv_freq, tables.scale, plan.table_dtype, inverse)
    if not plan.launch_filled(plan.spec, operands, *args):
        return False
    for temp, out in write_back:
        _arrays.assign(out, temp)
    return True


def in_blocks(plan, xs, resolved, tables, inverse, results, in_place):
    """Rotate into ``results`` through per-call rows a block of positions at a time: each
    operand split along the longest axis of its positions into blocks whose rows take at
    most ``BLOCK_BYTES`` (they are still in cache when the kernel reads them), each block's
    rows filled and rotated in turn. The memory of the rows stays bounded at any length."""
    row_bytes = 2 * tables.inv_freq.size * plan.table_dtype.itemsize
    block_rows = max(1, BLOCK_BYTES // max(row_bytes, 1))
    write_back = []
    for x, out, (values, _, _), same in zip(xs, results, resolved, in_place):
        if x.size == 0:
            continue
        lead = x.shape[:-1]
        # positions with one axis per leading axis of x (size 1 where they broadcast)
        values = values.reshape((1,) * (len(lead) + 1 - values.ndim) + values.shape)
        axis = int(np.argmax(values.shape[:-1])) if len(lead) else 0
        length = values.shape[axis] if len(lead) else 1
        per_step = values.size // values.shape[-1] // max(length, 1)
        step = max(1, block_rows // max(per_step, 1))
        for start in range(0, length, step):
            part = (slice(None),) * axis + (slice(start, start + step),)
            xb = x[part] if len(lead) else x
            ob = xb if out is x else (out[part] if len(lead) else out)
            vb = values[part] if len(lead) else values
            rows = checked_rows(tables, plan.table_dtype, vb.reshape(-1, vb.shape[-1]))
            idx = np.arange(rows.shape[1], dtype=np.int64).reshape(vb.shape[:-1] + (1,))
            operand = plan.operand(xb, ob, idx, same, write_back)
            plan.launch(plan.spec, [operand], rows[0], rows[1], inverse)
    for temp, out in write_back:
        _arrays.assign(out, temp)
