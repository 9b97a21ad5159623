"""Numba CPU kernels and their launcher.

One row body serves every dtype and pair style. The dtype of the flat views picks the element
conversion at compile time: float32 and float64 are read as they are; float16 travels as int16
bits and bfloat16 as uint16 bits (Numba has no CPU half type) and both are converted in
registers. In place is a compile-time case too (x passed as None). Every kernel is compiled once
per such case and cached on disk. Results not rotated in place are written straight from vector
registers where their rows are 16-byte aligned (see direct_path): with streaming stores where
they are large (see STREAM_ABOVE), with plain stores otherwise. Other large results go through a
scratch block and streaming stores, other small ones through the general row loop. Multi-axis
layouts with many runs of pairs, or whose positions are shared by many rows, are rotated from
per-entry tables (see gather_tables).

Operand geometry ``g`` is an int64 array of shape (2, 4, L + 1), one block per operand (q, k):
  g[t, 0, :L] leading sizes        g[t, 0, L] element stride of the axes dimension of ``idx``
  g[t, 1, :L] x strides            g[t, 1, L] x offset
  g[t, 2, :L] out strides          g[t, 2, L] out offset
  g[t, 3, :L] idx strides          g[t, 3, L] idx offset
all in elements of the flat views. ``rotate`` passes an empty second operand.
"""

import os
import platform
import threading

import numba
import numpy as np
from llvmlite import binding as ll
from llvmlite import ir
from numba import config, njit, prange, types
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic, overload

from ._layout import flat_view, geometry

# Inputs below this many elements run on one thread: a parallel launch costs ~2 µs and can stall
# for milliseconds after an idle gap, more than the whole work of a decode step.
SERIAL_BELOW = int(os.environ.get("ARRAYROPE_SERIAL_BELOW", 1 << 16))

# The fast path (one thread and no layout bookkeeping, see _api.rotate_small) takes inputs below
# SMALL_BELOW = FAST_FACTOR * SERIAL_BELOW elements. On two threads it beat the general path's
# parallel kernel 1.3-2.7x from 2**16 to 2**18 elements, (1, 32, 16..48, 128), and broke even at
# 2**19 (bench/fast_limit.py). With more threads the parallel kernel gains more, so it stops
# sooner.
FAST_FACTOR = 4 if config.NUMBA_NUM_THREADS <= 2 else 1
SMALL_BELOW = FAST_FACTOR * SERIAL_BELOW


# GNU OpenMP, Numba's "omp" threading layer, does not survive fork(): Numba kills (SIGTERM) a
# forked child that starts a parallel region after its parent started one. Forked children are
# common (PyTorch DataLoader workers, multiprocessing pools on Linux), so a child forked after
# that runs every kernel on one thread. TBB and workqueue have no such limit.
_forked = False


def _after_fork_in_child():
    global _forked
    _forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def threads_usable():
    """Whether this process may launch a parallel kernel: False only in a child forked from a
    process that had started Numba's OpenMP layer."""
    if not _forked:
        return True
    try:
        return numba.threading_layer() != "omp"
    except ValueError:  # no parallel region ran before the fork: the child may start one
        return True


_launch_lock = threading.Lock()
_layer = None


def run_parallel(kernel, *args):
    """``kernel(*args)`` for a parallel kernel. Numba's workqueue threading layer, its fallback
    where neither TBB nor OpenMP loads, aborts the process when two threads launch at once
    (Dask's threaded scheduler does), so there launches take turns. The layer is known after
    the first launch."""
    global _layer
    if _layer is None or _layer == "workqueue":
        with _launch_lock:
            result = kernel(*args)
            _layer = numba.threading_layer()
        return result
    return kernel(*args)


def _last_level_cache(default=32 << 20):
    """The size of the CPU's largest cache in bytes (Linux sysfs), or ``default``."""
    sizes = []
    for index in range(8):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size") as f:
                text = f.read().strip()
        except OSError:
            break
        scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KM")) * scale if text.rstrip("KM").isdigit() else 0)
    return max(sizes, default=0) or default


