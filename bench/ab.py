"""A/B: this working tree's arrayrope against a git revision's, alternating in one process.

On a shared machine the copy ceiling moves by 2x between minutes, so a change is judged by
timing both versions in alternation, round after round, and comparing medians. The revision is
extracted (git archive) as the package ``arrayrope_base`` into a temporary folder; each version
keeps its own Numba disk cache, so the first run compiles both.

    python bench/ab.py HEAD~3            # large and (1, 32, 512, 128) tensors (out=, in
                                         # place), multi-axis and decode rows, the
                                         # fused inference step
    python bench/ab.py main --quick      # fewer rounds
    python bench/ab.py HEAD --only decode
"""

import argparse
import importlib
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)


def base_package(revision, folder):
    """Extract ``revision``'s arrayrope/ into ``folder`` as the package arrayrope_base."""
    archive = subprocess.run(
        ["git", "-C", ROOT, "archive", revision, "arrayrope"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    os.rename(os.path.join(folder, "arrayrope"), os.path.join(folder, "arrayrope_base"))
    sys.path.insert(0, folder)
    return importlib.import_module("arrayrope_base")


def cases(ar, rng_seed=0):
    """name -> zero-argument call, for one version of the package."""
    import ml_dtypes

    rng = np.random.default_rng(rng_seed)
    shape = (4, 32, 2048, 128)
    found = {}
    middle = (1, 32, 512, 128)  # 8 MiB of float32: in this VM's last-level cache
    for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
        x = rng.standard_normal(shape).astype(dtype)
        out = np.empty_like(x)
        y = x.copy()  # rotated in place, call after call
        mid = x[:1, :, :512].copy()
        mid_out, mid_y = np.empty_like(mid), mid.copy()
        for style in ("interleaved", "half"):
            rope = ar.RoPE(128, style=style)
            name = f"{np.dtype(dtype).name} {style}"
            found[f"rotate out= {name}"] = (
                lambda r=rope, x=x, out=out: r.rotate(x, out=out),
                2 * x.nbytes,
            )
            found[f"rotate in place {name}"] = (
                lambda r=rope, y=y: r.rotate(y, out=y),
                2 * y.nbytes,
            )
            found[f"{middle} rotate out= {name}"] = (
                lambda r=rope, x=mid, out=mid_out: r.rotate(x, out=out),
                2 * mid.nbytes,
            )
            found[f"{middle} rotate in place {name}"] = (
                lambda r=rope, y=mid_y: r.rotate(y, out=y),
                2 * mid.nbytes,
            )
    # partial rotary whose pair blocks are off the 16-byte grid (rows on it), 64 MiB
    for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
        for d, rotary in ((128, 50), (96, 38)):
            rows = (64 << 20) // (32 * d * np.dtype(dtype).itemsize)
            x = rng.standard_normal((1, 32, rows, d)).astype(dtype)
            out = np.empty_like(x)
            rope = ar.RoPE(d, style="half", rotary_dim=rotary)
            found[f"partial {d}/{rotary} out= {np.dtype(dtype).name}"] = (
                lambda r=rope, x=x, out=out: r.rotate(x, out=out),
                2 * x.nbytes,
            )
    # small heads and half rotary with pair blocks on the grid (the direct path's rows), 64 MiB
    for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
        for d, rotary in ((64, 64), (128, 64)):
            rows = (64 << 20) // (32 * d * np.dtype(dtype).itemsize)
            x = rng.standard_normal((1, 32, rows, d)).astype(dtype)
            out = np.empty_like(x)
            for style in ("interleaved", "half"):
                rope = ar.RoPE(d, style=style, rotary_dim=rotary)
                name = f"head {d}/{rotary} out= {np.dtype(dtype).name} {style}"
                found[name] = (lambda r=rope, x=x, out=out: r.rotate(x, out=out), 2 * x.nbytes)
    x = rng.standard_normal(shape).astype(np.float32)
    out = np.empty_like(x)
    pos = rng.integers(0, 64, (4, 1, 2048, 3))
    layouts = {
        "multi-axis axial (16, 56, 56)": ar.RoPE.axial((16, 56, 56)),
        "multi-axis sectioned (16, 24, 24)": ar.RoPE.sectioned(128, (16, 24, 24)),
        "multi-axis Qwen3-VL (24, 20, 20)": ar.RoPE.sectioned(
            128, (24, 20, 20), assign="interleaved"
        ),
    }
    for name, rope in layouts.items():
        found[name] = (lambda r=rope: r.rotate(x, pos, out=out), 2 * x.nbytes)
    step = rng.standard_normal((1, 32, 1, 128)).astype(np.float32)
    decode = ar.RoPE(128)
    at = np.array([5])
    found["decode RoPE.rotate(x, int)"] = (lambda: decode.rotate(step, 5), None)
    found["decode arrayrope.rotate(x, int)"] = (lambda: ar.rotate(step, 5), None)
    k_step = rng.standard_normal((1, 8, 1, 128)).astype(np.float32)
    found["decode arrayrope.rotate_qk(q, k, int), 32 and 8 heads"] = (
        lambda: ar.rotate_qk(step, k_step, 5),
        None,
    )
    found["decode arrayrope.rotate(x, int, out=x)"] = (lambda: ar.rotate(step, 5, out=step), None)
    kv_cache = np.zeros((1, 8, 4096, 128), np.float32)
    found["decode arrayrope.rotate(k, int, out=KV-cache slice)"] = (
        lambda: ar.rotate(k_step, 5, out=kv_cache[:, :, 5:6]),
        None,
    )
    half_step = step.astype(np.float16)
    found["decode float16 arrayrope.rotate(x, int)"] = (lambda: ar.rotate(half_step, 5), None)
    found["decode RoPE.rotate(x, array)"] = (lambda: decode.rotate(step, at), None)
    batch = rng.standard_normal((8, 32, 1, 128)).astype(np.float32)
    each = rng.integers(0, 4096, (8, 1, 1))
    found["batched decode (8, 32, 1, 128), pos (8, 1, 1)"] = (
        lambda: decode.rotate(batch, each),
        None,
    )
    chunk = rng.standard_normal((1, 32, 16, 128)).astype(np.float32)
    chunk_pos = np.arange(1000, 1016)
    found["prefill chunk (1, 32, 16, 128), pos (16,)"] = (
        lambda: decode.rotate(chunk, chunk_pos),
        None,
    )
    fused = hasattr(ar.RoPE, "rotate_into_cache")  # a base revision may predate it
    for dtype in (np.float32, ml_dtypes.bfloat16) if fused else ():
        for label, n in (("prefill", 2048), ("decode", 32)):
            found[f"rotate_into_cache {label} {np.dtype(dtype).name}"] = _fused_step(
                ar, n, dtype, label == "decode"
            )
    return found


def _fused_step(ar, n, dtype, decode):
    """(the call, bytes moved) of a RoPE.rotate_into_cache step on bench/kv_cache.py's arrays
    (prefill, or decode tokens at mixed positions into scattered slots). Bytes None for decode
    (timed per call)."""
    from kv_cache import D, _arrays

    q, k, v, pos, k_cache, v_cache, slots, qkv = _arrays(n, dtype, decode)
    out = np.empty_like(q)
    rope = ar.RoPE(D, style="half")

    def step():
        rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots, out=out)

    return step, None if decode else 2 * qkv.nbytes


def timed(fn, calls):
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revision", help="git revision to compare against, e.g. HEAD~1")
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--only", default="", help="only the cases whose name contains this")
    args = parser.parse_args()
    rounds = 3 if args.quick else 7
    import arrayrope as new

    with tempfile.TemporaryDirectory() as folder:
        base = base_package(args.revision, folder)
        versions = {"base": cases(base), "new": cases(new)}
        print(f"# A/B: {args.revision} (base) against the working tree (new), {rounds} rounds")
        print("| case | base | new | new / base |")
        print("|---|---:|---:|---:|")
        for name in versions["new"]:
            if args.only not in name:
                continue
            calls = {v: versions[v][name] for v in versions if name in versions[v]}
            if len(calls) < 2:
                continue
            nbytes = calls["new"][1]
            repeat = max(1, (64 << 20) // nbytes) if nbytes else 2000  # calls per sample
            for fn, _ in calls.values():  # warm up: compile or load, build tables
                fn()
                fn()
            samples = {v: [] for v in calls}
            for _ in range(rounds):
                for v, (fn, _) in calls.items():
                    samples[v].append(min(timed(fn, repeat) for _ in range(2)))
            median = {v: float(np.median(s)) for v, s in samples.items()}
            ratio = median["base"] / median["new"]
            if nbytes:
                text = {v: f"{nbytes / t / 1e9:.1f} GB/s" for v, t in median.items()}
            else:
                text = {v: f"{t * 1e6:.2f} us" for v, t in median.items()}
            print(f"| {name} | {text['base']} | {text['new']} | {ratio:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
