"""The error flag of each CUDA device: positions on a device are checked there, by the
kernels. An invalid one (negative, 2**31 or more, not finite) gives NaN for its rows and sets
the device's flag, a word of pinned host memory the kernels write directly. The host reads it
at the next call on that device and raises there (:func:`raise_flagged`): reading it at once
would mean waiting for the kernel. An error no call raised is a warning at exit.

Changes here are checked by tests/test_cupy_on_host.py on the stand-in and by
tests/test_gpu.py and bench/gpu_check.py on a GPU.
"""

import atexit
import threading
import warnings

import numpy as np

from ... import _arrays
from ..._errors import RopeValueError

# Registry: the error flag of each device: (device array, host view) of one int32 in pinned memory,
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
                address = _arrays.pointer(host, _arrays.NUMPY)
                owned = cupy.cuda.UnownedMemory(address, 4, memory, device)
                flag = cupy.ndarray((1,), np.int32, cupy.cuda.MemoryPointer(owned, 0))
                found = _flags[device] = (flag, host)
    return found


_armed = []  # a flag: one entry once the exit report is registered


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
