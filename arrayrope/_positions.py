"""Positions: what ``pos`` may be, the one check of its shape and of its values, and the row
patterns the one-thread kernel reads without broadcasting.

A resolved ``pos`` is a kind and a value:
- NONE: 0..T-1 along axis -2 of each operand (position 0 for a 1-D x);
- INT: one position for every row (a Python or NumPy integer);
- ARRAY: NumPy or CuPy integers or reals, shape P (P + (n_axes,) for multi-axis RoPE),
  broadcastable to the operands' leading shapes.
"""

import math
import operator

import numpy as np

from . import _arrays
from ._cache import Bounded
from ._errors import RopeTypeError, RopeValueError

LIMIT = 2**31  # integer positions index int32-sized tables on every backend
NONE, INT, ARRAY = 0, 1, 2
_INT64 = np.dtype(np.int64)
_aranges = Bounded(1024)


def resolve(pos, n_axes):
    """(kind, value) of ``pos`` as the caller passed it (arrays from other frameworks already
    adopted, see ``_interop.native_positions``); raises for what cannot be positions."""
    if pos is None:
        if n_axes != 1:
            raise RopeValueError(
                f"pos is required for a RoPE with {n_axes} position axes: give shape "
                f"(..., {n_axes})"
            )
        return NONE, None
    if isinstance(pos, (int, np.integer)) and not isinstance(pos, (bool, np.bool_)):
        if n_axes != 1:
            raise RopeValueError(
                f"pos must end in an axis of size n_axes ({n_axes}), got the scalar {pos}"
            )
        return INT, check_int(operator.index(pos))
    if not _arrays.family(pos):
        _arrays.refuse_masked("pos", pos)
        try:
            pos = np.asarray(pos)
        except (TypeError, ValueError):
            raise RopeTypeError(f"pos must be positions (int or float), got {pos!r}") from None
    if pos.dtype.kind not in "iuf":
        raise RopeTypeError(f"pos must hold integers or real numbers, got dtype {pos.dtype}")
    return ARRAY, pos


def check_int(value):
    """A scalar integer position, checked."""
    if value < 0:
        raise RopeValueError(f"pos must be non-negative, got {value}")
    if value >= LIMIT:
        raise RopeValueError(f"pos must be below 2**31, got {value}")
    return value


def with_axes(values, n_axes, leads, name="pos"):
    """``values`` (an array) with its trailing axis of n_axes (added for one axis), checked to
    broadcast to every leading shape in ``leads``; errors call it ``name``."""
    if n_axes == 1:
        values = values[..., None]
    elif values.ndim == 0 or values.shape[-1] != n_axes:
        raise RopeValueError(
            f"{name} must end in an axis of size n_axes ({n_axes}), got shape {values.shape}"
        )
    shape = values.shape[:-1]
    for lead in leads:
        # A (B, T) array against (B, H, T) reads as (1, B, T): refused when an axis that pos
        # gains is longer than 1, since only then can pos's first axis mean something else.
        gained = lead[: len(lead) - len(shape)]
        if 1 < len(shape) < len(lead) and 1 not in shape and any(n > 1 for n in gained):
            raise RopeValueError(
                f"{name} of shape {shape} has fewer axes than the leading shape {lead}, and would "
                f"broadcast as {(1,) * (len(lead) - len(shape)) + shape}. For (B, T) "
                "position_ids give head_axis (1 for (B, H, T, d), 2 for (B, T, H, d)), or an "
                f"axis of size 1 where {name} broadcasts"
            )
    if not all(broadcasts(values.shape[:-1], lead) for lead in leads):
        shown = values.shape if n_axes > 1 else values.shape[:-1]
        hint = ""
        if len(shape) == 1 and any(len(lead) >= 2 and lead[-2] == shape[0] for lead in leads):
            hint = f"; for one row per token of (B, T, H, d), give {name}[:, None]: (T, 1)"
        raise RopeValueError(
            f"{name} of shape {shown} does not broadcast to the leading shape "
            + " and ".join(str(lead) for lead in leads)
            + (f" (with a trailing axis of {n_axes})" if n_axes > 1 else "")
            + hint
        )
    return values


