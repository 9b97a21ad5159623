"""A RoPE's fixed configuration: the checks of the constructor arguments, and the frozen spec
that plans and kernels read (never the RoPE object itself)."""

import dataclasses
import math
import operator

import numpy as np

from ._errors import RopeTypeError, RopeValueError

STYLES = ("interleaved", "half")


def int_arg(name, value, *, minimum):
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise RopeTypeError(f"{name} must be an int, got {value!r}") from None
    if number < minimum:
        raise RopeValueError(f"{name} must be >= {minimum}, got {number}")
    return number


def dims_arg(head_dim, rotary_dim):
    """(head_dim, rotary_dim), checked: both even, rotary_dim <= head_dim (default head_dim)."""
    head_dim = int_arg("head_dim", head_dim, minimum=2)
    if head_dim % 2:
        raise RopeValueError(f"head_dim must be even, got {head_dim}")
    rotary_dim = int_arg("rotary_dim", head_dim if rotary_dim is None else rotary_dim, minimum=2)
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise RopeValueError(
            f"rotary_dim must be even and <= head_dim ({head_dim}), got {rotary_dim}"
        )
    return head_dim, rotary_dim


def base_arg(base):
    try:
        value = float(base)
    except (TypeError, ValueError):
        raise RopeTypeError(f"base must be a real number, got {base!r}") from None
    if not (math.isfinite(value) and value > 0.0):
        raise RopeValueError(f"base must be finite and > 0, got {base!r}")
    return value


def style_arg(style):
    if style not in STYLES:
        raise RopeValueError(f"style must be 'interleaved' or 'half', got {style!r}")
    return style


def axes_arg(name, values):
    try:
        values = tuple(operator.index(v) for v in values)
    except TypeError:
        raise RopeTypeError(f"{name} must be a sequence of ints, got {values!r}") from None
    if not values:
        raise RopeValueError(f"{name} must name at least one axis, got ()")
    return values


def segments(pair_axis):
    """Runs of consecutive pairs on one position axis, as int64 rows (first, stop, axis)."""
    starts = [0] + [j for j in range(1, pair_axis.size) if pair_axis[j] != pair_axis[j - 1]]
    stops = starts[1:] + [pair_axis.size]
    return np.array([(a, b, pair_axis[a]) for a, b in zip(starts, stops)], dtype=np.int64)


def frozen(a):
    a = np.array(a, dtype=np.int64)
    a.flags.writeable = False
    return a


@dataclasses.dataclass(frozen=True, eq=False)
class Spec:
    """What the kernels need of a RoPE, fixed when it is made. (Compared and hashed by
    identity: a plan cache looks one up per call.)"""

    head_dim: int
    rotary_dim: int
    style: str
    half_style: bool  # pairs (x[i], x[i + rotary_dim/2]); else (x[2i], x[2i+1])
    n_axes: int
    pair_axis: np.ndarray  # int64 (rotary_dim // 2,): the position axis of each pair
    segments: np.ndarray  # int64 (runs, 3): runs of pairs on one axis, (first, stop, axis)
    dynamic: bool  # frequencies depend on the current length (DynamicNTK, LongRoPE)
