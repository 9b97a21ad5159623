"""The hand-written LLVM IR of the CPU kernels, behind a few intrinsics.

Vector steps rotate the pairs of 16 or 32 bytes of a row at a time (or one pair): loads widened
to the compute type, the rotation, the store rounded to the storage type, with plain or
streaming (non-temporal) stores. Chunk steps write 16 to 64 bytes of a row on the 16-byte grid
whatever the grid of its pair blocks, with masked loads where a chunk crosses an edge (and
_paired, built on these helpers, a whole such row with each pair computed once). The rest
are single instructions LLVM does not reach from Numba: row views typed as contiguous, the flat
view of an array's memory, addresses, 64-byte streaming copies, the store fence, prefetches.

Every step addresses its arrays by flat element offsets from their first element; the caller
guarantees the offsets are in bounds (a chunk step's masked-off lanes aside).
"""

import platform

import llvmlite.binding as ll
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic
from numba.np.arrayobj import populate_array

from ._config import BF16_INSTRUCTION, WIDE_PIECES

# Streaming stores and their fence are x86 instructions.
X86 = platform.machine().lower() in ("x86_64", "amd64")
# AVX512-BF16's vcvtne2ps2bf16 (see _config.BF16_INSTRUCTION) rounds two float32 vectors to
# bfloat16 in one instruction, half to even as _convert.f32_to_bf16_result does, but with
# results below float32's smallest normal flushed to zero (see _bf16_two). LLVM emits it from
# inline assembly only, which its JIT reads with the native assembly parser. Plain stores only:
# a streaming store of 2-byte elements goes in pieces (see _store_streaming), and a
# large streaming rotation is slower with the instruction than with the integer rounding.
if BF16_INSTRUCTION:
    ll.initialize_native_asmparser()


@intrinsic
def contiguous(typingctx, row):
    """A 1-D row view whose one stride the caller knows to be the itemsize, typed as C layout:
    the same array, but loops over it index without its stride and vectorize (a strided row
    view loops at half the speed)."""

    def codegen(context, builder, signature, args):
        return impl_ret_borrowed(context, builder, signature.return_type, args[0])

    return types.Array(row.dtype, 1, "C")(row), codegen


@intrinsic
def address(typingctx, a, i):
    """The address of ``a[i]`` in a 1-D array of unit stride, as an integer."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.ptrtoint(builder.gep(data, [args[1]]), ir.IntType(64))

    return types.uint64(a, i), codegen


@intrinsic
def span(typingctx, a, first, length):
    """The 1-D view of ``length`` elements of unit stride from ``first`` elements past
    a[0, ..., 0] (``first`` <= 0 where a descends along an axis), typed C: the memory an array
    of any layout spans, for kernels that address it by element offsets. The caller keeps the
    view inside that memory."""
    view_type = types.Array(a.dtype, 1, "C")

    def codegen(context, builder, signature, args):
        source = context.make_array(signature.args[0])(context, builder, args[0])
        view = context.make_array(view_type)(context, builder)
        populate_array(
            view,
            data=builder.gep(source.data, [args[1]]),
            shape=cgutils.pack_array(builder, [args[2]]),
            strides=cgutils.pack_array(builder, [source.itemsize]),
            itemsize=source.itemsize,
            meminfo=source.meminfo,
            parent=source.parent,
        )
        return impl_ret_borrowed(context, builder, view_type, view._getvalue())

    return view_type(a, types.intp, types.intp), codegen


def _store_streaming(context, builder, array_type, array, index, value, align, nontemporal=True):
    """Store ``value`` (a vector) at ``array[index]`` with a streaming store, which writes the
    cache line without first reading it, or with a plain store where ``nontemporal`` is False.
    ``align`` is what the address is known to have.

    A streaming store of 2-byte elements (float32 results narrowed to float16 or bfloat16 bits)
    stores pieces of 32 bytes where Numba compiles for AVX (_config.WIDE_PIECES) and the
    vector holds them, else of 16, each taken from a register that LLVM cannot see into (an
    empty inline assembly statement): LLVM would otherwise fold the narrowing and the store
    into one narrowing store (vpmovdw, vcvtps2ph to memory), which has no streaming form, and
    drop the streaming mark. Plain stores into lines that streaming stores write too make every
    such line a read and two partial writes. LLVM writes each piece with streaming stores as
    wide as the alignment it knows allows (16 bytes, except on the line grid: see
    _ladder.line_walk); 16-byte pieces, each cut from a vcvtps2ph result
    before the statement, make float16's streaming steps much slower (bench/shapes.py)."""
    data = context.make_array(array_type)(context, builder, array).data
    address = builder.gep(data, [index])
    mark = builder.module.add_metadata([ir.IntType(32)(1)])
    kind = value.type
    halves = isinstance(kind, ir.VectorType) and kind.element == ir.IntType(16)
    if not (nontemporal and X86 and halves and kind.count % 8 == 0):
        store = builder.store(value, builder.bitcast(address, kind.as_pointer()), align=align)
        if nontemporal:
            store.set_metadata("nontemporal", mark)
        return
    i32 = ir.IntType(32)
    count = 16 if WIDE_PIECES and kind.count % 16 == 0 else 8
    piece = ir.VectorType(kind.element, count)
    for first in range(0, kind.count, count):
        lanes = ir.Constant(ir.VectorType(i32, count), [i32(first + k) for k in range(count)])
        part = builder.shuffle_vector(value, value, lanes)
        part = builder.asm(ir.FunctionType(piece, [piece]), "", "=x,0", [part], side_effect=False)
        at = builder.bitcast(builder.gep(address, [i32(first)]), piece.as_pointer())
        builder.store(part, at, align=min(align, 2 * count)).set_metadata("nontemporal", mark)


