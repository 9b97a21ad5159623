"""apply_cos_sin for JAX code under jit, grad, vjp, jvp, vmap and eval_shape: the primitive
``arrayrope_apply_cos_sin``, lowered to the XLA FFI handler of ``_jax_ffi``, which runs the same
kernels as an eager call on XLA's buffers (on a GPU, to ``jax.pure_callback`` of those kernels).

y is bilinear in x and the tables (see ``_torch_given``): its JVP is the rotation of x's tangent
by the tables plus x turned by the tables' tangents (array operations, which JAX transposes
itself), and its transpose in x is the rotation with inverse flipped. A table in transformers'
layout is differentiated as transformers' formula reads it, each feature by its own entry.

This module imports JAX: it is imported only once a traced JAX array has been seen.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _arrays, _given, _jax_ffi, _jax_results
from ._errors import RopeTypeError, RopeValueError

_KIND = "apply_cos_sin"


def _entry(call):
    """(style, rotary_dim, inverse, head_axis, backend, dtypes of x, cos, sin) of a call."""
    return _jax_ffi.calls[call][1:]


def _with(call, **changes):
    style, rotary_dim, inverse, head_axis, backend, dtypes = _entry(call)
    fields = dict(style=style, rotary_dim=rotary_dim, inverse=inverse, head_axis=head_axis,
                  backend=backend, dtypes=dtypes)  # fmt: skip
    fields.update(changes)
    return _jax_ffi.call_id((_KIND,) + tuple(fields.values()))


def _rotate(x, cos, sin, out, call):
    style, rotary_dim, inverse, head_axis, backend, _ = _entry(call)
    _given.run((x,), cos, sin, style, rotary_dim, inverse, (out,), head_axis, backend, ("x",))


def _run(args, rets, entry):
    """The handler's work for one of this primitive's calls: views of XLA's buffers."""
    dtypes = entry[-1]
    x, cos, sin = (
        _jax_ffi.view(args[i], *_jax_ffi.storage(dtypes[i]), True) for i in range(3)
    )  # fmt: skip
    out = _jax_ffi.view(rets[0], *_jax_ffi.storage(dtypes[0]), False, True)
    _rotate(x, cos, sin, out, _jax_ffi.call_ids[entry])


_jax_ffi.RUNNERS[_KIND] = _run


