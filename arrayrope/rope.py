"""RoPE: one rotary-embedding configuration, its frequencies and its cos/sin caches."""

from __future__ import annotations

import threading
from typing import Any, TypeVar

import numpy as np

from . import _constructors, _interop, _kv_cache, _positions
from ._cache import Bounded
from ._dispatch import Engine
from ._docs import filled
from ._errors import RopeTypeError, RopeValueError
from ._spec import (
    Spec,
    base_arg,
    dims_arg,
    frozen,
    int_arg,
    segments,
    signed,
    style_arg,
    with_head_axis,
)
from ._tables import FreqSet
from .scaling import ScalingRule

Array = TypeVar("Array")  # a NumPy, CuPy, Dask or DLPack array: results have its type
Positions = Any  # an int, a float, None, or an array of them (NumPy, CuPy, DLPack, Dask)
# The engines' modes: a frequency set's tables scale as FreqSet.of says for each
_ROTATE, _SHIFT, _UNDO = "rotate", "shift", "undo"

# cache: the RoPEs of unpickled configurations, by configuration; kept when the launch
# configuration changes, which does not shape their tables
_restored = Bounded(64, survives_config=True)


def _restore(config):
    """The process-wide RoPE of a pickled configuration (see RoPE.__reduce__)."""
    rope = _restored.get(config)
    if rope is None:
        head_dim, rotary_dim, style, max_positions, scaling, blocks, pair_axis, base = config[:8]
        pick = config[8] if len(config) > 8 else None  # pickles of earlier forms have neither
        angles = config[9] if len(config) > 9 else "exact"
        rope = RoPE.__new__(RoPE)
        rope._setup(
            head_dim,
            rotary_dim,
            style,
            base,
            max_positions,
            scaling,
            list(blocks),
            np.array(pair_axis, dtype=np.int64),
            pick,
            angles,
        )
        rope = _restored.put(config, rope)
    return rope


