"""Numba CPU kernels and their launcher.

One row body serves every dtype and pair style. The dtype of the flat views picks the element
conversion at compile time: float32 and float64 are read as they are; float16 travels as int16
bits and bfloat16 as uint16 bits (Numba has no CPU half type) and both are converted in
registers. Every kernel is compiled once per dtype and cached on disk.

Operand geometry ``g`` is an int64 array of shape (2, 4, L + 1), one block per operand (q, k):
  g[t, 0, :L] leading sizes        g[t, 0, L] element stride of the axes dimension of ``idx``
  g[t, 1, :L] x strides            g[t, 1, L] x offset
  g[t, 2, :L] out strides          g[t, 2, L] out offset
  g[t, 3, :L] idx strides          g[t, 3, L] idx offset
all in elements of the flat views. ``rotate`` passes an empty second operand.
"""

import os

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from ._layout import flat_view

# Inputs below this many elements run on one thread: a parallel launch costs ~2 µs and can stall
# for milliseconds after an idle gap, more than the whole work of a decode step.
SERIAL_BELOW = int(os.environ.get("ARRAYROPE_SERIAL_BELOW", 1 << 16))
_CACHE = os.environ.get("ARRAYROPE_NUMBA_CACHE", "1") != "0"


@intrinsic
def _u32_as_f32(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def _f32_as_u32(typingctx, value):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


_F16_SUBNORMAL = np.float32(2.0**-24)
_F16_SUBNORMAL_INV = np.float32(2.0**24)
_RNE_MAGIC = np.float32(2.0**23)


@njit
def _f16_to_f32(h):
    bits = np.uint32(np.uint16(h))
    sign = (bits & np.uint32(0x8000)) << np.uint32(16)
    mag = bits & np.uint32(0x7FFF)
    if mag >= np.uint32(0x7C00):  # inf, nan: all-ones exponent, mantissa kept
        out = (mag << np.uint32(13)) | np.uint32(0x7F800000)
    elif mag >= np.uint32(0x0400):  # normal: rebias the exponent from 15 to 127
        out = (mag << np.uint32(13)) + np.uint32(0x38000000)
    else:  # subnormal or zero: exactly mag * 2**-24
        out = _f32_as_u32(np.float32(mag) * _F16_SUBNORMAL)
    return _u32_as_f32(out | sign)


@njit
def _f32_to_f16(f):
    bits = _f32_as_u32(f)
    sign = (bits >> np.uint32(16)) & np.uint32(0x8000)
    mag = bits & np.uint32(0x7FFFFFFF)
    if mag > np.uint32(0x7F800000):  # nan stays a quiet nan
        out = np.uint32(0x7E00)
    elif mag >= np.uint32(0x477FF000):  # >= 65520 rounds to inf
        out = np.uint32(0x7C00)
    elif mag < np.uint32(0x38800000):  # below 2**-14: subnormal, round half to even via 2**23
        scaled = _u32_as_f32(mag) * _F16_SUBNORMAL_INV
        out = np.uint32((scaled + _RNE_MAGIC) - _RNE_MAGIC)
    else:  # normal: rebias, round half to even on the 13 dropped bits
        odd = (mag >> np.uint32(13)) & np.uint32(1)
        out = (mag - np.uint32(0x38000000) + np.uint32(0xFFF) + odd) >> np.uint32(13)
    return np.int16(np.uint16(out | sign))


@njit
def _bf16_to_f32(h):
    return _u32_as_f32(np.uint32(h) << np.uint32(16))


@njit
def _f32_to_bf16(f):
    bits = _f32_as_u32(f)
    if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):  # nan stays a quiet nan
        return np.uint16((bits >> np.uint32(16)) | np.uint32(0x40))
    odd = (bits >> np.uint32(16)) & np.uint32(1)
    return np.uint16((bits + np.uint32(0x7FFF) + odd) >> np.uint32(16))


def _load(a, i):
    """The element a[i] as a float of the compute dtype."""


def _store(a, i, v):
    """a[i] = v, rounded once to a's storage type."""


@overload(_load)
def _load_impl(a, i):
    if a.dtype == types.int16:
        return lambda a, i: _f16_to_f32(a[i])
    if a.dtype == types.uint16:
        return lambda a, i: _bf16_to_f32(a[i])
    return lambda a, i: a[i]


@overload(_store)
def _store_impl(a, i, v):
    if a.dtype == types.int16:

        def store_f16(a, i, v):
            a[i] = _f32_to_f16(v)

        return store_f16
    if a.dtype == types.uint16:

        def store_bf16(a, i, v):
            a[i] = _f32_to_bf16(v)

        return store_bf16

    def store_float(a, i, v):
        a[i] = v

    return store_float


