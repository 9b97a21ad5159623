"""The fused step of an inference loop (``RoPE.rotate_into_cache``): for each token, q rotated
into its result, k rotated into the key cache at the token's slot and v copied into the value
cache there, each row read once; optionally each head RMS-normalized before its rotation, and
the caches float8 (e4m3fn), stored divided by their scales and saturated.

The kernels address each operand through a flat view of its memory with element strides
(``_fused_launch`` makes them, from arrays of any layout): q, k and v (token, head), the result
(token, head), each cache (block, offset in block, head). A token's table row is ``rows[t]`` of
cos and sin. Arithmetic is float32 (float64 for float64), the RMS accumulated in it, and every
value is rounded once, at its store.
"""

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload, register_jitable

from ._config import VECTOR_BYTES
from ._convert import load, store
from ._ladder import ladder, line_walk
from ._simd import copy_bytes, prefetch_row, scale_row, store_fence, sum_of_squares

# The bits of ``vector`` (see _token) past the two that choose the vector steps: a step too
# large for the cache (see _fused_launch.large_step_bits) prefetches its rows, and q's rows
# (STREAM_Q) and the caches' (STREAM_KV) that take the vector steps are written with streaming
# stores (normalized rows where they stay float32 or float64: see _token), which skip reading
# each line before it is written. Smaller steps store plainly: a
# cache row is read again soon (by attention), and a result row is as likely to be. Q_IN_PLACE:
# the result is q itself, whose rows' tails past the rotary part the vector steps leave as
# they are.
PREFETCH, STREAM_Q, STREAM_KV, Q_IN_PLACE = 4, 8, 16, 32

# The vector steps of the direct path (see _direct), with plain and with streaming stores.
_WIDTHS = (VECTOR_BYTES, 32, 16) if VECTOR_BYTES > 32 else (32, 16)
_HALF_ROW = ladder(True, _WIDTHS, False)
_PAIR_ROW = ladder(False, _WIDTHS, False)
# Rows that stream from their input (never in place: see _fused_launch.vector_steps) in whole
# cache lines (see _ladder.line_walk), but for the half style's 2-byte types: a large bfloat16
# step ran slower so, each element converted twice (as itself and as its partner)
_HALF_ROW_STREAMING = line_walk(True, True, ladder(True, _WIDTHS, True))
_PAIR_ROW_STREAMING = line_walk(False, True)
# A normalized row streams from the scratch row only where the target keeps its dtype (see
# _token): for other targets these compile to nothing.
_HALF_SCRATCH_STREAMING = ladder(True, _WIDTHS, True, one_dtype=True)
_PAIR_SCRATCH_STREAMING = ladder(False, _WIDTHS, True, one_dtype=True)
_COPY_64, _COPY_16 = copy_bytes(False, 64), copy_bytes(False, 16)
_STREAM_64, _STREAM_16 = copy_bytes(True, 64), copy_bytes(True, 16)


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


@njit(nogil=True)
def _square_at(x, j, d, zero):
    """x[j] squared in the compute dtype (of ``zero``), or zero past the row's end ``d``."""
    if j >= d:
        return zero
    value = load(x, np.uint64(j))
    return value * value


@njit(nogil=True)
def _inverse_rms(x, d, weight, eps):
    """1 / sqrt(mean(x^2) + eps) of a row (its view ``x``), in the compute dtype (every constant
    is made of its zero, so nothing widens to float64); 1 without a weight (no norm).

    The squares are summed in eight partial sums, element j into sum j % 8 in order, then added
    pairwise ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)): eight chains of additions that
    the CPU overlaps, where one sum over the row would wait on each addition in turn. The CUDA
    source sums in the same order, so both give the same bits. (Past the row's end the last
    group adds zeros, which leave a sum of squares as it is.) Compiled on its own, as is
    _square_at: inlined in Numba's IR at each call site, they made the fused step's compile
    half as long again. LLVM inlines _square_at here; this function stays a call, one per
    normalized row, beside a row's hundreds of operations."""
    zero = _zero(x)
    one = zero + np.float32(1.0)
    if weight.shape[0] == 0:
        return one
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = zero
    for j in range(0, d, 8):
        s0 += _square_at(x, j, d, zero)
        s1 += _square_at(x, j + 1, d, zero)
        s2 += _square_at(x, j + 2, d, zero)
        s3 += _square_at(x, j + 3, d, zero)
        s4 += _square_at(x, j + 4, d, zero)
        s5 += _square_at(x, j + 5, d, zero)
        s6 += _square_at(x, j + 6, d, zero)
        s7 += _square_at(x, j + 7, d, zero)
    total = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
    return one / np.sqrt(total / (zero + np.float32(d)) + (zero + eps))


