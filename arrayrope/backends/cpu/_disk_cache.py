"""Numba's disk cache of the kernels, made so that a damaged entry never stops a call.

A cache folder can hold truncated or garbled files (a copy interrupted, a full disk, a home
folder shared between machines); Numba then raises from the unpickling of every later call of
that kernel. Here a load that fails is a miss: the entry's index is removed and the kernel
compiles and is saved anew. A save that fails leaves the kernel compiled in memory. Each
folder warns once.

Numba keeps an entry while the file that defines the kernel keeps its time stamp and size, but
a kernel's code also comes from the helpers it inlines from the other modules of this folder;
an entry here is kept only while every source file of the folder is unchanged (a digest of
their contents joins the stamp), so a changed helper never runs as its old compiled self. And
processes that share a folder take turns to save (see _locked).
"""

import contextlib
import hashlib
import os
import warnings

try:
    import fcntl
except ImportError:  # Windows: no lock (see _locked)
    fcntl = None

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
            with _locked(self._inner, exclusive=False):
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
            with _locked(self._inner, exclusive=True):
                self._inner.save_overload(sig, data)
        except Exception as error:
            _warn(self._inner, error, "not saved; the kernel stays compiled in this process")


@contextlib.contextmanager
def _locked(cache, exclusive):
    """Hold the cache folder's lock file: alone to save, shared to load. Numba numbers a new
    entry's data file from the index it has just read, so two processes saving kernels of one
    function at once (pytest -n, worker pools on an empty cache) can give two signatures one
    number: the index then sends one signature to the other's machine code, which crashes.
    Where the lock cannot be taken (no fcntl, a folder it cannot write) the call goes on
    without it."""
    fd = None
    if fcntl is not None:
        try:
            if exclusive:  # Numba makes the folder on its first save
                os.makedirs(cache.cache_path, exist_ok=True)
            fd = os.open(os.path.join(cache.cache_path, ".arrayrope.lock"), os.O_RDWR | os.O_CREAT)
        except (OSError, AttributeError):
            fd = None
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # which releases the lock


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


def sources_digest(folder):
    """A digest of the names and contents of the Python files in ``folder``."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), "rb") as f:
                digest.update(name.encode() + b"\0" + f.read() + b"\0")
    return digest.hexdigest()


def _dispatchers(values):
    """The Numba dispatchers among ``values`` and in the dicts among them, at any depth."""
    for value in values:
        if isinstance(value, Dispatcher):
            yield value
        elif isinstance(value, dict):
            yield from _dispatchers(value.values())


def guard(*modules):
    """Guard the disk cache of every Numba dispatcher defined in ``modules`` (as a module
    global, or in a dict that is one), and key its entries to the sources of the modules'
    folders."""
    digests = {}
    for module in modules:
        folder = os.path.dirname(os.path.abspath(module.__file__))
        if folder not in digests:
            digests[folder] = sources_digest(folder)
        for value in _dispatchers(vars(module).values()):
            if isinstance(value._cache, FunctionCache):
                index = getattr(value._cache, "_cache_file", None)
                if index is not None and hasattr(index, "_source_stamp"):
                    index._source_stamp = (index._source_stamp, digests[folder])
                value._cache = _Tolerant(value._cache)
