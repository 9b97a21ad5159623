"""Dask row: rotate an array larger than one process comfortably holds, on a local cluster.

The input (default 4.3 GB of float32, (32, 32, 8192, 128)) is generated chunk by chunk on the
workers, rotated chunk by chunk, and reduced to one number, so no process ever holds it whole.
Prints throughput (bytes of x per second) next to the pipeline without the rotation and next to
the single-process kernel on one chunk, and the peak resident memory of each worker.

    python bench/dask_bench.py [--gb 4]
"""

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _peak_rss_mb():
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def run(gb=4.3, workers=2):
    import dask.array as da
    from distributed import Client, LocalCluster

    import arrayrope as ar

    batch = max(2, int(round(gb * 2**30 / (32 * 8192 * 128 * 4))))
    shape, chunks = (batch, 32, 8192, 128), (1, 32, 2048, 128)  # 32 MiB chunks
    nbytes = int(np.prod(shape)) * 4
    cluster = LocalCluster(
        n_workers=workers,
        threads_per_worker=1,
        processes=True,
        dashboard_address=None,
        memory_limit="6GB",
    )
    client = Client(cluster)
    try:
        rope = ar.RoPE(128, style="half")
        # Real chunks: da.ones alone yields zero-stride broadcast views, which no kernel can write
        # through; np.array materializes each chunk on its worker (the baseline pays it too).
        x = da.ones(shape, chunks=chunks, dtype=np.float32).map_blocks(np.array, dtype=np.float32)
        pos = np.arange(8192)
        client.compute(rope.rotate(x[:1], pos).sum()).result()  # warm the workers' kernels
        start = time.perf_counter()
        baseline = client.compute(x.sum()).result()
        t_base = time.perf_counter() - start
        start = time.perf_counter()
        total = client.compute(rope.rotate(x, pos).sum()).result()
        t_rope = time.perf_counter() - start
        peaks = client.run(_peak_rss_mb)
    finally:
        client.close()
        cluster.close()
    chunk = np.ones(chunks, np.float32)
    out = np.empty_like(chunk)
    chunk_pos = pos[: chunks[2]]
    rope.rotate(chunk, chunk_pos, out=out)
    start = time.perf_counter()
    for _ in range(5):
        rope.rotate(chunk, chunk_pos, out=out)
    t_chunk = (time.perf_counter() - start) / 5
    assert np.isfinite(total) and np.isfinite(baseline)
    return {
        "bytes": nbytes,
        "workers": workers,
        "generate+rotate+sum s": t_rope,
        "generate+sum s": t_base,
        "dask GB/s": nbytes / t_rope / 1e9,
        "dask GB/s without rotation": nbytes / t_base / 1e9,
        "single-process kernel GB/s": 2 * chunk.nbytes / t_chunk / 1e9,
        "worker peak MB": sorted(round(v) for v in peaks.values()),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=4.3)
    args = parser.parse_args()
    r = run(args.gb)
    print(
        f"dask: {r['bytes'] / 1e9:.1f} GB float32 on {r['workers']} worker processes: "
        f"generate+rotate+sum {r['generate+rotate+sum s']:.2f} s = {r['dask GB/s']:.2f} GB/s "
        f"of x (generate+sum alone {r['dask GB/s without rotation']:.2f} GB/s); "
        f"single-process kernel on one 32 MiB chunk {r['single-process kernel GB/s']:.1f} GB/s "
        f"(read+write); worker peak RSS {r['worker peak MB']} MB"
    )


if __name__ == "__main__":
    main()
