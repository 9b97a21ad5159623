"""The half style's rows whose pair blocks are off the 16-byte grid, each pair computed once
(AVX-512): an intrinsic built on _simd's loads, rounding and stores, which the chunk walk takes
for such rows of the 2-byte types (see _ladder.takes_paired_row)."""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._simd import (
    _below,
    _broadcast,
    _load_bits,
    _narrow,
    _signed_sin,
    _splat,
    _store_streaming,
    _widen,
)

# Pair blocks per row that paired_row holds (a row's h pairs in blocks of 64 bytes of o)
PAIRED_BLOCKS = 16
_PERMUTES = {16: "hi", 32: "d", 64: "q"}  # AVX-512's two-register permute by element bits


def paired_row(nontemporal):
    """An intrinsic ``row(x, xr, o, orow, n, cos, sin, t, inverse)`` (a ladder's arguments)
    that writes the half style's row of o at ``orow`` (16-byte aligned) up to the first
    16-byte boundary at or past the rotary part's end n, whatever the grid of its pair blocks,
    where h = n / 2 is at most PAIRED_BLOCKS blocks of 64 bytes of o (needs AVX512BW).

    Each pair is computed once, as the half steps compute it: the pairs in blocks of 64 bytes of
    o (masked loads past h), each block's first-half and second-half results. Each 64-byte
    chunk of the row on the grid then takes its elements below h from the first-half block at
    its place, those from h to n from the two second-half blocks it spans, joined by one
    two-register permute whose index depends on h alone, and those past n from x; it is stored
    in 16-byte pieces up to the boundary (streaming stores where ``nontemporal``). A row of one
    or two blocks keeps its results in registers; longer rows keep them in stack slots, written
    and read whole (each load is served from the store before it). In registers, a last block
    of at most half a block's pairs is computed in vectors of half the width, at half the
    arithmetic and conversions, which bound short rows even past the cache."""

    @intrinsic
    def row(typingctx, x, xr, o, orow, n, cos, sin, t, inverse):
        item = o.dtype.bitwidth // 8
        lanes = 64 // item
        per = 16 // item

        def codegen(context, builder, signature, args):
            x_, xr_, o_, orow_, n_, cos_, sin_, t_, inverse_ = args
            tys = signature.args
            kind = n_.type
            i16, i32 = ir.IntType(16), ir.IntType(32)
            bits = ir.VectorType(ir.IntType(8 * item), lanes)
            numbers = ir.Constant(ir.VectorType(i16, lanes), list(range(lanes)))
            zero = ir.Constant(bits, None)
            h = builder.lshr(n_, kind(1))
            end = builder.mul(builder.udiv(builder.add(n_, kind(per - 1)), kind(per)), kind(per))
            blocks = builder.udiv(builder.add(h, kind(lanes - 1)), kind(lanes))
            # the stack slots hold PAIRED_BLOCKS: the launcher gives no longer row (see
            # cpu._chunks_hold), and one would get wrong results but write no slot past them
            blocks = builder.select(
                builder.icmp_unsigned("<=", blocks, kind(PAIRED_BLOCKS)),
                blocks,
                kind(PAIRED_BLOCKS),
            )
            chunks = builder.udiv(builder.add(end, kind(lanes - 1)), kind(lanes))

            def ones(array_type, width):  # 1.0 in every lane, as the array's stored elements
                one = {types.uint16: 0x3F80, types.int16: 0x3C00}.get(array_type.dtype)
                if one is not None:
                    return _splat(i16, width, one)
                return _splat(context.get_value_type(array_type.dtype), width, 1.0)

            def read(which, array, index, width, inside, kept):
                loaded = _load_bits(context, builder, tys[which], array, index, width, inside, kept)
                return _widen(builder, tys[which].dtype, loaded)

            def block(j, width=lanes):
                """The first- and second-half results of pairs j..j + width - 1, as bits (a
                block of half the lanes, the only narrower width, has zeros past width). Lanes
                past h read 1.0 (a sin of 0): their results are 1.0, never zeros, which would
                send the bfloat16 rounding to its second pass (see _simd._bf16_two)."""
                assert width in (lanes, lanes // 2), width
                inside = _below(builder, j, h, width)
                xj = builder.add(xr_, j)
                a = read(0, x_, xj, width, inside, ones(tys[0], width))
                b = read(0, x_, builder.add(xj, h), width, inside, ones(tys[0], width))
                at = builder.add(t_, j)
                c = read(5, cos_, at, width, inside, ones(tys[5], width))
                s = _signed_sin(builder, read(6, sin_, at, width, inside, None), inverse_)
                low = builder.fsub(builder.fmul(a, c), builder.fmul(b, s))
                high = builder.fadd(builder.fmul(b, c), builder.fmul(a, s))
                if width == lanes:
                    return tuple(
                        builder.bitcast(_narrow(builder, tys[2].dtype, v), bits)
                        for v in (low, high)
                    )
                # a half-width block's two halves rounded as one vector of lanes (one conversion
                # instruction where there is one), then taken apart
                every = ir.Constant(ir.VectorType(i32, lanes), [*range(lanes)])
                narrowed = _narrow(builder, tys[2].dtype, builder.shuffle_vector(low, high, every))
                blank = ir.Constant(narrowed.type, None)
                return tuple(
                    builder.bitcast(
                        builder.shuffle_vector(
                            narrowed,
                            blank,
                            ir.Constant(
                                ir.VectorType(i32, lanes),
                                [*range(first, first + width), *range(lanes, lanes + width)],
                            ),
                        ),
                        bits,
                    )
                    for first in (0, width)
                )

            # lane l of the chunk at k lanes, from h on, is second-half element k lanes + l - h:
            # lane (l - h) mod lanes of second-half block k - h // lanes, or of the block before
            # it where l < h mod lanes; a two-register permute of those blocks picks it at index
            # l + lanes - h mod lanes
            whole = builder.udiv(h, kind(lanes))
            shift = builder.trunc(builder.urem(h, kind(lanes)), i16)
            index = builder.sub(
                builder.add(numbers, _splat(i16, lanes, lanes)), _broadcast(builder, shift, lanes)
            )
            if item != 2:
                index = builder.zext(index, bits)
            name = f"llvm.x86.avx512.vpermi2var.{_PERMUTES[8 * item]}.512"
            permute = builder.module.globals.get(name) or ir.Function(
                builder.module, ir.FunctionType(bits, [bits, bits, bits]), name
            )
            h16, n16, end16 = (
                _broadcast(builder, builder.trunc(v, i16), lanes) for v in (h, n_, end)
            )

            def second_slot(k):
                """Where chunk k's earlier second-half block is among the blocks numbered from
                1 (0 and blocks + 1 hold zeros), clamped to them: lanes outside h..n take
                nothing from them."""
                slot = builder.select(
                    builder.icmp_unsigned(">=", k, whole), builder.sub(k, whole), kind(0)
                )
                return builder.select(builder.icmp_unsigned("<=", slot, blocks), slot, blocks)

            def chunk(k, own, before, after):
                place = builder.mul(k, kind(lanes))
                q = builder.add(numbers, _broadcast(builder, builder.trunc(place, i16), lanes))
                joined = builder.call(permute, [before, index, after])
                in_row = builder.icmp_unsigned("<", q, end16)
                xa = builder.add(xr_, place)
                kept = builder.bitcast(
                    _load_bits(context, builder, tys[0], x_, xa, lanes, in_row), bits
                )
                value = builder.select(builder.icmp_unsigned("<", q, n16), joined, kept)
                value = builder.select(builder.icmp_unsigned("<", q, h16), own, value)

                def store_piece(p):
                    at = builder.add(place, kind(p * per))
                    chosen = ir.Constant(ir.VectorType(i32, per), [*range(p * per, (p + 1) * per)])
                    part = builder.shuffle_vector(value, value, chosen)
                    if item != 2:
                        stored = ir.VectorType(context.get_value_type(tys[2].dtype), per)
                        part = builder.bitcast(part, stored)
                    target = builder.add(orow_, at)
                    _store_streaming(context, builder, tys[2], o_, target, part, 16, nontemporal)

                for p in range(lanes // per):
                    at = builder.add(place, kind(p * per))
                    with builder.if_then(builder.icmp_unsigned("<", at, end), likely=True):
                        store_piece(p)

            def pick(values, at):  # values[at], at a scalar below len(values)
                chosen = values[0]
                for i in range(1, len(values)):
                    chosen = builder.select(
                        builder.icmp_unsigned("==", at, kind(i)), values[i], chosen
                    )
                return chosen

            def in_registers(count, last=lanes):
                """The row of ``count`` blocks, the last of ``last`` lanes, the others whole (at
                most as many chunks as their pairs fill twice), their results in registers, each
                chunk picking its second-half blocks by selects."""
                made = [
                    block(kind(b * lanes), last if b == count - 1 else lanes) for b in range(count)
                ]
                seconds = [zero, *(high for _, high in made), zero]  # as second_slot numbers
                pairs = (count - 1) * lanes + last
                for k in range((2 * pairs + lanes - 1) // lanes):
                    with builder.if_then(builder.icmp_unsigned("<", kind(k), chunks), likely=True):
                        slot = second_slot(kind(k))
                        own = made[k][0] if k < count else zero  # none of its lanes below h
                        chunk(kind(k), own, pick(seconds[:-1], slot), pick(seconds[1:], slot))

            def in_slots():
                """The row of more blocks, their results in stack slots."""
                firsts = cgutils.alloca_once(builder, bits, size=PAIRED_BLOCKS)
                seconds = cgutils.alloca_once(builder, bits, size=PAIRED_BLOCKS + 2)
                builder.store(zero, builder.gep(seconds, [kind(0)]))
                builder.store(zero, builder.gep(seconds, [builder.add(blocks, kind(1))]))
                with cgutils.for_range(builder, blocks) as loop:
                    low, high = block(builder.mul(loop.index, kind(lanes)))
                    builder.store(low, builder.gep(firsts, [loop.index]))
                    slot = builder.add(loop.index, kind(1))
                    builder.store(high, builder.gep(seconds, [slot]))
                last = builder.sub(blocks, kind(1))
                with cgutils.for_range(builder, chunks) as loop:
                    k = loop.index
                    mine = builder.select(builder.icmp_unsigned("<", k, last), k, last)
                    own = builder.load(builder.gep(firsts, [mine]))
                    slot = second_slot(k)
                    before = builder.load(builder.gep(seconds, [slot]))
                    after = builder.load(builder.gep(seconds, [builder.add(slot, kind(1))]))
                    chunk(k, own, before, after)

            one_block = builder.icmp_unsigned("==", blocks, kind(1))
            two_blocks = builder.icmp_unsigned("==", blocks, kind(2))
            with builder.if_else(one_block, likely=True) as (single, more):
                with single:
                    narrow = builder.icmp_unsigned("<=", h, kind(lanes // 2))
                    with builder.if_else(narrow) as (short, full):
                        with short:
                            in_registers(1, lanes // 2)
                        with full:
                            in_registers(1)
                with more:
                    with builder.if_else(two_blocks, likely=True) as (double, general):
                        with double:
                            narrow = builder.icmp_unsigned("<=", h, kind(lanes + lanes // 2))
                            with builder.if_else(narrow) as (short, full):
                                with short:
                                    in_registers(2, lanes // 2)
                                with full:
                                    in_registers(2)
                        with general:
                            in_slots()
            return context.get_dummy_value()

        return types.void(x, xr, o, orow, n, cos, sin, t, inverse), codegen

    return row
