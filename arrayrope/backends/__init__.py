"""Kernel backends, each imported on first use: ``cpu`` (Numba, NumPy arrays), ``cuda.cupy``
(CUDA C through CuPy), ``cuda.numba`` (numba.cuda) and ``reference`` (array operations).

Every backend's ``launch(spec, operands, cos, sin, inverse)`` rotates one or two (x, out, idx)
operands that the dispatcher has already checked; backends never re-check or re-dispatch.
"""

import importlib

from .._errors import RopeValueError

BACKENDS = ("auto", "numba", "numpy", "cupy", "numba-cuda")
_MODULES = {
    "numba": ".cpu",
    "numpy": ".reference",
    "cupy": ".cuda.cupy",
    "numba-cuda": ".cuda.numba",
}
_loaded = {}  # finite store: by backend name


def module(backend):
    """The module of a backend name (see ``_MODULES``), imported the first time."""
    found = _loaded.get(backend)
    if found is None:
        found = _loaded[backend] = importlib.import_module(_MODULES[backend], __name__)
    return found


def device():
    """The GPU backends' hook for the plans and the API (``cuda._device``), imported the first
    time: what a call on CuPy arrays needs besides its kernel launch (the error flag of device
    positions, graph capture, rows onto the device)."""
    return importlib.import_module(".cuda._device", __name__)


def check_name(backend):
    """Raise unless ``backend`` is one of BACKENDS."""
    if backend not in BACKENDS:
        raise RopeValueError(
            f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}"
        )
