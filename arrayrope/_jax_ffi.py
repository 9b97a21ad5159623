"""The XLA FFI handler that arrayrope's JAX primitives lower to on the CPU.

One ctypes callback, registered with ``jax.ffi.register_ffi_target`` as TARGET, serves every
primitive (``_jax_ops``'s rotation, ``_jax_given``'s apply_cos_sin, ``_jax_cache``'s step). A
lowered call carries one integer attribute: the index of its static entry in ``calls``, where
each distinct static call (the RoPE, the kind and value of scalar positions, flags, dtypes) is
stored once. The handler looks the entry up and runs it with ``RUNNERS[name](args, rets,
entry)``, name being the entry's first field where that is a string, else "rotate"; a runner
reads and writes XLA's buffers through NumPy views (:func:`view`).

This module imports JAX: it is imported only once a traced JAX array has been seen.
"""

import atexit
import ctypes
import functools
import math
import threading
import time

import jax
import numpy as np
from llvmlite import ir
from numba import cfunc, types
from numba.extending import intrinsic

from . import _arrays
from ._cache import Bounded

TARGET = "arrayrope_rotate"


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


def view(address, dtype, bits, read_only, result=False):
    """The XLA buffer whose descriptor is at ``address`` as a NumPy array (row-major, as XLA
    lays out custom-call operands by default) of ``dtype``. A ``result`` the kernel writes in
    full is first advised to huge pages (see _arrays.advise_huge_pages)."""
    buffer = _Buffer.from_address(address)
    data, shape = buffer.data or 0, tuple(buffer.dims[: buffer.rank])
    if result:
        _arrays.advise_huge_pages(data, math.prod(shape) * bits.itemsize)
    key = (data, shape, dtype, read_only)
    array = _views.get(key)
    if array is None:
        memory = _Memory()
        face = {"data": (data, read_only), "shape": shape, "typestr": bits.str, "version": 3}
        memory.__array_interface__ = face
        array = np.asarray(memory)
        array = _views.put(key, array if bits is dtype else array.view(dtype))
    return array


# Registry: every static part of a call, by its index. One entry per distinct static call, as jit
# keeps one program per one. The rotation's entries are its own (see _jax_ops); the other
# primitives' begin with their name. RUNNERS[name](args, rets, entry) runs one.
calls = []
call_ids = {}
RUNNERS = {}


lock = threading.Lock()


def call_id(call):
    """The index of ``call`` in ``calls``, added there if it is new."""
    found = call_ids.get(call)
    if found is None:
        with lock:
            found = call_ids.get(call)
            if found is None:
                found = call_ids[call] = len(calls)
                calls.append(call)
    return found


@functools.cache
def storage(dtype):
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
        call = calls[ctypes.cast(frame.attrs.attrs[0], _SCALAR).contents.value[0]]
        name = call[0] if isinstance(call[0], str) else "rotate"
        RUNNERS[name](frame.args.items, frame.rets.items, call)
        return None
    except BaseException as error:  # an exception must not cross into XLA
        message = f"arrayrope: {type(error).__name__}: {error}".encode()
        args = _ErrorArgs(ctypes.sizeof(_ErrorArgs), None, message, _INVALID_ARGUMENT)
        return frame.api.contents.error_create(ctypes.byref(args))


def position_view(address):
    """The read-only positions buffer at ``address`` as a NumPy array of its own dtype."""
    dtype = _POSITION_DTYPES[_Buffer.from_address(address).dtype]
    return view(address, dtype, dtype, True)


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
# The frame's and the error's addresses as integers, which the compiled entry passes through
_HANDLER = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_size_t)(
    lambda address: _handle(ctypes.cast(address, ctypes.POINTER(_CallFrame))) or 0
)


# The handler's entry, compiled: XLA runs a jitted program on its own threads, and may still run
# one that a script's last lines dispatched (its result never awaited) after the interpreter has
# begun to exit. A thread that then asks for the GIL to run Python never gets it, and XLA's
# shutdown waits for that thread forever. So the entry counts the calls inside Python in
# _STATE[1], and once _close (an atexit hook, run before JAX's own) has set _STATE[0], it returns
# at once without Python and without writing the results: no one reads them any more.
_STATE = np.zeros(2, np.int64)  # closing, calls inside Python


@intrinsic
def _atomic_add(typingctx, address, value):
    """Atomically add ``value`` to the int64 at ``address``; the value there before."""

    def codegen(context, builder, signature, args):
        pointer = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.atomic_rmw("add", pointer, args[1], "seq_cst")

    return types.int64(types.int64, types.int64), codegen


def _entry_for(state, handler):
    closing, running = state.ctypes.data, state.ctypes.data + 8

    @cfunc(types.uintp(types.uintp))  # XLA's void *(*)(XLA_FFI_CallFrame *)
    def entry(frame):
        if _atomic_add(closing, 0):
            return 0  # NULL: no error
        _atomic_add(running, 1)
        if _atomic_add(closing, 0):
            _atomic_add(running, -1)
            return 0
        result = handler(frame)
        _atomic_add(running, -1)
        return result

    return entry


_ENTRY = _entry_for(_STATE, _HANDLER)


def _close(timeout=60.0):
    """Stop the entry from running Python, and wait (GIL released) for the calls already in it."""
    _STATE[0] = 1
    deadline = time.monotonic() + timeout
    while _STATE[1] and time.monotonic() < deadline:
        time.sleep(0.001)


atexit.register(_close)
jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(_ENTRY.address), platform="cpu")
