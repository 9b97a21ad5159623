"""Arrays placed flush against inaccessible pages, so that a kernel touching one byte outside
its operands dies with SIGSEGV instead of reading or writing a neighbour.

Every array gets its own mapping: an inaccessible page, the data pages, an inaccessible page.
The array's memory (the span from its lowest to its highest byte, whatever its strides) ends at
the last data byte (``side="after"``) or starts at the first (``side="before"``).
"""

import ctypes
import mmap

import numpy as np

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.mprotect.restype = ctypes.c_int
_PROT_NONE = 0


class _Mapping:
    """One anonymous mapping with its first and last page made inaccessible."""

    def __init__(self, data_bytes):
        pages = -(-max(data_bytes, 1) // PAGE)
        self.map = mmap.mmap(-1, (pages + 2) * PAGE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.data_start = PAGE
        self.data_stop = (pages + 1) * PAGE
        for start in (0, self.data_stop):
            if _libc.mprotect(self.base + start, PAGE, _PROT_NONE) != 0:
                raise OSError(ctypes.get_errno(), "mprotect failed")


def span(shape, strides, itemsize):
    """(lowest byte offset, one past the highest) of an array's memory from its element 0."""
    low = high = 0
    for n, s in zip(shape, strides):
        if n == 0:
            return 0, 0
        if s < 0:
            low += (n - 1) * s
        else:
            high += (n - 1) * s
    return low, high + itemsize


def guarded(shape, dtype, strides=None, *, side="after", shift=0):
    """An uninitialised array of ``shape`` and ``dtype`` (byte ``strides``, C order by
    default) whose memory touches an inaccessible page: after its last byte (``side="after"``)
    or before its first (``side="before"``, then ``shift`` bytes later: a misaligned start).
    """
    dtype = np.dtype(dtype)
    shape = tuple(shape)
    if strides is None:
        strides = np.empty(shape, dtype).strides if all(shape) else (dtype.itemsize,) * len(shape)
    low, high = span(shape, strides, dtype.itemsize)
    size = high - low
    mapping = _Mapping(size + shift)

    if side == "after":
        first = mapping.data_stop - size
    elif side == "before":
        first = mapping.data_start + shift
    else:
        raise ValueError(f"side must be 'after' or 'before', got {side!r}")
    offset = first - low  # element 0's byte offset in the mapping
    return np.ndarray(shape, dtype, buffer=mapping.map, offset=offset, strides=strides)


def guarded_copy(a, strides=None, *, side="after", shift=0):
    """``a``'s values in a guarded array (see :func:`guarded`)."""
    g = guarded(a.shape, a.dtype, strides, side=side, shift=shift)
    g[...] = a
    return g
