"""The fused step of an inference loop (``RoPE.rotate_into_cache``): for each token, q rotated
into its result, k rotated into the key cache at the token's slot and v copied into the value
cache there, each row read once; optionally each head RMS-normalized before its rotation, and
the caches float8 (e4m3fn), stored divided by their scales and saturated.

The kernels address each operand through a flat view of its memory with element strides
(:func:`fused_step` makes them, from arrays of any layout): q, k and v (token, head), the result
(token, head), each cache (block, offset in block, head). A token's table row is ``rows[t]`` of
cos and sin. Arithmetic is float32 (float64 for float64), the RMS accumulated in it, and every
value is rounded once, at its store.
"""

import functools
import threading

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from . import _config
from ._config import DISK_CACHE, HARDWARE_F16, VECTOR_BYTES
from ._convert import load, store
from ._decode import memory_span
from ._ladder import ladder
from ._simd import copy_bytes, span
from ._step_checks import bounds, check_slots

# The vector steps of the direct path (see _direct), with plain stores: a cache row is read
# again soon (by attention), and a result row is as likely to be.
_WIDTHS = (VECTOR_BYTES, 32, 16) if VECTOR_BYTES > 32 else (32, 16)
_HALF_ROW = ladder(True, _WIDTHS, False)
_PAIR_ROW = ladder(False, _WIDTHS, False)
_COPY_64 = copy_bytes(False, 64)
_COPY_16 = copy_bytes(False, 16)


@intrinsic
def _f32_bits(typingctx, value):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


_E4M3_MAX = np.uint32(0x7E)  # 448, the largest finite e4m3fn value
_MAGIC = np.float32(2.0**23)


@njit(inline="always")
def to_e4m3(v):
    """float32 ``v`` as float8 e4m3fn bits, rounded half to even and saturated at +-448; a nan
    stays a nan."""
    f = np.float32(v)
    bits = _f32_bits(f)
    sign = np.uint8((bits >> np.uint32(24)) & np.uint32(0x80))
    mag = bits & np.uint32(0x7FFFFFFF)
    if mag > np.uint32(0x7F800000):
        return np.uint8(0x7F) | sign
    if mag < np.uint32(0x3C800000):  # below 2**-6: a multiple of 2**-9, rounded through 2**23
        scaled = abs(f) * np.float32(512.0)
        return np.uint8(np.uint32((scaled + _MAGIC) - _MAGIC)) | sign
    odd = (mag >> np.uint32(20)) & np.uint32(1)
    rounded = (mag + np.uint32(0x7FFFF) + odd) >> np.uint32(20)  # 8 exponent, 3 mantissa bits
    rebiased = rounded - np.uint32((127 - 7) << 3)
    return np.uint8(min(rebiased, _E4M3_MAX)) | sign


def put(a, i, v, multiplier):
    """a[i] = v, stored as a's type: a float8 cache (uint8 bits) takes v * multiplier."""


@overload(put)
def _put_impl(a, i, v, multiplier):
    if a.dtype == types.uint8:

        def put_e4m3(a, i, v, multiplier):
            a[i] = to_e4m3(v * multiplier)

        return put_e4m3
    return lambda a, i, v, multiplier: store(a, i, v)


def _zero(x):
    """Zero of the compute dtype of a view's elements: float64 for float64, else float32."""


@overload(_zero)
def _zero_impl(x):
    if x.dtype == types.float64:
        return lambda x: np.float64(0.0)
    return lambda x: np.float32(0.0)


@njit(inline="always")
def _inverse_rms(x, d, weight, eps):
    """1 / sqrt(mean(x^2) + eps) of a row (its view ``x``), in the compute dtype (every constant
    is made of its zero, so nothing widens to float64); 1 without a weight (no norm)."""
    zero = _zero(x)
    one = zero + np.float32(1.0)
    if weight.shape[0] == 0:
        return one
    total = zero
    for j in range(d):
        value = load(x, np.uint64(j))
        total += value * value
    return one / np.sqrt(total / (zero + np.float32(d)) + (zero + eps))


@njit(inline="always")
def _scaled(x, i, factor, weight):
    """x[i] normalized: times the row's inverse RMS and the weight of feature i."""
    value = load(x, i)
    if weight.shape[0] == 0:
        return value
    return value * factor * weight[i]


@njit(inline="always")
def _row(x, o, d, rotary_dim, cos, sin, half_style, inverse, weight, eps, multiplier):
    """One head's row: ``x`` normalized (where ``weight`` is not empty), its rotary part turned
    by the table row (cos, sin), into ``o``; the tail copied (normalized)."""
    factor = _inverse_rms(x, d, weight, eps)
    n = rotary_dim // 2
    h = np.uint64(n)
    for j in range(n):
        k = np.uint64(j)
        c = cos[k]
        s = -sin[k] if inverse else sin[k]
        two_k = np.uint64(2) * k
        ia, ib = (k, k + h) if half_style else (two_k, two_k + np.uint64(1))
        a = _scaled(x, ia, factor, weight)
        b = _scaled(x, ib, factor, weight)
        put(o, ia, a * c - b * s, multiplier)
        put(o, ib, b * c + a * s, multiplier)
    for j in range(rotary_dim, d):
        i = np.uint64(j)
        put(o, i, _scaled(x, i, factor, weight), multiplier)


