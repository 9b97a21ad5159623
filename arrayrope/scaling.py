"""Long-context frequency scaling rules.

Each rule is a small immutable object. Given the frequency blocks of a RoPE (features and base of
each run of pairs: one block for 1-D RoPE, one per axis for axial RoPE) it yields the per-pair
frequencies and the attention scaling that multiplies cos and sin.

All arithmetic is float64. Hugging Face transformers computes these frequencies in float32, so
its inv_freq differs from arrayrope's by up to ~6e-8 relative (one float32 rounding); at position
p that is an angle difference of up to p * theta * 6e-8 rad (2e-3 rad at p = 32768, theta = 1),
which is float32's error, not the method's (docs/performance.md shows the consequence).
``RoPE(..., angles="transformers")`` computes them as transformers does instead (``_hf_angles``).

Length-dependent rules (DynamicNTK, LongRoPE) pick their frequencies from the current sequence
length L: by default ``max(pos) + 1`` of each call, as Hugging Face derives it from position ids;
``seq_len=`` on rotate/rotate_qk/cos_sin pins it (an inference engine pins it for a whole KV
cache). Unlike Hugging Face's module, nothing is remembered between calls: the same call always
gets the same frequencies. Each frequency set has its own cos/sin cache; sets never mix.
"""

import math
from dataclasses import dataclass

import numpy as np

from ._docs import filled
from ._errors import RopeTypeError, RopeValueError
from ._spec import coerce as _coerce
from ._spec import length as _length
from ._spec import nonnegative as _nonnegative
from ._spec import optional as _optional
from ._spec import positive as _positive

__all__ = [
    "DynamicNTK", "Linear", "Llama3", "LongRoPE", "NTK", "Proportional", "ScalingRule", "YaRN"
]  # fmt: skip


def plain_inv_freq(dim, base):
    """theta_i = base ** (-2 i / dim) for i < dim / 2, in float64."""
    return base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)


class ScalingRule:
    """Base of the scaling rules: static, one frequency set, attention scaling 1."""

    dynamic = False

    def select(self, seq_len):
        """A key naming the frequency set for current length ``seq_len`` (None: the static set)."""
        return None

    def check(self, blocks):
        """Refuse a RoPE layout the rule cannot serve."""

    def frequencies(self, blocks, key):
        """(inv_freq float64 over every pair, attention scaling) for the set ``key``."""
        inv_freq = np.concatenate([self._block(dim, base, key) for dim, base in blocks])
        return inv_freq, self._attention(key)

    def _block(self, dim, base, key):
        raise NotImplementedError

    def _attention(self, key):
        return 1.0


@filled
@dataclass(frozen=True)
class Linear(ScalingRule):
    """Position interpolation (Chen et al. 2023): every theta_i divided by ``factor``.

    Parameters
    ----------
    factor : float > 0
        The context extension: positions are read as position / factor. Hugging Face's
        ``rope_type: "linear"``.

    Raises
    ------
    {raises of a rule}
    """

    factor: float

    def __post_init__(self):
        _coerce(self, factor=_positive)

    def _block(self, dim, base, key):
        return plain_inv_freq(dim, base) / self.factor


@filled
@dataclass(frozen=True)
class NTK(ScalingRule):
    """Static NTK-aware scaling: the base becomes ``base * factor ** (d / (d - 2))``.

    Parameters
    ----------
    factor : float > 0
        The context extension. Needs at least 4 rotated features per block.

    Raises
    ------
    {raises of a rule}
    """

    factor: float

    def __post_init__(self):
        _coerce(self, factor=_positive)

    def check(self, blocks):
        _no_two_feature_blocks(blocks, "NTK")

    def _block(self, dim, base, key):
        return plain_inv_freq(dim, base * self.factor ** (dim / (dim - 2)))


