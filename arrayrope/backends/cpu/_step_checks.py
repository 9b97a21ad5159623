"""A step's checks in compiled code (``RoPE.rotate_into_cache``): where NumPy would take
several calls each for the slots and the positions' bounds, a decode step pays none (the fused
launch runs them)."""

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