def broadcasts(shape, target):
    return len(shape) <= len(target) and all(
        s == 1 or s == t for s, t in zip(reversed(shape), reversed(target))
    )


def check_values(values):
    """(values as int64 or float64, is_int, highest) of a non-empty position array, after the
    one check of their values: finite, non-negative, integers below 2**31."""
    is_int = values.dtype.kind in "iu"
    if 0 in values.strides:
        # broadcast axes (stride 0) repeat the same values: read one slice of them
        values = values[tuple(slice(0, 1) if s == 0 else slice(None) for s in values.strides)]
    # min and max carry a nan or an infinity through, so they settle finiteness too; from a
    # device, both come back in one copy
    if _arrays.family(values) == _arrays.CUPY:
        xp = _arrays.namespace(_arrays.CUPY)
        low, high = (v.item() for v in xp.stack([values.min(), values.max()]).get())
    else:
        low, high = values.min().item(), values.max().item()
    if not is_int and not (math.isfinite(low) and math.isfinite(high)):
        raise RopeValueError("pos must be finite, got nan or inf")
    if low < 0:
        raise RopeValueError(f"pos must be non-negative, got {low}")
    if is_int:
        if high >= LIMIT:
            raise RopeValueError(f"pos must be below 2**31, got {high}")
        return values.astype(np.int64, copy=False), True, int(high)
    return values.astype(np.float64, copy=False), False, high


def defaults(length):
    """0..length-1 as a (length, 1) int64 array, kept. (Writable, though no one writes it: a
    read-only array is another Numba type, and every kernel would compile twice.)"""
    values = _aranges.get(length)
    if values is None:
        values = np.arange(length, dtype=np.int64).reshape(length, 1)
        _aranges.put(length, values)
    return values


def is_default(idx):
    """Whether ``idx`` is an array :func:`defaults` made (it may be kept on a device)."""
    return idx.ndim == 2 and _aranges.get(idx.shape[0]) is idx


def row_pattern(shape, lead):
    """How the rows (in C order) of an operand with leading shape ``lead`` read positions of
    ``shape``: (flatten, repeat), where row r sits at ``flat[(r // repeat) % flat.size]`` of the
    positions flattened (``flatten``: they are not 1-D already). None where positions broadcast
    in another pattern (across an axis in the middle of their own).

    Covers what decode and prefill pass: (T,) against (B, H, T); (T, 1) or (B, T, 1) against
    (B, T, H); (B, 1, 1) against (B, H, 1); one position for every row; no broadcasting at all.
    """
    offset = len(lead) - len(shape)
    if offset < 0:
        return None
    first = stop = 0  # the varying block of the positions' axes, [first, stop)
    for k, n in enumerate(shape):
        if n != 1:
            if stop == 0:
                first = k
            stop = k + 1
    if stop == 0:
        return len(shape) != 1, 1
    for k in range(first, stop):
        if shape[k] != lead[offset + k]:
            return None
    repeat = 1
    for n in lead[offset + stop :]:
        repeat *= n
    return len(shape) != 1, repeat


def seq_len_for(dynamic, seq_len, high):
    """The current length for a length-dependent scaling rule (``dynamic``): ``seq_len``,
    checked, or max(pos) + 1. None for other rules, which take no seq_len."""
    if not dynamic:
        if seq_len is not None:
            raise RopeValueError(
                "seq_len applies to length-dependent scaling rules (DynamicNTK, LongRoPE) only: "
                f"this RoPE's frequencies do not depend on the length, got seq_len={seq_len!r}"
            )
        return None
    if seq_len is None:
        return int(high) + 1
    try:
        value = operator.index(seq_len)
    except TypeError:
        raise RopeTypeError(f"seq_len must be an int or None, got {seq_len!r}") from None
    if value < 1:
        raise RopeValueError(f"seq_len must be >= 1, got {value}")
    return value
