"""The one cache policy: every cache arrayrope keeps is a :class:`Bounded` dict.

A lookup is a plain ``dict.get`` (a decode step's budget has no room for more); an insert past
the limit drops the oldest entry first. Entries are things that are cheap to rebuild (plans,
shared RoPEs, small device arrays), so first-in-first-out serves as well as least-recently-used
without a bookkeeping write on every hit.
"""

import weakref

_every = []  # weak references to every Bounded (a dict is unhashable: no WeakSet)


class Bounded(dict):
    """A dict of at most ``limit`` entries."""

    __slots__ = ("limit", "__weakref__")

    def __init__(self, limit):
        super().__init__()
        self.limit = limit
        if len(_every) > 4096:
            _every[:] = [ref for ref in _every if ref() is not None]
        _every.append(weakref.ref(self))

    def put(self, key, value):
        """``self[key] = value``, dropping the oldest entry first where the dict is full."""
        if len(self) >= self.limit and key not in self:
            try:
                del self[next(iter(self))]
            except (StopIteration, KeyError, RuntimeError):  # another thread changed it first
                pass
        self[key] = value
        return value


def clear_all():
    """Empty every cache: configuration changed, and what was built under it may not hold."""
    alive = []
    for ref in list(_every):
        cache = ref()
        if cache is not None:
            cache.clear()
            alive.append(ref)
    _every[:] = alive