@filled
@dataclass(frozen=True)
class DynamicNTK(ScalingRule):
    """Dynamic NTK: at current length L > original_max_positions the base becomes
    ``base * (factor * L / orig - (factor - 1)) ** (d / (d - 2))``; plain RoPE up to orig.

    Parameters
    ----------
    factor : float > 0
    original_max_positions : int
        The training context, orig. Hugging Face's ``rope_type: "dynamic"``; L is each call's
        max(pos) + 1 unless ``seq_len`` gives it.

    Raises
    ------
    {raises of a rule}
    """

    factor: float
    original_max_positions: int
    dynamic = True

    def __post_init__(self):
        _coerce(self, factor=_positive, original_max_positions=_length)

    def check(self, blocks):
        _no_two_feature_blocks(blocks, "DynamicNTK")

    def select(self, seq_len):
        if seq_len is None or seq_len <= self.original_max_positions:
            return None
        return int(seq_len)

    def _block(self, dim, base, key):
        if key is None:
            return plain_inv_freq(dim, base)
        growth = self.factor * key / self.original_max_positions - (self.factor - 1)
        return plain_inv_freq(dim, base * growth ** (dim / (dim - 2)))


def _yarn_mscale(scale, mscale=1.0):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@filled
@dataclass(frozen=True)
class YaRN(ScalingRule):
    """YaRN (Peng et al. 2023): interpolated frequencies (theta / factor) for the slow pairs,
    extrapolated (theta) for the fast ones, a linear ramp between over the correction range
    [beta_fast, beta_slow] rotations within original_max_positions.

    Attention factor: ``attention_factor`` if given; else, when both mscale and mscale_all_dim
    are set (DeepSeek), ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``; else
    ``0.1 * ln(factor) + 1`` (1 for factor <= 1).

    Raises
    ------
    {raises of a rule}
    """

    factor: float
    original_max_positions: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        _coerce(
            self,
            factor=_positive,
            original_max_positions=_length,
            beta_fast=_positive,
            beta_slow=_positive,
            mscale=_nonnegative,
            mscale_all_dim=_nonnegative,
            attention_factor=_optional(_positive),
        )
        if not isinstance(self.truncate, (bool, np.bool_)):
            raise RopeTypeError(f"truncate must be a bool, got {self.truncate!r}")

    def check(self, blocks):
        super().check(blocks)
        for _, base in blocks:
            if base == 1:
                raise RopeValueError(
                    "YaRN places its ramp by log(base), which is 0 at base 1: got base 1.0"
                )

    def _block(self, dim, base, key):
        def correction_dim(rotations):
            return (
                dim
                * math.log(self.original_max_positions / (rotations * 2 * math.pi))
                / (2 * math.log(base))
            )

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # the published formula's guard against a zero-width ramp
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
        extrapolated = plain_inv_freq(dim, base)
        interpolated = extrapolated / self.factor
        return interpolated * ramp + extrapolated * (1.0 - ramp)

    def _attention(self, key):
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return _yarn_mscale(self.factor)


