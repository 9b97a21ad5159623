"""Compile the common CPU kernel variants ahead of use, into Numba's disk cache.

Each kernel variant compiles on first use, in every fresh environment (a container, CI, a new
Numba version). ``python -m arrayrope warmup`` (or :func:`warmup`) makes those first calls once,
at build time, so that later processes load the kernels from the cache instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from ._errors import RopeValueError

_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


# The streaming variants are compiled for a dtype where its results stream from at most this
# many bytes (see _config.streams_from); a higher ARRAYROPE_STREAM_ABOVE turns streaming off in
# practice.
_STREAMING_UP_TO = 1 << 30


def _unaligned(shape, dtype):
    """An array one element off a 16-byte boundary: the vector steps write it with plain
    stores."""
    return np.empty(int(np.prod(shape)) + 1, dtype)[1:].reshape(shape)


def _calls(rope, dtype):
    """(variant, call) pairs: every kernel a decode loop, a prefill and a training step meet."""
    import arrayrope as ar

    from ._tables import PARALLEL_PAIRS
    from .backends.cpu import _config
    from .backends.cpu._config import STREAMING

    # one pair rotated: pair blocks off the 16-byte grid, rows on it (written in chunks)
    off_grid = ar.RoPE(rope.head_dim, style=rope.style, rotary_dim=2)

    rng = np.random.default_rng(0)
    step = rng.standard_normal((1, 8, 1, rope.head_dim)).astype(dtype)
    pair = rng.standard_normal((2, 8, 1, rope.head_dim)).astype(dtype)  # two sequences' steps
    cache = np.zeros((1, 8, 16, rope.head_dim), dtype)  # a KV cache, rows written in place
    chunk = rng.standard_normal((1, 8, 16, rope.head_dim)).astype(dtype)
    large = rng.standard_normal((2, 8, 1024, rope.head_dim)).astype(dtype)
    real = np.arange(16) + 0.5
    odd = _unaligned(chunk.shape, dtype)
    # enough rows past the cache that they are made on Numba's threads
    rows = max(16, PARALLEL_PAIRS // (rope.rotary_dim // 2))
    far = rng.standard_normal((rows, rope.head_dim)).astype(dtype)
    far_pos = np.arange(rows) + 2**30
    # a step of two tokens into a paged cache of 16-slot blocks (8 query heads, 2 key-value)
    tokens = rng.standard_normal((2, 8, rope.head_dim)).astype(dtype)
    kv = rng.standard_normal((2, 2, rope.head_dim)).astype(dtype)
    paged = np.zeros((2, 2, 16, 2, rope.head_dim), dtype)  # the key and the value cache
    slots = np.array([0, 17])
    calls = [
        ("decode step, new result", lambda: rope.rotate(step, 5)),
        ("decode step, in place", lambda: rope.rotate(cache[:, :, 0:1], 5, out=cache[:, :, 0:1])),
        ("decode step, into a KV-cache slice", lambda: rope.rotate(step, 5, out=cache[:, :, 5:6])),
        ("decode step, position array", lambda: rope.rotate(step, np.array([5]))),
        ("prefill chunk, rotate_qk", lambda: rope.rotate_qk(chunk, chunk[:, :2], np.arange(16))),
        ("one thread, real positions", lambda: rope.rotate(chunk, np.arange(16) + 0.5)),
        ("parallel, out=", lambda: rope.rotate(large, out=np.empty_like(large))),
        ("parallel, in place", lambda: rope.rotate(large, out=large)),
        ("vector steps off the 16-byte grid (out=)", lambda: rope.rotate(chunk, real, out=odd)),
        (
            "pair blocks off the grid, parallel, out=",
            lambda: off_grid.rotate(large, out=np.empty_like(large)),
        ),
        ("positions past the cos/sin cache", lambda: rope.rotate(step, np.array([2**31 - 1]))),
        ("a batch of rows past the cache", lambda: rope.rotate(pair, np.array([[[2**30]], [[9]]]))),
        ("positions past the cache, parallel rows", lambda: rope.rotate(far, far_pos)),
        (
            "fused step into a paged KV cache",
            lambda: rope.rotate_into_cache(tokens, kv, kv, slots, paged[0], paged[1], slots),
        ),
    ]
    streams_from = _config.streams_from(dtype.itemsize)
    if STREAMING and streams_from <= _STREAMING_UP_TO:
        # a result this large takes streaming stores (16 positions: a small table)
        rows = -(-streams_from // (16 * rope.head_dim * dtype.itemsize))
        huge = np.zeros((rows, 16, rope.head_dim), dtype)
        calls.append(("parallel, streaming stores", lambda: rope.rotate(huge)))
        calls.append(("parallel, in place, as large", lambda: rope.rotate(huge, out=huge)))
        calls.append(("pair blocks off the grid, streaming", lambda: off_grid.rotate(huge)))
    return calls


def warmup(
    dtypes: tuple[str, ...] | None = None,
    *,
    head_dim: int = 128,
    progress: Callable[[str], object] | None = print,
) -> float:
    """Compile the common CPU kernel variants into Numba's disk cache.

    Parameters
    ----------
    dtypes : tuple of {"float16", "bfloat16", "float32", "float64"}, optional
        The dtypes to compile for (default: all four; bfloat16 where ml_dtypes is installed).
    head_dim : int
        The head size of the calls made (the kernels serve every head size).
    progress : callable, optional
        Called with one line per variant (``print`` by default; None for silence).

    Returns
    -------
    float
        The seconds it took.
    """
    import arrayrope as ar

    if dtypes is None:
        dtypes = tuple(d for d in _DTYPES if d != "bfloat16" or _has_ml_dtypes())
    unknown = [d for d in dtypes if d not in _DTYPES]
    if unknown:
        raise RopeValueError(f"dtypes must be among {_DTYPES}, got {unknown}")
    start = time.perf_counter()
    for name in dtypes:
        dtype = _dtype(name)
        # both pair styles: the direct path compiles a kernel per style (the other kernels
        # serve both, compiled by the first style's calls)
        for style in ("interleaved", "half"):
            rope = ar.RoPE(head_dim, style=style)
            for variant, call in _calls(rope, dtype):
                began = time.perf_counter()
                call()
                if progress is not None:
                    took = time.perf_counter() - began
                    progress(f"{name:9s} {style:11s} {variant:42s} {took:6.1f} s")
    return time.perf_counter() - start


def _has_ml_dtypes():
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        return False
    return True
