"""The position sweep: arrayrope past the cos/sin cache (65,536 rows at d = 128, float32), each
figure against its own in-cache counterpart or copy ceiling measured in the same run.

    python bench/positions.py           # T to 2**20, decode steps to 2**31 - 1
    python bench/positions.py --quick   # T to 2**18, fewer rounds

- prefill: (1, 8, T, 128) float32 ``rope.rotate(x, out=o)`` with positions 0..T-1, for T from
  2**12 to 2**20: GB/s, the fraction of the fastest copy of the same bytes (np.copyto, a
  threaded Numba copy), and the rate per element against T = 2**15's;
- decode: (1, 32, 1, 128) float32 ``rope.rotate(x, p, out=o)`` at positions from 10**3 to
  2**31 - 1, us per call, and each against position 1,000; the same at a new position past
  the cache each call (the first layer of a decode step);
- batch: eight such rows, one position per sequence, at small and at large mixed positions.

``bench/bench.py`` prints the same rows.
"""

import argparse
import itertools
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

DECODE_POSITIONS = (1_000, 60_000, 100_000, 1_000_000, 10_000_000, 2**31 - 1)
CALLS = 500  # decode calls per timed batch
NEW_EACH_CALL = "positions 10**6, 10**6 + 1, ... (a new one each call)"


def prefill_sweep(lengths, repeats):
    """[(T, ms, GB/s, of ceiling, rate per element against T = 2**15)]."""
    from numba import njit, prange

    import arrayrope as ar
    from bench import paired

    @njit(parallel=True, cache=True)
    def threaded_copy(src, dst):
        for i in prange(src.size):
            dst[i] = src[i]

    rope = ar.RoPE(128)
    found, reference = [], None
    for length in lengths:
        x = np.random.default_rng(0).standard_normal((1, 8, length, 128), dtype=np.float32)
        out = np.empty_like(x)
        s, d = x.reshape(-1).view(np.uint8), out.reshape(-1).view(np.uint8)
        ceilings = [lambda: np.copyto(out, x), lambda: threaded_copy(s, d)]
        t, _, ratio, _ = paired(lambda: rope.rotate(x, out=out), ceilings, repeats)
        per_element = t / x.size
        if length == 2**15:
            reference = per_element
        found.append([length, t * 1e3, 2 * x.nbytes / t / 1e9, ratio, per_element])
    for row in found:
        row[4] = reference / row[4] if reference else None
    return [tuple(row) for row in found]


def decode_sweep(rounds):
    """{position: us per call} of a decode step, and {case: us} of batches of eight rows."""
    import arrayrope as ar

    rope = ar.RoPE(128)
    x = np.random.default_rng(0).standard_normal((1, 32, 1, 128), dtype=np.float32)
    o = np.empty_like(x)
    batch = np.random.default_rng(1).standard_normal((8, 32, 1, 128), dtype=np.float32)
    b_out = np.empty_like(batch)
    small = (np.arange(8) * 4_500 + 1_000).reshape(8, 1, 1)
    large = np.random.default_rng(2).integers(100_000, 2**31, 8).reshape(8, 1, 1)
    cases = {p: (lambda p=p: rope.rotate(x, p, out=o)) for p in DECODE_POSITIONS}
    # a decode step repeats its position once per layer; this is each step's first call
    steps = itertools.count(10**6)
    cases[NEW_EACH_CALL] = lambda: rope.rotate(x, next(steps), out=o)
    cases["batch small"] = lambda: rope.rotate(batch, small, out=b_out)
    cases["batch large"] = lambda: rope.rotate(batch, large, out=b_out)
    from bench import best_per_call

    best = best_per_call(cases, rounds, CALLS)
    return {name: seconds * 1e6 for name, seconds in best.items()}


def report(prefill, decode):
    lines = ["(1, 8, T, 128) float32 rotate out=, positions 0..T-1:"]
    lines.append("  T          ms     GB/s  of ceiling  rate vs T=2**15")
    for length, ms, gbs, ratio, rate in prefill:
        rate_text = "-" if rate is None else f"{rate:.2f}"
        lines.append(f"  {length:>8,} {ms:8.2f} {gbs:8.1f} {ratio:11.2f} {rate_text:>16s}")
    lines.append("decode (1, 32, 1, 128) float32 rotate(x, p, out=o), best us per call:")
    base = decode[DECODE_POSITIONS[0]]
    for p in DECODE_POSITIONS:
        lines.append(f"  position {p:>13,}: {decode[p]:7.2f} us  ({decode[p] / base:.2f}x)")
    new = decode[NEW_EACH_CALL]
    lines.append(f"  {NEW_EACH_CALL}: {new:.2f} us  ({new / base:.2f}x)")
    small, large = decode["batch small"], decode["batch large"]
    lines.append(
        f"  batch of 8 rows, pos (8, 1, 1): small positions {small:.2f} us, large (1e5 to "
        f"2**31) {large:.2f} us ({large / small:.2f}x)"
    )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T to 2**18, fewer rounds")
    args = parser.parse_args()
    top = 18 if args.quick else 20
    prefill = prefill_sweep([2**e for e in range(12, top + 1)], 3 if args.quick else 5)
    decode = decode_sweep(10 if args.quick else 30)
    print(report(prefill, decode))


if __name__ == "__main__":
    main()
