"""The module-level functions: ``rotate`` and ``rotate_qk`` on a RoPE shared per configuration."""

from . import _arrays
from ._cache import Bounded
from ._errors import RopeTypeError, RopeValueError
from .rope import RoPE

# The RoPEs the module-level functions share, by (head_dim, base, style, rotary_dim, scaling):
# a decode step finds its RoPE with one dictionary lookup.
_shared = Bounded(64)


def shared_rope(head_dim, base, style, rotary_dim, scaling):
    """The one RoPE per configuration that the module-level functions share."""
    key = (head_dim, base, style, rotary_dim, scaling)
    try:
        rope = _shared.get(key)
    except TypeError:  # an unhashable argument: let the constructor name it
        return RoPE(head_dim, base=base, style=style, rotary_dim=rotary_dim, scaling=scaling)
    if rope is None:
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


# The functions below find their RoPE with one lookup written out in each, and call its engine
# directly: a decode step is short enough to feel a helper call or RoPE.rotate's keywords.


def rotate(
    x,
    pos=None,
    *,
    base=10000.0,
    style="interleaved",
    rotary_dim=None,
    inverse=False,
    out=None,
    backend="auto",
    scaling=None,
    seq_len=None,
):
    """Rotate ``x`` (..., d) by rotary position embeddings; see :meth:`RoPE.rotate`.

    ``base``, ``style``, ``rotary_dim`` and ``scaling`` configure a RoPE of head_dim
    ``x.shape[-1]``; calls with one configuration share one RoPE and its cache.
    """
    try:
        rope = _shared.get((x.shape[-1], base, style, rotary_dim, scaling))
    except (AttributeError, IndexError, TypeError):  # the slow way below says what is wrong
        rope = None
    if rope is None:
        rope = shared_rope(_head_dim("x", x), base, style, rotary_dim, scaling)
    return rope._engine.rotate(x, pos, inverse, out, backend, seq_len)


def rotate_qk(
    q,
    k,
    pos=None,
    *,
    base=10000.0,
    style="interleaved",
    rotary_dim=None,
    inverse=False,
    out=None,
    backend="auto",
    scaling=None,
    seq_len=None,
):
    """Rotate queries and keys in one pass; returns (q_rot, k_rot). See :meth:`RoPE.rotate_qk`."""
    try:
        rope = _shared.get((q.shape[-1], base, style, rotary_dim, scaling))
    except (AttributeError, IndexError, TypeError):
        rope = None
    if rope is None:
        rope = shared_rope(_head_dim("q", q), base, style, rotary_dim, scaling)
    return rope._engine.rotate_qk(q, k, pos, inverse, out, backend, seq_len)
