"""One command for a CUDA machine: the GPU tests, then the GPU benchmark, a short table last.

    python bench/gpu_check.py            # about 2 to 4 minutes on an H200

Runs from the source tree (no install needed where numpy, numba, numba-cuda, cupy, ml_dtypes,
pytest and hypothesis are present). Exits non-zero if a GPU test fails.
"""

import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main():
    start = time.time()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    tests = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            # the GPU's own tests only: tests/test_cuda_source.py needs no GPU and runs in CI
            "tests/test_gpu.py",
            "tests/test_cuda_numba.py",
        ],
        cwd=ROOT,
        env=env,
    )
    import cupy
    import ml_dtypes
    import numpy as np

    from bench.bench import gpu_rows

    try:
        cupy.zeros(2, dtype=ml_dtypes.bfloat16)
        bf16 = "yes"
    except Exception as error:  # noqa: BLE001 - reported, not raised
        bf16 = f"no ({type(error).__name__})"
    device = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    rows = gpu_rows(
        [(4, 32, 2048, 128), (8, 32, 4096, 128)],
        [np.float32, np.float16, ml_dtypes.bfloat16],
        repeats=20,
    )
    print(
        f"\n# {device}, CuPy {cupy.__version__}, CuPy holds bfloat16 arrays: {bf16}; "
        f"tests {'passed' if tests.returncode == 0 else 'FAILED'}; {time.time() - start:.0f} s"
    )
    print(table(rows))
    length = 32768
    print(
        f"\n(1, 8, {length}, 128) float32 rotate out=, int64 device positions start..start+T-1"
        " (start 0: the device's table; the others past it), us per call:"
    )
    sweep = position_sweep(cupy, np, length)
    for start, us in sweep.items():
        print(f"  start {start:>13,}: {us:9.1f} us  ({us / sweep[0]:.2f}x)")
    print(
        "\nrotate_into_cache (q 32 heads, k and v 8, d 128, NHD cache of 16-slot blocks) against "
        "rotate_qk out= and two scatters, and a copy of the projection, us per call:"
    )
    dtypes = [np.float32] + ([ml_dtypes.bfloat16] if bf16 == "yes" else [])
    for (step, dtype), r in fused_steps(cupy, np, dtypes=dtypes).items():
        if "error" in r:
            print(f"  {step:8s} {dtype:9s} FAILED {r['error']}")
            continue
        print(
            f"  {step:8s} {dtype:9s} fused {r['fused']:9.1f}  unfused {r['unfused']:9.1f} "
            f"({r['unfused'] / r['fused']:.2f}x)  copy {r['copy']:9.1f} "
            f"({r['copy'] / r['fused']:.2f} of it)  same bits: {r['same']}"
        )
    print("\nhost-device traffic per decode call (1, 32, 1, 128) float32, counted over 100 calls:")
    for name, counts in decode_traffic(cupy, np).items():
        shown = (f"{k} {v:.2f}" if isinstance(v, float) else f"{k}: {v}" for k, v in counts.items())
        print(f"  {name:36s} " + ", ".join(shown))
    sys.exit(tests.returncode)


def position_sweep(cupy, np, length, repeats=20):
    """{start: us per call} of (1, 8, length, 128) float32 ``rope.rotate(x, pos, out=o)`` with
    int64 device positions start..start+length-1: rows from the device's table at start 0, and
    from the level tables in the kernel past it."""
    import arrayrope as ar

    rope = ar.RoPE(128)
    x = cupy.asarray(np.random.default_rng(0).standard_normal((1, 8, length, 128), np.float32))
    out = cupy.empty_like(x)
    found = {}
    for start in (0, 10**5, 10**6, 10**7, 2**31 - length):
        pos = cupy.asarray(np.arange(start, start + length, dtype=np.int64))
        rope.rotate(x, pos, out=out)  # compiled, tables on the device
        cupy.cuda.Device().synchronize()
        begin = time.perf_counter()
        for _ in range(repeats):
            rope.rotate(x, pos, out=out)
        cupy.cuda.Device().synchronize()
        found[start] = (time.perf_counter() - begin) / repeats * 1e6
    return found


