"""rotate, rotate_qk and the single path every call takes.

Validate once at this boundary, resolve positions into table rows once, pick the backend once and
launch once. Kernels get arrays that are already checked and never re-check them.
"""

import functools
import operator
import sys

import numpy as np

from ._device import on_device
from ._errors import RopeError, RopeTypeError, RopeValueError

POSITION_LIMIT = 2**31
ACCEPTED = "an array: NumPy, CuPy, Dask, or any DLPack producer (torch, JAX)"
# Arithmetic dtype per storage dtype: float32 for half types and float32, float64 for float64.
# Keyed by dtype object (hashing a dtype is cheap, dtype.name is not); bfloat16 joins on first
# sight, so that asking never imports ml_dtypes.
_TABLE_DTYPE = {
    np.dtype(np.float16): np.dtype(np.float32),
    np.dtype(np.float32): np.dtype(np.float32),
    np.dtype(np.float64): np.dtype(np.float64),
}


def _table_dtype(dtype):
    found = _TABLE_DTYPE.get(dtype)
    if found is None and dtype.name == "bfloat16" and dtype.itemsize == 2:
        found = _TABLE_DTYPE[dtype] = np.dtype(np.float32)
    return found


_BACKENDS = ("auto", "numba", "numpy", "cupy", "numba-cuda")
_family_of_type = {}


def _family(a):
    """'numpy', 'cupy' or '' for an object, cached per type; asking never imports CuPy."""
    kind = type(a)
    family = _family_of_type.get(kind)
    if family is None:
        cupy = sys.modules.get("cupy")
        if kind is np.ndarray or kind is np.memmap:
            family = "numpy"
        elif cupy is not None and issubclass(kind, cupy.ndarray):
            family = "cupy"
        else:
            family = ""
        _family_of_type[kind] = family
    return family


def _namespace(family):
    if family == "cupy":
        return sys.modules["cupy"]
    return np


def _describe(a):
    return f"{type(a).__module__}.{type(a).__name__}"


def _check_array(name, x, head_dim):
    family = _family(x)
    if x.ndim == 0:
        raise RopeValueError(f"{name} must have a feature axis (shape (..., d)), got a 0-d array")
    if _table_dtype(x.dtype) is None:
        if not x.dtype.isnative and _table_dtype(x.dtype.newbyteorder("=")) is not None:
            raise RopeTypeError(
                f"{name} must be in native byte order, got dtype {x.dtype.str} "
                f"({name}.astype({name}.dtype.newbyteorder('=')) converts it)"
            )
        raise RopeTypeError(
            f"{name} must be float16, bfloat16, float32 or float64, got dtype {x.dtype}"
        )
    if x.shape[-1] != head_dim:
        raise RopeValueError(
            f"{name}.shape[-1] must equal head_dim ({head_dim}), got {x.shape[-1]}"
        )
    return family


def _extent(a, family):
    ptr = a.data.ptr if family == "cupy" else a.__array_interface__["data"][0]
    low = high = ptr
    for n, s in zip(a.shape, a.strides):
        if s < 0:
            low += (n - 1) * s
        else:
            high += (n - 1) * s
    return low, high + a.itemsize


def _same_view(a, b, family):
    return a.strides == b.strides and _extent(a, family) == _extent(b, family)


def _may_overlap(a, b, family):
    """Whether the memory bounds of a and b intersect: the cheap test before the exact ones
    (NumPy's bounds check costs ~0.4 us, reading a data pointer through __array_interface__
    ~2 us)."""
    if family == "numpy":
        return np.may_share_memory(a, b)
    (a_lo, a_hi), (b_lo, b_hi) = _extent(a, family), _extent(b, family)
    return a_lo < b_hi and b_lo < a_hi


def _overlap(a, b, family):
    """True when a and b share memory (exactly, where the namespace can tell)."""
    (a_lo, a_hi), (b_lo, b_hi) = _extent(a, family), _extent(b, family)
    if a_hi <= b_lo or b_hi <= a_lo:
        return False
    if family == "numpy":
        return bool(np.shares_memory(a, b))
    return bool(_namespace(family).shares_memory(a, b))


