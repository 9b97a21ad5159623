"""arrayrope's rotation as a JAX primitive, for JAX code under jit, grad, vjp, jvp, vmap and
eval_shape.

A traced JAX array has no memory to rotate: it is a placeholder in a program XLA compiles. So
the rotation is a primitive, ``arrayrope_rotate``, with the rules JAX asks of one: its result
shapes (abstract evaluation), its lowering (an XLA FFI custom call into ``_jax_ffi``'s handler,
which runs the same kernels as an eager call on views of XLA's buffers; on a GPU,
``jax.pure_callback`` of those kernels), its JVP (the rotation of the tangent: it is linear),
its transpose (the rotation by minus the angle with the same scale, which is not the undo under
YaRN or LongRoPE) and its batching rule. Concrete arrays outside any transform keep the direct
path.

The handler is ``_jax_ffi``'s. Each static part of a call (the RoPE's engine key, the kind and
value of scalar positions, inverse, backend, seq_len) is stored once in its registry and
reaches the handler as one integer attribute. Array positions are an operand; they are not
differentiated (a tangent on real-valued positions is refused).

This module imports JAX: it is imported only once a traced JAX array has been seen.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _arrays, _jax_ffi, _jax_results, _registry
from ._errors import RopeTypeError, RopeValueError
from ._jax_ffi import call_id as _call_id
from ._jax_ffi import calls as _calls
from ._positions import check_int, check_values

# The rotation's entries in _jax_ffi.calls: (engine key, operands, position kind, scalar position,
# inverse, backend, seq_len, dtype). Kinds: "array" (an operand), "int", "float", "none".


def _run(args, rets, call):
    """The handler's run of one of the rotation's entries (see _jax_ffi.RUNNERS): its kernels
    on views of XLA's buffers."""
    key, operands, kind, scalar, inverse, backend, seq_len, dtype = call
    dtype, bits = _jax_ffi.storage(dtype)
    xs = tuple(_jax_ffi.view(args[i], dtype, bits, True) for i in range(operands))
    outs = tuple(_jax_ffi.view(rets[i], dtype, bits, False, True) for i in range(operands))
    pos = _jax_ffi.position_view(args[operands]) if kind == "array" else scalar
    _registry.engine_of(key).run(xs, pos, inverse, outs, backend, seq_len)


_jax_ffi.RUNNERS["rotate"] = _run


def _abstract(*avals, call):
    key, operands, kind, *_ = _calls[call]
    spec = _registry.engine_of(key).spec
    for name, aval in zip(("x",) if operands == 1 else ("q", "k"), avals[:operands]):
        if aval.ndim == 0 or aval.shape[-1] != spec.head_dim:
            raise RopeValueError(
                f"{name}.shape[-1] must equal head_dim ({spec.head_dim}), got "
                f"{aval.shape[-1] if aval.ndim else 'a 0-d array'}"
            )
        if aval.dtype.name not in ("float16", "bfloat16", "float32", "float64"):
            raise RopeTypeError(
                f"{name} must be float16, bfloat16, float32 or float64, got dtype {aval.dtype}"
            )
    if kind == "array" and avals[operands].dtype.kind not in "iuf":
        raise RopeTypeError(
            f"pos must hold integers or real numbers, got dtype {avals[operands].dtype}"
        )
    return [jax.core.ShapedArray(a.shape, a.dtype) for a in avals[:operands]]


rotate_p = Primitive("arrayrope_rotate")
rotate_p.multiple_results = True
rotate_p.def_impl(lambda *args, call: _eager(args, call))
rotate_p.def_abstract_eval(_abstract)


def _on_host(*args, call):
    """The primitive's results as NumPy arrays, rotated by the CPU kernels from ``args`` (any
    arrays NumPy can read)."""
    key, operands, kind, scalar, inverse, backend, seq_len, dtype = _calls[call]
    xs = tuple(np.asarray(a) for a in args[:operands])
    pos = np.asarray(args[operands]) if kind == "array" else scalar
    outs = tuple(_arrays.empty_for_xla(x.shape, x.dtype) for x in xs)
    _registry.engine_of(key).run(xs, pos, inverse, outs, backend, seq_len)
    return outs


def _eager(args, call):
    """The primitive on concrete arrays (a transform of an eager call binds it so): the kernels
    on NumPy views, no XLA program."""
    return [_jax_results.result(o) for o in _on_host(*args, call=call)]


def _with(call, **changes):
    """The id of ``call`` with some of its fields changed."""
    key, operands, kind, scalar, inverse, backend, seq_len, dtype = _calls[call]
    fields = dict(key=key, operands=operands, kind=kind, scalar=scalar, inverse=inverse,
                  backend=backend, seq_len=seq_len, dtype=dtype)  # fmt: skip
    fields.update(changes)
    return _call_id(tuple(fields.values()))


