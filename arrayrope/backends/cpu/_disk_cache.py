"""Numba's disk cache of the kernels, made so that a damaged entry never stops a call.

A cache folder can hold truncated or garbled files (a copy interrupted, a full disk, a home
folder shared between machines); Numba then raises from the unpickling of every later call of
that kernel. Here a load that fails is a miss: the entry's index is removed and the kernel
compiles and is saved anew. A save that fails leaves the kernel compiled in memory. Each
folder warns once.
"""

import os
import warnings

from numba.core.caching import FunctionCache
from numba.core.dispatcher import Dispatcher

_warned = set()


class _Tolerant:
    """A dispatcher's FunctionCache, with its loads and saves guarded."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def load_overload(self, sig, target_context):
        try:
            return self._inner.load_overload(sig, target_context)
        except Exception as error:  # any damage: unpickling, a short read, a bad file
            index = getattr(getattr(self._inner, "_cache_file", None), "_index_path", None)
            if index is not None:
                try:
                    os.unlink(index)
                except OSError:
                    pass
            _warn(self._inner, error, "dropped; the kernel compiles anew")
            return None

    def save_overload(self, sig, data):
        try:
            self._inner.save_overload(sig, data)
        except Exception as error:
            _warn(self._inner, error, "not saved; the kernel stays compiled in this process")


def _warn(cache, error, what):
    folder = getattr(cache, "cache_path", "?")
    if folder in _warned:
        return
    _warned.add(folder)
    warnings.warn(
        f"arrayrope: an entry of the kernel cache in {folder} is damaged or unreadable "
        f"({type(error).__name__}: {error}); it is {what}",
        RuntimeWarning,
        stacklevel=4,
    )


def guard(*modules):
    """Guard the disk cache of every Numba dispatcher defined in ``modules``."""
    for module in modules:
        for value in vars(module).values():
            if isinstance(value, Dispatcher) and isinstance(value._cache, FunctionCache):
                value._cache = _Tolerant(value._cache)
