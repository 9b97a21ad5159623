"""cos/sin tables for one set of pair frequencies.

A table row p holds ``scale * cos(p * inv_freq[j])`` and ``scale * sin(...)`` for every rotated
pair j, of the float64 angle, rounded once to the table's dtype. Rows are indexed by integer
position; a multi-axis RoPE reads row ``pos[axis_of_pair[j]]`` for pair j, so one table serves
every layout.

Two kinds of table:
- the cache: rows 0..N-1, one per (device, dtype), built on first use and grown geometrically
  under a lock, so concurrent callers never see a half-built table and growth is never per call;
- per-call tables: one row per position entry of a call, for real-valued positions (from
  NumPy's cos and sin of the float64 angles) and for integer positions past the cache's cap.

Every integer row, cached or per call, comes from three small level tables by angle addition
(``backends.cpu._angles``): the same values at any position below 2**31, in memory that does
not grow with it, with no cos or sin per element. transformers' tables (``_hf_angles``) are
the exception: torch makes each of their rows.
"""

import math
import threading

import numpy as np

from ._cache import Bounded
from ._errors import RopeError, RopeValueError
from .scaling import plain_inv_freq

# Default cap on the cached rows: 32 MiB for cos and sin together. Larger positions take rows
# made per call from the level tables instead of growing a table that would dwarf the data it
# rotates.
DEFAULT_CACHE_BYTES = 32 << 20
_MIN_ROWS = 256
# Per-call rows from the level tables are filled on Numba's threads from this many pairs (rows
# times pairs): fewer cost less than a parallel launch.
PARALLEL_PAIRS = 1 << 15
# A decode step's rows past the cap (see step_rows) are kept for steps of at most this many
# tokens: a prefill's would hold megabytes for a call that is not repeated.
STEP_ROWS_KEPT = 256

# cache: level tables (72 KiB per pair) by their frequencies' bytes. RoPEs of the same
# frequencies share them (the layers of one model, a RoPE made anew per call): a build costs
# milliseconds, more than the small cache it starts. Kept when the launch configuration
# changes: it does not shape them. The lock makes one build per set, whichever RoPEs ask.
_shared_levels = Bounded(8, survives_config=True)
_shared_levels_lock = threading.Lock()


def _angles_to_tables(xp, angles, scale, dtype):
    """cos and sin stacked: shape (2,) + angles.shape, so ``cos, sin = tables`` unpacks them as
    views and a kernel call can take both as one argument."""
    # Angles are float64 and so are cos/sin; the cast to the table dtype is the only rounding,
    # which keeps position 10**6 as exact as position 10 (a float32 angle is off by ~0.06 rad).
    tables = xp.stack((xp.cos(angles), xp.sin(angles)))
    if scale != 1.0:
        tables *= scale
    return tables.astype(dtype, copy=False)


class FreqSet:
    """One set of pair frequencies with its attention scaling and cos/sin tables."""

    def __init__(self, inv_freq, pair_axis, attention_scaling, max_rows, tables=None):
        self.inv_freq = inv_freq
        self.attention_scaling = float(attention_scaling)
        self.tables = (tables or CosSinTables)(inv_freq, pair_axis, attention_scaling, max_rows)

    @classmethod
    def of(cls, blocks, scaling, selected, mode, pair_axis, max_rows, pick=None, source=None):
        """The set of a RoPE's frequency ``blocks`` ((features, base) runs, concatenated) under
        ``scaling`` at its ``selected`` length, handed to the pairs as ``pick`` says (see
        RoPE._setup), whose tables multiply into cos and sin what ``mode`` asks: the attention
        scaling ("rotate"), one ("shift": a pure rotation), or its inverse ("undo": the exact
        undo). ``source``: a module whose ``frequencies`` and ``HFTables`` make the frequencies
        and tables instead of arrayrope's own (``_hf_angles``, for ``angles="transformers"``)."""
        try:  # what the rule gives is checked below: numpy's overflow warnings are not wanted
            with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
                inv_freq, scale, tables = _frequencies(blocks, scaling, selected, source)
            inv_freq = np.asarray(inv_freq, dtype=np.float64)
            finite = np.isfinite(inv_freq).all()
        except RopeError:
            raise
        except (ArithmeticError, ValueError) as error:  # overflow, log(0), a float of a huge int
            why = f"{type(error).__name__}: {error}"
            raise RopeValueError(_no_frequencies(blocks, scaling, why)) from None
        if not finite or not (math.isfinite(scale) and scale > 0):
            raise RopeValueError(_no_frequencies(blocks, scaling, "not finite"))
        scale = {"rotate": scale, "shift": 1.0, "undo": 1.0 / scale}[mode]
        if pick is not None:
            sign, order = pick
            inv_freq = sign * inv_freq[list(order)]
        inv_freq = np.ascontiguousarray(inv_freq)
        return cls(inv_freq, pair_axis, scale, max_rows, tables)


