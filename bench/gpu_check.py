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
    sys.exit(tests.returncode)


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
