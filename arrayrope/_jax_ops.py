"""arrayrope's rotation as a JAX primitive, for JAX code under jit, grad, vjp, jvp, vmap and
eval_shape.

A traced JAX array has no memory to rotate: it is a placeholder in a program XLA compiles. So
the rotation is a primitive, ``arrayrope_rotate``, with the rules JAX asks of one: its result
shapes (abstract evaluation), its lowering (an XLA FFI custom call into a handler of this
module, which runs the same kernels as an eager call on views of XLA's buffers; on a GPU,
``jax.pure_callback`` of those kernels), its JVP (the rotation of the tangent: it is linear),
its transpose (the rotation by minus the angle with the same scale, which is not the undo under
YaRN or LongRoPE) and its batching rule. Concrete arrays outside any transform keep the direct
path.

The handler is a ctypes callback registered with ``jax.ffi.register_ffi_target`` on the CPU.
Each static part of a call (the RoPE's engine key, the kind and value of scalar positions,
inverse, backend, seq_len) is stored once in ``_calls`` and reaches the handler as one integer
attribute. Array positions are an operand; they are not differentiated (a tangent on real-valued
positions is refused).

This module imports JAX: it is imported only once a traced JAX array has been seen.
"""

import ctypes
import functools
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _arrays, _jax_results, _registry
from ._cache import Bounded
from ._errors import RopeTypeError, RopeValueError
from ._positions import check_int, check_values

_TARGET = "arrayrope_rotate"


# The parts of XLA's FFI C API (xla/ffi/api/c_api.h) that the handler reads or writes.
class _Extension(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("type", ctypes.c_int),  # 1: metadata
        ("next", ctypes.c_void_p),  # the next extension, which the handler never follows
    ]


class _Buffer(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("dtype", ctypes.c_int),
        ("data", ctypes.c_void_p),
        ("rank", ctypes.c_int64),
        ("dims", ctypes.POINTER(ctypes.c_int64)),
    ]


class _Items(ctypes.Structure):  # XLA_FFI_Args and XLA_FFI_Rets
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("size", ctypes.c_int64),
        ("types", ctypes.POINTER(ctypes.c_int)),
        ("items", ctypes.POINTER(ctypes.c_void_p)),
    ]


class _Attrs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("size", ctypes.c_int64),
        ("types", ctypes.POINTER(ctypes.c_int)),
        ("names", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(ctypes.c_void_p)),
    ]


class _Scalar(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int), ("value", ctypes.POINTER(ctypes.c_int64))]


class _Version(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("major", ctypes.c_int),
        ("minor", ctypes.c_int),
    ]


class _ErrorArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("message", ctypes.c_char_p),
        ("code", ctypes.c_int),
    ]


class _Api(ctypes.Structure):  # its first fields only: the handler calls Error_Create alone
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("api_version", _Version),
        ("internal_api", ctypes.c_void_p),
        ("error_create", ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_ErrorArgs))),
    ]


class _CallFrame(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.POINTER(_Extension)),
        ("api", ctypes.POINTER(_Api)),
        ("ctx", ctypes.c_void_p),
        ("stage", ctypes.c_int),  # 3: execute
        ("args", _Items),
        ("rets", _Items),
        ("attrs", _Attrs),
        ("future", ctypes.c_void_p),
    ]


class _Metadata(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("api_version", _Version),
        ("traits", ctypes.c_uint32),
    ]


class _MetadataExtension(ctypes.Structure):
    _fields_ = [("base", _Extension), ("metadata", ctypes.POINTER(_Metadata))]


_INVALID_ARGUMENT = 3
_SCALAR = ctypes.POINTER(_Scalar)


class _Memory:
    """An object NumPy views through the array interface: one XLA buffer."""

    __slots__ = ("__array_interface__",)


# cache: NumPy views of XLA buffers by (address, shape, dtype, read-only). A view owns no
# memory, so a kept one serves any later buffer at that address of that shape and dtype (a
# jitted loop's buffers come back at the same addresses: donated caches always do).
_views = Bounded(256)


