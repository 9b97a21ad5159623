"""Dask arrays, chunk by chunk: each chunk rotated by the kernels of its chunk type (NumPy or
CuPy) with its own slice of the positions or tables, in a lazy graph. Loaded when a Dask array
arrives (dask is then loaded already)."""

import numpy as np

from . import _arrays, _positions
from ._errors import RopeTypeError, RopeValueError
from ._interop import is_dask, native_positions


def _host_positions(rope, pos, leads):
    """Positions that are not a Dask array, checked, as host values of shape P + (n_axes or 1,)
    and the highest."""
    kind, values = _positions.resolve(native_positions(pos), rope.n_axes)
    if kind == _positions.NONE:
        length = leads[0][-1] if leads[0] else 1
        return _positions.defaults(length), length - 1
    if kind == _positions.INT:
        return np.full((1, 1), values, dtype=np.int64), values
    values = _positions.with_axes(values, rope.n_axes, leads)
    if _arrays.family(values) == _arrays.CUPY:
        values = values.get()
    if values.size == 0:
        return values, -1
    values, _, high = _positions.check_values(values)
    return values, high


def rotate_dask(rope, mode, xs, pos, inverse, outs, backend, seq_len):
    """Lazy rotation of dask arrays: each chunk rotated by the kernel of its chunk type (NumPy
    or CuPy) with its own slice of positions, by the engine of ``mode`` (rotate, shift, undo).
    The feature axis is made whole first."""
    import dask.array as da

    from .backends import check_name

    check_name(backend)  # now, not when a worker computes a chunk
    if outs is not None:
        raise RopeValueError("out is not supported for dask arrays (their results are lazy)")
    if not all(is_dask(x) for x in xs):
        raise RopeTypeError("q and k must both be dask arrays, or neither")
    if not isinstance(inverse, (bool, np.bool_)):
        raise RopeTypeError(f"inverse must be a bool, got {inverse!r}")
    leads = [x.shape[:-1] for x in xs]
    for name, x in zip(("x",) if len(xs) == 1 else ("q", "k"), xs):
        if x.ndim == 0 or x.shape[-1] != rope.head_dim:
            raise RopeValueError(
                f"{name}.shape[-1] must equal head_dim ({rope.head_dim}), got "
                f"{x.shape[-1] if x.ndim else 'a 0-d array'}"
            )
        if _arrays.compute_dtype(x.dtype) is None:
            raise RopeTypeError(
                f"{name} must be float16, bfloat16, float32 or float64, got dtype {x.dtype}"
            )
    if is_dask(pos):
        if pos.dtype.kind not in "iuf":
            raise RopeTypeError(f"pos must hold integers or real numbers, got dtype {pos.dtype}")
        if rope.n_axes > 1 and (pos.ndim == 0 or pos.shape[-1] != rope.n_axes):
            raise RopeValueError(
                f"pos must end in an axis of size n_axes ({rope.n_axes}), got shape {pos.shape}"
            )
        values = pos if rope.n_axes > 1 else pos[..., None]
        if not all(_positions.broadcasts(values.shape[:-1], lead) for lead in leads):
            raise RopeValueError(
                f"pos of shape {pos.shape} does not broadcast to the leading shape "
                + " and ".join(str(lead) for lead in leads)
            )
        dynamic = rope.scaling is not None and rope.scaling.dynamic
        if seq_len is not None:
            _positions.seq_len_for(dynamic, seq_len, 0)  # checked, whatever the positions
        elif dynamic:  # one length for every chunk, from all positions
            seq_len = int(values.max().compute()) + 1
        hosts = [None] * len(xs)
    else:
        found = [_host_positions(rope, pos, [lead]) for lead in leads]  # None: each its own
        hosts = [values for values, _ in found]
        high = max(h for _, h in found)
        seq_len = _positions.seq_len_for(
            rope.scaling is not None and rope.scaling.dynamic, seq_len, high
        )

    results = []
    for x, host in zip(xs, hosts):
        if host is not None:
            values = host
        if len(x.chunks[-1]) > 1:
            x = x.rechunk({x.ndim - 1: -1})
        lead = x.shape[:-1]
        width = values.shape[-1]
        target = lead + (width,)
        # Positions enter the graph compact, chunked like x along their non-broadcast axes, and
        # are broadcast lazily per chunk: never a full-size position array in the graph.
        padded = (1,) * (len(target) - values.ndim) + tuple(values.shape)
        source_chunks = tuple(
            (1,) if n == 1 else x.chunks[i] for i, n in enumerate(padded[:-1])
        ) + ((width,),)
        if host is not None:
            source = da.from_array(host.reshape(padded), chunks=source_chunks)
        else:
            source = values.reshape(padded).rechunk(source_chunks)
        aligned = da.broadcast_to(source, target, chunks=x.chunks[:-1] + ((width,),))

        def rotate_block(block, positions, _rope=rope):
            p = positions if _rope.n_axes > 1 else positions[..., 0]
            engine = _rope._engine_for(mode)
            return engine.rotate(block, p, inverse, None, backend, seq_len)

        results.append(da.map_blocks(rotate_block, x, aligned, dtype=x.dtype, meta=x._meta))
    return tuple(results)


