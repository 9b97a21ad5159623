"""arrayrope benchmark: CPU (and GPU, when CuPy sees one) against a same-run copy ceiling.

For each shape and dtype it prints the time of arrayrope, of the NumPy reference formula
(arrayrope's readable array-operations backend), and of the fastest copy of the same bytes this
machine manages in the same run (np.copyto and a threaded Numba copy; for "rotate new", which
allocates its result, x.copy(), which does too), as GB/s (bytes read plus bytes written) and as a
fraction of that ceiling. Each operation is timed alternately with its ceiling after warm-up, and
"of ceiling" is the median of the per-round ratios (medians of times beside it); compile and
cache-load time is reported separately, as is import time. "of streaming copy" is the same ratio
against a stricter ceiling, a threaded copy with streaming stores (x86-64 only), which writes
without first reading each line and on some machines runs at twice np.copyto's speed.

    python bench/bench.py                              # the full tables
    python bench/bench.py --write docs/performance.md  # and the results file with its plots
    python bench/bench.py --quick                      # smaller shapes, fewer repeats
    python bench/bench.py --no-dask                    # without the Dask cluster row

It also times the same rotation written in NumPy, PyTorch (eager, torch.compile) and JAX
(jax.jit) where those are installed (bench/frameworks.py), and measures float32 accuracy
against position.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def median_time(fn, repeats, warmup=2):
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return float(np.median(samples))


def cold_start(cache_dir=None):
    """Import time and first-call time in a fresh process; with ``cache_dir``, an empty Numba
    cache there, so the first call compiles."""
    code = (
        "import time; t0 = time.perf_counter(); import arrayrope as ar; t1 = time.perf_counter()\n"
        "import numpy as np; x = np.ones((1, 32, 1, 128), np.float32)\n"
        "t2 = time.perf_counter(); ar.rotate(x, 5); t3 = time.perf_counter()\n"
        "print(t1 - t0, t3 - t2)"
    )
    env = dict(os.environ, **({"NUMBA_CACHE_DIR": cache_dir} if cache_dir else {}))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    return [float(v) for v in out.stdout.split()]


def best_per_call(cases, rounds, calls):
    """{name: best seconds per call}, the cases taking turns each round (a batch of ``calls``
    calls each), so that a slow stretch of the machine falls on all alike."""
    for fn in cases.values():
        fn()
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(rounds):
        for name, fn in cases.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / calls)
    return best


def paired(fn, ceilings, repeats, streaming=None):
    """Time ``fn`` alternately with its ceiling copies; returns (op s, ceiling s, ratio, ratio
    to the ``streaming`` copy or None).

    Alternating, and taking the median of per-round ratios, cancels the slow drift of a shared
    machine; the ceiling of a round is the fastest of its copies.
    """
    fn()
    for c in ceilings + ([streaming] if streaming else []):
        c()
    ops, tops, ratios, streamed = [], [], [], []
    for _ in range(repeats):
        best = min(median_time(c, 1, warmup=0) for c in ceilings)
        t = median_time(fn, 1, warmup=0)
        if streaming:
            streamed.append(median_time(streaming, 1, warmup=0) / t)
        ops.append(t)
        tops.append(best)
        ratios.append(best / t)
    stream_ratio = float(np.median(streamed)) if streaming else None
    return float(np.median(ops)), float(np.median(tops)), float(np.median(ratios)), stream_ratio


def streaming_copier():
    """A threaded Numba copy with streaming stores (x86-64), or None elsewhere: on some machines
    much faster than np.copyto and the plain threaded copy, so a second, stricter ceiling."""
    from numba import njit, prange

    from arrayrope.backends.cpu import _config, _rows, _simd

    if not _config.STREAMING:
        return None

    @njit(parallel=True, cache=True)
    def streaming_copy(src, dst):
        n = src.size
        per = (n + 63) // 64
        for task in prange(64):
            first = min(task * per, n)
            stop = min(first + per, n)
            _rows._stream_copy(src[first:stop], dst, np.uint64(first), np.uint64(stop - first))
            _simd.store_fence()

    return streaming_copy


def cpu_rows(shapes, dtypes, repeats):
    from numba import njit, prange

    import arrayrope as ar

    @njit(parallel=True, cache=True)
    def threaded_copy(src, dst):
        for i in prange(src.size):
            dst[i] = src[i]

    streaming_copy = streaming_copier()
    rows = []
    for shape in shapes:
        for dtype in dtypes:
            x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
            out = np.empty_like(x)
            k = x[:, : max(1, shape[1] // 4)].copy()  # grouped-query keys: a quarter of the heads
            k_out = np.empty_like(k)
            qk = np.concatenate([x.reshape(-1), k.reshape(-1)])
            qk_out = np.empty_like(qk)

            def copies(src, dst):
                s, d = src.reshape(-1).view(np.uint8), dst.reshape(-1).view(np.uint8)
                return [lambda: np.copyto(dst, src), lambda: threaded_copy(s, d)]

            def streamed(src, dst):
                s, d = src.reshape(-1).view(np.uint8), dst.reshape(-1).view(np.uint8)
                return (lambda: streaming_copy(s, d)) if streaming_copy else None

            for style in ("interleaved", "half"):
                cases = {
                    "rotate out=": (
                        lambda: ar.rotate(x, style=style, out=out),
                        copies(x, out),
                        2 * x.nbytes,
                        streamed(x, out),
                    ),
                    # allocating: against a copy that allocates its result too
                    "rotate new": (
                        lambda: ar.rotate(x, style=style),
                        [x.copy],
                        2 * x.nbytes,
                        None,
                    ),
                    "rotate in place": (
                        lambda: ar.rotate(out, style=style, out=out),
                        copies(x, out),
                        2 * x.nbytes,
                        streamed(x, out),
                    ),
                    "rotate_qk out=": (
                        lambda: ar.rotate_qk(x, k, style=style, out=(out, k_out)),
                        copies(qk, qk_out),
                        2 * qk.nbytes,
                        streamed(qk, qk_out),
                    ),
                }
                reference = median_time(
                    lambda: ar.rotate(x, style=style, backend="numpy"),
                    max(3, repeats // 3),
                    warmup=1,
                )
                for name, (fn, ceilings, moved, streaming) in cases.items():
                    t, ceiling, ratio, of_streaming = paired(fn, ceilings, repeats, streaming)
                    rows.append(
                        {
                            "device": "cpu",
                            "op": name,
                            "shape": shape,
                            "dtype": np.dtype(dtype).name,
                            "style": style,
                            "ms": t * 1e3,
                            "GB/s": moved / t / 1e9,
                            "copy GB/s": moved / ceiling / 1e9,
                            "of ceiling": ratio,
                            "of streaming copy": of_streaming,
                            "vs numpy": reference / t if name.startswith("rotate ") else None,
                        }
                    )
    return rows


def multi_axis_rows(repeats):
    """Multi-axis layouts at the large float32 shape, against the same copy ceiling."""
    import arrayrope as ar

    x = np.random.default_rng(0).standard_normal((4, 32, 2048, 128)).astype(np.float32)
    out = np.empty_like(x)
    pos = np.random.default_rng(1).integers(0, 64, (2048, 3))
    ropes = {
        "1-D (reference row)": (ar.RoPE(128), pos[:, 0]),
        "axial (16, 56, 56), FLUX": (ar.RoPE.axial((16, 56, 56)), pos),
        "sectioned (16, 24, 24), Qwen2-VL": (ar.RoPE.sectioned(128, (16, 24, 24)), pos),
        "interleaved (24, 20, 20), Qwen3-VL": (
            ar.RoPE.sectioned(128, (24, 20, 20), assign="interleaved"),
            pos,
        ),
    }
    rows = []
    for name, (rope, p) in ropes.items():
        t, ceiling, ratio, _ = paired(
            lambda: rope.rotate(x, p, out=out), [lambda: np.copyto(out, x)], repeats
        )
        rows.append(
            {
                "device": "cpu",
                "op": f"multi-axis {name}",
                "shape": x.shape,
                "dtype": "float32",
                "style": rope.style,
                "ms": t * 1e3,
                "GB/s": 2 * x.nbytes / t / 1e9,
                "copy GB/s": 2 * x.nbytes / ceiling / 1e9,
                "of ceiling": ratio,
                "vs numpy": None,
            }
        )
    return rows


def size_sweep(dtypes, repeats, lengths=(16, 64, 256, 1024, 4096)):
    """{dtype: [(MiB, GB/s, copy GB/s)]} of ``rotate out=`` on (1, 32, T, 128), half style,
    each against the fastest copy of the same bytes in the same run."""
    from numba import njit, prange

    import arrayrope as ar

    @njit(parallel=True, cache=True)
    def threaded_copy(src, dst):
        for i in prange(src.size):
            dst[i] = src[i]

    rope = ar.RoPE(128, style="half")
    found = {}
    for dtype in dtypes:
        points = []
        for length in lengths:
            x = np.random.default_rng(0).standard_normal((1, 32, length, 128)).astype(dtype)
            out = np.empty_like(x)
            s, d = x.reshape(-1).view(np.uint8), out.reshape(-1).view(np.uint8)
            ceilings = [lambda: np.copyto(out, x), lambda: threaded_copy(s, d)]
            calls = max(1, (32 << 20) // x.nbytes)  # short calls are timed in batches

            def batch(fn, calls=calls):
                def run():
                    for _ in range(calls):
                        fn()

                return run

            t, ceiling, _, _ = paired(
                batch(lambda: rope.rotate(x, out=out)), [batch(c) for c in ceilings], repeats
            )
            moved = 2 * x.nbytes * calls
            points.append((x.nbytes / 2**20, moved / t / 1e9, moved / ceiling / 1e9))
        found[np.dtype(dtype).name] = points
    return found


DECODE_CALLS = 500  # calls per batch


def decode_row(rounds):
    import arrayrope as ar

    x = np.random.default_rng(0).standard_normal((1, 32, 1, 128)).astype(np.float32)
    rope = ar.RoPE(128)
    pos = np.array([1234])
    batch = np.random.default_rng(1).standard_normal((8, 32, 1, 128)).astype(np.float32)
    each = np.arange(8).reshape(8, 1, 1) * 100 + 1000  # one position per sequence
    k = np.random.default_rng(2).standard_normal((1, 8, 1, 128)).astype(np.float32)
    kv_cache = np.zeros((1, 8, 2048, 128), np.float32)  # k's heads, written at one position
    chunk = np.random.default_rng(3).standard_normal((1, 32, 16, 128)).astype(np.float32)
    chunk_pos = np.arange(1000, 1016)  # a prefill chunk of 16 tokens: 2**16 elements
    cases = {
        "ar.rotate(x, int)": lambda: ar.rotate(x, 1234),
        "RoPE.rotate(x, int)": lambda: rope.rotate(x, 1234),
        "ar.rotate(x, int, out=x)": lambda: ar.rotate(x, 1234, out=x),
        "ar.rotate_qk(q, k, int)": lambda: ar.rotate_qk(x, k, 1234),
        "ar.rotate(k, int, out=KV)": lambda: ar.rotate(k, 1234, out=kv_cache[:, :, 1234:1235]),
        "RoPE.rotate(x, array)": lambda: rope.rotate(x, pos),
        "batch of 8, pos (8, 1, 1)": lambda: rope.rotate(batch, each),
        "chunk (1, 32, 16, 128)": lambda: rope.rotate(chunk, chunk_pos),
        "numpy reference": lambda: rope.rotate(x, pos, backend="numpy"),
        # no arrayrope: how fast this minute runs Python
        "(machine) sum(range(100))": lambda: sum(range(100)),
    }
    try:
        import torch
    except ImportError:
        pass
    else:  # the same step on a torch tensor: the eager path, the NumPy one in between
        t = torch.from_numpy(x.copy())
        cases["RoPE.rotate(torch x, int)"] = lambda: rope.rotate(t, 1234)
    for fn in cases.values():
        fn()
    samples = {name: [] for name in cases}
    # The cases take turns, a batch each per round, so that a slow stretch of a shared machine
    # (they last seconds) falls on every case alike instead of on whichever ran then.
    for _ in range(rounds):
        for name, fn in cases.items():
            start = time.perf_counter()
            for _ in range(DECODE_CALLS):
                fn()
            samples[name].append((time.perf_counter() - start) / DECODE_CALLS)
    # The best batch is the code's own cost (a shared machine only adds to it); the median
    # shows what the machine's neighbours added during this run.
    return {
        name: (float(np.min(t)) * 1e6, float(np.median(t)) * 1e6) for name, t in samples.items()
    }


def gpu_rows(shapes, dtypes, repeats):
    try:
        import cupy
        from cupyx.profiler import benchmark

        if not cupy.is_available():
            return None
    except Exception:
        return None
    import arrayrope as ar

    def device_time(fn):
        result = benchmark(fn, n_repeat=repeats, n_warmup=3)
        return float(np.median(result.gpu_times)), float(np.median(result.cpu_times))

    def measure(row, fn, style):
        """Time ``fn`` into ``row``; a failure is recorded in the row, not raised, so that one
        broken case costs its own row and not the rest of a device session's table."""
        row.update({"device": "gpu", "style": style, "ms": None, "host us": None})
        row.update({"GB/s": None, "copy GB/s": None, "of ceiling": None})
        try:
            t, host = device_time(fn)
        except Exception as error:  # noqa: BLE001 - reported in the table
            row["error"] = f"{type(error).__name__}: {error}"[:200]
            return False
        row["ms"], row["host us"] = t * 1e3, host * 1e6
        if row["op"].startswith(("cupy rotate", "decode cupy")):
            from arrayrope.backends.cuda import cupy as cupy_backend

            row["entry"] = cupy_backend.last_entry  # which kernel variant ran
        return True

    rows = []
    for shape in shapes:
        for dtype in dtypes:
            try:
                x = cupy.asarray(np.random.default_rng(0).standard_normal(shape).astype(dtype))
            except Exception:
                continue  # a dtype this CuPy cannot hold (bfloat16 on older CuPy)
            out = cupy.empty_like(x)
            copy, _ = device_time(lambda: cupy.copyto(out, x))
            nbytes = 2 * x.nbytes
            for style in ("interleaved", "half"):
                cases = {
                    "cupy rotate out=": lambda: ar.rotate(x, style=style, out=out, backend="cupy"),
                    "numba-cuda rotate out=": lambda: ar.rotate(
                        x, style=style, out=out, backend="numba-cuda"
                    ),
                    "cupy elementwise reference": lambda: ar.rotate(
                        x, style=style, backend="numpy"
                    ),
                }
                for name, fn in cases.items():
                    row = {"op": name, "shape": shape, "dtype": np.dtype(dtype).name}
                    timed = measure(row, fn, style)
                    if timed:
                        t = row["ms"] / 1e3
                        row["GB/s"] = nbytes / t / 1e9
                        row["copy GB/s"] = nbytes / copy / 1e9
                        row["of ceiling"] = copy / t
                    rows.append(row)
    x = cupy.asarray(np.random.default_rng(0).standard_normal((1, 32, 1, 128)), np.float32)
    out = cupy.empty_like(x)
    for backend in ("cupy", "numba-cuda"):
        row = {"op": f"decode {backend}", "shape": (1, 32, 1, 128), "dtype": "float32"}
        measure(row, lambda: ar.rotate(x, 1234, out=out, backend=backend), "interleaved")
        rows.append(row)
    return rows


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller shapes, fewer repeats")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--no-cpu", action="store_true", help="GPU rows only")
    parser.add_argument("--no-dask", action="store_true", help="skip the Dask cluster row")
    parser.add_argument(
        "--write", metavar="FILE.md", help="write the results file, and its plots beside it"
    )
    args = parser.parse_args()
    import ml_dtypes
    import report

    dtypes = [np.float32, np.float16, ml_dtypes.bfloat16]
    shapes = [(4, 32, 2048, 128)] if not args.quick else [(2, 16, 1024, 128)]
    repeats = 5 if args.quick else 11
    start = time.time()
    import tempfile

    with tempfile.TemporaryDirectory() as empty:
        first = cold_start(empty)  # compiles: an empty kernel cache
    cold_start()  # fills the project's own cache if it is empty
    import_s, first_call_s = cold_start()
    date = time.strftime("%Y-%m-%d %H:%M")
    info = report.machine()
    print(f"# arrayrope benchmark, {date}")
    for key, value in info.items():
        print(f"{key}: {value}")
    print(
        f"cold start: import arrayrope {import_s * 1e3:.0f} ms; first call "
        f"{first_call_s * 1e3:.0f} ms from the disk cache ({first[1]:.1f} s when the cache was "
        "cold)"
    )
    rows = []
    if not args.no_cpu:
        rounds = 4 * repeats
        decode = decode_row(rounds)
        print(
            "\ndecode step x (1, 32, 1, 128) float32 (k: 8 heads; KV: a (1, 8, 2048, 128) cache;"
            " chunk: 16 tokens at once),"
            " us per call, every Python-level check included"
            f" (best / median of {rounds} rounds, the cases taking turns, each a batch of"
            f" {DECODE_CALLS} calls):"
        )
        for name, (best, median) in decode.items():
            print(f"  {name:26s} {best:7.2f} us / {median:7.2f} us")
        rows = cpu_rows(shapes, dtypes, repeats)
        if not args.quick:
            rows += multi_axis_rows(repeats)
        import frameworks

        sweep = size_sweep(dtypes, max(3, repeats // 2))
        print("\nthroughput against size, rotate out= (1, 32, T, 128), half style:")
        for dtype, points in sweep.items():
            for mib, gbs, copy in points:
                print(f"  {dtype:9s} {mib:8.2f} MiB  {gbs:6.1f} GB/s  (copy {copy:6.1f} GB/s)")
        import positions
        import shapes as shape_matrix

        lengths = [2**e for e in range(12, (18 if args.quick else 20) + 1)]
        print("\npast the cos/sin cache (bench/positions.py):")
        long_context = (
            positions.prefill_sweep(lengths, max(3, repeats // 2)),
            positions.decode_sweep(rounds),
        )
        print(positions.report(*long_context))
        print("\nhead sizes x rotary fractions x styles x dtypes (bench/shapes.py):")
        matrix = shape_matrix.measure(3 if args.quick else 5)
        print(shape_matrix.report(matrix))
        row_cost = shape_matrix.row_costs(3 if args.quick else 5)
        print()
        print(shape_matrix.row_cost_report(row_cost))
        import kv_cache

        fused = kv_cache.rows(5 if args.quick else 15)
        print("\nthe fused inference step, rotate_into_cache (bench/kv_cache.py):")
        print(kv_cache.report(fused))
        import streaming

        stores = streaming.rows(3 if args.quick else 7)
        print("\nwhere streaming stores pay (bench/streaming.py):")
        print(streaming.report(stores))
        import ggml_rope

        llama = ggml_rope.rows(3 if args.quick else 7)
        print("\nagainst llama.cpp's rope (bench/ggml_rope.py):")
        print(ggml_rope.report(llama))
        against = frameworks.framework_rows(repeats=max(3, repeats // 2))
        print("\nagainst other implementations (float32, half style), us per call:")
        for shape, name, seconds in against:
            value = "-" if seconds is None else f"{seconds * 1e6:10.1f}"
            print(f"  {str(shape):18s} {name:40s} {value}")
        compiled = frameworks.compiled_sweep(max(3, repeats // 2))
        print("\nunder torch.compile, (1, 32, T, 128) float32, us per call:")
        for rows_t, formula, ours, operator in compiled:
            print(f"  T={rows_t:5d}  formula {formula * 1e6:9.1f}  arrayrope {ours * 1e6:9.1f}  "
                  f"through the operator {operator * 1e6:9.1f}")  # fmt: skip
        accuracy = frameworks.accuracy_rows()
        print("\nfloat32 max error against float64, in float32 ulps (arrayrope / float32 angles):")
        for pos, ours, common, ulp in accuracy[::4]:
            print(f"  position {pos:>10,}: {ours / ulp:6.2f} / {common / ulp:9.0f}")
    gpu = (
        gpu_rows(shapes + [(8, 32, 4096, 128)], dtypes, repeats)
        if not args.quick
        else gpu_rows(shapes, dtypes, repeats)
    )
    if gpu:
        rows += gpu
    print(
        "\n| device | op | shape | dtype | style | ms | GB/s | copy GB/s | of ceiling "
        "| of streaming copy | vs numpy |"
    )
    print("|---|---|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['device']} | {r['op']} | {r['shape']} | {r['dtype']} | {r['style']} | "
            f"{fmt(r['ms'], '.3f')} | {fmt(r['GB/s'], '.1f')} | {fmt(r['copy GB/s'], '.1f')} | "
            f"{fmt(r['of ceiling'], '.2f')} | {fmt(r.get('of streaming copy'), '.2f')} | "
            f"{fmt(r.get('vs numpy') or r.get('host us'), '.1f')} |"
        )
    if gpu is None:
        print("\n(no GPU rows: CuPy is not installed or sees no GPU)")
    for r in gpu or []:
        if "error" in r:
            print(f"GPU {r['op']} {r['shape']} {r['dtype']} {r['style']} failed: {r['error']}")
    dask_line = None
    if not args.no_dask and not args.no_cpu:
        # In its own process: this one holds large arrays by now, which skews the cluster.
        command = [sys.executable, os.path.join(HERE, "dask_bench.py")]
        if args.quick:
            command += ["--gb", "1"]
        done = subprocess.run(command, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("dask:")]
        dask_line = lines[-1] if lines else f"(no Dask row: {done.stderr.strip()[-300:]})"
        print("\n" + dask_line)
    if args.write and not args.no_cpu:
        cold = {"import_s": import_s, "first_call_s": first_call_s, "cold_s": first[1]}
        report.write(
            args.write,
            info,
            cold,
            decode,
            rows,
            sweep,
            (against, accuracy, long_context, matrix, row_cost, fused, llama, compiled, stores),
            dask_line,
            date,
        )
        print(f"\nwrote {args.write} and its plots")
    print(f"\ntotal {time.time() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"rows": rows, "import_s": import_s, "first_call_s": first_call_s},
                f,
                default=str,
                indent=1,
            )


if __name__ == "__main__":
    main()