def _view(address, dtype, bits, read_only, result=False):
    """The XLA buffer whose descriptor is at ``address`` as a NumPy array (row-major, as XLA
    lays out custom-call operands by default) of ``dtype``. A ``result`` the kernel writes in
    full is first advised to huge pages (see _arrays.advise_huge_pages)."""
    buffer = _Buffer.from_address(address)
    data, shape = buffer.data or 0, tuple(buffer.dims[: buffer.rank])
    if result:
        _arrays.advise_huge_pages(data, math.prod(shape) * bits.itemsize)
    key = (data, shape, dtype, read_only)
    view = _views.get(key)
    if view is None:
        memory = _Memory()
        face = {"data": (data, read_only), "shape": shape, "typestr": bits.str, "version": 3}
        memory.__array_interface__ = face
        view = np.asarray(memory)
        view = _views.put(key, view if bits is dtype else view.view(dtype))
    return view


# Registry: every static part of a call, by its index: (engine key, operands, position kind, scalar
# position, inverse, backend, seq_len, dtype). Kinds: "array" (an operand), "int", "float",
# "none". One entry per distinct static call, as jit keeps one program per one. Other primitives
# that lower to the same handler keep entries that begin with their name, and run them with
# RUNNERS[name](args, rets, entry).
_calls = []
_call_ids = {}
RUNNERS = {}


_lock = threading.Lock()


def _call_id(call):
    found = _call_ids.get(call)
    if found is None:
        with _lock:
            found = _call_ids.get(call)
            if found is None:
                found = _call_ids[call] = len(_calls)
                _calls.append(call)
    return found


@functools.cache
def _storage(dtype):
    """(dtype, the dtype its buffer is read as): the types NumPy's array interface does not name
    (bfloat16, float8) travel as unsigned bits of their size."""
    dtype = np.dtype(dtype)
    plain = dtype.kind in "biuf" and dtype.name != "bfloat16"
    return dtype, dtype if plain else np.dtype(f"u{dtype.itemsize}")


def _handle(frame_pointer):
    frame = frame_pointer.contents
    try:
        extension = frame.extension_start
        if extension and extension.contents.type == 1:  # XLA asks which API version this is
            metadata = ctypes.cast(extension, ctypes.POINTER(_MetadataExtension))
            metadata = metadata.contents.metadata.contents
            metadata.api_version.major = frame.api.contents.api_version.major
            metadata.api_version.minor = frame.api.contents.api_version.minor
            metadata.traits = 0
            return None
        if frame.stage != 3:
            return None
        call_id = ctypes.cast(frame.attrs.attrs[0], _SCALAR).contents.value[0]
        call = _calls[call_id]
        if isinstance(call[0], str):  # another primitive's call (see RUNNERS)
            RUNNERS[call[0]](frame.args.items, frame.rets.items, call)
            return None
        key, operands, kind, scalar, inverse, backend, seq_len, dtype = call
        dtype, bits = _storage(dtype)
        args = frame.args.items
        rets = frame.rets.items
        xs = tuple(_view(args[i], dtype, bits, True) for i in range(operands))
        outs = tuple(_view(rets[i], dtype, bits, False, True) for i in range(operands))
        if kind == "array":
            code = _Buffer.from_address(args[operands]).dtype
            pos = _view(args[operands], _POSITION_DTYPES[code], _POSITION_DTYPES[code], True)
        else:
            pos = scalar
        _registry.engine_of(key).run(xs, pos, inverse, outs, backend, seq_len)
        return None
    except BaseException as error:  # an exception must not cross into XLA
        message = f"arrayrope: {type(error).__name__}: {error}".encode()
        args = _ErrorArgs(ctypes.sizeof(_ErrorArgs), None, message, _INVALID_ARGUMENT)
        return frame.api.contents.error_create(ctypes.byref(args))


# XLA's data type codes of the position dtypes a buffer can hold.
_POSITION_DTYPES = {
    10: np.dtype(np.float16),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.uint8),
    7: np.dtype(np.uint16),
    8: np.dtype(np.uint32),
    9: np.dtype(np.uint64),
    11: np.dtype(np.float32),
    12: np.dtype(np.float64),
}
_HANDLER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_CallFrame))(_handle)


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


rotate_p = Primitive(_TARGET)
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
jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(_HANDLER), platform="cpu")
mlir.register_lowering(rotate_p, jax.ffi.ffi_lowering(_TARGET), platform="cpu")


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