def apply_cos_sin_dask(apply, xs, cos, sin, style, rotary_dim, inverse, head_axis, backend, names):
    """Lazy ``apply`` (arrayrope.apply_cos_sin) of dask arrays: each chunk by the kernels of its
    chunk type, with its slice of the tables (NumPy or dask arrays), which enter the graph
    compact and are broadcast per chunk, as rotate_dask's positions. The feature axis is made
    whole first."""
    import dask.array as da

    from ._spec import with_head_axis

    if not all(is_dask(x) for x in xs):
        raise RopeTypeError("q and k must both be dask arrays, or neither")
    for name, x in zip(names, xs):
        if x.ndim == 0 or _arrays.compute_dtype(x.dtype) is None:
            raise RopeTypeError(
                f"{name} must be float16, bfloat16, float32 or float64 with a feature axis, got "
                f"dtype {x.dtype} and shape {x.shape}"
            )
    tables = []
    for name, t in (("cos", cos), ("sin", sin)):
        if not is_dask(t):
            t = np.asarray(t)
        if t.ndim == 0:
            raise RopeValueError(f"{name} must end in the table axis, got a 0-d array")
        tables.append(t)
    if tables[0].shape != tables[1].shape:
        raise RopeValueError(
            f"cos and sin must have one shape, got {tables[0].shape} and {tables[1].shape}"
        )
    lead, width = tables[0].shape[:-1], tables[0].shape[-1]
    if head_axis is not None:
        lead = with_head_axis(np.empty(lead, np.int8), head_axis, xs[0], 1, "cos").shape
    _positions.with_axes(np.empty(lead, np.int8), 1, [x.shape[:-1] for x in xs], "cos")
    results = []
    for x in xs:
        if len(x.chunks[-1]) > 1:
            x = x.rechunk({x.ndim - 1: -1})
        padded = (1,) * (x.ndim - 1 - len(lead)) + tuple(lead) + (width,)
        source_chunks = tuple(
            (1,) if n == 1 else x.chunks[i] for i, n in enumerate(padded[:-1])
        ) + ((width,),)
        aligned = []
        for t in tables:
            t = t.reshape(padded)
            source = t.rechunk(source_chunks) if is_dask(t) else da.from_array(t, source_chunks)
            aligned.append(
                da.broadcast_to(source, x.shape[:-1] + (width,), x.chunks[:-1] + ((width,),))
            )

        def apply_block(block, c, s):
            return apply(
                block, c, s, style=style, rotary_dim=rotary_dim, inverse=inverse, backend=backend
            )

        results.append(da.map_blocks(apply_block, x, *aligned, dtype=x.dtype, meta=x._meta))
    return tuple(results)
