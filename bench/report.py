"""The benchmark's results file and its plots: bench.py --write FILE.md writes FILE.md and,
beside it, throughput.png, frameworks.png and accuracy.png."""

import os
import platform
import subprocess
import sys

import numpy as np


def machine():
    """What the figures were measured on: CPU model, vector instruction sets, cores, threads."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    except OSError:
        pass
    wanted = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16", "avx2", "f16c")
    isa = [f for f in wanted if f in flags]
    widest = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    import numba

    return {
        "cpu": model,
        "vector ISA": f"{widest} ({', '.join(isa) or 'none of ' + ', '.join(wanted)})",
        "cores": os.cpu_count(),
        "Numba threads": numba.config.NUMBA_NUM_THREADS,
        "versions": f"Python {platform.python_version()}, NumPy {np.__version__}, "
        f"Numba {numba.__version__}",
    }


def _revision():
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run(
        ["git", "-C", here, "describe", "--always", "--dirty"], capture_output=True, text=True
    )
    return done.stdout.strip() or "unknown"


def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def _streaming_section(stores):
    """The lines of the streaming stores' section (bench/streaming.py), none without rows."""
    if not stores:
        return []
    return [
        "## Where streaming stores pay",
        "",
        "(1, 32, T, 128) half style `rope.rotate(x, out=o)` with results around the size from "
        "which each dtype streams (float32 from `ARRAYROPE_STREAM_ABOVE`, float16 and bfloat16 "
        "from twice it), timed as the default policy stores them, with streaming stores "
        "forced and with plain stores forced, in rounds taking turns (bench/streaming.py). "
        "`default / faster`: 1.00 where the default took the faster way, above 1 where it lost "
        "that much (below 1: the default is one of the two ways, and its own turns ran faster "
        "than that way's). Microseconds, median of rounds.",
        "",
        _table(
            [
                "dtype",
                "MiB",
                "default",
                "default us",
                "streaming us",
                "plain us",
                "default / faster",
            ],  # fmt: skip
            [
                (dtype, f"{mib:.0f}", way, f"{d:.0f}", f"{s:.0f}", f"{p:.0f}", f"{o:.2f}")
                for dtype, mib, way, d, s, p, o in stores
            ],
        ),
        "",
    ]


