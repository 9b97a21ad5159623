"""The parts of the public docstrings that several functions share, each written once.

A docstring names a shared part by a line holding only ``{name}``; :func:`filled` replaces the
line with the part, indented as the line was (the way SciPy's ``doccer`` fills its docstrings).
So ``help(arrayrope.rotate)`` and ``help(RoPE.rotate)`` each give the whole contract.
"""

import re

_PARTS = {
    # configuration (RoPE, and the module-level functions that build one)
    "base": """\
base : float
    The frequency base (``rope_theta`` in Hugging Face configs).""",
    "style": """\
style : {"interleaved", "half"}
    The pair layout. "interleaved" rotates pairs (x[2i], x[2i+1]): the block-diagonal matrix
    of RoFormer's Eq. 15, GPT-J, Meta's original Llama code, DeepSeek-V2/V3. "half" rotates
    pairs (x[i], x[i + rotary_dim/2]): GPT-NeoX and Hugging Face's ``rotate_half`` (Llama,
    Mistral, Qwen, Phi, Gemma).""",
    "rotary_dim": """\
rotary_dim : int, optional
    Rotate only the first ``rotary_dim`` features (even, <= head_dim; default head_dim). The
    rest pass through bit-identical (partial rotary: GPT-NeoX, Phi-2).""",
    "max_positions": """\
max_positions : int, optional
    Build the cache for positions 0..max_positions-1 at once, and never grow it (at most
    2**31: positions stop below it). By default
    the cache grows geometrically up to 32 MiB of tables. Positions past the cache take the
    same values from the level tables (72 KiB per rotated pair), never refused.""",
    "scaling": """\
scaling : a rule from :mod:`arrayrope.scaling`, optional
    Long-context frequency scaling; None is plain RoPE.""",
    "angles": """\
angles : {"exact", "transformers"}
    How the cos/sin tables are made. "exact" (the default): cos and sin of the float64 angle
    m * theta_i, rounded once, at every position. "transformers": as Hugging Face transformers
    makes them, frequencies, m * theta_i, cos and sin all in torch's float32 on the CPU, so
    a float32 rotation matches a transformers model's bit for bit (it differs from "exact" by
    up to about m * theta_i * 2**-23 radians at position m). Needs torch; every row is made
    by torch, so long positions cost more than in "exact" mode.""",
    # the operands and settings of a rotation
    "x": """\
x : array, shape (..., head_dim)
    float16, bfloat16 (ml_dtypes), float32 or float64: NumPy, CuPy, Dask, or any DLPack
    producer (a torch tensor, a JAX array). The leading axes may have any strides.""",
    "q, k": """\
q, k : arrays, shape (..., Hq, T, d) and (..., Hk, T, d)
    One dtype and array kind, as ``x`` of :meth:`RoPE.rotate`. They may differ in head count
    (grouped-query attention) and may be strided views into one fused QKV buffer.""",
    "pos": """\
pos : int, float, array or None
    Positions broadcastable to ``x.shape[:-1]`` (with a trailing axis of size n_axes for a
    multi-axis RoPE), integer or real, non-negative. (B, H, T, d) takes (T,) or (B, 1, T);
    (B, T, H, d) takes (T, 1) or (B, T, 1); packed (N, H, d) takes (N, 1); Hugging Face's
    (B, T) ``position_ids`` take ``head_axis``. A scalar puts every row there; None means
    0..T-1 along axis -2 (position 0 for a 1-D x). Integer positions read the cache;
    real-valued ones get exact float64 angles.""",
    "pos of q, k": """\
pos : int, float, array or None
    As ``pos`` of :meth:`RoPE.rotate`, broadcastable to both leading shapes; None gives each
    of q and k its own 0..T-1 along its axis -2.""",
    "inverse": """\
inverse : bool
    Rotate by -angle and scale as forward: ``attention_scaling * R(-m) x``, the transpose of
    the forward map, which is its backward pass. Without a scaling rule that sets
    attention_scaling it is also the exact undo; :meth:`RoPE.unrotate` is the undo for every
    rule.""",
    "out": """\
out : array like ``x``, optional
    Where to write the result (the caller's type, shape and dtype); ``out=x`` rotates in
    place. Without it ``x`` is never written.""",
    "out of q, k": """\
out : (q_out, k_out), optional
    Where to write; ``out=(q, k)`` rotates both in place. Without it neither is written.""",
    "head_axis": """\
head_axis : int, optional
    The axis of ``x`` that ``pos`` lacks, where ``pos`` gets an axis of size 1, as Hugging
    Face's ``unsqueeze_dim``: 1 for (B, H, T, d) and 2 for (B, T, H, d) with (B, T)
    positions. ``pos`` must then have every leading axis of ``x`` but that one.""",
    "head_axis of delta": """\
head_axis : int, optional
    The axis of ``x`` that ``delta`` lacks, where ``delta`` gets an axis of size 1, as for
    ``pos`` in :meth:`RoPE.rotate`.""",
    "head_axis of cos, sin": """\
head_axis : int, optional
    The axis of ``x`` that the tables' leading shape lacks, where it gets an axis of size 1, as
    Hugging Face's ``unsqueeze_dim``: 1 for (B, H, T, d) and 2 for (B, T, H, d) with (B, T,
    width) tables.""",
    "x of cos, sin": """\
x : array, shape (..., d)
    float16, bfloat16 (ml_dtypes), float32 or float64: NumPy, CuPy, or any DLPack producer (a
    torch tensor, a JAX array). The leading axes may have any strides.""",
    "backend": """\
backend : {"auto", "numba", "numpy", "cupy", "numba-cuda"}
    "auto" takes Numba for NumPy arrays and "cupy" for CuPy arrays; "numpy" is the readable
    array-operations reference, in the array's own namespace.""",
    "cos, sin": """\
cos, sin : arrays, shape C + (rotary_dim,) or C + (rotary_dim / 2,)
    The caller's tables, of x's array kind (NumPy, CuPy, or a DLPack producer), any float
    dtype. Width rotary_dim is transformers' layout, each pair's value at both of its features
    (``cat(f, f)`` for style "half", repeat-interleaved for "interleaved"; checked on the host);
    width rotary_dim / 2 holds one value per pair (flash-attn, vLLM, FlashInfer). C broadcasts
    against the leading shape as positions do: (T,) against (B, H, T, d); Hugging Face's (B, T)
    with ``head_axis``. Rounded once to x's compute dtype (float32; float64 for float64 x).
style : {"interleaved", "half"}
    The pair layout the tables were made for: required, since a table does not say it.
rotary_dim : int, optional
    Rotate the first rotary_dim features (default all); the rest pass through. Required for
    tables narrower than x, whose width alone does not tell the two layouts apart.""",
    "inverse of cos, sin": """\
inverse : bool
    Rotate by minus the tables' angles (sin negated), cos as given: the transpose.""",
    "seq_len": """\
seq_len : int, optional
    The current length for a length-dependent scaling rule (DynamicNTK, LongRoPE); by
    default max(pos) + 1. Other rules take none.""",
    # what a rotation gives back
    "returns": """\
array
    ``out``, or a new array of ``x``'s type, shape and dtype. Arithmetic is float32 (float64
    for float64 x); half types are rounded once, at the store.""",
    "returns of q, k": """\
(q_rot, k_rot) : arrays
    As :meth:`RoPE.rotate` returns for each: ``out``'s pair, or new arrays.""",
    "raises of a constructor": """\
RopeValueError, RopeTypeError
    An argument out of range or of the wrong type (sections that do not fit, for
    sectioned); the message names it and its value.""",
    "raises of a rule": """\
RopeValueError, RopeTypeError
    A field out of range or of the wrong type; the message names it and its value.""",
    "raises": """\
RopeValueError, RopeTypeError
    Bad input, named in the message with its value; nothing is written.
BackendUnavailableError
    The backend needs a package or device this process lacks.""",
}

_PLACEHOLDER = re.compile(r"^( *)\{([a-z_, ]+)\}$", re.MULTILINE)


def filled(obj):
    """Decorator: ``obj`` with each placeholder line of its docstring filled (see the module),
    and of its methods' where ``obj`` is a class. Docstrings stripped by ``python -OO`` stay
    None."""
    targets = [obj]
    if isinstance(obj, type):
        for value in vars(obj).values():
            targets.append(getattr(value, "__func__", value))
    for target in targets:
        if callable(target) and target.__doc__:
            target.__doc__ = _PLACEHOLDER.sub(_part, target.__doc__)
    return obj


def _part(match):
    indent, name = match.groups()
    return "\n".join(indent + line if line else line for line in _PARTS[name].splitlines())