@filled
class RoPE:
    """A configured rotary position embedding that owns its cos/sin cache.

    RoPE (Su et al., RoFormer, 2021) turns pair i of every query and key row at position m by
    the angle ``m * theta_i``, ``theta_i = base ** (-2 i / rotary_dim)``. Attention scores then
    depend on positions only through their difference.

    Parameters
    ----------
    head_dim : int
        Features per head, d (even). ``x.shape[-1]`` must equal it.
    {base}
    {style}
    {rotary_dim}
    {max_positions}
    {scaling}
    {angles}

    Attributes
    ----------
    head_dim, rotary_dim, style, base, max_positions, scaling, angles : as given
    n_axes : int
        Position components per token: 1, or the axes of :meth:`axial` and :meth:`sectioned`.

    Raises
    ------
    {raises of a constructor}
    """

    def __init__(
        self,
        head_dim: int,
        *,
        base: float = 10000.0,
        style: str = "interleaved",
        rotary_dim: int | None = None,
        max_positions: int | None = None,
        scaling: ScalingRule | None = None,
        angles: str = "exact",
    ) -> None:
        head_dim, rotary_dim = dims_arg(head_dim, rotary_dim)
        base = base_arg(base)
        self._setup(
            head_dim,
            rotary_dim,
            style_arg(style),
            base,
            max_positions,
            scaling,
            blocks=[(rotary_dim, base)],
            pair_axis=np.zeros(rotary_dim // 2, np.int64),
            angles=angles,
        )

    def _setup(
        self, head_dim, rotary_dim, style, base, max_positions, scaling, blocks, pair_axis,
        pick=None, angles="exact",
    ):  # fmt: skip
        """Shared by every constructor: ``blocks`` lists (features, base) of the frequency runs
        that are concatenated into inv_freq (ceil(features / 2) pairs each, at exponents over
        ``features``); ``pair_axis`` gives each pair's position axis; ``pick`` = (sign, order),
        where given, makes pair j's frequency sign * (the blocks' frequencies)[order[j]]."""
        self.base = base
        if max_positions is not None:
            max_positions = int_arg("max_positions", max_positions, minimum=1)
            if max_positions > _positions.LIMIT:
                raise RopeValueError(
                    f"max_positions must be at most 2**31 (positions are below 2**31), got "
                    f"{max_positions}"
                )
        if scaling is not None:
            if not isinstance(scaling, ScalingRule):
                raise RopeTypeError(
                    "scaling must be a rule from arrayrope.scaling (Linear, NTK, DynamicNTK, "
                    f"YaRN, Llama3, LongRoPE, Proportional) or None, got {scaling!r}"
                )
            scaling.check(blocks)
        if not (isinstance(angles, str) and angles in ("exact", "transformers")):
            raise RopeValueError(f"angles must be 'exact' or 'transformers', got {angles!r}")
        self._source = None  # arrayrope's own frequencies and tables (see FreqSet.of)
        if angles == "transformers":
            from . import _hf_angles

            _hf_angles.torch_or_error()
            self._source = _hf_angles
        self.angles = angles
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.style = style
        self.max_positions = max_positions
        self.scaling = scaling
        self.n_axes = int(pair_axis.max()) + 1
        self._blocks = tuple(blocks)
        self._pick = pick
        self._spec = Spec(
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            style=style,
            half_style=style == "half",
            n_axes=self.n_axes,
            pair_axis=frozen(pair_axis),
            segments=frozen(segments(pair_axis)),
            dynamic=scaling is not None and scaling.dynamic,
        )
        # A long-running length-dependent rule must not pile up tables: one set per length. Kept
        # when the launch configuration changes: it does not shape the tables.
        self._sets = Bounded(64, survives_config=True)
        self._lock = threading.Lock()
        self._default = self._freq_set(None)
        self._engine = Engine(self._spec, self._freq_set, self, _ROTATE)
        self._engines = {_ROTATE: self._engine}

    def _engine_for(self, mode):
        """The engine whose tables carry ``mode``'s scale (see _SHIFT, _UNDO)."""
        engine = self._engines.get(mode)
        if engine is None:
            engine = Engine(self._spec, lambda seq_len: self._freq_set(seq_len, mode), self, mode)
            engine = self._engines.setdefault(mode, engine)
        return engine

    def _freq_set(self, seq_len, mode=_ROTATE):
        """The frequency set for a current sequence length (None: the short-length set)."""
        key = (None if self.scaling is None else self.scaling.select(seq_len), mode)
        found = self._sets.get(key)
        if found is not None:
            return found
        with self._lock:
            found = self._sets.get(key)
            if found is None:
                found = self._sets.put(
                    key,
                    FreqSet.of(
                        self._blocks, self.scaling, key[0], mode, self._spec.pair_axis,
                        self.max_positions, self._pick, self._source,
                    ),
                )  # fmt: skip
        return found

    axial = classmethod(_constructors.axial)
    sectioned = classmethod(_constructors.sectioned)
    from_hf_config = classmethod(_constructors.from_hf_config)
    from_hf_layers = classmethod(_constructors.from_hf_layers)
    rotate_into_cache = _kv_cache.rotate_into_cache

    def __reduce__(self):
        # The configuration only, and one RoPE per configuration per process on the way back:
        # the tasks of a Dask worker share one instance and its cos/sin cache instead of each
        # rebuilding the tables. Caches and the lock never travel.
        config = (
            self.head_dim,
            self.rotary_dim,
            self.style,
            self.max_positions,
            self.scaling,
            self._blocks,
            tuple(int(a) for a in self._spec.pair_axis),
            self.base,
            self._pick,
            self.angles,
        )
        return _restore, (config,)

    @property
    def inv_freq(self) -> np.ndarray:
        """theta_i of every pair, float64, shape (rotary_dim // 2,): the frequencies a scaling
        rule yields (for a length-dependent rule, those at short lengths); with
        ``angles="transformers"``, transformers' float32 values. A copy."""
        return self._default.inv_freq.copy()

    @property
    def attention_scaling(self) -> float:
        """The factor a scaling rule multiplies into cos and sin (YaRN, LongRoPE), 1.0
        otherwise: :meth:`rotate` returns ``attention_scaling * R(m) x``."""
        return self._default.attention_scaling

    def __repr__(self):
        extra = "" if self.scaling is None else f", scaling={self.scaling!r}"
        extra += "" if self.angles == "exact" else f", angles={self.angles!r}"
        if self._pick is not None:  # frequencies as a Hugging Face family hands them out
            sign, order = self._pick
            extra += ", turned the other way" if sign < 0 else ""
            extra += ", frequencies reordered" if list(order) != sorted(order) else ""
        return (
            f"RoPE(head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, base={self.base!r}, "
            f"style={self.style!r}, n_axes={self.n_axes}{extra})"
        )

    def rotate(
        self,
        x: Array,
        pos: Positions = None,
        *,
        inverse: bool = False,
        out: Array | None = None,
        head_axis: int | None = None,
        backend: str = "auto",
        seq_len: int | None = None,
    ) -> Array:
        """Rotate ``x`` by its positions: ``attention_scaling * R(m) x`` for each row.

        Parameters
        ----------
        {x}
        {pos}
        {inverse}
        {out}
        {head_axis}
        {backend}
        {seq_len}

        Returns
        -------
        {returns}

        Raises
        ------
        {raises}
        """
        if head_axis is not None:
            pos = with_head_axis(pos, head_axis, x, self.n_axes)
        return self._engine.rotate(x, pos, inverse, out, backend, seq_len)

    def rotate_qk(
        self,
        q: Array,
        k: Array,
        pos: Positions = None,
        *,
        inverse: bool = False,
        out: tuple[Array, Array] | None = None,
        head_axis: int | None = None,
        backend: str = "auto",
        seq_len: int | None = None,
    ) -> tuple[Array, Array]:
        """Rotate queries and keys by the same positions, in one call (one kernel launch for
        both, beyond decode sizes).

        Parameters
        ----------
        {q, k}
        {pos of q, k}
        {inverse}
        {out of q, k}
        {head_axis}
        {backend}
        {seq_len}

        Returns
        -------
        {returns of q, k}

        Raises
        ------
        {raises}
        """
        if head_axis is not None:
            pos = with_head_axis(pos, head_axis, q, self.n_axes)
        return self._engine.rotate_qk(q, k, pos, inverse, out, backend, seq_len)

    def shift(
        self,
        x: Array,
        delta: Positions,
        *,
        seq_len: int | None = None,
        out: Array | None = None,
        head_axis: int | None = None,
        backend: str = "auto",
    ) -> Array:
        """Move rows that :meth:`rotate` already rotated by ``delta`` positions.

        ``shift(rotate(k, m), delta)`` equals ``rotate(k, m + delta)`` for every scaling rule:
        it turns each pair by ``delta * theta_i`` and scales by nothing, since the rotated rows
        carry attention_scaling already. This is how a KV cache moves its keys (StreamingLLM-
        style eviction) without keeping them unrotated.

        Parameters
        ----------
        x : array, shape (..., head_dim)
            Rows rotated by this RoPE.
        delta : int, float or array
            The move, broadcastable like ``pos`` in :meth:`rotate`; negative moves back. An
            array's entries must share one sign.
        seq_len : int, optional
            For a length-dependent rule (DynamicNTK, LongRoPE): the length the rows were rotated
            at, which picks their frequencies. Required there; other rules take none.
        {out}
        {head_axis of delta}
        {backend}

        Returns
        -------
        {returns}

        Raises
        ------
        {raises}
        """
        if self._spec.dynamic and seq_len is None:
            raise RopeValueError(
                "shift needs seq_len for a length-dependent scaling rule: the length the rows "
                "were rotated at, which picks their frequencies"
            )
        delta, backward = signed(_interop.native_positions(delta))
        if head_axis is not None:
            delta = with_head_axis(delta, head_axis, x, self.n_axes)
        return self._engine_for(_SHIFT).rotate(x, delta, backward, out, backend, seq_len)

    def unrotate(
        self,
        x: Array,
        pos: Positions = None,
        *,
        seq_len: int | None = None,
        out: Array | None = None,
        head_axis: int | None = None,
        backend: str = "auto",
    ) -> Array:
        """The exact undo of :meth:`rotate`: ``unrotate(rotate(x, m), m)`` is ``x`` (to the
        dtype's rounding) for every scaling rule, attention_scaling divided out.

        Parameters
        ----------
        {x}
        pos : int, float, array or None
            The positions the rows were rotated at, as ``pos`` of :meth:`rotate`.
        seq_len : int, optional
            As given to :meth:`rotate` (by default max(pos) + 1).
        {out}
        {head_axis}
        {backend}

        Returns
        -------
        {returns}

        Raises
        ------
        {raises}
        """
        if head_axis is not None:
            pos = with_head_axis(pos, head_axis, x, self.n_axes)
        return self._engine_for(_UNDO).rotate(x, pos, True, out, backend, seq_len)

    def cos_sin(
        self, pos: Positions, like: Any = None, *, seq_len: int | None = None
    ) -> tuple[Any, Any]:
        """The cos and sin tables for ``pos``, attention scaling included.

        Parameters
        ----------
        pos : int, float or array, shape P (P + (n_axes,) for a multi-axis RoPE)
        like : array, optional
            Return arrays of its kind (NumPy, CuPy, or its framework's through DLPack), on its
            device, in its table dtype: float64 for float64, float32 otherwise (the default).
        seq_len : int, optional
            As in :meth:`rotate`.

        Returns
        -------
        (cos, sin), each of shape P + (rotary_dim // 2,)
            Pair j uses frequency ``inv_freq[j]`` (and, for a multi-axis RoPE, the position on
            its own axis).

        Raises
        ------
        RopeValueError, RopeTypeError
            Bad input, named in the message with its value.
        """
        return self._engine.cos_sin(pos, like, seq_len)
