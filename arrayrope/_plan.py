"""Plans: what a call's layout decides, checked and worked out once.

A plan is built for one layout of a call (array family, dtypes, shapes, strides, flags, kind of
out, kind of positions, backend) by :func:`build`, which makes every check that depends on the
layout alone and raises the errors of bad input. Running it does only what depends on values and
addresses: the positions' range, the overlap of outputs with inputs, the tables.

Two launch strategies:
- the CPU backend's rows plan (``backends.cpu.rows_plan``): its one-thread row kernel takes
  the arrays as they are (decode and prefill sizes, one position axis, positions in a row
  pattern). The kernel checks positions and overlap before writing, and hands anything else
  back to the plan's general twin;
- :class:`GeneralPlan`: every other call, on every backend: positions resolved into table rows,
  operands shaped for the kernels' flat views (through temporaries where a kernel cannot
  address an array), one launch for q and k. NumPy calls whose positions reach past the cache
  take the routes of ``_past_cap``.
"""

import numpy as np

from . import _arrays, _past_cap, _positions, backends
from ._arrays import CUPY, NUMPY
from ._errors import RopeTypeError, RopeValueError
from ._positions import ARRAY, INT, NONE
from ._spec import check_inverse
from ._tables import checked_rows
from .backends import check_name
from .backends import module as backend_module


def _pick_backend(backend, array_family):
    if backend == "auto":
        return "numba" if array_family == NUMPY else "cupy"
    check_name(backend)
    if backend == "numba" and array_family != NUMPY:
        raise RopeValueError(
            "backend='numba' takes NumPy arrays; for CuPy arrays use 'cupy' or 'numba-cuda'"
        )
    if backend in ("cupy", "numba-cuda") and array_family != CUPY:
        raise RopeValueError(
            f"backend={backend!r} takes CuPy arrays, got NumPy arrays; use 'numba' or 'numpy'"
        )
    return backend


def _check_outs(xs, outs, array_family, names):
    """The layout-only checks of ``out``: one array per operand, of the operand's family,
    shape, dtype and device, writable, not another operand, and no two of its elements in one
    place (parallel writes there would race)."""
    if len(outs) != len(xs):
        raise RopeTypeError(f"out must hold {len(xs)} arrays, got {len(outs)}")
    for i, (x, out) in enumerate(zip(xs, outs)):
        name = "out" if len(xs) == 1 else f"out[{i}]"
        if _arrays.family(out) != array_family:
            raise RopeTypeError(
                f"{name} must be a {'CuPy' if array_family == CUPY else 'NumPy'} array like "
                f"{names[i]}, got {_arrays.describe(out)}"
            )
        if out.shape != x.shape or out.dtype != x.dtype:
            raise RopeValueError(
                f"{name} must have {names[i]}'s shape {x.shape} and dtype {x.dtype}, "
                f"got shape {out.shape} and dtype {out.dtype}"
            )
        if array_family == NUMPY and not out.flags.writeable:
            raise RopeValueError(f"{name} is read-only")
        if array_family == CUPY and out.device != x.device:
            raise RopeValueError(
                f"{name} is on device {out.device.id}, {names[i]} on device {x.device.id}"
            )
        for j, other in enumerate(xs):
            if out is other and i != j and out.size:
                raise RopeValueError(f"{name} is {names[j]}: it would be overwritten first")
        if i == 1 and out is outs[0] and out.size:
            raise RopeValueError("out[0] and out[1] are one array: k would overwrite q")
        if _arrays.self_overlapping(out):
            raise RopeValueError(
                f"{name} has elements that share memory (strides {out.strides} for shape "
                f"{out.shape}): pass an array whose elements are distinct"
            )


def build(engine, xs, outs, kind, pos, backend):
    """The plan for a call on arrays of a known family (NumPy or CuPy); raises for bad input."""
    array_family, backend = checked(engine, xs, outs, kind, pos, backend)
    general = GeneralPlan(engine, xs, outs, kind, backend, array_family)
    if backend == "numba":
        rows = backend_module("numba").rows_plan(engine, xs, outs, kind, pos, general)
        if rows is not None:
            return rows
    return general


