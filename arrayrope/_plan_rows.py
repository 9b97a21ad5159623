"""The rows strategy: the CPU's one-thread row kernel on decode- and prefill-sized calls.

The kernel takes the arrays as they are (no flat views, no operand geometry), which a decode
step needs: its whole rotation takes less time than Python spends on a few attribute reads.
So the plan works out everything but the arrays themselves once, and runs as a closure over
constants. Because the plan's key fixes the Numba type of every argument (dtype, shape, strides
and flags of each array), it calls the kernel's compiled entry point for those types directly,
skipping the dispatcher's type resolution.

What depends on values and addresses the kernel checks before writing (every position is a row
of the cached table, x's memory does not meet out's) and reports back; the plan then grows the
table or hands the call to its general twin, which makes the one check of each and raises the
errors.
"""

import numpy as np

from . import _arrays, _positions
from ._arrays import NUMPY
from ._positions import ARRAY, INT, LIMIT, NONE
from ._spec import check_inverse
from .backends import module as backend_module

_INT64 = np.dtype(np.int64)
_F16 = np.dtype(np.float16)
FRESH, IN_PLACE, INTO_OUT = 0, 1, 2


def rows_plan(engine, xs, outs, kind, pos, general):
    """The rows plan of a checked call, or None where the call is not the row kernel's."""
    spec = engine.spec
    if spec.n_axes != 1 or spec.dynamic:
        return None
    if kind == ARRAY and (pos.dtype.kind not in "iu" or _arrays.family(pos) != NUMPY):
        return None
    cpu = backend_module("numba")
    if sum(x.size for x in xs) >= cpu.small_below():
        return None
    arrays = list(xs) + [o for o in outs or () if all(o is not x for x in xs)]
    if not all(_arrays.addressable(a, NUMPY) for a in arrays):
        return None
    patterns = []
    for x in xs:
        found = (False, 1)
        if kind == ARRAY:
            found = _positions.row_pattern(pos.shape, x.shape[:-1])
            if found is None:
                return None
        patterns.append(found)
    return RowsPlan(engine, xs, outs, kind, pos, patterns, general, cpu)


