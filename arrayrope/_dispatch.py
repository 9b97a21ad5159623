"""The one path of every call: adopt foreign arrays, find the plan of the call's layout, run it.

Each RoPE owns an :class:`Engine`. A call is looked up by a key of what its layout is: for each
array its family, dtype, shape, strides and flags; the kind of out (none, the operand itself,
another array) and of positions (none, an int, an array's dtype and shape); the backend. A miss
builds the plan (``_plan.build``: every check of the layout, once); a hit runs it, which does
only what depends on values and addresses. NumPy arrays with int, None or NumPy positions take
the shortest way to the key, written out in :meth:`Engine.rotate` for a decode step's sake.
"""

import numpy as np

from . import _arrays, _interop, _plan, _positions, _registry
from ._arrays import CUPY, FOREIGN, NUMPY
from ._cache import Bounded
from ._errors import RopeTypeError, RopeValueError
from ._positions import ARRAY, INT, NONE
from ._tables import checked_rows, gather

_NDARRAY = np.ndarray


def _array_key(a, array_family):
    if array_family == NUMPY:
        return (NUMPY, a.dtype, a.shape, a.strides, a.flags.num)
    return (CUPY, a.dtype, a.shape, a.strides, a.device.id)


def _pos_key(kind, pos):
    if kind == ARRAY:
        return _array_key(pos, _arrays.family(pos))
    return kind


def plan_key(xs, kind, pos, outs, backend):
    """The key of a call's plan. For NumPy operands, :meth:`Engine.rotate` and
    :meth:`Engine.rotate_qk` build the same tuple inline."""
    array_family = _arrays.family(xs[0])
    key = _array_key(xs[0], array_family)
    if len(xs) == 2:
        key += (_array_key(xs[1], _arrays.family(xs[1])),)
    return key + (_pos_key(kind, pos), _outs_key(xs, outs), backend)


def _outs_key(xs, outs):
    """What the plan needs of ``outs``: per out, the index of the operand it is, or its
    layout (one operand: that entry alone)."""
    if outs is None:
        return None
    key = []
    for out in outs:
        for j, x in enumerate(xs):
            if out is x:
                key.append(j)
                break
        else:
            key.append(_array_key(out, _arrays.family(out)))
    return key[0] if len(xs) == 1 else tuple(key)