def checked(engine, xs, outs, kind, pos, backend):
    """(array family, backend) of a call whose layout passes every check; raises otherwise."""
    spec = engine.spec
    names = ("x",) if len(xs) == 1 else ("q", "k")
    array_family = _arrays.family(xs[0])
    for name, x in zip(names, xs):
        if _arrays.family(x) != array_family:
            raise RopeTypeError(
                "q and k must be arrays of one kind, got "
                f"{_arrays.describe(xs[0])} and {_arrays.describe(x)}"
            )
        _arrays.check_float(name, x, spec.head_dim)
    if len(xs) == 2:
        if xs[0].dtype != xs[1].dtype:
            raise RopeTypeError(f"q and k must share a dtype, got {xs[0].dtype} and {xs[1].dtype}")
        if array_family == CUPY and xs[0].device != xs[1].device:
            raise RopeValueError(f"q is on device {xs[0].device.id}, k on device {xs[1].device.id}")
    if outs is not None:
        _check_outs(xs, outs, array_family, names)
    backend = _pick_backend(backend, array_family)
    leads = [x.shape[:-1] for x in xs]
    if kind == ARRAY:
        if array_family == NUMPY and _arrays.family(pos) == CUPY:
            raise RopeTypeError("pos is a CuPy array but x is a NumPy array; pass host positions")
        _positions.with_axes(pos, spec.n_axes, leads)
    return array_family, backend


def _filled(engine):
    """Whether kernels may make rows past the engine's table (see CosSinTables.filled); an
    engine of caller-supplied tables (apply_cos_sin) has none to make."""
    freq_set = getattr(engine, "freq_set", None)
    return freq_set is None or freq_set(None).tables.filled