def _check_outs(xs, outs, family, names):
    if len(outs) != len(xs):
        raise RopeTypeError(f"out must hold {len(xs)} arrays, got {len(outs)}")
    for i, (x, out) in enumerate(zip(xs, outs)):
        name = "out" if len(xs) == 1 else f"out[{i}]"
        if _family(out) != family:
            raise RopeTypeError(
                f"{name} must be a {'CuPy' if family == 'cupy' else 'NumPy'} array like "
                f"{names[i]}, got {_describe(out)}"
            )
        if out.shape != x.shape or out.dtype != x.dtype:
            raise RopeValueError(
                f"{name} must have {names[i]}'s shape {x.shape} and dtype {x.dtype}, "
                f"got shape {out.shape} and dtype {out.dtype}"
            )
        if family == "numpy" and not out.flags.writeable:
            raise RopeValueError(f"{name} is read-only")
        if family == "cupy" and out.device != x.device:
            raise RopeValueError(
                f"{name} is on device {out.device.id}, {names[i]} on device {x.device.id}"
            )
        if out.size == 0:
            continue
        for j, other in enumerate(xs):
            if other.size == 0:
                continue
            if out is other and i != j:
                raise RopeValueError(f"{name} is {names[j]}: it would be overwritten first")
            if out is other or not _may_overlap(out, other, family):
                continue
            if i == j and _same_view(out, other, family):
                continue  # in place through another view of x
            if _overlap(out, other, family):
                raise RopeValueError(
                    f"{name} overlaps {names[j]} partially; pass distinct memory, or {names[i]} "
                    "itself to rotate in place"
                )
    if (
        len(outs) == 2
        and outs[0].size
        and outs[1].size
        and _may_overlap(outs[0], outs[1], family)
        and _overlap(outs[0], outs[1], family)
    ):
        raise RopeValueError("out[0] and out[1] overlap")


def _pick_backend(backend, family):
    if backend == "auto":
        return "numba" if family == "numpy" else "cupy"
    if backend not in _BACKENDS:
        raise RopeValueError(
            f"backend must be one of {', '.join(map(repr, _BACKENDS))}, got {backend!r}"
        )
    if backend == "numba" and family != "numpy":
        raise RopeValueError(
            "backend='numba' takes NumPy arrays; for CuPy arrays use 'cupy' or 'numba-cuda'"
        )
    if backend in ("cupy", "numba-cuda") and family != "cupy":
        raise RopeValueError(
            f"backend={backend!r} takes CuPy arrays, got NumPy arrays; use 'numba' or 'numpy'"
        )
    return backend


_launchers = {}


def _launcher(backend):
    """The launch function of a kernel backend (None for the reference), imported on first use."""
    launch = _launchers.get(backend)
    if launch is None and backend != "numpy":
        if backend == "numba":
            from ._cpu import launch
        elif backend == "cupy":
            from ._cuda_cupy import launch
        else:
            from ._cuda_numba import launch
        _launchers[backend] = launch
    return launch


def _broadcasts(shape, target):
    return len(shape) <= len(target) and all(
        s == 1 or s == t for s, t in zip(reversed(shape), reversed(target))
    )


def _shape_text(shapes):
    return " and ".join(str(s) for s in shapes)


_cpu = None  # imported on first use: Numba loads with it
_INT64 = np.dtype(np.int64)
_aranges = {}
_scalars = {}
_ZERO = np.zeros((1, 1), dtype=np.int64)


def _default_positions(rope, leads):
    if rope.n_axes != 1:
        raise RopeValueError(
            f"pos is required for a RoPE with {rope.n_axes} position axes: give shape "
            f"(..., {rope.n_axes})"
        )
    length = leads[0][-1] if leads[0] else 1
    values = _aranges.get(length)
    if values is None:
        values = np.arange(length, dtype=np.int64).reshape(length, 1)
        values.flags.writeable = False
        if len(_aranges) < 1024:
            _aranges[length] = values
    return values, True, length - 1


def _scalar_position(pos):
    """A read-only (1, 1) int64 array holding ``pos``, cached."""
    values = _scalars.get(pos)
    if values is None:
        values = np.full((1, 1), pos, dtype=np.int64)
        values.flags.writeable = False
        if len(_scalars) > 4096:
            _scalars.clear()
        _scalars[int(pos)] = values
    return values


def _position_range(values, family):
    """(min, max, finite) of a non-empty position array."""
    global _cpu
    if 0 in values.strides:
        # Broadcast axes (stride 0) repeat the same values: read one slice of them, copy nothing.
        values = values[tuple(slice(0, 1) if s == 0 else slice(None) for s in values.strides)]
    if family == "numpy":
        if _cpu is None:
            from . import _cpu
        dtype = values.dtype
        if (dtype.kind == "f" and dtype.itemsize not in (4, 8)) or not dtype.isnative:
            # what the kernel does not take: float16, long double, a foreign byte order
            values = values.astype(np.float64 if dtype.kind == "f" else dtype.newbyteorder("="))
        return _cpu.position_range(values.reshape(-1))  # a copy only where not contiguous
    xp = _namespace(family)
    low, high = (float(v) for v in xp.stack([values.min(), values.max()]).get())
    return low, high, bool(np.isfinite(low) and np.isfinite(high))