class Engine:
    """Plans and the one path for the calls on one RoPE (``spec``, and ``freq_set(seq_len)``
    giving the frequencies and tables for a length). ``owner`` is the RoPE, which Dask graphs
    carry to their workers, and ``mode`` names this engine among its (rotate, shift, undo)."""

    __slots__ = ("spec", "freq_set", "owner", "mode", "plans", "key", "__weakref__")

    def __init__(self, spec, freq_set, owner, mode):
        self.spec = spec
        self.freq_set = freq_set
        self.owner = owner
        self.mode = mode
        self.plans = Bounded(256)
        self.key = _registry.register(self)  # how framework operators name it

    def rotate(self, x, pos, inverse, out, backend, seq_len):
        if type(x) is _NDARRAY:
            if pos is None:
                pos_key = NONE
            elif type(pos) is int:
                pos_key = INT
            elif type(pos) is _NDARRAY:
                pos_key = (NUMPY, pos.dtype, pos.shape, pos.strides, pos.flags.num)
            else:
                pos_key = None
            if out is None:
                out_key = None
            elif out is x:
                out_key = 0
            elif type(out) is _NDARRAY:
                out_key = (NUMPY, out.dtype, out.shape, out.strides, out.flags.num)
            else:
                pos_key = None
            if pos_key is not None:
                key = (NUMPY, x.dtype, x.shape, x.strides, x.flags.num, pos_key, out_key, backend)
                plan = self.plans.get(key)
                if plan is not None:
                    return plan.rotate(x, pos, inverse, out, seq_len)
        elif type(x).__module__ == "torch" and (routed := _interop.torch_routed) is not None:
            # a torch.Tensor, once arrayrope's torch module is loaded (told by its class's module,
            # not by torch.Tensor itself: see _interop)
            if (
                out is None
                and (pos is None or type(pos) is int)
                and (native := _interop.eager_view(x)) is not None
            ):  # an eager decode step on a CPU tensor: its memory as NumPy, the result back
                # (the NumPy way's plan looked up here, as above: a call less)
                plan = self.plans.get(
                    (
                        NUMPY,
                        native.dtype,
                        native.shape,
                        native.strides,
                        native.flags.num,
                        NONE if pos is None else INT,
                        None,
                        backend,
                    )
                )
                if plan is None:
                    return _interop.from_numpy(
                        self.rotate(native, pos, inverse, None, backend, seq_len)
                    )
                return _interop.from_numpy(plan.rotate(native, pos, inverse, None, seq_len))
            found = routed(self.key, x, pos, inverse, out, backend, seq_len)
            if found is not None:
                return found
        elif _interop.torch_ops_wanted(x, pos, out):
            return _interop.torch_ops().rotate(self.key, x, pos, inverse, out, backend, seq_len)
        if type(x) is not _NDARRAY and (out is None or out is x):
            adopt = _interop.fast_adopter(type(x))
            found = None if adopt is None else adopt(x)
            if found is not None:  # a torch or JAX array on the CPU, viewed as NumPy
                native, new, back = found
                if type(pos) is type(x):  # positions of the same kind, viewed alike
                    found = adopt(pos)
                    pos = pos if found is None else found[0]
                elif _interop.traced_beside(pos, x):
                    raise _interop.traced_beside_error("x", x)
                if out is None:
                    if new is not None and not _interop.jax_traced(pos):
                        (out,) = new(native)
                    return back(self.rotate(native, pos, inverse, out, backend, seq_len))
                if native.flags.writeable:
                    self.rotate(native, pos, inverse, native, backend, seq_len)
                    return x
        outs = None if out is None else (out,)
        if _interop.jax_traced(x, pos):
            return _interop.jax_ops().rotate(self.key, (x,), pos, inverse, outs, backend,
                                             seq_len)[0]  # fmt: skip
        return self.run((x,), pos, inverse, outs, backend, seq_len)[0]

    def rotate_qk(self, q, k, pos, inverse, out, backend, seq_len):
        if type(q) is not _NDARRAY:
            if type(q).__module__ == "torch" and (routed := _interop.torch_routed_qk) is not None:
                found = routed(self.key, q, k, pos, inverse, out, backend, seq_len)
                if found is not None:
                    return found
            elif _interop.torch_ops_wanted(q, pos, out, k):
                return _interop.torch_ops().rotate_qk(
                    self.key, q, k, pos, inverse, out, backend, seq_len
                )
        if out is None and type(q) is type(k) and type(q) is not _NDARRAY:
            adopt = _interop.fast_adopter(type(q))
            found = None if adopt is None else (adopt(q), adopt(k))
            if found is not None and found[0] is not None and found[1] is not None:
                kind = type(q)
                q_given = q
                (q, new, back), (k, _, _) = found  # torch or JAX arrays on the CPU, as NumPy
                if type(pos) is kind:
                    found = adopt(pos)
                    pos = pos if found is None else found[0]
                elif _interop.traced_beside(pos, q_given):
                    raise _interop.traced_beside_error("q", q_given)
                out = None if new is None or _interop.jax_traced(pos) else new(q, k)
                q_rot, k_rot = self.rotate_qk(q, k, pos, inverse, out, backend, seq_len)
                return back(q_rot), back(k_rot)
        if type(q) is _NDARRAY and type(k) is _NDARRAY and out is None:
            if pos is None:
                pos_key = NONE
            elif type(pos) is int:
                pos_key = INT
            elif type(pos) is _NDARRAY:
                pos_key = (NUMPY, pos.dtype, pos.shape, pos.strides, pos.flags.num)
            else:
                pos_key = None
            if pos_key is not None:
                key = (
                    NUMPY,
                    q.dtype,
                    q.shape,
                    q.strides,
                    q.flags.num,
                    (NUMPY, k.dtype, k.shape, k.strides, k.flags.num),
                    pos_key,
                    None,
                    backend,
                )
                plan = self.plans.get(key)
                if plan is not None:
                    return plan.run((q, k), pos, inverse, None, seq_len)
        if out is not None:
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise RopeTypeError(
                    f"out must be None or a pair (q_out, k_out), got {type(out).__name__}"
                )
            out = tuple(out)
        if _interop.jax_traced(q, k, pos):
            return _interop.jax_ops().rotate(self.key, (q, k), pos, inverse, out, backend, seq_len)
        return self.run((q, k), pos, inverse, out, backend, seq_len)

    def run(self, xs, pos, inverse, outs, backend, seq_len):
        """Any call: foreign arrays adopted, positions resolved, the plan found or built."""
        if any(not _arrays.family(x) for x in xs) or (
            outs is not None and any(not _arrays.family(o) for o in outs)
        ):
            return self._foreign(xs, pos, inverse, outs, backend, seq_len)
        kind, pos = _positions.resolve(_interop.native_positions(pos), self.spec.n_axes)
        key = plan_key(xs, kind, pos, outs, backend)
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans.put(key, _plan.build(self, xs, outs, kind, pos, backend))
        return plan.run(xs, pos, inverse, outs, seq_len)

    def _foreign(self, xs, pos, inverse, outs, backend, seq_len):
        """Arrays from other frameworks: viewed as NumPy or CuPy (no copy), rotated on this
        path, and handed back as their own type; Dask arrays as a lazy graph."""
        names = ("x",) if len(xs) == 1 else ("q", "k")
        if any(_interop.is_dask(x) for x in xs):
            from . import _dask

            return _dask.rotate_dask(
                self.owner, self.mode, xs, pos, inverse, outs, backend, seq_len
            )
        natives, restores = [], []
        for name, x in zip(names, xs):
            if _arrays.family(x):
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
                if i < len(xs) and out is xs[i] and _arrays.family(out) == FOREIGN:
                    native, read_only = natives[i], _interop.adopt(name, out, True)[2]
                elif _arrays.family(out):
                    native, read_only = out, False
                else:
                    native, _, read_only = _interop.adopt(name, out, True)
                if read_only:
                    raise RopeValueError(
                        f"{name} is read-only ({_arrays.describe(out)}); rotate into a "
                        "writable array, or leave out unset"
                    )
                native_outs.append(native)
            native_outs = tuple(native_outs)
        with _interop.framework_stream(xs + (outs or ())):
            results = self.run(tuple(natives), pos, inverse, native_outs, backend, seq_len)
        if outs is not None:
            return tuple(outs)  # written through their shared memory
        return tuple(r if restore is None else restore(r) for r, restore in zip(results, restores))

    def cos_sin(self, pos, like, seq_len):
        """See :meth:`RoPE.cos_sin`."""
        if pos is None:
            raise RopeValueError("pos is required for cos_sin")
        restore = None
        if like is None:
            array_family, dtype = NUMPY, np.dtype(np.float32)
        else:
            array_family = _arrays.family(like)
            if not array_family:
                like, restore, _ = _interop.adopt("like", like)
                array_family = _arrays.family(like)
            dtype = _arrays.compute_dtype(like.dtype)
            if dtype is None:
                raise RopeTypeError(
                    f"like must be float16, bfloat16, float32 or float64, got dtype {like.dtype}"
                )
        kind, values = _positions.resolve(_interop.native_positions(pos), self.spec.n_axes)
        if CUPY in (array_family, _arrays.family(values)):
            from . import backends

            backends.device().refuse_during_capture(_arrays.namespace(CUPY), "cos_sin on a device")
        if kind == INT:
            values = np.asarray(values)
        shape = values.shape
        lead = tuple(shape) if self.spec.n_axes == 1 else tuple(shape[:-1])
        values = _positions.with_axes(values, self.spec.n_axes, [lead])
        if values.size:
            values, is_int, high = _positions.check_values(values)
        else:
            is_int, high = values.dtype.kind in "iu", -1
        seq_len = _positions.seq_len_for(self.spec.dynamic, seq_len, high)
        tables = self.freq_set(seq_len).tables
        xp = _arrays.namespace(array_family)
        if array_family == CUPY:
            with like.device:
                cos, sin = self._cos_sin(xp, tables, values, is_int, high, dtype, like.device.id)
        else:
            cos, sin = self._cos_sin(xp, tables, values, is_int, high, dtype, None)
        if restore is not None:
            cos, sin = restore(cos), restore(sin)
        return cos, sin

    def _cos_sin(self, xp, tables, values, is_int, high, dtype, device):
        cached = tables.cached(xp, device, dtype, max(int(high), 0)) if is_int else None
        if cached is not None:
            cos, sin = cached[0], cached[1]
            idx = xp.asarray(values)
        else:
            value_xp = _arrays.namespace_of(values)
            flat = values.reshape(-1, values.shape[-1])
            if is_int and value_xp is np:  # the kernels' rows past the cache: the same values
                cos, sin = checked_rows(tables, dtype, flat)
            else:
                cos, sin = tables.exact(value_xp, dtype, flat.astype(np.float64, copy=False))
            idx = value_xp.arange(flat.shape[0], dtype=np.int64).reshape(values.shape[:-1] + (1,))
            cos, sin, idx = xp.asarray(cos), xp.asarray(sin), xp.asarray(idx)
        return gather(xp, self.spec.pair_axis, cos, sin, idx)
