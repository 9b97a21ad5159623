"""Rotary position embeddings on plain NumPy and CuPy arrays."""

from . import scaling
from ._api import apply_cos_sin, apply_cos_sin_qk, rotate, rotate_qk
from ._errors import BackendUnavailableError, RopeError, RopeTypeError, RopeValueError
from ._warmup import warmup
from .rope import RoPE

__version__ = "0.1.0"
__all__ = [
    "BackendUnavailableError",
    "RoPE",
    "RopeError",
    "RopeTypeError",
    "RopeValueError",
    "apply_cos_sin",
    "apply_cos_sin_qk",
    "rotate",
    "rotate_qk",
    "scaling",
    "warmup",
]