@njit(inline="always")
def _factor(total, d, eps, zero):
    """1 / sqrt(total / d + eps): a row's inverse RMS from its sum of squares ``total``, in the
    compute dtype (of ``zero``), with :func:`_inverse_rms`'s arithmetic in its order (the same
    bits). A normalized row of the vector steps is made at its call site in _token from this
    and the intrinsics sum_of_squares and scale_row: a function taking the row's arrays would
    count their references at each row, with locked instructions, which also wait for the
    streaming stores before them to reach memory."""
    return (zero + np.float32(1.0)) / np.sqrt(total / (zero + np.float32(d)) + (zero + eps))


@njit(inline="always")
def _scaled(x, i, factor, weight):
    """x[i] normalized: times the row's inverse RMS and the weight of feature i."""
    value = load(x, i)
    if weight.shape[0] == 0:
        return value
    return value * factor * weight[i]


@njit(inline="always")
def _row(x, o, d, rotary_dim, cos, sin, row, half_style, inverse, weight, eps, multiplier):
    """One head's row: ``x`` normalized (where ``weight`` is not empty), its rotary part turned
    by row ``row`` of the tables (cos, sin), into ``o``; the tail copied (normalized). The
    tables are indexed whole: a view of their row would cost a pair of reference-count calls
    (atomic) at each head."""
    factor = _inverse_rms(x, d, weight, eps)
    n = rotary_dim // 2
    h = np.uint64(n)
    for j in range(n):
        k = np.uint64(j)
        c = cos[row, k]
        s = -sin[row, k] if inverse else sin[row, k]
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