class RowsPlan:
    __slots__ = ("general", "kind", "tables", "rows", "table_source", "table_dtype", "cpu")
    __slots__ += ("highest_default", "rotate", "run", "launches", "cap", "row_at")
    __slots__ += ("past_cap",)

    def __init__(self, engine, xs, outs, kind, pos, patterns, general, cpu):
        self.general = general
        self.kind = kind
        self.cpu = cpu
        self.table_source = engine.freq_set(None).tables
        self.table_dtype = _arrays.compute_dtype(xs[0].dtype)
        self.cap = self.table_source.cap(self.table_dtype)
        self.row_at = None  # a decode step's row past the cap (set by _grow once one comes)
        # Once positions came past the cap, every call takes rows made for it (the cache's
        # values at any position) without first asking the kernel.
        self.past_cap = False
        self._set_tables(self.table_source.cached(np, None, self.table_dtype, 0))
        spec = engine.spec
        launches = []
        for t, (x, (flatten, repeat)) in enumerate(zip(xs, patterns)):
            out = None if outs is None else outs[t]
            mode = FRESH if out is None else IN_PLACE if out is x else INTO_OUT
            settings = cpu.settings(spec.rotary_dim, spec.half_style, False, repeat)
            default = _positions.defaults(x.shape[-2]).reshape(-1) if x.ndim > 1 else 0
            launches.append(self._launch(x, out, kind, pos, mode, flatten, default, settings))
        # default positions: each operand its own 0..T-1, the longest read in full
        self.highest_default = max(x.shape[-2] if x.ndim > 1 else 1 for x in xs) - 1
        self.launches = launches
        self.rotate = launches[0] if len(xs) == 1 else None
        self.run = self._operands(launches) if len(xs) == 2 else self._one(launches[0])

    def _set_tables(self, tables):
        self.tables, self.rows = tables, tables.shape[1]

    def _launch(self, x, out, kind, pos, mode, flatten, default, settings):
        """A closure rotating one operand: (x, pos, inverse, out, seq_len) -> result, or calls
        back into the plan where the kernel refused."""
        dtype, shape = x.dtype, x.shape
        # float16 and bfloat16 travel as their bits: Numba has no CPU half type
        bits = None if dtype.itemsize != 2 else np.int16 if dtype == _F16 else np.uint16
        empty = np.empty
        plan = self

        # Positions reach the kernel as C-order int64, so that the entry point's type holds for
        # every array of the key (a wrapped uint64 turns negative: refused, then reported).
        convert = kind == ARRAY and not (
            pos.dtype == _INT64 and (pos.ndim == 1 or flatten) and pos.flags.c_contiguous
        )

        def arguments(x, pos, out):
            if kind == INT:
                positions = pos
            elif kind == NONE:
                positions = default
            else:
                positions = pos.reshape(-1) if flatten else pos
                if convert:
                    positions = np.ascontiguousarray(positions, dtype=_INT64)
            if mode == FRESH:
                result = o = empty(shape, dtype)
                source = x
            elif mode == IN_PLACE:
                result = o = x
                source = None  # in place: the kernel's compile-time case
            else:
                result = o = out
                source = x
            if bits is not None:
                source = None if source is None else source.view(bits)
                o = o.view(bits)
            return result, source, o, positions

        _, *probe = arguments(x, pos if kind != INT else 0, out)
        kernel = self.cpu.rows_entry(*probe, self.tables, settings)

        if kind == INT:
            rotate = self._decode_step(kernel, mode, shape, dtype, settings, bits)
        else:

            def rotate(x, pos, inverse, out, seq_len):
                # arguments(), written out: a decode step is short enough to feel one more call
                if inverse is not False and inverse is not True:
                    inverse = check_inverse(inverse)
                if seq_len is not None:
                    _positions.seq_len_for(False, seq_len, 0)
                if plan.past_cap:
                    outs = None if out is None else (out,)
                    return plan._past_cap((x,), pos, inverse, outs, seq_len)[0]
                if kind == INT:
                    if not 0 <= pos < plan.rows:
                        return plan._grow(pos, (x,), pos, inverse, (out,), seq_len)[0]
                    positions = pos
                elif kind == NONE:
                    positions = default
                else:
                    positions = pos.reshape(-1) if flatten else pos
                    if convert:
                        positions = np.ascontiguousarray(positions, dtype=_INT64)
                if mode == FRESH:
                    result = o = empty(shape, dtype)
                    source = x
                elif mode == IN_PLACE:
                    result = o = x
                    source = None
                else:
                    result = o = out
                    source = x
                if bits is not None:
                    source = None if source is None else source.view(bits)
                    o = o.view(bits)
                status = kernel(source, o, positions, plan.tables, settings + inverse)
                if status:
                    outs = (out,)
                    return plan._refused(status, (x,), pos, positions, inverse, outs, seq_len)[0]
                return result

        rotate.arguments = arguments
        rotate.kernel = kernel
        rotate.settings = settings
        return rotate

    def _decode_step(self, kernel, mode, shape, dtype, settings, bits):
        """The launch of one operand at an int position (a decode step), one closure per kind
        of out: the general closure's tests of the kinds, written out of it."""
        plan = self
        empty = np.empty
        outside = self.cpu.POSITION_OUTSIDE_TABLE

        def checked(inverse, seq_len):
            if seq_len is not None:
                _positions.seq_len_for(False, seq_len, 0)
            return check_inverse(inverse)

        if mode == FRESH:

            def rotate(x, pos, inverse, out, seq_len):
                if (inverse is not False and inverse is not True) or seq_len is not None:
                    inverse = checked(inverse, seq_len)
                tables, p = plan.tables, pos
                if not 0 <= pos < plan.rows:
                    if plan.row_at is None or not plan.cap <= pos < LIMIT:
                        return plan._grow(pos, (x,), pos, inverse, (out,), seq_len)[0]
                    tables, p = plan.row_at(pos), 0
                result = empty(shape, dtype)
                if bits is None:
                    status = kernel(x, result, p, tables, settings + inverse)
                else:
                    o = result.view(bits)
                    status = kernel(x.view(bits), o, p, tables, settings + inverse)
                if status:
                    return plan._refused(outside, (x,), pos, pos, inverse, (out,), seq_len)[0]
                return result

        elif mode == IN_PLACE:

            def rotate(x, pos, inverse, out, seq_len):
                if (inverse is not False and inverse is not True) or seq_len is not None:
                    inverse = checked(inverse, seq_len)
                tables, p = plan.tables, pos
                if not 0 <= pos < plan.rows:
                    if plan.row_at is None or not plan.cap <= pos < LIMIT:
                        return plan._grow(pos, (x,), pos, inverse, (out,), seq_len)[0]
                    tables, p = plan.row_at(pos), 0
                o = x if bits is None else x.view(bits)
                if kernel(None, o, p, tables, settings + inverse):
                    return plan._refused(outside, (x,), pos, pos, inverse, (out,), seq_len)[0]
                return x

        else:

            def rotate(x, pos, inverse, out, seq_len):
                if (inverse is not False and inverse is not True) or seq_len is not None:
                    inverse = checked(inverse, seq_len)
                tables, p = plan.tables, pos
                if not 0 <= pos < plan.rows:
                    if plan.row_at is None or not plan.cap <= pos < LIMIT:
                        return plan._grow(pos, (x,), pos, inverse, (out,), seq_len)[0]
                    tables, p = plan.row_at(pos), 0
                if bits is None:
                    status = kernel(x, out, p, tables, settings + inverse)
                else:
                    o = out.view(bits)
                    status = kernel(x.view(bits), o, p, tables, settings + inverse)
                if status:
                    return plan._refused(status, (x,), pos, pos, inverse, (out,), seq_len)[0]
                return out

        return rotate

    def _one(self, launch):
        def run(xs, pos, inverse, outs, seq_len):
            return (launch(xs[0], pos, inverse, None if outs is None else outs[0], seq_len),)

        return run

    def _operands(self, launches):
        """q and k, each launched in turn. Everything that could stop a launch is settled
        before the first: the pairs of arrays that might share memory here (the general plan
        tells exactly), default positions against the table by the longest operand's, and
        given positions by the first launch, which reads the same values as the second."""
        plan = self

        def run(xs, pos, inverse, outs, seq_len):
            if inverse is not False and inverse is not True:
                inverse = check_inverse(inverse)
            if seq_len is not None:
                _positions.seq_len_for(False, seq_len, 0)
            if plan.past_cap:
                return plan._past_cap(xs, pos, inverse, outs, seq_len)
            if plan.kind == INT and not 0 <= pos < plan.rows:
                return plan._grow(pos, xs, pos, inverse, outs, seq_len)
            if plan.kind == NONE and plan.highest_default >= plan.rows:
                return plan._grow(plan.highest_default, xs, pos, inverse, outs, seq_len)
            if outs is not None and plan._may_share(xs, outs):
                return plan.general.run(xs, pos, inverse, outs, seq_len)
            tables = plan.tables
            results = []
            for t, launch in enumerate(launches):
                out = None if outs is None else outs[t]
                result, source, o, positions = launch.arguments(xs[t], pos, out)
                status = launch.kernel(source, o, positions, tables, launch.settings + inverse)
                if status:
                    if t:  # settled above: only a bug in arrayrope reaches this
                        raise AssertionError(f"arrayrope: the row kernel refused k ({status})")
                    return plan._refused(status, xs, pos, positions, inverse, outs, seq_len)
                results.append(result)
            return tuple(results)

        return run

    @staticmethod
    def _may_share(xs, outs):
        """Whether an out might share memory with an operand or the other out, short of being
        that operand (the general plan tells exactly)."""
        for i, out in enumerate(outs):
            for other in xs + outs[i + 1 :]:
                if other is not out and other.size and out.size and np.may_share_memory(out, other):
                    return True
        return False

    def _grow(self, high, xs, pos, inverse, outs, seq_len):
        """A position past the cached rows: grow the cache to it, or (past its cap) rotate by
        rows made for this call."""
        _positions.check_int(high)
        outs = None if outs is None or outs[0] is None else outs
        tables = self.table_source.cached(np, None, self.table_dtype, high)
        if tables is None:
            if self.row_at is None and self.kind == INT:
                self.row_at = self.table_source.row_at(self.table_dtype)
            self.past_cap = self.kind == ARRAY
            return self._past_cap(xs, pos, inverse, outs, seq_len)
        self._set_tables(tables)
        return self.run(xs, pos, inverse, outs, seq_len)

    def _past_cap(self, xs, pos, inverse, outs, seq_len):
        """Positions (checked) past the cache's cap: each operand's rows made for this call
        from the level tables (``CosSinTables.integer_rows``, the cache's values), and the
        kernel run on them with its positions numbered 0..R-1."""
        if len(xs) == 2 and outs is not None and self._may_share(xs, outs):
            return self.general.run(xs, pos, inverse, outs, seq_len)
        results = []
        for t, launch in enumerate(self.launches):
            out = None if outs is None else outs[t]
            result, source, o, positions = launch.arguments(xs[t], pos, out)
            if isinstance(positions, np.ndarray):
                rows = self.table_source.integer_rows(self.table_dtype, positions[:, None])
                if rows is None:  # the one check of the values, as the caller passed them
                    _positions.check_values(np.asarray(pos))
                    raise AssertionError("arrayrope: positions refused, then accepted")
                local = _positions.defaults(positions.shape[0]).reshape(-1)
            else:
                rows = self.table_source.integer_rows(self.table_dtype, [[positions]])
                local = 0
            status = launch.kernel(source, o, local, rows, launch.settings + inverse)
            if status:
                if t:  # settled above: only a bug in arrayrope reaches this
                    raise AssertionError(f"arrayrope: the row kernel refused k ({status})")
                return self.general.run(xs, pos, inverse, outs, seq_len)
            results.append(result)
        return tuple(results)

    def _refused(self, status, xs, pos, positions, inverse, outs, seq_len):
        """The kernel wrote nothing: a position outside the table, or out's memory meeting
        x's. Decide with the one check of each: grow the table, or take the general plan."""
        if status == self.cpu.POSITION_OUTSIDE_TABLE:
            if self.kind == INT:
                return self._grow(pos, xs, pos, inverse, outs, seq_len)
            given = pos if self.kind == ARRAY else positions  # as the caller passed them
            _, _, high = _positions.check_values(np.asarray(given))
            return self._grow(high, xs, pos, inverse, outs, seq_len)
        outs = None if outs is None or outs[0] is None else outs
        return self.general.run(xs, pos, inverse, outs, seq_len)
