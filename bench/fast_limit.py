"""Where the one-thread row kernel stops paying: it against the general strategy, by input size.

The rows strategy rotates on one thread with no layout bookkeeping; the general strategy
builds flat views and geometry and, from Config.serial_below elements on, runs the parallel
kernel. Plans take the rows strategy below Config.small_below elements. This script times
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

import numba  # noqa: E402

import arrayrope as ar  # noqa: E402
from arrayrope.backends.cpu import _config  # noqa: E402

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
    threads = numba.config.NUMBA_NUM_THREADS
    print(f"threads: {threads}, serial_below {_config.CONFIG.serial_below}")
    print("| dtype | shape | elements | rows | general | general / rows |")
    print("|---|---|---:|---:|---:|---:|")
    for name in names:
        dtype = dtype_named(name)
        for length in LENGTHS:
            x = np.random.default_rng(0).random((1, 32, length, 128)).astype(dtype)
            out, pos = np.empty_like(x), np.arange(length)
            times = {"rows": [], "general": []}
            for _ in range(ROUNDS):
                for strategy, limit in (("rows", 1 << 40), ("general", 1)):
                    with _config.override(small_below=limit):
                        rope.rotate(x, pos, out=out)  # warm: compiled, cache grown
                        times[strategy].append(seconds(lambda: rope.rotate(x, pos, out=out)))
            rows, general = (np.median(times[p]) * 1e6 for p in ("rows", "general"))
            print(
                f"| {name} | {x.shape} | {x.size} | {rows:.1f} us | {general:.1f} us | "
                f"{general / rows:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
