"""Strided arrays as (flat buffer, element offset, element strides), shared by the kernels.

Kernels address element ``(i_0, ..., i_{L-1}, j)`` of an operand as
``flat[offset + sum(i_k * stride_k) + j]``: the leading axes may have any strides (views into a
fused QKV buffer, negative steps, broadcast zeros) and nothing is copied. The feature axis must be
contiguous; callers route other layouts through a contiguous temporary.
"""

import math

import numpy as np

from .. import _arrays
from .._cache import Bounded


def _as_strided(a):
    if _arrays.is_host(a):
        return np.lib.stride_tricks.as_strided
    from cupy.lib.stride_tricks import as_strided

    return as_strided


def flat_view(a):
    """A 1-D view over the memory ``a`` spans, and the element offset of ``a[0, ..., 0]`` in it.

    ``a`` must not be empty, and addressable (see ``_arrays.addressable``: the plan routes
    other layouts through a temporary before any kernel sees them).
    """
    if a.flags.c_contiguous:
        return a.reshape(-1), 0
    item = a.itemsize
    low, high = _arrays.span(a)
    # The view that starts at the lowest address: the last index along each descending axis.
    start = a[tuple(slice(n - 1, n) if s < 0 else slice(0, 1) for n, s in zip(a.shape, a.strides))]
    flat = _as_strided(a)(start, shape=((high - low) // item,), strides=(item,))
    return flat, -low // item


def _merged_axes(shape, strides):
    """The leading axes as a list of (size, (x, out, idx) strides), outermost first.

    Axes of size 1 are dropped, and an axis merges into the one before it where all three arrays
    step through the pair as through one axis: (B, H, T) of a contiguous x with positions (T,)
    becomes (B*H, T), so kernels decode fewer axes and run longer inner loops.
    """
    merged = []
    for k, n in enumerate(shape):
        if n == 1:
            continue
        steps = tuple(s[k] for s in strides)
        if merged and all(p == n * q for p, q in zip(merged[-1][1], steps)):
            merged[-1] = (merged[-1][0] * n, steps)
        else:
            merged.append((n, steps))
    return merged or [(1, (0, 0, 0))]


_geometry_cache = Bounded(256)


def geometry(operands, flat):
    """The int64 geometry of one or two (x, out, idx) operands, shape (2, 4, L + 1).

    Per operand t, in elements:
      g[t, 0, :L] leading sizes        g[t, 0, L] stride of idx's axes dimension (0: one axis)
      g[t, 1, :L] x strides            g[t, 1, L] x offset
      g[t, 2, :L] out strides          g[t, 2, L] out offset
      g[t, 3, :L] idx strides          g[t, 3, L] idx offset
    Offsets are into ``flat_view`` buffers when ``flat``, else 0 (addresses from element 0, with
    signed strides). L is at most the number of leading axes: see :func:`_merged_axes`. A
    missing second operand has zero rows. Memoized on shapes and strides.
    """
    key = (flat,) + tuple(
        (x.shape, x.strides, o.strides, i.shape, i.strides) for x, o, i in operands
    )
    g = _geometry_cache.get(key)
    if g is not None:
        return g
    per_operand = []
    for x, out, idx in operands:
        strides = [
            [s // x.itemsize for s in x.strides[:-1]],
            [s // out.itemsize for s in out.strides[:-1]],
            [0 if n == 1 else s // idx.itemsize for n, s in zip(idx.shape[:-1], idx.strides[:-1])],
        ]
        per_operand.append(_merged_axes(x.shape[:-1], strides))
    nlead = max(len(axes) for axes in per_operand)
    g = np.zeros((2, 4, nlead + 1), dtype=np.int64)
    for t, ((x, out, idx), axes) in enumerate(zip(operands, per_operand)):
        first = nlead - len(axes)
        g[t, 0, :first] = 1  # an operand with fewer axes starts with axes of size 1
        for k, (n, steps) in enumerate(axes):
            g[t, 0, first + k] = n
            g[t, 1:, first + k] = steps
        g[t, 0, nlead] = 0 if idx.shape[-1] == 1 else idx.strides[-1] // idx.itemsize
        if flat:
            g[t, 1, nlead] = flat_view(x)[1]
            g[t, 2, nlead] = flat_view(out)[1]
            g[t, 3, nlead] = flat_view(idx)[1]
    return _geometry_cache.put(key, g)


def tail_mask(rotary_dim, operands):
    """Bit t set where operand t's features past ``rotary_dim`` must be copied to its out:
    there are some, and the operand is not rotated in place."""
    mask = 0
    if rotary_dim < operands[0][0].shape[-1]:
        for t, (x, out, _) in enumerate(operands):
            mask |= (out is not x) << t
    return mask


def rows(g, t):
    """The number of rows of operand t."""
    return math.prod(g[t, 0, :-1].tolist())  # np.prod costs microseconds on a few items