def write(path, info, cold, decode, rows, sweep, measured, dask_line, date):
    """The results file: ``measured`` holds the framework rows, the accuracy rows, the long
    context sweep (prefill rows, decode steps), the shape matrix, the cos/sin rows' cost (bytes
    of x, rows), the fused inference step's rows, the rows against llama.cpp's rope (None
    without ggml), the torch.compile sweep and the streaming stores' rows, as bench.py makes
    them."""
    import shapes  # bench/shapes.py, beside this file

    frameworks, accuracy, (prefill, decode_at), matrix, row_cost, fused, llama, compiled, stores = (
        measured
    )
    revision = _revision()  # before this writes the results files
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    figures = _plots(folder, sweep, frameworks, accuracy)
    figures["positions"] = _position_plot(folder, prefill, decode_at)
    first = min(decode_at, key=lambda k: k if isinstance(k, int) else float("inf"))
    text = [
        "# arrayrope performance",
        "",
        f"Written by `python bench/bench.py --write {os.path.relpath(path)}` on {date}, "
        f"arrayrope at {revision}. Each figure is measured in this run; ratios compare "
        "against a ceiling measured alongside it, alternating, so that a shared machine's "
        "slow minutes fall on both.",
        "",
        _table(["machine", ""], list(info.items())),
        "",
        "## Start-up",
        "",
        f"`import arrayrope`: {cold['import_s'] * 1e3:.0f} ms. First call (a decode step): "
        f"{cold['first_call_s'] * 1e3:.0f} ms with the kernels in Numba's disk cache, "
        f"{cold['cold_s']:.1f} s compiling them into an empty cache.",
        "",
        "## Decode and prefill steps",
        "",
        "x (1, 32, 1, 128) float32; k 8 heads; KV a (1, 8, 2048, 128) cache; chunk 16 tokens. "
        "Microseconds per call, every check included: the best and the median of rounds in "
        "which the cases take turns. `sum(range(100))` shows how fast this machine ran Python "
        "at the time.",
        "",
        _table(
            ["call", "best us", "median us"],
            [(name, f"{b:.2f}", f"{m:.2f}") for name, (b, m) in decode.items()],
        ),
        "",
        "## Large tensors",
        "",
        "GB/s counts bytes read plus bytes written. The ceiling is the fastest copy of the same "
        "bytes in the same run (np.copyto or a threaded copy; for `rotate new`, which allocates, "
        "`x.copy()`); the streaming copy is a threaded copy with streaming stores (x86-64). "
        "`vs numpy` is the speedup over the NumPy formula.",
        "",
        _table(
            [
                "op",
                "shape",
                "dtype",
                "style",
                "ms",
                "GB/s",
                "copy GB/s",
                "of ceiling",
                "of streaming copy",
                "vs numpy",
            ],
            [
                (
                    r["op"],
                    r["shape"],
                    r["dtype"],
                    r["style"],
                    _fmt(r["ms"], ".3f"),
                    _fmt(r["GB/s"], ".1f"),
                    _fmt(r["copy GB/s"], ".1f"),
                    _fmt(r["of ceiling"], ".2f"),
                    _fmt(r.get("of streaming copy"), ".2f"),
                    _fmt(r.get("vs numpy") or r.get("host us"), ".1f"),
                )
                for r in rows
            ],
        ),
        "",
        f"![throughput against tensor size]({figures['throughput']})",
        "",
        *_streaming_section(stores),
        "## Against other implementations",
        "",
        "The same rotation (float32, half style) as models write it with the framework's own "
        "operations: cos and sin of float32 angles, then rotate_half. The framework rows time "
        "what installed frameworks this run found.",
        "",
        _table(
            ["shape", "implementation", "us per call", "arrayrope (NumPy) is"],
            _framework_table(frameworks),
        ),
        "",
        f"![against other implementations]({figures['frameworks']})",
        "",
        "Inside the frameworks' compilers: arrayrope called in a function that torch.compile "
        "(fullgraph) or jax.jit compiles, with tensor positions, against the same compiler's "
        "output for the formula, in the same run. torch reaches arrayrope's registered "
        "operators and JAX its primitive (an XLA FFI call); a compiled decode step also pays "
        "the compiled function's own entry, which dominates at that size.",
        "",
        _table(
            ["shape", "compiler", "arrayrope us", "formula us", "arrayrope is"],
            _compiled_table(frameworks),
        ),
        "",
        "Under torch.compile by size: calls of up to arrayrope._torch_lowered.SMALL "
        "elements (q and k together) are written as torch operations that Inductor fuses into "
        "the compiled code, larger ones go through the operator. x (1, 32, T, 128) float32, "
        "tensor positions, us per call, same run (bench/frameworks.py).",
        "",
        _table(
            [
                "T",
                "torch.compile formula",
                "arrayrope",
                "arrayrope through the operator",
                "arrayrope is",
            ],
            [
                (
                    t,
                    _fmt(f * 1e6, ".1f"),
                    _fmt(o * 1e6, ".1f"),
                    _fmt(op * 1e6, ".1f"),
                    _speed(f / o),
                )
                for t, f, o, op in compiled
            ],
        ),
        "",
        "## float32 accuracy against position",
        "",
        "The largest error of a float32 rotation against the float64 one, head_dim 128, base "
        "10000, in float32 ulps of the inputs' largest magnitude.",
        "",
        _table(
            ["position", "arrayrope (ulps)", "float32-angle formula (ulps)"],
            [(f"{p:,}", f"{o / u:.2f}", f"{c / u:.0f}") for p, o, c, u in accuracy],
        ),
        "",
        f"![float32 error against position]({figures['accuracy']})",
        "",
        "## Long contexts",
        "",
        "(1, 8, T, 128) float32 `rope.rotate(x, out=o)`, positions 0..T-1: the cos/sin cache "
        "holds 65,536 rows here, and longer calls make each position's row in the kernel. "
        "`of ceiling` is against the fastest copy of the same bytes; `rate` is the time per "
        "element at T = 2**15 over the time per element at T.",
        "",
        _table(
            ["T", "ms", "GB/s", "of ceiling", "rate vs T = 2**15"],
            [
                (f"{t:,}", f"{ms:.2f}", f"{gbs:.1f}", f"{r:.2f}", _fmt(rate, ".2f"))
                for t, ms, gbs, r, rate in prefill
            ],
        ),
        "",
        "A decode step, (1, 32, 1, 128) float32 `rope.rotate(x, p, out=o)`, and eight rows at "
        "once, one position per sequence; microseconds per call, best of rounds taking turns.",
        "",
        _table(
            ["call", "us", "against"],
            [
                (
                    f"position {k:,}" if isinstance(k, int) else k,
                    f"{us:.2f}",
                    f"{us / decode_at[_decode_base(k, first)]:.2f}x",
                )
                for k, us in decode_at.items()
            ],
        ),
        "",
        f"![throughput and decode time against position]({figures['positions']})",
        "",
        "## Head sizes and rotary fractions",
        "",
        "(1, 32, T, d) `rope.rotate(x, out=o)` unless the mode says otherwise, at two sizes: x "
        "twice the last-level cache this process counts on (its size, at most 16 MiB per "
        "CPU), where both the rotation and the copy stream memory, and x an eighth of it (both "
        "run in cache). `of copy` is against the fastest copy of the same "
        "bytes, `vs full` the time per byte over full rotary's at the same d, dtype, style and "
        "mode (above 1: slower). In cache, each of the rotation's plain stores reads its line "
        "before writing it, and the rotation reads a cos/sin row for each row of x (as many "
        "bytes as the row in float32, twice as many for the 2-byte types); the copy moves each "
        "line once. The call's own work before its kernel is a visible part of a call this "
        "short (`without the kernel`, below).",
        "",
        shapes.report(matrix),
        "",
        "The same rotation at both sizes, at positions 0..T-1 and at a single position, where "
        "every row of x reads one cos/sin row that stays in the first-level cache: the gap "
        "between the two is what reading a row for each row of x costs (`bench/shapes.py`'s "
        "`row_cost`). `without the kernel` is the call at positions 0..T-1 with its kernel "
        "launch left out, as a share of the whole call's time: its own work before the kernel, "
        "timed right after the copies have passed through the cache, as the rest is.",
        "",
        shapes.row_cost_report(row_cost),
        "",
        "## Fused inference step",
        "",
        "`RoPE.rotate_into_cache` (bench/kv_cache.py): q (N, 32, 128), k and v (N, 8, 128) views "
        "of one fused projection, into a paged NHD cache of 16-slot blocks, half style. "
        "`unfused` is `rotate_qk(..., out=)` and two NumPy scatters into the cache; `copy` the "
        "fastest copy of the projection's bytes. Prefill: 2048 tokens at consecutive slots (and "
        "8192: in bfloat16, 2048 tokens are 24 MiB, which a last-level cache of 32 MiB partly "
        "holds for the copy and for the step, whose 2-byte rows stream only from twice "
        "`ARRAYROPE_STREAM_ABOVE`); "
        "decode: 32 tokens at mixed positions and scattered slots, below 30,000 and from 10**6 on "
        "(past the cache of cos/sin rows). QK-norm: q and k RMS-normalized per head before the "
        "rotation (`q_norm=`, `k_norm=`); unfused, by NumPy in float32 first. `of streaming "
        "copy`: the same ratio against a threaded copy with streaming stores (x86-64), as the "
        "fused step makes them where it is too large for the cache. Best of rounds.",
        "",
        _table(
            [
                "step",
                "dtype",
                "fused us",
                "unfused us",
                "speedup",
                "copy us",
                "of copy",
                "of streaming copy",
            ],
            [
                (
                    step,
                    dtype,
                    f"{f:.1f}",
                    f"{u:.1f}",
                    f"{u / f:.2f}x",
                    f"{c:.1f}",
                    f"{c / f:.2f}",
                    "-" if s is None else f"{s / f:.2f}",
                )
                for step, dtype, f, u, c, s in fused
            ],
        ),
    ]
    text += ["", "## Against llama.cpp's rope", ""]
    if llama is None:
        text.append("Not measured: ggml is not installed (`pip install ggml-python`).")
    else:
        text += [
            "ggml's `ggml_rope_ext` (bench/ggml_rope.py, NeoX pairs, base 10,000) and "
            "`rope.rotate(x, pos, out=o)` in half style on the same (T, H, 128) float32 tensors, "
            "positions (T,), timed in turns; ggml on a thread pool of Numba's thread count "
            "(one thread for a decode step). Microseconds per call, best of rounds.",
            "",
            _table(
                ["case", "T", "H", "arrayrope us", "ggml us", "ggml / arrayrope"],
                [
                    (name, f"{t:,}", h, f"{ours:.1f}", f"{theirs:.1f}", f"{theirs / ours:.2f}")
                    for name, t, h, ours, theirs, _ in llama
                ],
            ),
        ]
    if dask_line:
        text += ["", "## Dask", "", dask_line]
    with open(path, "w") as f:
        f.write("\n".join(text) + "\n")


