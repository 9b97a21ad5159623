"""The fused inference step: ``RoPE.rotate_into_cache`` against the best unfused sequence and
against a copy of the bytes it moves, each measured in the same run.

    python bench/kv_cache.py           # prefill of 2048 tokens, a decode batch of 32
    python bench/kv_cache.py --quick   # fewer rounds
    python bench/kv_cache.py --jax --torch   # also a decode step on JAX arrays (jax.jit) and
                                             # on torch CPU tensors, against the NumPy step

q, k and v are views of one fused projection (N, (32 + 2*8) * 128); the caches are paged,
(blocks, 16, 8, 128) NHD; half style.

- unfused: ``rope.rotate_qk(q, k, pos, out=(q_out, k_out))``, then
  ``k_cache.reshape(-1, 8, 128)[slots] = k_out`` and the same for v;
- fused: ``rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots, out=q_out)``;
- copy: the fastest of np.copyto and a threaded Numba copy of the projection into a buffer of
  its size: the bytes the fused step reads and writes once each; and, on x86-64, the threaded
  copy with streaming stores (bench/bench.py's), a second, stricter ceiling where the fused
  step streams (a prefill too large for the cache).

Prefill: 2048 tokens at positions 100..2147 into consecutive slots (in bfloat16 a projection of
24 MiB, which a last-level cache of 32 MiB partly holds for the copy and for the step, whose
2-byte rows stream only from twice ARRAYROPE_STREAM_ABOVE), and 8192 tokens, whose
projection no such cache holds; decode: 32 tokens at mixed positions below 30,000, into slots
scattered over a 4096-slot cache, and the same 10**6 further on (past the cache of cos/sin
rows: each token's row made from the level tables once for the step's positions, which the
calls here repeat as the layers of one step do). With QK-norm, the same prefill of 2048 tokens
and decode with ``q_norm=`` and ``k_norm=`` weights (norm_eps 1e-6), the unfused step
normalizing q and k with NumPy in float32 first. ``bench/bench.py`` prints the same rows.
"""

import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

HQ, HKV, D, BLOCK = 32, 8, 128, 16
EPS = 1e-6  # the QK-norm's


def _arrays(n, dtype, decode, first=0):
    """q, k, v (views of one projection), positions, the caches and slots of one step, and the
    projection. ``first``: added to every position (past the cache of cos/sin rows at 10**6)."""
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((n, (HQ + 2 * HKV) * D)).astype(dtype)
    q = qkv[:, : HQ * D].reshape(n, HQ, D)
    k = qkv[:, HQ * D : (HQ + HKV) * D].reshape(n, HKV, D)
    v = qkv[:, (HQ + HKV) * D :].reshape(n, HKV, D)
    blocks = 256 if decode else n // BLOCK + 64
    k_cache = np.ones((blocks, BLOCK, HKV, D), dtype)  # touched: no page faults in the timing
    v_cache = np.ones_like(k_cache)
    if decode:
        pos = rng.integers(0, 30_000, n) + first
        slots = rng.permutation(blocks * BLOCK)[:n]
    else:
        pos = np.arange(n) + 100
        slots = np.arange(n) + 4 * BLOCK
    return q, k, v, pos, k_cache, v_cache, slots, qkv


def _case(n, dtype, decode, first=0, norm=False):
    """The arrays of one step and its callables: unfused, fused and the copies. ``norm``: q and
    k RMS-normalized per head first (QK-norm), the unfused step in NumPy, in float32."""
    from numba import njit, prange

    import arrayrope as ar
    from bench import streaming_copier

    @njit(parallel=True, cache=True)
    def threaded_copy(src, dst):
        for i in prange(src.size):
            dst[i] = src[i]

    rope = ar.RoPE(D, style="half")
    q, k, v, pos, k_cache, v_cache, slots, qkv = _arrays(n, dtype, decode, first)
    q_out, k_out = np.empty_like(q), np.empty_like(k)
    k_rows, v_rows = k_cache.reshape(-1, HKV, D), v_cache.reshape(-1, HKV, D)
    per_token = pos[:, None]  # every head at its token's position

    weight = np.random.default_rng(1).uniform(0.5, 1.5, D).astype(np.float32)
    options = {"q_norm": weight, "k_norm": weight, "norm_eps": EPS} if norm else {}

    def normed(x):
        x = x.astype(np.float32)
        mean = np.mean(x * x, axis=-1, keepdims=True)
        return (x / np.sqrt(mean + np.float32(EPS)) * weight).astype(dtype)

    def unfused():
        qn, kn = (normed(q), normed(k)) if norm else (q, k)
        rope.rotate_qk(qn, kn, per_token, out=(q_out, k_out))
        k_rows[slots] = k_out
        v_rows[slots] = v

    def fused():
        rope.rotate_into_cache(q, k, v, pos, k_cache, v_cache, slots, out=q_out, **options)

    src, dst = qkv.reshape(-1), np.empty(qkv.size, qkv.dtype)
    s8, d8 = src.view(np.uint8), dst.view(np.uint8)

    def copy():
        np.copyto(dst, src)

    def threaded():
        threaded_copy(s8, d8)

    calls = {"unfused": unfused, "fused": fused, "copy": copy, "threaded copy": threaded}
    streaming_copy = streaming_copier()
    if streaming_copy is not None:
        calls["streaming copy"] = lambda: streaming_copy(s8, d8)
    return calls


