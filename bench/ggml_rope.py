"""arrayrope against llama.cpp's rope: ggml's ``ggml_rope_ext`` on the same arrays, timed in
turns in one run. Both rotate a (T, H, d) float32 tensor of tokens by positions (T,) in NeoX
pairs (arrayrope's half style), base 10,000, into a second tensor: ggml's own input and output
tensors, which arrayrope reads and writes as NumPy views.

    pip install ggml-python   # builds ggml from source: a few minutes
    python bench/ggml_rope.py
    python bench/ggml_rope.py --quick

ggml runs each graph on a thread pool of its own, made once per case, with as many threads as
Numba's (two, for the prefill rows) or one (decode rows, where it is fastest). Where ggml is not
installed, the script says so and exits 0. ``bench/bench.py`` prints the same rows.
"""

import argparse
import ctypes
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

# (name, T, H, first position, positions step): prefill rows one position per token from the
# first on, decode rows one token, a batch eight tokens at scattered large positions (step 0)
CASES = [
    ("prefill below the cache", 8192, 32, 0, 1),
    ("prefill across the cache's cap", 1 << 17, 8, 0, 1),
    ("prefill at positions from 10**6", 1 << 15, 8, 10**6, 1),
    ("prefill at positions from 2**30", 1 << 15, 8, 1 << 30, 1),
    ("decode at position 1,000", 1, 32, 1_000, 1),
    ("decode at position 10**6", 1, 32, 10**6, 1),
    ("decode at position 2**31 - 1", 1, 32, 2**31 - 1, 1),
    ("batch of 8 tokens at large positions", 8, 32, None, 0),
]
HEAD_DIM = 128


class GgmlRope:
    """One ggml graph of ``ggml_rope_ext`` over a (T, H, HEAD_DIM) float32 tensor, with its
    input, positions and output as NumPy views and a plan on a thread pool of its own."""

    def __init__(self, ggml, tokens, heads, threads):
        self.ggml = ggml
        nbytes = tokens * heads * HEAD_DIM * 4
        size = 2 * nbytes + 4 * tokens + 8 * ggml.ggml_tensor_overhead()
        size += ggml.ggml_graph_overhead() + (1 << 20)
        self.ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=size, mem_buffer=None))
        a = ggml.ggml_new_tensor_3d(self.ctx, ggml.GGML_TYPE_F32, HEAD_DIM, heads, tokens)
        b = ggml.ggml_new_tensor_1d(self.ctx, ggml.GGML_TYPE_I32, tokens)
        neox = ggml.GGML_ROPE_TYPE_NEOX
        r = ggml.ggml_rope_ext(
            self.ctx, a, b, None, HEAD_DIM, neox, 0, 10000.0, 1.0, 0.0, 1.0, 0.0, 0.0
        )
        self.graph = ggml.ggml_new_graph(self.ctx)
        ggml.ggml_build_forward_expand(self.graph, r)
        shape = (tokens, heads, HEAD_DIM)
        self.x, self.out = _view(ggml, a, shape, np.float32), _view(ggml, r, shape, np.float32)
        self.pos = _view(ggml, b, (tokens,), np.int32)
        self.pool = None
        if threads > 1:
            params = ggml.ggml_threadpool_params_default(threads)
            self.pool = ggml.ggml_threadpool_new(ctypes.byref(params))
        self.plan = ggml.ggml_graph_plan(self.graph, threads, self.pool)
        if self.plan.work_size:
            self.work = (ctypes.c_uint8 * self.plan.work_size)()
            self.plan.work_data = ctypes.cast(self.work, ctypes.POINTER(ctypes.c_uint8))

    def __call__(self):
        self.ggml.ggml_graph_compute(self.graph, ctypes.byref(self.plan))

    def close(self):
        if self.pool is not None:
            self.ggml.ggml_threadpool_free(self.pool)
        self.ggml.ggml_free(self.ctx)


def _view(ggml, tensor, shape, dtype):
    address = ggml.ggml_get_data(tensor)
    count = int(np.prod(shape))
    buffer = (ctypes.c_byte * (count * np.dtype(dtype).itemsize)).from_address(address)
    return np.frombuffer(buffer, dtype).reshape(shape)


def rows(rounds=5):
    """[(case, T, H, arrayrope us, ggml us, largest difference at positions below 2**12)], or
    None where ggml is not installed."""
    from bench import best_per_call

    try:
        import ggml
    except ImportError:
        return None
    import numba

    import arrayrope as ar

    rope = ar.RoPE(HEAD_DIM, style="half")
    rng = np.random.default_rng(0)
    found = []
    for name, tokens, heads, first, step in CASES:
        threads = 1 if tokens == 1 else numba.get_num_threads()
        g = GgmlRope(ggml, tokens, heads, threads)
        try:
            g.x[...] = rng.standard_normal(g.x.shape, dtype=np.float32)
            if first is None:
                g.pos[...] = rng.integers(100_000, 2**31, tokens)
            else:
                g.pos[...] = first + step * np.arange(tokens)
            pos = g.pos.astype(np.int64)[:, None]
            g()
            theirs = g.out.copy()
            rope.rotate(g.x, pos, out=g.out)
            small = g.pos < 1 << 12
            diff = float(np.abs(theirs[small] - g.out[small]).max()) if small.any() else None
            calls = 200 if tokens <= 8 else max(1, (1 << 22) // (tokens * heads * HEAD_DIM))
            best = best_per_call(
                {"ours": lambda: rope.rotate(g.x, pos, out=g.out), "ggml": g},
                rounds,
                calls,
            )
            found.append((name, tokens, heads, best["ours"] * 1e6, best["ggml"] * 1e6, diff))
        finally:
            g.close()
    return found


def report(found):
    if found is None:
        return (
            "ggml is not installed (pip install ggml-python): no comparison with llama.cpp's rope"
        )
    lines = [
        f"(T, H, {HEAD_DIM}) float32 rotated into a second tensor, NeoX pairs, us per call:",
        "  case                                       T     H    arrayrope       ggml  ggml / ours",
    ]
    for name, tokens, heads, ours, theirs, _ in found:
        times = f"{ours:11.1f} {theirs:10.1f} {theirs / ours:11.2f}"
        lines.append(f"  {name:38s} {tokens:>8,} {heads:4d} {times}")
    diffs = [d for *_, d in found if d is not None]
    if diffs:
        lines.append(
            f"  largest difference between the two at positions below 2**12: {max(diffs):.1e} "
            "(ggml's float32 angles)"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    args = parser.parse_args()
    print(report(rows(3 if args.quick else 7)))


if __name__ == "__main__":
    main()
