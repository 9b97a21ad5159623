"""The shape matrix: head sizes x rotary fractions x styles x dtypes, each against the fastest
copy of the same bytes and against full rotary at the same head size, measured in the same run.

    python bench/shapes.py           # (1, 32, 2048, d)
    python bench/shapes.py --quick   # (1, 32, 512, d), fewer repeats

Rows: ``rope.rotate(x, out=o)`` for every head size d in {64, 80, 96, 128, 256}, rotary
fraction in {1, 1/2, 0.4, 1/4} (rotary_dim rounded down to even) and style, in float32; the
fractions at d = 128 in float16, bfloat16 and float64; and at d = 128, rotary 1/2, the other
ways of storing results (a new result, in place, rotate_qk with a quarter of the heads as k).
"of copy" is the op's speed over the copy's; "vs full" is its time per byte over full
rotary's at the same d, dtype and style (above 1: slower).
"""

import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

HEAD_SIZES = (64, 80, 96, 128, 256)
FRACTIONS = (1.0, 0.5, 0.4, 0.25)


def _rotary(d, fraction):
    return max(2, int(d * fraction) // 2 * 2)


def matrix(length, repeats):
    """[(d, rotary_dim, style, dtype, mode, ms, of copy, vs full)]."""
    import ml_dtypes
    from numba import njit, prange

    import arrayrope as ar
    from bench import paired

    @njit(parallel=True, cache=True)
    def threaded_copy(src, dst):
        for i in prange(src.size):
            dst[i] = src[i]

    cases = []
    for d in HEAD_SIZES:
        for fraction in FRACTIONS:
            for style in ("interleaved", "half"):
                cases.append((d, _rotary(d, fraction), style, np.float32, "out="))
    for dtype in (np.float16, ml_dtypes.bfloat16, np.float64):
        for fraction in FRACTIONS:
            for style in ("interleaved", "half"):
                cases.append((128, _rotary(128, fraction), style, dtype, "out="))
    for mode in ("new", "in place", "rotate_qk"):
        for style in ("interleaved", "half"):
            cases.append((128, 64, style, np.float32, mode))
            cases.append((128, 128, style, np.float32, mode))
    rows, full = [], {}
    for d, rotary_dim, style, dtype, mode in cases:
        x = np.random.default_rng(0).standard_normal((1, 32, length, d)).astype(dtype)
        out = np.empty_like(x)
        k = x[:, :8].copy()
        rope = ar.RoPE(d, rotary_dim=rotary_dim, style=style)
        s, t = x.reshape(-1).view(np.uint8), out.reshape(-1).view(np.uint8)
        ceilings = [lambda: np.copyto(out, x), lambda: threaded_copy(s, t)]
        k_out = np.empty_like(k)
        ops = {
            "out=": lambda: rope.rotate(x, out=out),
            "new": lambda: rope.rotate(x),
            "in place": lambda: rope.rotate(out, out=out),
            "rotate_qk": lambda: rope.rotate_qk(x, k, out=(out, k_out)),
        }
        if mode == "new":
            ceilings = [lambda: x.copy()]  # which allocates its result too
        seconds, _, ratio, _ = paired(ops[mode], ceilings, repeats)
        key = (d, style, np.dtype(dtype).name, mode)
        if rotary_dim == d:
            full[key] = seconds
        rows.append([d, rotary_dim, style, np.dtype(dtype).name, mode, seconds * 1e3, ratio, key])
    for row in rows:
        base = full.get(row[-1])
        row[-1] = None if base is None else row[5] / 1e3 / base
    return [tuple(row) for row in rows]


def report(rows):
    lines = ["| d | rotary_dim | style | dtype | mode | ms | of copy | vs full |"]
    lines.append("|---:|---:|---|---|---|---:|---:|---:|")
    for d, rotary_dim, style, dtype, mode, ms, ratio, vs_full in rows:
        vs = "-" if vs_full is None else f"{vs_full:.2f}"
        lines.append(
            f"| {d} | {rotary_dim} | {style} | {dtype} | {mode} | {ms:.3f} | {ratio:.2f} | {vs} |"
        )
    below = [r for r in rows if r[6] < 0.85]
    lines.append(f"\n{len(below)} of {len(rows)} cases below 0.85 of the copy")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T = 512, fewer repeats")
    args = parser.parse_args()
    print(report(matrix(512 if args.quick else 2048, 3 if args.quick else 7)))


if __name__ == "__main__":
    main()
