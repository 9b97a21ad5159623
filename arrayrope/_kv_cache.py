"""RoPE.rotate_into_cache: the step of an inference loop from the projections to a paged KV
cache in one pass (the CPU kernel in backends/cpu/_fused, the CUDA one in backends/cuda/rope.cu).

Every check comes before the launch, so that nothing is written on a refusal: shapes and dtypes,
the cache layout, slots in range and each used once (two tokens in one slot would race), no
array written (caches, result) in another's memory or in its own twice over; q, k and v, only
read, may share theirs (the checks the arrays' layouts settle are in ``_kv_layout``, kept per
layout). Table rows: integer positions inside the cache read it; others (past it, real-valued,
multi-axis) get one row per token, made for the call.
"""

from __future__ import annotations

import math

import numpy as np

from . import _arrays, _positions
from ._arrays import CUPY, FOREIGN, NUMPY
from ._docs import filled
from ._errors import RopeTypeError, RopeValueError
from ._kv_layout import fp8, layout
from ._kv_step import EPS, no_weight, remember, step, step_key


def _weights(name, w, d):
    if w is None:
        return np.empty(0, np.float64)
    _arrays.refuse_masked(name, w)
    w = np.asarray(w)
    if w.shape != (d,) or w.dtype.kind != "f":
        raise RopeValueError(
            f"{name} must be a float array of shape ({d},), got {w.dtype} {w.shape}"
        )
    return w


def _scale(name, value, cache):
    if value is None:
        return 1.0
    if not fp8(cache.dtype):
        raise RopeValueError(
            f"{name} scales a float8 cache, and this cache is {cache.dtype}: leave it unset"
        )
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise RopeTypeError(f"{name} must be a number, got {value!r}") from None
    if not (math.isfinite(number) and number > 0):
        raise RopeValueError(f"{name} must be finite and > 0, got {value!r}")
    return number


def _slots(slots, n, capacity):
    """The slots, checked: integers, one per token, below the cache's capacity, each used once
    (a negative slot skips its token)."""
    if (
        type(slots) is np.ndarray
        and slots.dtype == np.int64
        and slots.shape == (n,)
        and slots.flags.c_contiguous
        and n
    ):
        from .backends.cpu._step_checks import check_slots

        slots = slots.copy()  # checked and used as one copy: the caller's may change meanwhile
        status, slot = check_slots(slots, capacity)
        if status == 0:
            return slots
        if status == 1:
            raise RopeValueError(
                f"slots must be below the cache's num_blocks * block_size ({capacity}), got "
                f"{int(slot)}"
            )
        raise RopeValueError(
            f"slots must be distinct (two tokens in one slot would race), got slot {int(slot)} "
            f"{int((slots == slot).sum())} times"
        )
    _arrays.refuse_masked("slots", slots)
    slots = np.asarray(slots)
    if slots.dtype.kind not in "iu":
        raise RopeTypeError(f"slots must hold integers, got dtype {slots.dtype}")
    if slots.shape != (n,):
        raise RopeValueError(f"slots must have shape ({n},), one per token, got {slots.shape}")
    used = slots[slots >= 0]  # in slots' own type: a uint64 past int64's range stays large
    if used.size and used.max() >= capacity:
        raise RopeValueError(
            f"slots must be below the cache's num_blocks * block_size ({capacity}), got "
            f"{int(used.max())}"
        )
    slots, used = slots.astype(np.int64), used.astype(np.int64)
    ordered = np.sort(used)
    twice = ordered[1:] == ordered[:-1]
    if twice.any():
        slot = ordered[1:][twice][0]
        raise RopeValueError(
            f"slots must be distinct (two tokens in one slot would race), got slot {int(slot)} "
            f"{int((used == slot).sum())} times"
        )
    return slots


