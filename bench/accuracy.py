"""Accuracy of a float32 rotation at large positions, against the float64 rotation.

For positions 10^3 ... 10^7 it prints the largest error of arrayrope's float32 rotation (angles in
float64, cos/sin rounded once to float32) and of the common float32-angle formula (inv_freq * pos
in float32, then cos/sin in float32, as most framework implementations compute them), in float32
ulps of the inputs' magnitude and in absolute terms.

    python bench/accuracy.py
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import arrayrope as ar  # noqa: E402


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


def main():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 128)).astype(np.float32)
    inv_freq = 10000.0 ** (-np.arange(0, 128, 2) / 128)
    ulp = float(np.spacing(np.float32(np.abs(x).max())))
    print("float32 rotation error against float64, head_dim 128, base 10000, 256 vectors")
    print(f"(one float32 ulp of the largest |x| = {ulp:.3g})\n")
    print(
        "| position | arrayrope max error | in ulps | float32-angle formula max error | in ulps |"
    )
    print("|---:|---:|---:|---:|---:|")
    for pos in (10**3, 10**5, 10**6, 10**7):
        exact = float64_rotation(x, pos, inv_freq)
        ours = np.abs(ar.rotate(x, pos).astype(np.float64) - exact).max()
        common = np.abs(float32_angle_rotation(x, pos, inv_freq).astype(np.float64) - exact).max()
        print(f"| {pos:,} | {ours:.3g} | {ours / ulp:.2f} | {common:.3g} | {common / ulp:.0f} |")


if __name__ == "__main__":
    main()
