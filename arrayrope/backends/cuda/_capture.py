"""CUDA graph capture: whether the current stream captures, the refusal of what a capture
cannot hold, and the arrays a captured graph reads, kept for the life of the process.
Changes here are checked by tests/test_cupy_on_host.py on the stand-in and by
tests/test_gpu.py and bench/gpu_check.py on a GPU."""

import threading

from ... import _arrays
from ..._errors import RopeValueError

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


# Registry: arrayrope's own device arrays that a captured graph reads (tables, geometry, kept
# arrays, the error flag), held for the life of the process: a cache may replace or drop its
# entry, and the graph keeps only their addresses. The caller's arrays are the caller's to keep.
_held = []
_held_ids = set()
_held_lock = threading.Lock()


def hold(cupy, arrays):
    """Keep the device arrays among ``arrays`` (arrayrope's, read by a launch being captured)
    alive for the process."""
    with _held_lock:
        for a in arrays:
            if _arrays.family(a) == _arrays.CUPY and id(a) not in _held_ids:
                _held_ids.add(id(a))
                _held.append(a)