def _overlaps(read, written, family):
    """Raise where an array written shares memory with another array (out may be q: in place);
    the arrays only read may share theirs (q, k and v of one QKV buffer)."""
    items = list(written.items())
    pairs = [(a, b) for i, a in enumerate(items) for b in items[i + 1 :]]
    # arrays read that are views of one array (a QKV projection) lie in its memory: a written
    # array clear of that memory is clear of each of them
    owner = next(iter(read.values())).base if family == NUMPY else None
    if type(owner) is not np.ndarray or any(a.base is not owner for a in read.values()):
        owner = None
    for item in items:
        if owner is None or np.may_share_memory(item[1], owner):
            pairs += [(item, b) for b in read.items()]
    for (a_name, a), (b_name, b) in pairs:
        if not (a.size and b.size):
            continue
        kind = _arrays.overlap_kind(a, b, family)
        if kind == "none" or kind == "same" and {a_name, b_name} == {"q", "out"}:
            continue
        raise RopeValueError(f"{a_name} and {b_name} share memory")


def _family(arrays):
    """NUMPY or CUPY: the family of every one of ``arrays`` (CuPy's on one device)."""
    families = {name: _arrays.family(a) for name, a in arrays.items()}
    family = families["q"]
    for name, a in arrays.items():
        if families[name] != family or family not in (NUMPY, CUPY):
            raise RopeTypeError(
                f"{name} must be a NumPy array like q, or all of q, k, v, the caches and out CuPy "
                f"arrays, got {_arrays.describe(a)}"
            )
    if family == CUPY:
        device = arrays["q"].device
        for name, a in arrays.items():
            if a.device != device:
                raise RopeValueError(f"{name} is on {a.device} and q on {device}: use one device")
    return family


def _on_host(a):
    """Slots, positions or weights on a device, copied to the host (the call waits for the
    device): they are checked there, before anything is written."""
    return a.get() if _arrays.family(a) == CUPY else a


def _on_device_like(q):
    """A new CuPy array of q's shape and dtype, on q's device (not the current one)."""
    import cupy

    with q.device:
        return cupy.empty(q.shape, q.dtype)


def _on_device(rope, q, out, k, v, k_cache, v_cache, slots, rows, cos, sin, block, layout,
               q_weight, k_weight, numbers):  # fmt: skip
    """The checked step's launch on CuPy arrays: each token's table row, the slots and the
    weights copied to q's device (a few kilobytes a token at most)."""
    import cupy

    from .backends.cuda import cupy as kernels

    with q.device:
        if q_weight.size and _arrays.address(out) == _arrays.address(q):
            # in place with a norm: each lane of a row's warp sums the whole row, which the
            # others are writing, so the kernel reads a copy
            q = q.copy()
        cos, sin = cupy.asarray(cos[rows]), cupy.asarray(sin[rows])
        rows, slots = cupy.arange(rows.shape[0], dtype=np.int64), cupy.asarray(slots)
        q_weight, k_weight = cupy.asarray(q_weight), cupy.asarray(k_weight)
    kernels.launch_fused(
        q, out, k, v, k_cache, v_cache, slots, rows, cos, sin, block, layout, rope._spec,
        q_weight, k_weight, numbers,
    )  # fmt: skip


def _resolved(pos, n_axes):
    kind, value = _positions.resolve(pos, n_axes)
    if kind == _positions.NONE:
        raise RopeValueError("pos is required: one position per token")
    return kind, value


def _rows(rope, pos, n, dtype, seq_len):
    """(cos, sin, rows): the tables and each token's row in them."""
    spec = rope._spec
    if (
        type(pos) is np.ndarray
        and pos.dtype == np.int64
        and pos.shape == (n,)
        and pos.flags.c_contiguous
        and spec.n_axes == 1
        and not spec.dynamic
        and seq_len is None
    ):
        # a step's int64 positions: one compiled pass for the bounds (others, and bad values,
        # take the general way below, which names them)
        from ._tables import checked_rows
        from .backends.cpu._step_checks import bounds

        pos = pos.copy()  # checked and used as one copy (as slots are)
        low, high = bounds(pos)
        if 0 <= low and high < _positions.LIMIT:
            tables = rope._engine.freq_set(None).tables
            cached = tables.cached(np, None, dtype, int(high))
            if cached is not None:
                return cached[0], cached[1], pos
            # past the cache: each token's own rows, as the general way makes them
            cos, sin = checked_rows(tables, dtype, pos.reshape(n, 1))
            return cos, sin, np.arange(n, dtype=np.int64)
    kind, value = _resolved(pos, spec.n_axes)
    if kind == _positions.INT:
        value = np.full((n,) + ((spec.n_axes,) if spec.n_axes > 1 else ()), value)
    values = _positions.with_axes(np.asarray(value), spec.n_axes, [(n,)])
    values = np.broadcast_to(values, (n, spec.n_axes))
    values, is_int, high = _positions.check_values(np.ascontiguousarray(values))
    seq_len = _positions.seq_len_for(spec.dynamic, seq_len, high)
    tables = rope._engine.freq_set(seq_len).tables
    if is_int and spec.n_axes == 1:
        cached = tables.cached(np, None, dtype, int(high))
        if cached is not None:
            return cached[0], cached[1], values[:, 0].astype(np.int64)
    if is_int:
        from ._tables import checked_rows

        cos, sin = checked_rows(tables, dtype, values)
    else:
        cos, sin = tables.exact(np, dtype, values.astype(np.float64))
    return cos, sin, np.arange(n, dtype=np.int64)