def fused_steps(cupy, np, dtypes, steps=(("prefill", 2048), ("decode", 32)), repeats=20):
    """{(step, dtype name): {"fused", "unfused", "copy": us per call, "same": whether the two
    steps wrote the same bits}} of ``rope.rotate_into_cache`` on N tokens (q, k and v views of
    one projection, half style, prefill into consecutive slots, decode at mixed positions into
    scattered ones), of ``rotate_qk`` with ``out=`` followed by scatters of k and v, and of a
    copy of the projection (the bytes the fused step reads and writes once each); a failure
    costs its own entry, as {"error": ...}."""
    import arrayrope as ar

    hq, hkv, d, block = 32, 8, 128, 16
    rope = ar.RoPE(d, style="half")
    rng = np.random.default_rng(0)
    found = {}
    for step, n in steps:
        for dtype in dtypes:
            name = np.dtype(dtype).name
            try:
                qkv = cupy.asarray(rng.standard_normal((n, (hq + 2 * hkv) * d)).astype(dtype))
                q = qkv[:, : hq * d].reshape(n, hq, d)
                k = qkv[:, hq * d : (hq + hkv) * d].reshape(n, hkv, d)
                v = qkv[:, (hq + hkv) * d :].reshape(n, hkv, d)
                blocks = n // block + 64
                caches = [cupy.zeros((blocks, block, hkv, d), dtype) for _ in range(4)]
                if step == "decode":
                    host_pos = rng.integers(0, 30_000, n)
                    host_slots = rng.permutation(blocks * block)[:n]
                else:
                    host_pos, host_slots = np.arange(n) + 100, np.arange(n) + 4 * block
                pos, slots = cupy.asarray(host_pos), cupy.asarray(host_slots)
                per_token = pos[:, None]
                q_fused, q_out, k_out = cupy.empty_like(q), cupy.empty_like(q), cupy.empty_like(k)
                rows = [c.reshape(-1, hkv, d) for c in caches[2:]]
                copy_to = cupy.empty_like(qkv)

                def fused():
                    rope.rotate_into_cache(q, k, v, pos, caches[0], caches[1], slots, out=q_fused)

                def unfused():
                    rope.rotate_qk(q, k, per_token, out=(q_out, k_out))
                    rows[0][slots] = k_out
                    rows[1][slots] = v

                def copy():
                    cupy.copyto(copy_to, qkv)

                times = {}
                for label, call in (("fused", fused), ("unfused", unfused), ("copy", copy)):
                    call()
                    cupy.cuda.Device().synchronize()
                    begin = time.perf_counter()
                    for _ in range(repeats):
                        call()
                    cupy.cuda.Device().synchronize()
                    times[label] = (time.perf_counter() - begin) / repeats * 1e6
                written = zip((q_fused, *caches[:2]), (q_out, *caches[2:]))
                same = all(bool((a.view(np.uint8) == b.view(np.uint8)).all()) for a, b in written)
                found[step, name] = times | {"same": "yes" if same else "NO"}
            except Exception as error:  # noqa: BLE001 - reported
                found[step, name] = {"error": f"{type(error).__name__}: {error}"[:160]}
    return found