def _positions(rope, pos, leads):
    """Check ``pos`` against the leading shapes.

    Returns (values, is_int, max): values of shape P + (n_axes or 1,), int64 or float64, on the
    host or (for CuPy positions) the device.
    """
    if pos is None:
        return _default_positions(rope, leads)
    if isinstance(pos, (int, np.integer)) and not isinstance(pos, (bool, np.bool_)):
        if rope.n_axes != 1:
            raise RopeValueError(
                f"pos must end in an axis of size n_axes ({rope.n_axes}), got the scalar {pos}"
            )
        if not 0 <= pos < POSITION_LIMIT:
            raise RopeValueError(f"pos must be in [0, 2**31), got {pos}")
        return _scalar_position(pos), True, int(pos)
    family = _family(pos)
    if family:
        values = pos
    else:
        try:
            values = np.asarray(pos)
        except (TypeError, ValueError):
            raise RopeTypeError(f"pos must be positions (int or float), got {pos!r}") from None
        family = "numpy"
    if values.dtype.kind in "iu":
        is_int = True
    elif values.dtype.kind == "f":
        is_int = False
    else:
        raise RopeTypeError(f"pos must hold integers or real numbers, got dtype {values.dtype}")
    if rope.n_axes == 1:
        values = values[..., None]
    elif values.ndim == 0 or values.shape[-1] != rope.n_axes:
        raise RopeValueError(
            f"pos must end in an axis of size n_axes ({rope.n_axes}), got shape {values.shape}"
        )
    if not all(_broadcasts(values.shape[:-1], lead) for lead in leads):
        shown = values.shape if rope.n_axes > 1 else values.shape[:-1]
        raise RopeValueError(
            f"pos of shape {shown} does not broadcast to the leading shape "
            f"{_shape_text(leads)}"
            + (f" (with a trailing axis of {rope.n_axes})" if rope.n_axes > 1 else "")
        )
    if values.size == 0:
        return values.astype(np.int64 if is_int else np.float64), is_int, -1
    low, high, finite = _position_range(values, family)
    if not finite:
        raise RopeValueError("pos must be finite, got nan or inf")
    if low < 0:
        raise RopeValueError(f"pos must be non-negative, got {low}")
    if is_int:
        if high >= POSITION_LIMIT:
            raise RopeValueError(f"integer pos must be < 2**31, got {high}")
        values = values.astype(np.int64, copy=False)
    else:
        values = values.astype(np.float64, copy=False)
    return values, is_int, high


def _seq_len(rope, seq_len, high):
    if rope.scaling is None or not rope.scaling.dynamic:
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


def _tables(rope, values, is_int, high, xp, device, dtype, seq_len):
    """(cos, sin, idx): tables of ``dtype`` in ``xp`` and int64 row indices shaped like values."""
    tables = rope._freq_set(seq_len).tables
    if is_int:
        cached = tables.cached(xp, device, dtype, max(int(high), 0))
        if cached is not None:
            return cached[0], cached[1], values
    # Real-valued positions, or integers past the cache: one exact row per position entry.
    value_xp = _namespace(_family(values))
    flat = values.reshape(-1, values.shape[-1]).astype(np.float64, copy=False)
    cos, sin = tables.exact(value_xp, dtype, flat)
    idx = value_xp.arange(flat.shape[0], dtype=np.int64).reshape(values.shape[:-1] + (1,))
    if value_xp is not xp:
        cos, sin = xp.asarray(cos), xp.asarray(sin)
    return cos, sin, idx


def _device_rows(cupy, device, idx, cos, sin):
    """Row indices on the current device, and the tables they index. A position array that
    arrayrope keeps on the host (a default arange, a scalar position's) is copied once per
    device; a scalar position is a zero row index into its own row of the tables (a view), so
    a decode step copies nothing to the device. Any other host idx is copied."""
    if _family(idx) == "cupy":
        return idx, cos, sin
    if idx.ndim == 2 and _aranges.get(idx.shape[0]) is idx:
        return on_device(cupy, device, ("arange", idx.shape[0]), idx), cos, sin
    if idx.shape == (1, 1):
        p = int(idx[0, 0])
        if _scalars.get(p) is idx:
            return on_device(cupy, device, "zero", _ZERO), cos[p : p + 1], sin[p : p + 1]
    return cupy.asarray(idx), cos, sin


