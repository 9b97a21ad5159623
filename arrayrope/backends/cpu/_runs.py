"""Runs of rows: where a row of an operand starts, decoded from the launch geometry (see
``backends._geometry``), for the row loops of _rows and _direct."""

import numpy as np
from numba import njit


@njit(inline="always")
def run_start(g, row):
    """Offsets (x, out, idx) of row ``row`` of the operand whose geometry block is ``g``, and how
    many rows from it on share its run along the innermost leading axis, where the offsets
    advance by constant strides. The loops decode the leading index (int64 divisions) once per
    run: per-row index bookkeeping would cost as much as rotating a float32 row in cache."""
    nlead = g.shape[1] - 1
    xb = g[1, nlead]
    ob = g[2, nlead]
    pb = g[3, nlead]
    rem = np.int64(row)
    left = np.int64(0)
    for ax in range(nlead - 1, -1, -1):
        i = rem % g[0, ax]
        rem //= g[0, ax]
        if ax == nlead - 1:
            left = g[0, ax] - i
        xb += i * g[1, ax]
        ob += i * g[2, ax]
        pb += i * g[3, ax]
    return xb, ob, pb, left
