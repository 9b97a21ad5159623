"""The short way of a decode loop's ``RoPE.rotate_into_cache``: a call whose arrays' layouts an
earlier call has checked (kept per layout by :func:`remember`) checks only what depends on the
call itself (slots, positions, overlaps), in a few compiled calls, and launches. Anything else,
or anything wrong, goes the general way in ``_kv_cache``, which names it."""

import functools

import numpy as np

from . import _arrays, _positions
from ._cache import Bounded

EPS = 1e-6  # norm_eps's default: a call that leaves it may take the short way
_NDARRAY = np.ndarray


@functools.cache
def no_weight(dtype):
    """The kernel's empty weights of ``dtype`` (no norm), one array per dtype, never written."""
    return np.empty(0, dtype)


def step_key(q, k, v, pos, k_cache, v_cache, slots, out, cache_layout):
    """The key of a decode step's layouts: NumPy arrays, and int64 positions and slots, one per
    token, contiguous. None for any other call."""
    if not (type(q) is type(k) is type(v) is type(k_cache) is type(v_cache) is _NDARRAY):
        return None
    if type(pos) is not _NDARRAY or type(slots) is not _NDARRAY or pos.dtype != np.int64:
        return None
    if type(out) is not _NDARRAY and out is not None or slots.dtype != np.int64:
        return None
    if type(cache_layout) is not str:
        return None
    layouts = tuple(
        (a.shape, a.strides, a.dtype, a.flags.num)
        for a in (q, k, v, k_cache, v_cache, pos, slots)
    )  # fmt: skip
    return (cache_layout, None if out is None else (out.shape, out.strides, out.flags.num), layouts)


_steps = Bounded(256)  # cache: what a decode step's layouts settle, by _step_key


def step(rope, q, k, v, pos, k_cache, v_cache, slots, out, cache_layout):
    """A decode loop's call, whose layouts an earlier call has checked (see remember): what
    depends on the call alone is checked here (slots, positions in the cached table, no array
    written into another's memory), in a few compiled calls. Returns the result, or None with
    nothing written where the general way must take the call (which names what is wrong)."""
    spec = rope._spec
    key = step_key(q, k, v, pos, k_cache, v_cache, slots, out, cache_layout)
    found = None if key is None else _steps.get(key)
    if found is None or spec.dynamic or spec.n_axes != 1 or q.shape[-1] != spec.head_dim:
        return None  # (the layouts were checked for a RoPE of this head size and kind)
    from .backends import cpu
    from .backends.cpu import _fused, _step_checks

    block, extents, dtype = found
    status, _, low, high, slots, pos = _step_checks.step_inputs(
        slots, pos, k_cache.shape[0] * block
    )
    if status or low < 0 or high >= _positions.LIMIT:
        return None
    tables = rope._engine.freq_set(None).tables.cached(np, None, dtype, int(high))
    if tables is None:
        return None
    if out is None:
        out = np.empty(q.shape, q.dtype)
    arrays = (q, out, k, v, k_cache, v_cache)
    bits = _fused.bits_of(q.dtype)
    known = _step_checks.addresses(*(a if bits is None else a.view(bits) for a in arrays))
    spans = [(at + first, at + end) for at, (first, end) in zip(known, extents)]
    for w in (1, 4, 5):  # out, k_cache, v_cache: written
        for other in range(6):
            if other == w or spans[w][1] <= spans[other][0] or spans[other][1] <= spans[w][0]:
                continue
            if not (w == 1 and other == 0 and known[0] == known[1] and q.strides == out.strides):
                return None  # out at q's address in q's layout is in place; anything else not
    cpu.launch_fused(
        q, out, k, v, k_cache, v_cache, slots, pos, tables[0], tables[1], block, cache_layout,
        spec, no_weight(dtype), no_weight(dtype), dtype.type(EPS), dtype.type(1.0),
        dtype.type(1.0), known,
    )  # fmt: skip
    return out


def remember(key, spec, arrays, block, dtype):
    """Keep what the layouts of a call the general way took settle (``arrays``: q, out, k, v,
    k_cache, v_cache), where the short way can serve its like: a one-axis RoPE whose rule
    does not read the length, caches of q's dtype (no float8)."""
    q, k_cache, v_cache = arrays[0], arrays[4], arrays[5]
    if spec.dynamic or spec.n_axes != 1 or not (k_cache.dtype == v_cache.dtype == q.dtype):
        return
    _steps.put(key, (block, tuple(_arrays.span(a) for a in arrays), dtype))