def rows(rounds):
    """[(step, dtype, fused us, unfused us, copy us, streaming copy us or None)] for prefill
    and decode (with QK-norm too), float32 and bfloat16."""
    import ml_dtypes

    from bench import best_per_call

    found = []
    steps = (  # (label, tokens, calls per round, decode, first position, norm)
        ("prefill", 2048, 1, False, 0, False),
        ("prefill 8192", 8192, 1, False, 0, False),
        ("decode", 32, 200, True, 0, False),
        ("decode from 10**6", 32, 200, True, 10**6, False),
        ("prefill, QK-norm", 2048, 1, False, 0, True),
        ("decode, QK-norm", 32, 200, True, 0, True),
    )
    for step, n, calls, decode, first, norm in steps:
        for dtype in (np.float32, ml_dtypes.bfloat16):
            case = _case(n, dtype, decode, first, norm)
            best = best_per_call(case, rounds, calls)
            ceiling = min(best["copy"], best["threaded copy"])
            streamed = best.get("streaming copy")
            found.append(
                (
                    step,
                    np.dtype(dtype).name,
                    best["fused"] * 1e6,
                    best["unfused"] * 1e6,
                    ceiling * 1e6,
                    None if streamed is None else streamed * 1e6,
                )
            )
    return found


def report(found):
    lines = [
        f"  {'step':19s} {'dtype':9s} {'fused us':>10s} {'unfused us':>11s} {'speedup':>8s} "
        f"{'copy us':>9s} {'of copy':>8s} {'of streaming copy':>18s}"
    ]
    for step, dtype, fused, unfused, copy, streamed in found:
        of_streamed = "-" if streamed is None else f"{streamed / fused:.2f}"
        lines.append(
            f"  {step:19s} {dtype:9s} {fused:10.1f} {unfused:11.1f} {unfused / fused:7.2f}x "
            f"{copy:9.1f} {copy / fused:8.2f} {of_streamed:>18s}"
        )
    return "\n".join(lines)


def jax_rows(rounds, n=32):
    """[(case, us per call)] of a decode step of n tokens on JAX arrays under jax.jit with the
    caches donated: rotate_into_cache, and rotate_qk followed by ``.at[slots].set`` of k and v;
    the NumPy step in the same run. None without JAX."""
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        return None
    import arrayrope as ar
    from bench import best_per_call

    rope = ar.RoPE(D, style="half")
    step = _case(n, np.float32, True)["fused"]
    q, k, v, pos, k_cache, v_cache, slots, _ = _arrays(n, np.float32, True)

    def unfused_step(q, k, v, pos, k_cache, v_cache, slots):
        q_rot, k_rot = rope.rotate_qk(q, k, pos[:, None])
        k_cache = k_cache.reshape(-1, HKV, D).at[slots].set(k_rot).reshape(k_cache.shape)
        v_cache = v_cache.reshape(-1, HKV, D).at[slots].set(v).reshape(v_cache.shape)
        return q_rot, k_cache, v_cache

    compiled = {
        "jax.jit rotate_into_cache": jax.jit(
            lambda *a: rope.rotate_into_cache(*a), donate_argnums=(4, 5)
        ),
        "jax.jit rotate_qk + .at[slots].set": jax.jit(unfused_step, donate_argnums=(4, 5)),
    }
    given = [jnp.asarray(a) for a in (q, k, v, pos.astype(np.int32))]
    given_slots = jnp.asarray(slots.astype(np.int32))
    calls = {"NumPy rotate_into_cache": step}
    for name, function in compiled.items():
        state = [jnp.asarray(k_cache), jnp.asarray(v_cache)]

        def call(function=function, state=state):
            result = function(*given, *state, given_slots)
            state[:] = result[1:]  # the donated caches' successors
            result[0].block_until_ready()

        calls[name] = call
    best = best_per_call(calls, rounds, 100)
    return [(name, seconds * 1e6) for name, seconds in best.items()]


def torch_rows(rounds, n=32):
    """[(case, us per call)] of a decode step of n tokens on plain torch CPU tensors (float32,
    views of the NumPy step's arrays, an eager call) and of the NumPy step, in the same run.
    None without torch."""
    try:
        import torch
    except ImportError:
        return None
    import arrayrope as ar
    from bench import best_per_call

    rope = ar.RoPE(D, style="half")
    q, k, v, pos, k_cache, v_cache, slots, _ = _arrays(n, np.float32, True)
    out = np.empty_like(q)
    arrays = (q, k, v, pos, k_cache, v_cache, slots)
    tensors = [torch.from_numpy(a) for a in arrays]
    out_tensor = torch.from_numpy(out)
    calls = {
        "NumPy rotate_into_cache": lambda: rope.rotate_into_cache(*arrays, out=out),
        "torch CPU tensors rotate_into_cache": (
            lambda: rope.rotate_into_cache(*tensors, out=out_tensor)
        ),
    }
    best = best_per_call(calls, rounds, 100)
    return [(name, seconds * 1e6) for name, seconds in best.items()]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--jax", action="store_true", help="also a decode step on JAX arrays")
    parser.add_argument(
        "--torch", action="store_true", help="also a decode step on torch CPU tensors"
    )
    args = parser.parse_args()
    print(
        f"rotate_into_cache, q {HQ} heads, k and v {HKV}, d {D}, NHD cache of {BLOCK}-slot "
        "blocks (best of rounds):"
    )
    print(report(rows(5 if args.quick else 15)))
    steps = [
        (args.jax, jax_rows, "caches donated", "JAX"),
        (args.torch, torch_rows, "out=", "torch"),
    ]
    for wanted, measure, how, package in steps:
        if wanted:
            found = measure(5 if args.quick else 15)
            print(f"\ndecode, 32 tokens, {how}, us per call:")
            if found is None:
                print(f"  {package} is not installed")
            for name, us in found or []:
                print(f"  {name:36s} {us:8.1f}")


if __name__ == "__main__":
    main()
