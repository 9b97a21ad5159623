"""RoPE: one rotary-embedding configuration, its frequencies and its cos/sin caches."""

from __future__ import annotations

import threading
from typing import Any, TypeVar

import numpy as np

from ._cache import Bounded
from ._dispatch import Engine
from ._errors import RopeTypeError, RopeValueError
from ._spec import (
    Spec,
    axes_arg,
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
from .scaling import ScalingRule, plain_inv_freq

Array = TypeVar("Array")  # a NumPy, CuPy, Dask or DLPack array: results have its type
Positions = Any  # an int, a float, None, or an array of them (NumPy, CuPy, DLPack, Dask)
# What a frequency set's tables multiply into cos and sin: the attention scaling (rotate), one
# (shift: a pure rotation), or its inverse (unrotate: the exact undo).
_ROTATE, _SHIFT, _UNDO = "rotate", "shift", "undo"

_restored = Bounded(64)


def _restore(config):
    """The process-wide RoPE of a pickled configuration (see RoPE.__reduce__)."""
    rope = _restored.get(config)
    if rope is None:
        head_dim, rotary_dim, style, max_positions, scaling, blocks, pair_axis, base = config
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
        )
        rope = _restored.put(config, rope)
    return rope


class RoPE:
    """A configured rotary position embedding that owns its cos/sin cache.

    RoPE (Su et al., RoFormer, 2021) turns pair i of every query and key row at position m by
    the angle ``m * theta_i``, ``theta_i = base ** (-2 i / rotary_dim)``. Attention scores then
    depend on positions only through their difference.

    Parameters
    ----------
    head_dim : int
        Features per head, d (even). ``x.shape[-1]`` must equal it.
    base : float
        The frequency base (``rope_theta`` in Hugging Face configs).
    style : {"interleaved", "half"}
        The pair layout. "interleaved" rotates pairs (x[2i], x[2i+1]): the block-diagonal matrix
        of RoFormer's Eq. 15, GPT-J, Meta's original Llama code, DeepSeek-V2/V3. "half" rotates
        pairs (x[i], x[i + rotary_dim/2]): GPT-NeoX and Hugging Face's ``rotate_half`` (Llama,
        Mistral, Qwen, Phi, Gemma).
    rotary_dim : int, optional
        Rotate only the first ``rotary_dim`` features (even, <= head_dim; default head_dim). The
        rest pass through bit-identical (partial rotary: GPT-NeoX, Phi-2).
    max_positions : int, optional
        Build the cache for positions 0..max_positions-1 at once, and never grow it. By default
        the cache grows geometrically up to 32 MiB of tables. Positions past the cache take
        the same values from the level tables (72 KiB per rotated pair), never refused.
    scaling : a rule from :mod:`arrayrope.scaling`, optional
        Long-context frequency scaling; None is plain RoPE.

    Attributes
    ----------
    head_dim, rotary_dim, style, base, max_positions, scaling : as given
    n_axes : int
        Position components per token: 1, or the axes of :meth:`axial` and :meth:`sectioned`.

    Raises
    ------
    RopeValueError, RopeTypeError
        An argument out of range or of the wrong type; the message names it.
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
        )

    def _setup(self, head_dim, rotary_dim, style, base, max_positions, scaling, blocks, pair_axis):
        """Shared by every constructor: ``blocks`` lists (features, base) of the frequency runs
        that are concatenated into inv_freq; ``pair_axis`` gives each pair's position axis."""
        self.base = base
        if max_positions is not None:
            max_positions = int_arg("max_positions", max_positions, minimum=1)
        if scaling is not None:
            if not isinstance(scaling, ScalingRule):
                raise RopeTypeError(
                    "scaling must be a rule from arrayrope.scaling (Linear, NTK, DynamicNTK, "
                    f"YaRN, Llama3, LongRoPE) or None, got {scaling!r}"
                )
            scaling.check(blocks)
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.style = style
        self.max_positions = max_positions
        self.scaling = scaling
        self.n_axes = int(pair_axis.max()) + 1
        self._blocks = tuple(blocks)
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
        # A long-running length-dependent rule must not pile up tables: one set per length.
        self._sets = Bounded(64)
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
                if self.scaling is None:
                    inv_freq = np.concatenate([plain_inv_freq(n, b) for n, b in self._blocks])
                    scale = 1.0
                else:
                    inv_freq, scale = self.scaling.frequencies(self._blocks, key[0])
                scale = {_ROTATE: scale, _SHIFT: 1.0, _UNDO: 1.0 / scale}[mode]
                found = self._sets.put(
                    key,
                    FreqSet(
                        np.ascontiguousarray(inv_freq, dtype=np.float64),
                        self._spec.pair_axis,
                        scale,
                        self.max_positions,
                    ),
                )
        return found

    @classmethod
    def axial(
        cls,
        dims: tuple[int, ...],
        *,
        base: float = 10000.0,
        style: str = "interleaved",
        max_positions: int | None = None,
        scaling: ScalingRule | None = None,
    ) -> RoPE:
        """Multi-axis RoPE with per-axis frequencies (FLUX ``axes_dim``, 2-D ViT RoPE).

        Parameters
        ----------
        dims : sequence of even ints
            Features per axis, e.g. (16, 56, 56) for (time, row, column) with head_dim 128.
            Axis a's pairs turn at ``base ** (-2 i / dims[a])``.
        style : {"interleaved", "half"}
            "interleaved": axis a owns the contiguous features of its block (FLUX). "half": axis
            a owns pairs p..p+dims[a]/2 of the global half split, features j and j + head_dim/2.

        ``pos`` for rotate then has a trailing axis of size len(dims) (for one axis, plain
        positions: that is plain RoPE, bit for bit). Real-valued coordinates are exact.
        """
        dims = axes_arg("dims", dims)
        for i, n in enumerate(dims):
            if n < 2 or n % 2:
                raise RopeValueError(f"dims[{i}] must be even and >= 2, got {n}")
        base = base_arg(base)
        head_dim = sum(dims)
        rope = cls.__new__(cls)
        pair_axis = np.repeat(np.arange(len(dims), dtype=np.int64), [n // 2 for n in dims])
        rope._setup(
            head_dim,
            head_dim,
            style_arg(style),
            base,
            max_positions,
            scaling,
            blocks=[(n, base) for n in dims],
            pair_axis=pair_axis,
        )
        return rope

    @classmethod
    def sectioned(
        cls,
        head_dim: int,
        sections: tuple[int, ...],
        *,
        base: float = 10000.0,
        style: str = "half",
        assign: str = "contiguous",
        rotary_dim: int | None = None,
        max_positions: int | None = None,
        scaling: ScalingRule | None = None,
    ) -> RoPE:
        """Multi-axis RoPE with shared frequencies (Qwen2-VL M-RoPE, Qwen3-VL).

        Parameters
        ----------
        head_dim : int
        sections : sequence of ints
            Pairs per axis, e.g. (16, 24, 24) for (time, height, width) with head_dim 128;
            they sum to rotary_dim / 2. Frequencies run over the whole rotary_dim as in 1-D RoPE.
        assign : {"contiguous", "interleaved"}
            "contiguous" (Qwen2-VL): consecutive runs of pairs take time, height, width.
            "interleaved" (Qwen3-VL): pair j takes axis a = j mod n_axes (a >= 1) while
            j < n_axes * sections[a]; axis 0 takes every other pair.
        """
        head_dim, rotary_dim = dims_arg(head_dim, rotary_dim)
        sections = axes_arg("sections", sections)
        if any(n < 0 for n in sections):
            raise RopeValueError(f"sections must be >= 0 pairs each, got {sections}")
        pairs = rotary_dim // 2
        if sum(sections) != pairs:
            raise RopeValueError(
                f"sections {sections} sum to {sum(sections)} pairs; rotary_dim {rotary_dim} "
                f"has {pairs}"
            )
        n_axes = len(sections)
        if assign == "contiguous":
            pair_axis = np.repeat(np.arange(n_axes, dtype=np.int64), sections)
        elif assign == "interleaved":
            j = np.arange(pairs)
            pair_axis = np.zeros(pairs, dtype=np.int64)
            for a in range(1, n_axes):
                pair_axis[(j % n_axes == a) & (j < n_axes * sections[a])] = a
            counts = tuple(int((pair_axis == a).sum()) for a in range(n_axes))
            if counts != sections:
                raise RopeValueError(
                    f"sections {sections} cannot be interleaved over {pairs} pairs (each axis "
                    f"a >= 1 needs n_axes * sections[a] <= {pairs}); got counts {counts}"
                )
        else:
            raise RopeValueError(f"assign must be 'contiguous' or 'interleaved', got {assign!r}")
        base = base_arg(base)
        rope = cls.__new__(cls)
        rope._setup(
            head_dim,
            rotary_dim,
            style_arg(style),
            base,
            max_positions,
            scaling,
            blocks=[(rotary_dim, base)],
            pair_axis=pair_axis,
        )
        return rope

    @classmethod
    def from_hf_config(
        cls, config: Any, *, style: str | None = None, max_positions: int | None = None
    ) -> RoPE:
        """The RoPE a Hugging Face model config describes.

        Parameters
        ----------
        config : dict, path to config.json or to a model folder, or a config object
            A transformers config object is read through its attributes (its aliases apply:
            GPT-J's n_embd is hidden_size). Reads rope_theta (rotary_emb_base), rope_scaling or
            rope_parameters (rope_type/type: default, linear, dynamic, yarn, longrope, llama3;
            mrope_section for Qwen-VL), head_dim or hidden_size / num_attention_heads
            (qk_rope_head_dim for DeepSeek), partial_rotary_factor (rotary_pct) or rotary_dim
            (GPT-J, CodeGen), max_position_embeddings and original_max_position_embeddings.
        style : {"half", "interleaved"}, optional
            Overrides the pair style of the model family ("half" for Llama-lineage checkpoints,
            "interleaved" for DeepSeek-V2/V3, GPT-J, CodeGen, Cohere).
        max_positions : int, optional
            As in :class:`RoPE`.

        Returns
        -------
        RoPE

        Raises
        ------
        RopeValueError
            Unknown fields, fields that disagree (rope_theta and rotary_emb_base, hidden_size
            and n_embd, rotary_dim and a partial rotary factor), or an unknown family without
            ``style=``.
        """
        from ._hf_config import rope_from_hf_config

        return rope_from_hf_config(cls, config, style, max_positions)

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
        )
        return _restore, (config,)

    @property
    def inv_freq(self) -> np.ndarray:
        """theta_i of every pair, float64, shape (rotary_dim // 2,): the frequencies a scaling
        rule yields (for a length-dependent rule, those at short lengths). A copy."""
        return self._default.inv_freq.copy()

    @property
    def attention_scaling(self) -> float:
        """The factor a scaling rule multiplies into cos and sin (YaRN, LongRoPE), 1.0
        otherwise: :meth:`rotate` returns ``attention_scaling * R(m) x``."""
        return self._default.attention_scaling

    def __repr__(self):
        extra = "" if self.scaling is None else f", scaling={self.scaling!r}"
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
        x : array, shape (..., head_dim)
            float16, bfloat16 (ml_dtypes), float32 or float64: NumPy, CuPy, Dask, or any DLPack
            producer (a torch tensor, a JAX array). The leading axes may have any strides.
        pos : int, float, array or None
            Positions broadcastable to ``x.shape[:-1]`` (with a trailing axis of size n_axes
            for a multi-axis RoPE), integer or real, non-negative. (B, H, T, d) takes (T,) or
            (B, 1, T); (B, T, H, d) takes (T, 1) or (B, T, 1); packed (N, H, d) takes (N, 1);
            Hugging Face's (B, T) ``position_ids`` take ``head_axis``. A scalar puts every row
            there; None means 0..T-1 along axis -2 (position 0 for a 1-D x). Integer positions
            read the cache; real-valued ones get exact float64 angles.
        inverse : bool
            Rotate by -angle and scale as forward: ``attention_scaling * R(-m) x``, the
            transpose of the forward map, which is its backward pass. Without a scaling rule that
            sets attention_scaling it is also the exact undo; :meth:`unrotate` is the undo for
            every rule.
        out : array like ``x``, optional
            Where to write the result (the caller's type, shape and dtype); ``out=x`` rotates in
            place. Without it ``x`` is never written.
        head_axis : int, optional
            The axis of ``x`` that ``pos`` lacks, where ``pos`` gets an axis of size 1, as
            Hugging Face's ``unsqueeze_dim``: 1 for (B, H, T, d) and 2 for (B, T, H, d) with
            (B, T) positions. ``pos`` must then have every leading axis of ``x`` but that one.
        backend : {"auto", "numba", "numpy", "cupy", "numba-cuda"}
            "auto" takes Numba for NumPy arrays and "cupy" for CuPy arrays; "numpy" is the
            readable array-operations reference, in the array's own namespace.
        seq_len : int, optional
            The current length for a length-dependent scaling rule (DynamicNTK, LongRoPE); by
            default max(pos) + 1. Other rules take none.

        Returns
        -------
        array
            ``out``, or a new array of ``x``'s type, shape and dtype. Arithmetic is float32
            (float64 for float64 x); half types are rounded once, at the store.

        Raises
        ------
        RopeValueError, RopeTypeError
            Bad input, named in the message; ``x`` and ``out`` are left untouched.
        BackendUnavailableError
            The backend needs a package or device this process lacks.
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
        q, k : arrays, shape (..., Hq, T, d) and (..., Hk, T, d)
            One dtype and array kind. They may differ in head count (grouped-query attention)
            and may be strided views into one fused QKV buffer.
        pos : as in :meth:`rotate`
            Broadcastable to both leading shapes; None gives each its own 0..T-1 along its
            axis -2.
        out : (q_out, k_out), optional
            Where to write; ``out=(q, k)`` rotates both in place.
        inverse, head_axis, backend, seq_len : as in :meth:`rotate`

        Returns
        -------
        (q_rot, k_rot)

        Raises
        ------
        RopeValueError, RopeTypeError
            As :meth:`rotate`; nothing is written unless both are.
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
        out, head_axis, backend : as in :meth:`rotate`

        Returns
        -------
        array, as :meth:`rotate`.
        """
        if self._spec.dynamic and seq_len is None:
            raise RopeValueError(
                "shift needs seq_len for a length-dependent scaling rule: the length the rows "
                "were rotated at, which picks their frequencies"
            )
        delta, backward = signed(delta)
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

        Parameters are those of :meth:`rotate` (``seq_len`` as given to it, or max(pos) + 1).
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
        """
        return self._engine.cos_sin(pos, like, seq_len)
