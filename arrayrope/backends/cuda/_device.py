"""What a call keeps on each CUDA device, and how it gets there without making the host wait.

- Small host arrays (launch geometry, pair axes, frequencies, default and scalar positions) are
  copied once per device and kept (:func:`on_device`).
- Any other host array a call needs there (host positions, their exact table rows) goes through
  a pinned staging buffer: a copy from pinned memory is queued on the current stream and the
  host goes on, where a copy from pageable memory waits (:func:`upload`).
- Positions on the device are checked there, by the kernels: an invalid one (negative, 2**31 or
  more, not finite) gives NaN for its rows and sets the device's error flag, a word of pinned
  host memory the kernels write directly. The host reads it at the next call on that device and
  raises there (:func:`raise_flagged`): reading it at once would mean waiting for the kernel.
  An error no call raised is a warning at exit.
"""

import atexit
import threading
import warnings

import numpy as np

from ..._cache import Bounded
from ..._errors import RopeValueError
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
        if capturing(cupy):  # the copy would be a node of the graph, not run now
            raise RopeValueError(
                "the current stream is capturing a CUDA graph, and this call needs arrays "
                "arrayrope has not copied to the device yet (launch geometry, default "
                "positions): make the same call once before capturing"
            )
        found = _kept.put(key, cupy.asarray(host() if callable(host) else host))
    return found


def kept(a):
    """Whether the device array ``a`` is one :func:`on_device` keeps, or a view of one."""
    return any(a is v or getattr(a, "base", None) is v for v in list(_kept.values()))


# Pinned staging buffers: per device, a list of [buffer, capacity, event of its last copy].
# A buffer is written again only once its event says the copy out of it has run, so a stream
# that runs behind never reads a buffer refilled under it. At most _STAGED buffers per device;
# past that the host waits for the oldest copy.
_staging = {}  # never dropped while the process runs: a copy may still read a buffer
_staging_lock = threading.Lock()
_STAGED = 32
_MIN_STAGE = 4096
_STAGE_LIMIT = 1 << 20  # larger copies go through cupy.asarray
_CAPTURE_IMPLICIT = 906  # cudaErrorStreamCaptureImplicit: another stream captures (global mode)


def capturing(cupy):
    """Whether the current stream is capturing a CUDA graph, or may not be used while another
    stream captures in global mode (which CUDA reports as an error)."""
    try:
        return bool(cupy.cuda.get_current_stream().is_capturing())
    except Exception as error:
        if getattr(error, "status", None) == _CAPTURE_IMPLICIT:
            return True
        raise


def refuse_during_capture(cupy, what):
    """Raise where the current stream captures a CUDA graph: ``what`` reads the host."""
    if capturing(cupy):
        raise RopeValueError(
            f"the current stream is capturing a CUDA graph, and {what} reads the device's "
            "values on the host, which a capture cannot hold: call it outside the capture"
        )


# arrayrope's own device arrays that a captured graph reads (tables, geometry, kept arrays, the
# error flag), held for the life of the process: a cache may replace or drop its entry, and the
# graph keeps only their addresses. The caller's arrays are the caller's to keep.
_held = []
_held_ids = set()
_held_lock = threading.Lock()


def hold(cupy, arrays):
    """Keep the device arrays among ``arrays`` (arrayrope's, read by a launch being captured)
    alive for the process."""
    with _held_lock:
        for a in arrays:
            if isinstance(a, cupy.ndarray) and id(a) not in _held_ids:
                _held_ids.add(id(a))
                _held.append(a)


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
    with _staging_lock:
        slots = _staging.setdefault(device, [])
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


# The error flag of each device: (device array, host view) of one int32 in pinned memory,
# never dropped while the process runs (a kernel may still write it).
_flags = {}
_flags_lock = threading.Lock()


def error_flag(cupy, device):
    """The device's error flag as a device array (one int32 the kernels set to 1 for an invalid
    position) and as a NumPy view of the same pinned memory."""
    found = _flags.get(device)
    if found is None:
        with _flags_lock:
            found = _flags.get(device)
            if found is None:
                memory = cupy.cuda.alloc_pinned_memory(4)
                host = np.frombuffer(memory, np.int32, 1)
                host[0] = 0
                # Under unified addressing (every 64-bit platform CUDA supports), pinned host
                # memory is accessible from every device at its host address.
                address = host.__array_interface__["data"][0]
                owned = cupy.cuda.UnownedMemory(address, 4, memory, device)
                flag = cupy.ndarray((1,), np.int32, cupy.cuda.MemoryPointer(owned, 0))
                found = _flags[device] = (flag, host)
    return found


_armed = []


def arm(cupy):
    """Once device positions reach a kernel: at exit, report an error no call raised."""
    if not _armed:
        with _flags_lock:
            if not _armed:
                _armed.append(True)
                atexit.register(_warn_unraised, cupy)


def _warn_unraised(cupy):
    """At exit: an invalid device position whose error no later call raised is reported as a
    warning (its rows are NaN), after waiting for the devices' queued work."""
    for device, (_, host) in list(_flags.items()):
        try:
            cupy.cuda.Device(device).synchronize()
        except Exception:  # noqa: BLE001 - a device or context already gone: read what is there
            pass
        if host[0]:
            warnings.warn(
                f"arrayrope: a call on CUDA device {device} was given device positions that are "
                "negative, 2**31 or more, or not finite (their rows are NaN), and no later call "
                "on that device raised the error",
                RuntimeWarning,
                stacklevel=1,
            )


def mark_invalid(cupy, device, values):
    """float64 device positions with every invalid value (negative, or not finite) made NaN,
    which makes the table entries of the pairs that read it NaN, as the kernels do for integer
    positions; the device's error flag is set where there is one. Device operations only:
    nothing waits."""
    invalid = ~((values >= 0) & (values < np.inf))
    flag = error_flag(cupy, device)[0]
    cupy.copyto(flag, 1, where=invalid.any())  # written only where there is an error
    return cupy.where(invalid, np.nan, values)


def raise_flagged(cupy, device):
    """Raise where a kernel on ``device`` has met an invalid device position since the last
    look (a kernel still queued has not: its error comes later); the flag is cleared."""
    found = _flags.get(device)
    if found is not None and found[1][0]:
        found[1][0] = 0
        raise RopeValueError(
            f"pos: an earlier call on CUDA device {device} was given device positions that are "
            "negative, 2**31 or more, or not finite, and wrote NaN for the pairs that read "
            "them. Positions on a device are checked there, without waiting for the kernel, so "
            "the error is raised by a later call on that device (this one, which did nothing)"
        )


def device_rows(cupy, device, idxs, cos, sin):
    """Row indices on the current device, one per operand, and the tables they index. Default
    positions (an arange arrayrope keeps) are copied once per device; a single position shared
    by every operand is a zero row index into its own row of the tables (a view), so a decode
    step copies nothing to the device. Other host arrays (positions, exact table rows) go
    through :func:`upload`; device positions are copied only where their start is not aligned
    to their element size, which a GPU's typed loads require."""
    first = idxs[0]
    if all(idx is first for idx in idxs) and isinstance(first, np.ndarray):
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
    if not isinstance(a, np.ndarray):
        return a.copy() if a.data.ptr % a.itemsize else a
    if is_default(a):
        return on_device(cupy, device, ("arange", a.shape[0]), a)
    return upload(cupy, device, a)
