"""The CUDA backends' one hook for the plans and the API (``backends.device()``): what a call
on CuPy arrays needs besides its kernel launch. The jobs live in their own modules: _staging
(host arrays onto a device), _flag (the error flag of device positions), _capture (CUDA graph
capture)."""

from ._capture import capturing, refuse_during_capture
from ._flag import arm, mark_invalid, raise_flagged
from ._staging import device_rows

__all__ = ["arm", "begin", "device_rows", "mark_invalid", "refuse_during_capture"]


def begin(cupy, device):
    """At the start of a call on ``device``: raise the error an earlier call's kernel flagged;
    returns whether the current stream is capturing a CUDA graph."""
    raise_flagged(cupy, device)
    return capturing(cupy)
