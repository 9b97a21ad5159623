"""The checks of ``RoPE.rotate_into_cache`` that its arrays' layouts settle (shapes, dtypes, the
cache layout, the written arrays' flags and strides), kept per layout: a decode loop brings the
same layouts each step, at new addresses. Each refusal names the argument and its value."""

import functools

from . import _arrays
from ._arrays import CUPY, NUMPY
from ._cache import Bounded
from ._errors import RopeTypeError, RopeValueError

LAYOUTS = ("NHD", "HND")


@functools.cache
def fp8(dtype):
    return dtype.name == "float8_e4m3fn"  # ml_dtypes' type: never imported here


def _operand(name, a, shape, dtype, family, written=False):
    """Raise unless the array ``a`` has ``shape`` and ``dtype`` (and, if ``written``, can take
    the kernel's writes)."""
    if a.shape != shape:
        raise RopeValueError(f"{name} must have shape {shape}, got {a.shape}")
    if a.dtype != dtype:
        raise RopeTypeError(f"{name} must have dtype {dtype}, got {a.dtype}")
    if written and family == NUMPY and not a.flags.writeable:
        raise RopeValueError(f"{name} is read-only")
    if written and not _arrays.addressable(a, family):
        raise RopeValueError(
            f"{name} must have a contiguous feature axis and an element-aligned address and "
            f"strides, got strides {a.strides} at address {_arrays.address(a)}"
        )
    if written and _arrays.self_overlapping(a):
        raise RopeValueError(
            f"{name} has elements that share memory (strides {a.strides}): parallel writes "
            "to it would race"
        )


def check_layout(cache_layout):
    """Refuse a ``cache_layout`` other than the names of LAYOUTS (checked where a framework
    route keys its call by it, before anything runs)."""
    if not (isinstance(cache_layout, str) and cache_layout in LAYOUTS):
        raise RopeValueError(f"cache_layout must be 'NHD' or 'HND', got {cache_layout!r}")


def layout(d, q, k, v, k_cache, v_cache, out, cache_layout, family):
    """(N, Hq, Hkv, block_size) after the checks that the arrays' layouts settle: shapes,
    dtypes, the cache layout, and the written arrays' flags and strides. Kept per layout (a
    decode loop brings the same arrays' layouts each step, at new addresses)."""
    check_layout(cache_layout)
    key = (d, cache_layout) + tuple(
        None if a is None else (a.shape, a.strides, a.dtype, _flags(a, family))
        for a in (q, k, v, k_cache, v_cache, out)
    )
    found = _layouts.get(key)
    if found is None:
        checked = checked_layout(d, q, k, v, k_cache, v_cache, out, cache_layout, family)
        found = _layouts.put(key, checked)
    return found


_layouts = Bounded(256)  # cache: layout by the arrays' layouts


def _flags(a, family):
    """What the layout key needs beyond shape, strides and dtype: NumPy's flags (writeable,
    aligned), a CuPy array's address modulo its item size (a misaligned one takes a copy)."""
    return a.flags.num if family == NUMPY else _arrays.address(a) % a.itemsize


def checked_layout(d, q, k, v, k_cache, v_cache, out, cache_layout, family):
    """:func:`layout`'s checks, each refusal naming the argument and its value."""
    if q.ndim != 3:
        raise RopeValueError(f"q must have shape (N, Hq, head_dim), got {q.shape}")
    _arrays.check_float("q", q, d)
    n, hq, _ = q.shape
    if k.ndim != 3:
        raise RopeValueError(f"k must have shape (N, Hkv, head_dim), got {k.shape}")
    hkv = k.shape[1]
    _operand("k", k, (n, hkv, d), q.dtype, family)
    shape = getattr(v, "shape", None)
    if shape is not None and len(shape) == 3 and shape[::2] == (n, d) and shape[1] != hkv:
        # k and v differ in their heads alone: either may be the wrong one
        raise RopeValueError(f"k and v must have one number of heads, got k {k.shape}, v {shape}")
    _operand("v", v, (n, hkv, d), q.dtype, family)
    if k_cache.ndim != 4:
        axes = "block_size, Hkv" if cache_layout == "NHD" else "Hkv, block_size"
        raise RopeValueError(
            f"k_cache must have shape (num_blocks, {axes}, head_dim), got {k_cache.shape}"
        )
    block = k_cache.shape[1] if cache_layout == "NHD" else k_cache.shape[2]
    heads_axis = 2 if cache_layout == "NHD" else 1
    if k_cache.shape[heads_axis] != hkv or k_cache.shape[3] != d:
        raise RopeValueError(
            f"k_cache of shape {k_cache.shape} ({cache_layout}) has Hkv={k_cache.shape[heads_axis]}"
            f" and head_dim={k_cache.shape[3]}; k has Hkv={hkv} and head_dim={d}"
        )
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not (cache.dtype == q.dtype or fp8(cache.dtype)):
            raise RopeTypeError(
                f"{name} must have q's dtype ({q.dtype}) or float8_e4m3fn, got {cache.dtype}"
            )
        _operand(name, cache, k_cache.shape, cache.dtype, family, written=True)
    if family == CUPY and k_cache.dtype != v_cache.dtype:  # one cache type per CUDA entry point
        raise RopeTypeError(
            f"k_cache and v_cache must have one dtype on a GPU, got {k_cache.dtype} and "
            f"{v_cache.dtype}"
        )
    if out is not None:
        _operand("out", out, q.shape, q.dtype, family, written=True)
    return n, hq, hkv, block
