"""RoPE: one rotary-embedding configuration, its frequencies and its cos/sin caches."""

import threading

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
    style_arg,
)
from ._tables import CosSinTables
from .scaling import ScalingRule, plain_inv_freq

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


class FreqSet:
    """One set of pair frequencies with its attention scaling and cos/sin tables."""

    def __init__(self, inv_freq, pair_axis, attention_scaling, max_rows):
        self.inv_freq = inv_freq
        self.attention_scaling = float(attention_scaling)
        self.tables = CosSinTables(inv_freq, pair_axis, attention_scaling, max_rows)


class RoPE:
    """A configured rotary position embedding that owns its cos/sin cache.

    Parameters
    ----------
    head_dim : int
        Features per head, d (even). ``x.shape[-1]`` must equal it.
    base : float
        The frequency base: pair i turns by ``theta_i = base ** (-2 i / rotary_dim)`` per position.
    style : {"interleaved", "half"}
        "interleaved" rotates pairs (x[2i], x[2i+1]): the block-diagonal matrix of RoFormer's
        Eq. 15, GPT-J, Meta's original Llama code. "half" rotates pairs (x[i], x[i + rotary_dim/2]):
        GPT-NeoX and Hugging Face Llama's ``rotate_half``.
    rotary_dim : int, optional
        Rotate only the first ``rotary_dim`` features (even, <= head_dim; default head_dim). The
        rest pass through bit-identical (partial rotary, as GPT-NeoX and Phi-2 use).
    max_positions : int, optional
        Build the cache for positions 0..max_positions-1 at once, and never grow it. By default
        the cache grows geometrically up to 32 MiB of tables. Positions past the cache are
        computed exactly per call, never refused.
    scaling : a rule from :mod:`arrayrope.scaling`, optional
        Long-context frequency scaling; None is plain RoPE.

    Attributes
    ----------
    inv_freq : float64 ndarray, shape (rotary_dim // 2,)
        theta_i of every pair (for length-dependent scaling, the frequencies at short lengths).
    attention_scaling : float
        The factor multiplied into cos and sin (1.0 without scaling).
    n_axes : int
        Position components per token (1 here; see :meth:`axial`, :meth:`sectioned`).
    """

    def __init__(
        self,
        head_dim,
        *,
        base=10000.0,
        style="interleaved",
        rotary_dim=None,
        max_positions=None,
        scaling=None,
    ):
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
        self._engine = Engine(self._spec, self._freq_set, self)

    def _freq_set(self, seq_len):
        """The frequency set for a current sequence length (None: the short-length set)."""
        key = None if self.scaling is None else self.scaling.select(seq_len)
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
                    inv_freq, scale = self.scaling.frequencies(self._blocks, key)
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
    def axial(cls, dims, *, base=10000.0, style="interleaved", max_positions=None, scaling=None):
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
        head_dim,
        sections,
        *,
        base=10000.0,
        style="half",
        assign="contiguous",
        rotary_dim=None,
        max_positions=None,
        scaling=None,
    ):
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
    def from_hf_config(cls, config, *, style=None, max_positions=None):
        """The RoPE a Hugging Face model config describes.

        Parameters
        ----------
        config : dict, path to config.json, or an object with those attributes
            Reads rope_theta (rotary_emb_base), rope_scaling or rope_parameters (rope_type/type:
            default, linear, dynamic, yarn, longrope, llama3; mrope_section for Qwen-VL),
            head_dim or hidden_size / num_attention_heads (qk_rope_head_dim for DeepSeek),
            partial_rotary_factor (rotary_pct), max_position_embeddings and
            original_max_position_embeddings.
        style : {"half", "interleaved"}, optional
            Overrides the pair style of the model family ("half" for Llama-lineage checkpoints,
            "interleaved" for DeepSeek-V2/V3, GPT-J, Cohere).

        Raises
        ------
        RopeValueError
            Unknown or inconsistent fields, an unknown family without ``style=``.
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
    def inv_freq(self):
        return self._default.inv_freq.copy()

    @property
    def attention_scaling(self):
        return self._default.attention_scaling

    def __repr__(self):
        extra = "" if self.scaling is None else f", scaling={self.scaling!r}"
        return (
            f"RoPE(head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, "
            f"style={self.style!r}, n_axes={self.n_axes}{extra})"
        )

    def rotate(self, x, pos=None, *, inverse=False, out=None, backend="auto", seq_len=None):
        """Rotate ``x`` by its positions.

        Parameters
        ----------
        x : float array, shape (..., head_dim)
            NumPy or CuPy; float16, bfloat16 (ml_dtypes), float32 or float64.
        pos : int or float array, int, float, or None
            Positions broadcastable to ``x.shape[:-1]`` (with a trailing axis of size n_axes for
            multi-axis RoPE). (B, H, T, d) takes (T,) or (B, 1, T); (B, T, H, d) takes (T, 1) or
            (B, T, 1); packed (N, H, d) takes (N, 1). A scalar puts every row there. None means
            0..T-1 along axis -2. Integer positions read the cache; real-valued positions get
            exact float64 angles.
        inverse : bool
            Rotate by -angle: the transpose, the exact undo (up to attention_scaling**2 when a
            scaling rule sets one) and the backward pass.
        out : array like ``x``, optional
            Where to write the result; ``out=x`` rotates in place. Without it ``x`` is untouched.
        backend : {"auto", "numba", "numpy", "cupy", "numba-cuda"}
        seq_len : int, optional
            The current length for length-dependent scaling rules (default: max(pos) + 1).

        Returns
        -------
        array, the type, shape and dtype of ``x``.

        Raises
        ------
        RopeValueError, RopeTypeError
            Bad input; ``x`` and ``out`` are left untouched.
        BackendUnavailableError
            The backend needs a package or device this process lacks.
        """
        return self._engine.rotate(x, pos, inverse, out, backend, seq_len)

    def rotate_qk(self, q, k, pos=None, *, inverse=False, out=None, backend="auto", seq_len=None):
        """Rotate queries and keys by the same positions in one pass.

        ``q`` (..., Hq, T, d) and ``k`` (..., Hk, T, d) may differ in head count (grouped-query
        attention) and may be strided views into one fused QKV buffer; ``pos`` must broadcast
        against both leading shapes; None gives each its own 0..T-1 along its axis -2. ``out``
        is None or a pair (q_out, k_out). Returns (q_rot, k_rot). Other parameters as in
        :meth:`rotate`.
        """
        return self._engine.rotate_qk(q, k, pos, inverse, out, backend, seq_len)

    def cos_sin(self, pos, like=None, *, seq_len=None):
        """The cos and sin tables for ``pos``, attention scaling included.

        Parameters
        ----------
        pos : int or float positions, shape P (P + (n_axes,) for multi-axis RoPE)
        like : array, optional
            Return on its device (NumPy or CuPy) with its table dtype: float64 for float64,
            float32 otherwise (the default).

        Returns
        -------
        (cos, sin), each of shape P + (rotary_dim // 2,); pair j uses frequency ``inv_freq[j]``.
        """
        return self._engine.cos_sin(pos, like, seq_len)