def _gather(rope, xp, cos, sin, idx):
    """cos/sin per pair for each position entry: shape idx.shape[:-1] + (n_pairs,)."""
    pairs = rope.rotary_dim // 2
    if idx.shape[-1] == 1:
        rows = xp.broadcast_to(idx, idx.shape[:-1] + (pairs,))
    else:
        rows = idx[..., xp.asarray(rope._pair_axis)]
    columns = xp.arange(pairs)
    return cos[rows, columns], sin[rows, columns]


def _row_positions(pos, lead):
    """Positions for the rows (in C order) of an x with leading shape ``lead``, as (flat
    array, repeat): row r sits at ``flat[(r // repeat) % flat.size]``. None where ``pos``
    broadcasts in another pattern (across an axis in the middle of its own), or not at all.

    Covers what decode and prefill pass: (T,) against (B, H, T); (T, 1) or (B, T, 1) against
    (B, T, H); (B, 1, 1) against (B, H, 1); one position for every row; no broadcasting at all.
    """
    shape = pos.shape  # read once: each read builds a tuple
    offset = len(lead) - len(shape)
    if offset < 0:
        return None
    first = stop = 0  # the varying block of pos's axes, [first, stop)
    for k, n in enumerate(shape):
        if n != 1:
            if stop == 0:
                first = k
            stop = k + 1
    if stop == 0:
        return (pos if len(shape) == 1 else pos.reshape(1)), 1
    for k in range(first, stop):
        if shape[k] != lead[offset + k]:
            return None
    repeat = 1
    for n in lead[offset + stop :]:
        repeat *= n
    return (pos if len(shape) == 1 else pos.reshape(-1)), repeat


def rotate_small(rope, x, pos, inverse, out):
    """The decode and prefill fast path for one operand: the result, or None where a call
    needs the general path.

    It takes a small NumPy ``x`` whose feature axis is contiguous (any leading strides:
    KV-cache slices, fused-QKV views), with ``out`` None, ``x`` itself (in place) or an array
    of x's shape and dtype whose memory does not overlap x's; and positions as None, an int
    (Python's or NumPy's) or an integer NumPy array in a common broadcast pattern (see
    :func:`_row_positions`); for a RoPE with one position axis and no length-dependent scaling
    (``rope._small``). These are the shapes of a decode step, where the general path's layout
    bookkeeping costs more than the rotation. Anything else, bad input included, returns None
    and goes the general way, which checks it; so do a position that is negative or past the
    cached table and a feature axis that is not contiguous, which the kernel finds before
    writing. Same row body, same results. Every check here is ordered and written for its
    cost: the whole Python side of a decode step is budgeted at about a microsecond.
    """
    rows = _small_rows(rope, x, pos)
    if rows is None or type(inverse) is not bool:
        return None
    positions, repeat_bits, high = rows
    dtype = x.dtype
    plan = rope._plans.get(dtype)
    if plan is None or plan[1] <= high:
        plan = _small_plan(rope, dtype, high)
        if plan is None:
            return None
    if x.size >= _cpu.SMALL_BELOW:
        return None
    tables, _, view, settings = plan
    if out is None:
        result = out = np.empty(x.shape, dtype)  # not empty_like: that costs twice as much here
    elif out is x:
        if not x.flags.writeable:
            return None
        result = out
        x = None  # in place: the kernel's compile-time case
    elif _small_out(x, out):
        result = out
    else:
        return None
    if view is not None:  # a half type: the kernel takes its bits
        x = None if x is None else x.view(view)
        out = out.view(view)
    if _cpu.rotate_rows(x, out, positions, tables, settings + inverse + repeat_bits):
        return result
    return _refused(rope, dtype)