@njit
def _row(x, o, idx, g, t, r, cos, sin, seg, rotary_dim, d, half_style, sign, copy_tail):
    nlead = g.shape[2] - 1
    xb = g[t, 1, nlead]
    ob = g[t, 2, nlead]
    pb = g[t, 3, nlead]
    rem = np.int64(r)  # a prange index may be unsigned; int64 keeps the index arithmetic integral
    for ax in range(nlead - 1, -1, -1):
        n = g[t, 0, ax]
        i = rem % n
        rem //= n
        xb += i * g[t, 1, ax]
        ob += i * g[t, 2, ax]
        pb += i * g[t, 3, ax]
    axis_stride = g[t, 0, nlead]
    half = rotary_dim // 2
    for s in range(seg.shape[0]):
        p = idx[pb + seg[s, 2] * axis_stride]
        c_row = cos[p]
        s_row = sin[p]
        if half_style:
            for j in range(seg[s, 0], seg[s, 1]):
                c = c_row[j]
                sn = s_row[j] * sign
                a = _load(x, xb + j)
                b = _load(x, xb + j + half)
                _store(o, ob + j, a * c - b * sn)
                _store(o, ob + j + half, b * c + a * sn)
        else:
            for j in range(seg[s, 0], seg[s, 1]):
                c = c_row[j]
                sn = s_row[j] * sign
                a = _load(x, xb + 2 * j)
                b = _load(x, xb + 2 * j + 1)
                _store(o, ob + 2 * j, a * c - b * sn)
                _store(o, ob + 2 * j + 1, b * c + a * sn)
    if copy_tail:
        for j in range(rotary_dim, d):
            o[ob + j] = x[xb + j]


@njit(cache=_CACHE)
def _count_rows(g, t):
    total = 1
    for ax in range(g.shape[2] - 1):
        total *= g[t, 0, ax]
    return total


@njit(cache=_CACHE)
def rotate_serial(x1, o1, i1, x2, o2, i2, g, cos, sin, seg, rotary_dim, d, half_style, sign,
                  copy_tail):
    n1 = _count_rows(g, 0)
    n2 = _count_rows(g, 1)
    for r in range(n1):
        _row(x1, o1, i1, g, 0, r, cos, sin, seg, rotary_dim, d, half_style, sign, copy_tail)
    for r in range(n2):
        _row(x2, o2, i2, g, 1, r, cos, sin, seg, rotary_dim, d, half_style, sign, copy_tail)


@njit(cache=_CACHE, parallel=True)
def rotate_parallel(x1, o1, i1, x2, o2, i2, g, cos, sin, seg, rotary_dim, d, half_style, sign,
                    copy_tail):
    n1 = _count_rows(g, 0)
    n2 = _count_rows(g, 1)
    for r in prange(n1 + n2):
        if r < n1:
            _row(x1, o1, i1, g, 0, r, cos, sin, seg, rotary_dim, d, half_style, sign, copy_tail)
        else:
            _row(x2, o2, i2, g, 1, r - n1, cos, sin, seg, rotary_dim, d, half_style, sign,
                 copy_tail)


@njit(cache=_CACHE)
def position_range(p):
    """(min, max, all finite) of a flat position array, in one pass."""
    lo = p[0]
    hi = p[0]
    finite = True
    for v in p:
        if v < lo:
            lo = v
        if v > hi:
            hi = v
        if v != v or v - v != 0:  # nan, or +-inf (inf - inf is nan)
            finite = False
    return lo, hi, finite


_BITS_VIEW = {"float16": np.int16, "bfloat16": np.uint16}
_geometry_cache = {}


def _geometry(operands):
    """The (2, 4, L + 1) geometry of the operands, memoized on shapes and strides."""
    key = tuple((x.shape, x.strides, o.strides, i.shape, i.strides) for x, o, i in operands)
    g = _geometry_cache.get(key)
    if g is not None:
        return g
    nlead = operands[0][0].ndim - 1
    g = np.zeros((2, 4, nlead + 1), dtype=np.int64)
    for t, (x, out, idx) in enumerate(operands):
        g[t, 0, :nlead] = x.shape[:-1]
        g[t, 0, nlead] = 0 if idx.shape[-1] == 1 else idx.strides[-1] // idx.itemsize
        for row, a in ((1, x), (2, out)):
            g[t, row, :nlead] = [s // a.itemsize for s in a.strides[:-1]]
            g[t, row, nlead] = flat_view(a)[1]
        g[t, 3, :nlead] = [
            0 if n == 1 else s // idx.itemsize for n, s in zip(idx.shape[:-1], idx.strides[:-1])
        ]
        g[t, 3, nlead] = flat_view(idx)[1]
    if len(_geometry_cache) > 256:
        _geometry_cache.clear()
    _geometry_cache[key] = g
    return g


def launch(operands, cos, sin, segments, rotary_dim, half_style, inverse):
    """Rotate one or two operands (q and k) in one kernel call.

    ``operands`` holds (x, out, idx) triples: x and out of shape (L leading..., d), the feature
    axis contiguous, every stride a whole number of elements; idx int64 of shape
    (L axes of size 1 or matching..., n_axes or 1), rows of ``cos``/``sin``.
    """
    g = _geometry(operands)
    flats = []
    for x, out, idx in operands:
        xf = flat_view(x)[0]
        of = xf if out is x else flat_view(out)[0]
        view = _BITS_VIEW.get(x.dtype.name)
        if view is not None:
            xf, of = xf.view(view), of.view(view)
        flats.append((xf, of, flat_view(idx)[0]))
    if len(flats) == 1:
        flats.append(flats[0])  # the empty second operand: g[1] has zero rows
    size = sum(x.size for x, _, _ in operands)
    kernel = rotate_serial if size < SERIAL_BELOW else rotate_parallel
    (x1, o1, i1), (x2, o2, i2) = flats
    d = operands[0][0].shape[-1]
    copy_tail = rotary_dim < d and any(out is not x for x, out, _ in operands)
    sign = cos.dtype.type(-1.0 if inverse else 1.0)
    kernel(x1, o1, i1, x2, o2, i2, g, cos, sin, segments, rotary_dim, d, half_style, sign,
           copy_tail)
