"""Strided arrays as (flat buffer, element offset, element strides), shared by the kernels.

Kernels address element ``(i_0, ..., i_{L-1}, j)`` of an operand as
``flat[offset + sum(i_k * stride_k) + j]``: the leading axes may have any strides (views into a
fused QKV buffer, negative steps, broadcast zeros) and nothing is copied. The feature axis must be
contiguous; callers route other layouts through a contiguous temporary.
"""

import numpy as np


def flat_view(a):
    """A 1-D view over the memory ``a`` spans, and the element offset of ``a[0, ..., 0]`` in it.

    Returns None when a stride is not a whole number of elements. ``a`` must not be empty.
    """
    if a.flags.c_contiguous:
        return a.reshape(-1), 0
    item = a.itemsize
    if any(s % item for s in a.strides):
        return None
    low = high = 0
    for n, s in zip(a.shape, a.strides):
        if s < 0:
            low += (n - 1) * s
        else:
            high += (n - 1) * s
    # The view that starts at the lowest address: the last index along each descending axis.
    start = a[tuple(slice(n - 1, n) if s < 0 else slice(0, 1) for n, s in zip(a.shape, a.strides))]
    span = (high - low) // item + 1
    flat = np.lib.stride_tricks.as_strided(start, shape=(span,), strides=(item,))
    return flat, -low // item


def element_strides(a, ndim):
    """The strides of the first ``ndim`` axes of ``a``, in elements."""
    item = a.itemsize
    return [s // item for s in a.strides[:ndim]]