def rotate_qk_small(rope, q, k, pos, inverse, outs):
    """:func:`rotate_small` for q and k: (q_rot, k_rot), or None. They share a dtype, and
    ``outs`` is None or a pair of which each is its operand itself or shares no memory with
    q, k or the other; the size limit counts q and k together."""
    q_rows = _small_rows(rope, q, pos)
    if q_rows is None or type(inverse) is not bool:
        return None
    k_rows = _small_rows(rope, k, pos)
    if k_rows is None or k.dtype != q.dtype:
        return None
    high = max(q_rows[2], k_rows[2])
    plan = rope._plans.get(q.dtype)
    if plan is None or plan[1] <= high:
        plan = _small_plan(rope, q.dtype, high)
        if plan is None:
            return None
    if q.size + k.size >= _cpu.SMALL_BELOW:
        return None
    if outs is None:
        q_out, k_out = np.empty(q.shape, q.dtype), np.empty(k.shape, k.dtype)
    elif _small_outs(q, k, outs):
        q_out, k_out = outs
    else:
        return None
    # The kernel refuses a call only before writing it, but q is written before k is looked
    # at: so what could make it refuse k, a feature axis that is not contiguous or a stride
    # that is not a whole number of elements, is checked here first (k's positions are q's,
    # and k's overlap with the other arrays was tested). NumPy's aligned flag covers the
    # strides (the alignment of these dtypes is their size), at the cost of also sending a
    # misaligned data pointer, which the kernel would take, the general way.
    for a in (k, k_out):
        if a.strides[-1] != a.itemsize or not a.flags.aligned:
            return None
    tables, _, view, settings = plan
    settings += inverse
    calls = ((False, q, q_out, q_rows), (True, k, k_out, k_rows))
    for q_written, x, out, (positions, repeat_bits, _) in calls:
        x = None if out is x else x  # in place: the kernel's compile-time case
        if view is not None:  # a half type: the kernel takes its bits
            x = None if x is None else x.view(view)
            out = out.view(view)
        if not _cpu.rotate_rows(x, out, positions, tables, settings + repeat_bits):
            if q_written:
                raise RuntimeError("arrayrope: the fast path refused k after writing q (a bug)")
            return _refused(rope, q.dtype)
    return q_out, k_out


def _refused(rope, dtype):
    """The kernel refused a call before writing: the general path may grow the cache, so the
    plan is fetched anew next time."""
    rope._plans.pop(dtype, None)
    return None


def _small_rows(rope, x, pos):
    """(positions, repeat bits, highest known position) of the rows of ``x`` (see
    :func:`_row_positions`; the period is len(positions), or 1 for an int; the repeat bits are
    ``(repeat - 1) << 32``, ready to add to rotate_rows's settings, and 0 for the common
    repeat of 1, which keeps that int small and cheap to pass), where the fast path takes
    ``x``: a NumPy array of ``rope``'s head_dim. Otherwise None. (The kernel checks that the
    feature axis is contiguous.)"""
    if type(x) is not np.ndarray:
        return None
    shape = x.shape
    if not shape or shape[-1] != rope.head_dim:
        return None
    if type(pos) is int:
        if not 0 <= pos < POSITION_LIMIT:
            return None
        return pos, 0, pos
    if pos is None:
        if len(shape) == 1:
            return 0, 0, 0
        length = shape[-2]
        return _default_positions(rope, [shape[:-1]])[0].reshape(-1), 0, length - 1
    if type(pos) is np.ndarray and pos.dtype.kind in "iu":
        found = _row_positions(pos, shape[:-1])
        if found is None:
            return None
        positions, repeat = found
        repeat_bits = (repeat - 1) << 32  # the repeat as rotate_rows's settings carry it
        if positions.dtype is not _INT64:
            positions = positions.astype(_INT64)  # a wrapped uint64 turns negative: refused
        return positions, repeat_bits, 0  # the highest is left to the kernel, which refuses
    if isinstance(pos, np.integer):  # a NumPy integer scalar: the int it holds
        return _small_rows(rope, x, int(pos))
    return None


def _small_out(x, out):
    """Whether ``out`` (not ``x`` itself) suits the fast path: a writeable NumPy array of x's
    shape and dtype. The kernel checks that its feature axis is contiguous and that its memory
    does not overlap x's, before writing."""
    return (
        type(out) is np.ndarray
        and out.dtype == x.dtype
        and out.shape == x.shape
        and out.flags.writeable
    )


def _small_outs(q, k, outs):
    """Whether rotate_qk's ``outs`` suit the fast path: a pair, each its operand itself
    (writeable) or an array as :func:`_small_out` takes, sharing no memory with any other array
    of the call (a bounds test: what might overlap goes to the general path). The kernel tests
    an out against its own operand; the other pairs, and k's own (k is rotated after q has been
    written), are tested here."""
    if len(outs) != 2:
        return False
    q_out, k_out = outs
    for x, out in ((q, q_out), (k, k_out)):
        if out is x:
            if not out.flags.writeable:
                return False
        elif not _small_out(x, out):
            return False
    share = np.may_share_memory
    if share(q_out, k) or share(k_out, q) or share(q_out, k_out):
        return False
    return k_out is k or not share(k_out, k)


