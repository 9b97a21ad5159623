"""The short way of a decode loop's ``RoPE.rotate_into_cache``: a call whose arrays' layouts an
earlier call has checked (kept per layout by :func:`remember`) checks only what depends on the
call itself (slots, positions, overlaps), in the compiled launch. Anything else, or anything
wrong, goes the general way in ``_kv_cache``, which names it."""

import functools

import numpy as np

from ._cache import Bounded
from ._positions import defaults

EPS = 1e-6  # norm_eps's default: a call that leaves it may take the short way
_NDARRAY = np.ndarray
_INT64 = np.dtype(np.int64)


def _writeable_bit():
    """The bit of ``ndarray.flags.num`` that says an array is writable."""
    writable = np.empty(0).view()
    read_only = writable.view()
    read_only.flags.writeable = False
    return writable.flags.num ^ read_only.flags.num


_WRITEABLE = _writeable_bit()


@functools.cache
def no_weight(dtype):
    """The kernel's empty weights of ``dtype`` (no norm), one array per dtype, never written."""
    return np.empty(0, dtype)


def step_key(spec, q, k, v, pos, k_cache, v_cache, slots, out, cache_layout):
    """The key of a decode step's layouts and of what the launch takes from its RoPE (the
    rotary part and style): NumPy arrays, and int64 positions and slots, one per token. None
    for any other call. One flat tuple, written out: a decode step pays for its making and
    its lookup. The last entry holds the flags of q, k, v, the caches, pos and slots."""
    if not (type(q) is type(k) is type(v) is type(k_cache) is type(v_cache) is _NDARRAY):
        return None
    if type(pos) is not _NDARRAY or type(slots) is not _NDARRAY or type(cache_layout) is not str:
        return None
    if pos.dtype != _INT64 or slots.dtype != _INT64:
        return None
    tokens = q.shape[:1]
    if pos.shape != tokens or slots.shape != tokens:
        return None  # (positions the general way broadcasts: their rows are not the tokens')
    if out is None:
        out_layout = None
    elif type(out) is _NDARRAY:
        out_layout = (out.shape, out.strides, out.dtype, out.flags.num)
    else:
        return None
    flags = (
        q.flags.num, k.flags.num, v.flags.num, k_cache.flags.num, v_cache.flags.num,
        pos.flags.num, slots.flags.num,
    )  # fmt: skip
    return (
        spec.rotary_dim, spec.half_style, cache_layout, out_layout,
        q.shape, q.strides, q.dtype, k.shape, k.strides, k.dtype, v.shape, v.strides, v.dtype,
        k_cache.shape, k_cache.strides, k_cache.dtype,
        v_cache.shape, v_cache.strides, v_cache.dtype, pos.strides, slots.strides, flags,
    )  # fmt: skip


_steps = Bounded(256)  # cache: what a decode step's layouts settle, by step_key


@functools.cache
def _plain_numbers(dtype):
    """The kernel's eps and cache multipliers for a call that sets none, one array per dtype,
    never written."""
    return np.array((EPS, 1.0, 1.0), dtype)


def step(rope, q, k, v, pos, k_cache, v_cache, slots, out, cache_layout, key):
    """A decode loop's call, whose layouts an earlier call has checked (see remember): what
    depends on the call alone (slots, positions within the launch's rows, no array written
    into another's memory) is checked in the compiled launch. The launch reads the cached
    table, or, once steps of this table and dtype have gone past its cap (a long context),
    rows made for the step's positions. ``key``: the call's step_key (not None). Returns the
    result, or None with nothing written where the general way must take the call (which
    names what is wrong)."""
    spec = rope._spec
    found = _steps.get(key)
    if found is None or spec.dynamic or spec.n_axes != 1 or q.shape[-1] != spec.head_dim:
        return None  # (the layouts were checked for a RoPE of this head size and kind)
    settings, threaded, dtype, bits, read_only, launch = found
    freqs = rope._engine.freq_set(None).tables
    long_context = dtype in freqs.past_the_cap
    if long_context:
        rows = _made_rows(freqs, dtype, pos)
        if rows is None:
            return None
    else:
        tables = freqs.existing(None, dtype)
        if tables is None:  # a loop that starts past the cache: the cache's first rows, once
            tables = freqs.cached(np, None, dtype, 0)
        rows = (pos, tables[0], tables[1])
    if out is None:
        out = np.empty(q.shape, q.dtype)
    arrays = (q, out, k, v, k_cache, v_cache)
    if bits:
        arrays = tuple(launch.bits_view(a) for a in arrays)
    weight = no_weight(dtype)
    args = (*arrays, slots, *rows, weight, weight, _plain_numbers(dtype), settings)
    if read_only:
        args = tuple(launch.writable(a) for a in args)
    status = launch.run(args, q.shape[0], threaded)
    if status == launch.PAST_THE_TABLE and not long_context:
        found = _past_the_table(freqs, dtype, pos)
        if found is None:
            return None
        rows, made = found
        if made:  # past the cap: the next steps make their rows first
            freqs.past_the_cap.add(dtype)
        if read_only:
            rows = tuple(launch.writable(a) for a in rows)
        status = launch.run(args[:7] + rows + args[10:], q.shape[0], threaded)
    return None if status else out


def _past_the_table(freqs, dtype, pos):
    """((table rows, cos, sin), whether the rows were made for the call) of the launch for
    positions past the cached table: the table grown to them where its cap allows, else each
    token's row made from the level tables for the call (a long context), as the general way
    makes them. None for a position outside [0, 2**31) (the general way names it). The launch
    checks the positions again, on its own copy."""
    low, high = int(pos.min()), int(pos.max())
    if low < 0:
        return None
    grown = freqs.cached(np, None, dtype, high)
    if grown is not None:
        return (pos, grown[0], grown[1]), False
    made = _made_rows(freqs, dtype, pos)
    return None if made is None else (made, True)


def _made_rows(freqs, dtype, pos):
    """(table rows, cos, sin) of the launch with each token's row made from the level tables,
    the values the cached table holds at any position, once per step (see
    CosSinTables.step_rows); None for a position outside [0, 2**31)."""
    made = freqs.step_rows(dtype, pos)
    if made is None:
        return None
    return defaults(pos.shape[0]).reshape(-1), made[0], made[1]


def remember(key, spec, arrays, block, layout, cos, sin):
    """Keep what the layouts of a call the general way took settle (``arrays``: q, out, k, v,
    k_cache, v_cache), where the short way can serve its like: a one-axis RoPE whose rule
    does not read the length, caches of q's dtype (no float8)."""
    from .backends.cpu import _fused_launch

    q, out, k, v, k_cache, v_cache = arrays
    if spec.dynamic or spec.n_axes != 1 or not (k_cache.dtype == v_cache.dtype == q.dtype):
        return
    vector = _fused_launch.layout_vector(spec, q, out, k, v, k_cache, v_cache, cos, sin)
    vector |= _fused_launch.large_step_bits(q, k, v)
    settings = _fused_launch.settings(spec, block, layout, vector, True)
    bits = _fused_launch.bits_of(q.dtype) is not None
    # whether an operand is read-only, from the key's flags (its last entry: see step_key): the
    # launch takes such operands through writable aliases (see _fused_launch.writable), made
    # here at no cost to the rest
    read_only = any(not flags & _WRITEABLE for flags in key[-1])
    # the launch module kept with them: an import statement would cost every step its lookup
    threaded = _fused_launch.parallel(q, k)
    _steps.put(key, (settings, threaded, cos.dtype, bits, read_only, _fused_launch))
