"""The rows plan: the one-thread row kernel (``_decode``) on decode- and prefill-sized calls.

The kernel takes the arrays as they are (no flat views, no operand geometry), which a decode
step needs: its whole rotation takes less time than Python spends on a few attribute reads.
So the plan works out everything but the arrays themselves once. Because the plan's key fixes
what the kernel's build depends on (each array's dtype and rank), it calls the kernel's compiled
entry point directly, skipping the dispatcher's type resolution.

What depends on values and addresses the kernel checks before writing (every position is a row
of the cached table, x's memory does not meet out's) and reports as a status; ``_RETRY`` says
what the plan does then: grow the table, or hand the call to its general twin, which makes the
one check of each and raises the errors.
"""

import numba
import numpy as np

from ... import _arrays, _positions
from ..._arrays import NUMPY
from ..._positions import ARRAY, INT, LIMIT, NONE
from ..._spec import check_inverse
from . import _config
from ._decode import POSITION_OUTSIDE_TABLE, SPANS_OVERLAP, rows_kernel, settings

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
    if sum(x.size for x in xs) >= _config.CONFIG.small_below:
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
    return RowsPlan(engine, xs, outs, kind, pos, patterns, general)


def _loose(t):
    """Numba type ``t``, an array's as writable and of any layout (A)."""
    return t.copy(layout="A", readonly=False) if isinstance(t, numba.types.Array) else t


class Operand:
    """One operand's launch: how (x, pos, out) of a call become the kernel's arguments, and
    the kernel's compiled entry point for them."""

    __slots__ = ("kind", "mode", "shape", "dtype", "bits", "flatten", "convert", "default")
    __slots__ += ("settings", "kernel")

    def __init__(self, x, out, kind, pos, flatten, repeat, spec, tables):
        self.kind = kind
        self.mode = FRESH if out is None else IN_PLACE if out is x else INTO_OUT
        self.shape, self.dtype = x.shape, x.dtype
        # float16 and bfloat16 travel as their bits: Numba has no CPU half type
        dtype = x.dtype
        self.bits = None if dtype.itemsize != 2 else np.int16 if dtype == _F16 else np.uint16
        self.flatten = flatten
        # Positions reach the kernel as C-order int64, so that the entry point's type holds for
        # every array of the key (a wrapped uint64 turns negative: refused, then reported).
        self.convert = kind == ARRAY and not (
            pos.dtype == _INT64 and (pos.ndim == 1 or flatten) and pos.flags.c_contiguous
        )
        self.default = _positions.defaults(x.shape[-2]).reshape(-1) if x.ndim > 1 else 0
        # indexed by inverse (False, True)
        self.settings = tuple(
            settings(spec.rotary_dim, spec.half_style, inverse, repeat) for inverse in (0, 1)
        )
        _, *probe = self.arguments(x, pos if kind != INT else 0, out)
        # The entry point checks nothing: the caller promises that every later call passes x,
        # o and positions of these dtypes and ranks (the plan's key fixes them) and tables of
        # this type (always made C-contiguous). x, o and the positions are typed as writable
        # and of any layout, so that one build serves C-ordered and strided, read-only or
        # writable operands alike (the kernel reads each row as contiguous whatever the layout
        # and writes only o, which the call has checked is writable): a build per layout and
        # flag would multiply the compile time of a program that meets several.
        types = tuple(
            _loose(numba.typeof(a)) if i < 3 else numba.typeof(a)
            for i, a in enumerate(probe + [tables, self.settings[0]])
        )
        self.kernel = rows_kernel(probe[1].dtype).compile(types)

    def arguments(self, x, pos, out):
        """(result, x, out, positions) as the kernel takes them: x None in place, the half
        types as their bits. ``pos`` is an int position's table row where kind is INT."""
        kind = self.kind
        if kind == INT:
            positions = pos
        elif kind == NONE:
            positions = self.default
        else:
            positions = pos.reshape(-1) if self.flatten else pos
            if self.convert:
                positions = np.ascontiguousarray(positions, dtype=_INT64)
        mode = self.mode
        if mode == FRESH:
            result = o = np.empty(self.shape, self.dtype)
            source = x
        elif mode == IN_PLACE:
            result = o = x
            source = None  # in place: the kernel's compile-time case
        else:
            result = o = out
            source = x
        if self.bits is not None:
            source = None if source is None else source.view(self.bits)
            o = o.view(self.bits)
        return result, source, o, positions