# Outputs of at least this many bytes, not written in place, are written with streaming stores
# (x86-64): a plain store first reads each cache line it writes, a third stream of memory
# traffic that streaming stores avoid. Smaller results may still be in cache when they are used
# next, which streaming would forfeit: half the last-level cache is where streaming stopped
# costing time, result read back included (a 32 MiB L3: 4 MiB 1.6x slower, 16 MiB even, 32 MiB
# 1.2x faster).
STREAM_ABOVE = int(os.environ.get("ARRAYROPE_STREAM_ABOVE", _last_level_cache() // 2))
STREAMING = platform.machine().lower() in ("x86_64", "amd64")
# Rows rotated into an in-cache scratch block before each streaming copy.
_STREAM_BLOCK_BYTES = 8192


# Disk cache of compiled kernels. Off when the software float16 path is forced: Numba's cache key
# does not see that switch, and would hand back kernels built for the other one.
_CACHE = (
    os.environ.get("ARRAYROPE_NUMBA_CACHE", "1") != "0"
    and os.environ.get("ARRAYROPE_SOFT_F16", "0") == "0"
)


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


# With F16C (every x86-64 since 2013) LLVM's half conversions are single vector instructions
# (vcvtph2ps/vcvtps2ph, round half to even), several times faster than the bit arithmetic below.
# Without it LLVM would call a runtime helper that Numba's JIT may not link, so other CPUs take
# the bit arithmetic, which tests check against NumPy for every float16 value.
HARDWARE_F16 = os.environ.get("ARRAYROPE_SOFT_F16", "0") == "0" and (
    "+f16c" in ll.get_host_cpu_features().flatten()
)

_F16_SUBNORMAL = np.float32(2.0**-24)
_F16_SUBNORMAL_INV = np.float32(2.0**24)
_RNE_MAGIC = np.float32(2.0**23)


# The conversions are written as selects, not branches, so that loops over them vectorize.
@njit
def _f16_to_f32(h):
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
def _f32_to_f16(f):
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
def _bf16_to_f32(h):
    return _u32_as_f32(np.uint32(h) << np.uint32(16))


@njit
def _f32_to_bf16(f):
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
def _f32_to_bf16_result(f):
    """A kernel result to bfloat16 bits, round half to even, with no nan test.

    Every nan that reaches a store is an arithmetic result, so it is quiet (bit 22 set) and
    carries either a quieted input payload or the CPU's default nan (IEEE 754 6.2.3; LLVM's
    LangRef allows just these two). Inputs are bfloat16 widened (low 16 bits zero) and finite
    float32 tables, so its low 16 bits are zero and the rounding leaves it exact, a quiet nan.
    The test cost a bfloat16 rotation about a third of its time on AVX2.
    """
    return _bf16_round(_f32_as_u32(f))


def _load(a, i):
    """The element a[i] as a float of the compute dtype."""


def _store(a, i, v):
    """a[i] = v, rounded once to a's storage type."""


def _row_views(x, o, xb, ob):
    """(``x[xb:]``, ``o[ob:]``), or the one view ``o[ob:]`` twice where ``x`` is None (in place).

    In place is a compile-time case, not a flag, and one view object plays both roles: two views
    of one address (or a runtime flag choosing between two inlined loops) fail or complicate
    LLVM's aliasing checks, and the loops ran 2.5-3x slower in cache. Reading through ``o`` also
    lets a read-only ``x`` compile.
    """


@overload(_row_views)
def _row_views_impl(x, o, xb, ob):
    if isinstance(x, types.NoneType):

        def in_place(x, o, xb, ob):
            row = o[ob:]
            return row, row

        return in_place
    return lambda x, o, xb, ob: (x[xb:], o[ob:])


@intrinsic
def _contiguous(typingctx, row):
    """A 1-D row view whose one stride the caller knows to be the itemsize, typed as C layout:
    the same array, but loops over it index without its stride and vectorize (a strided row
    view loops at half the speed)."""

    def codegen(context, builder, signature, args):
        return impl_ret_borrowed(context, builder, signature.return_type, args[0])

    return types.Array(row.dtype, 1, "C")(row), codegen


@intrinsic
def _address(typingctx, a, i):
    """The address of ``a[i]`` in a 1-D array of unit stride, as an integer."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.ptrtoint(builder.gep(data, [args[1]]), ir.IntType(64))

    return types.uint64(a, i), codegen


def _store_streaming(context, builder, array_type, array, index, value, align, nontemporal=True):
    """Store ``value`` (a vector) at ``array[index]`` with a streaming store, which writes the
    cache line without first reading it, or with a plain store where ``nontemporal`` is False.
    ``align`` is what the address is known to have."""
    data = context.make_array(array_type)(context, builder, array).data
    address = builder.bitcast(builder.gep(data, [index]), value.type.as_pointer())
    store = builder.store(value, address, align=align)
    if nontemporal:
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.IntType(32)(1)]))


@intrinsic
def _stream_line(typingctx, dst, di, src, si):
    """Copy the 64 bytes at ``src[si]`` to ``dst[di]`` (64-byte aligned) with a streaming store,
    which writes the cache line without first reading it. Both arrays 1-D of unit stride."""

    def codegen(context, builder, signature, args):
        dst_ty, _, src_ty, _ = signature.args
        s = context.make_array(src_ty)(context, builder, args[2]).data
        line = ir.VectorType(ir.IntType(32), 16)
        value = builder.load(builder.bitcast(builder.gep(s, [args[3]]), line.as_pointer()), align=1)
        _store_streaming(context, builder, dst_ty, args[0], args[1], value, 64)
        return context.get_dummy_value()

    return types.void(dst, di, src, si), codegen


@intrinsic
def _store_fence(typingctx):
    """Order the streaming stores before everything after (they are weakly ordered): another
    thread, or Python after the kernel returns, then sees them."""

    def codegen(context, builder, signature, args):
        if STREAMING:  # sfence: x86's fence for streaming stores (a seq_cst fence may not be)
            fnty = ir.FunctionType(ir.VoidType(), [])
            builder.call(builder.module.declare_intrinsic("llvm.x86.sse.sfence", fnty=fnty), [])
        return context.get_dummy_value()

    return types.void(), codegen


# The direct path: rows rotated in vector registers and stored straight into the output. Large
# outputs take 16-byte streaming stores, no scratch block: the CPU's write-combining buffers join
# the pieces of each cache line, so a line split between two rows streams whole too. It needs
# every store address 16-byte aligned (see direct_path); other large outputs take the scratch
# path. On a 2-vCPU EPYC, (4, 32, 2048, 128) `out=`, bench/ab.py against the scratch path:
# 1.21-1.28x float32, 1.15-1.31x float16, 1.03-1.12x bfloat16 (bench/RESULTS.md, sixth
# session). Smaller outputs take the same loop with plain stores (VECTOR): against the general
# row loop, (1, 32, 512, 128) `out=` and rotate_qk ran 1.4-1.6x faster for the half types in
# the half layout, 1.0-1.1x otherwise (bench/RESULTS.md, tenth session). So does in place at
# every size: 1.05-1.33x on (1, 32, 512, 128) and 1.05-1.26x on (4, 32, 2048, 128) in
# bench/ab.py, though float32 interleaved at the middle size gave 0.95-0.98x in a longer A/B
# (eleventh session).
SCRATCH, DIRECT, VECTOR = 1, 2, 3  # the kernels' ``stream`` argument; 0: plain stores
# Off: outputs below STREAM_ABOVE, and in place, take the general row loop (tests compare the
# two paths).
VECTOR_ROWS = True


def _splat(ty, lanes, value):
    return ir.Constant(ir.VectorType(ty, lanes), [value] * lanes)


def _lanes_of(array_type, nbytes):
    """Elements of ``array_type`` in ``nbytes`` (None: one)."""
    return 1 if nbytes is None else nbytes // (array_type.dtype.bitwidth // 8)


def _load_lanes(context, builder, array_type, array, index, lanes):
    """``lanes`` elements of a 1-D unit-stride array from ``index`` as a vector of the compute
    type (float64 for float64, float32 otherwise), converted as _load converts one."""
    data = context.make_array(array_type)(context, builder, array).data
    address = builder.gep(data, [index])
    dtype = array_type.dtype
    if dtype in (types.float32, types.float64):
        vector = ir.VectorType(context.get_value_type(dtype), lanes)
        return builder.load(
            builder.bitcast(address, vector.as_pointer()), align=dtype.bitwidth // 8
        )
    bits = builder.load(
        builder.bitcast(address, ir.VectorType(ir.IntType(16), lanes).as_pointer()), align=2
    )
    floats = ir.VectorType(ir.FloatType(), lanes)
    if dtype == types.int16:  # float16 bits
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), lanes)), floats)
    wide = builder.zext(bits, ir.VectorType(ir.IntType(32), lanes))  # bfloat16 bits
    return builder.bitcast(builder.shl(wide, _splat(ir.IntType(32), lanes, 16)), floats)


def _stream_lanes(context, builder, array_type, array, index, value, nontemporal, aligned=True):
    """Store the vector ``value`` at ``array[index]`` (16-byte aligned; only element-aligned
    where ``aligned`` is False), rounded once to the array's storage type as _store rounds,
    with streaming stores (plain ones where ``nontemporal`` is False)."""
    lanes = value.type.count
    dtype = array_type.dtype
    if dtype == types.int16:  # float16 bits, rounded half to even
        value = builder.bitcast(
            builder.fptrunc(value, ir.VectorType(ir.HalfType(), lanes)),
            ir.VectorType(ir.IntType(16), lanes),
        )
    elif dtype == types.uint16:  # bfloat16 bits
        rounded = _bf16_round_lanes(builder, value)
        value = builder.trunc(
            builder.lshr(rounded, _splat(ir.IntType(32), lanes, 16)),
            ir.VectorType(ir.IntType(16), lanes),
        )
    align = 16 if aligned else dtype.bitwidth // 8
    _store_streaming(context, builder, array_type, array, index, value, align, nontemporal)


def _bf16_round_lanes(builder, value):
    """_f32_to_bf16_result on every lane of a float32 vector, as 32-bit words whose high halves
    are the bfloat16 bits (the low halves are left over from the rounding)."""
    i32 = ir.IntType(32)
    lanes = value.type.count
    bits = builder.bitcast(value, ir.VectorType(i32, lanes))
    odd = builder.and_(builder.lshr(bits, _splat(i32, lanes, 16)), _splat(i32, lanes, 1))
    return builder.add(builder.add(bits, _splat(i32, lanes, 0x7FFF)), odd)


def _signed_sin(builder, sin, inverse):
    """sin, or -sin for the inverse (the transpose), as _pairs takes it: the sign bit xored with
    a mask that LLVM hoists out of the row loop. (A negate and a select compiled into a test and
    branch in every vector step.)"""
    lanes = sin.type.count
    bits = 64 if isinstance(sin.type.element, ir.DoubleType) else 32
    words = ir.VectorType(ir.IntType(bits), lanes)
    sign = builder.select(inverse, ir.IntType(bits)(1 << (bits - 1)), ir.IntType(bits)(0))
    mask = builder.insert_element(ir.Constant(words, None), sign, ir.IntType(32)(0))
    zeros = ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes)
    mask = builder.shuffle_vector(mask, mask, zeros)  # the sign in every lane
    return builder.bitcast(builder.xor(builder.bitcast(sin, words), mask), sin.type)


def _half_step(nbytes, nontemporal, aligned=True):
    """An intrinsic rotating the pairs (j, j + h) for the ``nbytes`` of o from o[oa] on (None:
    one pair): x read from x[xa] and x[xa + h], tables from cos[t], sin[t]. _pairs's
    arithmetic, in vectors. It stores as _stream_lanes's ``nontemporal`` and ``aligned`` say."""

    @intrinsic
    def step(typingctx, x, xa, o, oa, h, cos, sin, t, inverse):
        lanes = _lanes_of(o, nbytes)

        def codegen(context, builder, signature, args):
            x_, xa_, o_, oa_, h_, cos_, sin_, t_, inverse_ = args
            tys = signature.args
            a = _load_lanes(context, builder, tys[0], x_, xa_, lanes)
            b = _load_lanes(context, builder, tys[0], x_, builder.add(xa_, h_), lanes)
            c = _load_lanes(context, builder, tys[5], cos_, t_, lanes)
            s = _signed_sin(
                builder, _load_lanes(context, builder, tys[6], sin_, t_, lanes), inverse_
            )
            first = builder.fsub(builder.fmul(a, c), builder.fmul(b, s))
            second = builder.fadd(builder.fmul(b, c), builder.fmul(a, s))
            _stream_lanes(context, builder, tys[2], o_, oa_, first, nontemporal, aligned)
            second_at = builder.add(oa_, h_)
            _stream_lanes(context, builder, tys[2], o_, second_at, second, nontemporal, aligned)
            return context.get_dummy_value()

        return types.void(x, xa, o, oa, h, cos, sin, t, inverse), codegen

    return step


def _interleaved_step(nbytes, nontemporal, aligned=True):
    """An intrinsic rotating the pairs (2j, 2j + 1) in the ``nbytes`` of o from o[oa] on (None:
    one pair): x read from x[xa], tables from cos[t], sin[t]. _interleaved_pairs's arithmetic,
    in vectors: each element times its pair's cos, plus its partner times its pair's (signed)
    sin. It stores as _stream_lanes's ``nontemporal`` and ``aligned`` say."""

    @intrinsic
    def step(typingctx, x, xa, o, oa, cos, sin, t, inverse):
        lanes = 2 if nbytes is None else _lanes_of(o, nbytes)
        i32 = ir.IntType(32)
        twice = ir.Constant(ir.VectorType(i32, lanes), [i32(k // 2) for k in range(lanes)])
        swap = ir.Constant(ir.VectorType(i32, lanes), [i32(k ^ 1) for k in range(lanes)])
        # even lanes from the difference, odd lanes from the sum
        pick = ir.Constant(
            ir.VectorType(i32, lanes), [i32(k if k % 2 == 0 else lanes + k) for k in range(lanes)]
        )

        def codegen(context, builder, signature, args):
            x_, xa_, o_, oa_, cos_, sin_, t_, inverse_ = args
            tys = signature.args
            v = _load_lanes(context, builder, tys[0], x_, xa_, lanes)
            c = _load_lanes(context, builder, tys[4], cos_, t_, lanes // 2)
            s = _load_lanes(context, builder, tys[5], sin_, t_, lanes // 2)
            s = _signed_sin(builder, s, inverse_)
            c = builder.shuffle_vector(c, c, twice)
            s = builder.shuffle_vector(s, s, twice)
            scaled = builder.fmul(v, c)  # (a c, b c)
            crossed = builder.fmul(builder.shuffle_vector(v, v, swap), s)  # (b s, a s)
            result = builder.shuffle_vector(
                builder.fsub(scaled, crossed), builder.fadd(scaled, crossed), pick
            )
            _stream_lanes(context, builder, tys[2], o_, oa_, result, nontemporal, aligned)
            return context.get_dummy_value()

        return types.void(x, xa, o, oa, cos, sin, t, inverse), codegen

    return step


def _bfloat16_interleaved_step(nbytes, nontemporal, aligned=True):
    """The interleaved step for bfloat16, with no shuffles: each pair's two elements are one
    32-bit word, whose low half is the first element's bits and whose high half is the second's,
    so shifting and masking the word widens both to float32, and _f32_to_bf16_result on both
    results puts them back. (The shuffling step ran at 0.8x the scratch path.) ``nbytes`` None:
    one pair; ``aligned`` False: stores need only element alignment."""

    @intrinsic
    def step(typingctx, x, xa, o, oa, cos, sin, t, inverse):
        lanes = 1 if nbytes is None else nbytes // 4  # pairs
        i32 = ir.IntType(32)
        words = ir.VectorType(i32, lanes)
        floats = ir.VectorType(ir.FloatType(), lanes)

        def codegen(context, builder, signature, args):
            x_, xa_, o_, oa_, cos_, sin_, t_, inverse_ = args
            tys = signature.args
            source = context.make_array(tys[0])(context, builder, x_).data
            pair = builder.load(
                builder.bitcast(builder.gep(source, [xa_]), words.as_pointer()), align=2
            )
            sixteen = _splat(i32, lanes, 16)
            a = builder.bitcast(builder.shl(pair, sixteen), floats)
            b = builder.bitcast(builder.and_(pair, _splat(i32, lanes, 0xFFFF0000)), floats)
            c = _load_lanes(context, builder, tys[4], cos_, t_, lanes)
            s = _signed_sin(
                builder, _load_lanes(context, builder, tys[5], sin_, t_, lanes), inverse_
            )
            first = _bf16_round_lanes(builder, builder.fsub(builder.fmul(a, c), builder.fmul(b, s)))
            second = _bf16_round_lanes(
                builder, builder.fadd(builder.fmul(b, c), builder.fmul(a, s))
            )
            result = builder.or_(
                builder.lshr(first, sixteen), builder.and_(second, _splat(i32, lanes, 0xFFFF0000))
            )
            align = 16 if aligned else 2
            _store_streaming(context, builder, tys[2], o_, oa_, result, align, nontemporal)
            return context.get_dummy_value()

        return types.void(x, xa, o, oa, cos, sin, t, inverse), codegen

    return step


def _copy_16(nontemporal):
    """An intrinsic: o[oa...] = x[xa...], 16 bytes, with a streaming store (o[oa] 16-byte
    aligned) or a plain one."""

    @intrinsic
    def copy(typingctx, x, xa, o, oa):
        def codegen(context, builder, signature, args):
            x_, xa_, o_, oa_ = args
            vector = ir.VectorType(ir.IntType(32), 4)
            source = context.make_array(signature.args[0])(context, builder, x_).data
            value = builder.load(
                builder.bitcast(builder.gep(source, [xa_]), vector.as_pointer()), align=1
            )
            _store_streaming(context, builder, signature.args[2], o_, oa_, value, 16, nontemporal)
            return context.get_dummy_value()

        return types.void(x, xa, o, oa), codegen

    return copy


@intrinsic
def _copy_element(typingctx, x, xa, o, oa):
    """o[oa] = x[xa]: one element's bits, at flat element offsets from each array's first
    element, as the steps address them."""

    def codegen(context, builder, signature, args):
        x_, xa_, o_, oa_ = args
        source = context.make_array(signature.args[0])(context, builder, x_).data
        target = context.make_array(signature.args[2])(context, builder, o_).data
        builder.store(builder.load(builder.gep(source, [xa_])), builder.gep(target, [oa_]))
        return context.get_dummy_value()

    return types.void(x, xa, o, oa), codegen


# Rows per block in the direct path where rows have a tail: the block's tails are copied
# after its rows are rotated, while its lines are still in cache.
_TAIL_BLOCK_ROWS = 16


def _direct_rows_for(nontemporal):
    """The direct path's row loop, storing with streaming stores or (``nontemporal`` False)
    plain ones: a function ``rows(x, o, idx, xb, ob, pb, sx, so, sp, axis, run, cos, sin,
    rotary_dim, d, half, inv)`` for Numba, rotating the rows of one run straight into o (``x``
    None: o in place, which only the plain-store mode is given)."""
    half_32, half_16 = _half_step(32, nontemporal), _half_step(16, nontemporal)
    shuffled = _interleaved_step(32, nontemporal), _interleaved_step(16, nontemporal)
    bfloat16 = (
        _bfloat16_interleaved_step(32, nontemporal),
        _bfloat16_interleaved_step(16, nontemporal),
    )
    copy_16 = _copy_16(nontemporal)

    def direct_rows(
        x, o, idx, xb, ob, pb, sx, so, sp, axis, run, cos, sin, rotary_dim, d, half, inv
    ):
        """Rows of one run straight to o, rotated in vector registers."""

    @overload(direct_rows)
    def direct_rows_impl(
        x, o, idx, xb, ob, pb, sx, so, sp, axis, run, cos, sin, rotary_dim, d, half, inv
    ):
        if isinstance(x, types.NoneType):  # in place: o read and written, no tail to copy

            def in_place(
                x, o, idx, xb, ob, pb, sx, so, sp, axis, run, cos, sin, rotary_dim, d, half, inv
            ):
                direct_rows(
                    o, o, idx, ob, ob, pb, so, so, sp, axis, run, cos, sin, rotary_dim,
                    rotary_dim, half, inv,
                )  # fmt: skip

            return in_place

        # float16 without F16C takes the general loop (direct_path refuses it): its vector
        # conversions would call runtime helpers that Numba's JIT may not link.
        if o.dtype == types.int16 and not HARDWARE_F16:

            def nothing(
                x, o, idx, xb, ob, pb, sx, so, sp, axis, run, cos, sin, rotary_dim, d, half, inv
            ):
                return None

            return nothing

        pair_32, pair_16 = bfloat16 if o.dtype == types.uint16 else shuffled

        # Each row's loop is written out here, not called as an inlined helper: the helper's
        # array arguments cost reference-count calls per row, and table rows taken as views
        # (cos[p]) did too. Without them `out=` ran 1.10-1.25x faster on (4, 32, 2048, 128)
        # (bench/RESULTS.md, tenth session). The table row starts at the flat offset tb (cos and
        # sin alike). One loop per layout, and the tails copied in a loop of their own, a block
        # of rows at a time: with the layout test or the tail inside the row loop, LLVM kept the
        # loop's registers on the stack, which cost rows in cache a fifth of their time.
        def rows(x, o, idx, xb, ob, pb, sx, so, sp, axis, run, cos, sin, rotary_dim, d, half, inv):
            stride = np.uint64(cos.strides[0] // cos.itemsize)  # sin's too: see direct_path
            wide = np.uint64(32 // o.itemsize)
            n = np.uint64(rotary_dim)
            h = n // np.uint64(2)
            block = max(run, 1) if d == rotary_dim else _TAIL_BLOCK_ROWS
            for first in range(0, run, block):
                stop = min(first + block, run)
                if half:
                    for r in range(first, stop):
                        tb = np.uint64(idx[np.uint64(pb + r * sp + axis)]) * stride
                        xr = np.uint64(xb + r * sx)
                        orow = np.uint64(ob + r * so)
                        j = np.uint64(0)
                        while j + wide <= h:
                            half_32(x, xr + j, o, orow + j, h, cos, sin, tb + j, inv)
                            j += wide
                        if j < h:
                            half_16(x, xr + j, o, orow + j, h, cos, sin, tb + j, inv)
                else:
                    for r in range(first, stop):
                        tb = np.uint64(idx[np.uint64(pb + r * sp + axis)]) * stride
                        xr = np.uint64(xb + r * sx)
                        orow = np.uint64(ob + r * so)
                        j = np.uint64(0)
                        while j + wide <= n:
                            pair_32(x, xr + j, o, orow + j, cos, sin, tb + j // np.uint64(2), inv)
                            j += wide
                        if j < n:
                            pair_16(x, xr + j, o, orow + j, cos, sin, tb + j // np.uint64(2), inv)
                if d > rotary_dim:
                    for r in range(first, stop):
                        xr = np.uint64(xb + r * sx)
                        orow = np.uint64(ob + r * so)
                        for t in range(rotary_dim, d, 16 // o.itemsize):
                            copy_16(x, xr + np.uint64(t), o, orow + np.uint64(t))

        return rows

    return direct_rows


_direct_rows_streaming = _direct_rows_for(True)
_direct_rows_plain = _direct_rows_for(False)


def _row_at(x, o, idx):
    """(``x[idx]``, ``o[idx]``) as contiguous views, or ``o[idx]`` twice where ``x`` is None."""


@overload(_row_at)
def _row_at_impl(x, o, idx):
    if isinstance(x, types.NoneType):

        def in_place(x, o, idx):
            row = _contiguous(o[idx])
            return row, row

        return in_place
    return lambda x, o, idx: (_contiguous(x[idx]), _contiguous(o[idx]))


def _unit_feature_stride(x, o):
    """Whether the feature (last) axes of ``x`` (None: in place) and ``o`` are contiguous."""


@overload(_unit_feature_stride)
def _unit_feature_stride_impl(x, o):
    if isinstance(x, types.NoneType):
        return lambda x, o: o.strides[o.ndim - 1] == o.itemsize
    return lambda x, o: x.strides[x.ndim - 1] == x.itemsize and o.strides[o.ndim - 1] == o.itemsize


def _whole_strides(x, o):
    """Whether every stride of ``x`` (None: in place) and ``o`` is a whole number of elements."""


@overload(_whole_strides)
def _whole_strides_impl(x, o):
    if isinstance(x, types.NoneType):
        return lambda x, o: _whole_elements(o)
    return lambda x, o: _whole_elements(x) and _whole_elements(o)


@njit(inline="always")
def _whole_elements(a):
    """Whether every stride that reaches an element of ``a`` (on an axis longer than 1) is a
    whole number of its elements: NumPy's test for its ``aligned`` flag, but for the data
    pointer."""
    if a.size == 0:
        return True
    for k in range(a.ndim):
        if a.shape[k] > 1 and a.strides[k] % a.itemsize:
            return False
    return True


def _count(positions):
    """len(positions), or 1 where ``positions`` is a single int."""


@overload(_count)
def _count_impl(positions):
    if isinstance(positions, types.Integer):
        return lambda positions: 1
    return lambda positions: positions.shape[0]


def _entry(positions, i):
    """positions[i], or ``positions`` itself where it is a single int."""


@overload(_entry)
def _entry_impl(positions, i):
    if isinstance(positions, types.Integer):
        return lambda positions, i: positions
    return lambda positions, i: positions[i]


@overload(_load)
def _load_impl(a, i):
    if a.dtype == types.int16:
        if HARDWARE_F16:
            return lambda a, i: _f16_bits_widen(a[i])
        return lambda a, i: _f16_to_f32(a[i])
    if a.dtype == types.uint16:
        return lambda a, i: _bf16_to_f32(a[i])
    return lambda a, i: a[i]


@overload(_store)
def _store_impl(a, i, v):
    if a.dtype == types.int16:

        def store_f16(a, i, v):
            a[i] = _f16_bits_narrow(v) if HARDWARE_F16 else _f32_to_f16(v)

        return store_f16
    if a.dtype == types.uint16:

        def store_bf16(a, i, v):
            a[i] = _f32_to_bf16_result(v)

        return store_bf16

    def store_float(a, i, v):
        a[i] = v

    return store_float


# Every index is uint64: Numba adds a negative-index wraparound select to signed indices, which
# stops LLVM from vectorizing (measured: 10 GB/s signed, 51 GB/s unsigned on an in-cache float32
# rotation). And every index counts from 0 in a view that starts where the loop starts: with a
# runtime start offset in the index, LLVM left the interleaved (stride-2) loops scalar.
@njit(inline="always")
def _pairs(x, o, half, n, cos, sin, inverse):
    """Rotate pairs (j, j + half) for j < n: the "half" layout."""
    h = np.uint64(half)
    for j in range(n):
        k = np.uint64(j)
        c = cos[k]
        s = -sin[k] if inverse else sin[k]  # the transpose: rotate by -angle
        a = _load(x, k)
        b = _load(x, k + h)
        _store(o, k, a * c - b * s)
        _store(o, k + h, b * c + a * s)


@njit(inline="always")
def _interleaved_pairs(x, o, n, cos, sin, inverse):
    """Rotate pairs (2j, 2j + 1) for j < n: the "interleaved" layout."""
    one = np.uint64(1)
    for j in range(n):
        k = np.uint64(j)
        c = cos[k]
        s = -sin[k] if inverse else sin[k]
        a = _load(x, 2 * k)
        b = _load(x, 2 * k + one)
        _store(o, 2 * k, a * c - b * s)
        _store(o, 2 * k + one, b * c + a * s)


@njit(inline="always")
def _rotate_pairs(x, o, half, n, cos, sin, inverse):
    """n pairs: (j, j + half) where half > 0 (the "half" layout), else (2j, 2j + 1).

    Each layout and direction is its own loop, with ``inverse`` a constant in it: a runtime
    sign select left in the loop cost a decode step's rotation about a quarter of its time.
    """
    if half:
        if inverse:
            _pairs(x, o, half, n, cos, sin, True)
        else:
            _pairs(x, o, half, n, cos, sin, False)
    elif inverse:
        _interleaved_pairs(x, o, n, cos, sin, True)
    else:
        _interleaved_pairs(x, o, n, cos, sin, False)


@njit(inline="always")
def _row(
    x, o, idx, xb, ob, pb, axis_stride, cos, sin, seg, rotary_dim, d, half_style, inverse, copy_tail
):
    """Rotate the row at offsets ``xb`` (x) and ``ob`` (o), one run of pairs (a segment) per
    position axis, converting each element in registers on its way in and out. ``x`` is None in
    place (see :func:`_row_views`)."""
    half = rotary_dim // 2
    for s in range(seg.shape[0]):
        p = idx[pb + seg[s, 2] * axis_stride]
        first, stop = seg[s, 0], seg[s, 1]
        if half_style:
            xv, ov = _row_views(x, o, xb + np.uint64(first), ob + np.uint64(first))
            _rotate_pairs(xv, ov, half, stop - first, cos[p, first:], sin[p, first:], inverse)
        else:
            xv, ov = _row_views(x, o, xb + np.uint64(2 * first), ob + np.uint64(2 * first))
            _rotate_pairs(xv, ov, 0, stop - first, cos[p, first:], sin[p, first:], inverse)
    if copy_tail:
        xv, ov = _row_views(x, o, xb + np.uint64(rotary_dim), ob + np.uint64(rotary_dim))
        for j in range(d - rotary_dim):
            ov[np.uint64(j)] = xv[np.uint64(j)]


def _streams(x, stream, mode):
    """Whether ``stream`` is ``mode``; False in place (``x`` None), where no line is written
    unread."""


@overload(_streams)
def _streams_impl(x, stream, mode):
    if isinstance(x, types.NoneType):  # in place: only the plain-store vector loop
        return lambda x, stream, mode: mode == VECTOR and stream == mode
    return lambda x, stream, mode: stream == mode


@njit(inline="always")
def _stream_copy(src, dst, start, n):
    """dst[start:start + n] = src[:n], the whole 64-byte lines of it with streaming stores.

    Lines only partly inside (where dst is not 64-byte aligned) take plain stores, so that no
    line gets both kinds."""
    item = np.uint64(dst.itemsize)
    per_line = np.uint64(64) // item
    addr = _address(dst, start)
    head = ((np.uint64(64) - addr % np.uint64(64)) % np.uint64(64)) // item
    if addr % item != 0 or head > n:
        head = n
    lines = (n - head) // per_line
    for j in range(head):
        dst[start + np.uint64(j)] = src[np.uint64(j)]
    for k in range(lines):
        j = head + np.uint64(k) * per_line
        _stream_line(dst, start + j, src, j)
    for j in range(head + lines * per_line, n):
        dst[start + np.uint64(j)] = src[np.uint64(j)]


@njit(inline="always")
def _run_start(g, row):
    """Offsets (x, out, idx) of row ``row`` of the operand whose geometry block is ``g``, and how
    many rows from it on share its run along the innermost leading axis, where the offsets
    advance by constant strides."""
    nlead = g.shape[1] - 1
    xb = g[1, nlead]
    ob = g[2, nlead]
    pb = g[3, nlead]
    rem = np.int64(row)  # a prange index may be unsigned; int64 keeps index arithmetic integral
    left = np.int64(0)
    for ax in range(nlead - 1, -1, -1):
        i = rem % g[0, ax]
        rem //= g[0, ax]
        if ax == nlead - 1:
            left = g[0, ax] - i
        xb += i * g[1, ax]
        ob += i * g[2, ax]
        pb += i * g[3, ax]
    return xb, ob, pb, left


@njit
def _rows(
    x,
    o,
    idx,
    g,
    first,
    stop,
    cos,
    sin,
    seg,
    rotary_dim,
    d,
    half_style,
    inverse,
    copy_tail,
    stream,
):
    """Rows first..stop-1 of the operand whose geometry block is ``g`` (``g[t]`` of the launch's
    g). The leading index is decoded (int64 divisions) once per run of the innermost leading
    axis; within a run the offsets advance by its strides. Per-row index bookkeeping cost as
    much as rotating a float32 row in cache.

    Every caller passes arguments of one set of types (no literal operand number or first row),
    so that q's and k's calls, serial and parallel, share one compiled function: each type set
    costs several seconds of compilation."""
    if first >= stop:
        return
    inner = g.shape[1] - 2
    sx, so, sp = g[1, inner], g[2, inner], g[3, inner]
    axis_stride = g[0, inner + 1]
    streaming = _streams(x, stream, SCRATCH)
    direct = _streams(x, stream, DIRECT)
    vector = _streams(x, stream, VECTOR)
    block = max(1, _STREAM_BLOCK_BYTES // (d * o.itemsize))
    scratch = np.empty(block * d, o.dtype) if streaming else o[:0]
    row = first
    while row < stop:
        xb, ob, pb, left = _run_start(g, row)
        run = min(left, stop - row)
        if direct or vector:  # one run of pairs (seg has one row): see direct_path
            axis = seg[0, 2] * axis_stride
            if direct:
                _direct_rows_streaming(
                    x, o, idx, xb, ob, pb, sx, so, sp, axis, run, cos, sin, rotary_dim, d,
                    half_style, inverse,
                )  # fmt: skip
            else:
                _direct_rows_plain(
                    x, o, idx, xb, ob, pb, sx, so, sp, axis, run, cos, sin, rotary_dim, d,
                    half_style, inverse,
                )  # fmt: skip
            row += run
            continue
        # Where the run's rows are contiguous in o and streaming pays, a block of them at a
        # time is rotated into scratch (in cache) and then streamed to o; else the run is one
        # block rotated straight into o. One call site of _row: each is inlined, and a second
        # doubled the kernels' compile time.
        buffered = streaming and so == d
        step = block if buffered else run
        for start in range(0, run, step):
            rows = min(step, run - start)
            for i in range(rows):
                r = start + i
                target = scratch if buffered else o
                tb = i * d if buffered else ob + r * so
                _row(
                    x,
                    target,
                    idx,
                    np.uint64(xb + r * sx),
                    np.uint64(tb),
                    pb + r * sp,
                    axis_stride,
                    cos,
                    sin,
                    seg,
                    rotary_dim,
                    d,
                    half_style,
                    inverse,
                    copy_tail or buffered,
                )
            if buffered:
                _stream_copy(scratch, o, np.uint64(ob + start * so), np.uint64(rows * d))
        row += run
    if streaming or direct:
        _store_fence()


@njit(cache=_CACHE)
def _count_rows(g):
    total = 1
    for ax in range(g.shape[1] - 1):
        total *= g[0, ax]
    return total


@njit(cache=_CACHE)
def rotate_serial(
    x1,
    o1,
    i1,
    x2,
    o2,
    i2,
    g,
    cos,
    sin,
    seg,
    rotary_dim,
    d,
    half_style,
    inverse,
    copy_tail,
    stream,
):
    _rows(
        x1,
        o1,
        i1,
        g[0],
        np.int64(0),
        _count_rows(g[0]),
        cos,
        sin,
        seg,
        rotary_dim,
        d,
        half_style,
        inverse,
        copy_tail,
        stream,
    )
    _rows(
        x2,
        o2,
        i2,
        g[1],
        np.int64(0),
        _count_rows(g[1]),
        cos,
        sin,
        seg,
        rotary_dim,
        d,
        half_style,
        inverse,
        copy_tail,
        stream,
    )


# Rows per parallel task. Numba hands each thread an equal share of the tasks, in order, so more
# tasks than threads balance nothing by themselves; each costs its call and index decoding.
# Sixteen per thread, of equal size, keep the shares within one task (a sixteenth) of each
# other. On two threads, 32 tasks ran (1, 32, 512, 128) 1.00-1.16x as fast as 256, and
# (4, 32, 2048, 128) 0.96-1.06x (bench/RESULTS.md, eleventh session).
_MIN_TASK_ROWS = 32
_MAX_TASKS = min(256, 16 * config.NUMBA_NUM_THREADS)


@njit(cache=_CACHE, parallel=True)
def rotate_parallel(
    x1,
    o1,
    i1,
    x2,
    o2,
    i2,
    g,
    cos,
    sin,
    seg,
    rotary_dim,
    d,
    half_style,
    inverse,
    copy_tail,
    stream,
):
    # The tasks split the rows of both operands, q's then k's, into equal parts: a task may end
    # q and begin k, so that no thread's share is short by a partial task per operand.
    n1 = _count_rows(g[0])
    n2 = _count_rows(g[1])
    total = n1 + n2
    chunk = max(_MIN_TASK_ROWS, (total + _MAX_TASKS - 1) // _MAX_TASKS)
    for task in prange((total + chunk - 1) // chunk):
        first = np.int64(task * chunk)
        stop = min(first + chunk, total)
        _rows(
            x1,
            o1,
            i1,
            g[0],
            first,
            min(stop, n1),
            cos,
            sin,
            seg,
            rotary_dim,
            d,
            half_style,
            inverse,
            copy_tail,
            stream,
        )  # nothing where first >= n1
        _rows(
            x2,
            o2,
            i2,
            g[1],
            max(first, n1) - n1,
            stop - n1,
            cos,
            sin,
            seg,
            rotary_dim,
            d,
            half_style,
            inverse,
            copy_tail,
            stream,
        )  # nothing where stop <= n1


def _overlap(x, o):
    """Whether the memory spans of x and o intersect (False where x is None: in place).

    The bounds test of np.may_share_memory, done here because there it cost a decode step
    with ``out=`` 0.4 us of Python."""


@overload(_overlap)
def _overlap_impl(x, o):
    if isinstance(x, types.NoneType):
        return lambda x, o: False

    def overlap(x, o):
        x_lo, x_hi = _span(x)
        o_lo, o_hi = _span(o)
        return x_lo < o_hi and o_lo < x_hi

    return overlap


@njit(inline="always")
def _span(a):
    """[first byte, past the last byte) of the memory a spans (its whole span: empty or not)."""
    lo = np.int64(a.ctypes.data)
    hi = lo + a.itemsize
    for k in range(a.ndim):
        extent = (a.shape[k] - 1) * a.strides[k]
        if extent < 0:
            lo += extent
        else:
            hi += extent
    return lo, hi


@njit(cache=_CACHE)
def rotate_rows(x, o, positions, tables, settings):
    """The small-input path, one thread: the rows of ``x`` into those of ``o`` (``x`` None: in
    place), arrays of any number of axes and any leading strides, taken as they are: flat views
    and geometry cost more in Python than the rows of a decode step. Row r (in C order) sits at
    position ``positions[(r // repeat) % len(positions)]`` (``positions`` may be one int:
    decode passes one, which is cheaper to hand over than an array). ``tables`` is cos and sin
    stacked, shape (2, rows, pairs). Returns False, having written nothing, where a feature
    axis is not contiguous, a stride is not a whole number of elements (the vector steps
    address rows by element offsets), a position is negative or past the table, or ``o`` is
    not ``x`` but their memory spans overlap (the caller then takes the general path, which
    copies such arrays through a temporary and tells exact aliasing from partial overlap).
    These checks are here because each costs Python 0.05-0.4 us. One position axis only.
    ``settings`` packs repeat - 1, rotary_dim, the style and inverse into one int (see
    :func:`small_settings`): every argument costs the call 0.02-0.1 us of unboxing, a decode
    step's whole rotation about 0.8 us, and an int past 2**30 costs more to unbox than a
    smaller one.
    """
    repeat = (settings >> 32) + 1
    rotary_dim = (settings >> 2) & 0x3FFFFFFF
    half_style = (settings & 2) != 0
    inverse = (settings & 1) != 0
    cos = tables[0]
    sin = tables[1]
    if not _unit_feature_stride(x, o) or not _whole_strides(x, o):
        return False
    period = _count(positions)
    for i in range(period):
        if _entry(positions, i) < 0 or _entry(positions, i) >= cos.shape[0]:
            return False
    if _overlap(x, o):
        return False
    _small_path_rows(x, o, positions, repeat, cos, sin, rotary_dim, half_style, inverse)
    return True


def _small_path_rows(x, o, positions, repeat, cos, sin, rotary_dim, half_style, inverse):
    """rotate_rows's row loop, its checks passed."""


@overload(_small_path_rows)
def _small_path_rows_impl(x, o, positions, repeat, cos, sin, rotary_dim, half_style, inverse):
    # float16 without F16C keeps the row-view loop: see direct_rows_impl
    if o.dtype == types.uint16 or (o.dtype == types.int16 and HARDWARE_F16):
        return _rows_in_steps[o.dtype == types.uint16]
    return _rows_one_by_one


def _rows_one_by_one(x, o, positions, repeat, cos, sin, rotary_dim, half_style, inverse):
    """The rows through the general row body, a row view at a time."""
    d = o.shape[o.ndim - 1]
    n = rotary_dim // 2
    period = _count(positions)
    entry = 0
    left = repeat
    for idx in np.ndindex(o.shape[:-1]):
        p = _entry(positions, entry)
        xv, ov = _row_at(x, o, idx)
        _rotate_pairs(xv, ov, n if half_style else 0, n, cos[p], sin[p], inverse)
        for j in range(rotary_dim, d):  # the tail past rotary_dim, copied
            ov[np.uint64(j)] = xv[np.uint64(j)]
        left -= 1
        if left == 0:  # a counter, not r // repeat % period: divisions cost more than a row
            left = repeat
            entry += 1
            if entry == period:
                entry = 0


# float16 and bfloat16 in the small path: the direct path's vector steps, with plain stores
# that need only element alignment, rows addressed by offset. LLVM's own loop over a row view
# converts these types less well. On (1, 32, 16, 128) and (1, 32, 48, 128) the steps ran the
# half layout 1.17-1.28x as fast for float16 and 1.07-1.15x for bfloat16, interleaved float16
# 1.06-1.08x, interleaved bfloat16 0.96-0.98x, and a decode step 0.97-1.04x (bench/RESULTS.md,
# twelfth session). Keeping the old loop for that one case cost 2-3 s more compilation.
# float32 and float64 keep the old loop: the steps gained them nothing (0.95-1.02x).
_half_32 = _half_step(32, False, aligned=False)
_half_16 = _half_step(16, False, aligned=False)
_half_1 = _half_step(None, False, aligned=False)


def _source(x, o):
    """x, or o where x is None (in place)."""


@overload(_source)
def _source_impl(x, o):
    if isinstance(x, types.NoneType):
        return lambda x, o: o
    return lambda x, o: x


def _copies(x):
    """Whether rows have a tail to copy: not in place (``x`` None)."""


@overload(_copies)
def _copies_impl(x):
    copies = not isinstance(x, types.NoneType)
    return lambda x: copies


@njit(inline="always")
def _offset(a, idx):
    """The flat element offset of row ``idx`` of ``a`` from its first element."""
    offset = 0
    for k in range(len(idx)):
        offset += idx[k] * a.strides[k]
    return offset // a.itemsize


def _rows_in_steps_for(pair_32, pair_16, pair_1):
    """The small path's rows in vector steps, with ``pair_*`` the interleaved layout's."""

    def rows(x, o, positions, repeat, cos, sin, rotary_dim, half_style, inverse):
        """The rows in vector steps, each addressed by its flat offsets (no row views): 32
        bytes at a time, then 16, then a pair at a time. Tails are copied afterwards."""
        src = _source(x, o)
        n = rotary_dim
        h = n // 2
        wide = 32 // o.itemsize
        narrow = wide // 2
        stride = cos.strides[0] // cos.itemsize  # sin's too: both are views of one table
        period = _count(positions)
        entry = 0
        left = repeat
        if half_style:
            for idx in np.ndindex(o.shape[:-1]):
                t = _entry(positions, entry) * stride
                xr = _offset(src, idx)
                orow = _offset(o, idx)
                j = 0
                while j + wide <= h:
                    _half_32(src, xr + j, o, orow + j, h, cos, sin, t + j, inverse)
                    j += wide
                if j + narrow <= h:
                    _half_16(src, xr + j, o, orow + j, h, cos, sin, t + j, inverse)
                    j += narrow
                while j < h:
                    _half_1(src, xr + j, o, orow + j, h, cos, sin, t + j, inverse)
                    j += 1
                left -= 1
                if left == 0:
                    left = repeat
                    entry += 1
                    if entry == period:
                        entry = 0
        else:
            for idx in np.ndindex(o.shape[:-1]):
                t = _entry(positions, entry) * stride
                xr = _offset(src, idx)
                orow = _offset(o, idx)
                j = 0
                while j + wide <= n:
                    pair_32(src, xr + j, o, orow + j, cos, sin, t + j // 2, inverse)
                    j += wide
                if j + narrow <= n:
                    pair_16(src, xr + j, o, orow + j, cos, sin, t + j // 2, inverse)
                    j += narrow
                while j < n:
                    pair_1(src, xr + j, o, orow + j, cos, sin, t + j // 2, inverse)
                    j += 2
                left -= 1
                if left == 0:
                    left = repeat
                    entry += 1
                    if entry == period:
                        entry = 0
        d = o.shape[o.ndim - 1]
        if d > rotary_dim and _copies(x):
            for idx in np.ndindex(o.shape[:-1]):
                xr = _offset(src, idx)
                orow = _offset(o, idx)
                for j in range(rotary_dim, d):
                    _copy_element(src, xr + j, o, orow + j)

    return rows


_rows_in_steps = (
    _rows_in_steps_for(*(_interleaved_step(n, False, aligned=False) for n in (32, 16, None))),
    _rows_in_steps_for(
        *(_bfloat16_interleaved_step(n, False, aligned=False) for n in (32, 16, None))
    ),
)


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


_F16 = np.dtype(np.float16)
# Multi-axis layouts rotate from per-entry tables (see gather_tables), one run of pairs per
# row, when they have more runs than this (Qwen3-VL's interleaved axes: a run per pair or two
# leaves the loops no length), or when at least _SHARED_BY rows share each entry (heads sharing
# a token's positions), so that gathering costs little: short runs leave vector remainders
# (FLUX's (16, 56, 56): 8.3 -> 9.5 GB/s against 1-D 10.8, (4, 32, 2048, 128) float32).
_GATHER_ABOVE = 4
_SHARED_BY = 8


def _entries(idx):
    """The number of distinct position entries of idx: its non-broadcast leading extent."""
    count = 1
    for n, s in zip(idx.shape[:-1], idx.strides[:-1]):
        if s != 0:
            count *= n
    return count


@njit(inline="always")
def _gather_row(cos, sin, idx, pair_axis, row_cos, row_sin, r):
    """Fill row r of the per-entry tables."""
    for j in range(pair_axis.shape[0]):
        p = idx[r, pair_axis[j]]
        row_cos[r, j] = cos[p, j]
        row_sin[r, j] = sin[p, j]


@njit(cache=_CACHE)
def gather_tables(cos, sin, idx, pair_axis):
    """Per-entry tables: row r holds, for every pair j, ``cos[idx[r, pair_axis[j]], j]``.

    For layouts whose pairs change position axis every pair or two: the rotation then reads one
    row per entry as one run. Entries are position tuples (tokens), shared by every head, so this
    costs a fraction of the rotation (Qwen3-VL, (4, 32, 2048, 128): 8192 entries for 1M rows).
    One thread; :func:`gather_tables_parallel` for many entries.
    """
    row_cos = np.empty((idx.shape[0], pair_axis.shape[0]), dtype=cos.dtype)
    row_sin = np.empty((idx.shape[0], pair_axis.shape[0]), dtype=sin.dtype)
    for r in range(idx.shape[0]):
        _gather_row(cos, sin, idx, pair_axis, row_cos, row_sin, r)
    return row_cos, row_sin


@njit(cache=_CACHE, parallel=True)
def gather_tables_parallel(cos, sin, idx, pair_axis):
    """:func:`gather_tables` on every thread."""
    row_cos = np.empty((idx.shape[0], pair_axis.shape[0]), dtype=cos.dtype)
    row_sin = np.empty((idx.shape[0], pair_axis.shape[0]), dtype=sin.dtype)
    for r in prange(idx.shape[0]):
        _gather_row(cos, sin, idx, pair_axis, row_cos, row_sin, r)
    return row_cos, row_sin


def small_settings(rotary_dim, half_style):
    """rotate_rows's ``settings`` for the forward rotation with a repeat of 1: the inverse adds
    1, a repeat r adds ``(r - 1) << 32``. Low bits: rotary_dim, the style, inverse."""
    return rotary_dim * 4 + half_style * 2


def launch(rope, operands, cos, sin, inverse):
    """Rotate one or two operands (q and k) in one kernel call.

    ``operands`` holds (x, out, idx) triples: x and out of shape (L leading..., d), the feature
    axis contiguous, every stride a whole number of elements, ``out is x`` for in place; idx
    int64 of shape (L axes of size 1 or matching..., n_axes or 1), rows of ``cos``/``sin``.
    """
    segments = rope._segments
    if segments.shape[0] > 1:
        if operands[0][2].shape[-1] == 1:
            segments = _ONE_RUN[rope.rotary_dim // 2]  # per-entry tables already
        elif segments.shape[0] > _GATHER_ABOVE or all(
            _entries(idx) * _SHARED_BY <= x.size // x.shape[-1] for x, _, idx in operands
        ):
            operands, cos, sin = _per_entry(rope, operands, cos, sin)
            segments = _ONE_RUN[rope.rotary_dim // 2]
    g = geometry(operands, flat=True)
    args = []
    for x, out, idx in operands:
        xf = flat_view(x)[0]
        of = xf if out is x else flat_view(out)[0]
        # float16 as int16 bits, bfloat16 (the only other 2-byte dtype that gets here) as uint16
        view = None if x.itemsize != 2 else np.int16 if x.dtype == _F16 else np.uint16
        if view is not None:
            xf = xf.view(view)
            of = xf if out is x else of.view(view)
        args += (None if out is x else xf, of, flat_view(idx)[0])  # None: in place
    if len(operands) == 1:
        args += args  # the second operand has zero rows in g
    size = operands[0][0].size + (operands[1][0].size if len(operands) == 2 else 0)
    parallel = size >= SERIAL_BELOW and threads_usable()
    d = operands[0][0].shape[-1]
    copy_tail = rope.rotary_dim < d and not all(out is x for x, out, _ in operands)
    written = sum(out.nbytes for x, out, _ in operands if out is not x)
    stream = 0
    if STREAMING:
        large = written > 0 and written >= STREAM_ABOVE
        if (large or VECTOR_ROWS) and direct_path(rope, operands, segments, cos, sin):
            stream = DIRECT if large else VECTOR
        elif large:
            stream = SCRATCH
    args += (g, cos, sin, segments, rope.rotary_dim, d, rope._half_style, inverse)
    args += (copy_tail, stream)
    if parallel:
        run_parallel(rotate_parallel, *args)
    else:
        rotate_serial(*args)


def direct_path(rope, operands, segments, cos, sin):
    """Whether the direct path (DIRECT or VECTOR) can write these outputs (in place too): one
    run of pairs per row, table rows of unit stride (its vector loads assume it) with cos and
    sin laid out alike (one offset addresses a row of both), a pair block, tail and every output
    row starting on a 16-byte boundary, and float16 converted by the CPU (F16C)."""
    x = operands[0][0]
    item = x.itemsize
    if segments.shape[0] != 1 or (x.dtype == _F16 and not HARDWARE_F16):
        return False
    if cos.strides[-1] != cos.itemsize or sin.strides != cos.strides:
        return False
    rotary_dim, d = rope.rotary_dim, x.shape[-1]
    block = rotary_dim // 2 if rope._half_style else rotary_dim
    if (block * item) % 16 or ((d - rotary_dim) * item) % 16:
        return False
    for _, out, _ in operands:
        if out.__array_interface__["data"][0] % 16:
            return False
        if any(s % 16 for n, s in zip(out.shape[:-1], out.strides[:-1]) if n > 1):
            return False
    return True


class _OneRun(dict):
    """The segment table of a single run of ``pairs`` pairs, built once per size."""

    def __missing__(self, pairs):
        run = self[pairs] = np.array([[0, pairs, 0]], dtype=np.int64)
        return run


_ONE_RUN = _OneRun()


def _per_entry(rope, operands, cos, sin):
    """The operands re-pointed at per-entry tables gathered from (cos, sin), and those tables.

    Entries are the compact position entries: axes along which positions are broadcast (size 1
    or stride 0) are read once. q and k passing one position array share its tables.
    """
    cos_parts, sin_parts, entries_of, result = [], [], {}, []
    count = 0
    for x, out, idx in operands:
        if id(idx) not in entries_of:
            compact = idx[tuple(slice(0, 1) if s == 0 else slice(None) for s in idx.strides)]
            flat = np.ascontiguousarray(compact).reshape(-1, idx.shape[-1])
            # one thread for a few entries (a decode step), as for the rotation itself
            many = flat.shape[0] * rope._pair_axis.shape[0] >= SERIAL_BELOW and threads_usable()
            if many:
                tables = run_parallel(gather_tables_parallel, cos, sin, flat, rope._pair_axis)
            else:
                tables = gather_tables(cos, sin, flat, rope._pair_axis)
            row_cos, row_sin = tables
            cos_parts.append(row_cos)
            sin_parts.append(row_sin)
            entries = np.arange(count, count + flat.shape[0], dtype=np.int64)
            entries_of[id(idx)] = entries.reshape(compact.shape[:-1] + (1,))
            count += flat.shape[0]
        result.append((x, out, entries_of[id(idx)]))
    if len(cos_parts) == 1:
        return result, cos_parts[0], sin_parts[0]
    return result, np.concatenate(cos_parts), np.concatenate(sin_parts)