@intrinsic
def stream_line(typingctx, dst, di, src, si):
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
def prefetch_row(typingctx, a, first, n):
    """Ask the CPU to bring the ``n`` (a 64-bit integer) elements of a 1-D unit-stride array
    from ``first`` into its second-level cache, one request per 64-byte line they touch. A
    request never faults: the elements may lie outside the array."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        i8p, i64 = ir.IntType(8).as_pointer(), ir.IntType(64)
        at = builder.ptrtoint(builder.gep(data, [args[1]]), i64)
        line_start = builder.and_(at, i64(-64))
        start = builder.inttoptr(line_start, i8p)
        size = builder.mul(args[2], ir.Constant(args[2].type, a.dtype.bitwidth // 8))
        nbytes = builder.add(size, builder.sub(at, line_start))  # from the first line's start
        i32 = ir.IntType(32)
        name = "llvm.prefetch.p0" if ll.llvm_version_info >= (17,) else "llvm.prefetch.p0i8"
        function = builder.module.globals.get(name)
        if function is None:
            kind = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
            function = ir.Function(builder.module, kind, name)
        zero, line = ir.Constant(nbytes.type, 0), ir.Constant(nbytes.type, 64)
        with cgutils.for_range_slice(builder, zero, nbytes, line) as (offset, _):
            # read (0), locality 2 (the second-level cache), data (1)
            builder.call(function, [builder.gep(start, [offset]), i32(0), i32(2), i32(1)])
        return context.get_dummy_value()

    return types.void(a, first, n), codegen


@intrinsic
def store_fence(typingctx):
    """Order the streaming stores before everything after (they are weakly ordered): another
    thread, or Python after the kernel returns, then sees them."""

    def codegen(context, builder, signature, args):
        if X86:  # sfence: x86's fence for streaming stores (a seq_cst fence may not be)
            fnty = ir.FunctionType(ir.VoidType(), [])
            builder.call(builder.module.declare_intrinsic("llvm.x86.sse.sfence", fnty=fnty), [])
        return context.get_dummy_value()

    return types.void(), codegen


def _splat(ty, lanes, value):
    return ir.Constant(ir.VectorType(ty, lanes), [value] * lanes)


def _lanes_of(array_type, nbytes):
    """Elements of ``array_type`` in ``nbytes`` (None: one)."""
    return 1 if nbytes is None else nbytes // (array_type.dtype.bitwidth // 8)


def _load_lanes(context, builder, array_type, array, index, lanes, mask=None):
    """``lanes`` elements of a 1-D unit-stride array from ``index`` as a vector of the compute
    type (float64 for float64, float32 otherwise), converted as _convert.load converts one.
    With a ``mask`` (a vector of i1), only the lanes it sets are read (the others are zero):
    their addresses may lie outside the array."""
    return _widen(
        builder,
        array_type.dtype,
        _load_bits(context, builder, array_type, array, index, lanes, mask),
    )


def _load_bits(context, builder, array_type, array, index, lanes, mask=None, kept=None):
    """The stored elements :func:`_load_lanes` converts: a vector of float32 or float64, or of
    i16 for the 2-byte types. With a ``mask``, the lanes it leaves out are ``kept``'s (a
    vector of the same type), or zero."""
    data = context.make_array(array_type)(context, builder, array).data
    dtype = array_type.dtype
    if dtype in (types.float32, types.float64):
        element = context.get_value_type(dtype)
    else:
        element = ir.IntType(16)
    vector = ir.VectorType(element, lanes)
    address = builder.bitcast(builder.gep(data, [index]), vector.as_pointer())
    align = dtype.bitwidth // 8
    if mask is None:
        return builder.load(address, align=align)
    return _masked_load(builder, address, vector, align, mask, kept)


def _masked_load(builder, address, vector, align, mask, kept=None):
    """llvm.masked.load of ``vector`` at ``address``: the lanes ``mask`` leaves out are not
    read (the CPU faults on none of their addresses); they are ``kept``'s, or zero."""
    element = {ir.FloatType: "f32", ir.DoubleType: "f64"}.get(type(vector.element), "i16")
    pointer = "p0" if ll.llvm_version_info >= (17,) else f"p0v{vector.count}{element}"
    name = f"llvm.masked.load.v{vector.count}{element}.{pointer}"
    function = builder.module.globals.get(name)
    if function is None:
        kind = ir.FunctionType(vector, [address.type, ir.IntType(32), mask.type, vector])
        function = ir.Function(builder.module, kind, name)
    kept = ir.Constant(vector, None) if kept is None else kept
    return builder.call(function, [address, ir.IntType(32)(align), mask, kept])