def _small_plan(rope, dtype, high):
    """What the fast path needs for an ``x`` of ``dtype`` whose highest known position is
    ``high``, made and kept in ``rope._plans`` where the one kept there has too few rows or
    none: (cos and sin stacked, cached rows, the integer view dtype of a half type or None,
    the kernel's settings: rotary_dim and style). None for a dtype the kernels do not take, or a
    position past the cache's cap."""
    global _cpu
    if _cpu is None:
        from . import _cpu
    table_dtype = _table_dtype(dtype)
    if table_dtype is None:
        return None
    tables = rope._default.tables.cached(np, None, table_dtype, high)
    if tables is None:
        return None
    view = None
    if dtype.itemsize == 2:
        view = np.dtype(np.int16 if dtype == np.float16 else np.uint16)
    settings = _cpu.small_settings(rope.rotary_dim, rope._half_style)
    plan = (tables, tables.shape[1], view, settings)
    rope._plans[dtype] = plan
    return plan


def _foreign(xs, outs, pos):
    """Whether anything arrives in a type other than NumPy or CuPy (DLPack, Dask)."""
    if not all(_family(x) for x in xs):
        return True
    if outs is not None and not all(_family(o) for o in outs):
        return True
    return hasattr(pos, "__dlpack__") and not _family(pos)


def _apply_foreign(rope, xs, pos, inverse, outs, backend, seq_len, names):
    """Framework arrays: view them as NumPy/CuPy (no copy), rotate, hand back their own type."""
    from . import _interop

    if any(_interop.is_dask(x) for x in xs):
        return _interop.rotate_dask(rope, xs, pos, inverse, outs, backend, seq_len)
    natives, restores = [], []
    for name, x in zip(names, xs):
        if _family(x):
            natives.append(x)
            restores.append(None)
        else:
            native, restore, _ = _interop.adopt(name, x)
            natives.append(native)
            restores.append(restore)
    native_outs = None
    if outs is not None:
        native_outs = []
        for i, out in enumerate(outs):
            name = "out" if len(outs) == 1 else f"out[{i}]"
            if i < len(xs) and out is xs[i] and not _family(out):
                native, read_only = natives[i], _interop.adopt(name, out)[2]
            elif _family(out):
                native, read_only = out, False
            else:
                native, _, read_only = _interop.adopt(name, out)
            if read_only:
                raise RopeValueError(
                    f"{name} is read-only ({_describe(out)}); rotate into a "
                    "writable array, or leave out unset"
                )
            native_outs.append(native)
    if hasattr(pos, "__dlpack__") and not _family(pos):
        pos = _interop.adopt("pos", pos)[0]
    results = apply(
        rope,
        tuple(natives),
        pos,
        inverse,
        None if native_outs is None else tuple(native_outs),
        backend,
        seq_len,
    )
    if outs is not None:
        return tuple(outs)  # written through their shared memory
    return tuple(r if restore is None else restore(r) for r, restore in zip(results, restores))


def apply(rope, xs, pos, inverse, outs, backend, seq_len):
    """Validate, resolve positions and tables, and rotate each of ``xs``. Returns a tuple."""
    names = ("x",) if len(xs) == 1 else ("q", "k")
    if _foreign(xs, outs, pos):
        return _apply_foreign(rope, xs, pos, inverse, outs, backend, seq_len, names)
    family = None
    for name, x in zip(names, xs):
        fam = _check_array(name, x, rope.head_dim)
        if family is None:
            family = fam
        elif fam != family:
            raise RopeTypeError(
                f"q and k must be arrays of one kind, got {_describe(xs[0])} and {_describe(x)}"
            )
    if len(xs) == 2:
        if xs[0].dtype != xs[1].dtype:
            raise RopeTypeError(f"q and k must share a dtype, got {xs[0].dtype} and {xs[1].dtype}")
        if family == "cupy" and xs[0].device != xs[1].device:
            raise RopeValueError(f"q is on device {xs[0].device.id}, k on device {xs[1].device.id}")
    if not isinstance(inverse, (bool, np.bool_)):
        raise RopeTypeError(f"inverse must be a bool, got {inverse!r}")
    if outs is not None:
        _check_outs(xs, outs, family, names)
    backend = _pick_backend(backend, family)
    launch = _launcher(backend)
    xp = _namespace(family)
    leads = [x.shape[:-1] for x in xs]
    values, is_int, high = _positions(rope, pos, leads)
    if family == "numpy" and _family(values) == "cupy":
        raise RopeTypeError("pos is a CuPy array but x is a NumPy array; pass host positions")
    if family == "cupy":
        with xs[0].device:  # tables, copies and launches on x's device
            return _run(rope, xs, outs, values, is_int, high, xp, family, launch, inverse, seq_len)
    return _run(rope, xs, outs, values, is_int, high, xp, family, launch, inverse, seq_len)


