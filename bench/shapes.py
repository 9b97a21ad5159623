"""The shape matrix: head sizes x rotary fractions x styles x dtypes, each against the fastest
copy of the same bytes and against full rotary at the same head size, measured in the same run.

    python bench/shapes.py           # both sizes (see sizes)
    python bench/shapes.py --quick   # fewer repeats

Rows: ``rope.rotate(x, out=o)`` for every head size d in {64, 80, 96, 128, 256}, rotary
fraction in {1, 1/2, 0.4, 1/4} (rotary_dim rounded down to even), style and dtype (float32,
float16, bfloat16, float64; the 2-byte types' half style has its pair blocks off the 16-byte
grid at 24 of 64, 20 and 40 of 80, 24 and 38 of 96, 50 of 128 and 102 of 256 (two pair
blocks)); rotary_dim 72 and 80 of 96 in the half style in float32, float16 and
bfloat16 (in the 2-byte types, 36 pairs off the grid, two blocks, and 40 on it); and at d =
128, rotary 1/2, the other ways of storing results (a new result, in place, rotate_qk with a
quarter of the heads as k).
"of copy" is the op's speed over the copy's; "vs full" is its time per byte over full
rotary's at the same d, dtype, style and way of storing (above 1: slower), full rotary taking
turns with it as the copies do.

Each case runs at two sizes (see :func:`sizes`): x twice the share of the last-level cache this
process counts on, where the copy and the rotation both stream memory, and x an eighth of it,
where both run from the cache. In cache each of the rotation's plain stores reads its line
before writing it (streaming stores, which do not, would leave the result out of cache), and
the rotation reads a cos/sin row for each row of x; the copy moves each line once.

After the matrix, :func:`row_cost` times full rotary at d = 128 at both sizes once more at a
single position for every row, where that cos/sin row stays in the first-level cache: against
the rows at positions 0..T-1, the gap between the two is what reading a cos/sin row for each
row of x costs. It also times the call with its kernel launch left out: the call's own work,
which in cache is a visible part of the whole.
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


def sizes():
    """{name: bytes of x}: past the last-level cache and inside it (the share of it this process
    counts on: see arrayrope.backends.cpu._config._cache_share)."""
    from arrayrope.backends.cpu._config import _cache_share

    cache = _cache_share()
    return {"past the cache": 2 * cache, "in cache": cache // 8}


def matrix(nbytes, repeats):
    """[(d, rotary_dim, style, dtype, mode, T, ms, of copy, vs full)], x (1, 32, T, d) of about
    ``nbytes`` bytes."""
    import ml_dtypes
    from numba import njit, prange

    import arrayrope as ar
    from bench import paired

    @njit(parallel=True, cache=True)
    def threaded_copy(src, dst):
        for i in prange(src.size):
            dst[i] = src[i]

    cases = []
    for dtype in (np.float32, np.float16, ml_dtypes.bfloat16, np.float64):
        for d in HEAD_SIZES:
            for fraction in FRACTIONS:
                for style in ("interleaved", "half"):
                    cases.append((d, _rotary(d, fraction), style, dtype, "out="))
    for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):  # rotary_dims off the fractions
        for rotary_dim in (72, 80):
            cases.append((96, rotary_dim, "half", dtype, "out="))
    for mode in ("new", "in place", "rotate_qk"):
        for style in ("interleaved", "half"):
            cases.append((128, 64, style, np.float32, mode))
            cases.append((128, 128, style, np.float32, mode))
    rows = []
    for d, rotary_dim, style, dtype, mode in cases:
        length = max(1, nbytes // (32 * d * np.dtype(dtype).itemsize))
        x = np.random.default_rng(0).standard_normal((1, 32, length, d)).astype(dtype)
        out = x.copy()  # "in place" rotates it from the first call on
        k = x[:, :8].copy()
        rope = ar.RoPE(d, rotary_dim=rotary_dim, style=style)
        full = ar.RoPE(d, style=style)
        s, t = x.reshape(-1).view(np.uint8), out.reshape(-1).view(np.uint8)
        ceilings = [lambda: np.copyto(out, x), lambda: threaded_copy(s, t)]
        k_out = np.empty_like(k)

        def ops(r):
            return {
                "out=": lambda: r.rotate(x, out=out),
                "new": lambda: r.rotate(x),
                "in place": lambda: r.rotate(out, out=out),
                "rotate_qk": lambda: r.rotate_qk(x, k, out=(out, k_out)),
            }[mode]

        if mode == "new":
            ceilings = [lambda: x.copy()]  # which allocates its result too
        elif mode == "rotate_qk":  # q's bytes and k's
            ks, kt = k.reshape(-1).view(np.uint8), k_out.reshape(-1).view(np.uint8)
            ceilings = [
                lambda: (np.copyto(out, x), np.copyto(k_out, k)),
                lambda: (threaded_copy(s, t), threaded_copy(ks, kt)),
            ]
        # full rotary on the same bytes takes turns with the case and the copies, its time
        # over the case's taken round by round as the ceiling's is
        against = ops(full) if rotary_dim < d else None
        seconds, _, ratio, over_full = paired(ops(rope), ceilings, repeats, against)
        vs_full = 1.0 if over_full is None else 1 / over_full
        name = np.dtype(dtype).name
        rows.append((d, rotary_dim, style, name, mode, length, seconds * 1e3, ratio, vs_full))
    return [tuple(row) for row in rows]


def row_cost(nbytes, repeats):
    """[(dtype, of copy, of copy at one position, share without the kernel)]: (1, 32, T, 128)
    ``rope.rotate(x, out=o)``, half style, x of about ``nbytes`` bytes, at positions 0..T-1 and
    at position 0 for every row. At one position each row of x reads the same cos/sin row,
    which stays in the first-level cache; at T positions each row reads its own, which the call
    keeps in the core's cache a block of positions at a time through every head (see
    backends.cpu.launch). The gap between the two is what reading the rows costs the rotation
    on this machine.

    The last figure is the time of the call at positions 0..T-1 with its kernel launch left
    out, over the whole call's: the call's own work before its kernel, timed as the rest is,
    each call right after the copies, whose bytes have passed through the cache (as a model's
    other work does between its calls)."""
    import ml_dtypes
    from numba import njit, prange

    import arrayrope as ar
    from arrayrope.backends import cpu
    from bench import paired

    @njit(parallel=True, cache=True)
    def threaded_copy(src, dst):
        for i in prange(src.size):
            dst[i] = src[i]

    rope = ar.RoPE(128, style="half")
    found = []
    for dtype in (np.float32, np.float16, ml_dtypes.bfloat16, np.float64):
        length = max(1, nbytes // (32 * 128 * np.dtype(dtype).itemsize))
        x = np.random.default_rng(0).standard_normal((1, 32, length, 128)).astype(dtype)
        out = np.empty_like(x)
        zeros = np.zeros(length, dtype=np.int64)
        s, t = x.reshape(-1).view(np.uint8), out.reshape(-1).view(np.uint8)
        ceilings = [lambda: np.copyto(out, x), lambda: threaded_copy(s, t)]
        whole = paired(lambda: rope.rotate(x, out=out), ceilings, repeats)
        one = paired(lambda: rope.rotate(x, zeros, out=out), ceilings, repeats)[2]
        launch, cpu._run = cpu._run, lambda *args: None  # every launch of cpu.launch
        try:
            alone = paired(lambda: rope.rotate(x, out=out), ceilings, repeats)[0]
        finally:
            cpu._run = launch
        found.append((np.dtype(dtype).name, whole[2], one, alone / whole[0]))
    return found


def row_costs(repeats):
    """{size name: (bytes of x, :func:`row_cost`'s rows)} for each of :func:`sizes`."""
    return {name: (nbytes, row_cost(nbytes, repeats)) for name, nbytes in sizes().items()}


def row_cost_report(costs):
    """A markdown table of :func:`row_costs`'s rows, three columns per size."""
    head = ["dtype"]
    for name in costs:
        head += [f"0..T-1, {name}", f"one position, {name}", f"without the kernel, {name}"]
    sizes_said = ", ".join(
        f"x of {nbytes / 2**20:g} MiB {name}" for name, (nbytes, _) in costs.items()
    )
    lines = [
        f"the cos/sin rows' cost: (1, 32, T, 128) half style ({sizes_said}), speed as a "
        "fraction of the copy's at positions 0..T-1 and at one position (the gap between the "
        "two is the rows' reads), and the call's time with its kernel launch left out as a "
        "share of the whole call's (its own work before the kernel):",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    columns = [found for _, found in costs.values()]
    for cases in zip(*columns):
        cells = [cases[0][0]]
        cells += [f"{v:.2f}" for _, rows, one, alone in cases for v in (rows, one, alone)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def measure(repeats):
    """{size name: (bytes of x, matrix rows)} for each of :func:`sizes`."""
    return {name: (nbytes, matrix(nbytes, repeats)) for name, nbytes in sizes().items()}


def report(measured):
    """A markdown table: each case's ms, ratio to the copy and to full rotary at each size."""
    names = list(measured)
    head = ["d", "rotary_dim", "style", "dtype", "mode"]
    for name in names:
        head += [f"ms, {name}", f"of copy, {name}", f"vs full, {name}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    columns = [rows for _, rows in measured.values()]
    for cases in zip(*columns):
        cells = [str(v) for v in cases[0][:5]]
        for row in cases:
            vs = "-" if row[8] is None else f"{row[8]:.2f}"
            cells += [f"{row[6]:.3f}", f"{row[7]:.2f}", vs]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for name, (nbytes, rows) in measured.items():
        below = sum(r[7] < 0.85 for r in rows)
        slower = sum(r[8] is not None and r[8] > 1.1 for r in rows)
        lines.append(
            f"{name} (x of {nbytes / 2**20:g} MiB): {below} of {len(rows)} cases below 0.85 of "
            f"the copy, {slower} more than 10% slower per byte than full rotary"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    repeats = 3 if args.quick else 7
    print(report(measure(repeats)))
    print()
    print(row_cost_report(row_costs(repeats)))


if __name__ == "__main__":
    main()
