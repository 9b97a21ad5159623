"""The reference rotation, written with plain array operations.

It runs in the array's own namespace (NumPy or CuPy), stays readable on purpose, and is the test
oracle for every kernel as well as ``backend="numpy"``.
"""


def rotate_reference(xp, x, cos, sin, *, style, rotary_dim, inverse, out):
    """Rotate ``x`` by the tables ``cos``/``sin`` and write the result into ``out``.

    Parameters
    ----------
    x : array, shape (..., d)
    cos, sin : arrays broadcastable to ``x.shape[:-1] + (rotary_dim // 2,)``
        Already scaled by the attention scaling, float32 (float64 for float64 ``x``).
    style : "interleaved" or "half"
        Pairs (x[2i], x[2i+1]) or (x[i], x[i + rotary_dim/2]).
    inverse : bool
        Rotate by -angle (the transpose).
    out : array like ``x``; may be ``x`` itself.
    """
    half = rotary_dim // 2
    # Arithmetic in the table's dtype: float32, float64 for float64 input; half types round once.
    rot = x[..., :rotary_dim].astype(cos.dtype)
    if style == "interleaved":
        a, b = rot[..., 0::2], rot[..., 1::2]
    else:
        a, b = rot[..., :half], rot[..., half:]
    if inverse:
        sin = -sin
    new_a = a * cos - b * sin
    new_b = b * cos + a * sin
    if style == "interleaved":
        rotated = xp.stack([new_a, new_b], axis=-1).reshape(rot.shape)
    else:
        rotated = xp.concatenate([new_a, new_b], axis=-1)
    if out is not x:
        out[..., rotary_dim:] = x[..., rotary_dim:]
    out[..., :rotary_dim] = rotated.astype(out.dtype)
    return out


def launch(spec, operands, cos, sin, inverse):
    """The reference as a backend (``backend="numpy"``): the same contract as the kernels'
    launchers, each operand rotated with array operations in its own namespace."""
    from .. import _arrays
    from .._tables import gather

    for x, out, idx in operands:
        xp = _arrays.namespace_of(x)
        cos_rows, sin_rows = gather(xp, spec.pair_axis, cos, sin, idx)
        rotate_reference(
            xp,
            x,
            cos_rows,
            sin_rows,
            style=spec.style,
            rotary_dim=spec.rotary_dim,
            inverse=inverse,
            out=out,
        )
