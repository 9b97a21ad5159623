"""RoPE.rotate_into_cache on torch tensors and JAX arrays. Plain tensors go through views of their
memory (NumPy's on the CPU, CuPy's on a GPU, on torch's current stream: the caches written where
they are), and what torch traces, compiles or fakes through the ``arrayrope::rotate_into_cache``
operators (``_torch_ops``). JAX arrays, which cannot be written, go to ``_jax_cache``, which
returns new caches. Read-only views are refused.
"""

import sys

import numpy as np

from . import _interop
from ._errors import RopeTypeError

NAMES = ("q", "k", "v", "pos", "k_cache", "v_cache", "slots", "out")
_WRITTEN = ("k_cache", "v_cache", "out")


def _framework(a):
    return type(a).__module__.split(".", 1)[0]


def run(rope, arrays, options):
    """``rope.rotate_into_cache`` on ``arrays`` (q, k, v, pos, k_cache, v_cache, slots, out by
    :data:`NAMES`), where q is neither NumPy nor CuPy; ``options`` are its keyword
    arguments."""
    q, out = arrays[0], arrays[-1]
    weights = (options["q_norm"], options["k_norm"])
    eager = _interop.eager_views
    if eager is not None and (views := eager(arrays + weights)) is not None:
        # plain CPU tensors (an eager decode step): their memory as NumPy, the global tests
        # made once for all of them
        natives, (q_norm, k_norm) = views[:-2], views[-2:]
        options = options | {"q_norm": q_norm, "k_norm": k_norm}
        result = rope.rotate_into_cache(*natives[:-1], out=natives[-1], **options)
        if out is not None:
            return out
        return result if type(q) is np.ndarray else _interop.from_numpy(result)
    frameworks = {_framework(a) for a in arrays if hasattr(a, "__dlpack__")}
    if frameworks & {"jax", "jaxlib"}:
        if "torch" in frameworks:
            raise RopeTypeError(
                "rotate_into_cache takes the arrays of one framework, got torch tensors and JAX "
                "arrays"
            )
        data = dict(zip(("q", "k", "v", "k_cache", "v_cache"), arrays[:3] + arrays[4:6]))
        others = [n for n, a in data.items() if _framework(a) not in ("jax", "jaxlib")]
        if others:  # a NumPy cache would be left unwritten: the JAX step returns new caches
            raise RopeTypeError(
                f"with JAX arrays, q, k, v and the caches must all be JAX arrays; "
                f"{', '.join(others)} {'is' if len(others) == 1 else 'are'} not"
            )
        from . import _jax_cache

        return _jax_cache.rotate_into_cache(rope, arrays, dict(options))
    if "torch" in frameworks and _interop.torch_ops().cache_step_wanted(arrays + weights):
        return _interop.torch_ops().rotate_into_cache(rope._engine.key, arrays, options)
    natives = [_native(name, a) for name, a in zip(NAMES, arrays)]
    options = options | {name: _native(name, options[name]) for name in ("q_norm", "k_norm")}
    with _interop.framework_stream(arrays):  # torch CUDA tensors: on torch's current stream
        result = rope.rotate_into_cache(*natives[:-1], out=natives[-1], **options)
    if out is not None:
        return out
    return _interop.restorer(_framework(q))(result) if hasattr(q, "__dlpack__") else result


def _native(name, a):
    """A NumPy (or CuPy) view of ``a`` where it comes from another framework; ``a`` itself
    otherwise (NumPy arrays, ints, lists, None)."""
    if a is None or type(a) is np.ndarray or not hasattr(a, "__dlpack__"):
        return a
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor) and a.is_cpu:
        try:
            return a.numpy()  # the fast view of a plain CPU tensor
        except (RuntimeError, TypeError):  # bfloat16, float8, a lazy negation: torch's rules
            return _interop.torch_library()._native(a, name, name in _WRITTEN)
    return _interop.adopt(name, a, name in _WRITTEN)[0]
