"""transformers' own cos/sin tables, for ``angles="transformers"``.

arrayrope's tables are the float64 angle m * theta_i, rounded once. transformers computes its
frequencies, the product m * theta_i and cos and sin in float32 (torch's), so its tables differ
from those by float32's error, which grows with the position. A model's logits can only be
matched bit for bit with its own tables, so this mode makes them as transformers does: each
rule's frequencies by the torch float32 expressions of ``transformers.modeling_rope_utils``,
float32(m) * theta_i in float32, torch's float32 cos and sin on the CPU, times the attention
scaling in float32. Every row comes from torch, at any position (there are no level tables
in this mode), so it needs torch installed.
"""

import math

import numpy as np

from . import scaling as sc
from ._errors import BackendUnavailableError
from ._positions import LIMIT
from ._tables import CosSinTables


def torch_or_error():
    """torch, imported; a BackendUnavailableError naming the mode where it is missing."""
    try:
        import torch
    except ImportError:
        raise BackendUnavailableError(
            "angles='transformers' makes transformers' tables with torch's float32 arithmetic: "
            "pip install torch"
        ) from None
    return torch


def frequencies(blocks, scaling, key):
    """(inv_freq float32 over every pair, attention scaling): :meth:`ScalingRule.frequencies`
    as transformers computes each rule."""
    torch = torch_or_error()
    parts = [_block(torch, scaling, dim, base, key) for dim, base in blocks]
    scale = 1.0 if scaling is None else scaling._attention(key)
    return torch.cat(parts).numpy(), scale


def _exponents(torch, dim, stop=None):
    """2i / dim for the pairs i below stop / 2 (all of dim's), in float32, as transformers."""
    return torch.arange(0, dim if stop is None else stop, 2, dtype=torch.int64).float() / dim


def _plain(torch, dim, base):
    return 1.0 / (base ** _exponents(torch, dim))


def _block(torch, rule, dim, base, key):
    """One block's frequencies, written as transformers writes each rule (the same order of
    float32 operations: their results are what is compared, bit for bit)."""
    if rule is None or isinstance(rule, sc.DynamicNTK) and key is None:
        return _plain(torch, dim, base)
    if isinstance(rule, sc.Linear):
        return _plain(torch, dim, base) / rule.factor
    if isinstance(rule, sc.NTK):  # not a transformers rule: its base, then the default
        return _plain(torch, dim, base * rule.factor ** (dim / (dim - 2)))
    if isinstance(rule, sc.DynamicNTK):
        # transformers grows the base with a tensor of the length: float32 from there on
        length = torch.tensor(key)
        factor, orig = rule.factor, rule.original_max_positions
        grown = base * ((factor * length / orig) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (grown ** _exponents(torch, dim))
    if isinstance(rule, sc.YaRN):
        return _yarn(torch, rule, dim, base)
    if isinstance(rule, sc.Llama3):
        return _llama3(torch, rule, dim, base)
    if isinstance(rule, sc.LongRoPE):
        factors = rule.long_factor if key == "long" else rule.short_factor
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base ** _exponents(torch, dim))
    if isinstance(rule, sc.Proportional):
        rotated = int(rule.fraction * dim // 2)
        inv_freq = 1.0 / (base ** _exponents(torch, dim, 2 * rotated))
        inv_freq = torch.cat((inv_freq, torch.zeros(dim // 2 - rotated, dtype=torch.float32)))
        return inv_freq / rule.factor
    raise AssertionError(f"arrayrope: no transformers form of {rule!r}")  # every rule is above


def _yarn(torch, rule, dim, base):
    def correction_dim(rotations):
        return (dim * math.log(rule.original_max_positions / (rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(rule.beta_fast), correction_dim(rule.beta_slow)
    if rule.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** _exponents(torch, dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (rule.factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp
    return interpolated * (1 - kept) + extrapolated * kept


def _llama3(torch, rule, dim, base):
    inv_freq = _plain(torch, dim, base)
    orig, factor = rule.original_max_positions, rule.factor
    low, high = rule.low_freq_factor, rule.high_freq_factor
    low_wavelen, high_wavelen = orig / low, orig / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (orig / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class HFTables(CosSinTables):
    """:class:`CosSinTables` whose every row is transformers': ``inv_freq`` is float32 (held
    as float64, exactly), and rows come from :func:`rows` at any position. ``filled`` is
    False: no kernel may make rows from level tables for these."""

    filled = False
    _float32 = None  # inv_freq as the float32 tensor the rows multiply, made on first use

    def integer_rows(self, dtype, positions):
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and not (positions.min() >= 0 and positions.max() < LIMIT):
            return None
        return self._rows(dtype, positions[:, self.pair_axis])

    def _column(self, dtype, first, rows):
        return self._rows(dtype, np.arange(first, first + rows, dtype=np.int64)[:, None])

    def _row_maker(self, dtype):
        return lambda m: self._rows(dtype, np.array([[m]], dtype=np.int64))

    def at_least(self, xp, device, dtype, rows):
        # for positions the host does not read: the plan reads these tables' positions
        raise AssertionError("arrayrope: transformers' tables take positions read on the host")

    def exact(self, xp, dtype, positions):
        host = positions if xp is np else positions.get()
        rows = self._rows(dtype, np.asarray(host, dtype=np.float64)[:, self.pair_axis])
        return rows if xp is np else xp.asarray(rows)

    def level_arrays(self):
        raise AssertionError("arrayrope: transformers' tables have no level tables")

    def level_bytes(self):
        return 0

    def _rows(self, dtype, positions):
        """cos and sin stacked, (2, R, n_pairs) of ``dtype``, at ``positions`` of shape
        (R, n_pairs) or (R, 1), each pair's own: transformers' float32 values."""
        torch = torch_or_error()
        inv_freq = self._float32
        if inv_freq is None:  # (two threads may both make it: alike)
            inv_freq = self._float32 = torch.from_numpy(self.inv_freq.astype(np.float32))
        angles = torch.from_numpy(np.ascontiguousarray(positions)).float() * inv_freq
        out = torch.stack((angles.cos(), angles.sin()))
        if self.scale != 1.0:
            out = out * self.scale
        return out.numpy().astype(dtype)
