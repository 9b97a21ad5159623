"""The one place that knows array types: which family an array belongs to (NumPy, CuPy or
foreign), its namespace, the dtypes arrayrope computes in, the memory an array spans, overlap,
and whether a kernel can address an array as it is.

Asking never imports CuPy: an array is CuPy's only if CuPy is already loaded. The one
exception is the decode step's way in (``_api`` and ``Engine.rotate``), which tests
``type(x) is np.ndarray`` inline: a call to :func:`family` there costs a visible part of it.
"""

import ctypes
import functools
import math
import sys

import numpy as np

from ._cache import Bounded
from ._errors import RopeTypeError, RopeValueError

NUMPY, CUPY, FOREIGN = "numpy", "cupy", ""
ACCEPTED = "an array: NumPy, CuPy, Dask, or any DLPack producer (torch, JAX)"

# Arithmetic dtype per storage dtype: float32 for the half types (they round once, at the store)
# and float32, float64 for float64. Keyed by dtype object (hashing a dtype is cheap, its name is
# not); bfloat16 joins on first sight, so that asking never imports ml_dtypes.
_COMPUTE = {
    np.dtype(np.float16): np.dtype(np.float32),
    np.dtype(np.float32): np.dtype(np.float32),
    np.dtype(np.float64): np.dtype(np.float64),
}
_family_of_type = Bounded(256)


def family(a):
    """NUMPY, CUPY or FOREIGN for an object, cached per type."""
    kind = type(a)
    found = _family_of_type.get(kind)
    if found is None:
        cupy = sys.modules.get("cupy")
        if kind is np.ndarray or kind is np.memmap:
            found = NUMPY
        elif cupy is not None and issubclass(kind, cupy.ndarray):
            found = CUPY
        else:
            found = FOREIGN
        _family_of_type.put(kind, found)
    return found


def namespace(array_family):
    """The array module of a family: numpy or cupy."""
    return sys.modules["cupy"] if array_family == CUPY else np


def namespace_of(a):
    return namespace(family(a))


def describe(a):
    """The type of ``a`` as a message names it."""
    return f"{type(a).__module__}.{type(a).__name__}"


def compute_dtype(dtype):
    """The arithmetic (and cos/sin table) dtype for a storage dtype, or None if unsupported."""
    found = _COMPUTE.get(dtype)
    if found is None and dtype.name == "bfloat16" and dtype.itemsize == 2:
        found = _COMPUTE[dtype] = np.dtype(np.float32)
    return found


def check_float(name, a, head_dim):
    """Raise unless ``a`` (NumPy or CuPy) has a feature axis of ``head_dim`` and a dtype the
    kernels take."""
    if a.ndim == 0:
        raise RopeValueError(f"{name} must have a feature axis (shape (..., d)), got a 0-d array")
    if compute_dtype(a.dtype) is None:
        if not a.dtype.isnative and compute_dtype(a.dtype.newbyteorder("=")) is not None:
            raise RopeTypeError(
                f"{name} must be in native byte order, got dtype {a.dtype.str} "
                f"({name}.astype({name}.dtype.newbyteorder('=')) converts it)"
            )
        raise RopeTypeError(
            f"{name} must be float16, bfloat16, float32 or float64, got dtype {a.dtype}"
        )
    if a.shape[-1] != head_dim:
        raise RopeValueError(
            f"{name}.shape[-1] must equal head_dim ({head_dim}), got {a.shape[-1]}"
        )


def refuse_masked(name, a):
    """Raise where ``a`` is a NumPy masked array: its data would be read or written whole and
    its mask dropped."""
    if isinstance(a, np.ma.MaskedArray):
        raise RopeTypeError(
            f"{name} is a masked array (numpy.ma), whose mask arrayrope would ignore: pass "
            f"np.ma.getdata({name}) to use every element, or {name}.filled(value)"
        )


_read_size_t = ctypes.c_size_t.from_address


def _data_field():
    """The address of a NumPy array's data pointer field from the array object's own (the
    ``data`` member of PyArrayObject, right after the object header), where probes confirm it;
    else None. Reading it costs a tenth of building ``__array_interface__``, a dict, and a call
    reads up to four addresses (alignment, overlap)."""
    offset = object.__basicsize__
    base = np.zeros(8)
    probes = (base, base[3:], base[::-2], np.zeros((2, 3), np.float32).T)
    for a in probes:
        if _read_size_t(id(a) + offset).value != a.__array_interface__["data"][0]:
            return None
    return offset


_DATA_FIELD = _data_field()


def pointer(a, array_family):
    """The address of ``a``'s element 0."""
    if array_family == CUPY:
        return a.data.ptr
    if _DATA_FIELD is not None and type(a) is np.ndarray:
        return _read_size_t(id(a) + _DATA_FIELD).value
    return a.__array_interface__["data"][0]


def address(a):
    """The address of ``a[0, ..., 0]``, of a NumPy or CuPy array."""
    return pointer(a, family(a))


def is_host(a):
    """Whether ``a`` is a NumPy array (memmaps too)."""
    return family(a) == NUMPY


def addressable(a, array_family):
    """Whether every kernel can address ``a`` as it is: the feature axis contiguous, every
    stride of an axis longer than 1 a whole number of elements, and the data pointer aligned to
    the element size. Kernels index rows by element offsets and load elements with typed loads,
    which a GPU refuses at a misaligned address; other arrays go through a temporary."""
    if a.size == 0:
        return True
    item = a.itemsize
    if a.shape[-1] > 1 and a.strides[-1] != item:
        return False
    if array_family == NUMPY:
        return a.flags.aligned  # NumPy's test: the pointer and every stride that matters
    if pointer(a, array_family) % item:
        return False
    return all(s % item == 0 for n, s in zip(a.shape, a.strides) if n > 1)


