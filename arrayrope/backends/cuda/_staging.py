"""How host arrays reach a CUDA device without making the host wait.

- Small host arrays made once (launch geometry, pair axes, frequencies, level tables, default
  and scalar positions) are copied once per device and kept (:func:`on_device`).
- Any other host array a call needs there (host positions, their exact table rows) goes through
  a pinned staging buffer: a copy from pinned memory is queued on the current stream and the
  host goes on, where a copy from pageable memory waits (:func:`upload`).

Changes here are checked by tests/test_cupy_on_host.py on the stand-in and by
tests/test_gpu.py and bench/gpu_check.py on a GPU.
"""

import threading

import numpy as np

from ... import _arrays
from ..._cache import Bounded
from ..._errors import RopeValueError
from ..._positions import is_default
from ._capture import capturing

_kept = Bounded(512)
# The level tables of rows past a device's table (4.5 MiB at rotary_dim 128), by frequencies:
# few, so that frequency sets made per length (DynamicNTK) do not pile them up on a device.
_levels = Bounded(8)
_ZERO = np.zeros((1, 1), dtype=np.int64)


def on_device(cupy, device, key, host):
    """``host`` (a NumPy array made once, or a function that makes it, called only when needed)
    on device ``device`` (an id; the current one), copied the first time ``key`` is asked for
    there. ``key`` must identify the contents; keys starting with "levels" (level tables) are
    kept in a store of their own, of a few entries."""
    store = _levels if key[0] == "levels" else _kept
    key = (device, key)
    found = store.get(key)
    if found is None:
        if capturing(cupy):  # the copy would be a node of the graph, not run now
            raise RopeValueError(
                "the current stream is capturing a CUDA graph, and this call needs arrays "
                "arrayrope has not copied to the device yet (launch geometry, default "
                "positions): make the same call once before capturing"
            )
        found = store.put(key, cupy.asarray(host() if callable(host) else host))
    return found


def kept(a):
    """Whether the device array ``a`` is one :func:`on_device` keeps, or a view of one."""
    return any(a is v or getattr(a, "base", None) is v for v in list(_kept.values()))


# Pinned staging buffers: per device, a list of [buffer, capacity, event of its last copy].
# A buffer is written again only once its event says the copy out of it has run, so a stream
# that runs behind never reads a buffer refilled under it. At most _STAGED buffers per device;
# past that the host waits for the oldest copy.
_buffers = {}  # registry, never dropped while the process runs: a copy may still read one
_buffers_lock = threading.Lock()
_STAGED = 32
_MIN_STAGE = 4096
_STAGE_LIMIT = 1 << 20  # larger copies go through cupy.asarray


def upload(cupy, device, host):
    """A device copy of the NumPy array ``host``, queued on the current stream from pinned
    memory: the host does not wait for it (above _STAGE_LIMIT bytes, CuPy's own copy, which
    stages through CuPy's pinned pool). Refused during graph capture, where the copy would be
    replayed from a buffer arrayrope reuses."""
    if capturing(cupy):
        raise RopeValueError(
            "pos needs a copy from the host (a host position array, or the cos/sin rows of "
            "positions past the table), and the current stream is capturing a CUDA graph: a "
            "replay would copy again from a buffer arrayrope reuses. Pass int64 positions on "
            "the device (read when the graph runs), or an int inside the table"
        )
    host = np.ascontiguousarray(host)
    if host.nbytes > _STAGE_LIMIT:
        return cupy.asarray(host)
    stream = cupy.cuda.get_current_stream()
    nbytes = max(host.nbytes, 1)
    with _buffers_lock:
        slots = _buffers.setdefault(device, [])
        slot = next((s for s in slots if s[1] >= nbytes and (s[2] is None or s[2].done)), None)
        if slot is None and len(slots) >= _STAGED:
            slot = slots[0]
            slot[2].synchronize()  # every buffer is in flight: wait for the oldest
            if slot[1] < nbytes:
                slot[:2] = _pinned(cupy, nbytes)
        elif slot is None:
            slot = [*_pinned(cupy, nbytes), None]
            slots.append(slot)
        slots[:] = [s for s in slots if s is not slot] + [slot]  # oldest copy first
        staged = np.frombuffer(slot[0], np.uint8, host.nbytes)
        staged[:] = host.reshape(-1).view(np.uint8)
        result = cupy.empty(host.shape, host.dtype)
        result.set(staged.view(host.dtype).reshape(host.shape), stream=stream)
        event = cupy.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
        slot[2] = event
    return result


def _pinned(cupy, nbytes):
    capacity = max(_MIN_STAGE, 1 << (nbytes - 1).bit_length())
    return cupy.cuda.alloc_pinned_memory(capacity), capacity


def device_rows(cupy, device, idxs, cos, sin):
    """Row indices on the current device, one per operand, and the tables they index. Default
    positions (an arange arrayrope keeps) are copied once per device; a single position shared
    by every operand is a zero row index into its own row of the tables (a view), so a decode
    step copies nothing to the device. Other host arrays (positions, exact table rows) go
    through :func:`upload`; device positions are copied only where their start is not aligned
    to their element size, which a GPU's typed loads require."""
    first = idxs[0]
    if all(idx is first for idx in idxs) and _arrays.is_host(first):
        if first.shape == (1, 1) and not is_default(first):
            p = int(first[0, 0])
            zero = on_device(cupy, device, "zero", _ZERO)
            return (
                [zero] * len(idxs),
                _on_device(cupy, device, cos[p : p + 1]),
                _on_device(cupy, device, sin[p : p + 1]),
            )
    rows = []
    for idx in idxs:
        same = next((i for i, seen in enumerate(idxs[: len(rows)]) if seen is idx), None)
        rows.append(rows[same] if same is not None else _on_device(cupy, device, idx))
    return rows, _on_device(cupy, device, cos), _on_device(cupy, device, sin)


def _on_device(cupy, device, a):
    if not _arrays.is_host(a):
        return _arrays.copy(a) if _arrays.address(a) % a.itemsize else a
    if is_default(a):
        return on_device(cupy, device, ("arange", a.shape[0]), a)
    return upload(cupy, device, a)