class RowsPlan:
    """The plan of a call that the row kernel takes: one :class:`Operand` per operand (q and k
    launched in turn), the cached table they read and what to do when the kernel refuses."""

    __slots__ = ("general", "kind", "operands", "table_source", "table_dtype", "tables", "rows")
    __slots__ += ("cap", "row_at", "past_cap", "highest_default")

    def __init__(self, engine, xs, outs, kind, pos, patterns, general):
        self.general = general
        self.kind = kind
        self.table_source = engine.freq_set(None).tables
        self.table_dtype = _arrays.compute_dtype(xs[0].dtype)
        self.cap = self.table_source.cap(self.table_dtype)
        # a single position's row past the cap (set once one comes: by _grow for an int, by
        # _past_cap or rotate for a one-entry array)
        self.row_at = None
        # Once array positions came past the cap, every call takes rows made for it (the
        # cache's values at any position) without first asking the kernel.
        self.past_cap = False
        self._set_tables(self.table_source.cached(np, None, self.table_dtype, 0))
        self.operands = tuple(
            Operand(
                x, None if outs is None else outs[t], kind, pos, *pattern, engine.spec, self.tables
            )
            for t, (x, pattern) in enumerate(zip(xs, patterns))
        )
        # default positions: each operand its own 0..T-1, the longest read in full
        self.highest_default = max(x.shape[-2] if x.ndim > 1 else 1 for x in xs) - 1

    def _set_tables(self, tables):
        self.tables, self.rows = tables, tables.shape[1]

    def rotate(self, x, pos, inverse, out, seq_len):
        """:meth:`run` of one operand with no tuples built or unpacked: a decode step's whole
        rotation takes about as long as those."""
        if inverse is not False and inverse is not True:
            inverse = check_inverse(inverse)
        if seq_len is not None:
            _positions.seq_len_for(False, seq_len, 0)
        kind = self.kind
        if kind == INT:
            return self._step(x, pos, inverse, out, seq_len)
        if self.past_cap:
            one = pos.item() if pos.size == 1 else -1
            if 0 <= one < LIMIT:  # a decode step's one position, as an array
                if self.row_at is None:
                    self.row_at = self.table_source.row_at(self.table_dtype)
                return self._step(x, one, inverse, out, seq_len, pos)
            return self._past_cap((x,), pos, inverse, None if out is None else (out,), seq_len)[0]
        if kind == NONE and self.highest_default >= self.rows:
            return self.run((x,), pos, inverse, None if out is None else (out,), seq_len)[0]
        operand = self.operands[0]
        result, source, o, positions = operand.arguments(x, pos, out)
        status = operand.kernel(source, o, positions, self.tables, operand.settings[inverse])
        if status:
            outs = None if out is None else (out,)
            return _RETRY[status](self, (x,), pos, positions, inverse, outs, seq_len)[0]
        return result

    def _step(self, x, pos, inverse, out, seq_len, given=None):
        """:meth:`rotate` at an int position (a decode step), with Operand.arguments written
        out: one call fewer, which such a step feels. ``given``: the one-entry position array
        that ``pos`` came from, once array positions went past the cap (its row made, as
        :meth:`_past_cap` makes it)."""
        if given is not None:
            tables, at, pos = self.row_at(pos), _FIRST_ROW, given
        elif 0 <= pos < self.rows:
            tables, at = self.tables, pos
        elif self.row_at is not None and self.cap <= pos < LIMIT:
            tables, at = self.row_at(pos), 0
        else:
            return self.run((x,), pos, inverse, None if out is None else (out,), seq_len)[0]
        operand = self.operands[0]
        mode, bits = operand.mode, operand.bits
        if mode == FRESH:
            result = o = np.empty(operand.shape, operand.dtype)
        else:
            result = o = x if mode == IN_PLACE else out
        source = None if mode == IN_PLACE else x
        if bits is not None:
            source = None if source is None else source.view(bits)
            o = o.view(bits)
        status = operand.kernel(source, o, at, tables, operand.settings[inverse])
        if status:
            outs = None if out is None else (out,)
            return _RETRY[status](self, (x,), pos, at, inverse, outs, seq_len)[0]
        return result

    def run(self, xs, pos, inverse, outs, seq_len):
        """Rotate the operands ``xs`` (q and k, or one), into ``outs`` where given."""
        if inverse is not False and inverse is not True:
            inverse = check_inverse(inverse)
        if seq_len is not None:
            _positions.seq_len_for(False, seq_len, 0)
        if self.past_cap:
            return self._past_cap(xs, pos, inverse, outs, seq_len)
        tables, at = self.tables, pos
        kind = self.kind
        if kind == INT and not 0 <= pos < self.rows:
            if self.row_at is None or not self.cap <= pos < LIMIT:
                return self._grow(pos, xs, pos, inverse, outs, seq_len)
            tables, at = self.row_at(pos), 0
        elif kind == NONE and self.highest_default >= self.rows:
            return self._grow(self.highest_default, xs, pos, inverse, outs, seq_len)
        if len(xs) == 2 and outs is not None and _may_share(xs, outs):
            return self.general.run(xs, pos, inverse, outs, seq_len)
        results = []
        for t, operand in enumerate(self.operands):
            result, source, o, positions = operand.arguments(
                xs[t], at, None if outs is None else outs[t]
            )
            status = operand.kernel(source, o, positions, tables, operand.settings[inverse])
            if status:
                # Settled before the first launch: the pairs of arrays that might share memory
                # (above), default positions by the longest operand's, given positions by the
                # first launch, which reads the same values as the second.
                if t:
                    raise AssertionError(f"arrayrope: the row kernel refused k ({status})")
                return _RETRY[status](self, xs, pos, positions, inverse, outs, seq_len)
            results.append(result)
        return tuple(results)

    def _grow(self, high, xs, pos, inverse, outs, seq_len):
        """A position past the cached rows: grow the cache to it, or (past its cap) rotate by
        rows made for this call."""
        _positions.check_int(high)
        tables = self.table_source.cached(np, None, self.table_dtype, high)
        if tables is None:
            if self.kind == INT:
                if self.row_at is None:
                    self.row_at = self.table_source.row_at(self.table_dtype)
            else:
                self.past_cap = self.kind == ARRAY
            return self._past_cap(xs, pos, inverse, outs, seq_len)
        self._set_tables(tables)
        return self.run(xs, pos, inverse, outs, seq_len)

    def _past_cap(self, xs, pos, inverse, outs, seq_len):
        """Positions (checked) past the cache's cap: each operand's rows made for this call
        from the level tables (``CosSinTables.integer_rows``, the cache's values; a single
        position's by ``row_at``, which keeps the last one), and the kernel run on them with
        its positions numbered 0..R-1."""
        if len(xs) == 2 and outs is not None and _may_share(xs, outs):
            return self.general.run(xs, pos, inverse, outs, seq_len)
        results = []
        for t, operand in enumerate(self.operands):
            out = None if outs is None else outs[t]
            result, source, o, positions = operand.arguments(xs[t], pos, out)
            one = -1 if isinstance(positions, int) or positions.shape[0] != 1 else int(positions[0])
            if 0 <= one < LIMIT:
                # a decode step's one position: the last position's row is kept (see row_at)
                if self.row_at is None:
                    self.row_at = self.table_source.row_at(self.table_dtype)
                rows, local = self.row_at(one), _FIRST_ROW
            elif not isinstance(positions, int):
                rows = self.table_source.integer_rows(self.table_dtype, positions[:, None])
                if rows is None:  # the one check of the values, as the caller passed them
                    _positions.check_values(np.asarray(pos))
                    raise AssertionError("arrayrope: positions refused, then accepted")
                local = _positions.defaults(positions.shape[0]).reshape(-1)
            else:
                rows = self.table_source.integer_rows(self.table_dtype, [[positions]])
                local = 0
            status = operand.kernel(source, o, local, rows, operand.settings[inverse])
            if status:
                if t:  # settled above: only a bug in arrayrope reaches this
                    raise AssertionError(f"arrayrope: the row kernel refused k ({status})")
                return self.general.run(xs, pos, inverse, outs, seq_len)
            results.append(result)
        return tuple(results)

    def _outside(self, xs, pos, positions, inverse, outs, seq_len):
        """A position outside the table: grow it to the highest, after the one check of the
        values as the caller passed them."""
        if self.kind == INT:
            return self._grow(pos, xs, pos, inverse, outs, seq_len)
        given = pos if self.kind == ARRAY else positions
        _, _, high = _positions.check_values(np.asarray(given))
        return self._grow(high, xs, pos, inverse, outs, seq_len)

    def _general(self, xs, pos, positions, inverse, outs, seq_len):
        """x's memory meets out's: the general plan tells exact aliasing from overlap."""
        return self.general.run(xs, pos, inverse, outs, seq_len)


# The positions of one row of rows made for a call
_FIRST_ROW = np.zeros(1, np.int64)

# What the plan does with each status of a kernel that wrote nothing
_RETRY = {POSITION_OUTSIDE_TABLE: RowsPlan._outside, SPANS_OVERLAP: RowsPlan._general}


def _may_share(xs, outs):
    """Whether an out might share memory with an operand or the other out, short of being that
    operand (the general plan tells exactly)."""
    for i, out in enumerate(outs):
        for other in xs + outs[i + 1 :]:
            if other is not out and other.size and out.size and np.may_share_memory(out, other):
                return True
    return False
