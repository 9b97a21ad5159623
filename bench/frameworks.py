"""arrayrope against the same rotation written in NumPy, PyTorch (eager and torch.compile) and
JAX (jax.jit), where installed, and the float32 accuracy of arrayrope against the common
float32-angle formula. Used by bench.py; each piece also runs alone:

    python bench/frameworks.py
"""

import time

import numpy as np

SHAPE = (1, 32, 2048, 128)  # a prefill of 2048 tokens, 32 heads
DECODE = (1, 32, 1, 128)
BATCH = (4, 32, 2048, 128)  # a batch of prefills, for JAX's jit


def _best(fn, repeats, calls=1):
    fn()
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def _torch_formula(torch):
    """The rotation as transformers' models write it: cos/sin of float32 angles, rotate_half."""

    def rotate(x, pos, inv_freq):
        freqs = pos[:, None].float() * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    return rotate


def _jax_formula(jnp):
    def rotate(x, pos, inv_freq):
        freqs = pos[:, None].astype(jnp.float32) * inv_freq[None, :]
        emb = jnp.concatenate((freqs, freqs), axis=-1)
        cos, sin = jnp.cos(emb), jnp.sin(emb)
        half = x.shape[-1] // 2
        rotated = jnp.concatenate((-x[..., half:], x[..., :half]), axis=-1)
        return x * cos + rotated * sin

    return rotate


def framework_rows(repeats=7):
    """Seconds per call of each implementation, for a prefill and a decode step (float32,
    half style), each against arrayrope in the same run. Rows: (shape, name, seconds)."""
    import arrayrope as ar

    rope = ar.RoPE(128, style="half")
    rows = []
    for shape in (SHAPE, DECODE, BATCH):
        decode = shape == DECODE
        calls = 200 if decode else 1
        x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        pos = np.arange(shape[2], dtype=np.int64) + (1234 if decode else 0)
        p = 1234 if decode else None
        timings = {
            "arrayrope (NumPy array)": lambda: rope.rotate(x, p if decode else pos),
            "NumPy formula (arrayrope's reference)": lambda: rope.rotate(x, pos, backend="numpy"),
        }
        try:
            import torch

            if shape == BATCH:
                raise ImportError  # the batch rows are JAX's
            t = torch.from_numpy(x)
            tpos = torch.from_numpy(pos)
            inv = torch.tensor(rope.inv_freq, dtype=torch.float32)
            formula = _torch_formula(torch)
            compiled = torch.compile(formula)
            # arrayrope inside a compiled step: the position as a tensor, as a model passes it
            compiled_ours = torch.compile(lambda t, tpos: rope.rotate(t, tpos), fullgraph=True)
            timings["arrayrope (torch tensor)"] = lambda: rope.rotate(t, p if decode else tpos)
            timings["PyTorch eager formula"] = lambda: formula(t, tpos, inv)
            timings["torch.compile formula"] = lambda: compiled(t, tpos, inv)
            timings["arrayrope under torch.compile"] = lambda: compiled_ours(t, tpos)
        except Exception:  # noqa: BLE001 - torch missing, or torch.compile unavailable here
            pass
        try:
            import jax
            import jax.numpy as jnp

            j = jnp.asarray(x)
            jpos = jnp.asarray(pos.astype(np.int32))
            jinv = jnp.asarray(rope.inv_freq, dtype=jnp.float32)
            jitted = jax.jit(_jax_formula(jnp))
            jitted_ours = jax.jit(lambda j, jpos: rope.rotate(j, jpos))
            timings["arrayrope (JAX array)"] = lambda: rope.rotate(j, p if decode else jpos)
            timings["jax.jit formula"] = lambda: jitted(j, jpos, jinv).block_until_ready()
            timings["arrayrope under jax.jit"] = lambda: jitted_ours(j, jpos).block_until_ready()
        except Exception:  # noqa: BLE001 - JAX missing
            pass
        for name, fn in timings.items():
            try:
                rows.append((shape, name, _best(fn, repeats, calls)))
            except Exception as error:  # noqa: BLE001 - reported, not fatal
                rows.append((shape, f"{name} (failed: {type(error).__name__})", None))
    return rows


COMPILED_ROWS = (1, 4, 16, 256, 2048)


