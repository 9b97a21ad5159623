"""RoPE.rotate_into_cache for JAX arrays: the primitive ``arrayrope_rotate_into_cache``, whose
results are the rotated q and the two caches with the step's rows written.

JAX arrays cannot be written, so the step returns new caches: under jax.jit the lowering (an XLA
FFI call into ``_jax_ffi``'s handler, which runs the NumPy step on views of XLA's buffers) aliases
each cache operand to its result, so that XLA writes a donated cache in place
(``jax.jit(step, donate_argnums=...)``) and copies one that is not donated; an eager call copies
the caches. An inference step is neither differentiated nor batched: grad, jvp and vmap are
refused, each with the way out.

This module imports JAX: it is imported only once a JAX array reaches rotate_into_cache.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _arrays, _jax_ffi, _jax_ops, _jax_results, _kv_layout
from ._errors import BackendUnavailableError, RopeTypeError, RopeValueError
from ._kv_layout import check_layout

_KIND = "rotate_into_cache"
# Operands in order; pos, q_norm and k_norm are present where the call's entry says so.
_K_CACHE, _V_CACHE = 4, 5  # their operand indices, pos being an operand (else 3 and 4)

# The RoPEs whose steps were bound, by index: a call's entry names its RoPE by this index.
_ropes = []


def _rope_index(rope):
    for i, known in enumerate(_ropes):
        if known is rope:
            return i
    with _jax_ffi.lock:
        _ropes.append(rope)
        return len(_ropes) - 1


def _entry(call):
    """(RoPE index, position kind, scalar position, options, weights present, dtypes of the
    operands) of a call."""
    return _jax_ffi.calls[call][1:]


def _step(operands, out, k_cache, v_cache, call):
    """The NumPy step on ``operands`` (q, k, v, pos?, k_cache, v_cache, slots, q_norm?,
    k_norm?, as NumPy arrays), writing ``out`` and the caches (which already hold the caches
    given)."""
    index, kind, scalar, options, weights, _ = _entry(call)
    operands = list(operands)
    q, k, v = operands[:3]
    pos = operands.pop(3) if kind == "array" else scalar
    slots = operands[5]
    # JAX's integers are int32 unless x64 is on: int64 ones let a decode loop take the short
    # way (see _kv_step), and converting N of them costs next to nothing
    if kind == "array" and pos.dtype.kind in "iu":
        pos = pos.astype(np.int64)
    if slots.dtype.kind in "iu":
        slots = slots.astype(np.int64)
    q_norm, k_norm = (operands.pop(6) if present else None for present in weights)
    _ropes[index].rotate_into_cache(
        q, k, v, pos, k_cache, v_cache, slots, out=out, **dict(options), q_norm=q_norm,
        k_norm=k_norm,
    )  # fmt: skip


def _run(args, rets, entry):
    """The handler's work for one of this primitive's calls: views of XLA's buffers (the caches'
    results alias their operands)."""
    storage = [_jax_ffi.storage(dtype) for dtype in entry[-1]]
    # The operands are viewed as writable, though the step only reads them (it writes out and
    # the caches, and refuses any overlap with them): read-only ones would be aliased writable
    # on each step before the fused launch (see _fused_launch._step).
    operands = [_jax_ffi.view(args[i], *kinds, False) for i, kinds in enumerate(storage)]
    written = enumerate((0, *_caches(entry)))  # out has q's dtype, each cache its operand's
    out, k_cache, v_cache = (_jax_ffi.view(rets[i], *storage[j], False) for i, j in written)
    _step(operands, out, k_cache, v_cache, _jax_ffi.call_ids[entry])


def _caches(entry):
    """The operand indices of k_cache and v_cache in a call of ``entry``."""
    shift = 0 if entry[2] == "array" else 1
    return _K_CACHE - shift, _V_CACHE - shift


_jax_ffi.RUNNERS[_KIND] = _run


def _abstract(*avals, call):
    index, kind, _, options, _, _ = _entry(call)
    spec = _ropes[index]._spec
    k_at, v_at = _caches(_jax_ffi.calls[call])
    q, k, v = avals[:3]
    for name, aval in (("q", q), ("k", k), ("v", v)):
        if aval.ndim != 3 or aval.shape[-1] != spec.head_dim:
            raise RopeValueError(
                f"{name} must have shape (N, heads, head_dim={spec.head_dim}), got {aval.shape}"
            )
    return [
        jax.core.ShapedArray(q.shape, q.dtype),
        jax.core.ShapedArray(avals[k_at].shape, avals[k_at].dtype),
        jax.core.ShapedArray(avals[v_at].shape, avals[v_at].dtype),
    ]


def _eager(*args, call):
    """The primitive on concrete arrays: the NumPy step on copies of the caches."""
    k_at, v_at = _caches(_jax_ffi.calls[call])
    operands = [np.asarray(a) for a in args]
    out, k_cache, v_cache = (
        _arrays.empty_for_xla(operands[i].shape, operands[i].dtype) for i in (0, k_at, v_at)
    )
    k_cache[...], v_cache[...] = operands[k_at], operands[v_at]
    _step(operands, out, k_cache, v_cache, call)
    return [_jax_results.result(a) for a in (out, k_cache, v_cache)]


def _not_differentiated(primals, tangents, *, call):
    raise RopeTypeError(
        "rotate_into_cache is an inference step, which JAX does not differentiate here: "
        "rotate q and k with RoPE.rotate_qk (differentiable) and write the caches with .at[].set"
    )


def _not_batched(args, dims, *, call):
    raise RopeTypeError(
        "rotate_into_cache is not batched by vmap: its N axis already takes tokens of any "
        "batch; flatten the batch into it (and each token's slot into slots)"
    )


rotate_into_cache_p = Primitive("arrayrope_rotate_into_cache")
rotate_into_cache_p.multiple_results = True
rotate_into_cache_p.def_impl(_eager)
rotate_into_cache_p.def_abstract_eval(_abstract)
ad.primitive_jvps[rotate_into_cache_p] = _not_differentiated
batching.primitive_batchers[rotate_into_cache_p] = _not_batched


def _lowering(ctx, *args, call):
    k_at, v_at = _caches(_jax_ffi.calls[call])
    lower = jax.ffi.ffi_lowering(_jax_ffi.TARGET, operand_output_aliases={k_at: 1, v_at: 2})
    return lower(ctx, *args, call=call)


def _no_device_lowering(ctx, *args, call):
    raise BackendUnavailableError(
        "rotate_into_cache on JAX arrays runs on the CPU: under jit on a GPU, place the step on "
        "the CPU (jax.default_device(jax.devices('cpu')[0])), or pass CuPy arrays (through "
        "DLPack) or torch tensors"
    )


mlir.register_lowering(rotate_into_cache_p, _lowering, platform="cpu")
for _platform in ("cuda", "rocm"):
    mlir.register_lowering(rotate_into_cache_p, _no_device_lowering, platform=_platform)


def _check_shapes(rope, arrays, cache_layout):
    """The general way's checks of shapes, dtypes and the cache layout on ``arrays`` (q, k, v,
    k_cache, v_cache), before the call is traced: a refusal then is a RopeError here, not an
    error inside XLA's run of the call. They read only shapes and dtypes, so C-ordered
    stand-ins over one element carry them (never read)."""
    check_layout(cache_layout)

    def stand_in(a):
        a = jnp.asarray(a) if not hasattr(a, "shape") else a
        dtype = np.dtype(a.dtype)
        strides = np.cumprod((1, *a.shape[:0:-1]))[::-1] * dtype.itemsize
        return np.lib.stride_tricks.as_strided(np.empty(1, dtype), a.shape, tuple(strides))

    _kv_layout.checked_layout(
        rope.head_dim, *map(stand_in, arrays), None, cache_layout, _arrays.NUMPY
    )


def rotate_into_cache(rope, arrays, options):
    """(out, k_cache, v_cache) of ``rope.rotate_into_cache`` on ``arrays`` (q, k, v, pos,
    k_cache, v_cache, slots, out), some of them JAX arrays; ``options`` are its keyword
    arguments."""
    q, k, v, pos, k_cache, v_cache, slots, out = arrays
    if out is not None:
        raise RopeValueError(
            "out is not supported for JAX arrays, which are immutable: rotate_into_cache "
            "returns (out, k_cache, v_cache)"
        )
    _check_shapes(rope, (q, k, v, k_cache, v_cache), options["cache_layout"])
    kind, scalar, position = _jax_ops._positions(pos)
    weights = [options.pop(name) for name in ("q_norm", "k_norm")]
    operands = [jnp.asarray(a) for a in (q, k, v, *position, k_cache, v_cache, slots)]
    operands += [jnp.asarray(w) for w in weights if w is not None]
    for name, value in options.items():
        if name != "cache_layout" and value is not None and not np.isscalar(value):
            raise RopeTypeError(f"{name} must be a number for JAX arrays, got {value!r}")
    call = _jax_ffi.call_id(
        (_KIND, _rope_index(rope), kind, scalar, tuple(sorted(options.items())),
         tuple(w is not None for w in weights), tuple(np.dtype(a.dtype) for a in operands))
    )  # fmt: skip
    return tuple(rotate_into_cache_p.bind(*operands, call=call))
