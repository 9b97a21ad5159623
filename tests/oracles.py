"""The test oracles, written from the paper independently of arrayrope, and the tolerances.

``oracle`` rotates with float64 angles m * theta_i and float64 arithmetic, pairs chosen by style;
``matrix_oracle`` builds R^d_{Theta,m} of RoFormer's Eq. 15. Plain functions, importable by the
subprocess workers as well as by the tests (conftest re-exports them).
"""

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]
# Bound on |result - float64 oracle| relative to the row's largest |x|: float32 and float64
# compute in their own precision (a few ulps); half types round once at the store (half an ulp).
REL_TOL = {
    np.dtype(np.float16): 2.0**-10,
    BF16: 2.0**-7,
    np.dtype(np.float32): 2.0**-21,
    np.dtype(np.float64): 2.0**-48,
}
ABS_TOL = {
    np.dtype(np.float16): 2.0**-24,
    BF16: 2.0**-126,
    np.dtype(np.float32): 1e-30,
    np.dtype(np.float64): 1e-300,
}


def inv_freq(rotary_dim, base=10000.0):
    return base ** (-2.0 * np.arange(rotary_dim // 2) / rotary_dim)


def default_positions(shape):
    lead = shape[:-1]
    return np.arange(lead[-1]) if lead else np.zeros(())


def oracle(
    x,
    pos=None,
    *,
    base=10000.0,
    style="interleaved",
    rotary_dim=None,
    inverse=False,
    scale=1.0,
    freqs=None,
):
    """The float64 rotation of x (..., d) at positions broadcastable to x.shape[:-1]."""
    x64 = np.asarray(x).astype(np.float64)
    d = x64.shape[-1]
    rot = d if rotary_dim is None else rotary_dim
    theta = inv_freq(rot, base) if freqs is None else np.asarray(freqs, np.float64)
    p = default_positions(x64.shape) if pos is None else np.asarray(pos, dtype=np.float64)
    angle = np.broadcast_to(p, x64.shape[:-1])[..., None] * theta
    if inverse:
        angle = -angle
    c, s = scale * np.cos(angle), scale * np.sin(angle)
    if style == "interleaved":
        first, second = np.arange(0, rot, 2), np.arange(1, rot, 2)
    else:
        first, second = np.arange(rot // 2), np.arange(rot // 2, rot)
    a, b = x64[..., first], x64[..., second]
    out = x64.copy()
    out[..., first] = a * c - b * s
    out[..., second] = b * c + a * s
    return out


def matrix_oracle(x, m, base=10000.0):
    """R^d_{Theta,m} x for one vector, the explicit block-diagonal matrix of Eq. 15 (float64)."""
    d = x.shape[-1]
    r = np.zeros((d, d))
    for i, theta in enumerate(inv_freq(d, base)):
        c, s = np.cos(m * theta), np.sin(m * theta)
        r[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = [[c, -s], [s, c]]
    return r @ np.asarray(x, np.float64)


def assert_matches(result, expected, x):
    """result (any dtype) is within the dtype's tolerance of the float64 ``expected``."""
    dtype = np.dtype(result.dtype)
    got = np.asarray(result).astype(np.float64)
    assert not np.isnan(got).any(), "unwritten (poisoned) or nan elements in the result"
    scale = np.abs(np.asarray(x).astype(np.float64)).max(axis=-1, keepdims=True)
    bound = REL_TOL[dtype] * scale + ABS_TOL[dtype]
    err = np.abs(got - expected)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), (
        f"{dtype}: error {err[worst]:.3g} > bound {bound[worst[:-1]][0]:.3g} at {worst}"
    )


def random_array(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def poisoned(shape, dtype):
    out = np.empty(shape, dtype)
    out[...] = np.nan
    return out


def bits(a):
    """The bytes of a, for bit-exact comparisons (nan payloads included)."""
    return np.ascontiguousarray(a).view(np.uint8)


def rotate_pairs64(x, angles, style, rotary_dim):
    """Rotate x's pairs by per-pair angles (float64), pairs chosen by style."""
    x64 = x.astype(np.float64)
    if style == "interleaved":
        a_idx, b_idx = np.arange(0, rotary_dim, 2), np.arange(1, rotary_dim, 2)
    else:
        a_idx, b_idx = np.arange(rotary_dim // 2), np.arange(rotary_dim // 2, rotary_dim)
    a, b = x64[..., a_idx], x64[..., b_idx]
    out = x64.copy()
    out[..., a_idx] = a * np.cos(angles) - b * np.sin(angles)
    out[..., b_idx] = b * np.cos(angles) + a * np.sin(angles)
    return out


def flux_oracle(x, pos, dims, base):
    """FLUX-style: each axis rotates its own contiguous block of features, interleaved pairs."""
    out, start = [], 0
    for a, n in enumerate(dims):
        out.append(oracle(x[..., start : start + n], pos[..., a], base=base))
        start += n
    return np.concatenate(out, axis=-1)


def qwen2_oracle(x, pos, sections, base):
    """Qwen2-VL M-RoPE as Hugging Face writes it: cos over the full head_dim per axis, split into
    sections (twice, one per half), section i taken from axis i % 3."""
    d = x.shape[-1]
    freqs = pos[..., None].astype(np.float64) * inv_freq(d, base)  # (..., n_axes, d/2)
    emb = np.concatenate([freqs, freqs], axis=-1)  # (..., n_axes, d)
    bounds = np.cumsum(list(sections) * 2)[:-1]
    parts = np.split(emb, bounds, axis=-1)
    angle = np.concatenate([p[..., i % len(sections), :] for i, p in enumerate(parts)], axis=-1)
    return rotate_pairs64(x, angle[..., : d // 2], "half", d)


def qwen3_oracle(x, pos, sections, base):
    """Qwen3-VL: start from the time axis' frequencies, overwrite every n-th pair from offset a
    with axis a's, up to n * sections[a] pairs."""
    d = x.shape[-1]
    n = len(sections)
    freqs = pos[..., None].astype(np.float64) * inv_freq(d, base)  # (..., n_axes, d/2)
    angle = freqs[..., 0, :].copy()
    for a in range(1, n):
        picked = slice(a, n * sections[a], n)
        angle[..., picked] = freqs[..., a, picked]
    return rotate_pairs64(x, angle, "half", d)