def _run(rope, xs, outs, values, is_int, high, xp, family, launch, inverse, seq_len):
    """Tables, results and the launch, for inputs that are already checked."""
    device = xs[0].device.id if family == "cupy" else None
    cos, sin, idx = _tables(
        rope,
        values,
        is_int,
        high,
        xp,
        device,
        _table_dtype(xs[0].dtype),
        _seq_len(rope, seq_len, high),
    )
    if family == "cupy":
        # Row indices go to the device before any geometry is read from them: the copy, not
        # the host array, is what the kernels address.
        idx, cos, sin = _device_rows(xp, device, idx, cos, sin)
    results = tuple(xp.empty_like(x) for x in xs) if outs is None else outs

    if launch is None:
        cos_rows, sin_rows = _gather(rope, xp, cos, sin, idx)
        rotate = _reference_rotate()
        for x, out in zip(xs, results):
            rotate(
                xp,
                x,
                cos_rows,
                sin_rows,
                style=rope.style,
                rotary_dim=rope.rotary_dim,
                inverse=bool(inverse),
                out=out,
            )
        return results

    fresh = results if outs is None else (None,) * len(xs)
    operands, write_back = _kernel_operands(xs, results, idx, xp, family, fresh)
    if operands:
        launch(rope, operands, cos, sin, bool(inverse))
    for temp, out in write_back:
        out[...] = temp
    return results


def _reference_rotate():
    from ._reference import rotate_reference

    return rotate_reference


def _kernel_ready(a):
    """Whether the kernels can address ``a`` as it is: contiguous features, whole-item strides."""
    if a.flags.c_contiguous:
        return True
    return a.strides[-1] == a.itemsize and all(s % a.itemsize == 0 for s in a.strides)


def _kernel_operands(xs, outs, idx, xp, family, fresh_outs):
    """(x, out, idx) triples shaped for the kernels, and temporaries to copy back afterwards.

    Leading axes keep their strides (no copy). A layout the kernels cannot address (features not
    contiguous) goes through a contiguous temporary: correct, at the cost of a copy. Every
    operand gets the same number of leading axes, at least one, and idx gets them too; an
    in-place operand is passed with ``out is x``.
    """
    nlead = max(1, max(x.ndim - 1 for x in xs))
    operands, write_back = [], []
    for x, out, fresh in zip(xs, outs, fresh_outs):
        if x.size == 0:
            continue
        in_place = out is x or (
            out is not fresh and _may_overlap(out, x, family) and _same_view(out, x, family)
        )
        if in_place:
            if not _kernel_ready(x):
                x = xp.ascontiguousarray(x)
                write_back.append((x, out))
            out = x
        else:
            if not _kernel_ready(x):
                x = xp.ascontiguousarray(x)
            if not _kernel_ready(out):
                temp = xp.empty(x.shape, x.dtype)
                write_back.append((temp, out))
                out = temp
        if x.ndim < nlead + 1:
            pad = (None,) * (nlead + 1 - x.ndim)
            padded = x[pad]
            out = padded if out is x else out[pad]
            x = padded
        if idx.ndim < nlead + 1:
            idx = idx[(None,) * (nlead + 1 - idx.ndim)]
        operands.append((x, out, idx))
    return operands, write_back


def _feature_size(name, x):
    shape = getattr(x, "shape", None)
    if shape is None or not isinstance(shape, tuple):
        raise RopeTypeError(f"{name} must be {ACCEPTED}, got {_describe(x)}")
    if len(shape) == 0:
        raise RopeValueError(f"{name} must have a feature axis (shape (..., d)), got a 0-d array")
    if shape[-1] % 2:
        raise RopeValueError(f"{name}.shape[-1] must be even, got {shape[-1]}")
    return shape[-1]


# The shared RoPEs without scaling, by (head_dim, base, style, rotary_dim): what rotate's fast
# path looks up (lru_cache's call costs more than the rest of its Python side).
_small_ropes = {}


@functools.lru_cache(maxsize=64)
def _cached_rope(head_dim, base, style, rotary_dim, scaling):
    from .rope import RoPE

    return RoPE(head_dim, base=base, style=style, rotary_dim=rotary_dim, scaling=scaling)