@register_jitable
def _copy_rows(x, xr, o, orow, first, end, streaming):
    """o[orow + first:orow + end] = x[xr + first:...], in 64-byte then 16-byte steps (the
    launcher checks every row is a whole number of 16 bytes at 16-byte aligned stores), with
    streaming stores where ``streaming``. (One loop per kind of store: a loop that branched
    on it would have LLVM merge the two stores into one, which loses its streaming mark.)"""
    step = np.uint64(64 // o.itemsize)
    step_16 = np.uint64(16 // o.itemsize)
    t = np.uint64(first)
    end = np.uint64(end)
    if streaming:
        while t + step <= end:
            _STREAM_64(x, xr + t, o, orow + t)
            t += step
        while t < end:
            _STREAM_16(x, xr + t, o, orow + t)
            t += step_16
        return
    while t + step <= end:
        _COPY_64(x, xr + t, o, orow + t)
        t += step
    while t < end:
        _COPY_16(x, xr + t, o, orow + t)
        t += step_16


@njit(inline="always")
def _token(
    t, q, qo, k, v, kc, vc, qs, qos, ks, vs, kcs, vcs, slots, rows, cos, sin, block, hq, hkv,
    rotary_dim, d, half_style, inverse, q_weight, k_weight, numbers, vector, scratch,
):  # fmt: skip
    """Token t: each head of q into the result, and, unless its slot is negative (padding),
    each head of k and v into the caches. ``vector``: bit 0, q's rows take the vector steps;
    bit 1, k's and v's (see launch); PREFETCH, each row of q asks for its row two tokens on,
    and k's and v's rows two tokens on are asked for unless that token is padding (the caller
    sets the bit only where token t + 2 is in its range); STREAM_Q and STREAM_KV, q's and the
    caches' rows that take the vector steps from their input are written with streaming stores
    (see _fused_launch.large_step_bits); Q_IN_PLACE, q's rows are their own results, whose
    tails the vector steps do not copy. A normalized row takes the vector steps from
    ``scratch`` (d elements of the compute dtype), where sum_of_squares and scale_row put it
    (see :func:`_factor`). Under STREAM_Q (STREAM_KV), a normalized q (k) row whose target keeps
    the scratch row's dtype (float32, float64) streams from it, and so do the v rows beside
    normalized k rows; normalized rows narrowed to a 2-byte type, and their v rows, store
    plainly, which a large normalized bfloat16 step runs faster with. ``numbers``: eps and the
    caches' multipliers. (Thirty arguments at most: CPython passes a longer call's as a tuple,
    which Numba does not inline.)"""
    eps, k_multiplier, v_multiplier = numbers[0], numbers[1], numbers[2]
    row = rows[t]
    tb = np.uint64(row) * np.uint64(cos.strides[0] // cos.itemsize)
    n = np.uint64(rotary_dim)
    zero = np.uint64(0)
    stream_q, stream_kv = vector & STREAM_Q != 0, vector & STREAM_KV != 0
    zero_c = _zero(scratch)  # of the compute dtype
    # The vector rows call the ladders and _copy_rows (compiled on their own, inlined by LLVM)
    # directly: a helper inlined in Numba's IR rebinds its array arguments at each head, with a
    # pair of reference-count calls (atomic) per array.
    for head in range(hq):
        xb = np.uint64(qs[0] + t * qs[1] + head * qs[2])
        ob = np.uint64(qos[0] + t * qos[1] + head * qos[2])
        if vector & PREFETCH:
            prefetch_row(q, xb + np.uint64(2 * qs[1]), np.uint64(d))
        if vector & 1 and q_weight.shape[0]:
            total = sum_of_squares(q, xb, np.uint64(d))
            scale_row(q, xb, np.uint64(d), _factor(total, d, eps, zero_c), q_weight, scratch)
            if stream_q and qo.itemsize == scratch.itemsize:
                if half_style:
                    _HALF_SCRATCH_STREAMING(scratch, zero, qo, ob, n, cos, sin, tb, inverse)
                else:
                    _PAIR_SCRATCH_STREAMING(scratch, zero, qo, ob, n, cos, sin, tb, inverse)
                if d > rotary_dim:
                    _copy_rows(scratch, zero, qo, ob, rotary_dim, d, True)
            else:
                if half_style:
                    _HALF_ROW(scratch, zero, qo, ob, n, cos, sin, tb, inverse)
                else:
                    _PAIR_ROW(scratch, zero, qo, ob, n, cos, sin, tb, inverse)
                for j in range(rotary_dim, d):
                    store(qo, ob + np.uint64(j), scratch[j])
        elif vector & 1:
            if stream_q and half_style:
                _HALF_ROW_STREAMING(q, xb, qo, ob, n, cos, sin, tb, inverse)
            elif stream_q:
                _PAIR_ROW_STREAMING(q, xb, qo, ob, n, cos, sin, tb, inverse)
            elif half_style:
                _HALF_ROW(q, xb, qo, ob, n, cos, sin, tb, inverse)
            else:
                _PAIR_ROW(q, xb, qo, ob, n, cos, sin, tb, inverse)
            if d > rotary_dim and not vector & Q_IN_PLACE:
                _copy_rows(q, xb, qo, ob, rotary_dim, d, stream_q)
        else:
            _row(q[xb:], qo[ob:], d, rotary_dim, cos, sin, row, half_style, inverse, q_weight,
                 eps, 1.0)  # fmt: skip
    if vector & PREFETCH and slots[t + 2] >= 0:
        for head in range(hkv):
            prefetch_row(k, np.uint64(ks[0] + (t + 2) * ks[1] + head * ks[2]), np.uint64(d))
            prefetch_row(v, np.uint64(vs[0] + (t + 2) * vs[1] + head * vs[2]), np.uint64(d))
    slot = slots[t]
    if slot < 0:
        return
    page, offset = slot // block, slot % block
    for head in range(hkv):
        kb = np.uint64(ks[0] + t * ks[1] + head * ks[2])
        cb = np.uint64(kcs[0] + page * kcs[1] + offset * kcs[2] + head * kcs[3])
        vb = np.uint64(vs[0] + t * vs[1] + head * vs[2])
        vcb = np.uint64(vcs[0] + page * vcs[1] + offset * vcs[2] + head * vcs[3])
        if vector & 2 and k_weight.shape[0]:
            total = sum_of_squares(k, kb, np.uint64(d))
            scale_row(k, kb, np.uint64(d), _factor(total, d, eps, zero_c), k_weight, scratch)
            if stream_kv and kc.itemsize == scratch.itemsize:
                if half_style:
                    _HALF_SCRATCH_STREAMING(scratch, zero, kc, cb, n, cos, sin, tb, inverse)
                else:
                    _PAIR_SCRATCH_STREAMING(scratch, zero, kc, cb, n, cos, sin, tb, inverse)
                if d > rotary_dim:
                    _copy_rows(scratch, zero, kc, cb, rotary_dim, d, True)
                _copy_rows(v, vb, vc, vcb, 0, d, True)
            else:
                if half_style:
                    _HALF_ROW(scratch, zero, kc, cb, n, cos, sin, tb, inverse)
                else:
                    _PAIR_ROW(scratch, zero, kc, cb, n, cos, sin, tb, inverse)
                for j in range(rotary_dim, d):
                    store(kc, cb + np.uint64(j), scratch[j])
                _copy_rows(v, vb, vc, vcb, 0, d, False)
        elif vector & 2:
            if stream_kv and half_style:
                _HALF_ROW_STREAMING(k, kb, kc, cb, n, cos, sin, tb, inverse)
            elif stream_kv:
                _PAIR_ROW_STREAMING(k, kb, kc, cb, n, cos, sin, tb, inverse)
            elif half_style:
                _HALF_ROW(k, kb, kc, cb, n, cos, sin, tb, inverse)
            else:
                _PAIR_ROW(k, kb, kc, cb, n, cos, sin, tb, inverse)
            if d > rotary_dim:
                _copy_rows(k, kb, kc, cb, rotary_dim, d, stream_kv)
            _copy_rows(v, vb, vc, vcb, 0, d, stream_kv)
        else:
            _row(k[kb:], kc[cb:], d, rotary_dim, cos, sin, row, half_style, inverse, k_weight,
                 eps, k_multiplier)  # fmt: skip
            _copy(v[vb:], vc[vcb:], d, v_multiplier)


@njit(inline="always")
def _scratch(q_weight, k_weight, d):
    """A row of the compute dtype (the weights'), where a norm needs one: d rounded up to a
    multiple of 8 (see _simd.scale_row)."""
    row = (d + 7) // 8 * 8 if q_weight.shape[0] or k_weight.shape[0] else 0
    return np.empty(row, q_weight.dtype)


# fused_range and fused_parallel are compiled only into fused_step (_fused_launch), which the
# disk cache keeps; they are not cached themselves. A cached function compiled over a parallel
# callee that was loaded from the cache calls it at an address that a later process, loading
# the caller alone, leaves 0 (Numba 0.68; a plain callee links). fused_range is compiled in
# too, so that the launcher's build never depends on what the cache held when it compiled.
# fused_parallel calls fused_range for each range, so that the step's body (_token, inlined)
# is typed, lowered and optimized once in the build, not twice.
@njit(nogil=True)
def fused_range(
    q, qo, k, v, kc, vc, qs, qos, ks, vs, kcs, vcs, slots, rows, cos, sin, block, hq, hkv,
    rotary_dim, d, half_style, inverse, q_weight, k_weight, numbers, vector, first, stop,
):  # fmt: skip
    """Tokens first..stop-1 on one thread. The int64 ``qs`` (and ``qos``, ``ks``, ``vs``) hold
    the operand's element offset, token stride and head stride; the caches' ``kcs`` and
    ``vcs`` the offset and the block, offset-in-block and head strides. ``vector``'s PREFETCH
    bit is dropped for the range's last two tokens (see _token); where it streams, the range
    ends in a store fence."""
    scratch = _scratch(q_weight, k_weight, d)
    for t in range(first, stop):
        steps = vector if t + 2 < stop else vector & ~PREFETCH
        _token(
            t, q, qo, k, v, kc, vc, qs, qos, ks, vs, kcs, vcs, slots, rows, cos, sin, block, hq,
            hkv, rotary_dim, d, half_style, inverse, q_weight, k_weight, numbers, steps, scratch,
        )  # fmt: skip
    if vector & (STREAM_Q | STREAM_KV):
        store_fence()


@njit(parallel=True)
def fused_parallel(
    q, qo, k, v, kc, vc, qs, qos, ks, vs, kcs, vcs, slots, rows, cos, sin, block, hq, hkv,
    rotary_dim, d, half_style, inverse, q_weight, k_weight, numbers, vector, tasks, total,
):  # fmt: skip
    """The tokens 0..total-1 split into ``tasks`` ranges on Numba's threads, each run by
    fused_range."""
    for task in prange(tasks):
        t = np.int64(task)
        fused_range(
            q, qo, k, v, kc, vc, qs, qos, ks, vs, kcs, vcs, slots, rows, cos, sin, block, hq, hkv,
            rotary_dim, d, half_style, inverse, q_weight, k_weight, numbers, vector,
            total * t // tasks, total * (t + 1) // tasks,
        )  # fmt: skip