def _misaligned(a):
    """Whether ``a`` is a non-empty CuPy array whose pointer or a stride of an axis longer than 1
    is off its element grid (NumPy takes such arrays; a GPU refuses a typed load there)."""
    if family(a) != CUPY or a.size == 0:
        return False
    item = a.itemsize
    return a.data.ptr % item != 0 or any(s % item for n, s in zip(a.shape, a.strides) if n > 1)


def _bytes(a):
    """A CuPy array's memory as uint8, one axis more for each element's bytes: a view whose
    loads and stores are aligned at any address."""
    cupy = sys.modules["cupy"]
    shape, strides = a.shape + (a.itemsize,), a.strides + (1,)
    return cupy.ndarray(shape, np.uint8, a.data, strides=strides)


def copy(a):
    """A fresh C-order copy of ``a``, aligned. A misaligned CuPy array is copied as bytes:
    CuPy's own copy loads elements with typed loads, which a GPU refuses off the element grid
    (CUDA_ERROR_MISALIGNED_ADDRESS, which also loses the context)."""
    if not _misaligned(a):
        return a.copy()
    fresh = sys.modules["cupy"].empty(a.shape, a.dtype)
    _bytes(fresh)[...] = _bytes(a)
    return fresh


def aligned(a):
    """``a``, or an aligned copy of a misaligned CuPy array (which CuPy's own operations fault
    on: see :func:`copy`)."""
    return copy(a) if _misaligned(a) else a


def empty_for_xla(shape, dtype):
    """A new C-order NumPy array whose data starts on a 64-byte boundary: XLA adopts such a
    CPU buffer without copying it (``jax.device_put``), where it copies any other."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + 64, np.uint8)
    skip = -raw.ctypes.data % 64
    return raw[skip : skip + nbytes].view(dtype).reshape(shape)


# Linux's madvise flag that asks for transparent huge pages, the size of one, and the smallest
# buffer NumPy asks them for (numpy/_core/src/multiarray/alloc.c): a first write into fresh
# memory then takes one page fault for each 2 MiB, not one for each 4 KiB.
_MADV_HUGEPAGE, _HUGE_PAGE, _HUGE_FROM = 14, 1 << 21, 1 << 22


@functools.cache
def _madvise():
    """libc's madvise, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


def advise_huge_pages(address, nbytes):
    """Ask Linux to back the whole huge pages inside ``nbytes`` at ``address`` with huge pages,
    as NumPy does for its own arrays of 4 MiB and more. For the results XLA gives a kernel to
    write in full: XLA maps a large one afresh for each call, so writing it in small pages costs
    more than the rotation (a page fault for each 4 KiB). Advice only: the contents stay.
    Returns whether the kernel took the advice (not off Linux, below 4 MiB, or on a kernel
    without transparent huge pages)."""
    madvise = _madvise() if nbytes >= _HUGE_FROM else None
    if madvise is None:
        return False
    start = -(-address // _HUGE_PAGE) * _HUGE_PAGE
    end = (address + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    return madvise(start, end - start, _MADV_HUGEPAGE) == 0


def ready(a, array_family, any_layout):
    """Whether a backend can take ``a`` as it is: every kernel where :func:`addressable`, a
    backend of array operations (``any_layout``) any array but a misaligned CuPy one."""
    return not _misaligned(a) if any_layout else addressable(a, array_family)


def assign(out, a):
    """``out[...] = a`` (one shape and dtype), as bytes where ``out`` or ``a`` is a misaligned
    CuPy array (see :func:`copy`)."""
    if family(out) == family(a) and (_misaligned(out) or _misaligned(a)):
        _bytes(out)[...] = _bytes(a)
    else:
        out[...] = a


def self_overlapping(a):
    """Whether two elements of ``a`` may share memory (a zero stride on an axis longer than 1,
    or strides that interleave): parallel writes to it would race. Conservative: axes sorted by
    stride, each must step past everything the smaller ones span."""
    if a.size <= 1:
        return False
    key = (a.shape, a.strides, a.itemsize)
    found = _interleaved.get(key)
    if found is None:
        found = _interleaved.put(key, _interleaves(*key))
    return found


_interleaved = Bounded(256)  # cache: self_overlapping by layout (a decode step's are the same)


def _interleaves(shape, strides, itemsize):
    axes = sorted((abs(s), n) for n, s in zip(shape, strides) if n > 1)
    reach = itemsize
    for stride, n in axes:
        if stride < reach:
            return True
        reach += (n - 1) * stride
    return False


def span(a):
    """[first byte, one past the last byte) of the memory ``a`` spans, from a[0, ..., 0]."""
    low = high = 0
    for n, s in zip(a.shape, a.strides):
        if s < 0:
            low += (n - 1) * s
        else:
            high += (n - 1) * s
    return low, high + a.itemsize


def extent(a, array_family):
    """[first byte, one past the last byte) of the memory ``a`` spans."""
    low, high = span(a)
    at = pointer(a, array_family)
    return at + low, at + high


def overlap_kind(a, b, array_family):
    """How the memory of two non-empty arrays meets: "none", "same" (one layout at one
    address: b is another view of a, so writing a into b is in place) or "partial"."""
    if array_family == NUMPY and not np.may_share_memory(a, b):
        return "none"
    (a_lo, a_hi), (b_lo, b_hi) = extent(a, array_family), extent(b, array_family)
    if a_hi <= b_lo or b_hi <= a_lo:
        return "none"
    if a.strides == b.strides and a.shape == b.shape and a_lo == b_lo:
        return "same"
    if not namespace(array_family).shares_memory(a, b):
        return "none"
    return "partial"