def _widen(builder, dtype, bits):
    """The stored elements ``bits`` (see :func:`_load_bits`) as the compute type."""
    if dtype in (types.float32, types.float64):
        return bits
    lanes = bits.type.count
    floats = ir.VectorType(ir.FloatType(), lanes)
    if dtype == types.int16:  # float16 bits
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), lanes)), floats)
    wide = builder.zext(bits, ir.VectorType(ir.IntType(32), lanes))  # bfloat16 bits
    return builder.bitcast(builder.shl(wide, _splat(ir.IntType(32), lanes, 16)), floats)


def _stream_lanes(context, builder, array_type, array, index, value, nontemporal, aligned=True):
    """Store the vector ``value`` at ``array[index]`` (16-byte aligned; only element-aligned
    where ``aligned`` is False; ``aligned`` bytes where it is a number, the line grid of
    _ladder.line_walk), rounded once to the array's storage type as _convert.store rounds,
    with streaming stores (plain ones where ``nontemporal`` is False)."""
    value = _narrow(builder, array_type.dtype, value, nontemporal)
    align = _alignment(aligned, array_type.dtype.bitwidth // 8)
    _store_streaming(context, builder, array_type, array, index, value, align, nontemporal)


def _alignment(aligned, item):
    """The bytes a store's address is known to be aligned to (see :func:`_stream_lanes`)."""
    if aligned is True:
        return 16
    return aligned if aligned else item


def _narrow(builder, dtype, value, nontemporal=False):
    """The compute-type vector ``value`` rounded once to ``dtype``'s stored elements (as
    :func:`_load_bits` reads them), for a plain store or (``nontemporal``) a streaming one."""
    lanes = value.type.count
    if dtype == types.int16:  # float16 bits, rounded half to even
        return builder.bitcast(
            builder.fptrunc(value, ir.VectorType(ir.HalfType(), lanes)),
            ir.VectorType(ir.IntType(16), lanes),
        )
    if dtype != types.uint16:
        return value
    if BF16_INSTRUCTION and lanes == 32 and not nontemporal:  # see BF16_INSTRUCTION
        i32 = ir.IntType(32)
        low, high = (
            builder.shuffle_vector(
                value, value, ir.Constant(ir.VectorType(i32, 16), [*range(at, at + 16)])
            )
            for at in (0, 16)
        )
        return _bf16_two(builder, low, high)
    rounded = _bf16_round_lanes(builder, value)  # bfloat16 bits in each word's high half
    if nontemporal:  # x86-64 stores it in pieces (see _store_streaming): per vector
        return builder.trunc(
            builder.lshr(rounded, _splat(ir.IntType(32), lanes, 16)),
            ir.VectorType(ir.IntType(16), lanes),
        )
    # For a plain store, the high halves (the second of each word's, little-endian) picked by
    # one shuffle, which AVX-512 makes one vpermt2w per two vectors: fewer instructions than a
    # shift and a narrowing of each vector and a merge.
    words = builder.bitcast(rounded, ir.VectorType(ir.IntType(16), 2 * lanes))
    high = ir.Constant(ir.VectorType(ir.IntType(32), lanes), [2 * k + 1 for k in range(lanes)])
    return builder.shuffle_vector(words, words, high)


def _bf16_two(builder, low, high):
    """Two float32 vectors of 8 or 16 lanes as one vector of their bfloat16 bits, ``low``'s
    first, by one vcvtne2ps2bf16. Where any result is zero, as every result below float32's
    smallest normal becomes there, both are rounded again by :func:`_bf16_round_lanes` (the
    same bits, subnormals kept), on a branch that inputs without zeros never take."""
    i16, i32 = ir.IntType(16), ir.IntType(32)
    lanes = 2 * low.type.count
    bits = ir.VectorType(i16, lanes)
    convert = ir.FunctionType(bits, [low.type, low.type])
    # AT&T operand order: the first source fills the low half
    fast = builder.asm(convert, "vcvtne2ps2bf16 $2, $1, $0", "=v,v,v", [high, low], False)
    magnitude = builder.and_(fast, _splat(i16, lanes, 0x7FFF))
    zeros = builder.icmp_unsigned("==", magnitude, _splat(i16, lanes, 0))
    any_zero = builder.icmp_unsigned(
        "!=", builder.bitcast(zeros, ir.IntType(lanes)), ir.IntType(lanes)(0)
    )
    fast_from = builder.block
    with builder.if_then(any_zero, likely=False):
        both = builder.shuffle_vector(
            low, high, ir.Constant(ir.VectorType(i32, lanes), [*range(lanes)])
        )
        words = builder.bitcast(_bf16_round_lanes(builder, both), ir.VectorType(i16, 2 * lanes))
        odd = ir.Constant(ir.VectorType(i32, lanes), [2 * k + 1 for k in range(lanes)])
        exact = builder.shuffle_vector(words, words, odd)  # each word's high half
        exact_from = builder.block
    result = builder.phi(bits)
    result.add_incoming(fast, fast_from)
    result.add_incoming(exact, exact_from)
    return result


def _bf16_round_lanes(builder, value):
    """_convert.f32_to_bf16_result on every lane of a float32 vector, as 32-bit words whose
    high halves are the bfloat16 bits (the low halves are left over from the rounding)."""
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


def row_step(half, nbytes, nontemporal, aligned=True, part=None):
    """The step of :func:`_half_step` (``half``) or :func:`_pair_step` at element j of a row, in
    one signature for both styles: an intrinsic ``step(x, xr, o, orow, h, cos, sin, t, j,
    inverse)`` that reads x from xr + j, stores to orow + j and reads the tables at t + j
    (half) or t + j / 2 (interleaved: one table entry per pair); h is unused there. Its index
    arithmetic is made here rather than by an inlined helper: Numba's inlining of a helper at
    each call site costs compile time that an intrinsic does not. ``part`` (half only): see
    :func:`_half_step`."""
    if half:
        inner = _half_step(nbytes, nontemporal, aligned, part)
    else:
        inner = _pair_step(nbytes, nontemporal, aligned)

    @intrinsic
    def step(typingctx, x, xr, o, orow, h, cos, sin, t, j, inverse):
        if half:
            inner_sig, inner_codegen = inner(typingctx, x, xr, o, orow, h, cos, sin, t, inverse)
        else:
            inner_sig, inner_codegen = inner(typingctx, x, xr, o, orow, cos, sin, t, inverse)

        def codegen(context, builder, signature, args):
            x_, xr_, o_, orow_, h_, cos_, sin_, t_, j_, inverse_ = args
            xa = builder.add(xr_, j_)
            oa = builder.add(orow_, j_)
            entry = builder.add(t_, j_ if half else builder.lshr(j_, ir.Constant(j_.type, 1)))
            if half:
                inner_args = (x_, xa, o_, oa, h_, cos_, sin_, entry, inverse_)
            else:
                inner_args = (x_, xa, o_, oa, cos_, sin_, entry, inverse_)
            return inner_codegen(context, builder, inner_sig, inner_args)

        return types.void(x, xr, o, orow, h, cos, sin, t, j, inverse), codegen

    return step


def _half_step(nbytes, nontemporal, aligned=True, part=None):
    """An intrinsic's definition (typing, then codegen) of a step rotating the pairs
    (j, j + h) for the ``nbytes`` of o from o[oa] on (None: one pair): x read from x[xa] and
    x[xa + h], tables from cos[t], sin[t]. _pairs's arithmetic, in vectors. It stores as
    _stream_lanes's ``nontemporal`` and ``aligned`` say. ``part`` "first" stores only the
    results at j (h may then be any offset: see _ladder.ladder's split), None both."""
    if part not in (None, "first"):
        raise ValueError(f"no half step for part {part!r}")

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
            _stream_lanes(context, builder, tys[2], o_, oa_, first, nontemporal, aligned)
            if part is None:
                second = builder.fadd(builder.fmul(b, c), builder.fmul(a, s))
                second_at = builder.add(oa_, h_)
                _stream_lanes(context, builder, tys[2], o_, second_at, second, nontemporal, aligned)
            return context.get_dummy_value()

        return types.void(x, xa, o, oa, h, cos, sin, t, inverse), codegen

    return step


def _pair_step(nbytes, nontemporal, aligned=True):
    """An intrinsic's definition (typing, then codegen) of a step rotating the pairs (2j, 2j + 1) in
    the ``nbytes`` of o from o[oa] on (None: one pair): x read from x[xa], tables from cos[t],
    sin[t]. _interleaved_pairs's arithmetic, in vectors, by :func:`_interleaved_codegen`, or
    :func:`_bfloat16_codegen` where x and o hold bfloat16 bits (uint16). It stores as
    _stream_lanes's ``nontemporal`` and ``aligned`` say."""

    def step(typingctx, x, xa, o, oa, cos, sin, t, inverse):
        if o.dtype == types.uint16 and x.dtype == types.uint16:
            codegen = _bfloat16_codegen(nbytes, nontemporal, aligned)
        else:
            lanes = 2 if nbytes is None else _lanes_of(o, nbytes)
            codegen = _interleaved_codegen(lanes, nontemporal, aligned)
        return types.void(x, xa, o, oa, cos, sin, t, inverse), codegen

    return step


def _interleaved_codegen(lanes, nontemporal, aligned):
    """The pair step in ``lanes`` elements: each element times its pair's cos, plus its
    partner times its pair's (signed) sin."""

    def codegen(context, builder, signature, args):
        x_, xa_, o_, oa_, cos_, sin_, t_, inverse_ = args
        tys = signature.args
        v = _load_lanes(context, builder, tys[0], x_, xa_, lanes)
        c = _load_lanes(context, builder, tys[4], cos_, t_, lanes // 2)
        s = _signed_sin(
            builder, _load_lanes(context, builder, tys[5], sin_, t_, lanes // 2), inverse_
        )
        result = _interleaved(builder, v, c, s)
        _stream_lanes(context, builder, tys[2], o_, oa_, result, nontemporal, aligned)
        return context.get_dummy_value()

    return codegen


def _interleaved(builder, v, c, s):
    """The interleaved rotation of the pairs of ``v`` by one entry of ``c`` and (signed) ``s``
    per pair: (a c - b s, b c + a s) for each pair (a, b)."""
    i32 = ir.IntType(32)
    lanes = v.type.count
    twice = ir.Constant(ir.VectorType(i32, lanes), [i32(k // 2) for k in range(lanes)])
    swap = ir.Constant(ir.VectorType(i32, lanes), [i32(k ^ 1) for k in range(lanes)])
    # even lanes from the difference, odd lanes from the sum
    pick = ir.Constant(
        ir.VectorType(i32, lanes), [i32(k if k % 2 == 0 else lanes + k) for k in range(lanes)]
    )
    c = builder.shuffle_vector(c, c, twice)
    s = builder.shuffle_vector(s, s, twice)
    scaled = builder.fmul(v, c)  # (a c, b c)
    crossed = builder.fmul(builder.shuffle_vector(v, v, swap), s)  # (b s, a s)
    return builder.shuffle_vector(
        builder.fsub(scaled, crossed), builder.fadd(scaled, crossed), pick
    )


def chunk_step(half, kind, nbytes, nontemporal, align=16):
    """An intrinsic ``step(x, xr, o, orow, h, cos, sin, t, k, inverse)`` (row_step's arguments)
    that writes the ``nbytes`` of a row of o from its element k on, at orow + k on the 16-byte
    grid (on the ``align``-byte grid where the caller says so: a whole 64-byte line is then one
    store), whatever the grid of the row's pair blocks: x's row at xr, the table row at t, h
    pairs (2h rotary elements). ``kind`` says which elements the chunk holds: "first" (all in
    the first half of the half layout's pairs: j with partner j + h), "second" (all in its
    second half: j with partner j - h), or "mixed" (any, and elements past 2h, which get x's
    bits). A mixed chunk reads only what its elements need (masked loads), so its other
    lanes' addresses may lie outside the arrays (x's own 16 bytes at k are whole: rows are
    whole multiples of 16 bytes here). (Interleaved chunks inside the rotary part take
    row_step.) The arithmetic is _half_step's and _interleaved's, element for element (the
    mixed half-style chunk's x c + p (-s) rounds as x c - p s)."""
    if kind not in ("first", "second", "mixed") or (not half and kind != "mixed"):
        raise ValueError(f"no {kind!r} chunk for the {'half' if half else 'interleaved'} style")

    @intrinsic
    def step(typingctx, x, xr, o, orow, h, cos, sin, t, k, inverse):
        lanes = _lanes_of(o, nbytes)

        def codegen(context, builder, signature, args):
            x_, xr_, o_, orow_, h_, cos_, sin_, t_, k_, inverse_ = args
            tys = signature.args

            def load(which, array, at, count, mask=None):
                return _load_lanes(context, builder, tys[which], array, at, count, mask)

            xa = builder.add(xr_, k_)
            bits = _load_bits(context, builder, tys[0], x_, xa, lanes)
            xk = _widen(builder, tys[0].dtype, bits)
            if kind == "mixed":  # lanes inside the rotary part
                rotary = _below(builder, k_, builder.shl(h_, h_.type(1)), lanes)
            if half and kind == "mixed":
                # Both sides' formulas in one: x[j] c[i] + x[j'] (-s[i]) with i = j, j' = j + h
                # in the first half; x[j] c[i] + x[j'] s[i] with i = j' = j - h in the second.
                # Each operand is one masked load merged into another, and each element is
                # computed once (a - b and a + (-b) round alike).
                first = _below(builder, k_, h_, lanes)
                second = builder.and_(builder.not_(first), rotary)
                up, down = builder.add(t_, k_), builder.sub(builder.add(t_, k_), h_)

                def merged(which, array, a, b):
                    one = _load_bits(context, builder, tys[which], array, a, lanes, first)
                    return _widen(
                        builder,
                        tys[which].dtype,
                        _load_bits(context, builder, tys[which], array, b, lanes, second, one),
                    )

                partner = merged(0, x_, builder.add(xa, h_), builder.sub(xa, h_))
                c = merged(5, cos_, up, down)
                s = _signed_sin(builder, merged(6, sin_, up, down), inverse_)
                s = builder.select(first, builder.fneg(s), s)
                result = builder.fadd(builder.fmul(xk, c), builder.fmul(partner, s))
            elif kind == "first":  # x[j] c[j] - x[j + h] s[j]
                at = builder.add(t_, k_)
                partner = load(0, x_, builder.add(xa, h_), lanes)
                c = load(5, cos_, at, lanes)
                s = _signed_sin(builder, load(6, sin_, at, lanes), inverse_)
                result = builder.fsub(builder.fmul(xk, c), builder.fmul(partner, s))
            elif kind == "second":  # x[j] c[j - h] + x[j - h] s[j - h]
                at = builder.sub(builder.add(t_, k_), h_)
                partner = load(0, x_, builder.sub(xa, h_), lanes)
                c = load(5, cos_, at, lanes)
                s = _signed_sin(builder, load(6, sin_, at, lanes), inverse_)
                result = builder.fadd(builder.fmul(xk, c), builder.fmul(partner, s))
            else:
                pairs = lanes // 2
                half_k = builder.lshr(k_, k_.type(1))
                mask = _below(builder, half_k, h_, pairs)
                at = builder.add(t_, half_k)
                c = load(5, cos_, at, pairs, mask)
                s = _signed_sin(builder, load(6, sin_, at, pairs, mask), inverse_)
                result = _interleaved(builder, xk, c, s)
            stored = _narrow(builder, tys[2].dtype, result, nontemporal)
            if kind == "mixed":  # elements past the rotary part: x's bits
                stored = builder.select(rotary, stored, bits)
            oa = builder.add(orow_, k_)
            _store_streaming(context, builder, tys[2], o_, oa, stored, align, nontemporal)
            return context.get_dummy_value()

        return types.void(x, xr, o, orow, h, cos, sin, t, k, inverse), codegen

    return step


def _broadcast(builder, value, lanes):
    """The scalar ``value`` in every lane of a vector."""
    vector = ir.VectorType(value.type, lanes)
    one = builder.insert_element(ir.Constant(vector, None), value, ir.IntType(32)(0))
    return builder.shuffle_vector(
        one, one, ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes)
    )


def _below(builder, start, limit, lanes):
    """The lanes i of a vector of ``lanes`` with start + i < limit (unsigned scalars), as a
    vector of i1: the count of such lanes clamped to 0..lanes as a scalar, then one compare of
    16-bit lane numbers (a compare of the 64-bit indices takes a vector instruction per eight
    lanes)."""
    zero = start.type(0)
    count = builder.select(
        builder.icmp_unsigned("<", start, limit), builder.sub(limit, start), zero
    )
    count = builder.select(
        builder.icmp_unsigned("<", count, start.type(lanes)), count, start.type(lanes)
    )
    i16 = ir.IntType(16)
    numbers = ir.Constant(ir.VectorType(i16, lanes), list(range(lanes)))
    return builder.icmp_unsigned(
        "<", numbers, _broadcast(builder, builder.trunc(count, i16), lanes)
    )


def _from(builder, start, lanes):
    """(start, start + 1, ..., start + lanes - 1) as a vector."""
    steps = ir.Constant(ir.VectorType(start.type, lanes), list(range(lanes)))
    return builder.add(_broadcast(builder, start, lanes), steps)


def _bfloat16_codegen(nbytes, nontemporal, aligned):
    """The pair step for bfloat16, with no shuffles (they cost the shuffling step a fifth of its
    speed): each pair's two elements are one 32-bit word, whose low half is the first element's
    bits and whose high half is the second's, so shifting and masking the word widens both to
    float32, and f32_to_bf16_result on both results puts them back."""
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
        s = _signed_sin(builder, _load_lanes(context, builder, tys[5], sin_, t_, lanes), inverse_)
        first = builder.fsub(builder.fmul(a, c), builder.fmul(b, s))
        second = builder.fadd(builder.fmul(b, c), builder.fmul(a, s))
        if BF16_INSTRUCTION and lanes in (8, 16) and not nontemporal:  # see BF16_INSTRUCTION
            both = _bf16_two(builder, first, second)
            pairs = [i for k in range(lanes) for i in (k, lanes + k)]
            both = builder.shuffle_vector(
                both, both, ir.Constant(ir.VectorType(i32, 2 * lanes), pairs)
            )
            result = builder.bitcast(both, words)
        else:
            result = builder.or_(
                builder.lshr(_bf16_round_lanes(builder, first), sixteen),
                builder.and_(_bf16_round_lanes(builder, second), _splat(i32, lanes, 0xFFFF0000)),
            )
        align = _alignment(aligned, 2)
        _store_streaming(context, builder, tys[2], o_, oa_, result, align, nontemporal)
        return context.get_dummy_value()

    return codegen


def copy_bytes(nontemporal, nbytes, aligned=True):
    """An intrinsic: o[oa...] = x[xa...], ``nbytes`` bytes (16, 32 or 64), with streaming stores
    (o[oa] 16-byte aligned) or a plain one (o[oa] 16-byte aligned, or only element-aligned where
    ``aligned`` is False)."""
    align = 16 if aligned else 1

    @intrinsic
    def copy(typingctx, x, xa, o, oa):
        def codegen(context, builder, signature, args):
            x_, xa_, o_, oa_ = args
            vector = ir.VectorType(ir.IntType(32), nbytes // 4)
            source = context.make_array(signature.args[0])(context, builder, x_).data
            value = builder.load(
                builder.bitcast(builder.gep(source, [xa_]), vector.as_pointer()), align=1
            )
            _store_streaming(
                context, builder, signature.args[2], o_, oa_, value, align, nontemporal
            )
            return context.get_dummy_value()

        return types.void(x, xa, o, oa), codegen

    return copy


@intrinsic
def copy_element(typingctx, x, xa, o, oa):
    """o[oa] = x[xa]: one element's bits, at flat element offsets from each array's first
    element, as the steps address them."""

    def codegen(context, builder, signature, args):
        x_, xa_, o_, oa_ = args
        source = context.make_array(signature.args[0])(context, builder, x_).data
        target = context.make_array(signature.args[2])(context, builder, o_).data
        builder.store(builder.load(builder.gep(source, [xa_])), builder.gep(target, [oa_]))
        return context.get_dummy_value()

    return types.void(x, xa, o, oa), codegen


# The QK-norm of the fused step (see _fused): a row's sum of squares and its scaling, eight
# elements at a time, the last group through masked loads (its other lanes zero).
_NORM_LANES = 8


def _compute_type(dtype):
    return types.float64 if dtype == types.float64 else types.float32


def _groups(builder, d, body):
    """``body(j, mask)`` for j = 0, 8, ... below ``d``: mask None for whole groups, then a vector
    of i1 that sets the lanes below d for a last partial group."""
    whole = builder.and_(d, d.type(-_NORM_LANES))
    with cgutils.for_range_slice(builder, d.type(0), whole, d.type(_NORM_LANES), intp=d.type) as (
        j,
        _,
    ):
        body(j, None)
    left = builder.sub(d, whole)
    with builder.if_then(builder.icmp_unsigned("!=", left, d.type(0)), likely=False):
        lanes = _from(builder, d.type(0), _NORM_LANES)
        body(whole, builder.icmp_unsigned("<", lanes, _broadcast(builder, left, _NORM_LANES)))


@intrinsic
def sum_of_squares(typingctx, x, xr, d):
    """The sum of the squares of the ``d`` elements of x from flat offset ``xr``, in the compute
    type, in _fused._inverse_rms's order: element j into partial sum j % 8 (one lane of a
    vector of eight), the eight then added ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))."""
    compute = _compute_type(x.dtype)

    def codegen(context, builder, signature, args):
        x_, xr_, d_ = args
        vector = ir.VectorType(context.get_value_type(compute), _NORM_LANES)
        total = cgutils.alloca_once_value(builder, ir.Constant(vector, None))

        def add(j, mask):
            v = _load_lanes(
                context, builder, signature.args[0], x_, builder.add(xr_, j), _NORM_LANES, mask
            )
            builder.store(builder.fadd(builder.load(total), builder.fmul(v, v)), total)

        _groups(builder, d_, add)
        sums = builder.load(total)
        s = [builder.extract_element(sums, ir.IntType(32)(i)) for i in range(_NORM_LANES)]
        low = builder.fadd(builder.fadd(s[0], s[1]), builder.fadd(s[2], s[3]))
        high = builder.fadd(builder.fadd(s[4], s[5]), builder.fadd(s[6], s[7]))
        return builder.fadd(low, high)

    return compute(x, xr, d), codegen


@intrinsic
def scale_row(typingctx, x, xr, d, factor, weight, scratch):
    """scratch[j] = x[xr + j] * factor * weight[j] for j < d, in the compute type (scratch's,
    the weight's and factor's), each as _fused._scaled makes it. scratch holds d rounded up to
    a multiple of 8: a last partial group is stored whole."""

    def codegen(context, builder, signature, args):
        x_, xr_, d_, factor_, weight_, scratch_ = args
        tys = signature.args
        out = context.make_array(tys[5])(context, builder, scratch_).data
        vector = ir.VectorType(factor_.type, _NORM_LANES)
        scale = _broadcast(builder, factor_, _NORM_LANES)

        def put(j, mask):
            v = _load_lanes(context, builder, tys[0], x_, builder.add(xr_, j), _NORM_LANES, mask)
            w = _load_lanes(context, builder, tys[4], weight_, j, _NORM_LANES, mask)
            at = builder.bitcast(builder.gep(out, [j]), vector.as_pointer())
            builder.store(
                builder.fmul(builder.fmul(v, scale), w), at, align=tys[5].dtype.bitwidth // 8
            )

        _groups(builder, d_, put)
        return context.get_dummy_value()

    return types.void(x, xr, d, factor, weight, scratch), codegen
