"""The module-level functions: ``rotate`` and ``rotate_qk`` on a RoPE shared per configuration,
and ``apply_cos_sin`` and ``apply_cos_sin_qk`` on the caller's tables."""

from __future__ import annotations

import numpy as np

from . import _arrays, _given, _interop, _registry
from ._cache import Bounded
from ._docs import filled
from ._errors import RopeTypeError, RopeValueError
from ._spec import base_arg, check_inverse, int_arg, style_arg, with_head_axis
from .backends import check_name
from .rope import Array, Positions, RoPE
from .scaling import ScalingRule

# The RoPEs the module-level functions share, by (head_dim, base, style, rotary_dim, scaling):
# a decode step finds its RoPE with one dictionary lookup. Kept when the launch configuration
# changes: it does not shape their tables.
_shared = Bounded(64, survives_config=True)
_NDARRAY = np.ndarray


def shared_rope(head_dim, base, style, rotary_dim, scaling):
    """The one RoPE per configuration that the module-level functions share."""
    key = (head_dim, base, style, rotary_dim, scaling)
    try:
        rope = _shared.get(key)
    except TypeError:  # an unhashable argument: let the constructor name it
        return RoPE(head_dim, base=base, style=style, rotary_dim=rotary_dim, scaling=scaling)
    if rope is None or (rotary_dim is not None and type(rotary_dim) is not int):
        # the constructor checks every argument (a float rotary_dim equal to an int's finds
        # that int's RoPE, and is refused here)
        rope = RoPE(head_dim, base=base, style=style, rotary_dim=rotary_dim, scaling=scaling)
        _shared.put(key, rope)
    return rope


def _head_dim(name, x):
    """x.shape[-1], checked enough to configure a RoPE by; the engine checks the rest."""
    shape = getattr(x, "shape", None)
    if not isinstance(shape, tuple) and hasattr(x, "__dlpack__"):
        from ._interop import adopt

        shape = adopt(name, x)[0].shape  # a producer with nothing but the DLPack protocol
    if not isinstance(shape, tuple):
        raise RopeTypeError(f"{name} must be {_arrays.ACCEPTED}, got {_arrays.describe(x)}")
    if len(shape) == 0:
        raise RopeValueError(f"{name} must have a feature axis (shape (..., d)), got a 0-d array")
    if shape[-1] % 2:
        raise RopeValueError(f"{name}.shape[-1] must be even, got {shape[-1]}")
    return shape[-1]


def _check_settings(base, style, rotary_dim, scaling):
    """Raise for settings that no head size makes valid (the rest waits for x's head size)."""
    style_arg(style)
    base_arg(base)
    if rotary_dim is not None:
        int_arg("rotary_dim", rotary_dim, minimum=2)
    if scaling is not None and not isinstance(scaling, ScalingRule):
        raise RopeTypeError(
            "scaling must be a rule from arrayrope.scaling (Linear, NTK, DynamicNTK, YaRN, "
            f"Llama3, LongRoPE, Proportional) or None, got {scaling!r}"
        )


_registry.hooks.update(check=_check_settings, shared=shared_rope)


# The functions below find their RoPE with one lookup written out in each, and call its engine
# directly: a decode step is short enough to feel a helper call or RoPE.rotate's keywords.


@filled
def rotate(
    x: Array,
    pos: Positions = None,
    *,
    base: float = 10000.0,
    style: str = "interleaved",
    rotary_dim: int | None = None,
    inverse: bool = False,
    out: Array | None = None,
    head_axis: int | None = None,
    backend: str = "auto",
    scaling: ScalingRule | None = None,
    seq_len: int | None = None,
) -> Array:
    """Rotate ``x`` by rotary position embeddings: ``attention_scaling * R(m) x`` for each row.

    ``base``, ``style``, ``rotary_dim`` and ``scaling`` configure a :class:`RoPE` of head_dim
    ``x.shape[-1]``; calls with one configuration share one RoPE and its cos/sin cache, as
    :meth:`RoPE.rotate` calls on it would.

    Parameters
    ----------
    {x}
    {pos}
    {base}
    {style}
    {rotary_dim}
    {inverse}
    {out}
    {head_axis}
    {backend}
    {scaling}
    {seq_len}

    Returns
    -------
    {returns}

    Raises
    ------
    {raises}

    Examples
    --------
    >>> import numpy as np, arrayrope as ar
    >>> q = np.ones((1, 2, 3, 4), np.float32)            # (B, H, T, d)
    >>> ar.rotate(q, style="half")[0, 0, 1]               # position 1
    array([-0.30116868,  0.9899502 ,  1.3817732 ,  1.0099498 ], dtype=float32)
    """
    if type(x) is not _NDARRAY and _torch_wanted(x)(x, pos, out):
        # torch traces this call: the RoPE is found outside the trace, the ops do the rest
        _head_dim("x", x)
        key = _interop.torch_shared_key(base, style, rotary_dim, scaling)
        if head_axis is not None:
            pos = with_head_axis(pos, head_axis, x, 1)
        return _interop.torch_rotate(key, x, pos, inverse, out, backend, seq_len)
    try:
        rope = _shared.get((x.shape[-1], base, style, rotary_dim, scaling))
    except (AttributeError, IndexError, TypeError):  # the slow way below says what is wrong
        rope = None
    if rotary_dim is not None and type(rotary_dim) is not int:
        rope = None  # 4.0 finds rotary_dim 4's RoPE; the constructor refuses it
    if rope is None:
        rope = shared_rope(_head_dim("x", x), base, style, rotary_dim, scaling)
    if head_axis is not None:
        return rope.rotate(x, pos, inverse=inverse, out=out, head_axis=head_axis,
                           backend=backend, seq_len=seq_len)  # fmt: skip
    return rope._engine.rotate(x, pos, inverse, out, backend, seq_len)