def shared_rope(head_dim, base, style, rotary_dim, scaling):
    """The one RoPE per configuration that the module-level functions share."""
    try:
        rope = _cached_rope(head_dim, base, style, rotary_dim, scaling)
        if scaling is None and rope._small:
            if len(_small_ropes) >= 64:  # as many as _cached_rope keeps
                _small_ropes.clear()
            _small_ropes[(rope.head_dim, base, style, rotary_dim)] = rope
        return rope
    except RopeError:
        raise
    except TypeError:  # an unhashable argument: let the constructor name it
        from .rope import RoPE

        return RoPE(head_dim, base=base, style=style, rotary_dim=rotary_dim, scaling=scaling)


def rotate(
    x,
    pos=None,
    *,
    base=10000.0,
    style="interleaved",
    rotary_dim=None,
    inverse=False,
    out=None,
    backend="auto",
    scaling=None,
    seq_len=None,
):
    """Rotate ``x`` (..., d) by rotary position embeddings; see :meth:`RoPE.rotate`.

    ``base``, ``style``, ``rotary_dim`` and ``scaling`` configure a RoPE of head_dim
    ``x.shape[-1]``; calls with one configuration share one RoPE and its cache.
    """
    if scaling is None and seq_len is None and type(x) is np.ndarray:
        # A decode step's way: the shared RoPE by one dict lookup, then the fast path.
        try:
            rope = _small_ropes.get((x.shape[-1], base, style, rotary_dim))
        except (TypeError, IndexError):  # unhashable, or a 0-d x: the general path says so
            rope = None
        if rope is not None and (backend == "auto" or backend == "numba"):
            small = rotate_small(rope, x, pos, inverse, out)
            if small is not None:
                return small
            outs = None if out is None else (out,)
            return apply(rope, (x,), pos, inverse, outs, backend, seq_len)[0]
    rope = shared_rope(_feature_size("x", x), base, style, rotary_dim, scaling)
    return rope.rotate(x, pos, inverse=inverse, out=out, backend=backend, seq_len=seq_len)


def rotate_qk(
    q,
    k,
    pos=None,
    *,
    base=10000.0,
    style="interleaved",
    rotary_dim=None,
    inverse=False,
    out=None,
    backend="auto",
    scaling=None,
    seq_len=None,
):
    """Rotate queries and keys in one pass; returns (q_rot, k_rot). See :meth:`RoPE.rotate_qk`."""
    if scaling is None and seq_len is None and type(q) is np.ndarray:
        # A decode step's way, as in rotate: the shared RoPE by one dict lookup, then the fast
        # path (out None or a tuple of two; RoPE.rotate_qk checks other values).
        try:
            rope = _small_ropes.get((q.shape[-1], base, style, rotary_dim))
        except (TypeError, IndexError):  # unhashable, or a 0-d q: the general path says so
            rope = None
        if (
            rope is not None
            and (backend == "auto" or backend == "numba")
            and (out is None or (type(out) is tuple and len(out) == 2))
        ):
            small = rotate_qk_small(rope, q, k, pos, inverse, out)
            if small is not None:
                return small
            return apply(rope, (q, k), pos, inverse, out, backend, seq_len)
    rope = shared_rope(_feature_size("q", q), base, style, rotary_dim, scaling)
    return rope.rotate_qk(q, k, pos, inverse=inverse, out=out, backend=backend, seq_len=seq_len)


def cos_sin(rope, pos, like, seq_len):
    """See :meth:`RoPE.cos_sin`."""
    if pos is None:
        raise RopeValueError("pos is required for cos_sin")
    if like is None:
        family, dtype, device = "numpy", np.dtype(np.float32), None
    else:
        family = _family(like)
        if not family:
            raise RopeTypeError(f"like must be a NumPy or CuPy array, got {_describe(like)}")
        dtype = _table_dtype(like.dtype)
        if dtype is None:
            raise RopeTypeError(
                f"like must be float16, bfloat16, float32 or float64, got dtype {like.dtype}"
            )
        device = like.device.id if family == "cupy" else None
    xp = _namespace(family)
    shape = getattr(pos, "shape", np.shape(pos))
    lead = tuple(shape) if rope.n_axes == 1 else tuple(shape[:-1])
    values, is_int, high = _positions(rope, pos, [lead])
    seq_len = _seq_len(rope, seq_len, high)
    if family == "cupy":
        with like.device:  # tables and results on like's device
            cos, sin, idx = _tables(rope, values, is_int, high, xp, device, dtype, seq_len)
            idx, cos, sin = _device_rows(xp, device, idx, cos, sin)
            return _gather(rope, xp, cos, sin, idx)
    cos, sin, idx = _tables(rope, values, is_int, high, xp, device, dtype, seq_len)
    return _gather(rope, xp, cos, sin, idx)