def _abstract(x, cos, sin, *, call):
    style, rotary_dim, *_ = _entry(call)
    for name, aval in (("x", x), ("cos", cos), ("sin", sin)):
        if aval.dtype.name not in ("float16", "bfloat16", "float32", "float64"):
            raise RopeTypeError(
                f"{name} must be float16, bfloat16, float32 or float64, got dtype {aval.dtype}"
            )
    if cos.shape != sin.shape:
        raise RopeValueError(f"cos and sin must have one shape, got {cos.shape} and {sin.shape}")
    if cos.ndim == 0 or cos.shape[-1] not in (rotary_dim, rotary_dim // 2):
        raise RopeValueError(
            f"cos and sin must end in rotary_dim ({rotary_dim}) or rotary_dim / 2 "
            f"({rotary_dim // 2}), got shape {cos.shape}"
        )
    return jax.core.ShapedArray(x.shape, x.dtype)


def _on_host(x, cos, sin, *, call):
    """The primitive's result as a NumPy array, computed by the CPU kernels."""
    x, cos, sin = (np.asarray(a) for a in (x, cos, sin))
    out = _arrays.empty_for_xla(x.shape, x.dtype)
    _rotate(x, cos, sin, out, call)
    return out


def _eager(x, cos, sin, *, call):
    """The primitive on concrete arrays (a transform of an eager call binds it so)."""
    return _jax_results.result(_on_host(x, cos, sin, call=call))


def _through_host(x, cos, sin, *, call):
    """The primitive as ``jax.pure_callback`` of the CPU kernels: its lowering on a GPU (see
    _jax_ops._through_host)."""
    result = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.pure_callback(functools.partial(_on_host, call=call), result, x, cos, sin)


apply_p = Primitive("arrayrope_apply_cos_sin")
apply_p.def_impl(_eager)
apply_p.def_abstract_eval(_abstract)


def _pairs(style, rotary_dim):
    if style == "interleaved":
        return np.arange(0, rotary_dim, 2), np.arange(1, rotary_dim, 2)
    return np.arange(rotary_dim // 2), np.arange(rotary_dim // 2, rotary_dim)


def _turned(x, dc, ds, width, call):
    """x turned by tables' tangents ``dc``, ``ds`` (any values: a tangent need not be a
    rotation's), in array operations."""
    style, rotary_dim, inverse, head_axis, _, _ = _entry(call)
    if head_axis is not None:
        dc, ds = jnp.expand_dims(dc, head_axis), jnp.expand_dims(ds, head_axis)
    h = rotary_dim // 2
    if width == rotary_dim:  # per feature: first and second members of each pair
        if style == "half":
            ca, cb, sa, sb = dc[..., :h], dc[..., h:], ds[..., :h], ds[..., h:]
        else:
            ca, cb, sa, sb = dc[..., 0::2], dc[..., 1::2], ds[..., 0::2], ds[..., 1::2]
    else:
        ca = cb = dc
        sa = sb = ds
    sign = -1.0 if inverse else 1.0
    a, b = _pairs(style, rotary_dim)
    xa, xb = x[..., a], x[..., b]
    ya, yb = ca * xa - sign * sa * xb, cb * xb + sign * sb * xa
    # the pairs' members back in their places, as array operations JAX can transpose
    if style == "half":
        rotated = jnp.concatenate([ya, yb], -1)
    else:
        rotated = jnp.stack([ya, yb], -1).reshape(ya.shape[:-1] + (rotary_dim,))
    rest = jnp.zeros(x.shape[:-1] + (x.shape[-1] - rotary_dim,), rotated.dtype)
    return jnp.concatenate([rotated, rest], -1).astype(x.dtype)


def _jvp(primals, tangents, *, call):
    x, cos, sin = primals
    tx, tc, ts = tangents
    out = apply_p.bind(x, cos, sin, call=call)
    tangent = None
    if type(tx) is not ad.Zero:
        tangent = apply_p.bind(tx, cos, sin, call=call)
    if type(tc) is not ad.Zero or type(ts) is not ad.Zero:
        tc, ts = ad.instantiate_zeros(tc), ad.instantiate_zeros(ts)
        turned = _turned(x, tc, ts, cos.shape[-1], call)
        tangent = turned if tangent is None else tangent + turned
    return out, jnp.zeros_like(out) if tangent is None else tangent


def _transpose(ct, x, cos, sin, *, call):
    if ad.is_undefined_primal(cos) or ad.is_undefined_primal(sin):
        raise AssertionError("arrayrope: apply_cos_sin is linear in x alone")
    ct = ad.instantiate_zeros(ct)
    inverse = _entry(call)[2]
    return [apply_p.bind(ct, cos, sin, call=_with(call, inverse=not inverse)), None, None]


def _batch(args, dims, *, call):
    """The batch axis first on x and on batched tables; every table's head axis placed and its
    leading shape padded to x's, so that it still lines up with x."""
    x, cos, sin = args
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    x = jnp.broadcast_to(x, (size,) + x.shape) if dims[0] is None else jnp.moveaxis(x, dims[0], 0)
    head_axis = _entry(call)[3]
    lead = x.ndim - 1
    tables = []
    for t, dim in ((cos, dims[1]), (sin, dims[2])):
        batched = dim is not None
        if batched:
            t = jnp.moveaxis(t, dim, 0)
        if head_axis is not None:
            t = jnp.expand_dims(t, int(batched) + head_axis)
        own = t.shape[1:-1] if batched else t.shape[:-1]
        shape = (t.shape[0] if batched else 1,) + (1,) * (lead - 1 - len(own)) + own + t.shape[-1:]
        tables.append(t.reshape(shape))
    tables = jnp.broadcast_arrays(*tables)  # cos and sin of one shape, batched or not
    return apply_p.bind(x, *tables, call=_with(call, head_axis=None)), 0


ad.primitive_jvps[apply_p] = _jvp
ad.primitive_transposes[apply_p] = _transpose
batching.primitive_batchers[apply_p] = _batch
mlir.register_lowering(apply_p, jax.ffi.ffi_lowering(_jax_ffi.TARGET), platform="cpu")
for _platform in ("cuda", "rocm"):
    mlir.register_lowering(
        apply_p, mlir.lower_fun(_through_host, multiple_results=False), platform=_platform
    )


def apply_cos_sin(xs, cos, sin, style, rotary_dim, inverse, outs, head_axis, backend):
    """``apply_cos_sin``'s contract (see _api._apply) where a JAX array is traced.

    q and k are two binds of the primitive."""
    if outs is not None:
        raise RopeValueError(
            "out is not supported for JAX arrays, which are immutable: use the result"
        )
    xs = tuple(jnp.asarray(x) for x in xs)
    cos, sin = jnp.asarray(cos), jnp.asarray(sin)
    rotary_dim = xs[0].shape[-1] if rotary_dim is None else int(rotary_dim)
    if head_axis is not None:
        head_axis = int(head_axis) % xs[0].ndim  # an axis of x, counted from its front
    results = []
    for x in xs:
        dtypes = (np.dtype(x.dtype), np.dtype(cos.dtype), np.dtype(sin.dtype))
        call = _jax_ffi.call_id(
            (_KIND, style, rotary_dim, bool(inverse), head_axis, backend, dtypes)
        )
        results.append(apply_p.bind(x, cos, sin, call=call))
    return tuple(results)