def _frequencies(blocks, scaling, selected, source):
    """(inv_freq, attention scaling, the tables' class or None) of FreqSet.of."""
    if source is not None:
        inv_freq, scale = source.frequencies(blocks, scaling, selected)
        return inv_freq, scale, source.HFTables
    if scaling is None:
        return np.concatenate([plain_inv_freq(n, b) for n, b in blocks]), 1.0, None
    inv_freq, scale = scaling.frequencies(blocks, selected)
    return inv_freq, scale, None


def _no_frequencies(blocks, scaling, why):
    bases = sorted({base for _, base in blocks})
    rule = "" if scaling is None else f" under {scaling!r}"
    return (
        f"base {bases[0] if len(bases) == 1 else bases}{rule} gives no finite frequencies ({why})"
    )


class CosSinTables:
    """The cache and the exact tables of one frequency set.

    Parameters
    ----------
    inv_freq : float64 ndarray, shape (n_pairs,)
    pair_axis : int64 ndarray, shape (n_pairs,)
        The position axis each pair reads (all zero for 1-D RoPE).
    scale : float
        Attention scaling, multiplied into cos and sin.
    max_rows : int or None
        Cap on cached rows; None picks one from ``DEFAULT_CACHE_BYTES``.
    """

    # Whether kernels may make rows from the level tables (see level_arrays)
    filled = True

    def __init__(self, inv_freq, pair_axis, scale, max_rows=None):
        self.inv_freq = inv_freq
        self.pair_axis = pair_axis
        self.scale = float(scale)
        self.max_rows = max_rows
        self._tables = {}
        self._on_device = {}  # pair_axis and inv_freq per device, for exact rows there
        self._levels = None  # the level tables of integer_rows, built on first use
        self._lock = threading.RLock()  # the cache, and the level tables it is built from
        # dtypes whose decode steps have gone past the cap: their next steps make their rows
        # (integer_rows) before the launch (see _kv_step.step); only ever added to
        self.past_the_cap = set()
        self._step_rows = {}  # dtype -> (positions' bytes, rows): see step_rows

    def _cap(self, itemsize):
        if self.max_rows is not None:
            return self.max_rows
        return max(_MIN_ROWS, DEFAULT_CACHE_BYTES // (2 * itemsize * max(1, self.inv_freq.size)))

    def cached(self, xp, device, dtype, max_pos):
        """cos and sin stacked, shape (2, rows, n_pairs) with rows > max_pos, or None past the
        cap."""
        key = (device, dtype)
        tables = self._tables.get(key)
        if tables is not None and tables.shape[1] > max_pos:
            return tables
        cap = self._cap(np.dtype(dtype).itemsize)
        if max_pos >= cap:
            return None
        with self._lock:
            tables = self._tables.get(key)
            if tables is not None and tables.shape[1] > max_pos:
                return tables
            old = 0 if tables is None else tables.shape[1]
            if self.max_rows is not None:
                rows = cap  # a stated max_positions is built whole, once
            else:
                rows = min(cap, max(max_pos + 1, 2 * old, _MIN_ROWS))
            # the rows that positions past the cap get too: one formula for every integer
            tables = self._column(dtype, 0, rows)
            if xp is not np:
                tables = xp.asarray(tables)
            self._tables[key] = tables
            return tables

    def at_least(self, xp, device, dtype, rows):
        """The cache with at least ``rows`` rows (fewer at the cap), for positions whose largest
        value the host does not know (positions on a device): the kernels compute rows past
        it themselves."""
        rows = min(max(rows, 1), self.cap(dtype))
        return self.cached(xp, device, dtype, rows - 1)

    def cap(self, dtype):
        """The most rows the cache holds for tables of ``dtype``."""
        return self._cap(np.dtype(dtype).itemsize)

    def existing(self, device, dtype):
        """The cache as it is, or None: what a call being captured in a CUDA graph may read."""
        return self._tables.get((device, dtype))

    def integer_rows(self, dtype, positions):
        """cos and sin stacked, shape (2, R, n_pairs) of ``dtype`` on the host, for int64
        ``positions`` of shape (R, n_axes): the values the cache holds, at any position,
        from the level tables (about 72 KiB per pair, float64). None where a position is
        outside [0, 2**31)."""
        from .backends.cpu import _angles, _config

        found = self.level_arrays()
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        out = np.empty((2, positions.shape[0], self.inv_freq.size), dtype)
        if out[0].size >= PARALLEL_PAIRS and _config.threads_usable():
            fill = _angles.fill_rows_parallel
            valid = _config.run_parallel(fill, positions, *found, self.scale, out)
        else:
            valid = _angles.fill_rows(positions, *found, self.scale, out)
        return out if valid else None

    def step_rows(self, dtype, positions):
        """:meth:`integer_rows` of a step's int64 ``positions``, shape (N,), keeping the last
        step's rows per dtype where N is at most STEP_ROWS_KEPT: every layer of a decode step
        rotates at the same positions, and the layers after the first take the kept rows (never
        written; replaced whole, so threads read either step's)."""
        key = positions.tobytes()
        held = self._step_rows.get(dtype)
        if held is not None and held[0] == key:
            return held[1]
        rows = self.integer_rows(dtype, positions.reshape(-1, 1))
        if rows is not None and positions.shape[0] <= STEP_ROWS_KEPT:
            self._step_rows[dtype] = (key, rows)
        return rows

    def _column(self, dtype, first, rows):
        """The rows of positions first..first+rows-1 (checked by the caller) of a one-axis
        table, as :meth:`integer_rows` makes them: (2, rows, n_pairs) of ``dtype``."""
        from .backends.cpu import _angles

        _, inv_freq, levels = self.level_arrays()
        out = np.empty((2, rows, inv_freq.size), dtype)
        _angles.column_entry(out.dtype)(first, inv_freq, levels, self.scale, out)
        return out

    def row_at(self, dtype):
        """A function ``m -> rows``: :meth:`integer_rows` of the one position ``m`` (an int in
        [0, 2**31), checked by the caller) of a one-axis RoPE, shape (2, 1, n_pairs), with
        as little Python as a decode step affords. It keeps the last position's rows (never
        written once made): a decode step calls it once per layer at one position."""
        make = self._row_maker(dtype)
        last = [(-1, None)]  # (position, rows), replaced whole: threads read either pair

        def row_at(m):
            held = last[0]
            if held[0] == m:
                return held[1]
            rows = make(m)
            last[0] = (m, rows)
            return rows

        return row_at

    def _row_maker(self, dtype):
        """A function ``m -> rows`` making :meth:`row_at`'s rows anew."""
        from .backends.cpu import _angles

        _, inv_freq, levels = self.level_arrays()
        fill = _angles.column_entry(np.dtype(dtype))
        shape, scale, empty = (2, 1, inv_freq.size), self.scale, np.empty

        def make(m):
            rows = empty(shape, dtype)
            fill(m, inv_freq, levels, scale, rows)
            return rows

        return make

    def level_arrays(self):
        """(pair_axis, inv_freq, level tables) as the fill kernels take them, built once (the level
        tables shared with other RoPEs of the same frequencies: never written)."""
        found = self._levels
        if found is None:
            from .backends.cpu import _angles

            with self._lock:
                if self._levels is None:
                    inv_freq = np.ascontiguousarray(self.inv_freq, dtype=np.float64)
                    key = inv_freq.tobytes()
                    # inside self._lock; nothing holding _shared_levels_lock takes a table
                    # lock, so the two cannot deadlock
                    with _shared_levels_lock:
                        levels = _shared_levels.get(key)
                        if levels is None:
                            levels = _shared_levels.put(key, _angles.level_tables(inv_freq))
                    pair_axis = np.ascontiguousarray(self.pair_axis, dtype=np.int64)
                    self._levels = (pair_axis, inv_freq, levels)
                found = self._levels
        return found

    def level_bytes(self):
        """The memory of the level tables, built or not."""
        from .backends.cpu._angles import LEVEL_ROWS

        return 2 * LEVEL_ROWS * self.inv_freq.size * 8

    def exact(self, xp, dtype, positions):
        """cos and sin stacked, shape (2, R, n_pairs), for float64 ``positions`` of shape
        (R, n_axes)."""
        if xp is np:
            axis, inv_freq = self.pair_axis, self.inv_freq
        else:  # copied to each device once
            device = xp.cuda.Device().id
            found = self._on_device.get(device)
            if found is None:
                found = (xp.asarray(self.pair_axis), xp.asarray(self.inv_freq))
                found = self._on_device.setdefault(device, found)
            axis, inv_freq = found
        # C order, as the cached tables: fancy indexing may hand back a transposed layout,
        # which the kernels' vector loads along a row cannot use
        angles = xp.ascontiguousarray(positions[:, axis] * inv_freq)
        return _angles_to_tables(xp, angles, self.scale, dtype)


def gather(xp, pair_axis, cos, sin, idx):
    """cos and sin per pair for each position entry, shape idx.shape[:-1] + (n_pairs,):
    pair j of entry e reads row ``idx[e, pair_axis[j]]`` (``idx[e, 0]`` where idx has one
    column). Array operations in ``xp``, for the reference backend and ``cos_sin``."""
    pairs = pair_axis.shape[0]
    if idx.shape[-1] == 1:
        rows = xp.broadcast_to(idx, idx.shape[:-1] + (pairs,))
    else:
        rows = idx[..., xp.asarray(pair_axis)]
    columns = xp.arange(pairs)
    return cos[rows, columns], sin[rows, columns]


def checked_rows(tables, dtype, positions):
    """``tables.integer_rows`` of positions that ``_positions.check_values`` has checked."""
    rows = tables.integer_rows(dtype, positions)
    if rows is None:  # only a bug in arrayrope reaches this
        raise AssertionError("arrayrope: a position outside [0, 2**31) passed the check")
    return rows
