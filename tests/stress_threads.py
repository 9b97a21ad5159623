"""Many threads rotating through shared RoPEs while their caches grow.

Run by ``test_concurrency.py`` in a subprocess per Numba threading layer
(``NUMBA_THREADING_LAYER``). Each of THREADS threads works through its own shuffled list of
calls: a half type and float32, both styles, plain RoPE and scaling rules (Linear, YaRN, Llama
3, dynamic NTK), decode steps and inputs large enough for the parallel kernels, positions that
climb so that every shared cache grows while other threads read it, the module-level functions
too. Every
result must equal, bit for bit, the same call made beforehand on one thread with a RoPE of its
own, and stay within the float64 oracle's bound where the oracle applies.

    python tests/stress_threads.py SEED
"""

import os
import sys
import threading

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from oracles import BF16, assert_matches, oracle  # noqa: E402

import arrayrope as ar  # noqa: E402
from arrayrope import scaling  # noqa: E402

THREADS = 8
RULES = {
    "plain": None,
    "linear": scaling.Linear(2.0),
    "yarn": scaling.YaRN(4.0, 512),
    "llama3": scaling.Llama3(8.0, 1.0, 4.0, 512),
    "dynamic": scaling.DynamicNTK(2.0, 512),
}


def make_calls(rng):
    calls = []
    for rule in RULES:
        for dtype in (BF16, np.float32):  # a half type and a float type
            for style in ("interleaved", "half"):
                for size in ("decode", "parallel"):
                    for step in range(3):
                        shape = (1, 8, 1, 64) if size == "decode" else (1, 8, 160, 64)
                        top = 64 * 8**step  # climbing: each step past the cache's rows
                        lead = shape[:-1]
                        pos = rng.integers(top // 2, top, size=(lead[-1],))
                        x = rng.standard_normal(shape).astype(dtype)
                        calls.append((rule, style, x, pos, step % 2 == 1))
    return calls


def run(rope, call):
    rule, style, x, pos, inverse = call
    if rope is None:  # the module-level function, its RoPE shared by configuration
        return ar.rotate(x, pos, style=style, scaling=RULES[rule], inverse=inverse)
    return rope.rotate(x, pos, inverse=inverse)


def main():
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    rng = np.random.default_rng(seed)
    calls = make_calls(rng)
    shared = {
        (rule, style): ar.RoPE(64, style=style, scaling=RULES[rule])
        for rule in RULES
        for style in ("interleaved", "half")
    }
    expected = []
    for call in calls:
        alone = ar.RoPE(64, style=call[1], scaling=RULES[call[0]])
        expected.append(run(alone, call))
        rule, style, x, pos, inverse = call
        if RULES[rule] is None:
            assert_matches(expected[-1], oracle(x, pos, style=style, inverse=inverse), x)
    # fresh shared RoPEs: their caches start small and grow under the threads
    shared = {key: ar.RoPE(64, style=key[1], scaling=RULES[key[0]]) for key in shared}
    failures = []
    barrier = threading.Barrier(THREADS)

    def worker(index):
        order = np.random.default_rng([seed, index]).permutation(len(calls))
        barrier.wait()
        for i in order:
            call = calls[i]
            rope = None if (i + index) % 3 == 0 else shared[(call[0], call[1])]
            try:
                got = run(rope, call)
            except Exception as error:  # noqa: BLE001  (reported below)
                failures.append(f"thread {index}, call {i}: {error!r}")
                continue
            same = np.ascontiguousarray(got).view(np.uint8) == expected[i].view(np.uint8)
            if not same.all():
                rule, style, x, _, inverse = call
                failures.append(
                    f"thread {index}, call {i} ({rule}, {style}, {x.dtype}, {x.shape}, "
                    f"inverse={inverse}): bits differ from the one-thread result"
                )

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    import numba

    layer = numba.threading_layer()
    if failures:
        print("\n".join(failures[:20]))
        return 1
    print(f"{THREADS} threads x {len(calls)} calls on the {layer} layer: all equal", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
