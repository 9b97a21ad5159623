"""A RoPE's fixed configuration: the checks of its arguments (the constructors' and the calls'
that are not about arrays), and the frozen spec that plans and kernels read (never the RoPE
object itself)."""

import dataclasses
import math
import operator

import numpy as np

from . import _arrays
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
    if isinstance(base, (str, bytes, bool, np.bool_)):  # float() would read "1e4" and True
        raise RopeTypeError(f"base must be a real number, got {base!r}")
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


# Checks of a scaling rule's fields (arrayrope.scaling): each takes the field's name and value.


def real(name, value):
    try:
        return float(value)
    except (TypeError, ValueError):
        raise RopeTypeError(f"{name} must be a real number, got {value!r}") from None


def positive(name, value):
    number = real(name, value)
    if not (math.isfinite(number) and number > 0):
        raise RopeValueError(f"{name} must be finite and > 0, got {value!r}")
    return number


def nonnegative(name, value):
    number = real(name, value)
    if not (math.isfinite(number) and number >= 0):
        raise RopeValueError(f"{name} must be finite and >= 0, got {value!r}")
    return number


def length(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise RopeTypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise RopeValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def optional(check):
    return lambda name, value: None if value is None else check(name, value)


def coerce(rule, **checks):
    """Check and normalize fields of a frozen rule in __post_init__: name=checker(name, value)."""
    for name, check in checks.items():
        object.__setattr__(rule, name, check(name, getattr(rule, name)))


def axes_arg(name, values):
    try:
        values = tuple(operator.index(v) for v in values)
    except TypeError:
        raise RopeTypeError(f"{name} must be a sequence of ints, got {values!r}") from None
    if not values:
        raise RopeValueError(f"{name} must name at least one axis, got ()")
    return values


def axial_pairs(dims):
    """(dims checked, each pair's position axis) of an axial RoPE (see RoPE.axial)."""
    dims = axes_arg("dims", dims)
    for i, n in enumerate(dims):
        if n < 2 or n % 2:
            raise RopeValueError(f"dims[{i}] must be even and >= 2, got {n}")
    return dims, np.repeat(np.arange(len(dims), dtype=np.int64), [n // 2 for n in dims])


def sectioned_pairs(sections, assign, rotary_dim):
    """Each pair's position axis in a sectioned RoPE (see RoPE.sectioned)."""
    sections = axes_arg("sections", sections)
    if any(n < 0 for n in sections):
        raise RopeValueError(f"sections must be >= 0 pairs each, got {sections}")
    pairs = rotary_dim // 2
    if sum(sections) != pairs:
        raise RopeValueError(
            f"sections {sections} sum to {sum(sections)} pairs; rotary_dim {rotary_dim} has {pairs}"
        )
    n_axes = len(sections)
    if assign == "contiguous":
        return np.repeat(np.arange(n_axes, dtype=np.int64), sections)
    if assign != "interleaved":
        raise RopeValueError(f"assign must be 'contiguous' or 'interleaved', got {assign!r}")
    j = np.arange(pairs)
    pair_axis = np.zeros(pairs, dtype=np.int64)
    for a in range(1, n_axes):
        pair_axis[(j % n_axes == a) & (j < n_axes * sections[a])] = a
    counts = tuple(int((pair_axis == a).sum()) for a in range(n_axes))
    if counts != sections:
        raise RopeValueError(
            f"sections {sections} cannot be interleaved over {pairs} pairs (each axis "
            f"a >= 1 needs n_axes * sections[a] <= {pairs}); got counts {counts}"
        )
    return pair_axis


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


def check_inverse(inverse):
    if isinstance(inverse, (bool, np.bool_)):
        return bool(inverse)
    raise RopeTypeError(f"inverse must be a bool, got {inverse!r}")


def with_head_axis(pos, head_axis, x, n_axes, name="pos"):
    """``pos`` with an axis of size 1 at ``x``'s axis ``head_axis`` (which it must lack); errors
    call it ``name``."""
    shape = getattr(x, "shape", None)
    if not isinstance(shape, tuple):
        raise RopeTypeError(f"head_axis needs an x with a shape, got {_arrays.describe(x)}")
    try:
        axis = operator.index(head_axis) if not isinstance(head_axis, bool) else None
    except TypeError:
        axis = None
    lead = len(shape) - 1
    if axis is None or not (0 <= axis < lead or -len(shape) <= axis <= -2):
        raise RopeValueError(
            f"head_axis must be an axis of x's leading shape {shape[:-1]} (0 to {lead - 1}, or "
            f"negative from the end of x's shape), got {head_axis!r}"
        )
    axis %= len(shape)
    if pos is None or not hasattr(pos, "ndim") and np.ndim(pos) == 0:
        raise RopeValueError(f"head_axis applies to an array {name}, got {pos!r}")
    if not hasattr(pos, "ndim"):
        pos = np.asarray(pos)
    wanted = lead - 1 + (n_axes > 1)
    if pos.ndim != wanted:
        raise RopeValueError(
            f"with head_axis={head_axis}, {name} must have x's leading axes but that one "
            f"({wanted} axes{' with the trailing n_axes' if n_axes > 1 else ''}), got shape "
            f"{tuple(pos.shape)}"
        )
    placed = pos[(slice(None),) * axis + (None,)]
    shape = tuple(placed.shape[:-1] if n_axes > 1 else placed.shape)
    if not all(p == 1 or p == n for p, n in zip(shape, x.shape[:-1])):
        raise RopeValueError(
            f"with head_axis={head_axis}, {name} of shape {tuple(pos.shape)} lines up as {shape} "
            f"against x's leading shape {tuple(x.shape[:-1])}; head_axis is the axis of x that "
            f"{name} lacks (1 for (B, H, T, d), 2 for (B, T, H, d))"
        )
    return placed


def signed(delta):
    """(|delta|, whether delta is negative) for a move of one sign; ``delta`` a number, or an
    array already adopted (``_interop.native_positions``)."""
    if isinstance(delta, (int, float, np.integer, np.floating)) and not isinstance(delta, bool):
        return (-delta, True) if delta < 0 else (delta, False)
    values = delta
    if not _arrays.family(values):
        values = np.asarray(values)
    if values.dtype.kind not in "iuf" or values.size == 0:
        return values, False
    if _arrays.family(values) == _arrays.CUPY:
        from . import backends

        backends.device().refuse_during_capture(
            _arrays.namespace(_arrays.CUPY), "shift with device deltas"
        )
    low, high = values.min(), values.max()
    low, high = (float(v) for v in (low, high))
    if low < 0 < high:
        raise RopeValueError(
            f"delta must move every row one way, got moves from {low} to {high}: shift the "
            "forward and backward rows in two calls"
        )
    return (-values, True) if low < 0 else (values, False)
