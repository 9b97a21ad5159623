"""The policy for module-level state, and :class:`Bounded`, the dict of its caches.

Module-level state is of three kinds, and each store says which it is beside its definition:

- **Caches** hold what is cheap to rebuild (plans, shared RoPEs, geometry, small device arrays)
  and are keyed by what calls bring, so that without a bound they would grow with the calls.
  Every cache is a :class:`Bounded`: a lookup is a plain ``dict.get`` (a decode step's budget
  has no room for more); an insert past the limit drops the oldest entry first, which serves as
  well as least-recently-used without a bookkeeping write on every hit. :func:`clear_all`
  empties them when the configuration changes, but for those made ``survives_config``: cos/sin
  and level tables and the shared RoPEs that hold them, which the CPU launch configuration
  does not shape and which cost milliseconds to rebuild.
- **Finite stores** are plain dicts keyed by a closed set, so bounded by it: compiled kernels
  and entry points by variant, loaded modules by name, per-framework or per-device helpers.
  They are never dropped: an entry costs a compile to remake.
- **Registries** hold what something outside arrayrope may still name or read: RoPE keys that
  framework operators carry, configuration keys and JAX call ids inside compiled programs,
  pinned buffers and flags a device copy or kernel may still touch, arrays a captured graph
  reads. An entry lives as long as its owner (weakly held) or the process; none is dropped
  while it may be named.

Flags and switches (a forked process, the threading layer, a test's forced fallback) are
scalars that name what they switch.
"""

import weakref

_every = []  # weak references to every Bounded (a dict is unhashable: no WeakSet)


class Bounded(dict):
    """A dict of at most ``limit`` entries; ``survives_config``: kept when the CPU launch
    configuration changes (see :func:`clear_all`)."""

    __slots__ = ("limit", "survives_config", "__weakref__")

    def __init__(self, limit, survives_config=False):
        super().__init__()
        self.limit = limit
        self.survives_config = survives_config
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


def clear_all(config_change=False):
    """Empty every cache: what was built may not hold. ``config_change`` (the CPU launch
    configuration changed): every cache but those made ``survives_config``."""
    alive = []
    for ref in list(_every):
        cache = ref()
        if cache is not None:
            if not (config_change and cache.survives_config):
                cache.clear()
            alive.append(ref)
    _every[:] = alive
