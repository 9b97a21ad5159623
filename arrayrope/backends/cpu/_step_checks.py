"""A step's checks and addresses in compiled calls (``RoPE.rotate_into_cache``): where NumPy
would take several calls each for the slots, the positions' bounds and the operands' addresses,
a decode step pays one."""

import numpy as np
from numba import njit

from ._config import DISK_CACHE

# Tokens up to which check_slots compares each slot with the ones before it (above, it sorts)
_PAIRWISE_BELOW = 64


@njit(cache=DISK_CACHE, nogil=True)
def check_slots(slots, capacity):
    """(0, 0) where every int64 slot is below ``capacity`` and each non-negative one is used
    once; else (1, the largest slot) or (2, a slot used twice): a decode step's checks in one
    call, where NumPy's take several."""
    n = slots.shape[0]
    high = np.int64(-1)
    for i in range(n):
        high = max(high, slots[i])
    if high >= capacity:
        return 1, high
    if n <= _PAIRWISE_BELOW:
        for i in range(n):
            slot = slots[i]
            if slot >= 0:
                for j in range(i):
                    if slots[j] == slot:
                        return 2, slot
    else:
        ordered = np.sort(slots)
        for i in range(1, n):
            if ordered[i] >= 0 and ordered[i] == ordered[i - 1]:
                return 2, ordered[i]
    return 0, np.int64(0)


@njit(cache=DISK_CACHE, nogil=True)
def bounds(values):
    """(lowest, highest) of a non-empty int64 array."""
    low = high = values[0]
    for i in range(1, values.shape[0]):
        low = min(low, values[i])
        high = max(high, values[i])
    return low, high


@njit(cache=DISK_CACHE, nogil=True)
def address_of(a):
    """The address of a[0, ..., 0]: a compiled call costs a fraction of NumPy's ctypes.data."""
    return a.ctypes.data


@njit(cache=DISK_CACHE, nogil=True)
def addresses(q, out, k, v, k_cache, v_cache):
    """The six operands' addresses (their bits views: see _bits_view), in one compiled call."""
    return (
        q.ctypes.data, out.ctypes.data, k.ctypes.data, v.ctypes.data, k_cache.ctypes.data,
        v_cache.ctypes.data,
    )  # fmt: skip


@njit(cache=DISK_CACHE, nogil=True)
def step_inputs(slots, pos, capacity):
    """A decode step's int64 slots and positions, copied (the caller's may change meanwhile:
    they are checked and used as one copy) and checked in one call: (check_slots' status and
    value, the positions' lowest and highest, the slots, the positions)."""
    slots, pos = slots.copy(), pos.copy()
    status, value = check_slots(slots, capacity)
    low, high = bounds(pos)
    return status, value, low, high, slots, pos
