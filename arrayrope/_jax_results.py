"""NumPy results handed back as JAX arrays: by the eager way of JAX arrays (``_interop``) and by
the JAX primitives' eager rules (``_jax_ops``, ``_jax_given``, ``_jax_cache``).

Nothing here imports JAX: the caller's arrays have loaded it.
"""

import sys

from . import _arrays

# A result of this many bytes or more is written into memory XLA adopts (jax.device_put of
# _arrays.empty_for_xla: tens of microseconds, whatever the size); a smaller one goes to XLA
# through jnp.asarray, which costs less at that size (it copies an array off XLA's alignment).
ADOPTED_FROM = 1 << 18


def new(*likes):
    """The arrays the results for JAX arrays like ``likes`` are written into."""
    return tuple(_arrays.empty_for_xla(like.shape, like.dtype) for like in likes)


def result(array):
    """A NumPy result (which no one else holds) as a JAX array: see ADOPTED_FROM."""
    jax = sys.modules["jax"]
    if array.nbytes < ADOPTED_FROM:
        return jax.numpy.asarray(array)
    return jax.device_put(array)