def _jvp(primals, tangents, *, call):
    operands = _calls[call][1]
    if _calls[call][2] == "array" and type(tangents[operands]) is not ad.Zero:
        if jnp.issubdtype(primals[operands].dtype, jnp.floating):
            raise RopeValueError(
                "pos is differentiated: arrayrope differentiates with respect to x, not to "
                "the positions; pass jax.lax.stop_gradient(pos)"
            )
    out = rotate_p.bind(*primals, call=call)
    moving = [ad.instantiate_zeros(t) for t in tangents[:operands]]
    return out, rotate_p.bind(*moving, *primals[operands:], call=call)


def _transpose(cotangents, *args, call):
    operands = _calls[call][1]
    cts = [ad.instantiate_zeros(c) for c in cotangents]
    back = rotate_p.bind(*cts, *args[operands:], call=_with(call, inverse=not _calls[call][4]))
    return list(back) + [None] * (len(args) - operands)


def _batch(args, dims, *, call):
    key, operands, kind, scalar, *_ = _calls[call]
    n_axes = _registry.engine_of(key).spec.n_axes
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    xs = [
        jnp.broadcast_to(x, (size,) + x.shape) if d is None else jnp.moveaxis(x, d, 0)
        for x, d in zip(args[:operands], dims[:operands])
    ]
    rest = list(args[operands:])
    if kind == "array" and dims[operands] is not None:
        if operands == 2 and xs[0].ndim != xs[1].ndim:  # positions line up with each alone
            single = _with(call, operands=1)
            q = _batch([xs[0], rest[0]], [0, dims[operands]], call=single)[0][0]
            k = _batch([xs[1], rest[0]], [0, dims[operands]], call=single)[0][0]
            return [q, k], [0, 0]
        pos = jnp.moveaxis(rest[0], dims[operands], 0)
        per_example = pos.ndim - 1 - (n_axes > 1)
        lead = xs[0].ndim - 2
        if lead > per_example:
            pos = pos.reshape(pos.shape[:1] + (1,) * (lead - per_example) + pos.shape[1:])
        rest = [pos]
    elif kind == "none" and any(x.ndim == 2 for x in xs):
        if operands == 2 and xs[0].ndim != xs[1].ndim:  # each operand has its own default
            single = _with(call, operands=1)
            q = _batch([xs[0]], [0], call=single)[0][0]
            k = _batch([xs[1]], [0], call=single)[0][0]
            return [q, k], [0, 0]
        call = _with(call, kind="int", scalar=0)  # position 0 for a 1-D x, not 0..B-1
    return rotate_p.bind(*xs, *rest, call=call), [0] * operands


ad.primitive_jvps[rotate_p] = _jvp
ad.primitive_transposes[rotate_p] = _transpose
batching.primitive_batchers[rotate_p] = _batch
mlir.register_lowering(rotate_p, jax.ffi.ffi_lowering(_jax_ffi.TARGET), platform="cpu")


def _through_host(*args, call):
    """The primitive as ``jax.pure_callback`` of the CPU kernels: its lowering on a GPU, where
    there is no FFI handler. XLA copies the operands to the host and the results back."""
    results = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args[: _calls[call][1]]]
    return jax.pure_callback(functools.partial(_on_host, call=call), results, *args)


for _platform in ("cuda", "rocm"):
    mlir.register_lowering(
        rotate_p, mlir.lower_fun(_through_host, multiple_results=True), platform=_platform
    )


def _positions(pos):
    """(kind, scalar, operand) of ``pos``."""
    if pos is None:
        return "none", None, ()
    if isinstance(pos, bool):
        raise RopeTypeError(f"pos must be an int, a float, an array or None, got {pos!r}")
    if isinstance(pos, (int, np.integer)):  # scalars checked here, not in the run
        return "int", check_int(int(pos)), ()
    if isinstance(pos, (float, np.floating)):
        check_values(np.array([pos], np.float64))
        return "float", float(pos), ()
    if not hasattr(pos, "shape"):
        raise RopeTypeError(f"pos must be an int, a float, an array or None, got {pos!r}")
    return "array", None, (jnp.asarray(pos),)


def rotate(key, xs, pos, inverse, outs, backend, seq_len):
    """The rotated ``xs`` (one or two JAX arrays, at least one of the arguments traced)."""
    if outs is not None:
        raise RopeValueError(
            "out is not supported for JAX arrays, which are immutable: use the result"
        )
    if seq_len is not None and not isinstance(seq_len, (int, np.integer)):
        raise RopeTypeError(f"seq_len must be an int or None, got {seq_len!r}")
    kind, scalar, operand = _positions(pos)
    xs = tuple(jnp.asarray(x) for x in xs)
    if len(xs) == 2 and xs[0].dtype != xs[1].dtype:
        raise RopeTypeError(f"q and k must have one dtype, got {xs[0].dtype} and {xs[1].dtype}")
    call = _call_id(
        (key, len(xs), kind, scalar, bool(inverse), backend,
         None if seq_len is None else int(seq_len), np.dtype(xs[0].dtype))
    )  # fmt: skip
    return tuple(rotate_p.bind(*xs, *operand, call=call))