def decode_traffic(cupy, np, calls=100):
    """Per decode call, (1, 32, 1, 128) float32: copies to the device (pageable, and queued
    from pinned memory), copies to the host and synchronizations, counted by wrapping CuPy's
    entry points for them (after a warm-up call of each kind; an entry point CuPy does not let
    be wrapped is named, not counted), and whether the call can be captured in a CUDA graph,
    which fails on any synchronization or copy from pageable memory."""
    import arrayrope as ar

    counts = {}

    def counting(kind, function):
        def wrapper(*args, **kwargs):
            counts[kind] = counts.get(kind, 0) + 1
            return function(*args, **kwargs)

        return wrapper

    rope = ar.RoPE(128)
    x = cupy.asarray(np.random.default_rng(0).standard_normal((1, 32, 1, 128)), np.float32)
    out = cupy.empty_like(x)
    pair = cupy.asarray(np.random.default_rng(0).standard_normal((1, 32, 2, 128)), np.float32)
    pair_out = cupy.empty_like(pair)
    device_pos = cupy.asarray([1234])
    far_pos = cupy.asarray([100000])  # past the 65536 rows of the table
    cases = {
        "int position, out=": lambda: rope.rotate(x, 1234, out=out),
        "default positions": lambda: rope.rotate(x, out=out),
        "one host position": lambda: rope.rotate(x, np.array([1234]), out=out),
        "two host positions": lambda: rope.rotate(pair, np.array([7, 8]), out=pair_out),
        "device position array": lambda: rope.rotate(x, device_pos, out=out),
        "device position past the table": lambda: rope.rotate(x, far_pos, out=out),
        "numba-cuda, int position": lambda: rope.rotate(x, 1234, out=out, backend="numba-cuda"),
        "numba-cuda, device positions": lambda: rope.rotate(
            x, device_pos, out=out, backend="numba-cuda"
        ),
    }
    patches = [
        (cupy, "asarray", "to device"),
        (cupy.ndarray, "set", "to device (queued)"),
        (cupy.ndarray, "get", "to host"),
        (cupy.ndarray, "item", "to host"),
        (cupy.cuda.Stream, "synchronize", "syncs"),
        (cupy.cuda.Device, "synchronize", "syncs"),
    ]
    found = {}
    for name, call in cases.items():
        try:
            call()  # warm: compiled, tables and kept arrays on the device
        except Exception as error:  # noqa: BLE001 - reported
            found[name] = {"error": f"{type(error).__name__}: {error}"[:120]}
            continue
        saved = []
        counts.clear()
        try:
            for owner, attr, kind in patches:
                try:
                    original = getattr(owner, attr)
                    setattr(owner, attr, counting(kind, original))
                except (TypeError, AttributeError):
                    counts.setdefault("not counted", [])
                    counts["not counted"].append(f"{getattr(owner, '__name__', owner)}.{attr}")
                    continue
                saved.append((owner, attr, original))
            for _ in range(calls):
                call()
        except Exception as error:  # noqa: BLE001 - reported
            counts["error"] = f"{type(error).__name__}"
        finally:
            for owner, attr, original in saved:
                setattr(owner, attr, original)
        result = {k: (v / calls if isinstance(v, int) else v) for k, v in counts.items()}
        result["graph capture"] = _captures(cupy, call)
        found[name] = result
    return found


def _captures(cupy, call):
    """ "yes" where ``call`` can be captured in a CUDA graph, else why not."""
    stream = cupy.cuda.Stream(non_blocking=True)
    outcome = "yes"
    with stream:
        call()
        stream.synchronize()
        stream.begin_capture()
        try:
            call()
        except Exception as error:  # noqa: BLE001 - reported
            outcome = f"no ({type(error).__name__})"
        finally:
            try:
                stream.end_capture()
            except Exception as error:  # noqa: BLE001 - reported
                if outcome == "yes":
                    outcome = f"no ({type(error).__name__})"
    return outcome


def table(rows):
    """The benchmark rows as a Markdown table, failed cases listed after it."""

    def f(r, key, spec):
        return "-" if r.get(key) is None else format(r[key], spec)

    lines = [
        "| op | shape | dtype | style | us | GB/s | copy GB/s | of copy | host us/call | entry |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows or []:
        us = None if r["ms"] is None else r["ms"] * 1e3
        lines.append(
            f"| {r['op']} | {r['shape']} | {r['dtype']} | {r['style']} | "
            f"{'-' if us is None else format(us, '.1f')} | {f(r, 'GB/s', '.0f')} | "
            f"{f(r, 'copy GB/s', '.0f')} | {f(r, 'of ceiling', '.2f')} | "
            f"{f(r, 'host us', '.1f')} | {r.get('entry') or '-'} |"
        )
    lines += [
        f"FAILED {r['op']} {r['shape']} {r['dtype']} {r['style']}: {r['error']}"
        for r in rows or []
        if "error" in r
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
