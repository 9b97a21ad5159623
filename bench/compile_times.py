"""First-call cost of each CPU kernel variant, compiled into an empty Numba cache.

Each case runs in a fresh process with its own empty cache directory, so every number is a
cold compile of the kernels that case needs (Numba's import included, import arrayrope not).
A later process loads them from the disk cache instead. Usage:

    python bench/compile_times.py [--repeats N]

Prints one line per case: the median first-call time over N fresh processes (default 1).
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

# (name, the call, run after `import numpy as np, arrayrope as ar`)
CASES = [
    ("decode, row kernel (1, 32, 1, 128)", "ar.rotate(np.ones((1, 32, 1, 128), np.float32), 5)"),
    (
        "one thread, general kernel (1, 32, 8, 128), float positions",
        "ar.rotate(np.ones((1, 32, 8, 128), np.float32), np.arange(8.0))",
    ),
    (
        "parallel (1, 32, 1024, 128) out=",
        "x = np.ones((1, 32, 1024, 128), np.float32); ar.rotate(x, out=np.empty_like(x))",
    ),
    (
        "parallel (1, 32, 1024, 128) in place",
        "x = np.ones((1, 32, 1024, 128), np.float32); ar.rotate(x, out=x)",
    ),
    (
        "the README quick start (rotate, rotate_qk half, in place)",
        "q = np.ones((2, 32, 1024, 128), np.float32); k = np.ones((2, 8, 1024, 128), np.float32)"
        "; p = np.arange(1024); ar.rotate(q, p); ar.rotate_qk(q, k, p, style='half')"
        "; ar.rotate(k, p, out=k)",
    ),
    (
        "the fused step (rotate_into_cache, 4 tokens)",
        "q = np.ones((4, 8, 128), np.float32); k = np.ones((4, 2, 128), np.float32)"
        "; c = np.zeros((2, 16, 2, 128), np.float32); d = c.copy()"
        "; ar.RoPE(128, style='half').rotate_into_cache(q, k, k.copy(), np.arange(4), c, d,"
        " np.arange(4))",
    ),
]

SCRIPT = """
import time
import numpy as np
import arrayrope as ar
t = time.perf_counter()
{call}
print(time.perf_counter() - t)
"""


def first_call(call):
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache, ARRAYROPE_NUMBA_CACHE="1")
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT.format(call=call)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
    return float(done.stdout.split()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    for name, call in CASES:
        times = [first_call(call) for _ in range(args.repeats)]
        print(f"{name}: first call {statistics.median(times):.1f} s (cold cache)", flush=True)


if __name__ == "__main__":
    main()