@filled
def rotate_qk(
    q: Array,
    k: Array,
    pos: Positions = None,
    *,
    base: float = 10000.0,
    style: str = "interleaved",
    rotary_dim: int | None = None,
    inverse: bool = False,
    out: tuple[Array, Array] | None = None,
    head_axis: int | None = None,
    backend: str = "auto",
    scaling: ScalingRule | None = None,
    seq_len: int | None = None,
) -> tuple[Array, Array]:
    """Rotate queries and keys by the same positions in one call (one kernel launch for both,
    beyond decode sizes).

    ``base``, ``style``, ``rotary_dim`` and ``scaling`` configure a :class:`RoPE` of head_dim
    ``q.shape[-1]``, shared with :func:`rotate` calls of the same configuration.

    Parameters
    ----------
    {q, k}
    {pos of q, k}
    {base}
    {style}
    {rotary_dim}
    {inverse}
    {out of q, k}
    {head_axis}
    {backend}
    {scaling}
    {seq_len}

    Returns
    -------
    {returns of q, k}

    Raises
    ------
    {raises}

    Examples
    --------
    >>> import numpy as np, arrayrope as ar
    >>> q, k = np.ones((1, 4, 3, 8), np.float32), np.ones((1, 2, 3, 8), np.float32)
    >>> q_rot, k_rot = ar.rotate_qk(q, k, style="half")
    >>> bool(np.allclose(q_rot[0, 0], k_rot[0, 0]))
    True
    """
    if type(q) is not _NDARRAY and _torch_wanted(q)(q, pos, out, k):
        _head_dim("q", q)
        key = _interop.torch_shared_key(base, style, rotary_dim, scaling)
        if head_axis is not None:
            pos = with_head_axis(pos, head_axis, q, 1)
        return _interop.torch_rotate_qk(key, q, k, pos, inverse, out, backend, seq_len)
    try:
        rope = _shared.get((q.shape[-1], base, style, rotary_dim, scaling))
    except (AttributeError, IndexError, TypeError):
        rope = None
    if rotary_dim is not None and type(rotary_dim) is not int:
        rope = None
    if rope is None:
        rope = shared_rope(_head_dim("q", q), base, style, rotary_dim, scaling)
    if head_axis is not None:
        return rope.rotate_qk(q, k, pos, inverse=inverse, out=out, head_axis=head_axis,
                              backend=backend, seq_len=seq_len)  # fmt: skip
    return rope._engine.rotate_qk(q, k, pos, inverse, out, backend, seq_len)


def _native(name, a, written=False):
    """(NumPy or CuPy view of ``a``, the function that hands a result back as ``a``'s type or
    None for a native array)."""
    if _arrays.family(a):
        return a, None
    native, back, read_only = _interop.adopt(name, a, written)
    if written and read_only:
        raise RopeValueError(
            f"{name} is read-only ({_arrays.describe(a)}); rotate into a writable array, or "
            "leave out unset"
        )
    return native, back


def _torch_wanted(x):
    """``_torch_ops.wanted`` for a torch tensor ``x`` once torch's operators are loaded (the
    function itself, for the guards: see ``_interop``), else ``_interop.torch_ops_wanted``,
    which loads them for a first torch tensor and says False for other arrays."""
    wanted = _interop.torch_wanted
    if wanted is None or type(x).__module__[:5] != "torch":
        return _interop.torch_ops_wanted
    return wanted


def _torch_traced(xs, cos, sin, outs):
    """Whether a call on torch tensors must go through the operator (``_torch_given``): torch
    traces, transforms or records it, for x, k, the tables or the outs."""
    if type(xs[0]).__module__[:5] != "torch":
        return False
    k = xs[1] if len(xs) == 2 else None
    return _interop.torch_ops_wanted(xs[0], cos, outs, k) or _interop.torch_ops_wanted(
        xs[0], sin, None
    )


