"""The launch of the fused step (``RoPE.rotate_into_cache``; its kernels are in ``_fused``):
from arrays of any layout, the flat views, element strides and vector steps the kernels take,
a decode step's own checks, and the choice between one thread and Numba's threads, in one
compiled call.
"""

import functools
import threading

import numba
import numpy as np
from numba import njit

from . import _config
from ._config import DISK_CACHE, HARDWARE_F16
from ._decode import memory_span
from ._fused import PREFETCH, Q_IN_PLACE, STREAM_KV, STREAM_Q, fused_parallel, fused_range
from ._simd import span
from ._step_checks import bounds, check_slots


@njit
def _extent(a):
    """(first, end): the bytes ``a`` spans, from a[0, ..., 0] (first <= 0 where an axis
    descends); (0, 0) for an empty array."""
    if a.size == 0:
        return 0, 0
    first, end = memory_span(a)
    at = a.ctypes.data
    return first - at, end - at


@njit
def _flat(a, extent):
    """``a``'s memory as a flat view, and the element offset of a[0, ..., 0] in it."""
    first, end = extent
    item = a.itemsize
    return span(a, first // item, (end - first) // item), -first // item


@njit
def _meets(at, extent, other_at, other):
    """Whether two arrays' spans (their addresses and extents) share a byte."""
    return at + extent[0] < other_at + other[1] and other_at + other[0] < at + extent[1]


@njit
def _token_bytes(a):
    """The bytes one token's row of an (N, heads, head_dim) array spans from its first element,
    or -1 where an axis descends."""
    if a.strides[1] < 0 or a.strides[2] < 0:
        return -1
    return (a.shape[1] - 1) * a.strides[1] + (a.shape[2] - 1) * a.strides[2] + a.itemsize


@njit
def _rows_meet(a, at, extent, b, b_at, b_extent):
    """Whether two (N, heads, head_dim) arrays share a byte: their spans meet and, where both
    take one token stride that holds each token's row (views of one fused projection, whose
    spans interleave), a token's row of one meets a token's row of the other."""
    if not _meets(at, extent, b_at, b_extent):
        return False
    stride = a.strides[0]
    length, b_length = _token_bytes(a), _token_bytes(b)
    if stride <= 0 or b.strides[0] != stride or not (0 < length <= stride):
        return True
    if not 0 < b_length <= stride:
        return True
    # a's token t spans [t s, t s + length) from at, b's token u [delta + u s, ... + b_length):
    # they meet where delta + (u - t) s lies in (-b_length, length), which only the two
    # values of delta + k s nearest 0 can
    delta = b_at - at
    nearest = delta % stride
    for gap in (nearest, nearest - stride):
        k = (gap - delta) // stride
        if -b_length < gap < length and -(a.shape[0] - 1) <= k <= b.shape[0] - 1:
            return True
    return False


@njit
def _strides(a, base, first, second, third):
    """(base, a's element strides along the given axes) as the kernel's int64 offsets; third
    < 0 leaves it out."""
    item = a.itemsize
    if third < 0:
        return np.array((base, a.strides[first] // item, a.strides[second] // item))
    return np.array(
        (base, a.strides[first] // item, a.strides[second] // item, a.strides[third] // item)
    )


# fused_step's statuses with the check, where it writes nothing: a slot out of range or used
# twice; a position outside the table (or negative); a written array whose span meets another's
SLOTS, PAST_THE_TABLE, OVERLAP = 1, 2, 3


@njit
def vector_steps(allowed, q_at, out_at, k_cache_at, v_cache_at):
    """The vector steps a launch takes: those the layouts allow (see :func:`layout_vector`)
    whose targets' addresses are 16-byte aligned, each with its streaming bit as given; where
    out is q (in place), q's with Q_IN_PLACE for its streaming bit (its lines are read
    anyway); the PREFETCH bit as given (see :func:`large_step_bits`)."""
    steps = allowed & PREFETCH
    if allowed & 1 and out_at % 16 == 0:
        steps |= 1 | (allowed & STREAM_Q if out_at != q_at else Q_IN_PLACE)
    if allowed & 2 and k_cache_at % 16 == 0 and v_cache_at % 16 == 0:
        steps |= 2 | (allowed & STREAM_KV)
    return steps


# The step's checks compiled into fused_step, not loaded from the disk cache as _step_checks'
# own are where Python calls them (see fused_range).
_check_slots = njit(nogil=True)(check_slots.py_func)
_bounds = njit(nogil=True)(bounds.py_func)


@njit(nogil=True, cache=DISK_CACHE)
def fused_step(q, out, k, v, kc, vc, slots, rows, cos, sin, q_weight, k_weight, numbers,
               settings, tasks):  # fmt: skip
    """Launch the step on arrays of any layout (the half types and float8 as their bits): their
    flat views, offsets and strides made here. ``settings`` (see :func:`settings`): block
    size, HND, rotary_dim, half style, the vector steps the layouts allow (see
    :func:`layout_vector`) with the bits of a large step (see :func:`large_step_bits`), and
    whether to check; ``numbers``: eps and the caches' multipliers, of the compute dtype;
    ``tasks``: how many ranges of tokens Numba's threads share (0: the caller's thread runs
    them all).

    With the check, the call's own inputs are checked first and 0 means launched; else nothing
    is written and the status names the first failure: SLOTS (slots or positions not one per
    token, a slot out of range or used twice), PAST_THE_TABLE, OVERLAP (out at q's address in
    q's layout is in place). The slots and positions are used as checked copies
    (the caller's may change meanwhile). Without the check the caller has made every one."""
    block, hnd, rotary_dim, half_style = settings[0], settings[1], settings[2], settings[3]
    n, hq, d = q.shape
    if settings[5]:
        if slots.shape[0] != n or rows.shape[0] != n:
            return SLOTS
        slots, rows = slots.copy(), rows.copy()
        if _check_slots(slots, kc.shape[0] * block)[0]:
            return SLOTS
        low, high = _bounds(rows)
        if low < 0 or high >= cos.shape[0]:
            return PAST_THE_TABLE
    at = (
        q.ctypes.data, out.ctypes.data, k.ctypes.data, v.ctypes.data, kc.ctypes.data,
        vc.ctypes.data,
    )  # fmt: skip
    spans = (_extent(q), _extent(out), _extent(k), _extent(v), _extent(kc), _extent(vc))
    same = at[1] == at[0]
    if settings[5]:
        for w in (1, 4, 5):  # out, k_cache, v_cache: written
            for other in range(6):
                if other == w or not _meets(at[w], spans[w], at[other], spans[other]):
                    continue
                if w == 1 and other == 0 and same and q.strides == out.strides:
                    continue  # in place
                if w == 1 and other in (0, 2, 3):  # out beside q, k, v in one projection
                    a, a_extent = (q, spans[0]) if other == 0 else (k, spans[2])
                    if other == 3:
                        a, a_extent = v, spans[3]
                    if not _rows_meet(out, at[1], spans[1], a, at[other], a_extent):
                        continue
                return OVERLAP
    qf, qb = _flat(q, spans[0])
    kf, kb = _flat(k, spans[2])
    vf, vb = _flat(v, spans[3])
    kcf, kcb = _flat(kc, spans[4])
    vcf, vcb = _flat(vc, spans[5])
    qs = _strides(q, qb, 0, 1, -1)
    if same:  # out is q (the caller has refused any other overlap): addressed through q's view
        of, os_ = qf, qs
    else:
        of, ob = _flat(out, spans[1])
        os_ = _strides(out, ob, 0, 1, -1)
    offset, heads = (2, 1) if hnd else (1, 2)
    vector = vector_steps(settings[4], at[0], at[1], at[4], at[5])
    args = (
        qf, of, kf, vf, kcf, vcf, qs, os_, _strides(k, kb, 0, 1, -1), _strides(v, vb, 0, 1, -1),
        _strides(kc, kcb, 0, offset, heads), _strides(vc, vcb, 0, offset, heads), slots, rows,
        cos, sin, block, hq, k.shape[1], rotary_dim, d, half_style != 0, False, q_weight,
        k_weight, numbers, vector,
    )  # fmt: skip
    if tasks:
        fused_parallel(*args, tasks, n)
    else:
        fused_range(*args, 0, n)
    return 0


# fused_step compiles once per dtype combination, its six operands typed as of any layout (see
# _specialized): a decode loop's views and a prefill's contiguous arrays share one build
_compiling = threading.Lock()
_built = False  # whether fused_step has a build, and so takes no new ones at call time


def _specialized(args):
    """Compile fused_step for ``args`` with its six operands typed as of any layout (Numba
    then calls that build with arrays of every layout: C arrays convert to it)."""
    global _built
    args = tuple(writable(a) for a in args)
    signature = tuple(
        numba.typeof(a).copy(layout="A") if i < 6 else numba.typeof(a) for i, a in enumerate(args)
    )
    with _compiling:
        fused_step.disable_compile(False)
        try:
            fused_step.compile(signature)
        finally:
            fused_step.disable_compile()
            _built = True


def _step(*args):
    """fused_step(*args), compiling it first for a new dtype combination; read-only operands
    through writable aliases (see writable), after a type miss: that way in costs Numba's
    dispatcher hundreds of microseconds, so the callers alias read-only operands first: the
    general way always (see launch), the decode loop's short way where its layouts record one
    (see _kv_step), and JAX's route passes writable views of the buffers it only reads."""
    if not _built:
        _specialized(args)
    try:
        return fused_step(*args)
    except TypeError:  # no build for these types (Numba raises before running anything)
        pass
    args = tuple(writable(a) for a in args)
    try:
        return fused_step(*args)
    except TypeError:  # a new dtype combination
        _specialized(args)
    return fused_step(*args)


def bits_view(a):
    """``a`` as the kernel reads it: the half types by their bits, float8 as uint8."""
    bits = bits_of(a.dtype)
    return a if bits is None else a.view(bits)


@functools.cache
def bits_of(dtype):
    """The integer type the kernel reads a dtype's elements as, or None for its own."""
    return {"float16": np.int16, "bfloat16": np.uint16, "float8_e4m3fn": np.uint8}.get(dtype.name)


def layout_vector(spec, q, out, k, v, k_cache, v_cache, cos, sin):
    """The vector steps the layouts allow, where the targets' addresses are 16-byte aligned
    (fused_step checks those): bit 0 for q's rows, bit 1 for k's and v's."""
    vector = int(_vector(spec, q, (out,), cos, sin))
    return vector | 2 * int(_vector(spec, k, (k_cache, v_cache), cos, sin, v))


def large_step_bits(q, k, v):
    """The bits of a step whose inputs are too large for the cache (q, k and v together at
    least as many bytes as rotate's results of q's dtype stream from: see
    _config.streams_from), else 0: PREFETCH, the step asks for each token's rows of q, k and v
    two tokens before it rotates them (see _fused._token), where the CPU's own prefetching
    leaves it waiting on memory; and on x86-64 (where rotate streams) STREAM_Q and STREAM_KV,
    its results and cache rows that take the vector steps are written with streaming stores,
    as rotate's are: a plain store would first read each line it writes. In cache the
    requests only cost instructions, and plain stores leave the rows in cache for
    attention."""
    if q.nbytes + k.nbytes + v.nbytes < _config.streams_from(q.itemsize):
        return 0
    return PREFETCH | (STREAM_Q | STREAM_KV if _config.STREAMING else 0)


def _vector(spec, x, targets, cos, sin, other=None):
    """Whether rows of ``x`` (and ``other``) may take the vector steps into ``targets``:
    targets of x's dtype (no float8 cache), and what the direct path needs (see
    backends.cpu.direct_path): a pair block and tail of whole 16 bytes, 16-byte strides
    between target rows, unit-stride table rows, and float16 converted by the CPU. Normalized
    rows take them too, from a row of the compute dtype (see _fused._token)."""
    item = x.itemsize
    block = spec.rotary_dim // 2 if spec.half_style else spec.rotary_dim
    if (block * item) % 16 or ((x.shape[-1] - spec.rotary_dim) * item) % 16:
        return False
    if x.dtype == np.float16 and not HARDWARE_F16:
        return False
    if cos.strides[-1] != cos.itemsize or sin.strides != cos.strides:
        return False
    for target in targets:
        if target.dtype != x.dtype:
            return False
        rows = zip(target.shape[:-1], target.strides[:-1])  # the feature axis is contiguous
        if any(stride % 16 for size, stride in rows if size > 1):
            return False
    return other is None or other.dtype == x.dtype


def settings(spec, block, layout, vector, check):
    """fused_step's int64 settings."""
    return np.array(
        (block, layout == "HND", spec.rotary_dim, spec.half_style, vector, check), np.int64
    )


def parallel(q, k):
    """Whether a step of these operands runs on Numba's threads."""
    size = q.shape[0] * (q.shape[1] + 2 * k.shape[1]) * q.shape[2]
    return size >= _config.CONFIG.serial_below


class _Alias:
    """An object NumPy views through the array interface: another array's memory, and that
    array (``owner``), kept alive by the view."""

    __slots__ = ("__array_interface__", "owner")


def writable(a):
    """``a``, or where it is read-only a writable alias of its memory: fused_step has one build
    per dtype combination, and a read-only operand would type a second build, whose disk-cache
    entry a later process can load for writable arrays and crash (the step writes only out and
    the caches, which are writable)."""
    if not isinstance(a, np.ndarray) or a.flags.writeable:
        return a
    alias = _Alias()
    alias.owner = a
    face = dict(a.__array_interface__)
    face["data"] = (face["data"][0], False)
    alias.__array_interface__ = face
    return np.asarray(alias)


def run(args, n, threaded):
    """fused_step(*args, tasks): on Numba's threads where ``threaded`` and this process may
    launch them, in two ranges of tokens for each of the threads Numba was configured with
    (numba.get_num_threads would ask its threading layer at every call; fewer threads set by
    numba.set_num_threads share the ranges). Numba hands each thread a run of consecutive
    ranges, so more ranges would not balance the threads, and each range is a call of
    _fused.fused_range, whose own cost (its arrays' reference counts, its scratch row) a
    range per token would pay for every token."""
    if threaded and _config.threads_usable():
        return _config.run_parallel(_step, *args, min(n, 2 * numba.config.NUMBA_NUM_THREADS))
    return _step(*args, 0)


def launch(q, out, k, v, k_cache, v_cache, slots, rows, cos, sin, block, layout, spec, q_weight,
           k_weight, numbers):  # fmt: skip
    """Run the step over every token, on Numba's threads where it is large. The caller has
    checked every argument (see _kv_cache); ``numbers``: eps and the caches' multipliers, of
    the compute dtype."""
    vector = layout_vector(spec, q, out, k, v, k_cache, v_cache, cos, sin)
    vector |= large_step_bits(q, k, v)
    args = (
        *(bits_view(a) for a in (q, out, k, v, k_cache, v_cache)), slots, rows, cos, sin,
        q_weight, k_weight, numbers, settings(spec, block, layout, vector, False),
    )  # fmt: skip
    # read-only operands aliased here, not after a type miss (see _step): a few microseconds
    # beside the general way's checks
    run(tuple(writable(a) for a in args), q.shape[0], parallel(q, k))
