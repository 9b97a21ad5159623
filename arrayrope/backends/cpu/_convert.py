"""Element loads and stores for every storage dtype, converting in registers.

Numba has no CPU half type, so float16 travels as int16 bits and bfloat16 as uint16 bits; the
dtype of a flat view picks the conversion at compile time. Arithmetic is float32 for the half
types (float64 for float64), and a result is rounded once, at the store, half to even.
"""

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from ._config import HARDWARE_F16


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


@intrinsic
def _f16_bits_widen(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.int16), codegen


@intrinsic
def _f16_bits_narrow(typingctx, value):
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.int16(types.float32), codegen


_F16_SUBNORMAL = np.float32(2.0**-24)
_F16_SUBNORMAL_INV = np.float32(2.0**24)
_RNE_MAGIC = np.float32(2.0**23)


# The bit-arithmetic conversions, for CPUs without F16C; tests check them against NumPy for every
# float16 value. Written as selects, not branches, so that loops over them vectorize.
@njit
def f16_to_f32(h):
    bits = np.uint32(np.uint16(h))
    sign = (bits & np.uint32(0x8000)) << np.uint32(16)
    mag = bits & np.uint32(0x7FFF)
    normal = (mag << np.uint32(13)) + np.uint32(0x38000000)  # rebias the exponent 15 -> 127
    subnormal = _f32_as_u32(np.float32(mag) * _F16_SUBNORMAL)  # exactly mag * 2**-24
    special = (mag << np.uint32(13)) | np.uint32(0x7F800000)  # inf, nan: mantissa kept
    out = subnormal if mag < np.uint32(0x0400) else normal
    out = special if mag >= np.uint32(0x7C00) else out
    return _u32_as_f32(out | sign)


@njit
def f32_to_f16(f):
    bits = _f32_as_u32(f)
    sign = (bits >> np.uint32(16)) & np.uint32(0x8000)
    mag = bits & np.uint32(0x7FFFFFFF)
    # normal: rebias, round half to even on the 13 dropped bits
    odd = (mag >> np.uint32(13)) & np.uint32(1)
    normal = (mag - np.uint32(0x38000000) + np.uint32(0xFFF) + odd) >> np.uint32(13)
    # below 2**-14: subnormal, scaled to an integer and rounded half to even through 2**23
    small = mag if mag < np.uint32(0x38800000) else np.uint32(0x38800000)
    scaled = _u32_as_f32(small) * _F16_SUBNORMAL_INV
    subnormal = np.uint32((scaled + _RNE_MAGIC) - _RNE_MAGIC)
    out = subnormal if mag < np.uint32(0x38800000) else normal
    out = np.uint32(0x7C00) if mag >= np.uint32(0x477FF000) else out  # >= 65520 rounds to inf
    out = np.uint32(0x7E00) if mag > np.uint32(0x7F800000) else out  # nan stays a quiet nan
    return np.int16(np.uint16(out | sign))


@njit
def bf16_to_f32(h):
    return _u32_as_f32(np.uint32(h) << np.uint32(16))


@njit
def f32_to_bf16(f):
    """Any float32 to bfloat16 bits, round half to even; a nan stays a quiet nan."""
    bits = _f32_as_u32(f)
    if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((bits >> np.uint32(16)) | np.uint32(0x40))
    return _bf16_round(bits)


@njit(inline="always")
def _bf16_round(bits):
    odd = (bits >> np.uint32(16)) & np.uint32(1)
    return np.uint16((bits + np.uint32(0x7FFF) + odd) >> np.uint32(16))


@njit
def f32_to_bf16_result(f):
    """A kernel result to bfloat16 bits, round half to even, with no nan test.

    Every nan that reaches a store is an arithmetic result, so it is quiet (bit 22 set) and
    carries either a quieted input payload or the CPU's default nan (IEEE 754 6.2.3; LLVM's
    LangRef allows just these two). Inputs are bfloat16 widened (low 16 bits zero) and finite
    float32 tables, so its low 16 bits are zero and the rounding leaves it exact, a quiet nan.
    The test would be a third of a bfloat16 rotation's time.
    """
    return _bf16_round(_f32_as_u32(f))


def load(a, i):
    """The element a[i] as a float of the compute dtype."""


def store(a, i, v):
    """a[i] = v, rounded once to a's storage type."""


@overload(load)
def _load_impl(a, i):
    if a.dtype == types.int16:
        if HARDWARE_F16:
            return lambda a, i: _f16_bits_widen(a[i])
        return lambda a, i: f16_to_f32(a[i])
    if a.dtype == types.uint16:
        return lambda a, i: bf16_to_f32(a[i])
    return lambda a, i: a[i]


@overload(store)
def _store_impl(a, i, v):
    if a.dtype == types.int16:

        def store_f16(a, i, v):
            a[i] = _f16_bits_narrow(v) if HARDWARE_F16 else f32_to_f16(v)

        return store_f16
    if a.dtype == types.uint16:

        def store_bf16(a, i, v):
            a[i] = f32_to_bf16_result(v)

        return store_bf16

    def store_float(a, i, v):
        a[i] = v

    return store_float