@njit(inline="always")
def _copy(x, o, d, multiplier):
    for j in range(d):
        i = np.uint64(j)
        put(o, i, load(x, i), multiplier)


@njit(inline="always")
def _copy_rows(x, xr, o, orow, first, end):
    """o[orow + first:orow + end] = x[xr + first:...], in 64-byte then 16-byte steps (the
    launcher checks every row is a whole number of 16 bytes at 16-byte aligned stores)."""
    step = np.uint64(64 // o.itemsize)
    step_16 = np.uint64(16 // o.itemsize)
    t = np.uint64(first)
    end = np.uint64(end)
    while t + step <= end:
        _COPY_64(x, xr + t, o, orow + t)
        t += step
    while t < end:
        _COPY_16(x, xr + t, o, orow + t)
        t += step_16


@njit(inline="always")
def _vector_row(x, xr, o, orow, rotary_dim, d, cos, sin, tb, half_style, inverse):
    """One head's row without a norm, of o's dtype, in vector steps: its rotary part turned by
    the table row at flat offset ``tb``, its tail copied."""
    n = np.uint64(rotary_dim)
    if half_style:
        _HALF_ROW(x, xr, o, orow, n, cos, sin, tb, inverse)
    else:
        _PAIR_ROW(x, xr, o, orow, n, cos, sin, tb, inverse)
    if d > rotary_dim:
        _copy_rows(x, xr, o, orow, rotary_dim, d)


@njit(inline="always")
def _token(
    t, q, qo, k, v, kc, vc, qs, qos, ks, vs, kcs, vcs, slots, rows, cos, sin, block, hq, hkv,
    rotary_dim, d, half_style, inverse, q_weight, k_weight, eps, k_multiplier, v_multiplier,
    vector,
):  # fmt: skip
    """Token t: each head of q into the result, and, unless its slot is negative (padding),
    each head of k and v into the caches. ``vector``: bit 0, q's rows take the vector steps;
    bit 1, k's and v's (see launch)."""
    row = rows[t]
    c, s = cos[row], sin[row]
    tb = np.uint64(row) * np.uint64(cos.strides[0] // cos.itemsize)
    for head in range(hq):
        xb = np.uint64(qs[0] + t * qs[1] + head * qs[2])
        ob = np.uint64(qos[0] + t * qos[1] + head * qos[2])
        if vector & 1:
            _vector_row(q, xb, qo, ob, rotary_dim, d, cos, sin, tb, half_style, inverse)
        else:
            _row(q[xb:], qo[ob:], d, rotary_dim, c, s, half_style, inverse, q_weight, eps, 1.0)
    slot = slots[t]
    if slot < 0:
        return
    page, offset = slot // block, slot % block
    for head in range(hkv):
        kb = np.uint64(ks[0] + t * ks[1] + head * ks[2])
        cb = np.uint64(kcs[0] + page * kcs[1] + offset * kcs[2] + head * kcs[3])
        vb = np.uint64(vs[0] + t * vs[1] + head * vs[2])
        vcb = np.uint64(vcs[0] + page * vcs[1] + offset * vcs[2] + head * vcs[3])
        if vector & 2:
            _vector_row(k, kb, kc, cb, rotary_dim, d, cos, sin, tb, half_style, inverse)
            _copy_rows(v, vb, vc, vcb, 0, d)
        else:
            _row(k[kb:], kc[cb:], d, rotary_dim, c, s, half_style, inverse, k_weight, eps,
                 k_multiplier)  # fmt: skip
            _copy(v[vb:], vc[vcb:], d, v_multiplier)


@njit(cache=DISK_CACHE, nogil=True)
def fused_range(
    q, qo, k, v, kc, vc, qs, qos, ks, vs, kcs, vcs, slots, rows, cos, sin, block, hq, hkv,
    rotary_dim, d, half_style, inverse, q_weight, k_weight, eps, k_multiplier, v_multiplier,
    vector, first, stop,
):  # fmt: skip
    """Tokens first..stop-1 on one thread. The int64 ``qs`` (and ``qos``, ``ks``, ``vs``) hold
    the operand's element offset, token stride and head stride; the caches' ``kcs`` and
    ``vcs`` the offset and the block, offset-in-block and head strides."""
    for t in range(first, stop):
        _token(
            t, q, qo, k, v, kc, vc, qs, qos, ks, vs, kcs, vcs, slots, rows, cos, sin, block, hq,
            hkv, rotary_dim, d, half_style, inverse, q_weight, k_weight, eps, k_multiplier,
            v_multiplier, vector,
        )  # fmt: skip


@njit(cache=DISK_CACHE, parallel=True)
def fused_parallel(
    q, qo, k, v, kc, vc, qs, qos, ks, vs, kcs, vcs, slots, rows, cos, sin, block, hq, hkv,
    rotary_dim, d, half_style, inverse, q_weight, k_weight, eps, k_multiplier, v_multiplier,
    vector, tasks, total,
):  # fmt: skip
    """The tokens 0..total-1 split into ``tasks`` ranges on Numba's threads."""
    for task in prange(tasks):
        t = np.int64(task)
        for token in range(total * t // tasks, total * (t + 1) // tasks):
            _token(
                token, q, qo, k, v, kc, vc, qs, qos, ks, vs, kcs, vcs, slots, rows, cos, sin,
                block, hq, hkv, rotary_dim, d, half_style, inverse, q_weight, k_weight, eps,
                k_multiplier, v_multiplier, vector,
            )  # fmt: skip


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
def vector_steps(allowed, out_at, k_cache_at, v_cache_at):
    """The vector steps a launch takes: those the layouts allow (see :func:`layout_vector`)
    whose targets' addresses are 16-byte aligned."""
    steps = allowed & 1 if out_at % 16 == 0 else 0
    if k_cache_at % 16 == 0 and v_cache_at % 16 == 0:
        steps |= allowed & 2
    return steps


@njit(cache=DISK_CACHE, nogil=True)
def fused_step(q, out, k, v, kc, vc, slots, rows, cos, sin, q_weight, k_weight, numbers,
               settings, tasks):  # fmt: skip
    """Launch the step on arrays of any layout (the half types and float8 as their bits): their
    flat views, offsets and strides made here. ``settings`` (see :func:`settings`): block
    size, HND, rotary_dim, half style, the vector steps the layouts allow (see
    :func:`layout_vector`) and whether to check; ``numbers``: eps and the caches'
    multipliers, of the compute dtype; ``tasks``: how many ranges of tokens Numba's threads
    share (0: the caller's thread runs them all).

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
        if check_slots(slots, kc.shape[0] * block)[0]:
            return SLOTS
        low, high = bounds(rows)
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
                if not (w == 1 and other == 0 and same and q.strides == out.strides):
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
    vector = vector_steps(settings[4], at[1], at[4], at[5])
    args = (
        qf, of, kf, vf, kcf, vcf, qs, os_, _strides(k, kb, 0, 1, -1), _strides(v, vb, 0, 1, -1),
        _strides(kc, kcb, 0, offset, heads), _strides(vc, vcb, 0, offset, heads), slots, rows,
        cos, sin, block, hq, k.shape[1], rotary_dim, d, half_style != 0, False, q_weight,
        k_weight, numbers[0], numbers[1], numbers[2], vector,
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
    """fused_step(*args), compiling it first for a new dtype combination."""
    if not _built:
        _specialized(args)
    try:
        return fused_step(*args)
    except TypeError:  # no build for these types yet (Numba raises before running anything)
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


def layout_vector(spec, q, out, k, v, k_cache, v_cache, q_weight, k_weight, cos, sin):
    """The vector steps the layouts allow, where the targets' addresses are 16-byte aligned
    (fused_step checks those): bit 0 for q's rows, bit 1 for k's and v's."""
    vector = int(_vector(spec, q, (out,), q_weight, cos, sin))
    return vector | 2 * int(_vector(spec, k, (k_cache, v_cache), k_weight, cos, sin, v))


def _vector(spec, x, targets, weight, cos, sin, other=None):
    """Whether rows of ``x`` (and ``other``) may take the vector steps into ``targets``: no norm,
    targets of x's dtype, and what the direct path needs (see backends.cpu.direct_path): a pair
    block and tail of whole 16 bytes, 16-byte strides between target rows, unit-stride table
    rows, and float16 converted by the CPU."""
    item = x.itemsize
    block = spec.rotary_dim // 2 if spec.half_style else spec.rotary_dim
    if weight.size or (block * item) % 16 or ((x.shape[-1] - spec.rotary_dim) * item) % 16:
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


def run(args, n, threaded):
    """fused_step(*args, tasks): on Numba's threads where ``threaded`` and this process may
    launch them, in ranges of tokens a few per thread."""
    if threaded and _config.threads_usable():
        return _config.run_parallel(_step, *args, min(n, 16 * numba.get_num_threads()))
    return _step(*args, 0)


def launch(q, out, k, v, k_cache, v_cache, slots, rows, cos, sin, block, layout, spec, q_weight,
           k_weight, numbers):  # fmt: skip
    """Run the step over every token, on Numba's threads where it is large. The caller has
    checked every argument (see _kv_cache); ``numbers``: eps and the caches' multipliers, of
    the compute dtype."""
    vector = layout_vector(spec, q, out, k, v, k_cache, v_cache, q_weight, k_weight, cos, sin)
    args = (
        *(bits_view(a) for a in (q, out, k, v, k_cache, v_cache)), slots, rows, cos, sin,
        q_weight, k_weight, numbers, settings(spec, block, layout, vector, False),
    )  # fmt: skip
    run(args, q.shape[0], parallel(q, k))