class GeneralPlan:
    """Every call the row kernel does not take, on every backend."""

    def __init__(self, engine, xs, outs, kind, backend, array_family):
        self.engine = engine
        self.spec = engine.spec
        self.kind = kind
        self.family = array_family
        self.xp = _arrays.namespace(array_family)
        self.backend = backend
        self.launch = backend_module(backend).launch
        # the CPU's route for positions past the cache (see _past_cap.filled)
        self.launch_filled = backend_module(backend).launch_filled if backend == "numba" else None
        self.table_dtype = _arrays.compute_dtype(xs[0].dtype)
        # the reference works on any layout; the kernels address some through temporaries
        self.any_layout = backend == "numpy"
        # Positions on a device, for a kernel there: checked by the kernel (backends.cuda._flag),
        # except for transformers' tables, whose rows past the table only the host makes: their
        # range is read on the host, as the reference's is
        self.device_checked = array_family == CUPY and backend != "numpy" and _filled(engine)
        self.device = backends.device() if array_family == CUPY else None  # the GPU's hook
        self.in_place = tuple(outs is not None and out is x for x, out in zip(xs, outs or xs))
        self.nlead = max(1, max(x.ndim - 1 for x in xs))
        # NumPy operands that a kernel takes as they are (see operand), known from the layout
        self.as_they_are = array_family == NUMPY and all(
            x.size
            and x.ndim == self.nlead + 1
            and _arrays.addressable(x, NUMPY)
            and (x.flags.c_contiguous if outs is None else _arrays.addressable(out, NUMPY))
            for x, out in zip(xs, outs or xs)
        )
        # Calls of positions 0..T-1 whose launch can be replayed (see _replay), and the launch
        self.replays = kind == NONE and self.as_they_are and backend == "numba"
        self.replays = self.replays and not self.spec.dynamic
        self.replay = None

    def rotate(self, x, pos, inverse, out, seq_len):
        return self.run((x,), pos, inverse, None if out is None else (out,), seq_len)[0]

    def run(self, xs, pos, inverse, outs, seq_len):
        """Rotate ``xs`` (checked by :func:`build` for this plan); returns the results."""
        inverse = check_inverse(inverse)
        if self.family == CUPY:
            with xs[0].device:  # tables, copies and launches on x's device
                return self._run(xs, pos, inverse, outs, seq_len)
        return self._run(xs, pos, inverse, outs, seq_len)

    def _positions(self, xs, pos, seq_len):
        """(values, is_int, highest) per operand: values int64 or float64 of shape P + (1 or
        n_axes,), on the host or (CuPy positions) the device. Device positions for a kernel
        are checked by the kernel, and their highest value is None (unknown): reading it would
        wait for the device. A length-dependent rule without seq_len reads it all the same."""
        if self.kind == NONE:
            found = []
            for x in xs:
                length = x.shape[-2] if x.ndim > 1 else 1
                found.append((_positions.defaults(length), True, length - 1))
            return found
        if self.kind == INT:
            values = np.full((1, 1), _positions.check_int(pos), dtype=np.int64)
            return [(values, True, pos)] * len(xs)
        values = _positions.with_axes(pos, self.spec.n_axes, [x.shape[:-1] for x in xs])
        values = _arrays.aligned(values)
        if values.size == 0:
            dtype = np.int64 if values.dtype.kind in "iu" else np.float64
            return [(values.astype(dtype), dtype == np.int64, -1)] * len(xs)
        if (
            self.device_checked
            and _arrays.family(values) == CUPY
            and not (self.spec.dynamic and seq_len is None)
        ):
            is_int = values.dtype.kind in "iu"
            values = values.astype(np.int64 if is_int else np.float64, copy=False)
            return [(values, is_int, None)] * len(xs)
        return [_positions.check_values(values)] * len(xs)

    def _frequencies(self, resolved, seq_len):
        """(the highest position, -1 where the host does not know it; the frequency set's
        tables for the call's length)."""
        high = -1 if resolved[0][2] is None else max(h for _, _, h in resolved)
        seq_len = _positions.seq_len_for(self.spec.dynamic, seq_len, high)
        return high, self.engine.freq_set(seq_len).tables

    def _tables(self, resolved, seq_len, high, tables, capture, device):
        """cos, sin and one idx per operand: int64 rows of the frequency set's ``tables``,
        shaped like its positions. ``capture``: the call is being captured in a CUDA graph, so
        it reads the table as it is (growing it would copy from the host). ``device``: the
        current device's id, None for NumPy."""
        unknown = resolved[0][2] is None  # device positions: all operands share them
        xp = self.xp
        if all(is_int for _, is_int, _ in resolved):
            if capture:
                cached = tables.existing(device, self.table_dtype)
                if cached is None or not (unknown or high < cached.shape[1]):
                    past_cap = not unknown and high >= tables.cap(self.table_dtype)
                    raise RopeValueError(
                        "the current stream is capturing a CUDA graph, and this call needs cos/"
                        "sin rows the device does not have: "
                        + (
                            "a position past the table's cap takes rows from the host each "
                            "time; pass it as int64 positions on the device"
                            if past_cap
                            else "make the same call once before capturing"
                        )
                    )
            elif unknown:
                # rows for the longest axis of positions (a prefill from 0), or seq_len's;
                # the kernel computes rows past them
                longest = max(resolved[0][0].shape[:-1], default=1)
                cached = tables.at_least(xp, device, self.table_dtype, max(longest, seq_len or 0))
            else:
                cached = tables.cached(xp, device, self.table_dtype, max(int(high), 0))
            if cached is not None:
                return cached[0], cached[1], [values for values, _, _ in resolved]
        # Real-valued positions, or integers past the cache: one row per position entry.
        rows, idxs, count = [], [], 0
        for values, _, _ in resolved:
            if any(values is seen for seen in rows):
                idxs.append(idxs[[id(v) for v in rows].index(id(values))])
                continue
            rows.append(values)
            value_xp = _arrays.namespace_of(values)
            n = values.size // values.shape[-1]
            idx = value_xp.arange(count, count + n, dtype=np.int64)
            idxs.append(idx.reshape(values.shape[:-1] + (1,)))
            count += n
        flat = [v.reshape(-1, v.shape[-1]) for v in rows]
        value_xp = _arrays.namespace_of(flat[0])
        flat = flat[0] if len(flat) == 1 else value_xp.concatenate(flat)
        if value_xp is np and all(is_int for _, is_int, _ in resolved):
            cos, sin = checked_rows(tables, self.table_dtype, flat)
            return cos, sin, idxs
        flat = flat.astype(np.float64, copy=False)
        if unknown:
            flat = self.device.mark_invalid(xp, device, flat)
        cos, sin = tables.exact(value_xp, self.table_dtype, flat)
        return cos, sin, idxs  # host rows for a device: copied by device_rows

    def _device(self):
        return None if self.family == NUMPY else self.xp.cuda.Device().id

    def _run(self, xs, pos, inverse, outs, seq_len):
        replay = self.replay  # read once: another thread's call may drop it
        if replay is not None and seq_len is None:
            results = self._replay(replay, xs, outs, inverse)
            if results is not None:
                return results
        xp, capture, device = self.xp, False, None if self.family == NUMPY else self._device()
        if self.device is not None:
            capture = self.device.begin(xp, device)
            if capture:
                self._check_capturable(xs, pos, outs, seq_len)
        resolved = self._positions(xs, pos, seq_len)
        high, tables = self._frequencies(resolved, seq_len)
        if self.family == NUMPY and self._past_cap(resolved, high, tables):
            results, in_place = self._results(xs, outs)
            args = (self, xs, resolved, tables, inverse, results, in_place)
            if not _past_cap.filled(*args):
                _past_cap.in_blocks(*args)
            return results
        if resolved[0][2] is None:  # positions the kernel checks: report at exit what is left
            self.device.arm(xp)
        cos, sin, idxs = self._tables(resolved, seq_len, high, tables, capture, device)
        if self.device is not None:
            idxs, cos, sin = self.device.device_rows(xp, device, idxs, cos, sin)
        results, in_place = self._results(xs, outs)
        operands, write_back = [], []
        if self.as_they_are:
            for x, out, idx, same in zip(xs, results, idxs, in_place):
                idx = self._leading(idx)
                operands.append((out, out, idx) if same else (x, out, idx))
        else:
            for x, out, idx, same in zip(xs, results, idxs, in_place):
                if x.size:
                    operands.append(self.operand(x, out, idx, same, write_back))
        if operands:
            if self.device_checked:  # rows past the table are the kernel's to compute
                freqs = tables if resolved[0][2] is None else None  # device positions only
                self.launch(self.spec, operands, cos, sin, inverse, freqs=freqs, capture=capture)
            else:
                self.launch(self.spec, operands, cos, sin, inverse)
            # recorded from a call rotated in place only where its layout says so (out is x):
            # an out that is another view of x's memory makes its launch an in-place one
            if (
                self.replays
                and self.replay is None
                and seq_len is None
                and in_place == self.in_place
            ):
                run = backend_module(self.backend).replay(self.spec, operands, cos, sin)
                idxs = [idx for _, _, idx in operands]
                self.replay = None if run is None else (run, tables, cos.shape, idxs)
        for temp, out in write_back:
            _arrays.assign(out, temp)
        return results

    def _replay(self, replay, xs, outs, inverse):
        """The results of a call whose launch is the plan's first one's (see
        backends.cpu.replay), made again without working out its positions, table rows and
        kernel calls anew: positions 0..T-1 are the layout's, and so are the rows while the
        frequency set's table keeps its size. None where this call needs the full way: the table
        grown or dropped, an out sharing memory with an input or the other out (which the full
        way tells in place from partial overlap, and refuses), or a launch decided otherwise
        (see backends.cpu.replay). ``replay``: the plan's record of its launch."""
        run, tables, shape, idxs = replay
        stack = tables.existing(None, self.table_dtype)
        if stack is None or stack.shape[1:] != shape:
            self.replay = None  # the full way records the launch for the table as it is now
            return None
        if outs is None:
            results = tuple(np.empty_like(x) for x in xs)
        else:
            for i, out in enumerate(outs):
                for j, x in enumerate(xs):
                    if not (self.in_place[i] and i == j) and np.may_share_memory(out, x):
                        return None
            if len(outs) == 2 and np.may_share_memory(outs[0], outs[1]):
                return None
            results = outs
        operands = [
            (out, out, idx) if same else (x, out, idx)
            for x, out, idx, same in zip(xs, results, idxs, self.in_place)
        ]
        return results if run(operands, stack[0], stack[1], inverse) else None

    def _past_cap(self, resolved, high, tables):
        """Whether the call's positions are integers reaching past the cache's cap. Such a
        NumPy call takes no per-call table as large as itself: it runs filled
        (``_past_cap.filled``) or in blocks (``_past_cap.in_blocks``)."""
        return high >= tables.cap(self.table_dtype) and all(i for _, i, _ in resolved)

    def _results(self, xs, outs):
        """The result arrays (new ones, or ``outs``) and, per operand, whether it is rotated in
        place (see :meth:`_overlaps`)."""
        if outs is None:
            return tuple(self.xp.empty_like(x) for x in xs), (False,) * len(xs)
        return outs, self._overlaps(xs, outs)

    def _check_capturable(self, xs, pos, outs, seq_len):
        """Raise for a call that cannot be captured in a CUDA graph: one that would read the
        host, or make a device temporary (the graph keeps its address; the memory is freed when
        the call returns)."""
        why = None
        if self.kind == ARRAY and _arrays.family(pos) == CUPY:
            if pos.dtype != np.int64:
                why = f"pos is a device array of {pos.dtype}: give int64 positions"
            elif _arrays.pointer(pos, CUPY) % 8:
                why = "pos is not aligned to 8 bytes, and would be copied"
            elif self.spec.dynamic and seq_len is None:
                why = "a length-dependent rule needs seq_len (max(pos) would be read)"
        if not self.device_checked:
            why = (
                "backend='numpy' reads positions and makes temporaries"
                if self.backend == "numpy"
                else "angles='transformers' reads device positions on the host"
            )
        elif self.backend == "numba-cuda":
            why = "numba-cuda synchronizes the stream of each array it is given"
        for i, x in enumerate(xs):
            out = x if outs is None else outs[i]
            if not (_arrays.addressable(x, CUPY) and _arrays.addressable(out, CUPY)):
                why = "an operand is a layout the kernels reach through a temporary"
        if why is not None:
            raise RopeValueError(
                f"the current stream is capturing a CUDA graph, and this call cannot be "
                f"captured: {why}"
            )

    def _overlaps(self, xs, outs):
        """Per operand, whether its out is it (in place, through any view); raises where an out
        overlaps an input or the other out partially. Depends on addresses: checked per call."""
        names = ("x",) if len(xs) == 1 else ("q", "k")
        same = []
        for i, out in enumerate(outs):
            name = "out" if len(xs) == 1 else f"out[{i}]"
            in_place = self.in_place[i]
            for j, other in enumerate(xs):
                if in_place and i == j or not out.size or not other.size:
                    continue
                found = _arrays.overlap_kind(out, other, self.family)
                if found == "same" and i == j:
                    in_place = True
                elif found != "none":
                    raise RopeValueError(
                        f"{name} overlaps {names[j]} partially; pass distinct memory, or "
                        f"{names[i]} itself to rotate in place"
                    )
            same.append(in_place)
        if len(outs) == 2 and outs[0].size and outs[1].size:
            if _arrays.overlap_kind(outs[0], outs[1], self.family) != "none":
                raise RopeValueError("out[0] and out[1] overlap")
        return tuple(same)

    def operand(self, x, out, idx, in_place, write_back):
        """(x, out, idx) shaped for the kernels: every operand with the same number of leading
        axes, and through a temporary where a kernel cannot address an array (an in-place
        operand is passed with ``out is x``)."""
        xp, fam = self.xp, self.family
        # copy() makes a fresh C-order array, aligned where a contiguous view may not be
        if in_place:
            x = out  # one layout at one address; x may be a read-only view of a writable out
            if not _arrays.ready(x, fam, self.any_layout):
                temp = _arrays.copy(x)
                write_back.append((temp, out))
                x = temp
            out = x
        else:
            if not _arrays.ready(x, fam, self.any_layout):
                x = _arrays.copy(x)
            if not _arrays.ready(out, fam, self.any_layout):
                temp = xp.empty(x.shape, x.dtype)
                write_back.append((temp, out))
                out = temp
        if x.ndim < self.nlead + 1:
            pad = (None,) * (self.nlead + 1 - x.ndim)
            padded = x[pad]
            out = padded if out is x else out[pad]
            x = padded
        return x, out, self._leading(idx)

    def _leading(self, idx):
        """``idx`` with leading axes of size 1 up to the kernels' number of leading axes."""
        if idx.ndim < self.nlead + 1:
            idx = idx[(None,) * (self.nlead + 1 - idx.ndim)]
        return idx