def _apply(xs, cos, sin, style, rotary_dim, inverse, outs, head_axis, backend, names):
    """apply_cos_sin's one path: NumPy and CuPy arrays to the kernels (``_given.run``); torch
    tensors torch traces or differentiates, and traced JAX arrays, to their operators; other
    arrays viewed as NumPy or CuPy and handed back as their own type."""
    given = xs + (cos, sin) + (outs or ())
    if all(_arrays.family(a) for a in given):
        return _given.run(xs, cos, sin, style, rotary_dim, inverse, outs, head_axis, backend,
                          names)  # fmt: skip
    style, inverse = style_arg(style), check_inverse(inverse)
    if rotary_dim is not None:
        rotary_dim = int_arg("rotary_dim", rotary_dim, minimum=2)
    if head_axis is not None and (isinstance(head_axis, bool) or not isinstance(head_axis, int)):
        raise RopeTypeError(f"head_axis must be an int or None, got {head_axis!r}")
    check_name(backend)
    x = xs[0]
    _given.check_width(cos, getattr(x, "shape", (0,))[-1], rotary_dim, names[0])
    if len(xs) == 2 and getattr(xs[1], "dtype", None) != getattr(x, "dtype", None):
        raise RopeTypeError(f"q and k must share a dtype, got {x.dtype} and {xs[1].dtype}")
    if _torch_traced(xs, cos, sin, outs):
        from . import _torch_given

        return _torch_given.apply_cos_sin(xs, cos, sin, style, rotary_dim, inverse, outs,
                                          head_axis, backend)  # fmt: skip
    if any(_interop.is_dask(a) for a in xs):
        if outs is not None:
            raise RopeValueError("out is not supported for dask arrays (their results are lazy)")
        from . import _dask

        return _dask.apply_cos_sin_dask(apply_cos_sin, xs, cos, sin, style, rotary_dim, inverse,
                                        head_axis, backend, names)  # fmt: skip
    if _interop.jax_traced(*xs, cos, sin):
        from . import _jax_given

        return _jax_given.apply_cos_sin(xs, cos, sin, style, rotary_dim, inverse, outs,
                                        head_axis, backend)  # fmt: skip
    xs, restores = zip(*(_native(name, a) for name, a in zip(names, xs)))
    cos, sin = _native("cos", cos)[0], _native("sin", sin)[0]
    native_outs = None
    if outs is not None:
        names_out = ("out",) if len(outs) == 1 else ("out[0]", "out[1]")
        native_outs = tuple(_native(n, o, True)[0] for n, o in zip(names_out, outs))
    with _interop.framework_stream(given):
        results = _given.run(xs, cos, sin, style, rotary_dim, inverse, native_outs, head_axis,
                             backend, names)  # fmt: skip
    if outs is not None:
        return tuple(outs)  # written through their shared memory
    return tuple(r if back is None else back(r) for r, back in zip(results, restores))


@filled
def apply_cos_sin(
    x: Array,
    cos: Array,
    sin: Array,
    *,
    style: str,
    rotary_dim: int | None = None,
    inverse: bool = False,
    out: Array = None,
    head_axis: int | None = None,
    backend: str = "auto",
) -> Array:
    """Rotate ``x`` by cos and sin tables the caller computed: ``x * cos + rotate(x) * sin``
    pair by pair, in the kernels of :func:`rotate`.

    For tables from elsewhere: a reference model's own (transformers' ``position_embeddings``,
    to match its logits bit for bit), learned or hand-made frequencies.

    Parameters
    ----------
    {x of cos, sin}
    {cos, sin}
    {inverse of cos, sin}
    {out}
    {head_axis of cos, sin}
    {backend}

    Returns
    -------
    {returns}

    Raises
    ------
    {raises}

    Examples
    --------
    >>> import numpy as np, arrayrope as ar
    >>> x = np.ones((2, 3, 4, 8), np.float32)                  # (B, H, T, d)
    >>> angle = np.arange(4)[:, None] * 0.5 ** np.arange(4)    # (T, d/2)
    >>> y = ar.apply_cos_sin(x, np.cos(angle), np.sin(angle), style="half", rotary_dim=8)
    >>> bool(np.allclose(y, ar.rotate(x, np.arange(4), base=16.0, style="half")))
    True
    """
    return _apply((x,), cos, sin, style, rotary_dim, inverse, None if out is None else (out,),
                 head_axis, backend, ("x",))[0]  # fmt: skip


@filled
def apply_cos_sin_qk(
    q: Array,
    k: Array,
    cos: Array,
    sin: Array,
    *,
    style: str,
    rotary_dim: int | None = None,
    inverse: bool = False,
    out: tuple[Array, Array] | None = None,
    head_axis: int | None = None,
    backend: str = "auto",
) -> tuple[Array, Array]:
    """Rotate queries and keys by the same caller's tables, in one kernel launch for both:
    :func:`apply_cos_sin` of each.

    Parameters
    ----------
    {q, k}
    {cos, sin}
    {inverse of cos, sin}
    {out of q, k}
    {head_axis of cos, sin}
    {backend}

    Returns
    -------
    {returns of q, k}

    Raises
    ------
    {raises}
    """
    if out is not None and not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise RopeTypeError(f"out must be None or a pair (q_out, k_out), got {type(out).__name__}")
    return _apply((q, k), cos, sin, style, rotary_dim, inverse, None if out is None else tuple(out),
                 head_axis, backend, ("q", "k"))  # fmt: skip