def _framework_table(frameworks):
    base = {shape: s for shape, name, s in frameworks if name.startswith("arrayrope (NumPy")}
    rows = []
    for shape, name, seconds in frameworks:
        ratio = "-" if seconds is None else _speed(seconds / base[shape])
        if name.startswith("arrayrope (NumPy"):
            ratio = ""
        rows.append((shape, name, _fmt(None if seconds is None else seconds * 1e6, ".1f"), ratio))
    return rows


def _speed(ratio):
    """A time ratio (theirs / ours) in words."""
    return f"{ratio:.1f}x faster" if ratio >= 1 else f"{1 / ratio:.1f}x slower"


def _compiled_table(frameworks):
    found = {(shape, name): seconds for shape, name, seconds in frameworks}
    rows = []
    for shape in dict.fromkeys(shape for shape, _, _ in frameworks):
        for compiler, ours, formula in (
            ("torch.compile", "arrayrope under torch.compile", "torch.compile formula"),
            ("jax.jit", "arrayrope under jax.jit", "jax.jit formula"),
        ):
            mine, theirs = found.get((shape, ours)), found.get((shape, formula))
            if mine and theirs:
                rows.append((shape, compiler, _fmt(mine * 1e6, ".1f"), _fmt(theirs * 1e6, ".1f"),
                             _speed(theirs / mine)))  # fmt: skip
    return rows


