"""Small host arrays kept on each CUDA device, so that a call copies nothing to the device that
an earlier call already copied (launch geometry, pair axes, default and scalar positions).

A host-to-device copy costs microseconds and, from pageable memory, waits for the copy engine:
on the decode path that would be most of a call's host time.
"""

_kept = {}


def on_device(cupy, device, key, host):
    """``host`` (a small NumPy array, or a function that makes it, called only when needed) on
    device ``device`` (an id; the current one), copied the first time ``key`` is asked for
    there. ``key`` must identify the contents."""
    key = (device, key)
    found = _kept.get(key)
    if found is None:
        if len(_kept) > 512:
            _kept.clear()
        found = _kept[key] = cupy.asarray(host() if callable(host) else host)
    return found
