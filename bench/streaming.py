"""Where streaming stores pay: ``rope.rotate(x, out=o)``, x (1, 32, T, 128) half style, with
results from half to four times ``ARRAYROPE_STREAM_ABOVE`` (the default: half the last-level
cache the process counts on), timed as the default launch policy stores them, with streaming
stores forced and with plain stores forced, in rounds that take turns.

    python bench/streaming.py           # float32, float16, bfloat16
    python bench/streaming.py --quick   # fewer rounds

float32 results stream from ARRAYROPE_STREAM_ABOVE, float16 and bfloat16 from twice it
(see the README). Each row: the results' size, how the default stores them, the microseconds
of each way (median of rounds, each round the best of three calls) and the default's time over
the faster forced way's: 1.00 where the default took the faster, above 1 where it lost that
much (below 1: the default is one of the two ways, and its own turns ran faster than that
way's). Forced plain stores leave prefetching to the CPU; forced streaming asks for each row
ahead.
``bench/bench.py`` prints the same rows.
"""

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

MULTIPLES = (0.5, 1, 2, 3, 4)  # of ARRAYROPE_STREAM_ABOVE


def rows(rounds):
    """[(dtype, MiB, default way, default us, streaming us, plain us, default over faster)]."""
    import ml_dtypes

    import arrayrope as ar
    from arrayrope.backends.cpu import _config

    if not _config.STREAMING:
        return []
    above = _config.CONFIG.stream_above
    ways = {"default": above, "streaming": 0, "plain": 1 << 62}
    rope = ar.RoPE(128, style="half")
    found = []
    for dtype in (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)):
        for multiple in MULTIPLES:
            nbytes = int(multiple * above)
            length = max(1, nbytes // (32 * 128 * dtype.itemsize))
            x = np.random.default_rng(0).standard_normal((1, 32, length, 128)).astype(dtype)
            out = np.empty_like(x)
            times = {way: [] for way in ways}
            for _ in range(rounds):
                for way, stream_above in ways.items():
                    with _config.override(stream_above=stream_above):
                        rope.rotate(x, out=out)  # the plan of this configuration
                        best = float("inf")
                        for _ in range(3):
                            start = time.perf_counter()
                            rope.rotate(x, out=out)
                            best = min(best, time.perf_counter() - start)
                        times[way].append(best)
            us = {way: float(np.median(t)) * 1e6 for way, t in times.items()}
            streams = out.nbytes >= _config.streams_from(dtype.itemsize)
            found.append(
                (
                    dtype.name,
                    out.nbytes / (1 << 20),
                    "streaming" if streams else "plain",
                    us["default"],
                    us["streaming"],
                    us["plain"],
                    us["default"] / min(us["streaming"], us["plain"]),
                )
            )
    return found


def report(found):
    if not found:
        return "(no rows: streaming stores are used on x86-64 only)"
    lines = ["  dtype      MiB  default     default us  streaming us   plain us  default/faster"]
    for dtype, mib, way, default, streaming, plain, over in found:
        lines.append(
            f"  {dtype:9s} {mib:5.0f}  {way:10s} {default:10.0f} {streaming:13.0f} "
            f"{plain:10.0f} {over:15.2f}"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    args = parser.parse_args()
    print(report(rows(3 if args.quick else 7)))


if __name__ == "__main__":
    main()