def _decode_base(case, first):
    """The decode row a case is compared with: batches with the batch at small positions, the
    rest with the step at the first position."""
    return "batch small" if str(case).startswith("batch") else first


def _position_plot(folder, prefill, decode_at):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    lengths = [t for t, *_ in prefill]
    left.plot(lengths, [g for _, _, g, _, _ in prefill], marker="o", label="arrayrope")
    left.plot(lengths, [g / r for _, _, g, r, _ in prefill], ls="--", label="copy ceiling")
    left.axvline(65536, color="grey", lw=0.8)
    left.set_xscale("log", base=2)
    left.set_ylim(bottom=0)
    left.set_xlabel("T, (1, 8, T, 128) float32, positions 0..T-1 (line: the cache's end)")
    left.set_ylabel("GB/s (read + written)")
    left.legend()
    steps = {k: v for k, v in decode_at.items() if isinstance(k, int)}
    right.plot(list(steps), list(steps.values()), marker="o")
    right.axvline(65536, color="grey", lw=0.8)
    right.set_xscale("log")
    right.set_ylim(bottom=0)
    right.set_xlabel("position of a (1, 32, 1, 128) float32 decode step")
    right.set_ylabel("us per call")
    fig.suptitle("Against position")
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "positions.png"), dpi=110)
    plt.close(fig)
    return "positions.png"


def _plots(folder, sweep, frameworks, accuracy):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    names = {}
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for dtype, points in sweep.items():
        sizes = [mb for mb, _, _ in points]
        (line,) = ax.plot(sizes, [g for _, g, _ in points], marker="o", label=f"arrayrope {dtype}")
        ax.plot(sizes, [c for _, _, c in points], ls="--", color=line.get_color(), alpha=0.6)
    ax.set_xscale("log")
    ax.set_xlabel("tensor size (MiB), rotate out=, (1, 32, T, 128), half style")
    ax.set_ylabel("GB/s (read + written)")
    ax.set_title("Throughput; dashed: a copy of the same bytes in the same run")
    ax.legend()
    fig.tight_layout()
    names["throughput"] = "throughput.png"
    fig.savefig(os.path.join(folder, names["throughput"]), dpi=110)
    plt.close(fig)

    shapes = sorted({s for s, _, _ in frameworks}, key=lambda s: -s[2])
    fig, axes = plt.subplots(len(shapes), 1, figsize=(9, 2.2 + 1.9 * len(shapes)))
    for ax, shape in zip(np.atleast_1d(axes), shapes):
        entries = [(n, t) for s, n, t in frameworks if s == shape and t is not None]
        base = next(t for n, t in entries if n.startswith("arrayrope (NumPy"))
        ratios = [t / base for _, t in entries]
        ax.barh([n for n, _ in entries], ratios, color="tab:blue", left=0)
        ax.set_xscale("log")
        ax.set_xlim(0.5, max(ratios) * 4)
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        for y, (_, t) in enumerate(entries):
            label = f"{t * 1e6:.1f} us" if t < 1e-3 else f"{t * 1e3:.2f} ms"
            ax.text(t / base * 1.08, y, label, va="center", fontsize=8)
        ax.set_title(f"x {shape} float32: time per call, relative to arrayrope on NumPy")
        ax.invert_yaxis()
    fig.tight_layout()
    names["frameworks"] = "frameworks.png"
    fig.savefig(os.path.join(folder, names["frameworks"]), dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.2))
    positions = [p for p, _, _, _ in accuracy]
    ax.plot(positions, [o / u for _, o, _, u in accuracy], marker="o", label="arrayrope")
    ax.plot(positions, [c / u for _, _, c, u in accuracy], marker="s", label="float32 angles")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("position")
    ax.set_ylabel("max error (float32 ulps of max |x|)")
    ax.set_title("float32 rotation error against float64")
    ax.legend()
    fig.tight_layout()
    names["accuracy"] = "accuracy.png"
    fig.savefig(os.path.join(folder, names["accuracy"]), dpi=110)
    plt.close(fig)
    return names


if __name__ == "__main__":
    sys.exit("report.py is written by bench.py --write FILE.md")