def compiled_sweep(repeats=5):
    """Under torch.compile (fullgraph), x (1, 32, T, 128) float32 with tensor positions: seconds
    per call of the compiled formula, of arrayrope as it runs there (torch operations for
    Inductor up to ``_torch_lowered.SMALL`` elements, the operator past it) and of arrayrope's
    operator called in the compiled function at every size, the three taking turns in each
    round (best of ``repeats`` rounds). Rows: (T, formula, arrayrope, operator); none without
    torch."""
    try:
        import torch
    except ImportError:
        return []
    import arrayrope as ar

    rope = ar.RoPE(128, style="half")
    inv = torch.tensor(rope.inv_freq, dtype=torch.float32)
    key = rope._engine.key
    rope.rotate(torch.zeros(1, 128, requires_grad=True), 0)  # registers the operators
    operator = torch.ops.arrayrope.rotate_nograd.default
    rows = []
    for rows_t in COMPILED_ROWS:
        x = torch.randn(1, 32, rows_t, 128)
        pos = torch.arange(rows_t) + 1234
        calls = max(1, 64 // rows_t)
        torch._dynamo.reset()
        formula = torch.compile(_torch_formula(torch))
        ours = torch.compile(lambda t, p: rope.rotate(t, p), fullgraph=True)
        through = torch.compile(
            lambda t, p: operator(t, p, None, None, key, False, "auto", None), fullgraph=True
        )
        cases = (lambda: formula(x, pos, inv), lambda: ours(x, pos), lambda: through(x, pos))
        best = [float("inf")] * len(cases)
        for fn in cases:
            fn()
            fn()
        for round_ in range(repeats):
            # each round the other way round: right after torch's own parallel code, its
            # threads still spin for a while and slow the kernels' threads on a small machine
            order = list(enumerate(cases))
            for i, fn in order if round_ % 2 == 0 else order[::-1]:
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                best[i] = min(best[i], (time.perf_counter() - start) / calls)
        rows.append((rows_t, *best))
    return rows


def float64_rotation(x, pos, inv_freq):
    angle = np.float64(pos) * inv_freq
    a, b = x[..., 0::2].astype(np.float64), x[..., 1::2].astype(np.float64)
    out = np.empty(x.shape, np.float64)
    out[..., 0::2] = a * np.cos(angle) - b * np.sin(angle)
    out[..., 1::2] = b * np.cos(angle) + a * np.sin(angle)
    return out


def float32_angle_rotation(x, pos, inv_freq):
    angle = np.float32(pos) * inv_freq.astype(np.float32)  # the float32 angle: the usual formula
    c, s = np.cos(angle), np.sin(angle)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = b * c + a * s
    return out


def accuracy_rows():
    """(position, arrayrope max error, float32-angle formula max error, one float32 ulp of the
    largest |x|) for positions 10^1 ... 10^7, head_dim 128, base 10000, 256 vectors."""
    import arrayrope as ar

    x = np.random.default_rng(0).standard_normal((256, 128)).astype(np.float32)
    inv_freq = 10000.0 ** (-np.arange(0, 128, 2) / 128)
    ulp = float(np.spacing(np.float32(np.abs(x).max())))
    rows = []
    for pos in np.unique(np.logspace(1, 7, 25).astype(np.int64)):
        exact = float64_rotation(x, int(pos), inv_freq)
        ours = float(np.abs(ar.rotate(x, int(pos)).astype(np.float64) - exact).max())
        common = np.abs(float32_angle_rotation(x, pos, inv_freq).astype(np.float64) - exact)
        rows.append((int(pos), ours, float(common.max()), ulp))
    return rows


if __name__ == "__main__":
    for shape, name, seconds in framework_rows():
        print(f"{shape} {name:40s} {'-' if seconds is None else f'{seconds * 1e6:10.1f} us'}")
    for rows_t, formula, ours, operator in compiled_sweep():
        print(f"torch.compile T={rows_t:5d}: formula {formula * 1e6:9.1f} us, arrayrope "
              f"{ours * 1e6:9.1f} us, through the operator {operator * 1e6:9.1f} us")  # fmt: skip
    for pos, ours, common, ulp in accuracy_rows():
        print(f"position {pos:>9}: arrayrope {ours / ulp:6.2f} ulps, float32 angles {common:.3g}")