@filled
def rotate_into_cache(
    self,
    q,
    k,
    v,
    pos,
    k_cache,
    v_cache,
    slots,
    *,
    out=None,
    cache_layout: str = "NHD",
    q_norm=None,
    k_norm=None,
    norm_eps: float = EPS,
    k_scale: float | None = None,
    v_scale: float | None = None,
    seq_len: int | None = None,
):
    """One step of an inference loop in one pass: q rotated, k rotated into the key cache and v
    copied into the value cache at each token's slot, each read once.

    ``k_cache[slot] = R(pos) norm(k)``, ``v_cache[slot] = v`` and the result is
    ``R(pos) norm(q)``, for every head of every token; norm is the identity without weights.
    NumPy arrays and torch CPU tensors (under torch.compile, an operator that writes the
    caches and out; not recorded by autograd) on the CPU; CuPy arrays on their device, slots
    and positions checked on the host. JAX arrays, which cannot be written, on the CPU: the
    step returns ``(out, k_cache, v_cache)`` with new caches (under jax.jit, donated caches
    are written in place; not differentiated or batched by vmap).

    Parameters
    ----------
    q : array, shape (N, Hq, head_dim)
        N tokens of any batch, float16, bfloat16, float32 or float64, any strides (a view of a
        fused QKV projection works).
    k, v : arrays, shape (N, Hkv, head_dim)
        q's dtype.
    pos : int or array, shape (N,) (or (N, n_axes) for a multi-axis RoPE)
        Each token's position: integers or reals, as for :meth:`rotate`.
    k_cache, v_cache : arrays
        Paged caches, (num_blocks, block_size, Hkv, head_dim) for ``cache_layout="NHD"`` or
        (num_blocks, Hkv, block_size, head_dim) for ``"HND"`` (a contiguous (B, Hkv, T_max,
        head_dim) cache is HND with block_size T_max). Of k's dtype, or float8 e4m3fn
        (``ml_dtypes.float8_e4m3fn``). Written in place.
    slots : int array, shape (N,)
        Each token's cache slot, block * block_size + offset; a negative slot skips the token
        (padding): its q is rotated, nothing is cached.
    out : array like q, optional
        Where to write the rotated q; ``out=q`` rotates it in place.
    cache_layout : {"NHD", "HND"}
    q_norm, k_norm : float arrays, shape (head_dim,), optional
        RMSNorm weights: each head of q (k) is normalized before its rotation, ``x /
        sqrt(mean(x**2) + norm_eps) * weight``, accumulated in float32 (float64 for float64):
        the per-head QK-norm of Qwen3. Gemma 3's norm scales by ``1 + weight``: pass that.
    norm_eps : float
    k_scale, v_scale : float, optional
        For a float8 cache: values are multiplied by 1 / scale (in the compute dtype), rounded
        to float8 and saturated at the format's largest value (448). The rounding is from
        float32: float64 values round to float32 first.
    seq_len : int, optional
        The current length for a length-dependent scaling rule (DynamicNTK, LongRoPE), as for
        :meth:`rotate`: say it where padding tokens or a longer cache should not (or should)
        count; default max(pos) + 1 of the call's tokens, padding included.

    Returns
    -------
    array
        ``out``, or a new array of q's shape and dtype; for JAX arrays, the tuple ``(out,
        k_cache, v_cache)``.

    Raises
    ------
    RopeValueError, RopeTypeError
        Bad input, named in the message with its value: shapes, dtypes, a layout, slots out
        of range or used twice, arrays that share memory. Nothing is written.
    """
    plain = q_norm is None and k_norm is None and k_scale is None and v_scale is None
    plain = plain and seq_len is None and norm_eps is EPS
    spec = self._spec
    key = None
    if plain:
        key = step_key(spec, q, k, v, pos, k_cache, v_cache, slots, out, cache_layout)
        if key is not None:
            done = step(self, q, k, v, pos, k_cache, v_cache, slots, out, cache_layout, key)
            if done is not None:
                return done
    d = spec.head_dim
    arrays = {"q": q, "k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache}
    given = arrays | ({} if out is None else {"out": out})
    if any(_arrays.family(a) == FOREIGN and hasattr(a, "__dlpack__") for a in given.values()):
        from . import _kv_frameworks  # torch tensors (and JAX arrays, which it refuses)

        options = dict(
            cache_layout=cache_layout, q_norm=q_norm, k_norm=k_norm, norm_eps=norm_eps,
            k_scale=k_scale, v_scale=v_scale, seq_len=seq_len,
        )  # fmt: skip
        return _kv_frameworks.run(self, (q, k, v, pos, k_cache, v_cache, slots, out), options)
    family = _family(given)
    n, hq, hkv, block = layout(d, q, k, v, k_cache, v_cache, out, cache_layout, family)
    if out is None:
        out = np.empty(q.shape, q.dtype) if family == NUMPY else _on_device_like(q)
    q_weight = _weights("q_norm", _on_host(q_norm), d)
    k_weight = _weights("k_norm", _on_host(k_norm), d)
    try:
        eps = float(norm_eps)
    except (TypeError, ValueError):
        raise RopeTypeError(f"norm_eps must be a number, got {norm_eps!r}") from None
    if not (math.isfinite(eps) and eps >= 0):
        raise RopeValueError(f"norm_eps must be finite and >= 0, got {norm_eps!r}")
    k_multiplier = 1.0 / _scale("k_scale", k_scale, k_cache)
    v_multiplier = 1.0 / _scale("v_scale", v_scale, v_cache)
    slots = _slots(_on_host(slots), n, k_cache.shape[0] * block)
    written = {"k_cache": k_cache, "v_cache": v_cache, "out": out}
    _overlaps({"q": q, "k": k, "v": v}, written, family)
    dtype = _arrays.compute_dtype(q.dtype)
    if n == 0:
        _resolved(_on_host(pos), spec.n_axes)  # checked all the same
        return out
    cos, sin, rows = _rows(self, _on_host(pos), n, dtype, seq_len)
    # unit-stride weights of the compute dtype: the vector steps read them by element offsets
    q_weight = np.ascontiguousarray(q_weight, dtype) if q_weight.size else no_weight(dtype)
    k_weight = np.ascontiguousarray(k_weight, dtype) if k_weight.size else no_weight(dtype)
    # inputs the kernel cannot address as they are go through a copy
    addressable = [_arrays.addressable(a, family) for a in (q, k, v)]
    q, k, v = (a if fit else a.copy() for a, fit in zip((q, k, v), addressable))
    numbers = np.array((eps, k_multiplier, v_multiplier), dtype)
    if family == CUPY:
        _on_device(self, q, out, k, v, k_cache, v_cache, slots, rows, cos, sin, block,
                   cache_layout, q_weight, k_weight, numbers)  # fmt: skip
        return out
    from .backends import cpu

    cpu.launch_fused(
        q, out, k, v, k_cache, v_cache, slots, rows, cos, sin, block, cache_layout, spec,
        q_weight, k_weight, numbers,
    )  # fmt: skip
    if key is not None and all(addressable):
        remember(key, spec, (q, out, k, v, k_cache, v_cache), block, cache_layout, cos, sin)
    return out
