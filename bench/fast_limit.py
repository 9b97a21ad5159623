"""Where the one-thread fast path stops paying: it against the general path, by input size.

The fast path (arrayrope._api.rotate_small) rotates on one thread with no layout bookkeeping;
the general path builds flat views and geometry and, from SERIAL_BELOW elements on, runs the
parallel kernel. The fast path takes inputs below SMALL_BELOW elements. This script times
``RoPE.rotate(x, pos, out=out)`` on (1, 32, T, 128) with each limit in turn, alternating them
round by round (this machine's speed moves by 2x between minutes), and prints the medians and
their ratio. Usage:

    python bench/fast_limit.py [float32|float16|bfloat16 ...]
"""

import os
import sys
import timeit

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import arrayrope as ar  # noqa: E402
from arrayrope import _cpu  # noqa: E402

LENGTHS = [16, 32, 48, 64, 96, 128, 192]
ROUNDS = 3


def dtype_named(name):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def seconds(call, number=200):
    return min(timeit.repeat(call, number=number, repeat=5)) / number


def main():
    rope = ar.RoPE(128)
    names = sys.argv[1:] or ["float32", "float16"]
    print(f"threads: {_cpu.config.NUMBA_NUM_THREADS}, SERIAL_BELOW {_cpu.SERIAL_BELOW}")
    print("| dtype | shape | elements | fast path | general path | general / fast |")
    print("|---|---|---:|---:|---:|---:|")
    default = _cpu.SMALL_BELOW
    try:
        for name in names:
            dtype = dtype_named(name)
            for length in LENGTHS:
                x = np.random.default_rng(0).random((1, 32, length, 128)).astype(dtype)
                out, pos = np.empty_like(x), np.arange(length)
                times = {"fast": [], "general": []}
                for _ in range(ROUNDS):
                    for path, limit in (("fast", 1 << 40), ("general", 1)):
                        _cpu.SMALL_BELOW = limit
                        rope.rotate(x, pos, out=out)  # warm: compiled, cache grown
                        times[path].append(seconds(lambda: rope.rotate(x, pos, out=out)))
                fast, general = (np.median(times[p]) * 1e6 for p in ("fast", "general"))
                print(
                    f"| {name} | {x.shape} | {x.size} | {fast:.1f} us | {general:.1f} us | "
                    f"{general / fast:.2f} |",
                    flush=True,
                )
    finally:
        _cpu.SMALL_BELOW = default


if __name__ == "__main__":
    main()
