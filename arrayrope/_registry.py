"""The integers that framework operators name a RoPE by: each engine's key, and negative keys
for the configurations of the module-level functions.

torch operators and JAX primitives take integers, not objects. This module imports nothing of
arrayrope but its errors: the framework modules (``_torch_library``, ``_jax_ops``), which the
core loads once it meets a traced array, import it and nothing that would load them back.
``_api`` supplies the two functions that need the core (:data:`hooks`) when it is imported.
"""

import itertools
import threading
import weakref

from ._errors import RopeTypeError, RopeValueError

# Registry: engines by key, weakly: a RoPE lives only as long as its owners keep it.
_keys = itertools.count()
_engines = weakref.WeakValueDictionary()
# Registry: module-level configurations (base, style, rotary_dim, scaling) by their negative keys.
_configs = {}
_config_keys = {}
_lock = threading.Lock()

# Set by _api: "check" raises for settings that no head size makes valid; "shared" gives the
# shared RoPE of (head_dim, base, style, rotary_dim, scaling).
hooks = {}


def register(engine):
    """A new key for ``engine``."""
    key = next(_keys)
    _engines[key] = engine
    return key


def engine_of(key):
    """The engine of ``key``."""
    engine = _engines.get(key)
    if engine is None:
        raise RopeValueError(
            f"no RoPE has key {key} in this process: the RoPE a traced or exported call was "
            "made with is gone (keep a reference to it while its compiled code runs)"
        )
    return engine


def config_key(base, style, rotary_dim, scaling):
    """The negative key of a module-level configuration, checked the first time (what needs
    a head size is checked when a kernel first meets x's, by :func:`engine_for`)."""
    hooks["check"](base, style, rotary_dim, scaling)
    config = (base, style, rotary_dim, scaling)
    try:
        hash(config)
    except TypeError:
        raise RopeTypeError(f"unhashable RoPE settings: {config!r}") from None
    with _lock:
        key = _config_keys.get(config)
        if key is None:
            key = _config_keys[config] = -1 - len(_configs)
            _configs[key] = config
    return key


def engine_for(key, head_dim):
    """The engine of ``key``: an engine's own, or for a configuration's key the engine of its
    shared RoPE at ``head_dim``."""
    if key < 0 and key in _configs:
        return hooks["shared"](head_dim, *_configs[key])._engine
    return engine_of(key)