@filled
@dataclass(frozen=True)
class Llama3(ScalingRule):
    """Llama 3.1: wavelengths above orig / low_freq_factor are divided by ``factor``, those below
    orig / high_freq_factor kept, and the band between interpolated smoothly.

    Parameters
    ----------
    factor, low_freq_factor, high_freq_factor : float > 0
        As in Llama 3.1's ``rope_scaling`` (8, 1, 4); high_freq_factor >= low_freq_factor.
        Equal factors (Llama 4 Scout's 1, 1) leave no band between: wavelengths above
        orig / low_freq_factor are divided, the rest kept.
    original_max_positions : int
        The training context (8192).

    Raises
    ------
    {raises of a rule}
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_positions: int

    def __post_init__(self):
        _coerce(
            self,
            factor=_positive,
            low_freq_factor=_positive,
            high_freq_factor=_positive,
            original_max_positions=_length,
        )
        if self.high_freq_factor < self.low_freq_factor:
            raise RopeValueError(
                f"high_freq_factor ({self.high_freq_factor}) must be >= low_freq_factor "
                f"({self.low_freq_factor})"
            )

    def _block(self, dim, base, key):
        inv_freq = plain_inv_freq(dim, base)
        orig = self.original_max_positions
        wavelen = 2 * math.pi / inv_freq
        low_wavelen = orig / self.low_freq_factor
        high_wavelen = orig / self.high_freq_factor
        scaled = np.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        if self.high_freq_factor == self.low_freq_factor:  # no band between
            return scaled
        smooth = (orig / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled)


@filled
@dataclass(frozen=True)
class LongRoPE(ScalingRule):
    """LongRoPE (Phi-3): per-pair rescale factors, ``short_factor`` up to original_max_positions
    and ``long_factor`` beyond: theta_i / factor_i.

    Attention factor: ``attention_factor`` if given; else, with ``factor`` (the context
    extension, max_positions / original_max_positions), ``sqrt(1 + ln(factor) / ln(orig))``;
    else 1.

    Raises
    ------
    {raises of a rule}
    """

    short_factor: tuple
    long_factor: tuple
    original_max_positions: int
    factor: float | None = None
    attention_factor: float | None = None
    dynamic = True

    def __post_init__(self):
        for name in ("short_factor", "long_factor"):
            values = getattr(self, name)
            try:
                values = tuple(float(v) for v in values)
            except (TypeError, ValueError):
                raise RopeTypeError(
                    f"{name} must be a sequence of numbers, got {values!r}"
                ) from None
            if not values or not all(math.isfinite(v) and v > 0 for v in values):
                raise RopeValueError(f"{name} must be finite numbers > 0, got {values!r}")
            object.__setattr__(self, name, values)
        if len(self.short_factor) != len(self.long_factor):
            raise RopeValueError(
                f"short_factor and long_factor must have one value per pair, got "
                f"{len(self.short_factor)} and {len(self.long_factor)}"
            )
        _coerce(
            self,
            original_max_positions=_length,
            factor=_optional(_positive),
            attention_factor=_optional(_positive),
        )
        if (
            self.attention_factor is None
            and self.factor is not None
            and self.factor > 1
            and self.original_max_positions < 2
        ):
            raise RopeValueError(
                "LongRoPE's attention factor, sqrt(1 + log(factor) / log(original_max_positions)),"
                " needs original_max_positions > 1 where factor > 1: got 1 (or pass "
                "attention_factor)"
            )

    def check(self, blocks):
        if len(blocks) != 1:
            raise RopeValueError(
                f"LongRoPE scales one run of frequencies (a plain or sectioned RoPE), got an "
                f"axial RoPE with {len(blocks)} axes"
            )
        pairs = blocks[0][0] // 2
        if pairs != len(self.short_factor):
            raise RopeValueError(
                f"LongRoPE needs one factor per rotated pair: this RoPE rotates {pairs} pairs "
                f"(rotary_dim {2 * pairs}), got {len(self.short_factor)} short and long factors"
            )

    def select(self, seq_len):
        return "long" if seq_len is not None and seq_len > self.original_max_positions else "short"

    def _block(self, dim, base, key):
        factors = self.long_factor if key == "long" else self.short_factor
        return plain_inv_freq(dim, base) / np.asarray(factors, dtype=np.float64)

    def _attention(self, key):
        if self.attention_factor is not None:
            return self.attention_factor
        if self.factor is None or self.factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_positions))


@filled
@dataclass(frozen=True)
class Proportional(ScalingRule):
    """Proportional RoPE (Gemma 4's full-attention layers): the first ``fraction`` of the pairs
    turn at ``base ** (-2 i / d)`` over the whole head, the others not at all; every frequency
    is divided by ``factor``.

    Parameters
    ----------
    fraction : float in (0, 1]
        Hugging Face's ``partial_rotary_factor`` of ``rope_type: "proportional"``: the rotated
        pairs are int(fraction * d // 2), paired across the whole head (unlike ``rotary_dim``,
        which narrows the pairs to the rotated features).
    factor : float > 0

    Raises
    ------
    {raises of a rule}
    """

    fraction: float
    factor: float = 1.0

    def __post_init__(self):
        _coerce(self, fraction=_positive, factor=_positive)
        if self.fraction > 1:
            raise RopeValueError(f"fraction must be in (0, 1], got {self.fraction!r}")

    def check(self, blocks):
        if len(blocks) != 1:
            raise RopeValueError(
                f"Proportional scales one run of frequencies, got {len(blocks)} axes"
            )

    def _block(self, dim, base, key):
        inv_freq = plain_inv_freq(dim, base) / self.factor
        inv_freq[int(self.fraction * dim // 2) :] = 0.0
        return inv_freq


def _no_two_feature_blocks(blocks, name):
    for dim, _ in blocks:
        if dim <= 2:
            raise RopeValueError(f"{name} needs at least 4 rotated features per block, got {dim}")
