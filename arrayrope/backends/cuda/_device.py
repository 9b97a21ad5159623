"""Small host arrays kept on each CUDA device, so that a call copies nothing to the device that
an earlier call already copied (launch geometry, pair axes, default and scalar positions).

A host-to-device copy costs microseconds and, from pageable memory, waits for the copy engine:
on the decode path that would be most of a call's host time.
"""

import numpy as np

from ..._cache import Bounded
from ..._positions import is_default

_kept = Bounded(512)
_ZERO = np.zeros((1, 1), dtype=np.int64)


def on_device(cupy, device, key, host):
    """``host`` (a small NumPy array, or a function that makes it, called only when needed) on
    device ``device`` (an id; the current one), copied the first time ``key`` is asked for
    there. ``key`` must identify the contents."""
    key = (device, key)
    found = _kept.get(key)
    if found is None:
        found = _kept.put(key, cupy.asarray(host() if callable(host) else host))
    return found


def device_rows(cupy, device, idxs, cos, sin):
    """Row indices on the current device, one per operand, and the tables they index. Default
    positions (an arange arrayrope keeps) are copied once per device; a single position shared
    by every operand is a zero row index into its own row of the tables (a view), so a decode
    step copies nothing to the device. Any other host idx is copied; device positions are
    copied only where their start is not aligned to their element size, which a GPU's typed
    loads require."""
    first = idxs[0]
    if all(idx is first for idx in idxs) and isinstance(first, np.ndarray):
        if first.shape == (1, 1) and not is_default(first):
            p = int(first[0, 0])
            zero = on_device(cupy, device, "zero", _ZERO)
            return [zero] * len(idxs), cos[p : p + 1], sin[p : p + 1]
    return [_on_device(cupy, device, idx) for idx in idxs], cos, sin


def _on_device(cupy, device, idx):
    if not isinstance(idx, np.ndarray):
        return idx.copy() if idx.data.ptr % idx.itemsize else idx
    if is_default(idx):
        return on_device(cupy, device, ("arange", idx.shape[0]), idx)
    return cupy.asarray(idx)
